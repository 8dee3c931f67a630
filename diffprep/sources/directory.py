"""A folder of images with one caption file per image, on disk or under an ``s3://bucket/prefix``.

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

In a bucket the same files give the same ids; they come in the store's key
order, which is the same order unless a key holds ``%`` or a control
character. A bucket has no folders: ``images/`` and ``captions/`` must each
hold at least one object. Listing costs two listings of ``images/`` and one
of ``captions/`` (1000 keys a request), whatever the number of sub-folders.
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
from diffprep.storage import (
    S3Url,
    StorageUnavailableError,
    has_objects,
    is_s3_url,
    list_objects,
    object_exists,
    parse_s3_url,
    read_object,
    s3_client,
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


class _LocalFolder:
    """``images/`` and ``captions/`` on disk."""

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
        self.extra: dict = {}

    def image_ids(self) -> Iterator[str]:
        for rel, name in _walk_files(self.images_root):
            if _is_image_name(name):
                yield rel

    def caption_only_ids(self) -> Iterator[str]:
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

    def where(self, sub: str, rel: str) -> str:
        if any(part in ("", ".", "..") for part in rel.split("/")):
            raise ValueError(f"{escape_id(rel)!r} is not an id listed by the directory source {self.root}")
        return os.path.join(self.root, sub, rel)

    def exists(self, sub: str, rel: str) -> bool:
        return os.path.isfile(self.where(sub, rel))

    def read_bytes(self, sub: str, rel: str) -> bytes:
        with open(self.where(sub, rel), "rb") as f:
            return f.read()


class _S3Folder:
    """``images/`` and ``captions/`` under an ``s3://`` prefix.

    Both listings come in key order, and a caption ``<stem>.txt`` sorts where
    the images ``<stem>.<ext>`` do, so one forward walk over a second image
    listing finds each caption's image with nothing held in memory. The one
    exception, a stem that is another stem plus a dot (``a`` and ``a.b``), can
    make the walk step past an image: a caption it finds no image for is
    checked by a listing of ``images/<stem>.`` (rare: only captions without an
    image, or with such stems, cost that request).
    """

    def __init__(self, input_dir: str, endpoint_url: str | None, profile: str | None) -> None:
        url = parse_s3_url(input_dir, "source.input_dir")
        self._client = s3_client(endpoint_url, profile)
        top = S3Url(url.bucket, url.key.rstrip("/"))
        self.root = str(top).rstrip("/")
        self._images = top.join(IMAGES_DIR + "/")
        self._captions = top.join(CAPTIONS_DIR + "/")
        for folder in (self._images, self._captions):
            if not has_objects(self._client, folder):
                raise SourceError(
                    f"source.input_dir {self.root} has no object under {folder}; a directory source needs "
                    f"images/<name>.jpg|png|webp and captions/<name>.txt side by side"
                )
        self.extra = {"s3_endpoint_url": endpoint_url, "s3_profile": profile}

    def _image_rels(self) -> Iterator[str]:
        start = len(self._images.key)
        for info in list_objects(self._client, self._images):
            rel = info.key[start:]
            if _is_image_name(rel):
                yield rel

    def image_ids(self) -> Iterator[str]:
        return (escape_id(rel) for rel in self._image_rels())

    def caption_only_ids(self) -> Iterator[str]:
        images = (os.path.splitext(rel)[0] + "." for rel in self._image_rels())
        image = next(images, None)
        start = len(self._captions.key)
        for info in list_objects(self._client, self._captions):
            rel = info.key[start:]
            stem, ext = os.path.splitext(rel)
            if ext != CAPTION_EXTENSION:
                continue
            target = stem + "."
            while image is not None and image < target:
                image = next(images, None)
            if image != target and not self._has_image(stem):
                yield CAPTION_ONLY_PREFIX + escape_id(rel)

    def _has_image(self, stem: str) -> bool:
        prefix = self._images.join(stem + ".")
        # Image names sort between "<stem>.JPEG" and "<stem>.webp" (the largest, in any letter case).
        last = prefix.key + "webp"
        for info in list_objects(self._client, prefix, start_after=prefix.key + "JPE"):
            if info.key > last:
                return False
            ext = info.key[len(prefix.key):]
            if "/" not in ext and "." not in ext and "." + ext.lower() in IMAGE_EXTENSIONS:
                return True
        return False

    def where(self, sub: str, rel: str) -> str:
        return str(self._url(sub, rel))

    def _url(self, sub: str, rel: str) -> S3Url:
        return (self._images if sub == IMAGES_DIR else self._captions).join(rel)

    def exists(self, sub: str, rel: str) -> bool:
        return object_exists(self._client, self._url(sub, rel))

    def read_bytes(self, sub: str, rel: str) -> bytes:
        return read_object(self._client, self._url(sub, rel))


class DirectorySource:
    """Reads ``images/`` + ``captions/`` paired by file stem, on disk or in a bucket (see the module docstring)."""

    def __init__(self, input_dir: str, *, s3_endpoint_url: str | None = None, s3_profile: str | None = None) -> None:
        if is_s3_url(input_dir):
            self._folder: _LocalFolder | _S3Folder = _S3Folder(input_dir, s3_endpoint_url, s3_profile)
        else:
            self._folder = _LocalFolder(input_dir)
        self.root = self._folder.root

    def describe(self) -> dict:
        return {"type": "directory", "input_dir": self.root} | self._folder.extra

    def list_ids(self) -> Iterator[str]:
        # Both streams are in order, so the merge is lazy.
        return heapq.merge(self._folder.image_ids(), self._folder.caption_only_ids())

    def read(self, ids: Sequence[str]) -> Iterator[SourceSample]:
        for source_id in ids:
            if source_id.startswith(CAPTION_ONLY_PREFIX):
                yield self._read_caption_only(source_id)
            else:
                yield self._read_image(source_id)

    def _read_caption_only(self, source_id: str) -> SourceSample:
        rel = unescape_id(source_id[len(CAPTION_ONLY_PREFIX):])
        caption_path = self._folder.where(CAPTIONS_DIR, rel)
        if not self._folder.exists(CAPTIONS_DIR, rel):
            return rejected(source_id, "source_missing", f"{caption_path} no longer exists")
        stem = os.path.splitext(rel)[0]
        return rejected(
            source_id,
            "missing_image",
            f"{caption_path} has no image {IMAGES_DIR}/{stem}.{{jpg,jpeg,png,webp}}",
        )

    def _read_image(self, source_id: str) -> SourceSample:
        rel = unescape_id(source_id)
        image_path = self._folder.where(IMAGES_DIR, rel)
        try:
            image = self._folder.read_bytes(IMAGES_DIR, rel)
        except StorageUnavailableError:
            raise  # the store, not the sample: the unit fails and its task can run again
        except FileNotFoundError:
            return rejected(source_id, "source_missing", f"{image_path} no longer exists")
        except OSError as exc:
            return rejected(source_id, "source_read_error", f"{image_path}: {exc}")

        caption_rel = os.path.splitext(rel)[0] + CAPTION_EXTENSION
        caption_path = self._folder.where(CAPTIONS_DIR, caption_rel)
        try:
            data = self._folder.read_bytes(CAPTIONS_DIR, caption_rel)
        except StorageUnavailableError:
            raise
        except FileNotFoundError:
            return rejected(source_id, "missing_caption", f"no caption file {caption_path}", image=image)
        except OSError as exc:
            return rejected(source_id, "source_read_error", f"{caption_path}: {exc}", image=image)
        try:
            caption = decode_caption_bytes(data, caption_path)
        except RejectError as exc:
            return SourceSample(source_id, image, None, exc)
        return SourceSample(source_id, image, caption)
