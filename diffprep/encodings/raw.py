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
from collections.abc import Mapping
from typing import Any, Sequence

import numpy as np
import torch
from PIL import Image

from diffprep import contract
from diffprep.report.checks import Check, Findings
from diffprep.config import Settings
from diffprep.encodings.base import Encoding, SampleFields
from diffprep.writer.layouts import LayoutPreset
from diffprep.errors import ConfigError, DatasetValidationError
from diffprep.media.images import ImageSpec
from diffprep.report.pictures import file_pixels
from diffprep.output import Output, as_output
from diffprep.writer.plan import Plan
from diffprep.run.reader import Batch, first_batch
from diffprep.run.sanity import TAR_MEMBER_OVERHEAD, SanityReport, check_round_trip, finish_sanity, peak_memory, project_run
from diffprep.writer.shards import Reject, field_bytes
from diffprep.sources import Source

# Field name in the shard -> Pillow format.
IMAGE_FORMATS = {"jpg": "JPEG", "png": "PNG", "webp": "WEBP"}
PNG_LEVEL = 6  # zlib level of a png run's files; an edm-zip run writes EDM's (0: stored)
BATCH_SIZE = 16  # samples prepared per batch; only groups the work, any value gives the same bytes


def raw_fields(image_format: str) -> list[str]:
    """The fields every sample of a raw dataset has (plan.json's ``expected["fields"]``)."""
    if image_format not in IMAGE_FORMATS:
        raise ConfigError(f"raw.image_format must be one of {list(IMAGE_FORMATS)}, got {image_format!r}")
    return sorted([image_format, contract.RAW_CAPTION, contract.META])


def image_bytes(pixels: torch.Tensor, image_format: str, quality: int, png_level: int = PNG_LEVEL) -> bytes:
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
        image.save(buffer, format="PNG", compress_level=png_level, optimize=False)
    return buffer.getvalue()


@dataclass(frozen=True)
class RawImageWriter:
    """The raw pipeline's stand-in for the encoders: a batch of prepared pixels -> image files and captions."""

    image_format: str
    quality: int
    png_level: int = PNG_LEVEL

    def __post_init__(self) -> None:
        raw_fields(self.image_format)  # refuses an unknown format before any sample is read

    def sample_fields(self, batch: Batch, notes: Counter) -> list[dict | Reject]:
        """``SampleFields`` for ``encode_unit``: one dict of fields per sample of ``batch``."""
        return [
            {
                self.image_format: image_bytes(batch.pixels[i], self.image_format, self.quality, self.png_level),
                contract.RAW_CAPTION: batch.captions[i],
                contract.META: batch.metas[i],
            }
            for i in range(len(batch.keys))
        ]


def raw_sanity_check(
    output: Output | str,
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
    in ``diffprep.encodings.preencoded.sanity_check``).
    """
    output = as_output(output)
    batch = first_batch(plan, source, spec, BATCH_SIZE)
    start = time.perf_counter()
    samples = writer.sample_fields(batch, Counter())
    seconds = time.perf_counter() - start
    stored = torch.stack([file_pixels(sample[writer.image_format]) for sample in samples])
    psnrs, sheet, _ = check_round_trip(output, batch, stored, min_psnr=0.0)
    sizes = [sum(len(field_bytes(value)) for value in sample.values()) for sample in samples]
    per_sample = round(sum(sizes) / len(sizes)) + TAR_MEMBER_OVERHEAD * len(samples[0])
    remaining, projected_seconds, free = project_run(output, plan, units_left, seconds, len(samples), 1)
    shape = list(batch.pixels.shape[1:])
    report = SanityReport(
        ok=True,
        samples=len(samples),
        shapes={writer.image_format: shape},
        dtypes={writer.image_format: "uint8"},
        finite=True,
        psnr_db=psnrs,
        seconds_per_batch=round(seconds, 4),
        peak_memory_bytes=peak_memory(torch.device("cpu")),
        bytes_per_sample=per_sample,
        projected_bytes=per_sample * remaining,
        projected_seconds=round(projected_seconds, 1),
        free_bytes=free,
        contact_sheet=str(sheet),
        local_bytes=None if staged_samples is None else per_sample * min(remaining, staged_samples),
    )
    return finish_sanity(output, report, remaining)


def stored_image(key: str, fields: Mapping[str, bytes]) -> torch.Tensor:
    """The image file of a raw sample as uint8 RGB [3, H, W] (decoded as stored, not resized)."""
    names = [name for name in contract.RAW_IMAGE_FIELDS if name in fields]
    if len(names) != 1:
        raise DatasetValidationError(
            f"sample {key} must hold one image field of {list(contract.RAW_IMAGE_FIELDS)}, it has {sorted(fields)}"
        )
    return file_pixels(fields[names[0]])


def image_writer(settings: Settings) -> RawImageWriter:
    from diffprep.encodings.edm_zip import PNG_COMPRESS_LEVEL

    edm = settings.output.layout == contract.LAYOUT_EDM_ZIP
    return RawImageWriter(settings.raw.image_format, settings.raw.image_quality,
                          PNG_COMPRESS_LEVEL if edm else PNG_LEVEL)


class Raw(Encoding):
    """Prepared images stored as image files with their captions; nothing is encoded."""

    name = contract.ENCODING_RAW
    # Image files keep their names (jpg/png/webp, txt, meta.json); edm-zip assembles EDM's archive from them.
    layout_presets = {contract.LAYOUT_EDM_ZIP: LayoutPreset(members={})}

    def plan_settings(self, settings: Settings, token: str | None) -> tuple[dict[str, Any], dict[str, Any]]:
        if settings.video.target_fps is not None:
            raise ConfigError("--target-fps applies to clips: give --resolution-buckets \"WxHxF;...\" to store clips")
        output = settings.output
        if output.key_map or output.layout not in (contract.LAYOUT_ENERGON, contract.LAYOUT_EDM_ZIP):
            raise ConfigError(f"the raw encoding keeps its member names "
                              f"({', '.join(raw_fields(settings.raw.image_format))}): remove --layout {output.layout} / "
                              f"--key-map (output.layout, output.key_map); its one other layout is edm-zip")
        edm = settings.output.layout == contract.LAYOUT_EDM_ZIP
        if edm:
            from diffprep.encodings.edm_zip import check_settings

            check_settings(settings)
        raw = settings.raw
        # png is lossless: its quality setting changes no byte.
        quality = None if raw.image_format == "png" else raw.image_quality
        identity = {"raw": {"image_format": raw.image_format, "image_quality": quality}}
        if edm:  # only then: other raw plans keep their fingerprint
            from diffprep.encodings.edm_zip import PNG_COMPRESS_LEVEL, class_count

            identity["raw"]["png_compress_level"] = PNG_COMPRESS_LEVEL
            identity |= class_count(settings)
        return self.byte_settings(settings, identity), {"fields": raw_fields(raw.image_format)}

    def required_fields(self, expected: dict[str, Any]) -> tuple[str, ...]:
        return tuple(expected["fields"])

    def field_problem(self, fields: Sequence[str], expected: dict[str, Any] | None) -> str:
        problem = super().field_problem(fields, expected)
        if problem:
            return problem
        images = [name for name in fields if name in contract.RAW_IMAGE_FIELDS]
        if len(images) != 1 or contract.RAW_CAPTION not in fields:
            return (f"needs one image field of {list(contract.RAW_IMAGE_FIELDS)} and {contract.RAW_CAPTION!r}, "
                    f"has {sorted(fields)}")
        return ""

    def load(self, settings: Settings, token: str | None) -> RawImageWriter:
        return image_writer(settings)

    def own_folders(self, plan: Plan | None) -> Any:
        from diffprep.encodings import edm_zip

        return edm_zip if edm_zip.is_edm_zip(plan) else None

    def sample_fields(self, settings: Settings, loaded: RawImageWriter) -> SampleFields:
        return loaded.sample_fields

    def batch_size(self, settings: Settings) -> int:
        return BATCH_SIZE

    def sanity(self, output: Output, plan: Plan, loaded: RawImageWriter, source: Source, spec: ImageSpec, *,
               settings: Settings, batch_size: int, units_left: Sequence[int] | None, workers: int,
               staged_samples: int | None) -> SanityReport:
        return raw_sanity_check(output, plan, loaded, source, spec, units_left=units_left,
                                staged_samples=staged_samples)

    def oom_advice(self, settings: Settings, loaded: RawImageWriter) -> str:
        return f"lower --image-size (now {settings.image.image_size})"

    def holds(self, fields: Mapping[str, bytes]) -> bool:
        return any(name in fields for name in contract.RAW_IMAGE_FIELDS)

    def decode_stored(self, stored: Sequence[Any], plan: Plan | None, **options: Any
                      ) -> tuple[list[torch.Tensor], str | None]:
        """The stored image files as they are (no model)."""
        return [stored_image(sample.key, sample.fields) for sample in stored], None

    def task_encoder(self) -> Any:
        from diffprep.writer.cooker import FluxRawTaskEncoder  # Energon: finalize and validation only

        return FluxRawTaskEncoder()

    def inspector(self, expected: dict[str, Any] | None) -> RawInspector:
        return RawInspector()


class RawInspector:
    """Validation of loaded raw samples: every stored image decodes; counts per format and mode."""

    def __init__(self) -> None:
        self.decode = Findings("images")
        self.images: dict[str, int] = {}

    def inspect(self, sample: Any) -> None:
        try:
            with Image.open(io.BytesIO(sample.image)) as image:
                image.load()
                kind = f"{image.format} {image.mode}"
        except Exception as error:  # noqa: BLE001 - any undecodable image is a finding
            self.decode.add(f"{sample.__key__} {sample.image_format} does not decode: {type(error).__name__}: {error}")
            return
        self.images[kind] = self.images.get(kind, 0) + 1

    def checks(self) -> list[Check]:
        return [self.decode.check("every image decodes")]

    def summary(self) -> dict[str, Any]:
        return {"images": self.images}

    def passed(self) -> tuple[list[Check], dict[str, Any], dict[str, bytes]]:
        return [], {}, {}
