"""Resolution buckets for clips: ``WxHxF`` sizes, parsed from the LTX trainer's syntax, and the choice of one.

``--resolution-buckets "832x480x81;480x832x81;512x512x1"`` lists the output
sizes a run may produce. Each must fit the model family's VAE: W and H
multiples of its spatial factor, F a frame count the temporal factor accepts
(``F = t*k + 1``: Wan ``4k+1``, LTX ``8k+1``). A bad entry is refused with
the nearest valid values, never rounded silently.

A clip goes to the bucket with the smallest ``|log(aspect) - log(bucket
aspect)|`` among the buckets with ``F <= its frames``; ties go to the most
frames, then the largest area, then the earlier bucket in the list. This is
the LTX trainer's rule (``process_dataset.py``), so the same clips land in the
same buckets.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from diffprep.errors import ConfigError, RejectError

__all__ = ["Bucket", "auto_image_buckets", "choose_bucket", "cover_box", "nearest_frame_counts", "nearest_multiples",
           "parse_bucket", "parse_buckets", "parse_image_buckets"]


@dataclass(frozen=True, order=True)
class Bucket:
    """One output size: ``width`` x ``height`` pixels, ``frames`` frames (1 for images)."""

    width: int
    height: int
    frames: int

    def __str__(self) -> str:
        return f"{self.width}x{self.height}x{self.frames}"

    @property
    def aspect(self) -> float:
        return self.width / self.height

    @property
    def area(self) -> int:
        return self.width * self.height


def parse_bucket(name: str) -> Bucket:
    """A bucket's own name (``str(bucket)``, as plan.json records it) back to the bucket."""
    width, height, frames = (int(part) for part in name.split("x"))
    return Bucket(width, height, frames)


def nearest_frame_counts(frames: int, temporal_factor: int) -> list[int]:
    """The valid frame counts (``t*k + 1``, at least 1) nearest to ``frames``: one below and one above."""
    below = frames - (frames - 1) % temporal_factor
    candidates = [below, below + temporal_factor]
    return [count for count in candidates if count >= 1] or [1]


def nearest_multiples(value: int, factor: int) -> list[int]:
    """The positive multiples of ``factor`` nearest to ``value``: one below (if positive) and one above."""
    below = value // factor * factor
    return [m for m in (below, below + factor) if m >= factor]


def parse_buckets(spec: str, spatial_factor: int, temporal_factor: int, *, why: str | None = None) -> list[Bucket]:
    """``"WxHxF;WxHxF..."`` -> buckets, in the order given.

    Raises :class:`~diffprep.errors.ConfigError` naming the entry, what is
    wrong and the nearest valid values. Blank entries (a trailing ``;``) are
    ignored; duplicates are refused. ``why``: what sets ``spatial_factor``
    (default: the VAE's spatial factor).
    """
    if spatial_factor < 1 or temporal_factor < 1:
        raise ValueError(
            f"spatial_factor and temporal_factor must be >= 1, got {spatial_factor} and {temporal_factor}"
        )
    entries = [entry.strip() for entry in spec.split(";")]
    reason = why or "the VAE's spatial factor"
    buckets: list[Bucket] = []
    for entry in entries:
        if not entry:
            continue
        parts = entry.lower().split("x")
        if len(parts) != 3 or not all(part.strip().isdigit() for part in parts):
            raise ConfigError(
                f"resolution bucket {entry!r} is not WxHxF (three positive integers, e.g. 832x480x81); "
                f"buckets are separated by ';'"
            )
        width, height, frames = (int(part) for part in parts)
        problems = []
        for name, value in (("width", width), ("height", height)):
            if value < spatial_factor or value % spatial_factor:
                nearest = " or ".join(str(m) for m in nearest_multiples(value, spatial_factor))
                problems.append(
                    f"{name} {value} is not a multiple of {spatial_factor} ({reason}); "
                    f"nearest: {nearest}"
                )
        if frames < 1 and temporal_factor == 1:
            problems.append(f"{frames} frames: a bucket needs at least 1 frame")
        elif frames < 1 or (frames - 1) % temporal_factor:
            nearest = " or ".join(str(n) for n in nearest_frame_counts(max(frames, 1), temporal_factor))
            problems.append(
                f"{frames} frames is not {temporal_factor}k+1 (the VAE's temporal factor is {temporal_factor}); "
                f"nearest: {nearest}"
            )
        if problems:
            raise ConfigError(f"resolution bucket {entry!r}: " + "; ".join(problems))
        bucket = Bucket(width, height, frames)
        if bucket in buckets:
            raise ConfigError(f"resolution bucket {entry!r} is listed twice; list each bucket once")
        buckets.append(bucket)
    if not buckets:
        raise ConfigError(f"resolution buckets {spec!r} lists no bucket; give at least one WxHxF, e.g. 832x480x81")
    return buckets


def choose_bucket(width: int, height: int, frames: int, buckets: Sequence[Bucket]) -> Bucket:
    """The bucket for a ``width`` x ``height`` clip of ``frames`` frames (an image: ``frames=1``).

    Raises :class:`~diffprep.errors.RejectError` ``too_few_frames`` when the
    clip is shorter than every bucket.
    """
    if width < 1 or height < 1:
        raise ValueError(f"clip size must be at least 1x1, got {width}x{height}")
    if not buckets:
        raise ValueError("choose_bucket: buckets is empty")
    eligible = [bucket for bucket in buckets if bucket.frames <= frames]
    if not eligible:
        shortest = min(buckets, key=lambda b: b.frames)
        what = "an image (1 frame): add a bucket with F = 1" if frames == 1 else f"a clip of {frames} frames"
        raise RejectError(
            "too_few_frames",
            f"{what} is shorter than every bucket; the shortest is {shortest} ({shortest.frames} frames)",
        )
    log_aspect = math.log(width / height)
    # min() keeps the first of equal keys: the earlier bucket in the list wins a full tie.
    return min(eligible, key=lambda b: (abs(log_aspect - math.log(b.aspect)), -b.frames, -b.area))


def cover_box(width: int, height: int, bucket: Bucket) -> tuple[int, int, int, int]:
    """The centred box (left, top, right, bottom) of ``bucket``'s aspect ratio in a ``width`` x ``height``
    frame: resizing it to the bucket size is resize-to-cover then centre crop. Integer arithmetic only."""
    if width * bucket.height > height * bucket.width:  # wider than the bucket: crop left and right
        box_w, box_h = max(1, (2 * height * bucket.width + bucket.height) // (2 * bucket.height)), height
    else:
        box_w, box_h = width, max(1, (2 * width * bucket.height + bucket.width) // (2 * bucket.width))
    left, top = (width - box_w) // 2, (height - box_h) // 2
    return (left, top, left + box_w, top + box_h)


# --- images: aspect-ratio buckets at one area ---------------------------------------------------------

AUTO_ASPECTS = 41  # aspect ratios 4**(k/20), k = -20..20: from 1:4 to 4:1, evenly spaced in log scale


def auto_image_buckets(image_size: int, multiple: int = 16) -> list[Bucket]:
    """About 40 image buckets of area ``image_size``², aspect ratios from 1:4 to 4:1 evenly spaced in log
    scale (as PixArt and SimpleTuner bin images), sides multiples of ``multiple``, in order of aspect."""
    area = image_size * image_size
    buckets: list[Bucket] = []
    half = AUTO_ASPECTS // 2
    for k in range(-half, half + 1):
        ratio = 4 ** (k / half)
        width = max(multiple, round(math.sqrt(area * ratio) / multiple) * multiple)
        height = max(multiple, round(math.sqrt(area / ratio) / multiple) * multiple)
        bucket = Bucket(width, height, 1)
        if bucket not in buckets:
            buckets.append(bucket)
    return buckets


def parse_image_buckets(spec: str, image_size: int, multiple: int = 16) -> list[Bucket]:
    """``auto`` or ``"WxH,WxH..."`` -> one-frame buckets; sides must be multiples of ``multiple``."""
    if spec.strip().lower() == "auto":
        return auto_image_buckets(image_size, multiple)
    buckets: list[Bucket] = []
    for entry in (e.strip() for e in spec.split(",")):
        if not entry:
            continue
        parts = entry.lower().split("x")
        if len(parts) != 2 or not all(part.strip().isdigit() for part in parts):
            raise ConfigError(f"image bucket {entry!r} is not WxH (e.g. 1152x896); buckets are separated by ','")
        width, height = (int(part) for part in parts)
        for name, value in (("width", width), ("height", height)):
            if value < multiple or value % multiple:
                nearest = " or ".join(str(m) for m in nearest_multiples(value, multiple))
                raise ConfigError(f"image bucket {entry!r}: {name} {value} is not a multiple of {multiple}; "
                                  f"nearest: {nearest}")
        bucket = Bucket(width, height, 1)
        if bucket in buckets:
            raise ConfigError(f"image bucket {entry!r} is listed twice; list each bucket once")
        buckets.append(bucket)
    if not buckets:
        raise ConfigError(f"image buckets {spec!r} list no bucket; give 'auto' or WxH sizes, e.g. 1024x1024,1152x896")
    return buckets
