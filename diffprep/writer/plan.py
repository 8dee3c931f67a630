"""The plan: which source samples go into which work unit, and the fingerprint of the settings.

The fingerprint covers what changes the bytes of a shard (encoders and their
configs, precision, image sizing, T5 length, latent mode, shard size, key
format), not the source listing: a source that grew keeps every planned unit
as it is and gets new units for its new samples only.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

from diffprep import contract
from diffprep.writer.shards import atomic_write_json

MISSING_PREVIEW = 20


@dataclass
class UnitPlan:
    unit: int
    source_ids: list[str]
    bucket: str | None = None  # a video run's WxHxF bucket: one shard holds one bucket (None: not bucketed)

    @property
    def shard(self) -> str:
        return contract.shard_name(self.unit)


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

    def superseded(self, unit: int, source_id: str) -> bool:
        """Whether ``source_id``'s outcome in ``unit`` gave way to a retry in a later unit."""
        return self.retried.get(source_id, -1) > unit

    @property
    def total_samples(self) -> int:
        return sum(len(u.source_ids) for u in self.units)

    def unit(self, index: int) -> UnitPlan:
        for unit in self.units:
            if unit.unit == index:
                return unit
        raise KeyError(f"unit {index} is not in the plan (units 0..{len(self.units) - 1})")

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        for unit in data["units"]:
            if unit["bucket"] is None:  # image runs: plan.json exactly as before buckets existed
                del unit["bucket"]
        for name in ("retried", "retrying", "scenes", "changed_units", "cpu"):  # the same for plans that never retried
            if not data[name]:
                del data[name]
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "Plan":
        data = dict(data)
        data["units"] = [UnitPlan(**u) for u in data["units"]]
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


def plan_units(
    ids: Iterable[str],
    *,
    shard_size: int,
    max_samples: int | None = None,
    previous: Plan | None = None,
    bucket_of: Callable[[str], str | None] | None = None,
    retry: Iterable[str] = (),
) -> tuple[list[UnitPlan], list[str], int]:
    """Cut the source listing into units.

    With a ``previous`` plan of the same fingerprint, its units stay exactly as
    they are (a partly filled last unit included: its shard may be written
    already) and only ids it does not hold get new units. ``bucket_of`` (video
    runs): the bucket of a new id; each unit then holds one bucket, its ids in
    source order, and an id with no bucket (it cannot be read; the encode phase
    records why) goes to units of their own. ``retry``: planned ids (rejected,
    their inputs changed since) planned again, in new units before the new ids.
    Returns the units, a preview of
    planned ids that disappeared from the source, and their count.
    """
    units = [UnitPlan(u.unit, list(u.source_ids), u.bucket) for u in previous.units] if previous else []
    planned = {sid for u in units for sid in u.source_ids}
    seen_planned: set[str] = set()
    total = len(planned)
    next_unit = (max(u.unit for u in units) + 1) if units else 0
    groups: dict[str | None, list[str]] = {}  # bucket -> its ids not yet in a unit (one group when not bucketed)
    seen_new: set[str] = set()

    def add(sid: str) -> None:
        nonlocal next_unit
        bucket = bucket_of(sid) if bucket_of is not None else None
        current = groups.setdefault(bucket, [])
        current.append(sid)
        if len(current) == shard_size:
            units.append(UnitPlan(next_unit, list(current), bucket))
            next_unit += 1
            current.clear()

    for sid in retry:
        add(sid)
    for sid in ids:
        if sid in planned:
            seen_planned.add(sid)
            continue
        if max_samples is not None and total >= max_samples:
            if not planned:
                break
            continue  # keep scanning only to learn which planned ids disappeared
        if sid in seen_new:
            raise ValueError(f"the source listed the sample id {sid!r} twice; source ids must be unique")
        seen_new.add(sid)
        add(sid)
        total += 1
    for bucket, current in groups.items():  # the partly filled units, in order of their buckets' first sample
        if current:
            units.append(UnitPlan(next_unit, current, bucket))
            next_unit += 1
    missing = sorted(planned - seen_planned)
    return units, missing[:MISSING_PREVIEW], len(missing)


def plan_path(out_dir: str | os.PathLike) -> Path:
    return Path(out_dir) / contract.STATE_DIR / contract.PLAN_JSON


def read_plan(path: str | os.PathLike) -> Plan | None:
    path = Path(path)
    if path.is_dir():
        path = plan_path(path)
    if not path.is_file():
        return None
    return Plan.from_json(json.loads(path.read_text(encoding="utf-8")))


def write_plan(path: str | os.PathLike, plan: Plan) -> Path:
    path = Path(path)
    if path.is_dir() or path.suffix != ".json":
        path = plan_path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(path, plan.to_json())
    return path
