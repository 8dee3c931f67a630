"""Task: reconcile plan, manifests and tars (diffprep.audit)."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from diffprep.audit import audit
from diffprep.plan import read_plan
from tasks.common import small


@task(name="audit", cache_policy=NO_CACHE, persist_result=False)
def audit_task(out_dir: str) -> dict:
    return small(audit(out_dir, read_plan(out_dir)).to_json())
