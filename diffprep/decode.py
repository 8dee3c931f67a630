"""Decode a dataset's samples back to pictures and compare them with their sources.

``diffprep decode OUT --samples N --to DIR`` and the previews of the sanity
and validate phases share these pieces:

- :func:`read_samples`: N samples spread evenly over the committed units, read
  straight from their tars (tensors with ``weights_only=True``).
- :class:`VaeDecoder`: the dataset's VAE alone (no text encoders), found from
  ``plan.json``'s record of the encoders or a given path. It decodes with
  ``FluxEncoders.decode_latents`` itself, so undoing the scale and shift is
  the same code as in the encoders, with the factors of the VAE's own config.
- :func:`source_pixels`: the source images re-read through the plan's source
  and prepared with the plan's image settings: exactly the pixels that were
  encoded, so the PSNR measures the VAE round trip (or the jpg/webp loss of a
  raw dataset) and nothing else.
- :func:`contact_sheet`: a grid of source next to decoded, labelled with the
  sample key and the PSNR; :func:`markdown_image` embeds it in a Prefect
  Markdown artifact as a ``data:`` URI.

Raw datasets need no model: their stored image files are decoded as they are.
"""

from __future__ import annotations

import base64
import io
import json
import math
import os
import tarfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
from PIL import Image, ImageDraw

from diffprep import contract
from diffprep.config import SourceConfig
from diffprep.encoders.flux import FluxEncoders, _vae_normalization, resolve_device
from diffprep.encoders.hub import resolve_component
from diffprep.errors import ConfigError, DatasetValidationError, DiffprepError, RejectError, SourceError
from diffprep.images import ImageSpec, prepare_image, psnr, to_uint8
from diffprep.plan import Plan, read_plan
from diffprep.shards import atomic_write_bytes, load_tensor, read_manifests
from diffprep.sources import SOURCE_TYPES, open_source

CONTACT_SHEET = "contact_sheet.png"
TILE = 192  # pixels per picture in a contact sheet (small images are enlarged, large ones reduced)
MAX_EMBED_BYTES = 300_000  # larger sheets go into artifacts as a JPEG preview, not the PNG itself
_GAP = 8
_LABEL_HEIGHT = 16  # one line of Pillow's default font
_BACKGROUND = (48, 48, 48)
_EMPTY_TILE = (96, 96, 96)
_TEXT = (235, 235, 235)


@dataclass
class StoredSample:
    """One sample as it is in its shard: the raw bytes of every field."""

    key: str
    shard: str
    fields: dict[str, bytes]

    @property
    def meta(self) -> dict[str, Any]:
        data = self.fields.get(contract.META)
        return json.loads(data) if data else {}

    @property
    def caption(self) -> str:
        data = self.fields.get(contract.CAPTION, self.fields.get(contract.RAW_CAPTION, b""))
        return data.decode("utf-8", errors="replace")


@dataclass
class Preview:
    """A decoded sample and, when its source could be re-read, the source pixels it was made from."""

    key: str
    source_id: str | None
    caption: str
    decoded: torch.Tensor  # uint8 [3, H, W]
    source: torch.Tensor | None = None  # uint8 [3, H, W], the prepared source
    note: str = ""  # why there is no source, or what else is worth knowing

    @property
    def psnr_db(self) -> float | None:
        if self.source is None:
            return None
        return psnr(self.decoded, self.source)

    def to_json(self) -> dict[str, Any]:
        value = self.psnr_db
        return {
            "key": self.key,
            "source_id": self.source_id,
            "size": [int(self.decoded.shape[2]), int(self.decoded.shape[1])],
            # JSON has no infinity: an exact copy (a png raw dataset) is reported as None with a note.
            "psnr_db": None if value is None or math.isinf(value) else round(value, 2),
            "note": self.note or ("identical to the source" if value is not None and math.isinf(value) else ""),
        }


@dataclass
class DecodeReport:
    encoding: str
    previews: list[Preview]
    contact_sheet: str | None = None
    vae: str | None = None  # the VAE folder used (pre-encoded datasets)
    images: list[str] = field(default_factory=list)  # PNGs written

    def psnr_values(self) -> list[float]:
        return [p.psnr_db for p in self.previews if p.psnr_db is not None]

    def to_json(self) -> dict[str, Any]:
        return {
            "encoding": self.encoding,
            "samples": [p.to_json() for p in self.previews],
            "contact_sheet": self.contact_sheet,
            "vae": self.vae,
            "images": self.images,
        }

    def lines(self) -> list[str]:
        """One line per sample, for the terminal."""
        lines = []
        for preview in self.previews:
            value = preview.psnr_db
            shown = "n/a" if value is None else ("inf" if math.isinf(value) else f"{value:.2f} dB")
            note = f"  ({preview.note})" if preview.note else ""
            lines.append(f"{preview.key}  PSNR {shown:>9}  {preview.source_id or ''}{note}")
        return lines


# --- reading stored samples ------------------------------------------------------------------------


def read_samples(out_dir: str | os.PathLike, count: int) -> list[StoredSample]:
    """``count`` committed samples spread evenly over the dataset (the first one included), in key order."""
    if count < 1:
        raise ConfigError(f"the number of samples to decode must be >= 1, got {count}")
    out = Path(out_dir)
    manifests = [m for _, m in sorted(read_manifests(out).items()) if m.keys]
    total = sum(len(m.keys) for m in manifests)
    if not total:
        raise DatasetValidationError(f"{out} has no committed samples (no unit manifest lists any); encode first")
    count = min(count, total)
    positions = [i * total // count for i in range(count)]
    wanted: dict[str, dict[str, dict[str, bytes]]] = {}  # shard -> key -> fields
    picked: list[tuple[str, str]] = []
    start = 0
    for manifest in manifests:
        for position in positions:
            if start <= position < start + len(manifest.keys):
                key = manifest.keys[position - start]
                wanted.setdefault(manifest.shard, {})[key] = {}
                picked.append((manifest.shard, key))
        start += len(manifest.keys)
    for shard, samples in wanted.items():
        with tarfile.open(out / shard, mode="r:") as tar:
            for member in tar:
                key, _, ext = member.name.partition(".")
                if key in samples and member.isfile():
                    samples[key][ext] = tar.extractfile(member).read()
                elif samples and all(samples.values()) and key not in samples:
                    break  # members of a sample are consecutive: every wanted sample is complete
    missing = [key for shard, key in picked if not wanted[shard][key]]
    if missing:
        raise DatasetValidationError(f"samples {missing[:5]} are listed in the unit manifests but not in their shards")
    return [StoredSample(key, shard, wanted[shard][key]) for shard, key in picked]


def stored_image(sample: StoredSample) -> torch.Tensor:
    """The image file of a raw sample as uint8 RGB [3, H, W] (decoded as stored, not resized)."""
    names = [name for name in contract.RAW_IMAGE_FIELDS if name in sample.fields]
    if len(names) != 1:
        raise DatasetValidationError(
            f"sample {sample.key} must hold one image field of {list(contract.RAW_IMAGE_FIELDS)}, it has "
            f"{sorted(sample.fields)}"
        )
    return file_pixels(sample.fields[names[0]])


def file_pixels(data: bytes) -> torch.Tensor:
    """An image file's pixels as uint8 RGB [3, H, W], as stored (no resizing)."""
    with Image.open(io.BytesIO(data)) as image:
        rgb = np.asarray(image.convert("RGB"))
    return torch.from_numpy(np.ascontiguousarray(rgb.transpose(2, 0, 1)))


# --- the VAE ---------------------------------------------------------------------------------------


class VaeDecoder:
    """A dataset's VAE, loaded alone: normalized latents -> images, as ``FluxEncoders.decode_latents`` does."""

    # The encoders' own method: it reads only vae, device, dtype, latent_channels and the two factors,
    # so the inverse of the normalization lives in one place.
    decode_latents = FluxEncoders.decode_latents

    def __init__(self, vae, *, device: torch.device, dtype: torch.dtype, folder: Path | None = None) -> None:
        self.vae = vae
        self.device = device
        self.dtype = dtype
        self.folder = folder
        self.scaling_factor, self.shift_factor = _vae_normalization(vae.config)
        self.latent_channels: int = vae.config.latent_channels

    @classmethod
    def load(cls, folder: str | os.PathLike, *, dtype: torch.dtype, device: str = "auto") -> "VaeDecoder":
        from diffusers import AutoencoderKL

        target = resolve_device(device)
        vae = AutoencoderKL.from_pretrained(folder, dtype=dtype)
        vae.eval()
        vae.requires_grad_(False)
        vae.to(target)
        return cls(vae, device=target, dtype=dtype, folder=Path(folder))

    @classmethod
    def for_plan(cls, plan: Plan, *, model_path: str | None = None, device: str = "auto",
                 token: str | None = None, local_only: bool = False) -> "VaeDecoder":
        """The VAE that encoded ``plan``'s dataset (or the one at ``model_path``), in the plan's precision.

        ``local_only``: a hub VAE is taken from the local cache only, never downloaded.
        Raises ConfigError when it cannot be found or when its scale and shift
        differ from those the latents were normalized with.
        """
        encoders = plan.settings.get("encoders") or {}
        record = (encoders.get("components") or {}).get("vae")
        if model_path:
            local_dir, subfolder = resolve_component(model_path, "vae", revision=None, token=token, encoder="VAE")
            folder = local_dir / subfolder if subfolder else local_dir
        elif record:
            source, subfolder = record["source"], record.get("subfolder")
            revision = record.get("commit") or record.get("revision")
            if local_only and not Path(source).is_absolute():  # a hub repo id (plan.json records folders absolute)
                folder = _cached_component(source, subfolder, revision)
            else:
                local_dir, subfolder = resolve_component(source, subfolder, revision=revision, token=token,
                                                         encoder="VAE")
                folder = local_dir / subfolder if subfolder else local_dir
        else:
            raise ConfigError("plan.json records no VAE for this dataset; pass the VAE with --model-path")
        dtype = getattr(torch, str(encoders.get("dtype", "float32")), None)
        if not isinstance(dtype, torch.dtype):
            raise ConfigError(f"plan.json records encoder dtype {encoders.get('dtype')!r}, not a torch dtype")
        decoder = cls.load(folder, dtype=dtype, device=device)
        planned = (encoders.get("scaling_factor"), encoders.get("shift_factor"))
        if planned != (None, None) and planned != (decoder.scaling_factor, decoder.shift_factor):
            raise ConfigError(
                f"the VAE at {decoder.folder} has scaling_factor {decoder.scaling_factor} and shift_factor "
                f"{decoder.shift_factor}, the latents were normalized with {planned[0]} and {planned[1]} "
                "(plan.json): decode with the VAE that encoded the dataset (--model-path)"
            )
        return decoder

    def decode_one(self, latents: torch.Tensor) -> torch.Tensor:
        """Latents [C, h, w] -> uint8 [3, h*f, w*f]."""
        return to_uint8(self.decode_latents(latents[None]))[0]


def _cached_component(repo_id: str, subfolder: str | None, revision: str | None) -> Path:
    """A hub component's folder in the local Hugging Face cache; ConfigError when it is not there."""
    from huggingface_hub import try_to_load_from_cache

    config = try_to_load_from_cache(repo_id, f"{subfolder}/config.json" if subfolder else "config.json",
                                    revision=revision)
    if not isinstance(config, str):
        raise ConfigError(
            f"the VAE of hub repo {repo_id} is not in the local cache and is not downloaded here; "
            "`diffprep decode OUT` downloads it"
        )
    return Path(config).parent


# --- the sources -----------------------------------------------------------------------------------


# Source.describe() of the huggingface source names some settings without their hf_ prefix.
_HF_DESCRIBED = {"dataset": "hf_dataset", "split": "hf_split", "data_files": "hf_data_files",
                 "revision": "hf_revision", "streaming": "hf_streaming"}


def source_config(description: dict[str, Any]) -> SourceConfig:
    """The source settings that reopen the source a plan describes (``Source.describe()``)."""
    kind = description.get("type")
    if kind not in SOURCE_TYPES:
        raise SourceError(f"plan.json describes a source of type {kind!r}, which cannot be reopened here")
    renames = _HF_DESCRIBED if kind == "huggingface" else {}
    values = {renames.get(name, name): value for name, value in description.items()}
    # Descriptive entries (shard counts, base folders) are not settings.
    return SourceConfig(**{name: value for name, value in values.items() if name in SourceConfig.model_fields})


def source_pixels(plan: Plan, samples: Sequence[StoredSample], *, token: str | None = None,
                  local_only: bool = False) -> dict[str, torch.Tensor | str]:
    """Key -> the prepared source pixels of that sample, or a note saying why they are not available.

    A source whose image no longer gives the recorded original size and crop
    box changed since encoding: it is reported, not compared. ``local_only``
    leaves a hub dataset alone (opening one can download all of it).
    """
    hub = plan.source.get("type") == "huggingface" and not Path(str(plan.source.get("dataset"))).exists()
    if local_only and hub:
        return {s.key: f"source not re-read: hub dataset {plan.source['dataset']} (`diffprep decode` reads it)"
                for s in samples}
    try:
        spec = ImageSpec(**plan.settings["image"])
        source = open_source(source_config(plan.source), token=token)
    except (DiffprepError, KeyError, TypeError, OSError) as error:
        return {s.key: f"source not reachable: {error}" for s in samples}
    result: dict[str, torch.Tensor | str] = {}
    for sample in samples:
        meta = sample.meta
        source_id = meta.get("source_id")
        if not source_id:
            result[sample.key] = "no source_id in meta.json"
            continue
        try:
            read = next(iter(source.read([source_id])))
            if read.reject is not None:
                raise read.reject
            if read.image is None:
                raise RejectError("missing_image", "the source gave no image")
            prepared = prepare_image(read.image, spec)
        except RejectError as error:
            result[sample.key] = f"source {error.reason}: {error.detail}"
            continue
        except (DiffprepError, OSError, StopIteration) as error:
            result[sample.key] = f"source not readable: {type(error).__name__}: {error}"
            continue
        recorded = (meta.get("original_size"), meta.get("crop_box"))
        if recorded != (None, None) and recorded != (list(prepared.original_size), list(prepared.crop_box)):
            result[sample.key] = (f"the source changed since encoding (original size {prepared.original_size}, "
                                  f"recorded {recorded[0]})")
            continue
        result[sample.key] = prepared.pixels
    return result


# --- putting it together ---------------------------------------------------------------------------


def decode_dataset(
    out_dir: str | os.PathLike,
    samples: int,
    *,
    to_dir: str | os.PathLike | None = None,
    sheet: str | os.PathLike | None = None,
    model_path: str | None = None,
    device: str = "auto",
    token: str | None = None,
    decoder: VaeDecoder | None = None,
    local_only: bool = False,
) -> DecodeReport:
    """Decode ``samples`` samples of ``out_dir`` and compare them with their sources.

    Writes ``<key>.png`` (decoded) and ``<key>.source.png`` into ``to_dir``
    when given, and the contact sheet to ``sheet`` (default
    ``<to_dir>/contact_sheet.png``; none without either). Pre-encoded datasets
    need their VAE (from plan.json, ``model_path`` or an already loaded
    ``decoder``; with ``local_only`` a hub VAE must be cached already, and a
    hub dataset source is not re-read); raises ConfigError when the VAE cannot
    be loaded.
    """
    out = Path(out_dir)
    plan = read_plan(out)
    stored = read_samples(out, samples)
    raw = any(name in stored[0].fields for name in contract.RAW_IMAGE_FIELDS)
    encoding = contract.ENCODING_RAW if raw else contract.ENCODING_PREENCODED
    if raw:
        decoded = [stored_image(s) for s in stored]
    else:
        if decoder is None:
            if plan is None and not model_path:
                raise ConfigError(f"{out} has no plan.json naming its VAE; pass the VAE with --model-path")
            decoder = VaeDecoder.for_plan(plan or _EMPTY_PLAN, model_path=model_path, device=device, token=token,
                                          local_only=local_only)
        decoded = [decoder.decode_one(load_tensor(s.fields[contract.LATENTS], key=s.key, field=contract.LATENTS))
                   for s in stored]
    sources = source_pixels(plan, stored, token=token, local_only=local_only) if plan is not None else {}
    previews = []
    for sample, image in zip(stored, decoded):
        found = sources.get(sample.key, "plan.json is missing: the source is unknown")
        if isinstance(found, torch.Tensor) and found.shape != image.shape:
            found = f"decoded {list(image.shape)} but the source prepares to {list(found.shape)}"
        previews.append(Preview(
            key=sample.key, source_id=sample.meta.get("source_id"), caption=sample.caption, decoded=image,
            source=found if isinstance(found, torch.Tensor) else None,
            note="" if isinstance(found, torch.Tensor) else found,
        ))
    report = DecodeReport(encoding=encoding, previews=previews,
                          vae=str(decoder.folder) if decoder is not None and decoder.folder else None)
    if to_dir is not None:
        folder = Path(to_dir)
        folder.mkdir(parents=True, exist_ok=True)
        for preview in previews:
            path = folder / f"{preview.key}.png"
            atomic_write_bytes(path, png_bytes(preview.decoded))
            report.images.append(str(path))
            if preview.source is not None:
                atomic_write_bytes(folder / f"{preview.key}.source.png", png_bytes(preview.source))
        sheet = sheet or folder / CONTACT_SHEET
    if sheet is not None:
        report.contact_sheet = str(write_contact_sheet(sheet, previews))
    return report


_EMPTY_PLAN = Plan(fingerprint="", settings={}, source={}, expected={}, units=[])


# --- pictures --------------------------------------------------------------------------------------


def png_bytes(pixels: torch.Tensor) -> bytes:
    """uint8 [3, H, W] -> PNG file bytes."""
    buffer = io.BytesIO()
    _to_pil(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def _to_pil(pixels: torch.Tensor) -> Image.Image:
    return Image.fromarray(pixels.permute(1, 2, 0).contiguous().numpy(), "RGB")


def _tile(pixels: torch.Tensor | None, tile: int) -> Image.Image:
    cell = Image.new("RGB", (tile, tile), _EMPTY_TILE)
    if pixels is None:
        return cell
    image = _to_pil(pixels)
    side = max(image.size)
    if side <= tile:
        # Enlarge by a whole factor without smoothing: a 32 px sample stays readable pixel by pixel.
        factor = tile // side
        image = image.resize((image.width * factor, image.height * factor), Image.Resampling.NEAREST)
    else:
        scale = tile / side
        size = (max(1, round(image.width * scale)), max(1, round(image.height * scale)))
        image = image.resize(size, Image.Resampling.LANCZOS)
    cell.paste(image, ((tile - image.width) // 2, (tile - image.height) // 2))
    return cell


def contact_sheet(previews: Sequence[Preview], *, tile: int = TILE) -> Image.Image:
    """Source (left, grey when not reachable) next to decoded (right) for every preview, in a grid."""
    if not previews:
        raise ValueError("contact_sheet: no previews to show")
    columns = 1 if len(previews) <= 2 else 2 if len(previews) <= 8 else 4
    rows = math.ceil(len(previews) / columns)
    pair_w, pair_h = 2 * tile + _GAP, tile + 2 * _LABEL_HEIGHT
    width = columns * pair_w + (columns + 1) * _GAP
    height = _LABEL_HEIGHT + _GAP + rows * (pair_h + _GAP)
    sheet = Image.new("RGB", (width, height), _BACKGROUND)
    draw = ImageDraw.Draw(sheet)
    draw.text((_GAP, 2), "left: source as prepared for encoding   right: decoded from the dataset", fill=_TEXT)
    for index, preview in enumerate(previews):
        x = _GAP + (index % columns) * (pair_w + _GAP)
        y = _LABEL_HEIGHT + _GAP + (index // columns) * (pair_h + _GAP)
        sheet.paste(_tile(preview.source, tile), (x, y))
        sheet.paste(_tile(preview.decoded, tile), (x + tile + _GAP, y))
        value = preview.psnr_db
        shown = "no source" if value is None else ("identical" if math.isinf(value) else f"PSNR {value:.1f} dB")
        draw.text((x, y + tile + 2), f"{preview.key}  {shown}", fill=_TEXT)
        draw.text((x, y + tile + 2 + _LABEL_HEIGHT), _fit(draw, preview.caption, pair_w), fill=_TEXT)
    return sheet


def _fit(draw: ImageDraw.ImageDraw, text: str, width: int) -> str:
    """``text`` on one line, cut with an ellipsis to ``width`` pixels."""
    text = " ".join(text.split())
    if draw.textlength(text) <= width:
        return text
    while text and draw.textlength(text + "…") > width:
        text = text[:-1]
    return text + "…"


def write_contact_sheet(path: str | os.PathLike, previews: Sequence[Preview], *, tile: int = TILE) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    buffer = io.BytesIO()
    contact_sheet(previews, tile=tile).save(buffer, format="PNG")
    atomic_write_bytes(path, buffer.getvalue())
    return path


def markdown_image(path: str | os.PathLike, alt: str = "contact sheet") -> str:
    """Markdown that shows the picture at ``path`` in the Prefect UI (a ``data:`` URI) and names the file.

    Sheets over MAX_EMBED_BYTES are embedded as a JPEG preview to keep the artifact small.
    """
    path = Path(path)
    data, kind = path.read_bytes(), "png"
    if len(data) > MAX_EMBED_BYTES:
        buffer = io.BytesIO()
        with Image.open(path) as image:
            image.convert("RGB").save(buffer, format="JPEG", quality=80)
        data, kind = buffer.getvalue(), "jpeg"
    encoded = base64.b64encode(data).decode("ascii")
    return f"![{alt}](data:image/{kind};base64,{encoded})\n\n{alt}: `{path}`\n"
