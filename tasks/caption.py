"""Tasks of the caption-dataset flow: each a thin call of the caption run's phase (``diffprep.captions``)."""

from __future__ import annotations

from collections.abc import Callable

from prefect import task
from prefect.cache_policies import NO_CACHE

from diffprep.captions import pipeline, run
from diffprep.captions.pipeline import CaptionAudit, CaptionJob, CaptionSanity, SetInspection
from diffprep.captions.sets import CaptionSet, SetPlan
from diffprep.tasks.common import FETCH_RETRY_DELAYS, UNIT_RETRY_DELAYS, retry_transient


@task(name="caption-plan", retries=len(FETCH_RETRY_DELAYS), retry_delay_seconds=list(FETCH_RETRY_DELAYS),
      retry_condition_fn=retry_transient, cache_policy=NO_CACHE, persist_result=False)
def plan_task(job: CaptionJob) -> tuple[CaptionSet, SetPlan]:
    return pipeline.plan_set(job)


@task(name="caption-verify", cache_policy=NO_CACHE, persist_result=False)
def verify_task(cset: CaptionSet, plan: SetPlan) -> SetInspection:
    return pipeline.verify_set(cset, plan)


@task(name="caption-prepare", cache_policy=NO_CACHE, persist_result=False)
def prepare_task(cset: CaptionSet, plan: SetPlan, inspection: SetInspection, answer: str | None) -> list[int]:
    return pipeline.prepare_set(cset, plan, inspection, answer)


@task(name="caption-sanity", cache_policy=NO_CACHE, persist_result=False)
def sanity_task(job: CaptionJob, cset: CaptionSet, plan: SetPlan, units: list[int]) -> CaptionSanity:
    return run.sanity_here(job, cset, plan, units)


@task(name="caption-unit", task_run_name="caption-unit-{unit:06d}", retries=len(UNIT_RETRY_DELAYS),
      retry_delay_seconds=list(UNIT_RETRY_DELAYS), retry_condition_fn=retry_transient, cache_policy=NO_CACHE,
      persist_result=False)
def caption_unit_task(job: CaptionJob, cset: CaptionSet, plan: SetPlan, unit: int) -> dict:
    return pipeline.caption_unit(job, cset, plan.fingerprint, unit,
                                 run.captioners_for(job, plan.fingerprint, job.device), pipeline.caption_source(job))


def units_as_tasks(job: CaptionJob, cset: CaptionSet, plan: SetPlan, units: list[int],
                   done: Callable[[dict], None]) -> None:
    """Each unit its own task run in this process; with several devices, shared as a terminal run shares them."""
    from diffprep.run import launch

    if job.devices or launch.group() is not None:  # shared with worker processes, or with the other ranks
        run.units_here(job, cset, plan, units, done)
        return
    for unit in units:
        done(caption_unit_task(job, cset, plan, unit))


@task(name="caption-units", cache_policy=NO_CACHE, persist_result=False)
def caption_units_task(job: CaptionJob, cset: CaptionSet, plan: SetPlan, units: list[int]) -> None:
    """The units shared across ``job.devices`` (diffprep.run.pool): one task for them all."""
    run.units_here(job, cset, plan, units, lambda result: None)


@task(name="caption-audit", cache_policy=NO_CACHE, persist_result=False)
def audit_task(cset: CaptionSet, plan: SetPlan) -> CaptionAudit:
    return pipeline.audit_set(cset, plan)


@task(name="caption-write", cache_policy=NO_CACHE, persist_result=False)
def write_task(job: CaptionJob, cset: CaptionSet, plan: SetPlan, audit: CaptionAudit, captioner: dict | None) -> dict:
    return pipeline.write_set(job, cset, plan, audit, captioner)


TASKS = (plan_task, verify_task, prepare_task, sanity_task, caption_unit_task, audit_task, write_task)
