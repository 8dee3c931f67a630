"""Task: inspect the output and decide resume / fresh / new-dir / overwrite (diffprep.existing)."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from diffprep.existing import decide, inspect_output
from diffprep.plan import read_plan
from tasks.common import small


@task(name="verify-existing", cache_policy=NO_CACHE, persist_result=False)
def verify_existing_task(plan_path: str, out_dir: str, on_existing: str | None) -> dict:
    plan = read_plan(plan_path)
    inspection = inspect_output(out_dir, plan)
    return small(decide(inspection, on_existing).to_json())
