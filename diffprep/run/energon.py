"""Finalize an output folder as a Megatron-Energon dataset.

(Over 400 lines on purpose: split assignment, dataset.yaml and Energon's prepare, with the checks of
what prepare wrote, are one phase.)

``finalize`` takes the committed shards (those with a unit manifest), gives
each new shard a split, writes ``.nv-meta/dataset.yaml`` (a
``CrudeWebdataset`` with subflavor ``encoding``), and runs Energon's prepare
through its Python API, which writes ``.info.json``, ``split.yaml``,
``index.sqlite`` and a ``.tar.idx`` next to every shard. A local output's
metadata is built from the shard writer's member records instead
(``diffprep.run.energon_index``: the same files, without reading every tar).

Splits are assigned by whole shard and recorded in ``.diffprep/splits.json``.
Energon's own ratio split reshuffles every shard whenever shards are added,
which leaks held-out data into train; here a recorded shard never changes
split. New shards fill the splits towards the target ratios
(train = ``train_split``, val = test = half the rest each); ``split.yaml``
lists each split's shards (written by diffprep in Energon's format, also
after a bucket's prepare). Only ``replace_split=True`` reassigns
everything; callers must get the user's approval for that first
(``preview_replace_split`` says which shards would move).

Both ways overwrite existing metadata without asking (only the ``energon
prepare`` CLI wants ``--force-overwrite``), rebuilding the index and every
``.tar.idx``, so re-finalizing after an append simply indexes all committed
shards again: from their records, without reading the tars, on a local output.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import sqlite3
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterator

import braceexpand
import yaml

from diffprep import contract
from diffprep.run.approvals import ABORT, Question
from diffprep.run.energon_bucket import BucketShards, publish_metadata, records_complete
from diffprep.run.energon_index import NoRecord, build_index, write_split_yaml
from diffprep.run.failpoints import failpoint
from diffprep.writer.layouts import Layout
from diffprep.errors import ConfigError, DatasetValidationError, ExistingOutputError
from diffprep.output import Output, as_output
from diffprep.run.manifests import Manifests
from diffprep.writer.shards import UnitManifest

log = logging.getLogger(__name__)

Progress = Callable[[str, int, int], None]

SPLITS_VERSION = 1


@dataclass
class FinalizeResult:
    #: split -> shard names, only non-empty splits.
    splits: dict[str, list[str]]
    #: split -> number of samples.
    counts: dict[str, int]
    #: Field names (tar member extensions) Energon found in the shards.
    parts: list[str]
    #: True when the written assignment differs from the recorded one (new shards or moved shards).
    changed: bool
    #: Shards that got a split in this run.
    new_shards: list[str] = field(default_factory=list)
    #: shard -> (old split, new split); only ever non-empty with ``replace_split=True``.
    moved: dict[str, tuple[str, str]] = field(default_factory=dict)
    #: Tar files in the output that are not committed diffprep shards; left out of the dataset.
    foreign: list[str] = field(default_factory=list)
    #: Committed shards with no samples (every input rejected); Energon cannot index them.
    empty: list[str] = field(default_factory=list)


def split_targets(train_split: float) -> dict[str, float]:
    """Target fraction of shards per split: train, then val and test sharing the rest."""
    if not 0.0 < train_split <= 1.0:
        raise ConfigError(f"train_split must be in (0, 1], got {train_split}; use e.g. 0.9, or 1.0 for train only")
    rest = (1.0 - train_split) / 2
    return {"train": train_split, "val": rest, "test": rest}


def _order_key(seed: int, name: str) -> tuple[str, str]:
    # Shards are cut from consecutive source samples: spreading val/test over the
    # whole range (seeded, not name order) keeps them from being "the last folder".
    return hashlib.sha256(f"{seed}:{name}".encode()).hexdigest(), name


def assign_splits(shards: list[str], existing: dict[str, str], train_split: float, seed: int) -> dict[str, str]:
    """Give every shard a split; shards in ``existing`` keep theirs.

    The target shard counts for all ``len(shards)`` shards are apportioned from
    the ratios, with at least one shard for every split whose ratio is
    non-zero. New shards (visited in a seeded order) then go to the split that
    lacks most shards against its target, ties broken in the order train, val,
    test. The same inputs always give the same assignment. Entries of
    ``existing`` for shards not in ``shards`` are dropped.
    """
    targets = split_targets(train_split)
    active = [split for split in contract.SPLITS if targets[split] > 0]
    for shard, split in existing.items():
        if split not in contract.SPLITS:
            raise ConfigError(f"shard {shard} is recorded in split {split!r}; splits are {list(contract.SPLITS)}")
    total = len(shards)
    if total < len(active):
        raise ConfigError(
            f"{total} shard(s) cannot fill the {len(active)} splits {active} of train_split={train_split}: "
            f"lower --shard-size so there are at least {len(active)} shards, or use --train-split 1.0"
        )

    # Apportion the final counts: one shard per active split first, then by largest deficit.
    wanted = {split: (1 if split in active else 0) for split in contract.SPLITS}
    for _ in range(total - len(active)):
        split = max(active, key=lambda s: (targets[s] * total - wanted[s], -contract.SPLITS.index(s)))
        wanted[split] += 1

    assignment = {shard: existing[shard] for shard in shards if shard in existing}
    have = {split: 0 for split in contract.SPLITS}
    for split in assignment.values():
        have[split] += 1
    for shard in sorted((s for s in shards if s not in assignment), key=lambda s: _order_key(seed, s)):
        split = max(active, key=lambda s: (wanted[s] - have[s], -contract.SPLITS.index(s)))
        assignment[shard] = split
        have[split] += 1
    return {shard: assignment[shard] for shard in sorted(assignment)}


def planned_split(shards: int, train_split: float, seed: int = 42) -> tuple[dict[str, int], str | None]:
    """What finalize will make of ``train_split`` over ``shards`` planned shards, before any is written: the shard
    count of each split, and a warning when whole shards cannot come close to the ratio. Raises ConfigError when
    they cannot fill the splits at all (as finalize would, after the whole encode)."""
    names = [contract.shard_name(unit) for unit in range(shards)]
    assignment = assign_splits(names, {}, train_split, seed)
    counts = {split: sum(1 for s in assignment.values() if s == split) for split in contract.SPLITS}
    targets = split_targets(train_split)
    if any(abs(counts[split] / shards - targets[split]) > 0.1 for split in contract.SPLITS):
        shown = " / ".join(f"{split} {counts[split]}" for split in contract.SPLITS if counts[split])
        return counts, (f"--train-split {train_split} over {shards} shards gives {shown} shards (splits are by "
                        f"whole shard): lower --shard-size for a split closer to {train_split}")
    return counts, None


def write_dataset_yaml(output: Output | str | os.PathLike, encoding: str, layout: Layout | None = None) -> Path:
    """Write ``.nv-meta/dataset.yaml``: a CrudeWebdataset whose samples carry ``encoding`` (and a layout other
    than energon's own names: its member map, for the cookers) as subflavors."""
    if encoding not in contract.ENCODINGS:
        raise ConfigError(f"encoding must be one of {list(contract.ENCODINGS)}, got {encoding!r}")
    config = {
        "__module__": "megatron.energon",
        "__class__": "CrudeWebdataset",
        "subflavors": {"encoding": encoding, **(layout or Layout()).subflavors()},
    }
    return as_output(output).write_file(f"{contract.NV_META}/{contract.DATASET_YAML}",
                                        yaml.safe_dump(config, sort_keys=False).encode("utf-8"))


def read_subflavors(out_dir: str | os.PathLike) -> dict[str, Any] | None:
    """The subflavors of an existing dataset.yaml, or None when there is none."""
    path = Path(out_dir) / contract.NV_META / contract.DATASET_YAML
    if not path.is_file():
        return None
    config = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    subflavors = config.get("subflavors") if isinstance(config, dict) else None
    return subflavors if isinstance(subflavors, dict) else None


def read_dataset_encoding(out_dir: str | os.PathLike) -> str | None:
    """The ``encoding`` subflavor of an existing dataset.yaml, or None when there is none."""
    return (read_subflavors(out_dir) or {}).get("encoding")


def read_split_yaml(out_dir: str | os.PathLike) -> dict[str, str]:
    """shard -> split from Energon's ``split.yaml`` (brace patterns expanded); empty when absent."""
    path = Path(out_dir) / contract.NV_META / contract.SPLIT_YAML
    if not path.is_file():
        return {}
    config = yaml.safe_load(path.read_text(encoding="utf-8"))
    parts = config.get("split_parts") if isinstance(config, dict) else None
    if not isinstance(parts, dict) or not all(isinstance(names, list) for names in parts.values()):
        raise DatasetValidationError(f"{path} has no split_parts mapping each split to a list of shards; run finalize")
    assignment: dict[str, str] = {}
    for split, names in parts.items():
        for pattern in names:
            for name in braceexpand.braceexpand(pattern):
                if name in assignment and assignment[name] != split:
                    raise DatasetValidationError(f"{path} puts shard {name} in both {assignment[name]!r} and {split!r}")
                assignment[name] = split
    return assignment


def read_assignment(output: Output | str | os.PathLike) -> dict[str, str]:
    """The recorded shard -> split assignment.

    From ``.diffprep/splits.json``; when that is missing but an earlier
    prepare left ``.nv-meta/split.yaml``, from that file.
    """
    output = as_output(output)
    record = read_split_record(output)
    if record is not None:
        return dict(record["assignment"])
    return read_split_yaml(output.working_copy())


def read_split_record(output: Output) -> dict[str, Any] | None:
    """``.diffprep/splits.json`` as written by the last finalize (train_split, seed, assignment), or None."""
    return output.state.read_json(contract.SPLITS_JSON)


def split_question(output: Output | str | os.PathLike, *, train_split: float, seed: int = 42) -> Question | None:
    """The question to ask before finalizing with another ``train_split`` than the recorded one, or None."""
    output = as_output(output)
    record = read_split_record(output)
    if record is None or record["train_split"] == train_split:
        return None
    moves = preview_replace_split(output, train_split=train_split, seed=seed)
    out_dir = output.uri
    if not moves:
        return None
    rows = [f"| `{shard}` | {old} | {new} |" for shard, (old, new) in list(moves.items())[:50]]
    description = "\n".join([
        f"`{out_dir}` is split with **train_split {record['train_split']}**; this run asks for "
        f"**{train_split}**, which would move {len(moves)} shard(s):",
        "",
        "| shard | now | would be |",
        "|---|---|---|",
        *rows,
        "",
        "**Choices:** `replace`: reassign every shard (held-out val/test data may enter train) · `keep`: keep the "
        "recorded split, new shards follow the new ratio · `abort`: change nothing.",
    ])
    return Question(
        key="replace-split",
        title=f"The dataset is already split with train_split {record['train_split']}",
        description=description,
        choices=("replace", "keep", ABORT),
        preset_hint="--replace-split / finalize.on_split_change replace|keep|abort",
    )


def committed_shards(output: Output | str | os.PathLike) -> tuple[dict[str, UnitManifest], list[str], list[str]]:
    """(shard -> manifest for committed shards with samples, empty shards, foreign tar files).

    Empty shards come from outputs of an earlier diffprep, which wrote a tar for a unit whose every sample was
    rejected (such a unit's manifest now names no shard); they stay, and ``shard_counts.json`` names them with 0.

    A committed shard whose tar is missing or has another size than its
    manifest records is an error: the data changed after the commit.
    """
    output = as_output(output)
    entries = output.entries()  # a bucket: listed now, and the sizes below come from this listing
    shards: dict[str, UnitManifest] = {}
    empty: list[str] = []
    for unit, manifest in Manifests(output).items():  # one manifest at a time; only the kept ones stay
        if not manifest.has_shard:  # every sample rejected: the unit wrote no shard
            continue
        path = f"{output.uri}/{manifest.shard}"
        size = output.size(manifest.shard)
        if size is None:
            raise DatasetValidationError(
                f"unit {unit} has a manifest but its shard {path} is missing; re-run encoding to rewrite that unit"
            )
        if size != manifest.bytes:
            raise DatasetValidationError(
                f"shard {path} is {size} bytes but its manifest records {manifest.bytes}; the file changed after it "
                f"was committed: remove {contract.STATE_DIR}/{contract.UNITS_DIR}/{contract.unit_manifest_name(unit)} "
                "and re-run encoding to rewrite that unit"
            )
        if manifest.count == 0:
            empty.append(manifest.shard)
        else:
            shards[manifest.shard] = _without_ids(manifest)
    ours = set(shards) | set(empty)
    foreign = sorted(
        name for name in entries
        if name.endswith((".tar", ".tgz")) and name not in ours and output.size(name) is not None
    )
    return shards, empty, foreign


def _without_ids(manifest: UnitManifest) -> UnitManifest:
    """The manifest without its per-sample lists (keys, source ids, rejects): finalize keeps one per shard and
    needs only its shard, count, size and digest, so that 100k shards of 1000 samples do not hold 100M ids."""
    return replace(manifest, keys=[], source_ids=[], rejects=[], stamps=None)


def preview_replace_split(
    output: Output | str | os.PathLike, *, train_split: float, seed: int = 42
) -> dict[str, tuple[str, str]]:
    """Recorded shards that ``finalize(..., replace_split=True)`` would move: shard -> (old, new).

    Meant for the approval question before a full reassignment.
    """
    output = as_output(output)
    shards, _, _ = committed_shards(output)
    previous = read_assignment(output)
    fresh = assign_splits(sorted(shards), {}, train_split, seed)
    return {s: (previous[s], fresh[s]) for s in sorted(previous) if s in fresh and previous[s] != fresh[s]}


def _progress_adapter(progress: Progress | None) -> Callable[[Iterator[Any], int], Iterator[Any]]:
    def progress_fn(items: Iterator[Any], total: int) -> Iterator[Any]:
        for done, item in enumerate(items, start=1):
            yield item
            if progress is not None:
                progress("prepare", done, total)

    return progress_fn


def _run_prepare(out: Any, splits: dict[str, list[str]], workers: int, progress: Progress | None) -> set[str]:
    # Imported here: Energon pulls in torch and a lot more, which plan/CLI code paths do not need.
    from megatron.energon.flavors.webdataset.base_webdataset import BaseWebdatasetFactory

    names = sorted(name for shards in splits.values() for name in shards)
    # split.yaml is written after prepare, listing each split's shards: a pattern per split matched against every
    # shard grew ~N^2.3 in shards (an alternation of every name). These match nothing, at once.
    nothing = [(split, "^$") for split in splits]
    try:
        parts = BaseWebdatasetFactory.prepare_dataset(
            out,
            names,
            split_parts_patterns=nothing,
            split_config=contract.SPLIT_YAML,
            shuffle_seed=None,
            progress_fn=_progress_adapter(progress),
            workers=max(1, min(workers, len(names))),
        )
    except SystemExit as error:
        # Energon calls sys.exit(1) on duplicate sample keys after printing the example key.
        raise DatasetValidationError(
            f"Energon prepare stopped (exit {error.code}): two shards hold the same sample key. diffprep keys "
            "are <unit>_<index>, so a shard was copied or renamed; remove the duplicate and finalize again"
        ) from None
    except AssertionError as error:
        # A tar Energon cannot read is logged and counted as 0 samples, then rejected here.
        raise DatasetValidationError(
            f"Energon prepare could not index the shards ({error}); the named shard is unreadable or truncated: "
            "re-encode that unit"
        ) from error
    write_split_yaml(out, splits)
    return set(parts)


def _index(output: Output, splits: dict[str, list[str]], manifests: dict[str, UnitManifest], workers: int,
           progress: Progress | None) -> set[str]:
    """Energon's metadata, from the shard writer's records in shard order (``diffprep.run.energon_index``): a
    folder's, or a bucket's whose commits uploaded them (``diffprep.run.energon_bucket``); else (a bucket written by
    an earlier diffprep) Energon's prepare, reading every shard through its Multi-Storage Client."""
    if not output.remote:
        with output.energon_access() as path:
            return build_index(path, splits, manifests, progress)
    if records_complete(output, sorted(manifests)):
        try:
            with BucketShards(output) as shards:
                parts = build_index(output.local, splits, manifests, progress, shards)
            publish_metadata(output)
            return parts
        except NoRecord as missing:
            log.info("shard %s has no record of its writer matching its manifest: Energon's prepare indexes the "
                     "bucket", missing)
    with output.energon_access() as path:  # Energon writes .nv-meta there; the working copy follows
        return _run_prepare(path, splits, workers, progress)


def finalize(
    output: Output | str | os.PathLike,
    *,
    encoding: str,
    train_split: float,
    seed: int = 42,
    workers: int = 2,
    replace_split: bool = False,
    progress: Progress | None = None,
) -> FinalizeResult:
    """Make ``out_dir`` an Energon dataset over its committed shards.

    Recorded shards keep their split, even when ``train_split`` changed; new
    shards are assigned towards the current ratios. ``replace_split=True``
    reassigns every shard from scratch (held-out shards may move into train):
    pass it only after the user approved that. A shard that is recorded in a
    split but no longer committed is an error unless ``replace_split``.

    A bucket prefix is prepared in place, Energon reading it through a
    Multi-Storage Client profile; its metadata is then staged and checked here.
    """
    output = as_output(output)
    out = output.working_copy()
    if encoding not in contract.ENCODINGS:
        raise ConfigError(f"encoding must be one of {list(contract.ENCODINGS)}, got {encoding!r}")
    split_targets(train_split)
    existing_encoding = read_dataset_encoding(out)
    if existing_encoding is not None and existing_encoding != encoding:
        raise ExistingOutputError(
            f"{output.uri}/{contract.NV_META}/{contract.DATASET_YAML} declares encoding {existing_encoding!r}, "
            f"this finalize is for {encoding!r}; write to a new output directory instead"
        )

    manifests, empty, foreign = committed_shards(output)
    if not manifests:
        raise DatasetValidationError(f"{output.uri} has no committed shards with samples; run encoding first")
    previous = read_assignment(output)
    vanished = sorted(set(previous) - set(manifests))
    if vanished and not replace_split:
        raise DatasetValidationError(
            f"{len(vanished)} shard(s) recorded in a split are no longer committed: {vanished[:10]}; restore them, "
            "or re-split without them (replace_split, needs approval)"
        )

    assignment = assign_splits(sorted(manifests), {} if replace_split else previous, train_split, seed)
    splits = {split: sorted(s for s, p in assignment.items() if p == split) for split in contract.SPLITS}
    splits = {split: names for split, names in splits.items() if names}

    layout = Layout.of_plan(plan.settings) if (plan := output.state.plan()) is not None else Layout()
    write_dataset_yaml(output, encoding, layout)
    failpoint("finalize")
    parts = _index(output, splits, manifests, workers, progress)

    info = json.loads((out / contract.NV_META / contract.INFO_JSON).read_text(encoding="utf-8"))
    counted = info.get("shard_counts", {})
    if set(counted) != set(manifests):
        raise DatasetValidationError(
            f"Energon indexed {sorted(set(counted) ^ set(manifests))[:10]} differently from the committed shards"
        )
    for name, manifest in manifests.items():
        if counted[name] != manifest.count:
            raise DatasetValidationError(
                f"shard {name} holds {counted[name]} samples in its tar headers but its manifest records "
                f"{manifest.count}; the tar changed after it was committed: re-encode unit {manifest.unit}"
            )
    written = read_split_yaml(out)
    if written != assignment:
        raise DatasetValidationError(
            f"Energon wrote a split.yaml that differs from the assignment: {written} != {assignment}"
        )
    index = out / contract.NV_META / contract.INDEX_SQLITE
    with contextlib.closing(sqlite3.connect(f"file:{index}?mode=ro", uri=True)) as db:
        indexed = db.execute("SELECT COUNT(*) FROM samples").fetchone()[0]
    if indexed != sum(counted.values()):
        raise DatasetValidationError(f"index.sqlite holds {indexed} samples, .info.json counts {sum(counted.values())}")

    layout.write_shard_counts(output, {name: m.count for name, m in manifests.items()} | dict.fromkeys(empty, 0))
    output.state.write_json(
        contract.SPLITS_JSON,
        {"version": SPLITS_VERSION, "train_split": train_split, "seed": seed, "assignment": assignment},
    )
    moved = {s: (old, assignment[s]) for s, old in sorted(previous.items()) if assignment.get(s, old) != old}
    return FinalizeResult(
        splits=splits,
        counts={split: sum(counted[name] for name in names) for split, names in splits.items()},
        parts=sorted(parts),
        changed=assignment != previous,
        new_shards=sorted(s for s in assignment if s not in previous),
        moved=moved,
        foreign=foreign,
        empty=empty,
    )
