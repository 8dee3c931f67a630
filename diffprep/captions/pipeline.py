"""The caption run as plain Python: plan in units -> verify the set -> sanity (one sample) -> caption the units ->
audit -> written.

(A module of its own beside ``diffprep.phases.pipeline``: the phases have the encode's guarantees but a caption
set's store, ``diffprep.captions.sets``, instead of shards. The flow, ``flows/caption.py``, runs these same
functions as its tasks.)

- plan: the source's ids streamed into units of ``unit_size`` (never all held), fingerprinted with the captioning
  settings; nothing is written until the set is verified.
- verify: a set of this name with these settings is resumed (its committed units kept) or, written already,
  reused; with other settings it is the overwrite question (keep it and choose another ``--name``, overwrite,
  abort). Nothing existing is replaced without an answer.
- sanity: the first sample that decodes is captioned with every instruction; its frames' picture and captions are
  kept in the set's ``sanity/`` and shown (the flow's artifact) before the units start.
- units: each unit's samples captioned in batches and committed whole (``CaptionSet.commit_unit``); in this
  process, or shared with one process per other device (``diffprep.run.pool``). Captions are greedy, so a unit's
  bytes do not depend on the worker or the split.
- audit: every planned sample captioned or a named reject, in every unit.
- written: captions.jsonl, the lookup index, the token report and the digest in set.json; on request, the LTX
  trainer's metadata file and the directory source's caption files (each replacing files only after a question).
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import os
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from typing import Any

from diffprep.captions.sets import AUDIT_JSON, SANITY_DIR, TOKENS_JSON, CaptionSet, SetPlan, fingerprint_of
from diffprep.captions.tokens import TokenCounter, tokens_markdown
from diffprep.config import SourceConfig
from diffprep.errors import DiffprepError, RejectError
from diffprep.run.approvals import ABORT, Question
from diffprep.sources import open_source
from diffprep.sources.caption_set import SETS_FOLDER

log = logging.getLogger("diffprep.captions")

ON_EXISTING = ("overwrite",)


@dataclass
class CaptionJob:
    """Everything a caption run needs (picklable: the pool's workers get it)."""

    name: str
    source: SourceConfig
    captioning: dict[str, Any]  # CaptionSettings fields but the instruction
    instructions: list[str] = field(default_factory=list)  # one caption per sample each; empty: the default one
    device: str = "cpu"
    devices: str | None = None
    unit_size: int = 64
    count_tokens: dict[str, str] = field(default_factory=dict)  # family -> model folder
    on_existing: str | None = None  # overwrite: an existing set of this name with other settings is replaced
    ltx_metadata: str | None = None  # the LTX trainer's metadata file to write (JSON, JSONL or CSV)
    caption_files: bool = False  # the directory source's captions/<stem>.txt
    on_replace_files: str | None = None  # replace: existing caption files / metadata file are replaced
    hf_token: str | None = None

    def settings(self) -> list[Any]:
        """One CaptionSettings per instruction (the captions' bytes depend on every field)."""
        from diffprep.captions.models import CaptionSettings

        base = CaptionSettings(**self.captioning)
        return [replace(base, instruction=i) for i in self.instructions] or [base]

    def fingerprinted(self) -> dict[str, Any]:
        return {"captioning": [s.to_json() for s in self.settings()], "unit_size": self.unit_size,
                "token_families": sorted(self.count_tokens)}


# --- plan and verify -----------------------------------------------------------------------------------------------


def caption_source(job: CaptionJob) -> Any:
    """The source as a caption run reads it: media without caption files too (their captions are what is made)."""
    return open_source(job.source.model_copy(update={"caption_set": None}), token=job.hf_token,
                       captions_optional=True)


def plan_set(job: CaptionJob) -> tuple[CaptionSet, SetPlan]:
    """The units of the source's ids (streamed into a scratch file beside the sets), and the fingerprint."""
    cset = CaptionSet.of_source(job.source, job.name)
    source = caption_source(job)
    scratch = _scratch_plan(cset)
    os.makedirs(os.path.dirname(scratch), exist_ok=True)
    ids_hash = hashlib.sha256()
    units = samples = 0
    with open(scratch, "w", encoding="utf-8") as f:
        for ids in _chunks(source.list_ids(), job.unit_size):
            f.write(json.dumps(ids, ensure_ascii=False) + "\n")
            ids_hash.update(json.dumps(ids, ensure_ascii=False).encode("utf-8"))
            units += 1
            samples += len(ids)
    if not samples:
        raise DiffprepError(f"the source {source.describe()} lists no sample: nothing to caption")
    settings = job.fingerprinted()
    plan = SetPlan(job.name, fingerprint_of(settings, ids_hash.hexdigest()), settings, units, samples,
                   source.describe())
    return cset, plan


def discard_plan(cset: CaptionSet) -> None:
    """The scratch plan of a run that stops before it writes one (a refused question)."""
    if os.path.exists(_scratch_plan(cset)):
        os.remove(_scratch_plan(cset))


def _scratch_plan(cset: CaptionSet) -> str:
    return os.path.join(os.path.dirname(cset.path), f".{cset.name}.plan.tmp")


def _chunks(ids: Iterator[str], size: int) -> Iterator[list[str]]:
    chunk: list[str] = []
    for source_id in ids:
        chunk.append(source_id)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


@dataclass
class SetInspection:
    state: str  # fresh | resume | written | other
    existing: dict[str, Any] | None = None

    def question(self, cset: CaptionSet, plan: SetPlan) -> Question:
        before = self.existing or {}
        return Question(
            key="caption-set-exists",
            title=f"Caption set {cset.name!r} exists with other settings",
            description=(f"`{cset.path}` holds caption set **{cset.name}** (fingerprint `{before.get('fingerprint')}`, "
                         f"{before.get('samples')} samples, instructions {before.get('instructions')}), made with "
                         f"other settings or another source than this run (fingerprint `{plan.fingerprint}`).\n\n"
                         "- **overwrite**: remove that set's files and caption again under the same name"
                         + _kept(cset) + "\n"
                         "- **abort**: change nothing (to keep both, re-run with another `--name`)"),
            choices=("overwrite", ABORT),
            preset_hint="--on-existing overwrite (or another --name to keep the old set)",
        )


def verify_set(cset: CaptionSet, plan: SetPlan) -> SetInspection:
    record = cset.record()
    if record is None:
        return SetInspection("fresh")
    if record.get("fingerprint") != plan.fingerprint:
        return SetInspection("other", record)
    return SetInspection("written" if cset.is_written() else "resume", record)


def _kept(cset: CaptionSet) -> str:
    """What an overwrite of the set leaves: the files in its folder a caption run does not write."""
    _, foreign = cset.listing()
    if not foreign:
        return ""
    shown = ", ".join(f"`{name}`" for name in foreign[:10]) + (f" and {len(foreign) - 10} more" if len(foreign) > 10
                                                               else "")
    return f" ({len(foreign)} other file(s) stay: {shown})"


def prepare_set(cset: CaptionSet, plan: SetPlan, inspection: SetInspection, answer: str | None) -> list[int]:
    """An approved overwrite carried out, the plan written (or kept); the units left to caption."""
    scratch = _scratch_plan(cset)
    if inspection.state == "other":
        if answer != "overwrite":
            raise DiffprepError(f"caption set {cset.name!r} exists with other settings and was not replaced")
        log.warning("overwrite (approved): removing caption set %s", cset.path)
        kept = cset.remove()
        if kept:
            log.warning("kept the %d file(s) in %s that a caption run does not write: %s", len(kept), cset.path,
                        ", ".join(kept[:10]))
    if inspection.state in ("fresh", "other"):
        with open(scratch, encoding="utf-8") as f:
            cset.write_plan(plan, (json.loads(line) for line in f))
    os.remove(scratch)
    return [u for u in range(plan.units) if cset.committed(u, plan.fingerprint) is None]


# --- captioning ------------------------------------------------------------------------------------------------------


class Captioners:
    """The captioners of a job's instructions on one device: the model loaded once, one view per instruction
    (a captioner reads its settings' instruction at each call), and the token counters."""

    def __init__(self, job: CaptionJob, device: str) -> None:
        from diffprep.captions.models import load_captioner

        settings = job.settings()
        first = load_captioner(settings[0], device=device, token=job.hf_token)
        self.each = [first]
        for other in settings[1:]:
            view = copy.copy(first)
            view.settings = other
            self.each.append(view)
        self.settings = settings[0]
        self.tokens = TokenCounter(job.count_tokens)

    def describe(self) -> dict[str, Any]:
        return self.each[0].describe()

    def caption(self, inputs: list[Any]) -> list[list[str]]:
        """Each input's captions, one per instruction."""
        per_instruction = [captioner.caption(inputs) for captioner in self.each]
        return [list(captions) for captions in zip(*per_instruction)]


def sample_input(sample: Any, settings: Any) -> Any:
    """A source sample -> the captioner's input; a RejectError says why it cannot be captioned."""
    from diffprep.captions.frames import caption_input

    if sample.reject is not None and sample.reject.reason != "missing_caption":
        raise sample.reject
    if sample.media is None:
        raise RejectError("missing_media", "the source gave no image or clip for this sample", phase="read")
    return caption_input(sample.source_id, sample.media, fps=settings.fps, max_frames=settings.max_frames)


def caption_unit(job: CaptionJob, cset: CaptionSet, fingerprint: str, unit: int, captioners: Captioners,
                 source: Any) -> dict[str, Any]:
    """One unit captioned and committed; a committed unit is left as it is (resume)."""
    started = time.perf_counter()
    done = cset.committed(unit, fingerprint)
    if done is not None:
        return {"unit": unit, "count": done["captioned"], "rejected": done["rejected"], "seconds": 0.0,
                "skipped": True}
    ids = cset.unit_ids(unit)
    media_path = getattr(source, "media_path", None)
    root = os.path.dirname(os.path.dirname(cset.path))
    records: dict[str, dict[str, Any]] = {}
    batch: list[Any] = []

    def flush() -> None:
        for item, captions in zip(batch, captioners.caption(batch)):
            if not all(c.strip() for c in captions):
                records[item.key] = {"source_id": item.key, "reject": {
                    "reason": "empty_caption", "detail": "the captioner answered an empty caption"}}
                continue
            record: dict[str, Any] = {"source_id": item.key, "captions": captions}
            tokens = captioners.tokens.count(captions)
            if tokens:
                record["tokens"] = tokens
            path = media_path(item.key) if media_path else None
            if path is not None:
                record["media_path"] = os.path.relpath(path, root)
            records[item.key] = record
        batch.clear()

    for sample in source.read(ids):
        try:
            batch.append(sample_input(sample, captioners.settings))
        except RejectError as error:
            records[sample.source_id] = {"source_id": sample.source_id,
                                         "reject": {"reason": error.reason, "detail": error.detail}}
            continue
        if len(batch) == captioners.settings.batch_size:
            flush()
    if batch:
        flush()
    missing = [i for i in ids if i not in records]
    if missing:
        raise DiffprepError(f"caption set {cset.name}: the source returned no sample for {missing[:3]} of unit "
                            f"{unit}; the source must read every id it lists")
    header = cset.commit_unit(unit, fingerprint, [records[i] for i in ids])
    seconds = time.perf_counter() - started
    log.info("unit %06d: %d captioned, %d rejected in %.1f s", unit, header["captioned"], header["rejected"], seconds)
    return {"unit": unit, "count": header["captioned"], "rejected": header["rejected"],
            "seconds": round(seconds, 3), "skipped": False}


@dataclass
class CaptionSanity:
    source_id: str
    captions: list[str]
    frames: int
    seconds: float
    projected_seconds: float
    picture: str  # the frames' picture (PNG) in the set's sanity/

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def sanity_check(job: CaptionJob, cset: CaptionSet, plan: SetPlan, units_left: list[int], captioners: Captioners,
                 source: Any) -> CaptionSanity:
    """The first sample of the units left that decodes, captioned with every instruction and shown with its
    frames; the run's time projected from it. Raises when no sample of the first units decodes."""
    import numpy as np
    import torch

    from diffprep.report.pictures import frame_grid, png_bytes

    reasons: list[str] = []
    for unit in units_left[:3]:
        for sample in source.read(cset.unit_ids(unit)):
            try:
                item = sample_input(sample, captioners.settings)
            except RejectError as error:
                reasons.append(f"{sample.source_id}: {error}")
                continue
            started = time.perf_counter()
            captions = captioners.caption([item])[0]
            seconds = time.perf_counter() - started
            shown = item.frames[:64]
            frames = torch.stack([torch.from_numpy(np.array(f.convert("RGB"))).permute(2, 0, 1)
                                  for f in shown]) if _same_size(shown) else None
            picture = os.path.join(cset.path, SANITY_DIR, "frames.png")
            os.makedirs(os.path.dirname(picture), exist_ok=True)
            if frames is not None:
                with open(picture, "wb") as f:
                    f.write(png_bytes(frame_grid(frames, side=1024, min_width=256)))
            samples_left = len(units_left) * job.unit_size
            report = CaptionSanity(sample.source_id, captions, len(item.frames), round(seconds, 3),
                                   round(seconds * samples_left, 1), picture if frames is not None else "")
            cset.write_json(f"{SANITY_DIR}/sanity.json", report.to_json() | {"captioner": captioners.describe()})
            return report
    raise DiffprepError("sanity: no sample of the first units could be read for captioning: " + "; ".join(reasons[:5]))


def _same_size(frames: list[Any]) -> bool:
    return bool(frames) and len({f.size for f in frames}) == 1


# --- across workers ---------------------------------------------------------------------------------------------------


def worker_setup(job: CaptionJob, cset_path: str, fingerprint: str, device: str) -> Callable[[int], dict]:
    """Run in a pool worker (``diffprep.run.pool``): its captioners loaded on ``device``; captions one unit."""
    captioners = Captioners(job, device)
    source = caption_source(job)
    cset = CaptionSet(cset_path)
    return partial(_worker_unit, job, cset, fingerprint, captioners, source)


def _worker_unit(job: CaptionJob, cset: CaptionSet, fingerprint: str, captioners: Captioners, source: Any,
                 unit: int) -> dict:
    return caption_unit(job, cset, fingerprint, unit, captioners, source)


def caption_units(job: CaptionJob, cset: CaptionSet, plan: SetPlan, units: list[int], captioners: Captioners,
                  source: Any, done: Callable[[dict], None]) -> None:
    """The units in this process, or shared (``diffprep.run.pool``) with one process per device of
    ``job.devices``: this process is the one of its own device when that is listed (as an encode's), else
    it captions none; each worker takes units once its model is loaded."""
    from diffprep.run import launch
    from diffprep.run.workers import parse_devices

    devices = parse_devices(job.devices) if job.devices else [job.device]
    here = partial(caption_unit, job, cset, plan.fingerprint, captioners=captioners, source=source)
    group = launch.group()
    if group is not None:  # rank 0 of a torchrun / srun launch: the units shared with the other ranks
        group.decide({"set": cset.path, "fingerprint": plan.fingerprint, "settings": settings_digest(job),
                      "units": units})
        group.encode(launch.my_units(units, group.ranks), lambda unit: here(unit=unit), done)
        return
    if devices == [job.device]:
        for unit in units:
            done(here(unit=unit))
        return
    from diffprep.run.pool import share_units

    others = list(devices)
    if job.device in others:
        others.remove(job.device)
    log.info("captioning %d units on %s: %s", len(units), ", ".join(devices),
             f"this process ({job.device}) and {len(others)} worker process(es)" if job.device in devices
             else f"{len(others)} worker processes ({job.device}, --device, is not one of them)")
    share_units(units, here=(lambda unit: here(unit=unit)) if job.device in devices else None,
                here_name=f"this process ({job.device})",
                setups=[(d, partial(worker_setup, job, cset.path, plan.fingerprint, d)) for d in others],
                done=lambda finished: done(dict(finished.result, worker=finished.worker)))


def settings_digest(job: CaptionJob) -> str:
    return hashlib.sha256(json.dumps(job.fingerprinted(), sort_keys=True).encode("utf-8")).hexdigest()[:16]


def follow_rank(job: CaptionJob, group: Any) -> dict[str, Any]:
    """A rank other than 0 (``diffprep.run.launch``): wait for rank 0's plan, caption this rank's units of it
    (``u % world_size == rank``), hear how the run ended. Refused when this rank's settings differ from rank 0's."""
    rank = group.ranks.rank
    message = group.decide()
    if message is None:
        return {"rank": rank, "units": []}
    if settings_digest(job) != message["settings"]:
        raise DiffprepError(f"rank {rank} has other captioning settings than rank 0: every rank must run the same "
                            "command")
    cset = CaptionSet(message["set"])
    units = [u for u in message["units"] if u % group.ranks.world_size == rank]
    captioners = Captioners(job, job.device)
    source = caption_source(job)
    group.encode(units, lambda unit: caption_unit(job, cset, message["fingerprint"], unit, captioners, source),
                 lambda result: log.info("rank %d: unit %06d, %d captioned, %d rejected", rank, result["unit"],
                                         result["count"], result["rejected"]))
    group.outcome()
    return {"rank": rank, "units": units}


# --- audit and written -----------------------------------------------------------------------------------------------


@dataclass
class CaptionAudit:
    samples: int = 0
    captioned: int = 0
    rejected: int = 0
    by_reason: dict[str, int] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def audit_set(cset: CaptionSet, plan: SetPlan) -> CaptionAudit:
    """Every planned sample captioned (as many captions as instructions) or a named reject, in plan order."""
    report = CaptionAudit()
    reasons: Counter[str] = Counter()
    per_sample = len(plan.settings["captioning"])
    for unit, ids in cset.plan_units():
        if cset.committed(unit, plan.fingerprint) is None:
            report.problems.append(f"unit {unit:06d} is not captioned")
            continue
        found = [r["source_id"] for r in cset.unit_records(unit)]
        if found != ids:
            report.problems.append(f"unit {unit:06d} holds other samples than planned")
        for record in cset.unit_records(unit):
            report.samples += 1
            if "reject" in record:
                report.rejected += 1
                reasons[record["reject"].get("reason") or "unnamed"] += 1
            elif len(record.get("captions", [])) != per_sample or not all(record["captions"]):
                report.problems.append(f"{record['source_id']}: {len(record.get('captions', []))} captions, "
                                       f"{per_sample} expected")
            else:
                report.captioned += 1
    report.by_reason = dict(sorted(reasons.items()))
    return report


def write_set(job: CaptionJob, cset: CaptionSet, plan: SetPlan, audit: CaptionAudit, captioner: dict | None
              ) -> dict[str, Any]:
    """captions.jsonl, the index and the reports; the digest last (the set is then written)."""
    written = cset.write_outputs(plan.units, job.count_tokens)
    cset.write_json(AUDIT_JSON, audit.to_json())
    cset.write_json(TOKENS_JSON, written["tokens"])
    extra = {"audit": {k: v for k, v in audit.to_json().items() if k != "problems"}, "tokens": written["tokens"]}
    if captioner is not None:
        extra["captioner"] = captioner
    cset.finish(written["digest"], extra)
    log.info("caption set %s written: %d captioned, %d rejected (digest %s)\n%s", cset.path, audit.captioned,
             audit.rejected, written["digest"][:16], tokens_markdown(written["tokens"]))
    return written


__all__ = ["CaptionAudit", "CaptionJob", "CaptionSanity", "Captioners", "ON_EXISTING", "SETS_FOLDER", "audit_set",
           "caption_source", "caption_unit", "caption_units", "plan_set", "prepare_set", "sanity_check",
           "verify_set", "worker_setup", "write_set"]
