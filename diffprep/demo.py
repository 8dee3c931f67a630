"""A deterministic synthetic demo dataset: coloured shapes with captions that describe them.

Written in the ``directory`` source layout (images/ + captions/), mixed
formats and sizes, so the demo exercises decoding, cropping and batching the
way a real folder does.
"""

from __future__ import annotations

import random
from pathlib import Path

from PIL import Image, ImageDraw

COLOURS = {
    "red": (220, 40, 40),
    "green": (40, 170, 70),
    "blue": (40, 80, 220),
    "yellow": (240, 210, 40),
    "purple": (140, 60, 180),
    "orange": (240, 140, 30),
    "white": (245, 245, 245),
    "black": (20, 20, 20),
}
SHAPES = ("circle", "square", "triangle", "stripes")
SIZES = ((96, 96), (128, 96), (96, 128), (80, 80), (160, 112))


def _draw(shape: str, fg: tuple[int, int, int], bg: tuple[int, int, int], size: tuple[int, int]) -> Image.Image:
    width, height = size
    image = Image.new("RGB", size, bg)
    draw = ImageDraw.Draw(image)
    margin = min(width, height) // 5
    box = (margin, margin, width - margin, height - margin)
    if shape == "circle":
        draw.ellipse(box, fill=fg)
    elif shape == "square":
        draw.rectangle(box, fill=fg)
    elif shape == "triangle":
        draw.polygon([(width // 2, margin), (width - margin, height - margin), (margin, height - margin)], fill=fg)
    else:
        for x in range(0, width, 16):
            draw.rectangle((x, 0, x + 7, height), fill=fg)
    return image


def write_demo_dataset(path: str | Path, samples: int = 24, seed: int = 0) -> Path:
    """Write ``samples`` image/caption pairs under ``path`` (same files for the same arguments)."""
    root = Path(path)
    (root / "images").mkdir(parents=True, exist_ok=True)
    (root / "captions").mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    names = list(COLOURS)
    for i in range(samples):
        shape = SHAPES[i % len(SHAPES)]
        fg_name, bg_name = rng.sample(names, 2)
        size = SIZES[i % len(SIZES)]
        image = _draw(shape, COLOURS[fg_name], COLOURS[bg_name], size)
        stem = f"{i:05d}"
        if i % 3 == 0:
            image.save(root / "images" / f"{stem}.jpg", format="JPEG", quality=92)
        else:
            image.save(root / "images" / f"{stem}.png", format="PNG")
        thing = f"{fg_name} stripes" if shape == "stripes" else f"a {fg_name} {shape}"
        caption = f"{thing} on a {bg_name} background"
        (root / "captions" / f"{stem}.txt").write_text(caption + "\n", encoding="utf-8")
    return root
