"""Each planned unit's sample list in a file of its own, and the id index that plans without holding every id.

plan.json describes units only (index, sample count, bucket, the list's file); the sample ids of unit ``N``, with
the locator the source gave each (``Source.list_entries``: where a reader finds the sample without listing the
source again), live in ``.diffprep/plan_units/NNNNNN.jsonl``. A worker reads only its units' lists.

A list is JSON lines, one sample a line in the unit's order: ``"id"``, or ``["id", at]`` when the source gave a
locator. Planning writes each list as its unit fills, into a staging folder of its own (the output is chosen only
after the plan, by the verify phase); writing the plan to an output copies the lists there, then plan.json.

Dedup and "is this id planned already" (appends to a grown source, retried rejects) go through ``IdIndex``, an
SQLite table on disk in the staging folder: its memory is its page cache, whatever the number of ids.
"""

from __future__ import annotations

import json
import shutil
import sqlite3
import tempfile
import weakref
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from diffprep import contract

Entry = tuple[str, Any]  # a sample id and its locator (None: the source has nothing better than the id)


def entry_line(sid: str, at: Any) -> str:
    """One sample's line of a unit list."""
    if at is None:
        return json.dumps(sid)
    return json.dumps([sid, at], separators=(",", ":"))


def list_bytes(entries: Iterable[Entry]) -> bytes:
    """A unit list's file content."""
    return "".join(entry_line(sid, at) + "\n" for sid, at in entries).encode("utf-8")


def read_entries(path: Path) -> Iterator[Entry]:
    """The entries of a unit list, streamed from its file."""
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            value = json.loads(line)
            if isinstance(value, str):
                yield value, None
            else:
                yield value[0], value[1]


def as_entry(item: str | Entry | list) -> Entry:
    """A listing's item (an id from ``list_ids``, or ``(id, at)`` from ``list_entries``) as an entry."""
    if isinstance(item, str):
        return item, None
    sid, at = item
    return sid, at


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


# An id's state in the index.
PLANNED, PLANNED_SEEN, NEW = 1, 2, 3


class IdIndex:
    """The ids a plan holds, on disk (SQLite, keyed by id): which are planned already, which the listing showed
    again, which it added. Lookups go by chunks of ids (one query each), not one query per id."""

    CACHE_KIB = 32 * 1024  # the page cache's bound: the index's memory whatever its size

    def __init__(self, path: Path) -> None:
        self.path = path
        self.db = sqlite3.connect(path, isolation_level=None)
        self.db.execute("PRAGMA journal_mode=OFF")
        self.db.execute("PRAGMA synchronous=OFF")
        self.db.execute(f"PRAGMA cache_size=-{self.CACHE_KIB}")
        self.db.execute("PRAGMA temp_store=FILE")
        self.db.execute("CREATE TABLE ids (id TEXT PRIMARY KEY, state INTEGER NOT NULL) WITHOUT ROWID")
        self.db.execute("BEGIN")

    def add_planned(self, ids: list[str]) -> None:
        """Ids of an earlier plan (a retried id is in two units: kept once)."""
        self.db.execute("INSERT OR IGNORE INTO ids SELECT value, ? FROM json_each(?)", (PLANNED, json.dumps(ids)))

    def states(self, ids: list[str]) -> dict[str, int]:
        """The known ids among ``ids`` and their states."""
        rows = self.db.execute("SELECT id, state FROM ids WHERE id IN (SELECT value FROM json_each(?))",
                               (json.dumps(ids),))
        return dict(rows)

    def seen(self, ids: list[str]) -> None:
        """Planned ids the listing holds still."""
        if ids:
            self.db.execute("UPDATE ids SET state = ? WHERE id IN (SELECT value FROM json_each(?))",
                            (PLANNED_SEEN, json.dumps(ids)))

    def add_new(self, ids: list[str]) -> None:
        if ids:
            self.db.execute("INSERT INTO ids SELECT value, ? FROM json_each(?)", (NEW, json.dumps(ids)))

    def missing(self, preview: int) -> tuple[list[str], int]:
        """Planned ids the listing no longer holds: the first ``preview`` in sorted order, and their count."""
        first = [row[0] for row in self.db.execute("SELECT id FROM ids WHERE state = ? ORDER BY id LIMIT ?",
                                                   (PLANNED, preview))]
        (count,) = self.db.execute("SELECT count(*) FROM ids WHERE state = ?", (PLANNED,)).fetchone()
        return first, count

    def close(self) -> None:
        self.db.close()
        self.path.unlink(missing_ok=True)


__all__ = ["Entry", "IdIndex", "Staging", "as_entry", "entry_line", "list_bytes", "read_entries"]
