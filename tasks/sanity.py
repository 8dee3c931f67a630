"""Task: encode one batch into the state folder and project the run (diffprep.encode.sanity_check)."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from diffprep import contract
from diffprep.config import Settings
from diffprep.encode import sanity_check, write_empty_prompt
from diffprep.outputs import Output
from diffprep.workers import parse_devices
from diffprep.images import ImageSpec
from diffprep.plan import read_plan
from tasks.common import output_from, settings_from, small
from tasks.encode import load_encoders, oom_advice, open_run_source, with_smaller_batches_on_oom


@task(name="sanity", cache_policy=NO_CACHE, persist_result=False)
def sanity_task(settings: dict, out_dir: str, units_left: list[int]) -> dict:
    s = settings_from(settings)
    output = output_from(s, out_dir)
    plan = read_plan(output.local)
    encoders = load_encoders(s)
    write_empty_prompt(output.local, encoders)
    output.push(f"{contract.STATE_DIR}/{contract.EMPTY_PROMPT}")
    source, spec = open_run_source(s), ImageSpec.from_config(s.image)
    # The sanity batch is the run's batch: out of memory, try it smaller like a unit would.
    try:
        report = with_smaller_batches_on_oom(
            lambda batch_size: sanity_check(output.local, plan, encoders, source, spec, batch_size=batch_size,
                                            units_left=units_left, min_psnr=s.model.min_psnr,
                                            staged_samples=staged_samples(s, output)),
            s.model.batch_size, what="the sanity check", advice=oom_advice(s, encoders),
        )
    finally:
        output.push(f"{contract.STATE_DIR}/{contract.SANITY_DIR}")
    return small(report.to_json())


def staged_samples(settings: Settings, output: Output) -> int | None:
    """Samples on local disk at once for a bucket output (a shard per worker until its upload); None for a folder."""
    if not output.remote:
        return None
    return settings.output.shard_size * len(parse_devices(settings.workers.devices or "cpu:1"))
