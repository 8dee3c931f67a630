"""The phases of a run as plain Python: fetch -> verify existing -> sanity -> units -> audit -> finalize -> validate.

(Over 400 lines on purpose: every phase and the run that orders them, readable top to bottom in one
place; each phase is a short function.)

``run()`` is the whole job with typed results and an ``ask`` callback, usable
from a test, a torchrun rank or a notebook without Prefect. Each phase is a
function of its own (``plan_output``, ``verify_output``, ``prepare_output``,
``sanity_phase``, ``encode_one_unit``, ``audit``, ``finalize_output``,
``validate_output``); ``Steps`` names them, and the Prefect flow
(``flows/encode.py``) passes its tasks instead, which call these same
functions. ``Events`` is how a run reports (plan, sanity, progress, audit):
logging here, artifacts in the flow.

Questions are asked through ``ask(question, preset, release=...)``: the
default asks on the terminal and takes the safe choice (abort) when there is
none; ``release=True`` marks a question asked after work was done (a flow run
on a deployment may then give its infrastructure back while it waits).
"""

from __future__ import annotations

import gc
import hashlib
import logging
import socket
import threading
import time
import weakref
from collections import defaultdict
from dataclasses import asdict, dataclass
from typing import Any, Callable, TypeVar

import torch

from diffprep import contract
from diffprep.captions.long_captions import settle_long_captions
from diffprep.run.approvals import Ask, ask_here
from diffprep.phases.audit import AuditReport, answered_before, audit, record_answer, rejects_accepted, rejects_question
from diffprep.config import FinalizeConfig, Settings, WorkersConfig
from diffprep.families.hub import resolve_token
from diffprep.encodings import encoding_for, get_encoding
from diffprep.run.energon import FinalizeResult, finalize, planned_split, split_question
from diffprep.errors import DiffprepError
from diffprep.phases.existing import Decision, Inspection, decide, inspect_output
from diffprep.phases.fetch import fetch
from diffprep.run.launch import Group, my_units
from diffprep.run.long_videos import confirm_discarded, scenes_summary
from diffprep.output import Output, OutputRef, ref_of
from diffprep.validation.ownership import ownership, refuse_links
from diffprep.writer.plan import Plan, fingerprint
from diffprep.run.sanity import SanityReport, round_trip_text
from diffprep.sources import Source, open_source
from diffprep.run.threads import CpuRecord, encoding_device, planned_threads
from diffprep.run.unit_progress import UnitProgress
from diffprep.run.units import UnitResult, encode_unit
from diffprep.validation import ValidationReport, validate_dataset
from diffprep.run.workers import parse_devices, units_for_shard

log = logging.getLogger("diffprep.pipeline")
T = TypeVar("T")


def settings_output(settings: Settings) -> OutputRef:
    """Where the settings say the dataset goes (the LTX layout: its ``.precomputed`` folder)."""
    out = settings.output
    location = out.output_dir
    if out.layout == "ltx" and location:
        from diffprep.encodings.ltx_layout import precomputed_root

        location = precomputed_root(location)
    return OutputRef(location=location, endpoint_url=out.s3_endpoint_url, profile=out.s3_profile,
                     credentials_block=settings.auth.aws_credentials_block)


# --- the phases ----------------------------------------------------------------------------------------------------


def plan_output(settings: Settings, output: Output, encoding: str, token: str | None = None) -> Plan:
    """Phase 1: the plan of this run (an append keeps the units of the plan already there)."""
    plan, _source = fetch(settings, output, token=token, encoding=encoding)
    return plan


def verify_output(output: Output, plan: Plan) -> Inspection:
    """Phase 2: what the output holds against the plan."""
    return inspect_output(output, plan)


def prepare_output(output: Output, decision: Decision, inspection: Inspection, plan: Plan,
                   workers: WorkersConfig) -> list[int]:
    """With the output's lock held: leftovers of dead runs removed, an approved overwrite carried out, the plan
    written. Returns the units this run encodes."""
    removed = output.clear_dead_temp_files()
    if removed:
        log.info("removed temporary files of interrupted writers: %s", ", ".join(removed))
    if workers.shard_index is None:  # holding the prefix alone: any unfinished upload is a dead run's
        aborted = output.abort_stale_uploads()
        if aborted:
            log.info("aborted unfinished uploads of interrupted runs: %s", ", ".join(aborted))
    if decision.action == "overwrite":
        owned = ownership(output)  # again, under the lock: only what diffprep's own records name goes
        output.remove(owned.ours)
        log.warning("overwrite (approved): removed the %d file(s) diffprep wrote%s", len(owned.ours),
                    f"; kept the {len(owned.foreign)} it did not write" if owned.foreign else "")
    output.state.write_plan(plan)
    if decision.action in ("resume", "complete"):
        units = sorted(inspection.units_left + inspection.damaged_units)
    else:
        units = [u.unit for u in plan.units]
    return units_for_shard(units, workers.num_shards, workers.shard_index)


def staged_samples(settings: Settings, output: Output) -> int | None:
    """Samples on local disk at once for a bucket output (a shard per worker until its upload); None for a folder."""
    if not output.remote:
        return None
    return settings.output.shard_size * len(parse_devices(settings.workers.devices or "cpu:1"))


def sanity_phase(settings: Settings, output: Output, plan: Plan, units_left: list[int],
                 token: str | None = None) -> SanityReport:
    """Phase 3: one batch at the run's batch size (smaller when out of memory), checked; the run projected."""
    encoding = get_encoding(plan.encoding)
    loaded = encoding.load(settings, token)
    share_text_encodings(loaded, output, plan)
    source = opened_source(settings, plan, token)
    spec = encoding.media_spec(settings, plan)
    with planned_threads(CpuRecord.from_json(plan.cpu), encoding_device(settings)):  # it fills the caption cache
        return with_smaller_batches_on_oom(
            lambda batch_size: encoding.sanity(output, plan, loaded, source, spec, settings=settings,
                                               batch_size=batch_size, units_left=units_left, workers=1,
                                               staged_samples=staged_samples(settings, output)),
            encoding.batch_size(settings), what="the sanity check", advice=encoding.oom_advice(settings, loaded),
        )


def share_text_encodings(loaded: Any, output: Output, plan: Plan) -> None:
    """The loaded encoders' caption cache, shared with this run's other encoding processes on this machine through
    the output's working folder (``diffprep.families.text_cache``); encoders without one share nothing."""
    cache = getattr(loaded, "text_cache", None)
    if cache is not None:
        cache.share(output.state.path(text_scratch(plan, this_host=True)))


def text_scratch(plan: Plan, *, this_host: bool = False) -> str:
    """The state folder where a run's processes share their caption encodings (``share_text_encodings``), or this
    machine's part of it. The run that owns every unit removes the whole of it once they are done; a process
    that encodes only some (a rank, a fan-out chunk) removes this machine's part, for a staging folder of its own."""
    return f"{contract.TEXT_CACHE_DIR}/{plan.fingerprint}" + (f"/{socket.gethostname()}" if this_host else "")


# The source this process opened last, for the units (and the sanity check) of one plan: opening a source can read
# it whole (a metadata file's rows are checked), so a process opens it once, not once per unit (issue #37).
_OPENED: dict[str, Any] = {}
_OPENED_LOCK = threading.Lock()


def opened_source(settings: Settings, plan: Plan, token: str | None = None) -> Source:
    """The source of ``settings`` for ``plan``, opened once per process: the one opened before when the source
    settings, the token and the plan (the same object: a run's) are the same, else a new one (the old dropped).
    The plan's description of the source spares what listing already found (a metadata file's columns)."""
    options = get_encoding(plan.encoding).source_options(plan.settings)
    key = (settings.source.model_dump_json(), hashlib.sha256((token or "").encode()).hexdigest(), repr(options))
    with _OPENED_LOCK:
        if _OPENED.get("key") != key or _OPENED["plan"]() is not plan:
            _OPENED.clear()  # the other settings' source goes
            _OPENED.update(key=key, plan=weakref.ref(plan),
                           source=open_source(settings.source, token=token, planned=getattr(plan, "source", None),
                                              **options))
        return _OPENED["source"]


# The batch size that last fitted, per loaded encoder set: after running out of memory, the next units start there
# instead of running out of memory again at the full size.
_WORKING_BATCH: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()


def encode_one_unit(settings: Settings, output: Output, plan: Plan, unit: int, token: str | None = None) -> UnitResult:
    """Phase 4, one unit: encoded into its shard and committed (idempotent; smaller batches when out of memory)."""
    encoding = get_encoding(plan.encoding)
    loaded = encoding.load(settings, token)
    share_text_encodings(loaded, output, plan)
    fields = encoding.sample_fields(settings, loaded)
    source = opened_source(settings, plan, token)
    spec = encoding.media_spec(settings, plan)
    start = min(_WORKING_BATCH.get(loaded, encoding.batch_size(settings)), encoding.batch_size(settings))

    writer = encoding.unit_writer(output, plan)

    def attempt(batch_size: int) -> UnitResult:
        result = encode_unit(output, plan, unit, fields, source, spec, batch_size=batch_size,
                             decode_workers=settings.image.decode_workers, writer=writer,
                             full_cov=settings.finalize.full_cov,
                             progress=UnitProgress())  # a line every few seconds inside the unit
        _WORKING_BATCH[loaded] = batch_size
        return result

    # The plan's thread count around the encoders, said first when this CPU cannot give its bits (diffprep/run/threads.py).
    with planned_threads(CpuRecord.from_json(plan.cpu), encoding_device(settings), what=f"unit {unit:06d}"):
        result = with_smaller_batches_on_oom(attempt, start, what=f"unit {unit}",
                                             advice=encoding.oom_advice(settings, loaded))
    cache = getattr(loaded, "text_cache", None)
    if cache is not None and not result.skipped:
        stats = cache.stats
        log.info("text encoders in this process so far: %d of %d captions encoded, %d from the cache (%d of them "
                 "encoded by another process; %d kept, %.0f of %.0f MiB)", stats.encoded, stats.captions, stats.hits,
                 stats.shared, len(cache), cache.bytes / 2**20, cache.max_bytes / 2**20)
    return result


def check_split(plan: Plan, config: FinalizeConfig, split: bool) -> None:
    """The split asked for, checked against the planned shards before anything is written, and recorded in the plan
    for a later finalize (``split``: whether this output has splits at all; a trainer's own folders have none)."""
    if not split:
        return
    counts, warning = planned_split(len(plan.units), config.train_split, config.shuffle_seed)
    plan.split = {"train_split": config.train_split, "seed": config.shuffle_seed}
    if warning:
        log.warning("%s", warning)
    elif config.train_split < 1.0:
        log.info("split: %s", " / ".join(f"{split} {count} shards" for split, count in counts.items()))


def finalize_output(output: Output, encoding: str, config: FinalizeConfig, ask: Ask = ask_here, *,
                    replace_split: bool = False, finalizer: Callable[..., FinalizeResult] | None = None,
                    ) -> FinalizeResult:
    """Phase 6: Energon metadata over the committed shards (the encoding's, for a trainer's own layout); a change
    of split is asked first; a link where it writes (Energon writes its indexes itself) is refused first."""
    refuse_links(output)
    own = get_encoding(encoding).own_folders(output.state.plan())
    question = None if replace_split or own else split_question(output, train_split=config.train_split,
                                                                 seed=config.shuffle_seed)
    replace = replace_split or (question is not None
                                and ask(question, config.on_split_change, release=True) == "replace")
    run = finalizer or finalize_split
    return run(output, encoding, config, replace)


def finalize_split(output: Output, encoding: str, config: FinalizeConfig, replace: bool) -> FinalizeResult:
    plan = output.state.plan()
    own = get_encoding(encoding).own_folders(plan)
    if own is not None:
        return own.finalize(output, plan)
    return finalize(output, encoding=encoding, train_split=config.train_split, seed=config.shuffle_seed,
                    workers=config.workers, replace_split=replace)


def validate_output(output: Output, encoding: str | None = None, max_load: int | None = None) -> ValidationReport:
    """Phase 7: strict validation (the report; ``raise_if_failed`` makes a failure an error)."""
    return validate_dataset(output, encoding=encoding, max_load=max_load)


# --- out of memory ---------------------------------------------------------------------------------------------------


def free_device_memory() -> None:
    """Return what a failed batch held: Python garbage first, then the CUDA allocator's cached blocks."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def with_smaller_batches_on_oom(attempt: Callable[[int], T], batch_size: int, *, what: str, advice: str) -> T:
    """``attempt(batch_size)``; out of device memory, free it and try again at half the batch size, down to 1.

    ``attempt`` must leave nothing behind when it fails (a unit commits its
    shard only once it is whole). Other errors are not caught.
    """
    while True:
        try:
            return attempt(batch_size)
        except torch.OutOfMemoryError as exc:
            error = str(exc).splitlines()[0] if str(exc) else "out of memory"
        # Freed outside the except block: the traceback's frames hold the failed batch's tensors.
        free_device_memory()
        if batch_size <= 1:
            raise DiffprepError(f"{what} ran out of memory even at batch size 1: {advice} ({error})")
        smaller = batch_size // 2
        log.warning("%s ran out of memory at batch size %d: retrying it at batch size %d (%s)",
                    what, batch_size, smaller, error)
        batch_size = smaller


# --- how a run reports and runs its steps -----------------------------------------------------------------------------


class Progress:
    """Units done / total, samples/s per worker and overall, ETA, one log line per unit."""

    def __init__(self, units: int) -> None:
        self.total = units
        self.done = 0
        self.samples = 0
        self.start = time.perf_counter()
        self.per_worker: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])  # samples, busy seconds

    def unit_done(self, result: dict) -> None:
        self.done += 1
        samples = result["count"] + result["rejected"]
        self.samples += samples
        worker = result.get("worker", "flow")
        self.per_worker[worker][0] += samples
        self.per_worker[worker][1] += result["seconds"]
        elapsed = time.perf_counter() - self.start
        rate = self.samples / elapsed if elapsed > 0 else 0.0
        eta = elapsed / self.done * (self.total - self.done)
        w_samples, w_seconds = self.per_worker[worker]
        self.log(
            "unit %06d done (%d/%d) by %s: %d written, %d rejected; %.1f samples/s this worker, "
            "%.1f samples/s overall, ETA %.0f s",
            result["unit"], self.done, self.total, worker, result["count"], result["rejected"],
            w_samples / w_seconds if w_seconds > 0 else 0.0, rate, eta,
        )
        self.update()

    def log(self, message: str, *args: Any) -> None:
        log.info(message, *args)

    def update(self) -> None:
        """Show ``done`` of ``total`` (the flow keeps a progress artifact)."""


class Events:
    """How a run reports its phases; this one logs, the flow's also publishes artifacts."""

    def planned(self, plan: Plan, units_left: list[int], output: Output) -> None:
        log.info("planned %d samples in %d units (fingerprint %s), %d to encode", plan.total_samples,
                 len(plan.units), plan.fingerprint, len(units_left))

    def sanity(self, output: Output, started: float) -> None:
        """After the sanity check, passed or failed (its report is in the state folder if it got that far)."""

    def progress(self, units: int, output: Output) -> Progress:
        return Progress(units)

    def audited(self, report: AuditReport, output: Output) -> None:
        log.info("audit: %d written, %d rejected of %d inputs", report.written, report.rejected, report.inputs)

    def done(self, output: Output) -> None:
        log.info("dataset: %s", output.uri)


def write_units_here(settings: Settings, output: Output, plan: Plan, units: list[int], progress: Progress,
                     token: str | None = None) -> None:
    """Every unit in this process, one after the other."""
    for unit in units:
        result = encode_one_unit(settings, output, plan, unit, token)
        progress.unit_done({"unit": result.unit, "count": result.count, "rejected": result.rejected,
                            "seconds": round(result.seconds, 3), "skipped": result.skipped})


@dataclass
class Steps:
    """The phases a run calls; the Prefect flow passes its tasks (which call the same functions)."""

    plan: Callable[[Settings, Output, str], Plan]
    verify: Callable[[Output, Plan], Inspection]
    prepare: Callable[[Output, Decision, Inspection, Plan, WorkersConfig], list[int]]
    sanity: Callable[[Settings, Output, Plan, list[int]], SanityReport]
    units: Callable[[Settings, Output, Plan, list[int], Progress], None]
    audit: Callable[[Output, Plan], AuditReport]
    finalize: Callable[[Output, str, FinalizeConfig, bool], FinalizeResult]
    validate: Callable[[Output, str], ValidationReport]

    @classmethod
    def here(cls, token: str | None = None) -> Steps:
        """Every phase in this process, without Prefect."""
        return cls(
            plan=lambda settings, output, encoding: plan_output(settings, output, encoding, token),
            verify=verify_output,
            prepare=prepare_output,
            sanity=lambda settings, output, plan, units: sanity_phase(settings, output, plan, units, token),
            units=lambda settings, output, plan, units, progress: write_units_here(settings, output, plan, units,
                                                                                    progress, token),
            audit=lambda output, plan: audit(output, plan),
            finalize=finalize_split,
            validate=lambda output, encoding: validate_output(output, encoding),
        )


# --- the other ranks of a torchrun / SLURM run (diffprep.run.launch) ------------------------------------------------------


def follow_rank(settings: Settings, encoding: str, group: Group, token: str | None = None) -> dict[str, Any]:
    """A rank other than 0: wait for rank 0's decision, encode this rank's units, hear how the run ended.

    The plan is rank 0's (read from the output); this rank checks that its own
    settings give the same fingerprint before it writes anything. Raises when
    a rank failed (naming it) or when rank 0 did not finish the run.
    """
    rank = group.ranks.rank
    message = group.decide()
    if message is None:
        return {"rank": rank, "units": [], "out_dir": None}
    mine_fp = fingerprint(get_encoding(encoding_for(settings, encoding, token)).planned(settings, token)[0])
    if mine_fp != message["fingerprint"]:
        raise DiffprepError(f"rank {rank} has settings of fingerprint {mine_fp}, rank 0 planned "
                            f"{message['fingerprint']}: every rank must run the same command")
    output = OutputRef(**message["output"]).open()
    plan = output.state.plan()
    if plan is None or plan.fingerprint != message["fingerprint"]:
        raise DiffprepError(f"rank {rank}: {output.uri} holds no plan of fingerprint {message['fingerprint']}")
    units = my_units(message["units"], group.ranks)

    def encode(unit: int) -> dict:
        result = encode_one_unit(settings, output, plan, unit, token)
        return {"unit": unit, "count": result.count, "rejected": result.rejected,
                "seconds": round(result.seconds, 3), "skipped": result.skipped}

    def done(result: dict) -> None:
        log.info("rank %d: unit %06d, %d written, %d rejected in %.1f s", rank, result["unit"], result["count"],
                 result["rejected"], result["seconds"])

    try:
        group.encode(units, encode, done)
    finally:  # a machine of its own (a multi-node run to a bucket) keeps no shared captions in its staging folder
        output.state.discard_scratch(text_scratch(plan, this_host=True))
    group.outcome()  # rank 0 audits, finalizes and validates meanwhile
    return {"rank": rank, "units": units, "out_dir": output.uri}


# --- the whole run ----------------------------------------------------------------------------------------------------


@dataclass
class RunResult:
    out_dir: str
    action: str  # fresh | resume | complete | new-dir | overwrite | reuse
    fingerprint: str
    seconds: float = 0.0
    units: int | None = None
    encoded_units: int | None = None
    samples: int | None = None
    rejected: int | None = None
    rejects_by_reason: dict[str, int] | None = None
    notes: dict[str, int] | None = None
    retried: int | None = None  # rejected samples this run planned again (their inputs changed)
    sanity: dict | None = None
    finalize: dict | None = None
    validation: dict | None = None
    shard: str | None = None  # "i/n" for a --shard-index run
    scenes: dict | None = None  # long videos (--split-scenes): the plan's totals (long_videos.scenes_summary)

    def to_json(self) -> dict[str, Any]:
        """The flow's result: the fields that apply to this kind of run (a run that encoded nothing: sanity None)."""
        kept = {"sanity"} if self.samples is not None else set()
        return {k: v for k, v in asdict(self).items() if v is not None or k in kept}


def run(settings: Settings, encoding: str, *, output: Output | None = None, ask: Ask = ask_here,
        steps: Steps | None = None, events: Events | None = None, run_id: str | None = None) -> RunResult:
    """The whole job for ``encoding`` (``preencoded``, ``raw``); returns what it did.

    Existing data is changed only after an approval: ``ask`` (a preset in the
    settings is that approval). ``run_id`` names the run in the output's lock.
    """
    started = time.perf_counter()
    settings = settle_long_captions(settings, ask)  # a caption set's over-long captions: asked before the plan
    steps = steps or Steps.here(resolve_token(settings.auth.hf_token_file))
    events = events or Events()
    output = output or settings_output(settings).open()
    plan = steps.plan(settings, output, encoding)
    encoding = plan.encoding  # a pre-encoded run writes its model family's encoding (Wan: "wan")
    check_split(plan, settings.finalize, get_encoding(encoding).own_folders(plan) is None)
    if plan.missing_count:
        log.warning("%d planned samples are no longer in the source; nothing is removed from the dataset",
                    plan.missing_count)
    if plan.retrying:
        log.info("retrying %d rejected samples whose input files changed or appeared, in new units (the shards "
                 "written stay as they are)", plan.retrying)

    inspection = steps.verify(output, plan)
    on_existing = settings.output.on_existing
    if inspection.needs_choice and on_existing is None:
        on_existing = ask(inspection.question())
    decision = decide(inspection, on_existing, output, plan.fingerprint)
    if decision.out_dir != output.uri:
        output = ref_of(output).with_location(decision.out_dir).open()
    log.info("output %s: %s", output.uri, decision.action)
    result = RunResult(output.uri, decision.action, plan.fingerprint)
    if decision.action == "reuse":
        log.info("reusing %s as it is: nothing encoded, nothing changed", output.uri)
        result.seconds = round(time.perf_counter() - started, 1)
        return result

    workers = settings.workers
    if workers.num_shards is not None and decision.action in ("overwrite", "new-dir"):
        raise DiffprepError(f"--shard-index runs only resume; decide about the existing output ({decision.action}) "
                            "with a plain run first")
    output.local.mkdir(parents=True, exist_ok=True)
    with output.lock(run=run_id, shard=workers.shard_index):
        units_left = steps.prepare(output, decision, inspection, plan, workers)
        events.planned(plan, units_left, output)
        if plan.scenes:  # long videos: frames in shots shorter than every bucket, asked about before any model loads
            result.scenes = scenes_summary(plan.scenes)
            confirm_discarded(plan.scenes, output, settings.output.accept_rejects, ask,
                              lambda found: get_encoding(plan.encoding).rejects_advice(found, plan))
        if units_left:
            sanity_started = time.time()
            try:
                sanity = steps.sanity(settings, output, plan, units_left)
            finally:
                events.sanity(output, sanity_started)
            round_trip = round_trip_text(sanity.psnr_db, sanity.min_psnr)  # None: nothing was decoded back
            log.info("sanity: %s s per batch, projected %.2f GiB and %.0f s for %d units%s",
                     sanity.seconds_per_batch, sanity.projected_bytes / 2**30, sanity.projected_seconds,
                     len(units_left), f"; {round_trip}" if round_trip else "")
            result.sanity = sanity.to_json()
            try:
                steps.units(settings, output, plan, units_left, events.progress(len(units_left), output))
            finally:  # the units are done (or failed): nothing of this run reads the shared captions now
                if workers.num_shards is None:  # a shard run leaves them to the other shards and the plain run
                    output.state.discard_scratch(text_scratch(plan))
        else:
            log.info("every unit is already encoded with these settings: nothing to encode")
            if workers.num_shards is None:  # what shard runs shared (the plain run after them has nothing to do)
                output.state.discard_scratch(text_scratch(plan))
        result.units, result.encoded_units = len(plan.units), len(units_left)
        if workers.num_shards is not None:
            log.info("shard %d of %d: %d units encoded; run a plain `diffprep encode` with the same settings to "
                     "audit and finalize", workers.shard_index, workers.num_shards, len(units_left))
            result.shard = f"{workers.shard_index}/{workers.num_shards}"
            result.sanity = None
            result.seconds = round(time.perf_counter() - started, 1)
            return result

        report = steps.audit(output, plan)
        events.audited(report, output)
        if report.problems:
            raise DiffprepError("audit failed:\n  " + "\n  ".join(report.problems))
        if not rejects_accepted(report, settings.output.accept_rejects):
            if (before := answered_before(output, report)) is not None:
                log.info("these %d rejects were accepted on %s (%s/%s): not asked again", report.rejected,
                         before.get("answered_at"), contract.STATE_DIR, contract.REJECTS_ANSWER_JSON)
            else:
                advice = get_encoding(plan.encoding).rejects_advice(report, plan)
                record_answer(output, report, ask(rejects_question(report, output.uri, advice), release=True))
        result.samples, result.rejected = report.written, report.rejected
        result.rejects_by_reason, result.notes = report.by_reason, report.notes
        result.retried = plan.retrying or None
        if settings.finalize.enabled:
            finalized = finalize_output(output, encoding, settings.finalize, ask,
                                        finalizer=lambda o, e, c, r: steps.finalize(o, e, c, r))
            result.finalize = asdict(finalized)
            validation = steps.validate(output, encoding)
            validation.raise_if_failed()
            result.validation = {"ok": validation.ok, "summary": validation.summary}
        events.done(output)
    result.seconds = round(time.perf_counter() - started, 1)
    return result


__all__ = ["Ask", "Events", "Progress", "RunResult", "Steps", "ask_here", "follow_rank", "run", "settings_output"]
