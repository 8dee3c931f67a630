"""The plan: which source samples go into which work unit, and the fingerprint of the settings.

The fingerprint covers what changes the bytes of a shard (encoders and their
configs, precision, image sizing, T5 length, latent mode, shard size, key
format), not the source listing: a source that grew keeps every planned unit
as it is and gets new units for its new samples only.

plan.json describes units, not samples: each unit's sample ids (and the
source's locator of each) are in a file of their own beside it
(``unit_lists``), read by the unit that needs them; counts come from
plan.json. Planning reads the listing once with bounded memory.
"""

from __future__ import annotations

import copy
import hashlib
import itertools
import json
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from diffprep import contract
from diffprep.errors import DiffprepError
from diffprep.sources.base import Repeats
from diffprep.writer.links import no_link_below
from diffprep.writer.shards import atomic_write_bytes, atomic_write_json
from diffprep.writer.unit_lists import Entry, ListingIndex, Staging, list_bytes, read_entries

MISSING_PREVIEW = 20


KEPT_LISTS = 8  # the unit lists read from their files that stay in memory, per process
_kept: OrderedDict[int, "UnitPlan"] = OrderedDict()
_kept_lock = threading.Lock()


def _keep(unit: "UnitPlan") -> None:
    """``unit``'s list is the newest kept; the oldest past ``KEPT_LISTS`` is forgotten."""
    with _kept_lock:
        _kept[id(unit)] = unit
        _kept.move_to_end(id(unit))
        while len(_kept) > KEPT_LISTS:
            _, oldest = _kept.popitem(last=False)
            oldest._forget()


class UnitPlan:
    """One unit: its index, its samples (ids, and the locators the source gave them) and, for video, its bucket.

    Its sample list lives in a file of its own (``unit_lists``): ``source_ids`` and ``positions`` read it on first
    use and keep it while it is among the ``KEPT_LISTS`` lists read last in this process (a process that goes
    through every unit, the units phase or the audit, then holds a few lists, never the plan's every id: an
    older one is read again if it is used again); ``entries`` streams it without keeping it, for the loops over a
    whole plan. ``count`` is plan.json's, read without the list. A unit built from ids in memory (a
    plan of the tests, one converted from plan.json's old inline form) holds them from the start.
    """

    def __init__(self, unit: int, source_ids: Iterable[str] | None = None, bucket: str | None = None, *,
                 positions: list[Any] | None = None, count: int | None = None, path: Path | None = None,
                 pull: Callable[[str], None] | None = None, staging: Staging | None = None) -> None:
        if source_ids is None and (path is None and count is None):
            raise ValueError(f"unit {unit}: give its source ids or the file of its sample list")
        self.unit = unit
        self.bucket = bucket  # a video run's WxHxF bucket: one shard holds one bucket (None: not bucketed)
        self._ids = list(source_ids) if source_ids is not None else None
        self._positions = positions
        self._count = count
        self._path = path  # where its list is read (None: in memory only)
        self._pull = pull  # makes the local copy of its list current (a bucket output's), given its state path
        self._staging = staging  # keeps the staging folder its list was planned into while this unit lives

    @property
    def shard(self) -> str:
        return contract.shard_name(self.unit)

    @property
    def count(self) -> int:
        """How many samples the unit plans (without reading its list)."""
        ids = self._ids
        return len(ids) if ids is not None else self._count

    @property
    def source_ids(self) -> list[str]:
        ids = self._ids
        return ids if ids is not None else self._load()[0]

    @property
    def positions(self) -> list[Any] | None:
        """The source's locator of each sample (``Source.read(ids, at=...)``), parallel to ``source_ids``; None
        when the source gave none, or not one for every sample (a retried reject's is not known)."""
        if self._ids is None:
            return self._load()[1]
        return self._positions

    def entries(self) -> Iterator[Entry]:
        """``(id, at)`` for each sample, streamed from the list's file when it is not in memory (nothing kept)."""
        if self._ids is not None:
            yield from zip(self._ids, self._positions if self._positions is not None else [None] * len(self._ids))
            return
        yield from read_entries(self._list_file())

    def _list_file(self) -> Path:
        if self._path is None:
            raise DiffprepError(f"unit {self.unit}'s sample list was not given with its plan (plan.json read without "
                                "its folder): read the plan with read_plan or Output.state.plan()")
        if self._pull is not None:
            self._pull(contract.plan_unit_path(self.unit))
        if not self._path.is_file():
            raise DiffprepError(
                f"unit {self.unit}'s sample list {self._path} is missing, so the plan beside it cannot be read. "
                "Plan again into a fresh output (--on-existing new-dir), or restore the state folder from a copy.")
        return self._path

    def _load(self) -> tuple[list[str], list[Any] | None]:
        ids, positions = [], []
        for sid, at in read_entries(self._list_file()):
            ids.append(sid)
            positions.append(at)
        if self._count is not None and len(ids) != self._count:
            raise DiffprepError(f"unit {self.unit}'s sample list {self._path} holds {len(ids)} samples, plan.json "
                                f"plans {self._count}: the state folder was changed by hand. Plan again into a fresh "
                                "output (--on-existing new-dir).")
        kept = positions if all(at is not None for at in positions) and positions else None
        self._ids, self._positions, self._count = ids, kept, len(ids)
        _keep(self)
        return ids, kept

    def _forget(self) -> None:
        """Drop the list read from its file (read again when used again)."""
        self._ids = self._positions = None

    def to_json(self) -> dict[str, Any]:
        """The unit in plan.json: index, count, bucket, the file of its list (relative to the state folder)."""
        data: dict[str, Any] = {"unit": self.unit, "count": self.count}
        if self.bucket is not None:  # image runs: no bucket
            data["bucket"] = self.bucket
        data["file"] = contract.plan_unit_path(self.unit)
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any], folder: Path | None = None,
                  pull: Callable[[str], None] | None = None) -> "UnitPlan":
        if "source_ids" in data:  # plan.json of an earlier version: the ids inline (kept; written as lists again)
            return cls(data["unit"], data["source_ids"], data.get("bucket"))
        unit = data["unit"]
        if data.get("file") != contract.plan_unit_path(unit):  # never a path plan.json chose (``../`` or a link)
            raise DiffprepError(f"plan.json names {data.get('file')!r} as unit {unit}'s sample list, not "
                                f"{contract.plan_unit_path(unit)!r}: it was not written by diffprep. Plan again into "
                                "a fresh output (--on-existing new-dir).")
        path = folder / data["file"] if folder is not None else None
        return cls(unit, None, data.get("bucket"), count=data["count"], path=path, pull=pull)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, UnitPlan):
            return NotImplemented
        return ((self.unit, self.bucket, self.count, self.source_ids, self.positions)
                == (other.unit, other.bucket, other.count, other.source_ids, other.positions))

    def __repr__(self) -> str:
        return f"UnitPlan(unit={self.unit}, count={self.count}, bucket={self.bucket!r})"


@dataclass
class Plan:
    """What ``plan.json`` holds; every later phase reads it instead of the source."""

    fingerprint: str
    settings: dict[str, Any]  # the byte-affecting settings the fingerprint was computed from
    source: dict[str, Any]  # the source's description (no secrets)
    expected: dict[str, Any]  # shapes and dtype every sample must have
    units: list[UnitPlan]
    encoding: str = contract.ENCODING_PREENCODED
    missing: list[str] = field(default_factory=list)  # planned ids no longer in the source (first few)
    missing_count: int = 0
    version: int = contract.CONTRACT_VERSION
    # The split asked for (train_split, seed): a later `diffprep finalize` keeps it. Not fingerprinted (no byte of a
    # shard depends on it); None in plans written before it was recorded.
    split: dict[str, Any] | None = None
    # Rejected ids planned again because their inputs changed: id -> the last unit that encodes it again. Its
    # rejects in earlier units are superseded (the audit counts the id once, in that unit).
    retried: dict[str, int] = field(default_factory=dict)
    retrying: int = 0  # how many of them this plan added
    # Long videos (--split-scenes): per source id, its shots, windows and discarded frames (diffprep/run/long_videos.py),
    # found once: a re-run or an append reads them here.
    scenes: dict[str, dict[str, Any]] = field(default_factory=dict)
    # Committed units of which a written sample's input files (a mask, a sound file) changed since it was read
    # (UnitManifest.stamps): verify-existing counts them damaged and this run encodes them again.
    changed_units: list[int] = field(default_factory=list)
    # The CPU kernels and the encoders' intra-op thread count the latents' last bits depend on (diffprep/run/threads.py),
    # kept by resumes and appends; not fingerprinted. None in plans written before it was recorded.
    cpu: dict[str, Any] | None = None
    # The source's stamp when it was listed (diffprep/sources/stamps.py): a re-run whose source has the same stamp
    # takes this plan's units instead of listing it again. Not fingerprinted; None where the source has no cheap
    # stamp, and in plans written before it was recorded (those list again, and record it).
    source_stamp: dict[str, Any] | None = None

    def superseded(self, unit: int, source_id: str) -> bool:
        """Whether ``source_id``'s outcome in ``unit`` gave way to a retry in a later unit."""
        return self.retried.get(source_id, -1) > unit

    @property
    def total_samples(self) -> int:
        return sum(u.count for u in self.units)  # plan.json's counts: no unit's list is read

    def unit(self, index: int) -> UnitPlan:
        if 0 <= index < len(self.units) and self.units[index].unit == index:
            return self.units[index]  # units are numbered from 0 in order: no scan per unit
        for unit in self.units:
            if unit.unit == index:
                return unit
        raise KeyError(f"unit {index} is not in the plan (units 0..{len(self.units) - 1})")

    def to_json(self) -> dict[str, Any]:
        """plan.json: everything but the units' sample lists (``write_plan`` writes those beside it)."""
        data = {f.name: copy.deepcopy(getattr(self, f.name)) for f in fields(self) if f.name != "units"}
        data["units"] = [unit.to_json() for unit in self.units]
        for name in ("retried", "retrying", "scenes", "changed_units", "cpu", "source_stamp"):  # the same for plans that never retried
            if not data[name]:
                del data[name]
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any], folder: Path | None = None,
                  pull: Callable[[str], None] | None = None) -> "Plan":
        """A plan from plan.json; ``folder``: where its units' lists are (the state folder); ``pull``: what makes a
        list's local copy current before it is read (a bucket output's). Plans of earlier versions (ids inline) are
        read as they are and written in the new form by the next ``write_plan``."""
        data = dict(data)
        data["units"] = [UnitPlan.from_json(u, folder, pull) for u in data["units"]]
        return cls(**data)


def planned_inputs(plan: Plan) -> tuple[str, ...]:
    """The clip's other inputs a plan reads besides its media (masks, sound files, reference audio: their roles)."""
    return tuple(plan.settings.get("video", {}).get("inputs", ()))


def shape_matches(shape: list[int] | tuple[int, ...], want: list[int | None] | None) -> bool:
    """Whether a tensor shape fits a planned one (``None``: any size in that dimension; no plan: anything)."""
    return want is None or (len(shape) == len(want) and all(w is None or w == s for w, s in zip(want, shape)))


def dtype_name(dtype: Any) -> str:
    """``torch.bfloat16`` -> ``bfloat16``, as plan.json's ``expected["dtype"]`` names it."""
    return str(dtype).removeprefix("torch.")


def fingerprint(settings: dict[str, Any]) -> str:
    """A short stable hash of the byte-affecting settings."""
    blob = json.dumps(settings, sort_keys=True, separators=(",", ":")).encode("utf-8")
    return hashlib.sha256(blob).hexdigest()[:16]


def settings_diff(old: dict[str, Any], new: dict[str, Any], prefix: str = "") -> list[str]:
    """Each byte-affecting setting that differs between two plans, as ``name: old -> new`` (nested settings by
    dotted name; one missing on a side shows as ``(none)``)."""
    changes = []
    for key in sorted(set(old) | set(new), key=str):
        name = f"{prefix}{key}"
        before, after = old.get(key, _MISSING), new.get(key, _MISSING)
        if isinstance(before, dict) and isinstance(after, dict):
            changes += settings_diff(before, after, name + ".")
        elif before != after:
            changes.append(f"{name}: {_shown(before)} -> {_shown(after)}")
    return changes


_MISSING = object()


def _shown(value: Any) -> str:
    return "(none)" if value is _MISSING else json.dumps(value, sort_keys=True)


LISTING_CHUNK = 2_500  # listing entries taken at once


def plan_units(
    ids: Iterable[str | Entry],
    *,
    shard_size: int,
    max_samples: int | None = None,
    previous: Plan | None = None,
    bucket_of: Callable[[str], str | None] | None = None,
    retry: Iterable[str] = (),
    buckets_of: Callable[[list[str]], Mapping[str, str | None]] | None = None,
    repeats: Repeats | None = None,
) -> tuple[list[UnitPlan], list[str], int]:
    """Cut the source listing into units, with bounded memory.

    ``ids``: the listing, as ids (``Source.list_ids``) or ``(id, at)`` pairs (``Source.list_entries``: ``at`` is
    kept beside the id in its unit's list, ``UnitPlan.positions``); it is read once. Which ids are planned already
    and which the listing repeats is answered by a ``ListingIndex`` on disk, not by sets of every id; each unit's
    list is then written to a staging folder as the unit fills (``unit_lists``).

    With a ``previous`` plan of the same fingerprint, its units stay exactly as
    they are (a partly filled last unit included: its shard may be written
    already) and only ids it does not hold get new units. ``bucket_of`` (video
    runs): the bucket of a new id; each unit then holds one bucket, its ids in
    source order, and an id with no bucket (it cannot be read; the encode phase
    records why) goes to units of their own. ``retry``: planned ids (rejected,
    their inputs changed since) planned again, in new units before the new ids.
    ``buckets_of``: ``bucket_of`` for a batch of new ids at once (a probe of
    their files on many threads), asked ``LISTING_CHUNK`` ids at a time. ``repeats``: the source's naming of an
    id its listing gives again (``Source.repeats``).
    Returns the units, a preview of
    planned ids that disappeared from the source, and their count.
    """
    staging = Staging()
    index = ListingIndex(staging.root / "index", repeats)
    try:
        units = list(previous.units) if previous else []
        for unit in units:  # the planned ids, one unit's list at a time
            index.planned(sid for sid, _ in unit.entries())
        total = previous.total_samples if previous else 0
        listing = iter(ids)
        if max_samples is not None and not total:
            # Nothing planned yet: every listed id is new, so the listing is read no further than the limit (and the
            # one after it) instead of to the end of a large source.
            listing = itertools.islice(listing, max(0, max_samples) + 1)
        while chunk := list(itertools.islice(listing, LISTING_CHUNK)):
            # A listing gives ids (``list_ids``) or (id, at) pairs (``list_entries``), one or the other throughout.
            index.listed([(sid, None) for sid in chunk] if isinstance(chunk[0], str) else chunk)
        missing, missing_count = index.classify(MISSING_PREVIEW)

        next_unit = (max(u.unit for u in units) + 1) if units else 0
        groups: dict[str | None, list[Entry]] = {}  # bucket -> its samples not yet in a unit (one group unbucketed)

        def close(bucket: str | None, entries: list[Entry]) -> None:
            nonlocal next_unit
            units.append(UnitPlan(next_unit, None, bucket, count=len(entries), path=staging.write(next_unit, entries),
                                  staging=staging))
            next_unit += 1

        def add(sid: str, at: Any, bucket: str | None) -> None:
            current = groups.setdefault(bucket, [])
            current.append((sid, at))
            if len(current) == shard_size:
                close(bucket, current)
                current.clear()

        def to_plan() -> Iterator[Entry]:  # the retried ids (their locators are looked up), then the new ones
            nonlocal total
            yield from ((sid, None) for sid in retry)
            for entry in index.new_entries():
                if max_samples is not None and total >= max_samples:
                    return
                yield entry
                total += 1

        if buckets_of is None:
            for sid, at in to_plan():
                add(sid, at, bucket_of(sid) if bucket_of is not None else None)
        else:
            entries = to_plan()
            while chunk := list(itertools.islice(entries, LISTING_CHUNK)):
                found = buckets_of([sid for sid, _ in chunk])
                for sid, at in chunk:
                    add(sid, at, found.get(sid))
        for bucket, current in groups.items():  # the partly filled units, in order of their buckets' first sample
            if current:
                close(bucket, current)
    finally:
        index.close()
    return units, missing, missing_count


def plan_path(out_dir: str | os.PathLike) -> Path:
    return Path(out_dir) / contract.STATE_DIR / contract.PLAN_JSON


def read_plan(path: str | os.PathLike, pull: Callable[[str], None] | None = None) -> Plan | None:
    """The plan of an output (or a plan.json file); its units' lists are read from the folder beside plan.json when
    a unit is first used. ``pull``: what makes a list's local copy current first (``StateStore.plan``)."""
    path = Path(path)
    if path.is_dir():
        path = plan_path(path)
    if not path.is_file():
        return None
    return Plan.from_json(json.loads(path.read_text(encoding="utf-8")), path.parent, pull)


LIST_WRITERS = 8  # lists written at once: their fsyncs (a bucket's uploads) overlap instead of queueing


def write_unit_lists(plan: Plan, folder: Path, write: Callable[[str, bytes], Path]) -> None:
    """Write each unit's list that ``folder`` (the state folder) does not hold yet through ``write(relative, data)``
    (atomic, links refused), and read the units from there after. A unit whose list is ``folder``'s already and
    that was not loaded is not written again: a resume or an append writes only its new units' lists."""
    pending = [unit for unit in plan.units
               if unit._ids is not None or unit._path != folder / contract.plan_unit_path(unit.unit)]

    def write_one(unit: UnitPlan) -> Path:
        # A list planned into a staging folder is copied as it is; one in memory (old plan.json, tests) encoded.
        data = unit._list_file().read_bytes() if unit._ids is None else list_bytes(unit.entries())
        return write(contract.plan_unit_path(unit.unit), data)

    with ThreadPoolExecutor(LIST_WRITERS) as pool:
        for start in range(0, len(pending), 64 * LIST_WRITERS):  # a bounded number of writes in flight
            batch = pending[start:start + 64 * LIST_WRITERS]
            for unit, path in zip(batch, pool.map(write_one, batch)):
                if unit._ids is None:
                    unit._path, unit._staging, unit._pull = path, None, None


def write_plan(path: str | os.PathLike, plan: Plan) -> Path:
    """Write ``plan`` to an output's state folder (or to a ``.json`` file): the units' lists, then plan.json."""
    path = Path(path)
    if path.is_dir() or path.suffix != ".json":
        path = plan_path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    folder = path.parent

    def write(relative: str, data: bytes) -> Path:
        target = no_link_below(folder, folder / relative)
        target.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(target, data)
        return target

    write_unit_lists(plan, folder, write)
    atomic_write_json(no_link_below(folder, path), plan.to_json())
    return path
