"""A caption set on disk: a named folder beside the data, written unit by unit, then indexed.

::

    <root>/.captions/<NAME>/set.json          name, captioning settings (one per instruction), the captioner's
                                              description, the source, the fingerprint; ``digest`` once written
    <root>/.captions/<NAME>/plan.jsonl        the units: one line each, its source ids (streamed, never all held)
    <root>/.captions/<NAME>/units/<u>.jsonl   a unit's captions (the commit point: written whole, renamed in)
    <root>/.captions/<NAME>/sanity/           the one-sample check: its frames' picture and captions
    <root>/.captions/<NAME>/captions.jsonl    written: every sample, in plan order (caption, captions, media_path)
    <root>/.captions/<NAME>/index.sqlite      written: source id -> captions, token counts (encode's lookup)
    <root>/.captions/<NAME>/audit.json, tokens.json

A unit file's first line is its header (unit, fingerprint, counts); each further line is one planned sample:
``{"source_id", "captions": [...], "tokens": {family: [...]}, "media_path"}`` or ``{"source_id", "reject":
{"reason", "detail"}}``, in the plan's order. Captions are greedy, so a unit's bytes do not depend on which
worker wrote it; the written files are the units' lines in order, so neither does the set.

``<root>`` and the lookup are ``diffprep.sources.caption_set`` (the encode reads sets from there).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import contextlib
import sqlite3
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from diffprep.errors import DiffprepError
from diffprep.sources.caption_set import INDEX, SET_JSON, SETS_FOLDER, set_dir
from diffprep.writer.links import no_link_below
from diffprep.writer.shards import TEMP_SUFFIX, atomic_write_bytes

SET_VERSION = 1
PLAN = "plan.jsonl"
PLAN_OFFSETS = "plan.offsets"  # each unit's line's byte offset in plan.jsonl, 8 bytes little-endian per unit
UNITS_DIR = "units"
SANITY_DIR = "sanity"
CAPTIONS_JSONL = "captions.jsonl"
AUDIT_JSON = "audit.json"
TOKENS_JSON = "tokens.json"


@dataclass
class SetPlan:
    """What a caption run will write: its fingerprint and how many units (their ids stay in plan.jsonl)."""

    name: str
    fingerprint: str
    settings: dict[str, Any]  # the fingerprinted settings: captioning per instruction, token families, unit size
    units: int
    samples: int
    source: dict[str, Any] = field(default_factory=dict)


def unit_name(unit: int) -> str:
    return f"{UNITS_DIR}/{unit:06d}.jsonl"


class CaptionSet:
    """One named set's folder (``path``); nothing here decides whether a set may be replaced: the flow asks."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.name = os.path.basename(path)

    @classmethod
    def of_source(cls, cfg: Any, name: str) -> CaptionSet:
        return cls(set_dir(cfg, name))

    def file(self, relative: str) -> str:
        return os.path.join(self.path, relative)

    def exists(self) -> bool:
        return os.path.exists(self.file(SET_JSON))

    # --- set.json ---------------------------------------------------------------------------------------------

    def record(self) -> dict[str, Any] | None:
        try:
            with open(self.file(SET_JSON), encoding="utf-8") as f:
                return json.load(f)
        except FileNotFoundError:
            return None

    def write_record(self, record: dict[str, Any]) -> None:
        os.makedirs(self.path, exist_ok=True)
        atomic_write_bytes(self.file(SET_JSON), _json_bytes(record))

    def is_written(self) -> bool:
        record = self.record()
        return bool(record and record.get("digest")) and os.path.exists(self.file(INDEX))

    # --- the plan ------------------------------------------------------------------------------------------------

    def write_plan(self, plan: SetPlan, units: Iterable[list[str]], captioner: dict[str, Any] | None = None) -> None:
        """plan.jsonl from ``units`` (the same ids the fingerprint was made of), then set.json without a digest."""
        os.makedirs(self.file(UNITS_DIR), exist_ok=True)
        temporary = self.file(PLAN + ".tmp")
        offsets = self.file(PLAN_OFFSETS + ".tmp")
        with open(temporary, "wb") as f, open(offsets, "wb") as index:
            for unit, ids in enumerate(units):
                index.write(f.tell().to_bytes(8, "little"))
                f.write((json.dumps({"unit": unit, "source_ids": ids}, ensure_ascii=False) + "\n").encode("utf-8"))
        os.replace(offsets, self.file(PLAN_OFFSETS))
        os.replace(temporary, self.file(PLAN))
        self.write_record({"version": SET_VERSION, "name": plan.name, "fingerprint": plan.fingerprint,
                           "settings": plan.settings, "units": plan.units, "samples": plan.samples,
                           "source": plan.source, "instructions": [s["instruction"] for s in
                                                                   plan.settings["captioning"]],
                           "captioner": captioner, "digest": None})

    def plan_units(self) -> Iterator[tuple[int, list[str]]]:
        """``(unit, source ids)`` of plan.jsonl, streamed."""
        with open(self.file(PLAN), encoding="utf-8") as f:
            for line in f:
                entry = json.loads(line)
                yield entry["unit"], entry["source_ids"]

    def unit_ids(self, unit: int) -> list[str]:
        """One unit's ids: its line found through plan.offsets (a worker never reads the whole plan)."""
        with open(self.file(PLAN_OFFSETS), "rb") as index:
            index.seek(8 * unit)
            offset = index.read(8)
        if unit < 0 or len(offset) != 8:
            raise DiffprepError(f"caption set {self.name}: unit {unit} is not in its plan ({self.file(PLAN)})")
        with open(self.file(PLAN), "rb") as f:
            f.seek(int.from_bytes(offset, "little"))
            entry = json.loads(f.readline())
        return entry["source_ids"]

    # --- units ---------------------------------------------------------------------------------------------------

    def committed(self, unit: int, fingerprint: str) -> dict[str, Any] | None:
        """A unit's header when it is committed under ``fingerprint``; None otherwise (not yet, or another plan's)."""
        try:
            with open(self.file(unit_name(unit)), encoding="utf-8") as f:
                header = json.loads(f.readline())
        except (FileNotFoundError, ValueError):
            return None
        return header if header.get("fingerprint") == fingerprint else None

    def commit_unit(self, unit: int, fingerprint: str, records: list[dict[str, Any]]) -> dict[str, Any]:
        """The unit's file, written whole and renamed in: a unit cut short leaves nothing."""
        rejected = sum(1 for r in records if "reject" in r)
        header = {"unit": unit, "fingerprint": fingerprint, "captioned": len(records) - rejected,
                  "rejected": rejected}
        data = b"".join(_json_line(r) for r in [header, *records])
        os.makedirs(self.file(UNITS_DIR), exist_ok=True)
        atomic_write_bytes(self.file(unit_name(unit)), data)
        return header

    def unit_records(self, unit: int) -> Iterator[dict[str, Any]]:
        with open(self.file(unit_name(unit)), encoding="utf-8") as f:
            f.readline()
            for line in f:
                yield json.loads(line)

    def listing(self) -> tuple[list[str], list[str]]:
        """The set folder's files, relative: those a caption run writes, and the others (never removed)."""
        ours, foreign = [], []
        for folder, dirs, files in os.walk(self.path):
            rel = os.path.relpath(folder, self.path)
            for name in sorted(files) + sorted(d for d in dirs if os.path.islink(os.path.join(folder, d))):
                relative = name if rel == "." else f"{rel}/{name}"
                (ours if _own_file(relative) and not os.path.islink(os.path.join(folder, name))
                 else foreign).append(relative)
        return sorted(ours), sorted(foreign)

    def remove(self) -> list[str]:
        """An approved overwrite: the files a caption run writes, never through a link; the others stay (returned)."""
        no_link_below(Path(self.path).parent, Path(self.path))
        ours, foreign = self.listing()
        for relative in ours:
            os.remove(no_link_below(Path(self.path), Path(self.path) / relative))
        for folder in (SANITY_DIR, UNITS_DIR):
            with contextlib.suppress(OSError):  # kept when something else is in it
                os.rmdir(os.path.join(self.path, folder))
        return foreign

    # --- written -------------------------------------------------------------------------------------------------

    def write_outputs(self, units: int, families: Iterable[str]) -> dict[str, Any]:
        """captions.jsonl and index.sqlite from the committed units in order; returns the digest and token
        statistics (per family: samples, longest, how many over the limit, and which (the first 20))."""
        from diffprep.captions.tokens import TokenTally

        tally = TokenTally(families)
        digest = hashlib.sha256()
        index_path = self.file(INDEX)
        temporary = index_path + ".tmp"
        if os.path.exists(temporary):
            os.remove(temporary)
        db = sqlite3.connect(temporary)
        db.execute("CREATE TABLE captions (source_id TEXT PRIMARY KEY, captions TEXT, tokens TEXT, "
                   "media_path TEXT)")
        listing = self.file(CAPTIONS_JSONL + ".tmp")
        with open(listing, "wb") as out:
            for unit in range(units):
                with open(self.file(unit_name(unit)), "rb") as f:
                    data = f.read()
                digest.update(hashlib.sha256(data).digest())
                rows = []
                for line in data.splitlines()[1:]:
                    record = json.loads(line)
                    if "reject" in record:
                        continue
                    captions = record["captions"]
                    tokens = record.get("tokens", {})
                    tally.add(record["source_id"], tokens)
                    out.write(_json_line({"caption": captions[0], "media_path": record.get("media_path"),
                                          "source_id": record["source_id"], "captions": captions}))
                    rows.append((record["source_id"], json.dumps(captions, ensure_ascii=False),
                                 json.dumps(tokens), record.get("media_path")))
                db.executemany("INSERT INTO captions VALUES (?, ?, ?, ?)", rows)
        db.commit()
        db.close()
        os.replace(listing, self.file(CAPTIONS_JSONL))
        os.replace(temporary, index_path)
        return {"digest": digest.hexdigest(), "tokens": tally.to_json()}

    def finish(self, digest: str, extra: dict[str, Any]) -> None:
        """set.json with its digest: the set is written (an encode may read it)."""
        record = self.record() or {}
        atomic_write_bytes(self.file(SET_JSON), _json_bytes(record | extra | {"digest": digest}))

    def write_json(self, relative: str, value: Any) -> str:
        path = self.file(relative)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        atomic_write_bytes(path, _json_bytes(value))
        return path


def _json_line(value: Any) -> bytes:
    return (json.dumps(value, ensure_ascii=False, sort_keys=True) + "\n").encode("utf-8")


def _json_bytes(value: Any) -> bytes:
    return (json.dumps(value, ensure_ascii=False, indent=2, sort_keys=True) + "\n").encode("utf-8")


def fingerprint_of(settings: dict[str, Any], ids_digest: str) -> str:
    """The set's fingerprint: its captioning settings and the planned ids (a changed source: a new plan)."""
    text = json.dumps({"settings": settings, "ids": ids_digest}, sort_keys=True)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


# The files a caption run writes in its set folder, by folder; each may also be left as its temporary (``<name>.tmp``
# by the plan, index and listing writers, ``.<name>.<host>.<pid>.tmp`` by ``atomic_write_bytes``).
_WRITTEN = {"": (SET_JSON, PLAN, PLAN_OFFSETS, INDEX, CAPTIONS_JSONL, AUDIT_JSON, TOKENS_JSON),
            SANITY_DIR: ("frames.png", "sanity.json")}
_UNIT_FILE = re.compile(r"\d{6}\.jsonl")


def _own_file(relative: str) -> bool:
    """A file a caption run writes in its set folder (``_WRITTEN``, a unit's ``units/NNNNNN.jsonl``), or the
    temporary of one: nothing else is removed by an overwrite."""
    folder, _, name = relative.rpartition("/")
    if "/" in folder or (folder and folder not in (UNITS_DIR, SANITY_DIR)):
        return False
    if name.endswith(TEMP_SUFFIX):
        name = name.removesuffix(TEMP_SUFFIX)
        if name.startswith("."):  # atomic_write_bytes's: the name, then the host (which may hold dots) and the pid
            name = name[1:].split(".")
            return any(_written(folder, ".".join(name[:cut])) for cut in range(1, len(name)))
    return _written(folder, name)


def _written(folder: str, name: str) -> bool:
    return _UNIT_FILE.fullmatch(name) is not None if folder == UNITS_DIR else name in _WRITTEN[folder]


__all__ = ["AUDIT_JSON", "CAPTIONS_JSONL", "PLAN", "SANITY_DIR", "SETS_FOLDER", "TOKENS_JSON", "CaptionSet",
           "SetPlan", "fingerprint_of", "unit_name"]
