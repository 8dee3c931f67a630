"""Task: resolve source and encoders, plan the units (diffprep.phases.pipeline.plan_output)."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from diffprep.config import Settings
from diffprep.output import OutputRef
from diffprep.phases.pipeline import plan_output
from diffprep.writer.plan import Plan
from diffprep.tasks.common import FETCH_RETRY_DELAYS, output_of, retry_transient, run_token


@task(name="fetch", retries=len(FETCH_RETRY_DELAYS), retry_delay_seconds=list(FETCH_RETRY_DELAYS),
      retry_jitter_factor=0.5,
      retry_condition_fn=retry_transient, cache_policy=NO_CACHE, persist_result=False)
def fetch_task(settings: Settings, output: OutputRef, encoding: str) -> Plan:
    return plan_output(settings, output_of(output), encoding, run_token(settings))
