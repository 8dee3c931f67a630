"""Writing a unit: its batches through the encoding's sample writer into one shard, then the commit.

Every input sample ends in the unit's shard or in its manifest's rejects,
with a reason. The shard is written in a thread of its own while the encoders
work on the next batch, and uploaded while it is written when the output is a
bucket; the output commits the unit (``Output.commit_unit``) once the shard is
whole. A committed unit is left as it is.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import shutil
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

from diffprep.errors import DiffprepError
from diffprep.run.failpoints import failpoint
from diffprep.media.images import UPSCALED, ImageSpec
from diffprep.report.latent_stats import UnitStats, unit_stats_path
from diffprep.writer.layouts import Layout
from diffprep.output import Output, as_output
from diffprep.writer.plan import Plan, UnitPlan, planned_inputs
from diffprep.run.reader import Batch, iter_batches, prefetch
from diffprep.writer.shards import BackgroundShardWriter, Reject, ShardWriter, UnitManifest
from diffprep.sources import Source

log = logging.getLogger("diffprep.units")

Progress = Callable[[dict], None]
# How a batch becomes the fields of its samples (one dict, or a Reject, per sample); counts kept-but-noted
# samples (e.g. truncated captions) in the Counter.
SampleFields = Callable[[Batch, Counter], list[dict | Reject]]
# Shards are written in a thread of their own while the encoders work on the next batch.
UnitWriter = BackgroundShardWriter


class DiskSpaceError(DiffprepError):
    """The projected dataset does not fit on the output's file system."""


@dataclass
class UnitResult:
    unit: int
    count: int
    rejected: int
    seconds: float
    skipped: bool  # already done before this call

    @property
    def samples_per_second(self) -> float:
        return (self.count + self.rejected) / self.seconds if self.seconds > 0 else 0.0


def encode_unit(
    output: Output | str | Path,
    plan: Plan,
    unit_index: int,
    sample_fields: SampleFields,
    source: Source,
    spec: ImageSpec,
    *,
    batch_size: int,
    decode_workers: int = 2,
    progress: Progress | None = None,
    writer: Callable[[], Any] | None = None,
    full_cov: bool = False,
) -> UnitResult:
    """Write one unit into its shard and commit it. Idempotent: a committed unit is left as it is.

    ``sample_fields`` turns a batch into its samples' fields: the encoding's
    sample writer (``diffprep.encodings``). A bucket output gets the shard's
    bytes as they are written (its sink) and commits the unit there.
    ``writer`` makes the unit's writer instead of its shard (the LTX layout's
    files); one with a ``refuse(source_id)`` may turn a sample into a reject. The unit's latent moments
    (``diffprep.report.latent_stats``; the co-moments with ``full_cov``) are accumulated as its samples are written and
    saved before the manifest commits it.
    """
    output = as_output(output)
    start = time.perf_counter()
    done = output.committed_unit(unit_index, plan.fingerprint)
    if done is not None and unit_index not in plan.changed_units:
        return UnitResult(unit_index, done.count, len(done.rejects), 0.0, skipped=True)
    unit = plan.unit(unit_index)
    rejects: list[Reject] = []
    notes: Counter[str] = Counter()
    keys: list[str] = []
    source_ids: list[str] = []
    moments = UnitStats(full_cov)
    sink = output.shard_sink(unit_index)
    batches = prefetch(iter_batches(source, unit, spec, batch_size, rejects, workers=decode_workers))
    # closing(): an encoder error must also stop the reader thread and its decode pool at once.
    try:
        made = writer() if writer is not None else UnitWriter(output.local, unit_index, sink)
        with contextlib.closing(batches), made as writer:
            info = _write_unit(writer, batches, sample_fields, Layout.of_plan(plan.settings), unit, rejects, notes,
                               keys, source_ids, progress, moments)
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            raise DiskSpaceError(disk_full_message(output.local, unit_index)) from exc
        raise
    # Before the commit point: a committed unit always has its moments. A unit without latents (a raw encoding)
    # saves none, unless an earlier try of it did: that file is replaced, never left to be merged.
    if moments.fields or output.state.exists(unit_stats_path(unit_index)):
        output.state.write_bytes(unit_stats_path(unit_index), moments.to_bytes(plan.fingerprint))
    failpoint("before-manifest")
    # Rejects in source order, whatever phase found them.
    order = {sid: i for i, sid in enumerate(unit.source_ids)}
    rejects.sort(key=lambda r: order[r.source_id])
    stamps = getattr(source, "stamps", None)  # what a later run compares to retry a reject whose inputs changed
    if stamps is not None and rejects:
        for reject, stamp in zip(rejects, stamps([r.source_id for r in rejects]).values()):
            reject.stamp = stamp
    manifest = UnitManifest(
        unit=unit_index,
        shard=info.name,
        fingerprint=plan.fingerprint,
        keys=keys,
        source_ids=source_ids,
        count=info.count,
        bytes=info.bytes,
        sha256=info.sha256,
        rejects=rejects,
        notes=dict(sorted(notes.items())),
    )
    manifest.files = info.files
    if stamps is not None and source_ids and planned_inputs(plan):
        manifest.stamps = stamps(list(source_ids))  # a mask or sound file changed later: the unit is redone
    output.commit_unit(manifest, sink)
    seconds = time.perf_counter() - start
    result = UnitResult(unit_index, info.count, len(rejects), seconds, skipped=False)
    log.info("unit %06d: %d written, %d rejected in %.1f s (%.1f samples/s)",
             unit_index, info.count, len(rejects), seconds, result.samples_per_second)
    return result


def _write_unit(writer: ShardWriter, batches: Iterator[Batch], sample_fields: SampleFields, layout: Layout,
                unit: UnitPlan, rejects: list[Reject], notes: Counter, keys: list[str], source_ids: list[str],
                progress: Progress | None, moments: UnitStats):
    """Turn the unit's batches into samples in ``writer`` (under the plan's member names) and commit it; returns
    the shard's info."""
    refuse = getattr(writer, "refuse", None)
    for batch in batches:
        failpoint("encode")
        for i, fields in enumerate(sample_fields(batch, notes)):
            refused = refuse(batch.source_ids[i]) if refuse and not isinstance(fields, Reject) else None
            if isinstance(fields, Reject) or refused is not None:
                rejects.append(refused or fields)
                continue
            if not batch.captions[i].strip():
                notes["empty_caption"] += 1
            if UPSCALED in batch.metas[i].get("notes", ()):
                notes["image_upscaled"] += 1
            writer.write(batch.keys[i], layout.write(fields))
            moments.add(fields)
            failpoint("shard-write")
            keys.append(batch.keys[i])
            source_ids.append(batch.source_ids[i])
        if progress:
            progress({"unit": unit.unit, "samples": len(keys) + len(rejects), "total": len(unit.source_ids)})
    return writer.commit()


def disk_full_message(out_dir: str | Path, unit: int) -> str:
    """What a user needs when the disk filled up under a unit: where, how much is free, what the dataset uses."""
    usage = shutil.disk_usage(out_dir)
    used_here = sum(p.stat().st_size for p in Path(out_dir).glob("*.tar"))
    gib = 1024**3
    return (
        f"the disk filled up while writing unit {unit:06d} to {out_dir}; that unit left nothing behind and the "
        f"units finished before it are intact:\n"
        f"  shards so far  {used_here / gib:10.2f} GiB  ({out_dir})\n"
        f"  free           {usage.free / gib:10.2f} GiB of {usage.total / gib:.2f} GiB\n"
        "Free space (or move the output) and re-run the same command: it resumes at this unit."
    )
