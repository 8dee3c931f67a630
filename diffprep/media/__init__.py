"""Media preparation for clips: probing and decoding video with PyAV, resolution buckets."""

from diffprep.media.buckets import Bucket, choose_bucket, parse_buckets

__all__ = ["Bucket", "choose_bucket", "parse_buckets"]
