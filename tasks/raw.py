"""Tasks of the encode-raw flow that differ from encode-dataset's: plan, one-batch check, one unit (diffprep.raw).

Verify, audit, finalize and validate are encode-dataset's own tasks.
"""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from diffprep import contract
from diffprep.config import Settings
from diffprep.encode import UnitResult, encode_unit
from diffprep.images import ImageSpec
from diffprep.outputs import Output
from diffprep.plan import Plan, read_plan
from diffprep.raw import BATCH_SIZE, RawImageWriter, raw_sanity_check
from diffprep.shards import ShardSink
from tasks.common import output_from, retry_transient, settings_from, small
from tasks.encode import open_run_source, write_unit
from tasks.fetch import plan_output
from tasks.sanity import staged_samples


def image_writer(settings: Settings) -> RawImageWriter:
    return RawImageWriter(settings.raw.image_format, settings.raw.image_quality)


@task(name="fetch-raw", retries=3, retry_delay_seconds=[5, 30, 120], retry_jitter_factor=0.5,
      retry_condition_fn=retry_transient, cache_policy=NO_CACHE, persist_result=False)
def fetch_raw_task(settings: dict, out_dir: str) -> dict:
    return plan_output(settings, out_dir, contract.ENCODING_RAW)


@task(name="sanity-raw", cache_policy=NO_CACHE, persist_result=False)
def raw_sanity_task(settings: dict, out_dir: str, units_left: list[int]) -> dict:
    s = settings_from(settings)
    output = output_from(s, out_dir)
    try:
        report = raw_sanity_check(output.local, read_plan(output.local), image_writer(s), open_run_source(s),
                                  ImageSpec.from_config(s.image), units_left=units_left,
                                  staged_samples=staged_samples(s, output))
    finally:
        output.push(f"{contract.STATE_DIR}/{contract.SANITY_DIR}")
    return small(report.to_json())


@task(name="write-raw-unit", task_run_name="write-raw-unit-{unit:06d}", retries=2, retry_delay_seconds=[10, 60],
      retry_jitter_factor=0.5, retry_condition_fn=retry_transient, cache_policy=NO_CACHE, persist_result=False)
def raw_unit_task(settings: dict, out_dir: str, unit: int) -> dict:
    s = settings_from(settings)

    def write(output: Output, plan: Plan, sink: ShardSink | None) -> UnitResult:
        return encode_unit(output.local, plan, unit, None, open_run_source(s), ImageSpec.from_config(s.image),
                           batch_size=BATCH_SIZE, decode_workers=s.image.decode_workers,
                           sample_fields=image_writer(s).sample_fields, sink=sink)

    return write_unit(s, out_dir, unit, write)
