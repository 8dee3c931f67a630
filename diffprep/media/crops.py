"""The crops of the dataset tools FastGen's class-conditional recipes run (``--crop edm|adm``), pixel for pixel.

- ``edm`` (EDM's ``center-crop``): the largest centred square, cut at integer offsets
  ``(side - short) // 2``, then one Lanczos resize to ``size`` x ``size``.
- ``adm`` (EDM2's ``center-crop-dhariwal``, from ADM): while the short side is at
  least twice ``size``, halve both sides (integer division) with a box filter;
  then one bicubic resize that brings the short side to ``size`` (each side
  ``round(side * size / short)``), and a centred ``size`` square cut at
  ``(side - size) // 2``.

Both take upright RGB images (``images.prepare_image`` has applied EXIF and
composited alpha) and return the output and the source box that fills it, in
the input's coordinates, for meta.json. The order matters for the bytes: EDM cuts
before it resamples, so no pixel outside the square reaches the filter.
"""

from __future__ import annotations

from PIL import Image

from diffprep import contract
from diffprep.errors import ConfigError


def edm_center_crop(rgb: Image.Image, size: int) -> tuple[Image.Image, tuple[int, int, int, int]]:
    width, height = rgb.size
    short = min(width, height)
    left, top = (width - short) // 2, (height - short) // 2
    box = (left, top, left + short, top + short)
    square = rgb.crop(box)
    # Pillow returns a copy when the size is already right, as EDM's tool gets from the same call.
    return square.resize((size, size), Image.Resampling.LANCZOS), box


def adm_center_crop(rgb: Image.Image, size: int) -> tuple[Image.Image, tuple[int, int, int, int]]:
    image = rgb
    scale = 1.0  # input pixels per pixel of ``image``, to report the box in the input's coordinates
    while min(image.size) >= 2 * size:
        image = image.resize((image.width // 2, image.height // 2), Image.Resampling.BOX)
        scale *= 2
    factor = size / min(image.size)
    resized = (round(image.width * factor), round(image.height * factor))
    image = image.resize(resized, Image.Resampling.BICUBIC)
    left, top = (image.width - size) // 2, (image.height - size) // 2
    out = image.crop((left, top, left + size, top + size))
    per_pixel = scale / factor
    box = tuple(min(limit, round(v * per_pixel)) for v, limit in
                zip((left, top, left + size, top + size), (rgb.width, rgb.height) * 2))
    return out, box  # type: ignore[return-value]


CROPPERS = {contract.CROP_EDM: edm_center_crop, contract.CROP_ADM: adm_center_crop}


def crop_image(rgb: Image.Image, crop: str, size: int) -> tuple[Image.Image, tuple[int, int, int, int]]:
    """``rgb`` as the tool of ``crop`` makes it ``size`` square; the source box that fills it."""
    try:
        cropper = CROPPERS[crop]
    except KeyError:
        raise ConfigError(f"image.crop must be one of {list(CROPPERS)}, got {crop!r}") from None
    return cropper(rgb, size)


__all__ = ["CROPPERS", "adm_center_crop", "crop_image", "edm_center_crop"]
