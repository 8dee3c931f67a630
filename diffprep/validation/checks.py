"""The checks of a finalized dataset, each a function of the ``Dataset`` description returning its findings.

- ``check_splits``: every shard of ``.info.json`` in exactly one split, split.yaml
  agreeing with ``.diffprep/splits.json``, no committed shard left out;
- ``check_shards``: every shard and its ``.tar.idx`` present, the index with
  one entry per sample, the tar headers holding the ``.info.json`` count, the
  unit manifest's keys, size and sha256, and every field a sample needs;
- ``check_loading`` (``--full`` in one process, or ``max_load``): every sample (or
  ``max_load`` per split) loaded through Energon's own loader with the encoding's
  task encoder and errors re-raised, each split yielding exactly its
  ``.info.json`` count; the encoding's inspector judges each loaded sample
  (shapes, dtypes, finite values). By default one sample drawn from each shard is
  loaded instead, and ``--full`` in processes loads the same as here
  (``diffprep.validation.loading``);
- ``check_layout_files``: a trainer layout's files at the top (FastGen's
  negative prompt ``.npy`` files and ``shard_counts.json``).

Fields are judged under the dataset's own names whatever layout wrote them
(dataset.yaml's subflavors record its member map).

No check writes a file; ``diffprep.validation`` assembles the report.
"""

from __future__ import annotations

import contextlib
import gc
import io
import json
import warnings
from collections.abc import Iterator
from typing import Any, Callable

import numpy as np

from diffprep import contract
from diffprep.report.checks import Check, Findings
from diffprep.encodings import Encoding
from diffprep.output import Output
from diffprep.writer.plan import shape_matches
from diffprep.writer.shards import UnitManifest
from diffprep.validation.dataset import Dataset

Progress = Callable[[str, int, int], None]
_IDX_ENTRY_BYTES = 8  # Energon's .tar.idx: one uint64 offset per sample plus the end offset


def check_splits(ds: Dataset) -> tuple[list[Check], dict[str, Any]]:
    """The split assignment; the summary's ``splits`` (shards and samples per split)."""
    if ds.info is None or ds.split_of is None:
        return [], {}
    problems = Findings("splits")
    for name in sorted(set(ds.split_of) - set(ds.info)):
        problems.add(f"{name} is in split {ds.split_of[name]!r} but not in {contract.INFO_JSON}")
    for name in sorted(set(ds.info) - set(ds.split_of)):
        problems.add(f"{name} is in {contract.INFO_JSON} but in no split")
    if ds.recorded_splits_problem:
        problems.add(ds.recorded_splits_problem)
    recorded = ds.recorded_splits or {}
    moved = {n: (recorded[n], s) for n, s in ds.split_of.items() if n in recorded and recorded[n] != s}
    for name, (was, now) in sorted(moved.items()):
        problems.add(f"{name} is in {now!r} in split.yaml but recorded in {was!r} in "
                     f"{contract.STATE_DIR}/{contract.SPLITS_JSON}; finalize again "
                     "(do not run energon prepare by hand)")
    for shard, count in ds.committed.items():
        if count and shard not in ds.info:
            problems.add(f"{shard} is committed but not in the dataset; run finalize")
    splits = {
        split: {
            "shards": sum(1 for s in ds.split_of.values() if s == split),
            "samples": sum(ds.info.get(n, 0) for n, s in ds.split_of.items() if s == split),
        }
        for split in contract.SPLITS
        if split in ds.split_of.values()
    }
    detail = "shards per split: " + ", ".join(f"{split} {v['shards']}" for split, v in splits.items())
    return [problems.check(detail)], {"splits": splits}


def check_shards(ds: Dataset, output: Output, encoding: Encoding | None,
                 progress: Progress | None = None) -> tuple[list[Check], dict[str, Any]]:
    """Every shard read once (from the bucket, for a bucket prefix): index, counts, manifests, fields."""
    if ds.info is None:
        return [], {}
    findings = {name: Findings(name) for name in ("shard files", "shard counts", "manifests", "fields")}
    total_bytes = 0
    names = sorted(ds.info)
    for done, name in enumerate(names, start=1):
        size = output.size(name)
        if size is not None:
            total_bytes += size
            _check_shard(ds, output, encoding, name, findings)
        else:
            findings["shard files"].add(f"{name} is listed in {contract.INFO_JSON} but missing")
        if progress is not None:
            progress("shards", done, len(names))
    for problem in getattr(ds.manifests, "problems", {}).values():  # manifests that could not be read
        findings["manifests"].add(problem)
    samples_total = sum(ds.info.values())
    summary = {
        "shards": len(names),
        "samples": samples_total,
        "bytes": total_bytes,
        "bytes_per_sample": round(total_bytes / samples_total) if samples_total else 0,
    }
    checks = [
        findings["shard files"].check(f"{len(names)} shards and their .tar.idx present"),
        findings["shard counts"].check(f"tar headers match {contract.INFO_JSON} ({samples_total} samples)"),
        findings["manifests"].check("keys, size and sha256 match the unit manifests" if ds.manifests
                                    else "no unit manifests (not written by diffprep)"),
        findings["fields"].check("every sample has its required fields"),
    ]
    return checks, summary


def _check_shard(ds: Dataset, output: Output, encoding: Encoding | None, name: str,
                 findings: dict[str, Findings]) -> None:
    files, counts, manifests_check, fields = (findings[n] for n in ("shard files", "shard counts", "manifests",
                                                                    "fields"))
    count = ds.info[name]
    idx = contract.index_name(name)
    idx_size = output.size(idx)
    if idx_size is None:
        files.add(f"{idx} is missing; run finalize to rebuild the tar index")
    elif idx_size != (count + 1) * _IDX_ENTRY_BYTES:
        files.add(f"{idx} indexes {idx_size // _IDX_ENTRY_BYTES - 1} samples, {contract.INFO_JSON} counts {count}; "
                  "run finalize")

    try:  # one read of the shard: size, hash and tar headers
        digest = output.shard_digest(name)
    except OSError as error:
        files.add(f"{name} cannot be read: {error}")
        return
    size, sha256, samples = digest.size, digest.sha256, digest.keys

    unit = contract.unit_of_shard(name)
    manifest: UnitManifest | None = ds.manifests.get(unit) if unit is not None else None
    if ds.manifests and manifest is None and unit not in getattr(ds.manifests, "problems", {}):
        manifests_check.add(f"{name} has no unit manifest")
    if manifest is not None:
        if manifest.shard != name:
            manifests_check.add(f"manifest of unit {unit} names shard {manifest.shard}, not {name}")
        if (size, sha256) != (manifest.bytes, manifest.sha256):
            manifests_check.add(f"{name} is {size} bytes with sha256 {sha256[:12]}…, its manifest records "
                                f"{manifest.bytes} bytes, {manifest.sha256[:12]}…: the shard was modified or "
                                "corrupted after it was written; re-encode that unit")
    if digest.error is not None:
        counts.add(f"{name}: cannot read the tar headers ({digest.error})")
        return

    if len(samples) != count:
        counts.add(f"{name} holds {len(samples)} samples, {contract.INFO_JSON} counts {count}")
    if manifest is not None and sorted(manifest.keys) != sorted(samples):
        missing = sorted(set(manifest.keys) - set(samples))
        extra = sorted(set(samples) - set(manifest.keys))
        manifests_check.add(f"{name} holds {len(samples)} samples, its manifest records {manifest.count}: "
                            f"missing {missing[:5]}, extra {extra[:5]}")
    for key, exts in samples.items():
        problem = _field_problem(encoding, ds.layout.fields_of(exts), ds.expected)
        if problem:
            under = f" (layout {ds.layout.name}: it has the members {sorted(exts)})" if ds.layout.members else ""
            fields.add(f"{name} sample {key}: {problem}{under}")


def _field_problem(encoding: Encoding | None, exts: list[str], expected: dict[str, Any] | None) -> str:
    if encoding is not None:
        return encoding.field_problem(exts, expected)
    # dataset.yaml names no known encoding (already a metadata finding): duplicates and the plan's fields only.
    if len(set(exts)) != len(exts):
        return f"duplicate fields {sorted(exts)}"
    required = (expected or {}).get("fields") or []
    missing = [f for f in required if f not in exts]
    return f"missing {missing} (required by the plan)" if missing else ""


@contextlib.contextmanager
def frozen_gc() -> Iterator[None]:
    """The objects of this process left out of garbage-collection scans inside the block (``gc.freeze``)."""
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def check_layout_files(ds: Dataset, output: Output) -> list[Check]:
    """A trainer layout's files at the output's top: each negative prompt embedding a plain float32 ``.npy`` of one
    sample (shaped as the plan's field), and ``shard_counts.json`` naming every ``.tar`` there with its samples."""
    layout = ds.layout
    if not (layout.negative or layout.shard_counts):
        return []
    problems = Findings(f"{layout.name} files")
    for name, field_name in layout.negative.items():
        try:
            with output.open(name) as stream:
                array = np.load(io.BytesIO(stream.read()), allow_pickle=False)
        except Exception as error:  # noqa: BLE001 - missing or unreadable: a finding
            problems.add(f"{name} cannot be read as a plain .npy ({type(error).__name__}: {error}); encode again")
            continue
        want = (ds.expected or {}).get(contract.field_stem(field_name))
        if array.dtype != np.float32 or not shape_matches(array.shape, want):
            problems.add(f"{name} is {array.dtype} {list(array.shape)}, expected float32 {want} (one sample of "
                         f"{field_name}, no batch dimension)")
    if layout.shard_counts:
        counts = dict(ds.committed) or dict(ds.info or {})
        tars = {n for n in output.entries() if n.endswith(contract.SHARD_SUFFIX)}
        try:
            with output.open(contract.SHARD_COUNTS_JSON) as stream:
                recorded = json.loads(stream.read())
        except Exception as error:  # noqa: BLE001 - missing or unreadable: a finding
            problems.add(f"{contract.SHARD_COUNTS_JSON} cannot be read ({type(error).__name__}: {error}); finalize")
        else:
            if recorded != counts:
                problems.add(f"{contract.SHARD_COUNTS_JSON} records {recorded}, the committed shards hold {counts}; "
                             "finalize again")
            if tars - set(recorded):
                problems.add(f"{sorted(tars - set(recorded))[:10]} are in the folder but not in "
                             f"{contract.SHARD_COUNTS_JSON}: a loader listing every .tar there fails on them")
    return [problems.check(", ".join([*layout.negative, *([contract.SHARD_COUNTS_JSON] if layout.shard_counts
                                                          else [])]) + " as the layout reads them")]


def check_loading(ds: Dataset, output: Output, encoding: Encoding, inspector: Any, splits: dict[str, Any],
                  max_load: int | None, progress: Progress | None = None) -> list[Check]:
    """Every split loaded through Energon's own loader; ``splits[split]["loaded"]`` is filled in."""
    from megatron.energon import WorkerConfig, get_loader, get_val_dataset
    from megatron.energon.errors import reraise_exception

    checks = []
    for split, info in splits.items():
        problems = Findings(f"load {split}")
        total = info["samples"]
        limit = total if max_load is None else min(total, max_load)
        loaded = 0
        worker_config = WorkerConfig(rank=0, world_size=1, num_workers=0, global_error_handler=reraise_exception)
        try:
            with warnings.catch_warnings(), output.energon_access() as path:
                # The loader asks for pinned memory, which a CPU-only machine cannot give; harmless here.
                warnings.filterwarnings("ignore", message=".*pin_memory.*")
                # get_val_dataset reads each split once, in order, without shuffling or repeating.
                dataset = get_val_dataset(path, split_part=split, batch_size=None, worker_config=worker_config,
                                          task_encoder=encoding.task_encoder())
                # The loader runs a full gc.collect() as it starts and every 10 samples: in a process holding
                # encoders and a Prefect client, seconds per split. The objects that exist now are left out of
                # those scans (Energon's own GcDataset freezes what exists when it starts iterating, then unfreezes).
                with frozen_gc():
                    for sample in get_loader(dataset, watchdog_timeout_seconds=None):
                        loaded += 1
                        inspector.inspect(sample)
                        if progress is not None and (loaded % 100 == 0 or loaded == limit):
                            progress(f"load {split}", loaded, limit)
                        if loaded >= limit and max_load is not None:
                            break
        except Exception as error:  # noqa: BLE001 - a sample that does not load is a finding
            problems.add(f"loading failed after {loaded} samples: {type(error).__name__}: {error}")
        else:
            if loaded != limit:
                problems.add(f"Energon yielded {loaded} samples, {contract.INFO_JSON} counts {total}")
        info["loaded"] = loaded
        limited = f" (max_load {max_load})" if limit < total else ""
        checks.append(problems.check(f"{loaded} of {total} samples loaded through Energon{limited}"))
    return checks + inspector.checks()


__all__ = ["check_layout_files", "check_loading", "check_shards", "check_splits"]
