"""Task: resolve source and encoders, plan the units (diffprep.fetch)."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from diffprep import contract
from diffprep.fetch import fetch, stage_plan
from tasks.common import output_from, retry_transient, run_token, settings_from


@task(name="fetch", retries=3, retry_delay_seconds=[5, 30, 120], retry_jitter_factor=0.5,
      retry_condition_fn=retry_transient, cache_policy=NO_CACHE, persist_result=False)
def fetch_task(settings: dict, out_dir: str) -> dict:
    return plan_output(settings, out_dir, contract.ENCODING_PREENCODED)


def plan_output(settings: dict, out_dir: str, encoding: str) -> dict:
    """Plan ``out_dir`` for ``encoding``; the summary the flow logs, with the staged plan's path."""
    s = settings_from(settings)
    output = output_from(s, out_dir)
    output.pull_state()  # an append keeps the units of the plan already there
    plan, _source = fetch(s, output.local, token=run_token(s), encoding=encoding)
    return {
        "plan_path": str(stage_plan(plan, output.local)),
        "fingerprint": plan.fingerprint,
        "units": len(plan.units),
        "samples": plan.total_samples,
        "missing_from_source": plan.missing_count,
    }
