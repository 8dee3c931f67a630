"""Task: reconcile plan, manifests and tars (diffprep.phases.audit)."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from diffprep.phases.audit import AuditReport, audit
from diffprep.output import OutputRef
from diffprep.writer.plan import Plan
from diffprep.tasks.common import output_of


@task(name="audit", cache_policy=NO_CACHE, persist_result=False)
def audit_task(output: OutputRef, plan: Plan) -> AuditReport:
    return audit(output_of(output), plan)
