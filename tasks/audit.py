"""Task: reconcile plan, manifests and tars (diffprep.audit)."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from diffprep.audit import audit
from diffprep.plan import read_plan
from tasks.common import output_from, settings_from, small


@task(name="audit", cache_policy=NO_CACHE, persist_result=False)
def audit_task(out_dir: str, settings: dict) -> dict:
    output = output_from(settings_from(settings), out_dir)
    output.pull_state()
    return small(audit(output, read_plan(output.local)).to_json())
