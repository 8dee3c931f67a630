"""A sample's bytes -> what a captioner looks at: one RGB image, or a clip's frames sampled as the peers do.

The curation peers (Cosmos-Curate, NeMo Curator) caption a clip from frames
sampled at ``fps`` (2 by default) and capped at ``max_frames`` (256); here:

1. A file Pillow recognizes is an image: decoded as :mod:`diffprep.media.images`
   does (EXIF orientation, alpha over white, 16-bit and float modes), never
   resized (the model's processor sizes it).
2. Anything else is a clip, read by :mod:`diffprep.media.video`: resampled to
   ``fps`` (frame ``k`` is the one on screen at ``k / fps``), and when that
   gives more than ``max_frames``, ``max_frames`` of them evenly spread from
   the first to the last. The frames' rate is ``fps`` lowered by the spreading
   (``playback_fps``), so the model is told the real time between them.
   Frames larger than :data:`MAX_FRAME_PIXELS` are scaled down (aspect kept) as
   they are decoded: a 4K clip's 256 frames are never held at full size, and
   the processors resize videos below that anyway.

Bad media is a :class:`~diffprep.errors.RejectError` with the decoders' own
reasons (``empty_file``, ``image_truncated``, ``video_decode_error``,
``video_truncated``...), never an exception of another kind.
"""

from __future__ import annotations

import io
import math
import os
from fractions import Fraction
from pathlib import Path

from PIL import Image, UnidentifiedImageError

from diffprep.captions.models import CaptionInput
from diffprep.errors import ConfigError, RejectError

__all__ = ["MAX_FRAME_PIXELS", "caption_input", "is_image"]

# Qwen2-VL's video processor caps a frame at 768 tokens' worth of pixels (28 * 28 * 768); a frame decoded larger is
# only made smaller again there, so clips are decoded at most this size.
MAX_FRAME_PIXELS = 28 * 28 * 768


def caption_input(key: str, path_or_bytes: bytes | str | os.PathLike, *, fps: float, max_frames: int
                  ) -> CaptionInput:
    """The :class:`CaptionInput` of one sample (an image file or a clip, as bytes or a path)."""
    if not fps > 0:
        raise ConfigError(f"captions fps must be > 0, got {fps}")
    if max_frames < 1:
        raise ConfigError(f"captions max_frames must be >= 1, got {max_frames}")
    data = path_or_bytes if isinstance(path_or_bytes, (bytes, bytearray, memoryview)) else None
    if data is not None and len(data) == 0:
        raise RejectError("empty_file", "the file is 0 bytes", phase="decode")
    if is_image(path_or_bytes):
        from diffprep.media.images import ImageSpec, decode_rgb

        raw = bytes(data) if data is not None else Path(path_or_bytes).read_bytes()
        rgb, _notes = decode_rgb(raw, ImageSpec())
        return CaptionInput(key=key, frames=[rgb], fps=None)
    return _clip_input(key, path_or_bytes, fps=fps, max_frames=max_frames)


def is_image(path_or_bytes: bytes | str | os.PathLike) -> bool:
    """Whether Pillow recognizes the file (its header alone is read)."""
    source = io.BytesIO(bytes(path_or_bytes)) if isinstance(path_or_bytes, (bytes, bytearray, memoryview)) \
        else Path(path_or_bytes)
    try:
        with Image.open(source):
            return True
    except Image.DecompressionBombError:
        return True  # an image too large to open: the image path names it (image_too_large)
    except (UnidentifiedImageError, OSError, ValueError):
        # Not an image Pillow knows; a file named as one goes to the image path, which names what is wrong with it.
        return isinstance(source, Path) and source.suffix.lower() in (".jpg", ".jpeg", ".png", ".webp")


def _clip_input(key: str, source: bytes | str | os.PathLike, *, fps: float, max_frames: int) -> CaptionInput:
    from diffprep.media.buckets import Bucket
    from diffprep.media.video import prepare_clip, probe

    if not isinstance(source, (bytes, bytearray, memoryview)):
        path = Path(source)
        if path.stat().st_size == 0:
            raise RejectError("empty_file", f"{path.name} is 0 bytes", phase="decode")
    info = probe(source)
    # As media.video resamples: frame k is the one on screen at k / fps, for every k / fps before the clip ends.
    available = math.ceil(info.end_time * Fraction(str(fps))) if info.frames else 0
    if available < 1:
        raise RejectError("too_few_frames", "the clip has no frame to caption", phase="decode")
    frames = min(available, max_frames)
    width, height = _frame_size(info.width, info.height)
    clip = prepare_clip(source, [Bucket(width, height, frames)], target_fps=fps, frame_sampling="uniform")
    images = [Image.fromarray(frame.permute(1, 2, 0).numpy(), mode="RGB") for frame in clip.pixels]
    return CaptionInput(key=key, frames=images, fps=clip.meta["fps"] or float(fps))


def _frame_size(width: int, height: int) -> tuple[int, int]:
    """The clip's display size, scaled down (aspect kept) to at most :data:`MAX_FRAME_PIXELS`."""
    if width * height <= MAX_FRAME_PIXELS:
        return width, height
    scale = math.sqrt(MAX_FRAME_PIXELS / (width * height))
    return max(1, math.floor(width * scale)), max(1, math.floor(height * scale))
