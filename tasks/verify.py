"""Task: inspect the output against the plan (diffprep.existing.inspect_output); the flow decides."""

from __future__ import annotations

from dataclasses import asdict

from prefect import task
from prefect.cache_policies import NO_CACHE

from diffprep.existing import inspect_output
from diffprep.plan import read_plan
from tasks.common import output_from, settings_from, small


@task(name="verify-existing", cache_policy=NO_CACHE, persist_result=False)
def verify_existing_task(plan_path: str, out_dir: str, settings: dict) -> dict:
    output = output_from(settings_from(settings), out_dir)
    return small(asdict(inspect_output(output, read_plan(plan_path))))
