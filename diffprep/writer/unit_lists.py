"""Each planned unit's sample list in a file of its own, and the id index that plans without holding every id.

plan.json describes units only (index, sample count, bucket, the list's file); the sample ids of unit ``N``, with
the locator the source gave each (``Source.list_entries``: where a reader finds the sample without listing the
source again), live in ``.diffprep/plan_units/NNNNNN.jsonl``. A worker reads only its units' lists.

A list is JSON lines, one sample a line in the unit's order: ``"id"``, or ``["id", at]`` when the source gave a
locator. Planning writes each list as its unit fills, into a staging folder of its own (the output is chosen only
after the plan, by the verify phase); writing the plan to an output copies the lists there, then plan.json.

Dedup and "is this id planned already" (appends to a grown source, retried rejects) go through ``ListingIndex``:
the ids cut into parts on disk by a hash, each part checked alone, never a set of every id.
"""

from __future__ import annotations

import heapq
import itertools
import json
import marshal
import re
import shutil
import tempfile
import weakref
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

from diffprep import contract
from diffprep.sources.base import Repeats

Entry = tuple[str, Any]  # a sample id and its locator (None: the source has nothing better than the id)


# An id that JSON writes as it is, between quotes (printable ASCII but ``"`` and ``\``): json.dumps's own output,
# without its cost, for the ids of nearly every source.
_PLAIN = re.compile(r'[ !#-\[\]-~]*')


def entry_line(sid: str, at: Any) -> str:
    """One sample's line of a unit list."""
    plain = _PLAIN.fullmatch(sid)
    if at is None:
        return f'"{sid}"' if plain else json.dumps(sid)
    if plain and type(at) is list and all(type(n) is int for n in at):  # a row's offsets, a member's span
        return f'["{sid}",[{",".join(map(str, at))}]]'  # json.dumps's bytes, at a third of its cost
    return json.dumps([sid, at], separators=(",", ":"))


def list_bytes(entries: Iterable[Entry]) -> bytes:
    """A unit list's file content."""
    return "".join(entry_line(sid, at) + "\n" for sid, at in entries).encode("utf-8")


def read_entries(path: Path) -> Iterator[Entry]:
    """The entries of a unit list, streamed from its file."""
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            if line[0] == '"' and "\\" not in line:  # a plain id: the text between its quotes
                yield line[1:-2], None
                continue
            value = json.loads(line)
            if isinstance(value, str):
                yield value, None
            else:
                yield value[0], value[1]


class Staging:
    """A temporary folder for the lists planned before the output is chosen (``TMPDIR`` decides where); removed
    when no unit planned into it is left in memory, or when the process ends."""

    def __init__(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="diffprep-plan-"))
        self._finalizer = weakref.finalize(self, shutil.rmtree, str(self.root), True)

    def list_path(self, unit: int) -> Path:
        path = self.root / contract.plan_unit_path(unit)
        path.parent.mkdir(parents=True, exist_ok=True)
        return path

    def write(self, unit: int, entries: list[Entry]) -> Path:
        path = self.list_path(unit)
        path.write_bytes(list_bytes(entries))
        return path


class ListingIndex:
    """The listing and the ids an earlier plan holds, cut by a hash of the id into parts on disk: which listed ids
    are new, which are listed twice, which planned ids the listing no longer holds, answered one part at a time
    (``classify``). Memory: a part's ids (``PARTS`` of them in all) and one bit per listed sample, whatever the
    order of the listing (an index keyed by id, an SQLite table, slows down once it outgrows its cache: the
    listing's ids come in no order the index could use).

    The listing itself (ids and locators) is kept in listing order in a file of its own, read again once the new
    ids are known (``new_entries``).

    ``repeats`` (a source whose listing may give an id twice: ``Source.repeats``): an entry whose id an earlier one
    has is named by ``repeats.name(id, at)`` instead of failing the plan. The parts are then cut by the id up to
    ``repeats.mark``, so that an id, its repeats and their names are checked in the same part, and a part's item
    carries the name its entry would have as a repeat.
    """

    PARTS = 256
    SPILL = 5_000  # ids held before they are written to their parts' files

    def __init__(self, folder: Path, repeats: Repeats | None = None) -> None:
        self.folder = folder
        self.repeats = repeats
        folder.mkdir(parents=True, exist_ok=True)
        self.count = 0  # samples listed
        self._parts: list[list[tuple[str, int]]] = [[] for _ in range(self.PARTS)]
        self._held = 0
        self._spilled = False
        self._listing_path = folder / "listing.marshal"
        self._listing = open(self._listing_path, "wb")
        self._new = bytearray()
        self._repeated = bytearray()  # one bit per listed sample: named by ``repeats``
        self._files: dict[int, BinaryIO] = {}  # the parts' files, once spilled to

    def planned(self, ids: Iterable[str]) -> None:
        """Ids of an earlier plan (a retried id is in two units: counted once)."""
        self._put([(sid, -1) for sid in ids])

    def listed(self, entries: list[Entry]) -> None:
        """The next entries of the listing, in its order."""
        if not entries:
            return
        _dump(entries, self._listing)
        start, self.count = self.count, self.count + len(entries)
        if self.repeats is None:
            self._put([(sid, position) for position, (sid, _) in enumerate(entries, start)])
        else:
            name = self.repeats.name
            self._put([(sid, position, name(sid, at)) for position, (sid, at) in enumerate(entries, start)])

    def _put(self, items: list[tuple]) -> None:
        parts, count = self._parts, self.PARTS
        if self.repeats is None:
            for item in items:
                parts[hash(item[0]) % count].append(item)
        else:
            mark = self.repeats.mark
            for item in items:
                parts[hash(item[0].partition(mark)[0]) % count].append(item)
        self._held += len(items)
        if self._held >= self.SPILL:
            self._spill()

    def _spill(self) -> None:
        for number, part in enumerate(self._parts):
            if part:
                if number not in self._files:  # kept open until classify: a spill opens no file again
                    self._files[number] = open(self.folder / f"part-{number:03d}.marshal", "wb")  # noqa: SIM115
                _dump(part, self._files[number])
                part.clear()
        self._held, self._spilled = 0, True

    def _close_files(self) -> None:
        for handle in self._files.values():
            handle.close()
        self._files.clear()

    def _part(self, number: int) -> Iterator[tuple[str, int]]:
        path = self.folder / f"part-{number:03d}.marshal"
        if self._spilled and path.is_file():
            yield from _marshalled(path)
        yield from self._parts[number]

    def classify(self, preview: int) -> tuple[list[str], int]:
        """Mark the new ids (``ValueError`` for an id listed twice); returns the planned ids no longer listed: the
        first ``preview`` in sorted order, and their count."""
        self._listing.close()
        self._close_files()
        self._new = bytearray((self.count + 7) // 8)
        self._repeated = bytearray((self.count + 7) // 8)
        first: list[str] = []
        count = 0
        for number in range(self.PARTS):
            planned: dict[str, bool] = {}  # planned id -> listed still
            listed: set[str] = set()
            for item in self._part(number):  # a part's items are in listing order, the planned ones first
                sid, position = item[0], item[1]
                if position < 0:
                    planned[sid] = False
                    continue
                if self.repeats is not None and (sid in listed or planned.get(sid)):  # a repeat: its own name
                    sid = item[2]
                    self._repeated[position >> 3] |= 1 << (position & 7)
                if sid in planned:
                    planned[sid] = True
                elif sid in listed:
                    raise ValueError(f"the source listed the sample id {sid!r} twice; source ids must be unique")
                else:
                    listed.add(sid)
                    self._new[position >> 3] |= 1 << (position & 7)
            gone = [sid for sid, still in planned.items() if not still]
            count += len(gone)
            first = heapq.nsmallest(preview, itertools.chain(first, gone))
            self._parts[number] = []
        return first, count

    def new_entries(self) -> Iterator[Entry]:
        """The new samples (``classify``), in listing order, with their locators."""
        position = 0
        for sid, at in _marshalled(self._listing_path):
            bit = 1 << (position & 7)
            if self._new[position >> 3] & bit:
                yield (self.repeats.name(sid, at) if self._repeated[position >> 3] & bit else sid), at
            position += 1

    def close(self) -> None:
        self._listing.close()
        self._close_files()
        shutil.rmtree(self.folder, ignore_errors=True)


def _dump(items: list, handle: BinaryIO) -> None:
    """A list of the process's own scratch (str, int, JSON-like locators) as one length-prefixed record."""
    data = marshal.dumps(items)
    handle.write(len(data).to_bytes(8, "little") + data)


def _marshalled(path: Path) -> Iterator[Any]:
    """The items of the records ``_dump`` wrote to ``path``, one record in memory at a time (a record is read whole:
    ``marshal.load`` on a file reads it a few bytes at a time)."""
    with open(path, "rb") as handle:
        while header := handle.read(8):
            yield from marshal.loads(handle.read(int.from_bytes(header, "little")))


__all__ = ["Entry", "ListingIndex", "Staging", "entry_line", "list_bytes", "read_entries"]
