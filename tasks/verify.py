"""Tasks: inspect the output against the plan (the flow decides), then prepare it under the run's lock."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from diffprep.config import WorkersConfig
from diffprep.phases.existing import Decision, Inspection
from diffprep.output import OutputRef
from diffprep.phases.pipeline import prepare_output, verify_output
from diffprep.writer.plan import Plan
from diffprep.tasks.common import output_of


@task(name="verify-existing", cache_policy=NO_CACHE, persist_result=False)
def verify_existing_task(output: OutputRef, plan: Plan) -> Inspection:
    return verify_output(output_of(output), plan)


@task(name="prepare-output", cache_policy=NO_CACHE, persist_result=False)
def prepare_output_task(output: OutputRef, decision: Decision, inspection: Inspection, plan: Plan,
                        workers: WorkersConfig) -> list[int]:
    """Leftovers of dead runs removed, an approved overwrite carried out, the plan written; the units to encode."""
    return prepare_output(output_of(output), decision, inspection, plan, workers)
