"""The whole caption run, in order, with an ``ask`` callback and swappable steps (as ``diffprep.phases.pipeline.run``
is the encode's): the terminal runs it with the phases here, the Prefect flow (``flows/caption.py``) with its tasks.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from diffprep.captions.exports import write_caption_files, write_ltx_metadata
from diffprep.captions.pipeline import (CaptionAudit, CaptionJob, CaptionSanity, Captioners, SetInspection,
                                        audit_set, caption_source, caption_units, discard_plan, plan_set,
                                        prepare_set,
                                        sanity_check, verify_set, write_set)
from diffprep.captions.sets import CaptionSet, SetPlan
from diffprep.errors import DiffprepError
from diffprep.run.approvals import Ask, ask_here

log = logging.getLogger("diffprep.captions")

# The loaded captioners of this process, by job and device: the sanity check's are the units' (a flow's tasks run
# in this process too).
_LOADED: dict[tuple[str, str], Captioners] = {}


def captioners_for(job: CaptionJob, fingerprint: str, device: str) -> Captioners:
    key = (fingerprint, device)
    if key not in _LOADED:
        _LOADED.clear()  # one model held at a time
        _LOADED[key] = Captioners(job, device)
    return _LOADED[key]


def sanity_here(job: CaptionJob, cset: CaptionSet, plan: SetPlan, units: list[int]) -> CaptionSanity:
    return sanity_check(job, cset, plan, units, captioners_for(job, plan.fingerprint, job.device),
                        caption_source(job))


def units_here(job: CaptionJob, cset: CaptionSet, plan: SetPlan, units: list[int],
               done: Callable[[dict], None]) -> None:
    caption_units(job, cset, plan, units, captioners_for(job, plan.fingerprint, job.device), caption_source(job),
                  done)


@dataclass
class CaptionSteps:
    """The phases; the flow passes its tasks (which call these same functions)."""

    plan: Callable[[CaptionJob], tuple[CaptionSet, SetPlan]] = plan_set
    verify: Callable[[CaptionSet, SetPlan], SetInspection] = verify_set
    prepare: Callable[[CaptionSet, SetPlan, SetInspection, str | None], list[int]] = prepare_set
    sanity: Callable[[CaptionJob, CaptionSet, SetPlan, list[int]], CaptionSanity] = sanity_here
    units: Callable[[CaptionJob, CaptionSet, SetPlan, list[int], Callable[[dict], None]], None] = units_here
    audit: Callable[[CaptionSet, SetPlan], CaptionAudit] = audit_set
    write: Callable[[CaptionJob, CaptionSet, SetPlan, CaptionAudit, dict | None], dict] = write_set


class CaptionEvents:
    """How a caption run reports; this one logs, the flow's publishes artifacts too."""

    def planned(self, cset: CaptionSet, plan: SetPlan, units_left: list[int]) -> None:
        log.info("caption set %s: %d samples in %d units (fingerprint %s), %d to caption", cset.path, plan.samples,
                 plan.units, plan.fingerprint, len(units_left))

    def sanity(self, cset: CaptionSet, report: CaptionSanity) -> None:
        log.info("sanity: %s captioned in %.1f s from %d frame(s) (%s); projected %.0f s for the units left:\n%s",
                 report.source_id, report.seconds, report.frames, report.picture or "no picture",
                 report.projected_seconds, "\n".join(f"  [{i}] {c}" for i, c in enumerate(report.captions)))

    def unit_done(self, result: dict) -> None:
        """A unit's counts (the log line is the unit's own)."""

    def audited(self, cset: CaptionSet, audit: CaptionAudit) -> None:
        log.info("audit: %d captioned, %d rejected of %d samples%s", audit.captioned, audit.rejected, audit.samples,
                 "".join(f"; {reason}: {n}" for reason, n in audit.by_reason.items()))

    def written(self, cset: CaptionSet, result: dict) -> None:
        """After the set is written (the flow links it)."""


def run_caption(job: CaptionJob, *, ask: Ask = ask_here, steps: CaptionSteps | None = None,
                events: CaptionEvents | None = None) -> dict[str, Any]:
    """The whole caption run; returns what it did (the command prints it)."""
    started = time.perf_counter()
    steps = steps or CaptionSteps()
    events = events or CaptionEvents()
    cset, plan = steps.plan(job)
    inspection = steps.verify(cset, plan)
    answer = None
    if inspection.state == "other":
        try:
            answer = ask(inspection.question(cset, plan), job.on_existing)
        except BaseException:
            discard_plan(cset)  # nothing of this run is left beside the sets
            raise
    units_left = steps.prepare(cset, plan, inspection, answer)
    action = {"fresh": "fresh", "other": "overwrite", "resume": "resume", "written": "reuse"}[inspection.state]
    result: dict[str, Any] = {"set": cset.path, "name": cset.name, "action": action, "fingerprint": plan.fingerprint,
                              "samples": plan.samples, "units": plan.units, "captioned_units": len(units_left)}
    events.planned(cset, plan, units_left)
    if inspection.state != "written":
        captioner = None
        if units_left:
            sanity = steps.sanity(job, cset, plan, units_left)
            events.sanity(cset, sanity)
            result["sanity"] = sanity.to_json()
            steps.units(job, cset, plan, units_left, events.unit_done)
            captioner = (cset.record() or {}).get("captioner") or _described(job, plan)
        audit = steps.audit(cset, plan)
        events.audited(cset, audit)
        if audit.problems:
            raise DiffprepError("caption audit failed:\n  " + "\n  ".join(audit.problems[:20]))
        written = steps.write(job, cset, plan, audit, captioner)
        result["tokens"] = written["tokens"]
    record = cset.record() or {}
    result["audit"] = record.get("audit")
    result["tokens"] = record.get("tokens", {})
    result["digest"] = record.get("digest")
    if job.ltx_metadata:
        result["ltx_metadata"] = write_ltx_metadata(cset, job.ltx_metadata, ask, job.on_replace_files)
    if job.caption_files:
        result["caption_files"] = write_caption_files(cset, ask, job.on_replace_files)
    events.written(cset, result)
    result["seconds"] = round(time.perf_counter() - started, 1)
    return result


def _described(job: CaptionJob, plan: SetPlan) -> dict | None:
    """The captioner's description (model revision or hashes), from the one loaded here if any."""
    loaded = _LOADED.get((plan.fingerprint, job.device))
    return loaded.describe() if loaded is not None else None


__all__ = ["CaptionEvents", "CaptionSteps", "captioners_for", "run_caption"]
