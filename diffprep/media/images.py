"""Encoded image bytes -> model-ready pixels, deterministically.

(Over 400 lines on purpose: one path from bytes to pixels -- EXIF, modes, alpha, the three ways of sizing
and the aspect buckets -- whose rules depend on one another and are read best in one place.)

``prepare_image`` is the whole path for one sample:

1. **Open** with Pillow (header only) and check ``width * height`` against
   ``image.max_pixels`` before any pixel is decoded (decompression bombs).
2. **Decode** (``load``) and turn every failure into a
   :class:`~diffprep.errors.RejectError` with phase ``decode``:
   ``empty_file``, ``image_too_large``, ``image_truncated``,
   ``image_decode_error``, ``image_unsupported_mode``.
3. **EXIF orientation** is applied, so a rotated phone photo comes out upright.
4. **RGB**: alpha (RGBA, LA, PA, palette or colour-key transparency) is
   composited over ``background``; greyscale is replicated to three channels;
   16-bit samples are mapped to 8 bits by their high byte (``>> 8``);
   CMYK (including Adobe's inverted JPEGs) is converted by Pillow.
5. **Geometry**: one integer box of the (post-EXIF) source is resized with
   LANCZOS to the output size (see :func:`target_size` and ``ImageSpec``).
   The box is returned as ``crop_box`` so a sample's metadata says exactly which
   source pixels it holds.

LANCZOS is used for down- and upscaling alike: one filter keeps results easy to
reason about, it is the sharpest of Pillow's filters, and upscaling is rare
(small images only). ``reducing_gap`` and JPEG draft decoding are not used:
both are deterministic but trade quality for speed, and these pixels become
training data.

Pillow's global ``Image.MAX_IMAGE_PIXELS`` and the process-wide warning
filters are never changed here (``warnings.catch_warnings`` is not
thread-safe before Python 3.14, and decoding runs in threads).
"""

from __future__ import annotations

import functools
import io
import math
import re
from dataclasses import dataclass

import numpy as np
import torch
from PIL import ExifTags, Image, ImageOps, UnidentifiedImageError

from diffprep.config import ImageConfig
from diffprep.media.buckets import Bucket, choose_bucket, cover_box, parse_image_buckets
from diffprep.errors import ConfigError, RejectError

__all__ = ["ImageSpec", "PreparedImage", "target_size", "prepare_image", "decode_rgb", "to_model_input", "to_uint8",
           "psnr"]

# Smallest output side in every mode: the VAE downsamples by 8 and Flux packs latents 2x2.
MULTIPLE = 16

# The note of an image enlarged to fill its output (a 1x1 icon at 64x64): kept, and counted.
UPSCALED = "upscaled"

# EPS is rendered by spawning Ghostscript on the file: never for untrusted bytes.
_REFUSED_FORMATS = frozenset({"EPS"})

_ALPHA_MODES = frozenset({"RGBA", "RGBa", "LA", "PA"})
# Converted to RGB by Pillow directly (no alpha, 8 bits per sample or a palette).
_PIL_RGB_MODES = frozenset({"P", "L", "1", "CMYK", "YCbCr", "LAB", "HSV", "RGBX"})
_ORIENTATION = ExifTags.Base.Orientation
_BYTESIO_REPR = re.compile(r"\s*<_io\.BytesIO object at 0x[0-9a-fA-F]+>")


@dataclass(frozen=True)
class ImageSpec:
    """How a source image becomes output pixels.

    Fixed size (``variable_size=False``): the output is ``image_size`` square.
    With ``center_crop`` the short side is scaled to ``image_size`` and the
    center is cropped; without it the whole image is stretched to the square
    (the aspect ratio is lost, nothing is cut).

    Variable size: the aspect ratio is kept. Images whose long side exceeds
    ``max_size`` are scaled down so it equals ``max_size``; smaller images are
    not upscaled. Both sides are then rounded down to multiples of 16 by
    cropping a few pixels at the center. A side never goes below 16: an image
    whose short side would be under 16 (a 1x1 icon, a 10000x40 panorama) is
    scaled so its short side is 16 and its long side is center-cropped to at
    most ``max_size``.

    Aspect-ratio buckets (``buckets``, sizes ``(W, H)`` or ``"WxH"``): the
    output is the bucket of nearest aspect ratio (smallest |log aspect
    difference|; ties to the larger area, then the earlier bucket), the image
    resized to cover it and centre-cropped.

    Transparent pixels are composited over ``background`` (RGB, 0-255).

    ``min_size``: an image whose shorter side (upright) is below it is the
    reject ``image_too_small``; unset, every size is kept. An image whose
    pixels are enlarged to fill the output has the note ``upscaled``.
    """

    image_size: int = 1024
    center_crop: bool = True
    variable_size: bool = False
    max_size: int = 1024
    max_pixels: int = 89_478_485
    background: tuple[int, int, int] = (255, 255, 255)
    buckets: tuple[tuple[int, int], ...] = ()
    min_size: int | None = None
    crop: str | None = None  # edm | adm: the crop of the tool FastGen runs (diffprep.media.crops); fixed size only

    def __post_init__(self) -> None:
        for name in ("image_size", "max_size"):
            value = getattr(self, name)
            if value < MULTIPLE or value % MULTIPLE:
                raise ConfigError(f"image.{name} must be a multiple of {MULTIPLE} and at least {MULTIPLE}, got {value}")
        if self.max_pixels < 1:
            raise ConfigError(f"image.max_pixels must be >= 1, got {self.max_pixels}")
        background = tuple(self.background)
        if len(background) != 3 or not all(isinstance(c, int) and 0 <= c <= 255 for c in background):
            raise ConfigError(f"image.background must be three integers in 0..255 (R, G, B), got {self.background!r}")
        object.__setattr__(self, "background", background)
        sizes = tuple(tuple(int(v) for v in (b.split("x") if isinstance(b, str) else b)) for b in self.buckets)
        if any(len(size) != 2 or min(size) < MULTIPLE or size[0] % MULTIPLE or size[1] % MULTIPLE for size in sizes):
            raise ConfigError(f"image buckets must be WxH with sides multiples of {MULTIPLE}, got {self.buckets!r}")
        object.__setattr__(self, "buckets", sizes)

    @classmethod
    def from_config(cls, cfg: ImageConfig) -> "ImageSpec":
        return cls(
            image_size=cfg.image_size,
            center_crop=cfg.center_crop,
            variable_size=cfg.variable_size,
            max_size=cfg.max_size,
            max_pixels=cfg.max_pixels,
            background=tuple(cfg.background),
            buckets=tuple((b.width, b.height) for b in image_buckets(cfg)),
            min_size=cfg.min_size,
            crop=cfg.crop,
        )


def image_buckets(cfg: ImageConfig) -> list[Bucket]:
    """The aspect-ratio buckets ``image.buckets`` asks for (``auto`` or ``WxH,...``); none when unset."""
    return parse_image_buckets(cfg.buckets, cfg.image_size, MULTIPLE) if cfg.buckets else []


def bucket_name(width: int, height: int) -> str:
    """An image bucket as plan.json names it: ``WxH``."""
    return f"{width}x{height}"


@dataclass(frozen=True)
class PreparedImage:
    """One decoded sample.

    ``pixels``: uint8 [3, H, W] RGB, contiguous. ``original_size``: (width,
    height) after EXIF orientation. ``crop_box``: (left, top, right, bottom) of
    the source region, in ``original_size`` coordinates, that fills the output.
    ``notes``: conversions made, e.g. ``("exif_transposed", "mode:RGBA->RGB",
    "alpha_composited")``.
    """

    pixels: torch.Tensor
    original_size: tuple[int, int]
    crop_box: tuple[int, int, int, int]
    notes: tuple[str, ...] = ()


def target_size(width: int, height: int, spec: ImageSpec) -> tuple[int, int]:
    """(width, height) of the output for a source of ``width`` x ``height`` (post-EXIF)."""
    return _plan(width, height, spec)[0]


def image_size_of(data: bytes, spec: ImageSpec) -> tuple[int, int]:
    """(width, height) after EXIF orientation, from the header alone (no pixel decoded)."""
    if not data:
        raise RejectError("empty_file", "the image file is 0 bytes", phase="decode")
    with _open(data, spec) as img:
        width, height = img.size
        try:
            if img.getexif().get(_ORIENTATION, 1) in (5, 6, 7, 8):  # a quarter turn swaps the sides
                width, height = height, width
        except Exception:  # noqa: BLE001 - a broken EXIF block: the image is kept as stored
            pass
    return width, height


def prepare_image(data: bytes, spec: ImageSpec) -> PreparedImage:
    """Decode ``data`` and turn it into ``spec``'s pixels.

    Raises :class:`~diffprep.errors.RejectError` (phase ``decode``) for bytes
    that are not a usable image; never for a valid image of any mode or size
    within ``spec.max_pixels``.
    """
    if not data:
        raise RejectError("empty_file", "the image file is 0 bytes", phase="decode")
    notes: list[str] = []
    with _open(data, spec) as img:
        _load(img, notes)
        _exif_transpose(img, notes)
        rgb = _to_rgb(img, spec.background, notes)

        width, height = rgb.size
        if spec.min_size is not None and min(width, height) < spec.min_size:
            raise RejectError("image_too_small", f"{width}x{height}: the shorter side {min(width, height)} px is "
                              f"below image.min_size {spec.min_size} (--min-image-size)")
        if spec.crop:
            from diffprep.media.crops import crop_image

            out, box = crop_image(rgb, spec.crop, spec.image_size)
            if min(width, height) < spec.image_size:
                notes.append(UPSCALED)
        else:
            (out_w, out_h), box = _plan(width, height, spec)
            if out_w > box[2] - box[0] or out_h > box[3] - box[1]:
                notes.append(UPSCALED)
            if (box[2] - box[0], box[3] - box[1]) == (out_w, out_h):
                out = rgb.crop(box)  # scale 1: an exact crop, no resampling
            else:
                out = rgb.resize((out_w, out_h), Image.Resampling.LANCZOS, box=box)
    # [H, W, 3] -> [3, H, W]; ascontiguousarray makes the one (writable) copy torch needs.
    pixels = torch.from_numpy(np.ascontiguousarray(np.asarray(out).transpose(2, 0, 1)))
    return PreparedImage(pixels=pixels, original_size=(width, height), crop_box=box, notes=tuple(notes))


def decode_rgb(data: bytes, spec: ImageSpec, *, exif_transpose: bool = True) -> tuple[Image.Image, tuple[str, ...]]:
    """Steps 1-4 of ``prepare_image`` alone: ``data`` as an RGB Pillow image and its notes, no resizing.

    ``exif_transpose=False`` keeps the pixels as stored (a posed frame's camera describes the stored pixel array).
    The same rejects as ``prepare_image``; the caller owns (closes) the image.
    """
    if not data:
        raise RejectError("empty_file", "the image file is 0 bytes", phase="decode")
    notes: list[str] = []
    with _open(data, spec) as img:
        _load(img, notes)
        if exif_transpose:
            _exif_transpose(img, notes)
        rgb = _to_rgb(img, spec.background, notes)
        return (rgb if rgb is not img else img.copy()), tuple(notes)


def to_model_input(pixels: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """uint8 [B, 3, H, W] or [3, H, W] -> ``dtype`` in [-1, 1] as ``x / 127.5 - 1`` (computed in float32)."""
    if pixels.dtype != torch.uint8:
        raise ValueError(f"to_model_input: pixels must be uint8, got {pixels.dtype}")
    if pixels.ndim not in (3, 4) or pixels.shape[-3] != 3:
        raise ValueError(f"to_model_input: pixels must be [3, H, W] or [B, 3, H, W], got {list(pixels.shape)}")
    if not dtype.is_floating_point:
        raise ValueError(f"to_model_input: dtype must be a floating point type, got {dtype}")
    return (pixels.to(torch.float32) / 127.5 - 1.0).to(dtype)


def to_uint8(images: torch.Tensor) -> torch.Tensor:
    """Float images in [-1, 1] (e.g. VAE decodes) -> uint8, rounded and clamped; the inverse of to_model_input."""
    if not images.dtype.is_floating_point:
        raise ValueError(f"to_uint8: images must be a floating point tensor, got {images.dtype}")
    images = images.to(torch.float32)
    finite = torch.isfinite(images)
    if not bool(finite.all()):
        bad = images.numel() - int(finite.sum())
        raise ValueError(f"to_uint8: images hold {bad} non-finite values (NaN or inf); the decoder output is broken")
    return ((images + 1.0) * 127.5).round().clamp(0, 255).to(torch.uint8)


def psnr(a: torch.Tensor, b: torch.Tensor) -> float:
    """Peak signal-to-noise ratio of two uint8 images of the same shape, in dB; ``inf`` when identical."""
    if a.dtype != torch.uint8 or b.dtype != torch.uint8:
        raise ValueError(f"psnr: both images must be uint8, got {a.dtype} and {b.dtype}")
    if a.shape != b.shape:
        raise ValueError(f"psnr: shapes differ: {list(a.shape)} vs {list(b.shape)}")
    if a.numel() == 0:
        raise ValueError("psnr: images are empty")
    mse = float((a.to(torch.float64) - b.to(torch.float64)).square().mean())
    if mse == 0.0:
        return math.inf
    return 10.0 * math.log10(255.0**2 / mse)


# --- decoding ---------------------------------------------------------------------------------


@functools.cache
def _allowed_formats() -> tuple[str, ...]:
    Image.init()  # registers every plugin, so ID lists all formats Pillow can open
    return tuple(f for f in Image.ID if f not in _REFUSED_FORMATS)


def _open(data: bytes, spec: ImageSpec) -> Image.Image:
    """Read the header only and refuse images over ``spec.max_pixels`` before any pixel is decoded."""
    try:
        img = Image.open(io.BytesIO(data), formats=_allowed_formats())
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        # Pillow's own global limit (or a process filter turning its warning into an error) fired
        # inside Image.open, before the size reached us.
        raise RejectError(
            "image_too_large",
            f"{exc} Pillow's process-wide limit PIL.Image.MAX_IMAGE_PIXELS={Image.MAX_IMAGE_PIXELS} refused it "
            f"before image.max_pixels={spec.max_pixels} was checked.",
        ) from None
    except UnidentifiedImageError as exc:
        raise RejectError("image_decode_error", f"{_pil_message(exc)} (first bytes: {data[:16]!r})") from None
    except Exception as exc:  # Pillow's header parsers raise many types on malformed input
        raise _decode_reject(exc) from None
    width, height = img.size
    if width < 1 or height < 1:
        img.close()
        raise RejectError("image_decode_error", f"the header gives an empty image ({width}x{height})")
    if width * height > spec.max_pixels:
        img.close()
        raise RejectError(
            "image_too_large",
            f"{width}x{height} = {width * height} pixels is over image.max_pixels = {spec.max_pixels} "
            "(decompression-bomb limit); raise image.max_pixels if images this large are expected",
        )
    return img


def _load(img: Image.Image, notes: list[str]) -> None:
    try:
        if getattr(img, "is_animated", False):  # asked before load: it seeks through the frames
            notes.append("multiframe:first_frame")
        img.load()
    except Exception as exc:  # decoders raise OSError, SyntaxError, ValueError, EOFError... on bad data
        raise _decode_reject(exc) from None


def _exif_transpose(img: Image.Image, notes: list[str]) -> None:
    try:
        orientation = img.getexif().get(_ORIENTATION, 1)
        if orientation in range(2, 9):
            ImageOps.exif_transpose(img, in_place=True)
            notes.append("exif_transposed")
    except Exception:
        # The pixels are fine; only the EXIF block is broken. Keep the image as stored and say so.
        notes.append("exif_unreadable")


def _decode_reject(exc: Exception) -> RejectError:
    message = _pil_message(exc)
    if isinstance(exc, EOFError) or "truncated" in message.lower():
        return RejectError("image_truncated", f"the file ends early: {message}")
    return RejectError("image_decode_error", message)


def _pil_message(exc: Exception) -> str:
    # Pillow puts the BytesIO repr (a memory address) in some messages; rejects must read the same every run.
    message = _BYTESIO_REPR.sub("", str(exc)).strip()
    return f"{type(exc).__name__}: {message}" if message else type(exc).__name__


# --- modes ------------------------------------------------------------------------------------


def _to_rgb(img: Image.Image, background: tuple[int, int, int], notes: list[str]) -> Image.Image:
    mode = img.mode
    transparent = "transparency" in img.info  # a palette entry or a colour key
    if mode == "RGB" and not transparent:
        return img
    if mode != "RGB":
        notes.append(f"mode:{mode}->RGB")
    if mode.startswith("I;16") or mode in ("I", "F"):
        values = np.asarray(img)
        grey, note = _sixteen_to_eight(values) if mode != "F" else _float_to_eight(values)
        notes[-1] += note
        rgb = Image.fromarray(np.repeat(grey[:, :, None], 3, axis=2))  # uint8 [H, W, 3]: RGB
        key = img.info.get("transparency")
        if not isinstance(key, int):
            return rgb
        rgb.putalpha(Image.fromarray(np.where(values == key, 0, 255).astype(np.uint8)))
        return _composite(rgb, background, notes)
    try:
        if mode in _ALPHA_MODES or transparent:
            # Pillow's convert turns palette and colour-key transparency into the alpha band.
            return _composite(img if mode == "RGBA" else img.convert("RGBA"), background, notes)
        if mode in _PIL_RGB_MODES:
            return img.convert("RGB")
    except ValueError as exc:  # "conversion from X to Y not supported"
        raise RejectError("image_unsupported_mode", f"Pillow cannot convert mode {mode!r} to RGB: {exc}") from None
    raise RejectError("image_unsupported_mode", f"Pillow mode {mode!r} has no RGB conversion here")


def _composite(rgba: Image.Image, background: tuple[int, int, int], notes: list[str]) -> Image.Image:
    notes.append("alpha_composited")
    base = Image.new("RGBA", rgba.size, (*background, 255))
    return Image.alpha_composite(base, rgba).convert("RGB")


def _sixteen_to_eight(values: np.ndarray) -> tuple[np.ndarray, str]:
    """16-bit samples -> 8 bits by the high byte (65535 -> 255, 32768 -> 128): a scale, not a clip.

    Mode ``I`` (32-bit) comes from 16-bit sources (PGM, older Pillow's 16-bit
    PNG), so it is read as 0..65535; values outside are clipped.
    """
    return (np.clip(values.astype(np.int64), 0, 65535) >> 8).astype(np.uint8), "(>>8)"


def _float_to_eight(values: np.ndarray) -> tuple[np.ndarray, str]:
    """Float samples -> 8 bits. Float files (TIFF) mostly hold 0..1, Pillow's own convention is 0..255:
    an image whose maximum is <= 1 is read as 0..1. NaN becomes 0; values outside the range are clipped."""
    values = np.where(np.isnan(values), 0.0, values.astype(np.float64))
    unit_range = values.size > 0 and float(values.max()) <= 1.0
    if unit_range:
        values = values * 255.0
    return np.clip(np.rint(values), 0, 255).astype(np.uint8), "(0..1)" if unit_range else "(0..255)"


# --- geometry ---------------------------------------------------------------------------------


def _plan(width: int, height: int, spec: ImageSpec) -> tuple[tuple[int, int], tuple[int, int, int, int]]:
    """Output (W, H) and the integer source box (left, top, right, bottom) that is resized into it.

    The scale is the exact fraction ``num / den``; integer arithmetic keeps
    every size the same on every machine.
    """
    if width < 1 or height < 1:
        raise ValueError(f"image size must be at least 1x1, got {width}x{height}")
    if spec.buckets:
        bucket = choose_bucket(width, height, 1, [Bucket(w, h, 1) for w, h in spec.buckets])
        return (bucket.width, bucket.height), cover_box(width, height, bucket)
    long_side, short_side = max(width, height), min(width, height)

    if not spec.variable_size:
        size = spec.image_size
        if not spec.center_crop:
            return (size, size), (0, 0, width, height)  # stretch: the whole image, aspect ratio not kept
        # Scaling the short side to `size` and cropping the center square = taking the centered square of
        # side `short_side` from the source.
        return (size, size), _centered(width, height, short_side, short_side)

    num, den = (spec.max_size, long_side) if long_side > spec.max_size else (1, 1)  # never upscale...
    if short_side * num < MULTIPLE * den:  # ...except to lift the short side to the minimum
        num, den = MULTIPLE, short_side
    out_w = _fit(_round_half_up(width * num, den), spec.max_size)
    out_h = _fit(_round_half_up(height * num, den), spec.max_size)
    # The source region that maps onto the output at this scale (rounded to whole source pixels).
    box_w = min(width, max(1, _round_half_up(out_w * den, num)))
    box_h = min(height, max(1, _round_half_up(out_h * den, num)))
    return (out_w, out_h), _centered(width, height, box_w, box_h)


def _fit(side: int, max_size: int) -> int:
    """Round down to a multiple of 16, within [16, max_size]."""
    return max(MULTIPLE, min(max_size, side // MULTIPLE * MULTIPLE))


def _round_half_up(numerator: int, denominator: int) -> int:
    return (2 * numerator + denominator) // (2 * denominator)


def _centered(width: int, height: int, box_w: int, box_h: int) -> tuple[int, int, int, int]:
    """A box_w x box_h box centered in width x height; an odd leftover pixel goes to the right/bottom."""
    left, top = (width - box_w) // 2, (height - box_h) // 2
    return (left, top, left + box_w, top + box_h)
