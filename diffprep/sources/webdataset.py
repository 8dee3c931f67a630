"""WebDataset tar shards on local disk or in S3-compatible storage: ``source.input_path`` is a glob
(``/data/shards/*.tar``, ``s3://bucket/shards/*.tar``), brace expansion allowed
(``/data/shard-{000..099}.tar``). In a bucket, wildcards match within one ``/``-separated part
and ``**`` spans parts, as a local glob does.

Members are grouped into samples by webdataset's own rule (``base_plus_ext``
in ``webdataset.tariterators``): the key is the member path up to the first dot
of its base name, directories included, and the extension is everything after
that dot, lower-cased. So ``pics/img.001.jpg`` has key ``pics/img`` and
extension ``001.jpg`` (not ``jpg``): name such a member with
``source.image_key: 001.jpg``. Members whose base name has no dot or starts
with one, webdataset's ``__meta__`` names, and non-regular members (links,
folders) are not part of any sample, as in webdataset. Unlike webdataset, all
members of one key within a shard form one sample even when they are not
adjacent (a sample id must be unique); a repeated extension is a
``duplicate_member`` reject.

Ids are ``<shard path relative to the glob's fixed folder>/<key>`` (the fixed
folder of ``s3://bucket/shards/*.tar`` is ``s3://bucket/shards/``), so the same
tars give the same ids on disk and in a bucket. Listing (``list_entries``)
gives each id the byte span of its members in its shard, and reads several
shards at once (threads), in the shards' order. ``read`` goes through each
needed shard once and keeps only the requested samples; given the spans, it
reads a shard only from the unit's first member to its last (in a bucket:
ranged GETs of that part; without spans, each needed shard is downloaded
again). Listing a local shard reads its tar headers only (seeking past the
data); an object in a bucket is listed as a forward-only stream, so listing
downloads each shard once (never held in memory or written to disk). Ranged
GETs of the headers alone would save that for shards of large members; for
the small image members of a source shard the reads are mostly the data
anyway.

Member names are never used as file paths (nothing is extracted); a key with a
``..`` component or an absolute path is still listed, and read as an
``unsafe_member_path`` reject so it shows up in the audit.

Media: a sample holding a clip member (mp4, webm, mov, mkv; the first of those)
is a clip sample (``SourceSample.video``), even beside an image member, which is
then taken for a thumbnail; else the first of jpg, jpeg, png, webp, gif, bmp,
tif, tiff, avif is its image. ``source.video_key`` / ``source.image_key``
(extensions) name the members instead: only the named ones are looked at, the
clip's first. A sample with none of them is an ``unsupported_format`` reject
when it has a member that could be media (``photo.heic``: not a caption, json
or class member), listing the formats read, else a ``missing_image`` reject;
both name its members.

Caption: ``source.caption_key`` (an extension such as ``txt``, or
``json.prompt`` for a field of the json member), else txt, then caption, then
the json member's caption, text or prompt field.
"""

from __future__ import annotations

import glob
import io
import json
import logging
import os
import re
import tarfile
from array import array
from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from itertools import islice
from typing import Any

import braceexpand

from diffprep.errors import RejectError, SourceError
from diffprep.sources.base import (
    SourceSample,
    decode_caption_bytes,
    escape_id,
    is_missing,
    lookup_path,
    normalize_caption,
    reject,
    rejected,
    unescape_id,
    unsupported,
)
from diffprep.sources.storage import (
    READ_BUFFER,
    RangedObject,
    S3Url,
    StorageUnavailableError,
    glob_objects,
    is_s3_url,
    open_object,
    parse_s3_url,
    s3_client,
)
from diffprep.sources.tar_headers import TarMember, file_members, stream_members

IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp", "gif", "bmp", "tif", "tiff", "avif")
VIDEO_EXTENSIONS = ("mp4", "webm", "mov", "mkv")
CAPTION_EXTENSIONS = ("txt", "caption")
# Members that are not media: a sample with none of the media members and one of something else is
# unsupported_format (a photo.heic member), not missing_image.
_NOT_MEDIA = frozenset({*CAPTION_EXTENSIONS, "json", "cls", "cls2", "id", "key", "url", "meta"})
JSON_CAPTION_FIELDS = ("caption", "text", "prompt")
# Shards listed at once (threads: a local shard's listing waits on its headers' reads, a bucket's on the network).
LIST_WORKERS = min(8, os.cpu_count() or 1)
log = logging.getLogger(__name__)

# Copied from webdataset.tariterators (base_plus_ext and tar_file_iterator's
# skip_meta) so that listing does not import webdataset, which imports torch;
# a test checks both against the installed package.
_BASE_PLUS_EXT = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")
_META = re.compile(r"__[^/]*__($|/)")
_GLOB_MAGIC = re.compile(r"[*?\[{]")
_JSON_FIELD_KEY = re.compile(r"^(.*?json)\.(.+)$", re.IGNORECASE)


def split_member_name(name: str) -> tuple[str, str] | None:
    """``(key, lower-cased extension)`` of a tar member by webdataset's rule, or None when it has no sample."""
    if _META.match(name) or ("/" not in name and name.startswith("__") and name.endswith("__")):
        return None
    match = _BASE_PLUS_EXT.match(name)
    if not match:
        return None
    return match.group(1), match.group(2).lower()


def is_unsafe_key(key: str) -> bool:
    return key.startswith("/") or ".." in key.split("/")


def _regular_members(tar: tarfile.TarFile) -> Iterator[tarfile.TarInfo]:
    """Iterate members without keeping them: TarFile remembers every member it has seen otherwise."""
    while (member := tar.next()) is not None:
        tar.members = []
        if member.isreg():
            yield member


def _fixed_folder(pattern: str) -> list[str]:
    """The ``/``-separated parts of a glob before its first part with a wildcard or brace (the file excluded)."""
    fixed = []
    for part in pattern.split("/")[:-1]:
        if _GLOB_MAGIC.search(part):
            break
        fixed.append(part)
    return fixed


class _LocalShards:
    """Tar files on disk, opened seekable: listing reads their headers only."""

    def __init__(self, input_path: str) -> None:
        pattern = os.path.abspath(os.path.expanduser(input_path))
        self.base = "/".join(_fixed_folder(pattern)) or "/"
        paths = {p for expanded in braceexpand.braceexpand(pattern) for p in glob.glob(expanded, recursive=True)}
        self.shards = sorted(escape_id(os.path.relpath(p, self.base)) for p in paths if os.path.isfile(p))
        if not self.shards:
            raise SourceError(f"source.input_path {input_path!r} matches no file (looked for {pattern})")
        self.extra: dict = {}

    def where(self, shard: str) -> str:
        return os.path.join(self.base, unescape_id(shard))

    def is_shard(self, name: str) -> bool:
        return os.path.isfile(self.where(name))

    def members(self, shard: str) -> Iterator[TarMember]:
        """The shard's regular members, headers only (``tarfile.open(..., "r:*")``'s, read fast)."""
        return file_members(self.where(shard), "r:*")

    @contextmanager
    def open_tar(self, shard: str) -> Iterator[tarfile.TarFile]:
        with tarfile.open(self.where(shard), "r:*") as tar:
            yield tar

    @contextmanager
    def open_span(self, shard: str, start: int, end: int) -> Iterator[tuple[tarfile.TarFile, int]]:
        """The tar positioned at ``start`` (a member's header), and the offset where the span ends in it."""
        with self.open_tar(shard) as tar:
            if start > 0:  # opening read the shard's first member: go back to the span's first header
                tar.firstmember, tar.offset = None, start
            yield tar, end


class _S3Shards:
    """Tar objects in a bucket, each read as one forward-only GET stream (nothing is written to disk)."""

    def __init__(self, input_path: str, endpoint_url: str | None, profile: str | None) -> None:
        pattern = parse_s3_url(input_path, "source.input_path")
        self._client = s3_client(endpoint_url, profile)
        fixed = "/".join(_fixed_folder(pattern.key))
        self._folder = S3Url(pattern.bucket, fixed + "/" if fixed else "")
        self.base = str(self._folder)
        start = len(self._folder.key)
        self.shards = sorted(escape_id(info.key[start:]) for info in glob_objects(self._client, pattern))
        if not self.shards:
            raise SourceError(
                f"source.input_path {input_path!r} matches no object (listed {self.base} at "
                f"{self._client.meta.endpoint_url})"
            )
        self._names = frozenset(self.shards)
        for name in self.shards:  # a key can be a "folder" of other keys; a file cannot
            for slash in (i for i, char in enumerate(name) if char == "/"):
                if name[:slash] in self._names:
                    raise SourceError(
                        f"source.input_path {input_path!r} matches {self.where(name[:slash])} and "
                        f"{self.where(name)}, which lies under it: sample ids would be ambiguous; narrow the glob"
                    )
        self.extra = {"s3_endpoint_url": endpoint_url, "s3_profile": profile}

    def where(self, shard: str) -> str:
        return str(self._folder.join(unescape_id(shard)))

    def is_shard(self, name: str) -> bool:
        return name in self._names  # a shard deleted since listing fails at GET (FileNotFoundError)

    def members(self, shard: str) -> Iterator[TarMember]:
        """The shard's regular members from one GET stream (``tarfile.open(..., "r|*")``'s, read fast)."""
        with open_object(self._client, self._folder.join(unescape_id(shard))) as stream:
            yield from stream_members(stream, "r|*")

    @contextmanager
    def open_tar(self, shard: str) -> Iterator[tarfile.TarFile]:
        stream = open_object(self._client, self._folder.join(unescape_id(shard)))
        with stream, tarfile.open(fileobj=stream, mode="r|*") as tar:
            yield tar

    @contextmanager
    def open_span(self, shard: str, start: int, end: int) -> Iterator[tuple[tarfile.TarFile, int]]:
        """The span's bytes as a tar stream of their own (ranged GETs from ``start``; its offsets count from
        there), and the offset where the span ends in it."""
        raw = RangedObject(self._client, self._folder.join(unescape_id(shard)))
        raw.seek(start)
        stream = io.BufferedReader(raw, max(1, min(READ_BUFFER, end - start)))
        with stream, tarfile.open(fileobj=stream, mode="r|") as tar:
            yield tar, end - start


@dataclass
class _Collected:
    parts: dict[str, bytes] = field(default_factory=dict)
    duplicates: list[str] = field(default_factory=list)


@dataclass
class _ShardRead:
    found: dict[str, _Collected] = field(default_factory=dict)
    error: str | None = None  # the read error that stopped the pass over the shard
    missing: bool = False  # the shard was gone when it was opened (or while it was read, in a bucket)


class WebDatasetSource:
    """Samples of WebDataset tar shards on disk or in a bucket (see the module docstring)."""

    def __init__(self, input_path: str, image_key: str | None = None, caption_key: str | None = None, *,
                 video_key: str | None = None, s3_endpoint_url: str | None = None,
                 s3_profile: str | None = None) -> None:
        if is_s3_url(input_path):
            self._store: _LocalShards | _S3Shards = _S3Shards(input_path, s3_endpoint_url, s3_profile)
        elif "://" in input_path:
            raise SourceError(
                f"source.input_path {input_path!r}: the webdataset source reads local tar files or s3:// URLs; "
                f"copy or mount the shards and give a local glob, or give s3://bucket/prefix/*.tar"
            )
        else:
            self._store = _LocalShards(input_path)
        self.input_path = input_path
        self.base = self._store.base
        self.shards = self._store.shards
        self.image_key = image_key.lower() if image_key else None
        self.video_key = video_key.lower() if video_key else None
        self.caption_key = caption_key

    def describe(self) -> dict:
        return {
            "type": "webdataset",
            "input_path": self.input_path,
            "base": self.base,
            "num_shards": len(self.shards),
            "image_key": self.image_key,
            "video_key": self.video_key,
            "caption_key": self.caption_key,
        } | self._store.extra

    def list_entries(self) -> Iterator[tuple[str, list[int]]]:
        """Each id with ``[start, end]``: the byte offsets of its first member's header and past its last member
        in its shard. Shards are listed ``LIST_WORKERS`` at a time in threads (their headers, or in a bucket their
        streams), each held (its keys and an array of offsets) only until it is yielded; the order is the shards'
        own."""
        with ThreadPoolExecutor(max_workers=LIST_WORKERS, thread_name_prefix="diffprep-list") as pool:
            shards = iter(self.shards)
            window = deque(pool.submit(self._list_shard, shard) for shard in islice(shards, LIST_WORKERS))
            try:
                while window:
                    keys, spans = window.popleft().result()
                    window.extend(pool.submit(self._list_shard, shard) for shard in islice(shards, 1))
                    prefix = keys.pop()  # the shard's own name and its slash
                    for index, key in enumerate(keys):
                        yield prefix + escape_id(key), [spans[2 * index], spans[2 * index + 1]]
            finally:
                for future in window:
                    future.cancel()

    def list_ids(self) -> Iterator[str]:
        return (source_id for source_id, _ in self.list_entries())

    def _list_shard(self, shard: str) -> tuple[list[str], array]:
        """The shard's sample keys in first-seen order (then ``<shard>/``), and their spans flat in an array:
        ``start, end`` per key (a third of the memory of an id and a list per sample, while it waits its turn)."""
        spans: dict[str, list[int]] = {}  # key -> [first header, end of its last member], in first-seen order
        try:
            for member in self._store.members(shard):  # headers only, without tarfile's per-header cost
                split = split_member_name(member.name)
                if split is not None:
                    end = member.offset_data + -(-member.size // tarfile.BLOCKSIZE) * tarfile.BLOCKSIZE
                    spans.setdefault(split[0], [member.offset, end])[1] = end
        except StorageUnavailableError:
            raise  # the store, not the shard: running again can help
        except (OSError, tarfile.TarError) as exc:
            raise SourceError(f"cannot list shard {self._store.where(shard)}: {exc}") from exc
        return [*spans, f"{shard}/"], array("q", (offset for span in spans.values() for offset in span))

    def _split_id(self, source_id: str, cache: dict[str, bool]) -> tuple[str | None, str]:
        """``(shard, key)`` of an id; shard is None when no prefix of the id is a shard any more.

        The shard is the one prefix (at a ``/``) that is a shard: a shard is never also a folder
        holding another shard (a file cannot be; in a bucket the listing refuses it), so the split
        is unambiguous.
        """
        start = 0
        while (slash := source_id.find("/", start)) != -1:
            prefix = source_id[:slash]
            if prefix not in cache:
                cache[prefix] = self._store.is_shard(prefix)
            if cache[prefix]:
                return prefix, unescape_id(source_id[slash + 1:])
            start = slash + 1
        return None, ""

    def read(self, ids: Sequence[str], at: Sequence[Any] | None = None) -> Iterator[SourceSample]:
        """One sample per id; each needed shard read once. With ``at`` (``list_entries``' spans, parallel to
        ``ids``) a local shard is read from the first span's start to the last one's end only; where the members
        are not all found there (the shard changed since planning), the whole shard is read, as without."""
        if at is not None and len(at) != len(ids):
            raise SourceError(f"{len(at)} positions for {len(ids)} ids under {self.base}: the unit's plan is damaged; "
                              "plan the run again")
        cache: dict[str, bool] = {}
        located = [self._split_id(source_id, cache) for source_id in ids]
        last_use = {shard: pos for pos, (shard, _) in enumerate(located)}
        collected: dict[str | None, _ShardRead] = {None: _ShardRead()}
        pos = 0
        for shard in dict.fromkeys(s for s, _ in located):  # shards in order of first use
            if shard is not None:
                wanted = {key for s, key in located if s == shard and not is_unsafe_key(key)}
                span = self._span([at[i] for i, (s, _) in enumerate(located) if s == shard]) if at else None
                collected[shard] = self._collect(shard, wanted, span)
            # Yield every id whose shard has been read; drop a shard's samples after its last id.
            while pos < len(ids) and located[pos][0] in collected:
                shard_of_id = located[pos][0]
                yield self._sample(ids[pos], *located[pos], collected[shard_of_id])
                if shard_of_id is not None and last_use[shard_of_id] == pos:
                    del collected[shard_of_id]
                pos += 1

    def _span(self, positions: list[Any]) -> tuple[int, int] | None:
        """The byte range of a shard holding these spans; None when one is missing or not a span."""
        try:
            spans = [(int(start), int(end)) for start, end in positions]
        except (TypeError, ValueError):
            return None
        return min(start for start, _ in spans), max(end for _, end in spans)

    def _collect(self, shard: str, wanted: set[str], span: tuple[int, int] | None = None) -> _ShardRead:
        """Members of the wanted keys in one pass over the shard (or its ``span``), and what stopped the pass."""
        if span is not None:
            result = self._collect_pass(shard, wanted, span)
            if result.error is None and not result.missing and wanted <= result.found.keys():
                return result
            log.info("%s: the members planned at bytes %d-%d are not all there any more: reading the whole shard",
                     self._store.where(shard), *span)
        return self._collect_pass(shard, wanted, None)

    @contextmanager
    def _open(self, shard: str, span: tuple[int, int] | None) -> Iterator[tuple[tarfile.TarFile, int | None]]:
        """The shard's tar from its start (no end), or from its span's start (and where the span ends in it)."""
        if span is None:
            with self._store.open_tar(shard) as tar:
                yield tar, None
        else:
            with self._store.open_span(shard, *span) as opened:
                yield opened

    def _collect_pass(self, shard: str, wanted: set[str], span: tuple[int, int] | None) -> _ShardRead:
        result = _ShardRead()
        try:
            with self._open(shard, span) as (tar, end):
                for member in _regular_members(tar):
                    if end is not None and member.offset >= end:
                        break
                    split = split_member_name(member.name)
                    if split is None or split[0] not in wanted:
                        continue
                    key, ext = split
                    sample = result.found.setdefault(key, _Collected())
                    if ext in sample.parts:
                        sample.duplicates.append(member.name)
                        continue
                    extracted = tar.extractfile(member)
                    assert extracted is not None  # regular members always have data
                    sample.parts[ext] = extracted.read()
        except StorageUnavailableError:
            raise  # not the samples' fault: the unit fails and its task can run again
        except FileNotFoundError:
            result.missing = True
        except (OSError, tarfile.TarError) as exc:
            result.error = f"{type(exc).__name__}: {exc}"
        return result

    def _sample(self, source_id: str, shard: str | None, key: str, shard_read: _ShardRead) -> SourceSample:
        if shard is None:
            return rejected(source_id, "source_missing", f"its shard under {self.base} no longer exists")
        where = f"{self._store.where(shard)}:{key}"
        if is_unsafe_key(key):
            return rejected(source_id, "unsafe_member_path", f"{where}: member path is absolute or has '..'")
        sample = shard_read.found.get(key)
        if sample is None:
            if shard_read.missing:
                return rejected(source_id, "source_missing", f"{where}: the shard no longer exists")
            if shard_read.error is not None:
                return rejected(source_id, "source_read_error", f"{where}: shard stopped reading: {shard_read.error}")
            return rejected(source_id, "source_missing", f"{where}: no member with this key any more")
        if sample.duplicates:
            return rejected(source_id, "duplicate_member", f"{where}: repeated member(s) {sample.duplicates}")
        parts = sample.parts
        media = self._media(parts)
        if media is None:
            # A dotted member of a format read (img.001.jpg) is missing_image: its message says how to name it.
            known = {*_NOT_MEDIA, *IMAGE_EXTENSIONS, *VIDEO_EXTENSIONS}
            other = sorted(ext for ext in parts
                           if ext.rpartition(".")[2] not in known and ext != (self.caption_key or "").lower())
            if other and not (self.video_key or self.image_key):
                error = unsupported(f"{where}: members {other}", "." + other[0].rpartition(".")[2])
                return SourceSample(source_id, None, None, error)
            return rejected(source_id, "missing_image",
                            f"{where}: no {self._media_wanted()} member; members are {sorted(parts)}")
        is_video, data = media

        def sample_of(caption: str | None, error: RejectError | None = None) -> SourceSample:
            if is_video:
                return SourceSample(source_id, None, caption, error, video=data)
            return SourceSample(source_id, data, caption, error)

        try:
            return sample_of(self._caption(parts, where))
        except RejectError as exc:
            return sample_of(None, exc)

    def _media(self, parts: dict[str, bytes]) -> tuple[bool, bytes] | None:
        """``(is a clip, bytes)`` of the sample's clip or image member: the named ones, else clips, then images."""
        if self.video_key or self.image_key:
            wanted = [(key, is_video) for key, is_video in ((self.video_key, True), (self.image_key, False)) if key]
        else:
            wanted = [(ext, True) for ext in VIDEO_EXTENSIONS] + [(ext, False) for ext in IMAGE_EXTENSIONS]
        return next(((is_video, parts[ext]) for ext, is_video in wanted if ext in parts), None)

    def _media_wanted(self) -> str:
        if self.video_key or self.image_key:
            return " or ".join(repr(key) for key in (self.video_key, self.image_key) if key)
        return "image or clip"

    def _caption(self, parts: dict[str, bytes], where: str) -> str:
        if self.caption_key:
            match = _JSON_FIELD_KEY.match(self.caption_key)
            ext, path = (match.group(1).lower(), match.group(2).split(".")) if match else (self.caption_key.lower(), [])
            if ext in parts:
                if not path:
                    return decode_caption_bytes(parts[ext], f"{where}.{ext}")
                value = lookup_path(parts[ext], path)
                if not is_missing(value):
                    return normalize_caption(value, f"{where}.{ext} {'.'.join(path)}")
            raise reject("missing_caption", f"{where}: no {self.caption_key!r}; members are {sorted(parts)}")
        for ext in CAPTION_EXTENSIONS:
            if ext in parts:
                return decode_caption_bytes(parts[ext], f"{where}.{ext}")
        if "json" in parts:
            try:
                meta = json.loads(parts["json"])
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise reject("caption_decode_error", f"{where}.json is not valid JSON: {exc}") from None
            for name in JSON_CAPTION_FIELDS:
                value = lookup_path(meta, [name])
                if not is_missing(value):
                    return normalize_caption(value, f"{where}.json {name}")
        raise reject(
            "missing_caption",
            f"{where}: no txt or caption member nor json caption/text/prompt field; members are {sorted(parts)}",
        )
