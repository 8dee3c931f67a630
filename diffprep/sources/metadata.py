"""A metadata file listing media files and their captions: the LTX trainer's ``dataset.json`` convention.

``source.metadata_file`` is a JSON list of objects (``.json``), one JSON object
per line (``.jsonl``, blank lines skipped) or a CSV file with a header row
(``.csv``), chosen by the file's extension; UTF-8, a leading BOM dropped. The
file may be local or ``s3://bucket/prefix/dataset.json``.

Columns: the caption is ``source.caption_key`` (``--caption-column``), default
``caption``. The media path is ``source.video_key`` (``--video-column``), else
``source.image_key``, else the first of ``video``, ``media_path``, ``image``
that the file has. A column that is named but absent, or no caption or media
column at all, is a ``SourceError`` naming the file and the columns it has; so
is a file that does not parse (naming the line).

Paths are resolved relative to the metadata file's folder, as the LTX trainer
does (``clips/a.mp4`` beside ``/data/dataset.json`` is ``/data/clips/a.mp4``;
beside ``s3://b/ds/dataset.json`` it is ``s3://b/ds/clips/a.mp4``). Absolute
paths and ``s3://`` URLs are taken as they are (``/abs`` is a local path even
in a bucket's metadata file); a relative path climbing out of the bucket is
an ``invalid_media_path`` reject. A path with an image extension (jpg, jpeg,
png, webp, gif, bmp, tif, tiff, avif) gives an image sample, one with a video
extension (mp4, webm, mov, mkv) a clip sample; a path naming an image format no
decoder here reads (heic, heif, jxl, svg, camera raw) is an
``unsupported_format`` reject listing the formats read, before it is read; any
other path follows its column (``image``: an image, otherwise a clip, whose
decoding then says what it is).

Ids are the media path as written in the row (escaped as ids are everywhere,
and ``#`` written ``%23``), in row order; a path that an earlier row already
used gets ``#<row>`` appended (``clips/a.mp4#7``: the 7th row, counted from 1),
and a row without a path is ``#<row>``. So ids stay the same when rows are
appended, and a row's id does not move when rows before it change unless they
hold the same path.

An audio-only file (LTX-2 T2A, the trainer's convention) names audio files in
the column ``source.audio_key`` (``--audio-column``), by default ``audio`` when
the file has none of the media columns above: every path of that column is an
audio sample (any file PyAV decodes: wav, flac, mp3, m4a, or a clip whose sound
is wanted), resolved like a clip's. An ``audio`` column beside a media column
is the clips' sound (below).

An IC-LoRA reference clip (LTX-2) is read from the column
``source.reference_key`` (``--reference-column``; the trainer's are
``reference_video`` and ``ref_media_path``) when it is set; its path resolves as
the media's, and a row without one, or whose file is missing, is a
``missing_reference`` / ``reference_not_found`` reject.

Beside a clip column, the trainer's other roles are read by their column names
when the file has them (``extra_columns``; ``SourceSample.extras``): ``audio``
(the clip's sound as a file of its own), ``reference_audio``, ``video_mask``,
``audio_mask``. Each resolves as the media path; a row without one is
``missing_<role>``, a path to no file ``<role>_not_found``. ``source.depth_key`` (``--depth-column``) names the
column of each clip's depth clip (Wan, ``extras["depth"]``): ``missing_depth`` / ``depth_not_found`` likewise.

``source.score_columns`` (``--score-column``) names columns of numbers copied
into the sample's meta as top-level fields (``diffprep.sources.scores``: a row
without a value leaves the field out, any other non-number is ``invalid_score``).

A row is a reject, never dropped: no path (``missing_media``), a path that is
not text (``invalid_media_path``), no file at the path (``media_not_found``),
a file that cannot be read (``source_read_error``), no caption or a null one
(``missing_caption``; an empty CSV cell or ``""`` is an empty caption, kept as
in the other sources), a caption that is not text (``invalid_caption``). An
id no row has any more (the file changed since planning) is ``source_missing``.
Captions are normalized as in every source (``sources/base.py``).

Listing (``list_entries``) is one streamed pass that gives each id where its
row is (byte offset, row number, line, CRC-32 of the row's bytes;
``sources/metadata_rows.py``); a unit's ``read(ids, at=...)`` parses only its
own rows there. A row not there as listed, byte for byte (the file changed),
is looked up by its id, as a plan without positions is: the file read whole
once per opened source. Opening checks every row and takes the columns (a CSV
file's header, every key of a JSONL file's rows: one streamed pass holding no
row, once per file and process), unless it is given the plan's description of
the source (``planned``), whose columns it takes instead: a unit's process
then reads nothing but its rows. In a bucket the file is streamed for
listing and checking, and a unit's rows are read by ranged GETs. A JSON list
cannot be streamed and is parsed whole on opening: keep it to a few million
rows, or write JSONL.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import posixpath
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, BinaryIO, TypeVar

from diffprep.errors import RejectError, SourceError
from diffprep.sources.base import (
    UNREADABLE_IMAGE_EXTENSIONS,
    Repeats,
    SourceSample,
    escape_id,
    file_stamp,
    is_image_name,
    is_video_name,
    normalize_caption,
    reject,
    rejected,
    unsupported,
)
from diffprep.sources.metadata_rows import (
    Opener,
    Record,
    file_columns,
    json_records,
    planned_columns,
    record_at,
    records,
)
from diffprep.sources.scores import check_score_columns, row_scores
from diffprep.sources.storage import (
    S3Url,
    StorageUnavailableError,
    is_s3_url,
    object_stamp,
    open_object,
    open_ranged,
    parse_s3_url,
    read_object,
    s3_client,
)

METADATA_FORMATS = (".json", ".jsonl", ".csv")
CAPTION_COLUMN = "caption"
MEDIA_COLUMNS = ("video", "media_path", "image")  # the first one the file has, when none is named
IMAGE_COLUMN = "image"
AUDIO_COLUMN = "audio"  # the LTX trainer's column of audio files (T2A), taken when no media column is there
REFERENCE_COLUMNS = ("reference_video", "ref_media_path")  # the LTX trainer's names for an IC-LoRA reference
# The trainer's other per-clip roles, read by these column names beside a clip column (SourceSample.extras).
EXTRA_COLUMNS = (AUDIO_COLUMN, "reference_audio", "video_mask", "audio_mask")
DUPLICATE_MARK = "#"
_ABSENT = object()
T = TypeVar("T")
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Row:
    number: int  # 1-based position among the records
    line: int | None  # the line the record starts on (JSONL, CSV), None in a JSON list
    media: Any  # the media column's value, _ABSENT when the record lacks it
    caption: Any  # the caption column's value, _ABSENT when the record lacks it
    reference: Any = None  # the reference column's value (None: no such column), _ABSENT when the record lacks it
    extras: tuple = ()  # the values of the extra columns, in extra_columns' order (_ABSENT where missing)
    scores: tuple = ()  # the values of the score columns, in score_columns' order (_ABSENT where missing)
    depth: Any = None  # the depth column's value (None: no such column), _ABSENT when the record lacks it


def _where_row(file: str, row: _Row) -> str:
    return f"{file} row {row.number}" + (f" (line {row.line})" if row.line is not None else "")


def _column(explicit: str | None, setting: str, defaults: Sequence[str], columns: list[str], where: str,
            what: str, flag: str) -> str:
    if explicit:
        if explicit not in columns:
            raise SourceError(f"{where}: source.{setting} {explicit!r} is not a column; the columns are {columns}")
        return explicit
    for name in defaults:
        if name in columns:
            return name
    raise SourceError(f"{where}: no {what} column (looked for {list(defaults)}); the columns are {columns}; "
                      f"name yours with {flag}")


class MetadataSource:
    """Rows of a JSON / JSONL / CSV metadata file naming media files and captions (see the module docstring)."""

    # How often this process opened a metadata source, checked a whole file on opening (its columns), and looked
    # rows up by id (the whole file read into an index): what a unit must not cost again
    # (tests/test_source_positions.py and benchmarks/source_scale.py count them).
    opened = 0
    scanned = 0
    indexed = 0

    def __init__(self, metadata_file: str, *, caption_key: str | None = None, video_key: str | None = None,
                 image_key: str | None = None, s3_endpoint_url: str | None = None,
                 s3_profile: str | None = None, reference_key: str | None = None,
                 audio_key: str | None = None, score_columns: Sequence[str] = (),
                 depth_key: str | None = None, planned: Mapping[str, Any] | None = None) -> None:
        """``planned``: the plan's ``describe()`` of this source; when it describes this same file, its columns
        are taken from it and opening reads nothing of the file (a unit's process, which reads at positions)."""
        MetadataSource.opened += 1
        self._endpoint_url, self._profile = s3_endpoint_url, s3_profile
        self._client = None
        fmt = posixpath.splitext(metadata_file)[1].lower()
        if fmt not in METADATA_FORMATS:
            raise SourceError(f"source.metadata_file {metadata_file!r} must end in one of {list(METADATA_FORMATS)} "
                              f"(a JSON list, one JSON object per line, or CSV with a header)")
        if is_s3_url(metadata_file):
            url = parse_s3_url(metadata_file, "source.metadata_file")
            self.metadata_file = str(url)
            self._s3_folder: S3Url | None = S3Url(url.bucket, posixpath.dirname(url.key))
            self._local_folder = ""
            # Streamed for listing and checking; read by ranged GETs at a unit's rows (nothing else downloaded).
            self._open: Opener = lambda: open_object(self._s3(), url)
            self._open_at: Opener = lambda: open_ranged(self._s3(), url)
            identity = None  # nothing to key the columns' cache on without a request
        else:
            self.metadata_file = os.path.abspath(os.path.expanduser(metadata_file))
            self._s3_folder = None
            self._local_folder = os.path.dirname(self.metadata_file)
            path = self.metadata_file
            self._open = self._open_at = lambda: open(path, "rb")
            info = self._read_metadata(lambda: os.stat(path))
            identity = (path, fmt, info.st_size, info.st_mtime_ns)
        where = self.metadata_file
        self._fmt = fmt
        self._json: list[Record] | None = None  # a JSON list, parsed whole once (it cannot be streamed)
        if fmt == ".json":
            self._json = self._read_metadata(lambda: list(json_records(self._open, where)))
            columns = list(dict.fromkeys(name for record in self._json for name in record.values))
            has_records = bool(self._json)
        else:
            found = planned_columns(planned, self.metadata_file, fmt)
            if found is None:
                columns, has_records, scanned = self._read_metadata(lambda: file_columns(identity, fmt, self._open,
                                                                                           where))
                MetadataSource.scanned += scanned
            else:
                columns, has_records = found
        self._header = columns if fmt == ".csv" else []
        if audio_key and (video_key or image_key):
            raise SourceError(f"{where}: source.audio_key {audio_key!r} names the audio files of an audio-only run; "
                              "it cannot go with source.video_key or source.image_key")
        # An audio-only file: the audio column named, or `audio` where no media column is there.
        self.audio_only = bool(audio_key) or (not (video_key or image_key) and AUDIO_COLUMN in columns
                                              and not any(c in columns for c in MEDIA_COLUMNS))
        if has_records or columns:
            self.caption_key = _column(caption_key, "caption_key", (CAPTION_COLUMN,), columns, where, "caption",
                                       "--caption-column")
            if self.audio_only:
                self.media_key = _column(audio_key, "audio_key", (AUDIO_COLUMN,), columns, where, "audio",
                                         "--audio-column")
            else:
                self.media_key = _column(video_key or image_key, "video_key" if video_key else "image_key",
                                         MEDIA_COLUMNS, columns, where, "media path", "--video-column")
        else:  # an empty list: no rows, nothing to check
            self.caption_key, self.media_key = caption_key or CAPTION_COLUMN, video_key or image_key or MEDIA_COLUMNS[0]
        # The trainer's other roles beside the media column (a clip's own sound file, reference audio, masks).
        # (An audio-only file's too: its reference sound and audio mask; its encoding refuses a video mask.)
        self.extra_columns = [c for c in EXTRA_COLUMNS if c in columns and c not in (self.media_key, self.caption_key)]
        if reference_key and reference_key not in columns:
            raise SourceError(f"{where}: source.reference_key {reference_key!r} is not a column; the columns are "
                              f"{columns}")
        self.reference_key = reference_key
        if depth_key and (has_records or columns) and depth_key not in columns:
            raise SourceError(f"{where}: source.depth_key {depth_key!r} is not a column; the columns are {columns}")
        self.depth_key = depth_key
        # The trainer's reference columns the file has: an LTX-2 run refuses to leave them out unasked.
        self.reference_columns = [c for c in REFERENCE_COLUMNS if c in columns]
        self.columns = columns
        self.score_columns = list(score_columns)
        if self.score_columns and (has_records or columns):
            check_score_columns(self.score_columns, columns, where)
        # Paths with neither an image nor a video extension are images only in an image column.
        self._column_is_image = not video_key and (bool(image_key) or self.media_key == IMAGE_COLUMN)

        # Rows by id, for a read without positions (a plan written before them) or a row that moved: built on the
        # first such read, once per opened source.
        self._index_lock = threading.Lock()
        self._by_id: dict[str, _Row] | None = None

    def _read_metadata(self, read: Callable[[], T]) -> T:
        try:
            return read()
        except FileNotFoundError:
            raise SourceError(f"source.metadata_file {self.metadata_file} does not exist") from None
        except StorageUnavailableError:
            raise
        except OSError as exc:
            raise SourceError(f"source.metadata_file {self.metadata_file}: cannot read it ({exc})") from None

    def _row_of(self, record: Record) -> _Row:
        values = record.values
        return _Row(record.number, record.line, values.get(self.media_key, _ABSENT),
                    values.get(self.caption_key, _ABSENT),
                    values.get(self.reference_key, _ABSENT) if self.reference_key else None,
                    tuple(values.get(c, _ABSENT) for c in self.extra_columns),
                    tuple(values.get(c, _ABSENT) for c in self.score_columns),
                    values.get(self.depth_key, _ABSENT) if self.depth_key else None)

    def _records(self) -> Iterator[Record]:
        return iter(self._json) if self._json is not None else records(self._fmt, self._open, self.metadata_file)

    def _rows(self) -> Iterator[tuple[str, _Row, Record]]:
        """Every row with its id and record, streamed. (The paths seen so far are held, to tell a repeated one.)"""
        seen: set[str] = set()
        for record in self._records():
            row = self._row_of(record)
            base = _base_id(row)
            if base is None or base in seen:
                yield _own_id(row, base), row, record
            else:
                seen.add(base)
                yield base, row, record

    def _index(self) -> dict[str, _Row]:
        with self._index_lock:
            if self._by_id is None:
                log.info("%s: looking rows up by id (a plan without positions, or rows that moved since planning): "
                         "the file is read whole once", self.metadata_file)
                MetadataSource.indexed += 1
                self._by_id = self._read_metadata(lambda: {source_id: row for source_id, row, _ in self._rows()})
            return self._by_id

    def _s3(self):
        if self._client is None:
            self._client = s3_client(self._endpoint_url, self._profile)
        return self._client

    def describe(self) -> dict:
        return {
            "type": "metadata",
            "metadata_file": self.metadata_file,
            "caption_key": self.caption_key,
            # The media column under the setting that reopens it as the same kind of column.
            "image_key": self.media_key if self._column_is_image else None,
            "video_key": None if self._column_is_image or self.audio_only else self.media_key,
            **({"audio_key": self.media_key} if self.audio_only else {}),
            **({"reference_key": self.reference_key} if self.reference_key else {}),
            **({"score_columns": self.score_columns} if self.score_columns else {}),
            **({"depth_key": self.depth_key} if self.depth_key else {}),
            "s3_endpoint_url": self._endpoint_url,
            "s3_profile": self._profile,
            # What opening found in the file, so that a unit's process need not read it again (``planned``).
            "columns": self.columns,
        }

    def list_entries(self) -> Iterator[tuple[str, Any]]:
        """Each row's id with where it is, ``[byte offset, row number, line, CRC-32 of its bytes]``, streamed. A row
        naming a file an earlier row names is listed under that file's id too: the plan names it
        (``repeats``: ``<id>#<row>``, as ``list_ids`` does), so listing holds no set of every path. (A JSON list,
        parsed whole on opening, has no positions: its rows are listed under their own ids, with None.)"""
        if self._json is not None:
            return ((source_id, None) for source_id, _, _ in self._rows())
        return ((_base_id(row) or _own_id(row, None), record.position())
                for record in self._records() for row in (self._row_of(record),))

    @property
    def repeats(self) -> Repeats | None:
        """How the plan names a row whose file an earlier row names (``list_entries``)."""
        return None if self._json is not None else Repeats(DUPLICATE_MARK, _repeated_row)

    def list_ids(self) -> Iterator[str]:
        """Every row's own id, in file order (the paths seen so far held, to tell a repeated one)."""
        return (source_id for source_id, _, _ in self._rows())

    def read(self, ids: Sequence[str], at: Sequence[Any] | None = None) -> Iterator[SourceSample]:
        """One sample per id; ``at`` (``list_entries``' positions, parallel to ``ids``) reads each row where it
        starts, parsing only those rows. A row no longer there as planned, byte for byte (the file changed), is
        looked up by its id, as without positions: gone, it is ``source_missing``."""
        if at is not None and len(at) != len(ids):
            raise SourceError(f"{len(at)} positions for {len(ids)} ids of {self.metadata_file}: the unit's plan is "
                              "damaged; plan the run again")
        positions = at if at is not None else [None] * len(ids)
        wanted = any(pos is not None for pos in positions) and self._json is None
        stream = self._read_metadata(self._open_at) if wanted else None
        try:
            for source_id, pos in zip(ids, positions):
                row = self._row_at(stream, source_id, pos) if stream is not None and pos is not None else None
                if row is None:
                    row = self._index().get(source_id)
                if row is None:
                    yield rejected(source_id, "source_missing",
                                   f"no row of {self.metadata_file} gives this id any more (the file changed)")
                else:
                    yield self._sample(source_id, row)
        finally:
            if stream is not None:
                stream.close()

    def _row_at(self, stream: BinaryIO, source_id: str, pos: Any) -> _Row | None:
        """The row at ``pos`` when it still gives ``source_id``, else None (also when it cannot be read there: the
        lookup by id then says why)."""
        try:
            record = record_at(self._fmt, stream, self.metadata_file, pos, self._header)
        except StorageUnavailableError:
            raise  # the store, not the file: the unit fails and its task can run again
        except OSError:
            return None
        if record is None:
            return None
        row = self._row_of(record)
        base = _base_id(row)
        return row if source_id in (base, _own_id(row, base)) else None

    def _sample(self, source_id: str, row: _Row) -> SourceSample:
        where = _where_row(self.metadata_file, row)
        media = row.media
        if media is _ABSENT or media is None or media == "":
            return rejected(source_id, "missing_media", f"{where}: no path in column {self.media_key!r}")
        if not isinstance(media, str):
            return rejected(source_id, "invalid_media_path",
                            f"{where}: column {self.media_key!r} holds a {type(media).__name__}, not a path")
        if not self.audio_only and posixpath.splitext(media)[1].lower() in UNREADABLE_IMAGE_EXTENSIONS:
            return SourceSample(source_id, None, None, unsupported(f"{where}: {media!r}", media))
        is_video = is_video_name(media) or (not is_image_name(media) and not self._column_is_image)
        try:
            data = self._read_media(media, where)
        except RejectError as exc:
            return SourceSample(source_id, None, None, exc)

        reference = None
        if self.reference_key is not None:
            value = row.reference
            if value is _ABSENT or not isinstance(value, str) or not value.strip():
                return rejected(source_id, "missing_reference",
                                f"{where}: no reference clip path in column {self.reference_key!r}")
            try:
                reference = self._read_media(value.strip(), where, missing="reference_not_found")
            except RejectError as exc:
                return SourceSample(source_id, None, None, exc)

        extras = {}
        roles = list(zip(self.extra_columns, row.extras)) + ([("depth", row.depth)] if self.depth_key else [])
        for role, value in roles:
            if value is _ABSENT or not isinstance(value, str) or not value.strip():
                column = self.depth_key if role == "depth" else role
                return rejected(source_id, f"missing_{role}", f"{where}: no path in column {column!r}")
            try:
                extras[role] = (value.strip(), self._read_media(value.strip(), where, missing=f"{role}_not_found"))
            except RejectError as exc:
                return SourceSample(source_id, None, None, exc)

        try:
            scores = row_scores(dict(zip(self.score_columns, row.scores)), where, _ABSENT)
        except RejectError as exc:
            return SourceSample(source_id, None, None, exc)

        def sample(caption: str | None, error: RejectError | None = None) -> SourceSample:
            if self.audio_only:
                return SourceSample(source_id, None, caption, error, audio=data, extras=extras, scores=scores)
            if is_video:
                return SourceSample(source_id, None, caption, error, video=data, reference=reference, extras=extras,
                                    scores=scores)
            return SourceSample(source_id, data, caption, error, reference=reference, extras=extras, scores=scores)

        caption_where = f"{where} column {self.caption_key!r}"
        if row.caption is _ABSENT:
            return sample(None, reject("missing_caption", f"{caption_where}: the row has no caption"))
        try:
            return sample(normalize_caption(row.caption, caption_where))
        except RejectError as exc:
            return sample(None, exc)

    def stamps(self, ids: Sequence[str]) -> dict[str, str]:
        """Each row as it is now: its media file's stamp (a stat, or a HEAD in a bucket), a digest of the row's
        values (a caption fixed in the metadata file changes it) and the stamps of the other files it names."""
        return {source_id: self._stamp(source_id) for source_id in ids}

    def _stamp(self, source_id: str) -> str:
        row = self._index().get(source_id)
        if row is None:
            return "-"
        values = json.dumps([_plain(v) for v in (row.media, row.caption, row.reference, *row.extras, *row.scores,
                                                 *((row.depth,) if self.depth_key else ()))],
                            sort_keys=True, default=str)
        files = [v.strip() for v in (row.reference, *row.extras, row.depth) if isinstance(v, str) and v.strip()]
        media = self._file_stamp(row.media) if isinstance(row.media, str) and row.media else "-"
        digest = hashlib.sha256(values.encode("utf-8")).hexdigest()[:16]
        return " ".join([media, digest, *(self._file_stamp(f) for f in files)])

    def _file_stamp(self, path: str) -> str:
        try:
            location = self._locate(path, "")
        except RejectError:
            return "-"
        return object_stamp(self._s3(), location) if isinstance(location, S3Url) else file_stamp(location)

    def _locate(self, media: str, where: str) -> str | S3Url:
        """Where the file a row names is: a local path or an object (a path leading out of the bucket: a reject)."""
        if is_s3_url(media):
            try:
                return parse_s3_url(media, "the path")
            except SourceError as exc:
                raise reject("invalid_media_path", f"{where}: {exc}") from None
        if os.path.isabs(media):
            return media
        if self._s3_folder is not None:
            key = posixpath.normpath(posixpath.join(self._s3_folder.key, media))
            if key == ".." or key.startswith("../"):
                raise reject("invalid_media_path",
                             f"{where}: {media!r} leads out of the bucket {self._s3_folder.bucket}")
            return S3Url(self._s3_folder.bucket, key)
        return os.path.join(self._local_folder, media)

    def _read_media(self, media: str, where: str, missing: str = "media_not_found") -> bytes:
        """The bytes of the file a row names, or a reject saying why not."""
        location = self._locate(media, where)
        try:
            if isinstance(location, S3Url):
                return read_object(self._s3(), location)
            return _read_local(location)
        except StorageUnavailableError:
            raise  # the store, not the sample: the unit fails and its task can run again
        except FileNotFoundError:
            raise reject(missing, f"{where}: {media!r} is not a file ({location})") from None
        except OSError as exc:
            raise reject("source_read_error", f"{where}: {location}: {exc}") from None


def _base_id(row: _Row) -> str | None:
    """The id of the row's path (escaped; ``#`` as ``%23``), None for a row without one."""
    if not isinstance(row.media, str) or not row.media:
        return None
    return escape_id(row.media).replace(DUPLICATE_MARK, "%23")


def _own_id(row: _Row, base: str | None) -> str:
    """The id of a row whose path an earlier row has (``base#<row>``), or that has none (``#<row>``)."""
    return (base or "") + f"{DUPLICATE_MARK}{row.number}"


def _repeated_row(source_id: str, at: list[int]) -> str:
    """The id of a listed row whose path an earlier row has: ``_own_id``'s, from its position (``at[1]``: the row)."""
    return f"{source_id}{DUPLICATE_MARK}{at[1]}"


def _plain(value: Any) -> Any:
    """A row's value for its digest (an absent column as null)."""
    return None if value is _ABSENT else value


def _read_local(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()
