"""Task: Energon metadata and split assignment over the committed shards (diffprep.run.energon.finalize)."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from diffprep.config import FinalizeConfig
from diffprep.run.energon import FinalizeResult
from diffprep.output import OutputRef
from diffprep.phases.pipeline import finalize_split
from diffprep.tasks.common import output_of


@task(name="finalize", cache_policy=NO_CACHE, persist_result=False)
def finalize_task(output: OutputRef, encoding: str, config: FinalizeConfig, replace_split: bool) -> FinalizeResult:
    return finalize_split(output_of(output), encoding, config, replace_split)
