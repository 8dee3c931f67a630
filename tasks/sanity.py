"""Task: encode one batch into the state folder and project the run (diffprep.encode.sanity_check)."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from diffprep.encode import sanity_check, write_empty_prompt
from diffprep.images import ImageSpec
from diffprep.plan import read_plan
from tasks.common import settings_from, small
from tasks.encode import load_encoders, oom_advice, open_run_source, with_smaller_batches_on_oom


@task(name="sanity", cache_policy=NO_CACHE, persist_result=False)
def sanity_task(settings: dict, out_dir: str, units_left: list[int]) -> dict:
    s = settings_from(settings)
    plan = read_plan(out_dir)
    encoders = load_encoders(s)
    write_empty_prompt(out_dir, encoders)
    source, spec = open_run_source(s), ImageSpec.from_config(s.image)
    # The sanity batch is the run's batch: out of memory, try it smaller like a unit would.
    report = with_smaller_batches_on_oom(
        lambda batch_size: sanity_check(out_dir, plan, encoders, source, spec, batch_size=batch_size,
                                        units_left=units_left, min_psnr=s.model.min_psnr),
        s.model.batch_size, what="the sanity check", advice=oom_advice(s, encoders),
    )
    return small(report.to_json())
