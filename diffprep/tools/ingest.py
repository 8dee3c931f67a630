"""``diffprep ingest``: an already-encoded dataset (MLPerf Flux's Arrow files) into Energon shards, as an encode would.

The run is ``diffprep.phases.pipeline.run`` with its plan, prepare, sanity and units
steps swapped for an ingest's; verify, audit, finalize and validation are the
encode's own. The plan has one unit per manifest file, in name order (a grown
manifest keeps its units and plans new ones for the new files). The units
step downloads files ahead of the unit being written (``Prefetcher``: at most
``prefetch_depth`` on disk), writes each file's rows into its unit's shard
(``diffprep.encodings.ingested``: the bytes as stored) through the shard
writer, and commits the unit by its manifest, the commit point; only then is
the file removed. A killed run resumes at the first unit without a manifest.

Several manifests (``datasets``: Primus's ``mlperf_flux1.yaml`` lists CC12M
for train and COCO for val) go into one dataset: the plan's units are one per
file across them, the datasets in their order and each one's files in name
order (``<dataset>/<file>`` source ids, so a re-run keeps every unit), and the
finalize step gives each shard its dataset's split instead of a ratio's.
"""

from __future__ import annotations

import errno
import logging
import shutil
import time
from pathlib import Path
from typing import Any

from diffprep import contract
from diffprep.run.approvals import ABORT, Question
from diffprep.config import FinalizeConfig, Settings, WorkersConfig
from diffprep.encodings import get_encoding
from diffprep.encodings.ingested import FORMAT_MLPERF, row_fields, row_id, shapes_of
from diffprep.run.energon import SPLITS_VERSION, FinalizeResult, committed_shards, finalize, read_assignment
from diffprep.errors import ConfigError
from diffprep.phases.existing import Decision, Inspection
from diffprep.run.failpoints import failpoint
from diffprep.tools.ingest_settings import IngestConfig
from diffprep.output import Output
from diffprep.phases.pipeline import (Ask, Events, Progress, RunResult, Steps, ask_here, finalize_split, prepare_output,
                               run)
from diffprep.writer.plan import Plan, fingerprint, plan_units
from diffprep.run.sanity import TAR_MEMBER_OVERHEAD, SanityReport, finish_sanity
from diffprep.writer.shards import Reject, UnitManifest
from diffprep.sources.mlperf import (ManifestSet, Prefetcher, arrow_rows, clear_partial_downloads, download,
                                     file_md5, file_url, read_manifest, safe_file_name)
from diffprep.run.units import DiskSpaceError, UnitResult, UnitWriter, disk_full_message

log = logging.getLogger("diffprep.ingest")
SANITY_ROWS = 4  # rows of the first file checked before any unit is written


def ingest_unit(output: Output, plan: Plan, unit_index: int, path: Path) -> UnitResult:
    """One file's rows into its unit's shard, committed by its manifest (idempotent: a committed unit stays)."""
    start = time.perf_counter()
    done = output.committed_unit(unit_index, plan.fingerprint)
    if done is not None:
        return UnitResult(unit_index, done.count, len(done.rejects), 0.0, skipped=True)
    (name,) = plan.unit(unit_index).source_ids
    keys: list[str] = []
    source_ids: list[str] = []
    rejects: list[Reject] = []
    sink = output.shard_sink(unit_index)
    try:
        with UnitWriter(output.local, unit_index, sink) as writer:
            for row, values in enumerate(arrow_rows(path)):
                failpoint("decode")
                key, sid = contract.sample_key(unit_index, row), row_id(name, row)
                fields = row_fields(values, sid, key)
                if isinstance(fields, Reject):
                    rejects.append(fields)
                    continue
                writer.write(key, fields)
                failpoint("shard-write")
                keys.append(key)
                source_ids.append(sid)
            info = writer.commit()
    except OSError as error:
        if error.errno == errno.ENOSPC:
            raise DiskSpaceError(disk_full_message(output.local, unit_index)) from error
        raise
    failpoint("before-manifest")
    manifest = UnitManifest(unit=unit_index, shard=info.name, fingerprint=plan.fingerprint, keys=keys,
                            source_ids=source_ids, count=info.count, bytes=info.bytes, sha256=info.sha256,
                            rejects=rejects)
    output.commit_unit(manifest, sink)
    seconds = time.perf_counter() - start
    log.info("unit %06d (%s): %d written, %d rejected in %.1f s", unit_index, name, info.count, len(rejects), seconds)
    return UnitResult(unit_index, info.count, len(rejects), seconds, skipped=False)


class IngestJob:
    """One ingest run's steps for ``diffprep.phases.pipeline.run``, sharing the manifest and the downloads between them."""

    def __init__(self, config: IngestConfig, manifests: ManifestSet, ask: Ask = ask_here) -> None:
        self.config, self.manifests, self.ask = config, manifests, ask
        self.prefetcher: Prefetcher | None = None
        self.encoding = get_encoding(contract.ENCODING_PREENCODED_NUMPY)
        # dataset -> its split; empty for one manifest (split by --train-split, as an encode)
        self.splits = {d.name: d.split for d in config.datasets or ()}

    @property
    def download_options(self) -> dict[str, Any]:
        c = self.config
        return {"retries": c.retries, "backoff_s": c.backoff_s, "timeout_s": c.timeout_s}

    def downloads(self, output: Output) -> Path:
        return Path(self.config.download_dir) if self.config.download_dir else output.state.path(
            contract.DOWNLOADS_DIR)

    # --- the steps -------------------------------------------------------------------------------------------------

    def plan(self, settings: Settings, output: Output, encoding: str) -> Plan:
        """One unit per manifest file, across the datasets in their order (an earlier plan of the same fingerprint
        keeps its units)."""
        byte, expected = self.encoding.ingest_settings(FORMAT_MLPERF)
        fp = fingerprint(byte)
        previous = output.state.plan() if output.local.is_dir() else None
        if previous is not None and previous.fingerprint != fp:
            previous = None  # other settings: verify-existing asks what to do
        units, missing, missing_count = plan_units(self.listing(previous), shard_size=1, previous=previous)
        return Plan(fingerprint=fp, settings=byte, source=self.manifests.describe(), expected=expected, units=units,
                    encoding=self.encoding.name, missing=missing, missing_count=missing_count)

    def listing(self, previous: Plan | None) -> list[str]:
        """The file ids to plan: every dataset's, in order; with ``max_files``, a dataset's planned files and its
        first others up to ``max_files`` of it (Primus's ``max_files`` counts per dataset)."""
        planned = {sid for unit in previous.units for sid in unit.source_ids} if previous else set()
        limit = self.config.max_files
        ids: list[str] = []
        for dataset, _ in self.manifests.manifests:
            mine = self.manifests.ids(dataset)
            room = None if limit is None else limit - sum(1 for sid in mine if sid in planned)
            for sid in mine:
                if sid in planned:
                    ids.append(sid)
                elif room is None or room > 0:
                    ids.append(sid)
                    room = None if room is None else room - 1
        return ids

    def split_of(self, file_id: str) -> str:
        return self.splits[self.manifests.dataset_of(file_id)]

    def prepare(self, output: Output, decision: Decision, inspection: Inspection, plan: Plan,
                workers: WorkersConfig) -> list[int]:
        """The encode's preparation, then (under the same lock) what killed runs left in the download folder
        removed and the empty encodings fetched."""
        units = prepare_output(output, decision, inspection, plan, workers)
        wanted = {plan.unit(u).source_ids[0] for u in units}
        removed = clear_partial_downloads(self.downloads(output), keep=sorted(wanted))
        if removed:
            log.info("removed downloads no unit needs any more: %s", ", ".join(removed))
        if self.config.empty_encodings:
            self.fetch_empty_encodings(output)
        return units

    def sanity(self, settings: Settings, output: Output, plan: Plan, units_left: list[int]) -> SanityReport:
        """The first file's first rows checked (all four columns, uint16 .npy, one shape each; at least one usable
        row: the others are the unit's rejects); the disk use
        projected from its size; DiskSpaceError before any shard when that does not fit."""
        prefetcher = self._prefetcher(output, plan, units_left)
        name = plan.unit(units_left[0]).source_ids[0]
        start = time.perf_counter()
        path = prefetcher.get(name)
        problems: list[str] = []
        rejected: list[str] = []
        shapes: dict[str, list[int]] = {}
        checked = 0
        per_sample = 0
        rows = 0
        for row, values in enumerate(arrow_rows(path)):
            rows += 1
            if row >= SANITY_ROWS:
                continue
            fields = row_fields(values, row_id(name, row), contract.sample_key(units_left[0], row))
            if isinstance(fields, Reject):  # a reject is data (the unit records it), unless no row is usable
                rejected.append(f"{fields.source_id}: {fields.reason}: {fields.detail}")
                continue
            checked += 1
            per_sample = max(per_sample, sum(len(fields[f]) for f in contract.INGESTED_FIELDS[:4])
                             + TAR_MEMBER_OVERHEAD * len(contract.INGESTED_FIELDS) + 128)
            for stem, shape in shapes_of(fields).items():
                if shapes.setdefault(stem, shape) != shape:
                    problems.append(f"{fields['json']['source_id']}: {stem} has shape {shape}, row 0 has "
                                    f"{shapes[stem]}")
        if rows == 0:
            problems.append(f"{name} holds no rows")
        elif checked == 0:
            problems.append(f"none of the first {len(rejected)} rows of {name} is usable: " + "; ".join(rejected))
        seconds = time.perf_counter() - start
        file_bytes = path.stat().st_size
        # A shard holds about what its file held; the downloads waiting on disk come on top.
        projected = max(file_bytes, per_sample * rows) * len(units_left)
        staged = file_bytes * self.config.prefetch_depth
        report = SanityReport(
            ok=not problems, samples=checked, shapes=shapes, dtypes={stem: "bfloat16" for stem in shapes},
            finite=True, psnr_db=[], seconds_per_batch=round(seconds, 4), peak_memory_bytes=0,
            bytes_per_sample=per_sample, projected_bytes=projected + staged,
            projected_seconds=round(seconds * len(units_left), 1), free_bytes=shutil.disk_usage(output.local).free,
            problems=problems)
        return finish_sanity(output, report, rows * len(units_left))

    def units(self, settings: Settings, output: Output, plan: Plan, units_left: list[int], progress: Progress) -> None:
        prefetcher = self._prefetcher(output, plan, units_left)
        try:
            for unit in units_left:
                name = plan.unit(unit).source_ids[0]
                result = ingest_unit(output, plan, unit, prefetcher.get(name))
                prefetcher.release(name)  # committed: its file is no longer needed
                progress.unit_done({"unit": unit, "count": result.count, "rejected": result.rejected,
                                    "seconds": round(result.seconds, 3), "skipped": result.skipped})
        finally:
            self.close()
        if not self.config.download_dir:
            output.state.discard_scratch(contract.DOWNLOADS_DIR)

    def finalize(self, output: Output, encoding: str, config: FinalizeConfig, replace: bool) -> FinalizeResult:
        """The encode's finalize; with datasets, every shard in its dataset's split. A committed shard recorded in
        another split (the config changed a split_name) moves only when the user approves (``replace``); ``keep``
        leaves the recorded shards where they are."""
        if not self.splits:
            return finalize_split(output, encoding, config, replace)
        plan = output.state.plan()
        committed, _, _ = committed_shards(output)
        wanted = {contract.shard_name(u.unit): self.split_of(u.source_ids[0]) for u in plan.units}
        wanted = {shard: wanted[shard] for shard in sorted(committed) if shard in wanted}
        previous = read_assignment(output)
        moves = {s: (previous[s], split) for s, split in wanted.items() if previous.get(s, split) != split}
        if moves and not replace:
            replace = self.ask(self.split_change(output, moves), config.on_split_change, release=True) == "replace"
        assignment = previous | (wanted if replace else {s: p for s, p in wanted.items() if s not in previous})
        # Recorded first, so that finalize keeps every shard where its dataset puts it (it assigns by ratio only
        # the shards no record names, and there are none left).
        output.state.write_json(contract.SPLITS_JSON, {"version": SPLITS_VERSION, "train_split": config.train_split,
                                                       "seed": config.shuffle_seed, "assignment": assignment})
        result = finalize(output, encoding=encoding, train_split=config.train_split, seed=config.shuffle_seed,
                          workers=config.workers, replace_split=False)
        result.new_shards = sorted(s for s in wanted if s not in previous)
        result.moved = {s: move for s, move in moves.items() if replace}
        result.changed = bool(result.new_shards or result.moved)
        log.info("split by dataset: %s", ", ".join(f"{split} {len(names)} shards"
                                                   for split, names in result.splits.items()))
        return result

    def split_change(self, output: Output, moves: dict[str, tuple[str, str]]) -> Question:
        shown = [f"- `{shard}`: {old} → {new}" for shard, (old, new) in sorted(moves.items())[:10]]
        if len(moves) > 10:
            shown.append(f"- … and {len(moves) - 10} more")
        return Question(
            key="replace-split",
            title=f"{len(moves)} shard(s) of {output.uri} are in another split than their dataset's",
            description="\n".join([
                f"`{output.uri}` records these shards in other splits than the config's datasets now give them:",
                *shown, "",
                "`replace`: move them to their dataset's split (a held-out shard may move into train) · `keep`: "
                "leave the recorded shards where they are, new shards follow the datasets · `abort`: change nothing.",
            ]),
            choices=("replace", "keep", ABORT),
            preset_hint="--on-split-change replace|keep|abort",
        )

    def steps(self) -> Steps:
        steps = Steps.here()
        steps.plan, steps.prepare, steps.sanity, steps.units = self.plan, self.prepare, self.sanity, self.units
        steps.finalize = self.finalize
        return steps

    # --- downloads -------------------------------------------------------------------------------------------------

    def _prefetcher(self, output: Output, plan: Plan, units: list[int]) -> Prefetcher:
        if self.prefetcher is None:
            names = [plan.unit(u).source_ids[0] for u in units]
            self.prefetcher = Prefetcher(self.manifests, names, self.downloads(output),
                                         depth=self.config.prefetch_depth, workers=self.config.download_workers,
                                         **self.download_options)
        return self.prefetcher

    def close(self) -> None:
        if self.prefetcher is not None:
            self.prefetcher.close()
            self.prefetcher = None

    def fetch_empty_encodings(self, output: Output) -> list[str]:
        """The empty caption's encodings of their own manifest, md5-checked, into ``<out>/empty_encodings/``."""
        assert self.config.empty_encodings
        empty = read_manifest(self.config.empty_encodings, **self.download_options)
        written = []
        folder = self.downloads(output)
        for entry in empty.entries:
            relative = f"{contract.EMPTY_ENCODINGS_DIR}/{safe_file_name(entry.name)}"
            target = output.local / relative
            if target.is_file() and file_md5(target) == entry.md5:
                continue
            path = download(file_url(empty.base_url, entry.name), folder / f"empty-{entry.name}", entry.md5,
                            **self.download_options)
            output.write_file(relative, path.read_bytes())
            path.unlink()
            written.append(relative)
        if written:
            log.info("empty encodings: %s", ", ".join(written))
        return written


class IngestEvents(Events):
    def planned(self, plan: Plan, units_left: list[int], output: Output) -> None:
        where = plan.source.get("manifest") or ", ".join(
            f"{d['name']} ({d['manifest']})" for d in plan.source.get("datasets", ()))
        log.info("planned %d files of %s in %d units (fingerprint %s), %d to ingest", plan.total_samples, where,
                 len(plan.units), plan.fingerprint, len(units_left))


def read_manifests(config: IngestConfig) -> ManifestSet:
    """The manifest, or each dataset's, read (with retries) before anything is written."""
    options = {"retries": config.retries, "backoff_s": config.backoff_s, "timeout_s": config.timeout_s}
    if config.datasets is None:
        return ManifestSet(((None, read_manifest(config.manifest, **options)),))
    return ManifestSet(tuple((d.name, read_manifest(d.manifest, **options)) for d in config.datasets))


def ingest(settings: Settings, config: IngestConfig, *, ask: Ask = ask_here, output: Output | None = None
           ) -> RunResult:
    """The whole ingest: plan, verify existing, sanity, units, audit, finalize and validate, as an encode runs them."""
    if not settings.output.output_dir and output is None:
        raise ConfigError("output.output_dir is not set (pass --output-dir)")
    if settings.workers.num_shards is not None:
        raise ConfigError("an ingest runs in one process: remove --num-shards/--shard-index")
    if config.datasets is not None and settings.finalize.train_split != 1.0:
        raise ConfigError(f"finalize.train_split is {settings.finalize.train_split}, but the datasets give the "
                          "splits (each its split_name): remove --train-split")
    job = IngestJob(config, read_manifests(config), ask)
    try:
        return run(settings, contract.ENCODING_PREENCODED_NUMPY, ask=ask, steps=job.steps(), events=IngestEvents(),
                   output=output)
    finally:
        job.close()


__all__ = ["IngestEvents", "IngestJob", "ingest", "ingest_unit", "read_manifests"]
