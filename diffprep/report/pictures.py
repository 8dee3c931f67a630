"""Pictures for people: decoded samples next to their sources, as contact sheets, PNGs and Markdown.

- :class:`Preview`: a decoded sample and the source pixels it was made from, with their PSNR;
- :func:`contact_sheet` / :func:`write_contact_sheet`: a grid of source next to decoded, labelled with the
  sample key and the PSNR (the sanity check, validation and ``diffprep decode`` all write one);
- :func:`markdown_image`: a picture embedded in a Prefect Markdown artifact as a ``data:`` URI;
- :func:`file_pixels`, :func:`png_bytes`: image files to pixels and back;
- :func:`frame_strip` (a clip's frames side by side, one PSNR over them) and :func:`frame_grid` (in rows, of a
  bounded size: what a person looks at).
"""

from __future__ import annotations

import base64
import io
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
from PIL import Image, ImageDraw

from diffprep.media.images import psnr
from diffprep.writer.shards import atomic_write_bytes

CONTACT_SHEET = "contact_sheet.png"
TILE = 192  # pixels per picture in a contact sheet (small images are enlarged, large ones reduced)
MAX_EMBED_BYTES = 300_000  # larger sheets go into artifacts as a JPEG preview, not the PNG itself
_GAP = 8
_LABEL_HEIGHT = 16  # one line of Pillow's default font
_BACKGROUND = (48, 48, 48)
_EMPTY_TILE = (96, 96, 96)
_TEXT = (235, 235, 235)


@dataclass
class Preview:
    """A decoded sample and, when its source could be re-read, the source pixels it was made from."""

    key: str
    source_id: str | None
    caption: str
    decoded: torch.Tensor  # uint8 [3, H, W]
    source: torch.Tensor | None = None  # uint8 [3, H, W], the prepared source
    note: str = ""  # why there is no source, or what else is worth knowing
    audio_mel_l1: float | None = None  # LTX-2 with audio: the decoded sound against the source's, log-mel L1

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
            **({"audio_mel_l1": round(self.audio_mel_l1, 4)} if self.audio_mel_l1 is not None else {}),
        }


def file_pixels(data: bytes) -> torch.Tensor:
    """An image file's pixels as uint8 RGB [3, H, W], as stored (no resizing)."""
    with Image.open(io.BytesIO(data)) as image:
        rgb = np.asarray(image.convert("RGB"))
    return torch.from_numpy(np.ascontiguousarray(rgb.transpose(2, 0, 1)))


def frame_strip(frames: torch.Tensor) -> torch.Tensor:
    """A clip's frames ``[F, 3, H, W]`` side by side, ``[3, H, F * W]``: one picture, one PSNR over every frame."""
    f, c, h, w = frames.shape
    return frames.permute(1, 2, 0, 3).reshape(c, h, f * w)


GRID_SIDE = 2048  # a frame grid fits a square of this side: a long scene's frames shrink, never widen the picture


def frame_grid(frames: torch.Tensor, side: int = GRID_SIDE, min_width: int = 0) -> torch.Tensor:
    """A clip's frames ``[F, 3, H, W]`` in rows, read left to right then down, as one uint8 ``[3, H', W']`` picture
    that fits a ``side`` square (unlike ``frame_strip``, whose width grows with every frame: a 256-frame scene was
    some 100,000 px wide). The grid is about as wide as tall; a grid that would not fit shrinks its frames, and one
    narrower than ``min_width`` enlarges them by a whole factor without smoothing (a 48 px frame stays sharp)."""
    count, _, height, width = frames.shape
    columns = min(count, max(1, math.ceil(math.sqrt(count * height / width))))
    rows = math.ceil(count / columns)
    scale = min(1.0, side / (columns * width), side / (rows * height))
    if scale == 1.0 and min_width > columns * width:
        scale = float(max(1, min(min_width // (columns * width), side // (columns * width),
                                 side // (rows * height))))
    tile_w, tile_h = max(1, int(width * scale)), max(1, int(height * scale))
    grid = Image.new("RGB", (columns * tile_w, rows * tile_h), _EMPTY_TILE)
    for i, frame in enumerate(frames):
        image = _to_pil(frame)
        if image.size != (tile_w, tile_h):
            image = image.resize((tile_w, tile_h), Image.NEAREST if scale > 1 else Image.BILINEAR)
        grid.paste(image, ((i % columns) * tile_w, (i // columns) * tile_h))
    return torch.from_numpy(np.array(grid)).permute(2, 0, 1).contiguous()


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
        if preview.audio_mel_l1 is not None:
            shown += f"  mel L1 {preview.audio_mel_l1:.2f}"
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
