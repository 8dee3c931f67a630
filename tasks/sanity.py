"""Task: encode one batch into the state folder and project the run (diffprep.phases.pipeline.sanity_phase)."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from diffprep.config import Settings
from diffprep.output import OutputRef
from diffprep.phases.pipeline import sanity_phase
from diffprep.writer.plan import Plan
from diffprep.run.sanity import SanityReport
from diffprep.tasks.common import output_of, run_token


@task(name="sanity", cache_policy=NO_CACHE, persist_result=False)
def sanity_task(settings: Settings, output: OutputRef, plan: Plan, units_left: list[int]) -> SanityReport:
    return sanity_phase(settings, output_of(output), plan, units_left, run_token(settings))
