"""A folder of images and/or clips with one caption file per sample, on disk or under an ``s3://bucket/prefix``.

Layout::

    <input_dir>/images/<relpath>/<stem>.<ext>     ext: jpg jpeg png webp gif bmp tif tiff avif, any letter case
    <input_dir>/videos/<relpath>/<stem>.<ext>     ext: mp4 webm mov mkv, any letter case
    <input_dir>/captions/<relpath>/<stem>.txt     any letter case; UTF-8 (a BOM is dropped), whitespace stripped

A dataset holds ``images/``, ``videos/`` or both, and ``captions/``. Sub-folders
under ``images/`` and ``videos/`` are mirrored under ``captions/``. The id of a
sample is its file's path relative to ``images/`` or ``videos/`` with forward
slashes (``sub/cat.JPG``, ``clips/walk.mp4``): an image id ends in an image
extension and a clip id in a video extension, so the two never collide, and
image ids are what they were before clips were read. Files with the same stem
and different extensions (``a.jpg``, ``a.png``, ``a.mp4``) are separate
samples, all captioned by ``a.txt``; a clip sample carries the file bytes in
``SourceSample.video``. A caption with neither an image nor a clip of its stem
is listed as ``caption-only:<relpath>.txt`` and read as a ``missing_image``
reject (its detail names both folders); an image or clip without a caption file
is a ``missing_caption`` reject. An empty caption file is a valid empty caption.

Every other file in the three folders is a named reject, listed after the
samples (sorted) as ``other:<folder>/<relpath>``: a format no reader here
decodes (``photo.heic``, ``notes.md``, a clip in ``images/``) is
``unsupported_format`` naming the formats that are read; a second spelling
of a caption (``a.TXT`` beside ``a.txt``) is ``duplicate_caption`` (the
caption is ``.txt``, else the first other spelling in byte order). Dot files
(``.DS_Store``) and desktop metadata (``Thumbs.db``, ``desktop.ini``) are
nobody's data and are skipped. The other files are held in memory until the
listing ends (the plan holds every id anyway).

Ids are listed in bytewise order of the id, walking one directory at a time:
each directory's entries are sorted (sub-folders as ``name/``), which gives the
global order without collecting the whole tree; the image, clip and
caption-only streams are each in that order and merged lazily. Symlinked
sub-folders (they could loop) and dangling symlinks are skipped; symlinked
files are read.

In a bucket the same files give the same ids; they come in the store's key
order, which is the same order unless a key holds ``%`` or a control
character. A bucket has no folders: ``captions/`` must hold at least one
object, and so must ``images/`` or ``videos/``. Listing costs two listings of
``images/``, two of ``videos/`` (each only when it holds objects) and one of
``captions/`` (1000 keys a request), whatever the number of sub-folders; a
sample whose caption is spelled other than ``.txt`` costs one more listing when
it is read.
"""

from __future__ import annotations

import heapq
import os
from collections import OrderedDict
from collections.abc import Iterator, Sequence

from diffprep.errors import RejectError, SourceError
from diffprep.sources.base import (
    CAPTION_EXTENSION,
    CAPTION_SPELLINGS,
    IMAGE_EXTENSIONS,
    VIDEO_EXTENSIONS,
    SourceSample,
    decode_caption_bytes,
    escape_id,
    is_caption_name,
    is_ignored_name,
    is_image_name,
    is_video_name,
    reject,
    rejected,
    file_stamp,
    unescape_id,
    unsupported,
)
from diffprep.sources.storage import (
    S3Url,
    StorageUnavailableError,
    has_objects,
    is_s3_url,
    list_objects,
    object_exists,
    object_stamp,
    parse_s3_url,
    read_object,
    s3_client,
)

IMAGES_DIR = "images"
VIDEOS_DIR = "videos"
CAPTIONS_DIR = "captions"
CAPTION_ONLY_PREFIX = "caption-only:"
OTHER_PREFIX = "other:"  # a file in one of the folders that is no sample: other:<folder>/<relpath>
# The media folders and the file extensions each one's samples have.
MEDIA_EXTENSIONS = {IMAGES_DIR: IMAGE_EXTENSIONS, VIDEOS_DIR: VIDEO_EXTENSIONS}
_LAYOUT_HINT = ("a directory source needs images/<name>.jpg|png|webp|gif|... and/or videos/<name>.mp4|webm|mov|mkv, "
                "with captions/<name>.txt side by side")


def _is_media_name(name: str, sub: str) -> bool:
    return os.path.splitext(name)[1].lower() in MEDIA_EXTENSIONS[sub]


def _media_folder(rel: str) -> str:
    """The folder an id (or its unescaped path) lies in: ``videos/`` for a clip name, ``images/`` otherwise."""
    return VIDEOS_DIR if is_video_name(rel) else IMAGES_DIR


class _Spellings:
    """The caption spellings of stems that have a media file, as a sorted walk meets them: a stem's spellings
    other than its caption (``CAPTION_SPELLINGS`` order) are the extra files. Only stems with a spelling other
    than ``.txt`` are held, each until the walk has passed every spelling of it."""

    def __init__(self, others: list[str]) -> None:
        self._pending: OrderedDict[str, list[str]] = OrderedDict()
        self._others = others

    def seen(self, rel_stem: str, ext: str, rel: str) -> None:
        while self._pending and next(iter(self._pending)) + CAPTION_EXTENSION < rel:
            self._settle(*self._pending.popitem(last=False))
        if rel_stem in self._pending:
            self._pending[rel_stem].append(ext)
        elif ext != CAPTION_EXTENSION:
            self._pending[rel_stem] = [ext]

    def close(self) -> None:
        while self._pending:
            self._settle(*self._pending.popitem(last=False))

    def _settle(self, rel_stem: str, exts: list[str]) -> None:
        chosen = min(exts, key=CAPTION_SPELLINGS.index)
        self._others.extend(f"{OTHER_PREFIX}{CAPTIONS_DIR}/{rel_stem}{ext}" for ext in exts if ext != chosen)


def _caption_of(present: list[str]) -> str | None:
    """The spelling that captions a stem among those ``present``."""
    return min(present, key=CAPTION_SPELLINGS.index) if present else None


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
    """``images/``, ``videos/`` and ``captions/`` on disk."""

    def __init__(self, input_dir: str, captions_optional: bool = False) -> None:
        self.root = os.path.abspath(os.path.expanduser(input_dir))
        self.captions_root = os.path.join(self.root, CAPTIONS_DIR)
        if not os.path.isdir(self.root):
            raise SourceError(f"source.input_dir {input_dir!r} is not a folder (resolved to {self.root})")
        self.media = [sub for sub in MEDIA_EXTENSIONS if os.path.isdir(os.path.join(self.root, sub))]
        if not self.media:
            raise SourceError(f"source.input_dir {self.root} has no images/ or videos/ folder; {_LAYOUT_HINT}")
        if not os.path.isdir(self.captions_root) and not captions_optional:
            raise SourceError(f"source.input_dir {self.root} has no captions/ folder; {_LAYOUT_HINT}")
        self.extra: dict = {}
        self.others: list[str] = []  # the ids of files that are no sample, found by the listing so far

    def media_ids(self, sub: str) -> Iterator[str]:
        for rel, name in _walk_files(os.path.join(self.root, sub)):
            if _is_media_name(name, sub):
                yield rel
            elif not is_ignored_name(name):
                self.others.append(f"{OTHER_PREFIX}{sub}/{rel}")

    def caption_only_ids(self) -> Iterator[str]:
        stems_by_dir: OrderedDict[str, frozenset[str]] = OrderedDict()
        spellings = _Spellings(self.others)
        for rel, name in _walk_files(self.captions_root):
            stem, ext = os.path.splitext(name)
            if not is_caption_name(name):
                if not is_ignored_name(name):
                    self.others.append(f"{OTHER_PREFIX}{CAPTIONS_DIR}/{rel}")
                continue
            reldir = rel.rpartition("/")[0]
            if reldir not in stems_by_dir:
                stems_by_dir[reldir] = self._media_stems(reldir)
                if len(stems_by_dir) > 64:  # a folder's files can be split by its sub-folders; keep a few
                    stems_by_dir.popitem(last=False)
            if stem not in stems_by_dir[reldir]:
                yield CAPTION_ONLY_PREFIX + rel
            else:
                spellings.seen(rel[:-len(ext)], ext, rel)
        spellings.close()

    def find_caption(self, rel_stem: str) -> str | None:
        """The caption file of a stem spelled other than ``.txt`` (``a.TXT``), relative to ``captions/``."""
        folder, base = os.path.split(self.where(CAPTIONS_DIR, rel_stem + CAPTION_EXTENSION))
        base = base[:-len(CAPTION_EXTENSION)]
        # Asked when <stem>.txt is not there (or of a second spelling): a case-insensitive file system then has
        # no spelling at all, so each spelling found is a file of its own.
        present = [ext for ext in CAPTION_SPELLINGS if os.path.isfile(os.path.join(folder, base + ext))]
        chosen = _caption_of(present)
        return None if chosen is None else rel_stem + chosen

    def _media_stems(self, escaped_reldir: str) -> frozenset[str]:
        stems: set[str] = set()
        for sub in self.media:
            folder = os.path.join(self.root, sub, unescape_id(escaped_reldir))
            try:
                with os.scandir(folder) as it:
                    stems.update(os.path.splitext(e.name)[0] for e in it if _is_media_name(e.name, sub) and e.is_file())
            except (FileNotFoundError, NotADirectoryError):
                pass
        return frozenset(stems)

    def where(self, sub: str, rel: str) -> str:
        if any(part in ("", ".", "..") for part in rel.split("/")):
            raise ValueError(f"{escape_id(rel)!r} is not an id listed by the directory source {self.root}")
        return os.path.join(self.root, sub, rel)

    def exists(self, sub: str, rel: str) -> bool:
        return os.path.isfile(self.where(sub, rel))

    def stamp(self, sub: str, rel: str) -> str:
        return file_stamp(self.where(sub, rel))

    def read_bytes(self, sub: str, rel: str) -> bytes:
        with open(self.where(sub, rel), "rb") as f:
            return f.read()


def _extension_range(extensions: frozenset[str]) -> tuple[str, str]:
    """Bounds of every letter-case spelling of ``extensions`` (without dots): (just below the least, the greatest)."""
    least = min(ext[1:].upper() for ext in extensions)
    return least[:-1], max(ext[1:].lower() for ext in extensions)


class _S3Folder:
    """``images/``, ``videos/`` and ``captions/`` under an ``s3://`` prefix.

    The listings come in key order, and a caption ``<stem>.txt`` sorts where
    the media files ``<stem>.<ext>`` do, so one forward walk over a second
    listing of the media folders finds each caption's image or clip with
    nothing held in memory. The one exception, a stem that is another stem plus
    a dot (``a`` and ``a.b``), can make the walk step past a file: a caption it
    finds no media file for is checked by a listing of ``images/<stem>.`` and
    ``videos/<stem>.`` (rare: only captions without media, or with such stems,
    cost those requests).
    """

    def __init__(self, input_dir: str, endpoint_url: str | None, profile: str | None) -> None:
        url = parse_s3_url(input_dir, "source.input_dir")
        self._client = s3_client(endpoint_url, profile)
        top = S3Url(url.bucket, url.key.rstrip("/"))
        self.root = str(top).rstrip("/")
        self._folders = {sub: top.join(sub + "/") for sub in (*MEDIA_EXTENSIONS, CAPTIONS_DIR)}
        if not has_objects(self._client, self._folders[CAPTIONS_DIR]):
            raise SourceError(
                f"source.input_dir {self.root} has no object under {self._folders[CAPTIONS_DIR]}; {_LAYOUT_HINT}"
            )
        self.media = [sub for sub in MEDIA_EXTENSIONS if has_objects(self._client, self._folders[sub])]
        if not self.media:
            raise SourceError(
                f"source.input_dir {self.root} has no object under {self._folders[IMAGES_DIR]} or "
                f"{self._folders[VIDEOS_DIR]}; {_LAYOUT_HINT}"
            )
        self.extra = {"s3_endpoint_url": endpoint_url, "s3_profile": profile}
        self.others: list[str] = []

    def _media_rels(self, sub: str, others: list[str] | None = None) -> Iterator[str]:
        folder = self._folders[sub]
        start = len(folder.key)
        for info in list_objects(self._client, folder):
            rel = info.key[start:]
            if _is_media_name(rel, sub):
                yield rel
            elif others is not None and not is_ignored_name(rel):
                others.append(f"{OTHER_PREFIX}{sub}/{escape_id(rel)}")

    def media_ids(self, sub: str) -> Iterator[str]:
        if sub not in self.media:
            return iter(())
        return (escape_id(rel) for rel in self._media_rels(sub, self.others))

    def caption_only_ids(self) -> Iterator[str]:
        media = heapq.merge(*((os.path.splitext(rel)[0] + "." for rel in self._media_rels(sub)) for sub in self.media))
        current = next(media, None)
        folder = self._folders[CAPTIONS_DIR]
        start = len(folder.key)
        spellings = _Spellings(self.others)
        for info in list_objects(self._client, folder):
            rel = info.key[start:]
            stem, ext = os.path.splitext(rel)
            if not is_caption_name(rel):
                if not is_ignored_name(rel):
                    self.others.append(f"{OTHER_PREFIX}{CAPTIONS_DIR}/{escape_id(rel)}")
                continue
            target = stem + "."
            while current is not None and current < target:
                current = next(media, None)
            if current != target and not self._has_media(stem):
                yield CAPTION_ONLY_PREFIX + escape_id(rel)
            else:
                spellings.seen(escape_id(stem), ext, escape_id(rel))
        spellings.close()

    def find_caption(self, rel_stem: str) -> str | None:
        """The caption object of a stem spelled other than ``.txt`` (one listing of ``captions/<stem>.``)."""
        prefix = self._folders[CAPTIONS_DIR].join(rel_stem + ".")
        below, greatest = _extension_range(frozenset({CAPTION_EXTENSION}))
        present = []
        for info in list_objects(self._client, prefix, start_after=prefix.key + below):
            if info.key > prefix.key + greatest:
                break
            ext = "." + info.key[len(prefix.key):]
            if ext in CAPTION_SPELLINGS:
                present.append(ext)
        chosen = _caption_of(present)
        return None if chosen is None else rel_stem + chosen

    def _has_media(self, stem: str) -> bool:
        return any(self._has_media_in(sub, stem) for sub in self.media)

    def _has_media_in(self, sub: str, stem: str) -> bool:
        prefix = self._folders[sub].join(stem + ".")
        # The names sort between every letter-case spelling of the folder's extensions.
        below, greatest = _extension_range(MEDIA_EXTENSIONS[sub])
        last = prefix.key + greatest
        for info in list_objects(self._client, prefix, start_after=prefix.key + below):
            if info.key > last:
                return False
            ext = info.key[len(prefix.key):]
            if "/" not in ext and "." not in ext and "." + ext.lower() in MEDIA_EXTENSIONS[sub]:
                return True
        return False

    def where(self, sub: str, rel: str) -> str:
        return str(self._folders[sub].join(rel))

    def exists(self, sub: str, rel: str) -> bool:
        return object_exists(self._client, self._folders[sub].join(rel))

    def stamp(self, sub: str, rel: str) -> str:
        return object_stamp(self._client, self._folders[sub].join(rel))

    def read_bytes(self, sub: str, rel: str) -> bytes:
        return read_object(self._client, self._folders[sub].join(rel))


class DirectorySource:
    """``images/`` and ``videos/`` with ``captions/`` paired by file stem, on disk or in a bucket (module docstring)."""

    def __init__(self, input_dir: str, *, s3_endpoint_url: str | None = None, s3_profile: str | None = None,
                 captions_optional: bool = False) -> None:
        # captions_optional: media without captions/ (a caption run, or an encode reading a caption set): a
        # sample without a caption file is still a missing_caption reject, which the caption set answers.
        if is_s3_url(input_dir):
            self._folder: _LocalFolder | _S3Folder = _S3Folder(input_dir, s3_endpoint_url, s3_profile)
        else:
            self._folder = _LocalFolder(input_dir, captions_optional)
        self.root = self._folder.root

    def describe(self) -> dict:
        return {"type": "directory", "input_dir": self.root} | self._folder.extra

    def media_path(self, source_id: str) -> str | None:
        """A media sample's file (a caption set's ``media_path``); None for an id that is no media file."""
        if source_id.startswith((CAPTION_ONLY_PREFIX, OTHER_PREFIX)):
            return None
        rel = unescape_id(source_id)
        return self._folder.where(_media_folder(rel), rel)

    def list_ids(self) -> Iterator[str]:
        # Every stream is in order, so the merge is lazy.
        found = False
        for source_id in heapq.merge(*(self._folder.media_ids(sub) for sub in MEDIA_EXTENSIONS),
                                     self._folder.caption_only_ids()):
            found = True
            yield source_id
        others = sorted(self._folder.others)
        self._folder.others.clear()
        if not found:
            listed = "".join(f"; it holds {len(others)} other files, e.g. "
                             f"{', '.join(o.removeprefix(OTHER_PREFIX) for o in others[:5])}" if others else "")
            raise SourceError(f"source.input_dir {self.root} holds no media file and no caption{listed}; "
                              f"{_LAYOUT_HINT}")
        yield from others

    def stamps(self, ids: Sequence[str]) -> dict[str, str]:
        """Each sample's files as they are now (a stat, or a HEAD in a bucket, per file): the media file and its
        caption (in whichever spelling it has), a caption-only or other file alone."""
        return {source_id: self._stamp(source_id) for source_id in ids}

    def _stamp(self, source_id: str) -> str:
        if source_id.startswith(CAPTION_ONLY_PREFIX):
            return self._folder.stamp(CAPTIONS_DIR, unescape_id(source_id[len(CAPTION_ONLY_PREFIX):]))
        if source_id.startswith(OTHER_PREFIX):
            sub, _, escaped = source_id[len(OTHER_PREFIX):].partition("/")
            return self._folder.stamp(sub, unescape_id(escaped))
        rel = unescape_id(source_id)
        stem = os.path.splitext(rel)[0]
        caption = self._folder.stamp(CAPTIONS_DIR, stem + CAPTION_EXTENSION)
        if caption == "-" and (found := self._folder.find_caption(stem)) is not None:
            caption = f"{found[len(stem):]}={self._folder.stamp(CAPTIONS_DIR, found)}"
        return f"{self._folder.stamp(_media_folder(rel), rel)} {caption}"

    def read(self, ids: Sequence[str]) -> Iterator[SourceSample]:
        for source_id in ids:
            if source_id.startswith(CAPTION_ONLY_PREFIX):
                yield self._read_caption_only(source_id)
            elif source_id.startswith(OTHER_PREFIX):
                yield self._read_other(source_id)
            else:
                yield self._read_media(source_id)

    def _read_caption_only(self, source_id: str) -> SourceSample:
        rel = unescape_id(source_id[len(CAPTION_ONLY_PREFIX):])
        caption_path = self._folder.where(CAPTIONS_DIR, rel)
        if not self._folder.exists(CAPTIONS_DIR, rel):
            return rejected(source_id, "source_missing", f"{caption_path} no longer exists")
        stem = os.path.splitext(rel)[0]
        return rejected(
            source_id,
            "missing_image",
            f"{caption_path} has no image {IMAGES_DIR}/{stem}.{{jpg,jpeg,png,webp,gif,bmp,tif,tiff,avif}} and no clip "
            f"{VIDEOS_DIR}/{stem}.{{mp4,webm,mov,mkv}}",
        )

    def _read_other(self, source_id: str) -> SourceSample:
        """A file in one of the folders that is no sample: why, by name."""
        sub, _, escaped = source_id[len(OTHER_PREFIX):].partition("/")
        rel = unescape_id(escaped)
        path = self._folder.where(sub, rel)
        if sub not in (*MEDIA_EXTENSIONS, CAPTIONS_DIR) or not self._folder.exists(sub, rel):
            return rejected(source_id, "source_missing", f"{path} no longer exists")
        if sub == CAPTIONS_DIR and is_caption_name(rel):
            chosen = self._folder.where(CAPTIONS_DIR, self._folder.find_caption(os.path.splitext(rel)[0]) or rel)
            return rejected(source_id, "duplicate_caption",
                            f"{path} is a second spelling of the caption {chosen}, which is the one read: remove one")
        if sub == IMAGES_DIR and is_video_name(rel):
            return rejected(source_id, "unsupported_format",
                            f"{path} is a clip in {IMAGES_DIR}/: move it to {VIDEOS_DIR}/")
        if sub == VIDEOS_DIR and is_image_name(rel):
            return rejected(source_id, "unsupported_format",
                            f"{path} is an image in {VIDEOS_DIR}/: move it to {IMAGES_DIR}/ (a thumbnail: remove it)")
        error = unsupported(path, rel)
        return SourceSample(source_id, None, None, error)

    def _read_media(self, source_id: str) -> SourceSample:
        rel = unescape_id(source_id)
        sub = _media_folder(rel)
        media_path = self._folder.where(sub, rel)

        def sample(media: bytes, caption: str | None, error: RejectError | None = None) -> SourceSample:
            if sub == VIDEOS_DIR:
                return SourceSample(source_id, None, caption, error, video=media)
            return SourceSample(source_id, media, caption, error)

        try:
            media = self._folder.read_bytes(sub, rel)
        except StorageUnavailableError:
            raise  # the store, not the sample: the unit fails and its task can run again
        except FileNotFoundError:
            return rejected(source_id, "source_missing", f"{media_path} no longer exists")
        except OSError as exc:
            return rejected(source_id, "source_read_error", f"{media_path}: {exc}")

        caption_rel = os.path.splitext(rel)[0] + CAPTION_EXTENSION
        caption_path = self._folder.where(CAPTIONS_DIR, caption_rel)
        try:
            data = self._folder.read_bytes(CAPTIONS_DIR, caption_rel)
        except StorageUnavailableError:
            raise
        except FileNotFoundError:
            data = None
        except OSError as exc:
            return sample(media, None, reject("source_read_error", f"{caption_path}: {exc}"))
        if data is None:  # a caption spelled a.TXT, or none
            found = self._folder.find_caption(os.path.splitext(rel)[0])
            if found is None:
                return sample(media, None, reject("missing_caption",
                                                  f"no caption file, in any letter case, {caption_path}"))
            caption_path = self._folder.where(CAPTIONS_DIR, found)
            try:
                data = self._folder.read_bytes(CAPTIONS_DIR, found)
            except StorageUnavailableError:
                raise
            except OSError as exc:
                return sample(media, None, reject("source_read_error", f"{caption_path}: {exc}"))
        try:
            caption = decode_caption_bytes(data, caption_path)
        except RejectError as exc:
            return sample(media, None, exc)
        return sample(media, caption)
