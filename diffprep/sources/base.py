"""What every source reader provides, and the caption rules they share.

A source lists stable sample ids (``list_ids``, streamed) and later reads any
contiguous run of them (``read``), one ``SourceSample`` per id. Problems with
one sample are data, not exceptions: the sample carries a ``RejectError`` with
``phase="read"`` and the pipeline records it.

Captions are normalized the same way in every source: text is decoded as
strict UTF-8 (a leading BOM is dropped), surrounding whitespace is stripped,
and a list of captions yields its first element. An empty caption is kept.
"""

from __future__ import annotations

import hashlib
import json
import os
import posixpath
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from diffprep.errors import RejectError, SourceError

if TYPE_CHECKING:
    from diffprep.sources.scenes.base import Scene

READ_PHASE = "read"
_UTF8_BOM = b"\xef\xbb\xbf"

# File name extensions (lower case, with the dot) that make a file an image or a clip, in every source
# that goes by file names; a name's extension matches in any letter case. Images are what Pillow decodes
# (an animated GIF, WebP or TIFF gives its first frame and the note multiframe:first_frame); clips what PyAV does.
IMAGE_EXTENSIONS = frozenset({".jpg", ".jpeg", ".png", ".webp", ".gif", ".bmp", ".tif", ".tiff", ".avif"})
VIDEO_EXTENSIONS = frozenset({".mp4", ".webm", ".mov", ".mkv"})
# A caption file's extension, matched in any letter case; where one stem has several spellings (a.txt and a.TXT)
# the first of these that exists is its caption (.txt, then the others in byte order), the others are rejects.
CAPTION_EXTENSION = ".txt"
CAPTION_SPELLINGS = (CAPTION_EXTENSION, *sorted({"." + "".join(c.upper() if (n >> i) & 1 else c for i, c in
                                                              enumerate("txt")) for n in range(8)} - {".txt"}))
# Image formats no decoder here reads (Pillow has no plugin for them): a path naming one is rejected as
# unsupported_format before it is read, in the sources that are given paths or members.
UNREADABLE_IMAGE_EXTENSIONS = frozenset({".heic", ".heif", ".jxl", ".svg", ".dng", ".cr2", ".nef", ".arw"})
# Files that are no one's data (the desktop's folder metadata): not listed, not rejected.
IGNORED_NAMES = frozenset({"Thumbs.db", "desktop.ini"})


def is_image_name(name: str) -> bool:
    return _extension(name) in IMAGE_EXTENSIONS


def is_video_name(name: str) -> bool:
    return _extension(name) in VIDEO_EXTENSIONS


def is_caption_name(name: str) -> bool:
    return _extension(name) == CAPTION_EXTENSION


def is_ignored_name(name: str) -> bool:
    """A dot file (``.DS_Store``) or desktop metadata beside the data; only ever asked of a name that is no sample."""
    base = posixpath.basename(name)
    return base.startswith(".") or base in IGNORED_NAMES


def _extension(name: str) -> str:
    return posixpath.splitext(name)[1].lower()


def supported_formats() -> str:
    """The formats every source reads, for an ``unsupported_format`` message."""
    return (f"images {' '.join(sorted(IMAGE_EXTENSIONS))}, clips {' '.join(sorted(VIDEO_EXTENSIONS))}, "
            f"captions {CAPTION_EXTENSION} (any letter case)")


def unsupported(where: str, name: str) -> RejectError:
    """``unsupported_format`` for a file or member ``name`` that no reader here decodes."""
    ext = _extension(name) or "(no extension)"
    return reject("unsupported_format", f"{where}: {ext} is not a format diffprep reads; it reads "
                  f"{supported_formats()}: convert the file (an animation meant as a clip: to .mp4)")


def read_class_names(path: str) -> list[str]:
    """The names in a ``source.class_names`` file: one per line, label 0 first, blank lines skipped."""
    try:
        with open(os.path.expanduser(path), encoding="utf-8") as handle:
            names = [line.strip() for line in handle if line.strip()]
    except OSError as error:
        raise SourceError(f"source.class_names {path}: {error.strerror}") from None
    if not names:
        raise SourceError(f"source.class_names {path} holds no class name (one per line)")
    return names


def caption_settings(cfg: Any) -> dict[str, Any]:
    """The settings besides the source's own data that decide its captions, for the fingerprint: the class-label
    template and the names in the class-names file (their sha256: editing the file changes the fingerprint, its
    path does not). Empty when neither is set, so other plans keep the fingerprint they always had."""
    found: dict[str, Any] = {}
    if cfg.caption_template is not None:
        found["caption_template"] = cfg.caption_template
    if cfg.class_names:
        names = json.dumps(read_class_names(cfg.class_names), ensure_ascii=False).encode("utf-8")
        found["class_names_sha256"] = hashlib.sha256(names).hexdigest()
    if getattr(cfg, "caption_set", None):  # --caption-set: the set's name and digest (a re-captioned set: new data)
        from diffprep.sources.caption_set import caption_set_settings

        found |= caption_set_settings(cfg)
    return found


@dataclass(frozen=True)
class SourceSample:
    source_id: str  # stable across runs, no newlines; unique within the source
    image: bytes | None  # the encoded image file bytes (jpeg/png/webp...), None when absent
    caption: str | None  # decoded caption text, None when absent/undecodable
    reject: RejectError | None = None  # set when the source itself cannot give a usable sample
    video: bytes | None = None  # the encoded clip file bytes (mp4/webm/mov/mkv...) of a video sample
    reference: bytes | None = None  # an IC-LoRA reference clip's file bytes (metadata source, LTX-2)
    audio: bytes | None = None  # the audio file's bytes of an audio-only sample (metadata source, LTX-2 T2A)
    # A clip's other inputs by role (metadata source, LTX-2): "audio" (its sound as a file of its own),
    # "reference_audio", "video_mask", "audio_mask" -> (the path as written, the file's bytes).
    extras: Mapping[str, tuple[str, bytes]] = field(default_factory=dict)
    scene: Scene | None = None  # a posed scene's frames and cameras (--source-type scenes); image and video None
    # Numbers of the source's score columns (--score-column), written as top-level fields of the sample's meta.
    scores: Mapping[str, int | float] = field(default_factory=dict)

    @property
    def media(self) -> bytes | None:
        """The sample's file bytes: the clip of a video sample, the file of an audio sample, else the image."""
        if self.video is not None:
            return self.video
        return self.audio if self.audio is not None else self.image


@runtime_checkable
class Source(Protocol):
    def list_ids(self) -> Iterator[str]:
        """All sample ids in a stable order, streamed."""
        ...

    def read(self, ids: Sequence[str]) -> Iterator[SourceSample]:
        """Exactly one SourceSample per id, in the given order."""
        ...

    def describe(self) -> dict:
        """A small JSON-able description for plan.json (no secrets)."""
        ...

    # Optional: ``stamps(ids) -> {id: str}``, a cheap mark of each sample's input files (sizes and mtimes, or
    # ETags; no content read) recorded with a reject, so that a re-run retries it once its inputs changed.
    # Optional: ``list_entries() -> Iterator[(id, at)]``, the ids with a small JSON-able locator each (where the
    # sample lies: a row's byte offset, a tar member's); a source offering it reads ``read(ids, at=locators)``
    # straight from there, and ``read(ids)`` (a plan without locators) by its ids as before. ``read_planned``.
    # Optional, with ``list_entries``: ``repeats``, a ``Repeats`` when its listing may give an id twice.


@dataclass(frozen=True)
class Repeats:
    """How a source names an entry of its listing whose id an earlier entry has (a metadata file's second row naming
    the same file): ``name(id, at)``, the repeated id, ``mark``, then what tells the entry apart.

    A source with a ``repeats`` attribute lists each entry under the id it would have alone (``list_entries``) and
    the plan, which keeps its ids on disk (``diffprep.writer.unit_lists.ListingIndex``), names the repeats: the
    source then holds no set of every id it listed."""

    mark: str
    name: Callable[[str, Any], str]


def read_planned(source: Source, ids: Sequence[str], positions: Sequence[Any] | None = None) -> Iterator[SourceSample]:
    """A unit's samples: read at their planned ``positions`` (``list_entries``' locators) when the plan has them and
    the source takes them, else by id (why: a unit then parses only its own rows or tar members, not the source)."""
    if positions is not None and callable(getattr(source, "list_entries", None)):
        return source.read(ids, at=positions)
    return source.read(ids)


def list_planned(source: Source) -> Iterator[tuple[str, Any]]:
    """Every id with its locator (``list_entries``), or with None for a source that only lists ids."""
    if callable(getattr(source, "list_entries", None)):
        return source.list_entries()
    return ((source_id, None) for source_id in source.list_ids())


def file_stamp(path: str) -> str:
    """``<size>:<mtime_ns>`` of a local file, ``-`` when there is none."""
    try:
        info = os.stat(path)
    except OSError:
        return "-"
    return f"{info.st_size}:{info.st_mtime_ns}"


def reject(reason: str, detail: str) -> RejectError:
    return RejectError(reason, detail, phase=READ_PHASE)


def rejected(source_id: str, reason: str, detail: str, *, image: bytes | None = None,
             caption: str | None = None, video: bytes | None = None) -> SourceSample:
    return SourceSample(source_id, image, caption, reject(reason, detail), video=video)


# --- ids -------------------------------------------------------------------
# Ids are built from file and member names, which may hold control characters
# (a newline is legal in a POSIX file name) or undecodable bytes (surrogate
# escapes). Those, and "%" itself, are percent-escaped so an id is one line of
# valid text; the escape is reversible so the directory source can map an id
# back to its file.

_ESCAPE_RE = re.compile(r"[%\x00-\x1f\x7f\udc80-\udcff]")
_UNESCAPE_RE = re.compile(r"%([0-9A-F]{2})")


def _escape_char(match: re.Match[str]) -> str:
    char = match.group(0)
    code = ord(char) - 0xDC00 if "\udc80" <= char <= "\udcff" else ord(char)
    return f"%{code:02X}"


def _unescape_char(match: re.Match[str]) -> str:
    code = int(match.group(1), 16)
    return chr(0xDC00 + code) if code >= 0x80 else chr(code)


def escape_id(name: str) -> str:
    """Percent-escape ``%``, control characters and surrogate-escaped bytes of a name."""
    return _ESCAPE_RE.sub(_escape_char, name)


def unescape_id(escaped: str) -> str:
    """Inverse of ``escape_id``."""
    return _UNESCAPE_RE.sub(_unescape_char, escaped)


# --- captions ----------------------------------------------------------------


def decode_caption_bytes(data: bytes, where: str) -> str:
    """Strict UTF-8 (BOM dropped), whitespace stripped; ``caption_decode_error`` names the byte offset."""
    offset = 0
    if data.startswith(_UTF8_BOM):
        data, offset = data[len(_UTF8_BOM):], len(_UTF8_BOM)
    try:
        return data.decode("utf-8").strip()
    except UnicodeDecodeError as exc:
        raise reject(
            "caption_decode_error",
            f"{where}: invalid UTF-8 at byte offset {exc.start + offset} ({exc.reason})",
        ) from None


def normalize_caption(value: Any, where: str) -> str:
    """Turn a caption value from a dataset (text, bytes, list of those) into text, or raise a reject.

    A list holds alternative captions: the first one is used.
    """
    if isinstance(value, (list, tuple)):
        if not value:
            raise reject("missing_caption", f"{where}: the caption list is empty")
        value = value[0]
    if value is None:
        raise reject("missing_caption", f"{where}: the caption is empty (None)")
    if isinstance(value, bytes):
        return decode_caption_bytes(value, where)
    if isinstance(value, str):
        return value.strip()
    raise reject("invalid_caption", f"{where}: expected text, got {type(value).__name__}")


_MISSING = object()


def lookup_path(value: Any, path: Sequence[str]) -> Any:
    """Follow dict fields ``path`` into ``value``; a JSON string on the way is parsed.

    Returns ``_MISSING`` when a field does not exist. An unparsable JSON string
    is a ``caption_decode_error`` reject.
    """
    for field in path:
        if isinstance(value, (str, bytes)):
            try:
                value = json.loads(value)
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise reject("caption_decode_error", f"not valid JSON while looking up {field!r}: {exc}") from None
        if not isinstance(value, dict) or field not in value:
            return _MISSING
        value = value[field]
    return value


def is_missing(value: Any) -> bool:
    return value is _MISSING
