"""The raw pipeline: prepared images stored as image files with their captions, for encoding at training time.

Everything but the encoders is the pre-encoded pipeline's: the same sources,
image sizing (``images.prepare_image``: EXIF, every mode to RGB with alpha
composited, crop/resize), units, atomic shards and manifests, audit, finalize
(subflavor ``encoding: raw``) and validation. A sample holds

- ``jpg`` | ``png`` | ``webp``: the prepared pixels, written again in that format;
- ``txt``: the caption, UTF-8;
- ``meta.json``: source id, original size, crop box, output size, conversions.

The image files carry no metadata (no EXIF, ICC profile or timestamp) and are
written with fixed encoder options, so the same pixels and settings give the
same bytes, and so the same shards.
"""

from __future__ import annotations

import io
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
from PIL import Image

from diffprep import contract
from diffprep.decode import file_pixels
from diffprep.encode import (
    TAR_MEMBER_OVERHEAD,
    Batch,
    SanityReport,
    _peak_memory,
    check_round_trip,
    finish_sanity,
    first_batch,
    project_run,
)
from diffprep.errors import ConfigError
from diffprep.images import ImageSpec
from diffprep.plan import Plan
from diffprep.shards import Reject, field_bytes
from diffprep.sources import Source

# Field name in the shard -> Pillow format.
IMAGE_FORMATS = {"jpg": "JPEG", "png": "PNG", "webp": "WEBP"}
BATCH_SIZE = 16  # samples prepared per batch; only groups the work, any value gives the same bytes


def raw_fields(image_format: str) -> list[str]:
    """The fields every sample of a raw dataset has (plan.json's ``expected["fields"]``)."""
    if image_format not in IMAGE_FORMATS:
        raise ConfigError(f"raw.image_format must be one of {list(IMAGE_FORMATS)}, got {image_format!r}")
    return sorted([image_format, contract.RAW_CAPTION, contract.META])


def image_bytes(pixels: torch.Tensor, image_format: str, quality: int) -> bytes:
    """uint8 RGB [3, H, W] -> an image file without metadata; same pixels and options, same bytes."""
    if image_format not in IMAGE_FORMATS:
        raise ConfigError(f"raw.image_format must be one of {list(IMAGE_FORMATS)}, got {image_format!r}")
    if not 1 <= quality <= 100:
        raise ConfigError(f"raw.image_quality must be in 1..100, got {quality}")
    image = Image.fromarray(np.ascontiguousarray(pixels.permute(1, 2, 0).numpy()), "RGB")
    buffer = io.BytesIO()
    # Every option that shapes the bytes is spelled out rather than left to Pillow's defaults.
    if image_format == "jpg":
        image.save(buffer, format="JPEG", quality=quality, subsampling="4:2:0", optimize=False, progressive=False)
    elif image_format == "webp":
        image.save(buffer, format="WEBP", quality=quality, method=4, lossless=False, exact=False)
    else:
        image.save(buffer, format="PNG", compress_level=6, optimize=False)
    return buffer.getvalue()


@dataclass(frozen=True)
class RawImageWriter:
    """The raw pipeline's stand-in for the encoders: a batch of prepared pixels -> image files and captions."""

    image_format: str
    quality: int

    def __post_init__(self) -> None:
        raw_fields(self.image_format)  # refuses an unknown format before any sample is read

    def sample_fields(self, batch: Batch, notes: Counter) -> list[dict | Reject]:
        """``encode.SampleFields`` for ``encode_unit``: one dict of fields per sample of ``batch``."""
        return [
            {
                self.image_format: image_bytes(batch.pixels[i], self.image_format, self.quality),
                contract.RAW_CAPTION: batch.captions[i],
                contract.META: batch.metas[i],
            }
            for i in range(len(batch.keys))
        ]


def raw_sanity_check(
    out_dir: str | Path,
    plan: Plan,
    writer: RawImageWriter,
    source: Source,
    spec: ImageSpec,
    *,
    units_left: Sequence[int] | None = None,
    staged_samples: int | None = None,
) -> SanityReport:
    """Write one batch's image files into memory, project the run's size and time, compare them with the pixels.

    The PSNR of the stored files against the prepared pixels is the format's
    loss (None for png: identical); it is reported, not checked. Raises
    DiskSpaceError before any shard is written when the projection does not fit (``staged_samples``: as
    in ``diffprep.encode.sanity_check``).
    """
    sanity_dir = Path(out_dir) / contract.STATE_DIR / contract.SANITY_DIR
    sanity_dir.mkdir(parents=True, exist_ok=True)
    batch = first_batch(plan, source, spec, BATCH_SIZE)
    start = time.perf_counter()
    samples = writer.sample_fields(batch, Counter())
    seconds = time.perf_counter() - start
    stored = torch.stack([file_pixels(sample[writer.image_format]) for sample in samples])
    psnrs, sheet, _ = check_round_trip(sanity_dir, batch, stored, min_psnr=0.0)
    sizes = [sum(len(field_bytes(value)) for value in sample.values()) for sample in samples]
    per_sample = round(sum(sizes) / len(sizes)) + TAR_MEMBER_OVERHEAD * len(samples[0])
    remaining, projected_seconds, free = project_run(out_dir, plan, units_left, seconds, len(samples), 1)
    shape = list(batch.pixels.shape[1:])
    report = SanityReport(
        ok=True,
        samples=len(samples),
        shapes={writer.image_format: shape},
        dtypes={writer.image_format: "uint8"},
        finite=True,
        psnr_db=psnrs,
        seconds_per_batch=round(seconds, 4),
        peak_memory_bytes=_peak_memory(torch.device("cpu")),
        bytes_per_sample=per_sample,
        projected_bytes=per_sample * remaining,
        projected_seconds=round(projected_seconds, 1),
        free_bytes=free,
        contact_sheet=str(sheet),
        local_bytes=None if staged_samples is None else per_sample * min(remaining, staged_samples),
    )
    return finish_sanity(out_dir, report, remaining)
