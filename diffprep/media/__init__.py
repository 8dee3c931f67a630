"""Media preparation for clips: probing and decoding video with PyAV, resolution buckets."""

from diffprep.media.buckets import Bucket, choose_bucket, parse_buckets
from diffprep.media.video import ClipInfo, PreparedClip, prepare_clip, prepare_image_clip, probe

__all__ = ["Bucket", "ClipInfo", "PreparedClip", "choose_bucket", "parse_buckets", "prepare_clip",
           "prepare_image_clip", "probe"]  # fmt: skip
