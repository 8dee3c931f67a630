"""A folder of images with one caption file per image.

Layout::

    <input_dir>/images/<relpath>/<stem>.<ext>     ext: jpg jpeg png webp, any letter case
    <input_dir>/captions/<relpath>/<stem>.txt     UTF-8 (a BOM is dropped), whitespace stripped

Sub-folders under ``images/`` are mirrored under ``captions/``. The id of a
sample is its image path relative to ``images/`` with forward slashes
(``sub/cat.JPG``). Two images with the same stem and different extensions
(``a.jpg`` and ``a.png``) are two samples, both captioned by ``a.txt``.
A caption with no image of its stem is listed as ``caption-only:<relpath>.txt``
and read as a ``missing_image`` reject; an image without a caption file is a
``missing_caption`` reject. An empty caption file is a valid empty caption.

Ids are listed in bytewise order of the id, walking one directory at a time:
each directory's entries are sorted (sub-folders as ``name/``), which gives the
global order without collecting the whole tree. Other files (``.gif``,
``notes.md``...) are not samples and are ignored, and so are symlinked
sub-folders (they could loop) and dangling symlinks; symlinked files are read.
"""

from __future__ import annotations

import heapq
import os
from collections import OrderedDict
from collections.abc import Iterator, Sequence

from diffprep.errors import RejectError, SourceError
from diffprep.sources.base import (
    SourceSample,
    decode_caption_bytes,
    escape_id,
    rejected,
    unescape_id,
)

IMAGE_EXTENSIONS = frozenset({".jpg", ".jpeg", ".png", ".webp"})
CAPTION_EXTENSION = ".txt"
IMAGES_DIR = "images"
CAPTIONS_DIR = "captions"
CAPTION_ONLY_PREFIX = "caption-only:"


def _is_image_name(name: str) -> bool:
    return os.path.splitext(name)[1].lower() in IMAGE_EXTENSIONS


def _walk_files(top: str, prefix: str = "") -> Iterator[tuple[str, str]]:
    """Yield ``(escaped relative path, entry name)`` of the regular files under ``top``, sorted by that path."""
    try:
        with os.scandir(top) as it:
            entries = []
            for entry in it:
                if entry.is_dir(follow_symlinks=False):
                    entries.append((escape_id(entry.name) + "/", entry))
                elif entry.is_file():
                    entries.append((escape_id(entry.name), entry))
    except FileNotFoundError:
        return
    # "name/" for folders: every path below a folder then sorts exactly where
    # the folder does, so a depth-first walk yields globally sorted paths.
    entries.sort(key=lambda item: item[0])
    for key, entry in entries:
        if key.endswith("/"):
            yield from _walk_files(entry.path, prefix + key)
        else:
            yield prefix + key, entry.name


class DirectorySource:
    """Reads ``images/`` + ``captions/`` paired by file stem (see the module docstring)."""

    def __init__(self, input_dir: str) -> None:
        self.root = os.path.abspath(os.path.expanduser(input_dir))
        self.images_root = os.path.join(self.root, IMAGES_DIR)
        self.captions_root = os.path.join(self.root, CAPTIONS_DIR)
        if not os.path.isdir(self.root):
            raise SourceError(f"source.input_dir {input_dir!r} is not a folder (resolved to {self.root})")
        for sub in (self.images_root, self.captions_root):
            if not os.path.isdir(sub):
                raise SourceError(
                    f"source.input_dir {self.root} has no {os.path.basename(sub)}/ folder; a directory source "
                    f"needs images/<name>.jpg|png|webp and captions/<name>.txt side by side"
                )

    def describe(self) -> dict:
        return {"type": "directory", "input_dir": self.root}

    def list_ids(self) -> Iterator[str]:
        # Both streams are sorted, so the merge is sorted and lazy.
        return heapq.merge(self._image_ids(), self._caption_only_ids())

    def _image_ids(self) -> Iterator[str]:
        for rel, name in _walk_files(self.images_root):
            if _is_image_name(name):
                yield rel

    def _caption_only_ids(self) -> Iterator[str]:
        stems_by_dir: OrderedDict[str, frozenset[str]] = OrderedDict()
        for rel, name in _walk_files(self.captions_root):
            stem, ext = os.path.splitext(name)
            if ext != CAPTION_EXTENSION:
                continue
            reldir = rel.rpartition("/")[0]
            if reldir not in stems_by_dir:
                stems_by_dir[reldir] = self._image_stems(reldir)
                if len(stems_by_dir) > 64:  # a folder's files can be split by its sub-folders; keep a few
                    stems_by_dir.popitem(last=False)
            if stem not in stems_by_dir[reldir]:
                yield CAPTION_ONLY_PREFIX + rel

    def _image_stems(self, escaped_reldir: str) -> frozenset[str]:
        folder = os.path.join(self.images_root, unescape_id(escaped_reldir))
        try:
            with os.scandir(folder) as it:
                return frozenset(
                    os.path.splitext(e.name)[0] for e in it if _is_image_name(e.name) and e.is_file()
                )
        except (FileNotFoundError, NotADirectoryError):
            return frozenset()

    def read(self, ids: Sequence[str]) -> Iterator[SourceSample]:
        for source_id in ids:
            if source_id.startswith(CAPTION_ONLY_PREFIX):
                yield self._read_caption_only(source_id)
            else:
                yield self._read_image(source_id)

    def _relpath(self, source_id: str, escaped: str) -> str:
        rel = unescape_id(escaped)
        if any(part in ("", ".", "..") for part in rel.split("/")):
            raise ValueError(f"{source_id!r} is not an id listed by the directory source {self.root}")
        return rel

    def _read_caption_only(self, source_id: str) -> SourceSample:
        rel = self._relpath(source_id, source_id[len(CAPTION_ONLY_PREFIX):])
        caption_path = os.path.join(self.captions_root, rel)
        if not os.path.isfile(caption_path):
            return rejected(source_id, "source_missing", f"{caption_path} no longer exists")
        stem = os.path.splitext(rel)[0]
        return rejected(
            source_id,
            "missing_image",
            f"{caption_path} has no image {IMAGES_DIR}/{stem}.{{jpg,jpeg,png,webp}}",
        )

    def _read_image(self, source_id: str) -> SourceSample:
        rel = self._relpath(source_id, source_id)
        image_path = os.path.join(self.images_root, rel)
        try:
            with open(image_path, "rb") as f:
                image = f.read()
        except FileNotFoundError:
            return rejected(source_id, "source_missing", f"{image_path} no longer exists")
        except OSError as exc:
            return rejected(source_id, "source_read_error", f"{image_path}: {exc}")

        caption_path = os.path.join(self.captions_root, os.path.splitext(rel)[0] + CAPTION_EXTENSION)
        try:
            with open(caption_path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            return rejected(source_id, "missing_caption", f"no caption file {caption_path}", image=image)
        except OSError as exc:
            return rejected(source_id, "source_read_error", f"{caption_path}: {exc}", image=image)
        try:
            caption = decode_caption_bytes(data, caption_path)
        except RejectError as exc:
            return SourceSample(source_id, image, None, exc)
        return SourceSample(source_id, image, caption)
