"""A tiny class-folder image tree (ImageNet's train layout) written by the tests that read one."""

from __future__ import annotations

import io
from pathlib import Path

from PIL import Image


def jpeg_bytes(seed: int, size: int = 16) -> bytes:
    """A small JPEG whose colour depends on ``seed``."""
    image = Image.new("RGB", (size, size), ((seed * 53) % 256, (seed * 97) % 256, (seed * 31) % 256))
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", quality=90)
    return buffer.getvalue()


def png_bytes(seed: int, size: int = 16) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (size, size), (seed % 256, 0, 255 - seed % 256)).save(buffer, format="PNG")
    return buffer.getvalue()


def write_class_folders(root: Path, classes: dict[str, int]) -> Path:
    """``<root>/<class>/<class>_<i>.JPEG`` for each class and count, the ImageNet names; returns ``root``."""
    seed = 0
    for name, count in classes.items():
        folder = root / name
        folder.mkdir(parents=True, exist_ok=True)
        for index in range(count):
            (folder / f"{name}_{index}.JPEG").write_bytes(jpeg_bytes(seed))
            seed += 1
    return root
