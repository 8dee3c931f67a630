"""A run's units: read into batches, checked (sanity), encoded and written, finalized; devices, ranks, threads."""
