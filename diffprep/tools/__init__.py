"""Separate commands beside encode: t2i (pack, verify, mirror), ingest, the demo datasets."""
