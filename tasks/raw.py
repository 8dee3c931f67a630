"""Tasks of the encode-raw flow that differ from encode-dataset's: plan, one-batch check, one unit (diffprep.raw).

Verify, audit, finalize and validate are encode-dataset's own tasks.
"""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from diffprep import contract
from diffprep.config import Settings
from diffprep.encode import encode_unit
from diffprep.fetch import fetch, stage_plan
from diffprep.images import ImageSpec
from diffprep.plan import read_plan
from diffprep.raw import BATCH_SIZE, RawImageWriter, raw_sanity_check
from tasks.common import retry_transient, run_token, settings_from, small
from tasks.encode import open_run_source, worker_name


def image_writer(settings: Settings) -> RawImageWriter:
    return RawImageWriter(settings.raw.image_format, settings.raw.image_quality)


@task(name="fetch-raw", retries=3, retry_delay_seconds=[5, 30, 120], retry_jitter_factor=0.5,
      retry_condition_fn=retry_transient, cache_policy=NO_CACHE, persist_result=False)
def fetch_raw_task(settings: dict, out_dir: str) -> dict:
    s = settings_from(settings)
    plan, _source = fetch(s, out_dir, token=run_token(s), encoding=contract.ENCODING_RAW)
    return {
        "plan_path": str(stage_plan(plan, out_dir)),
        "fingerprint": plan.fingerprint,
        "units": len(plan.units),
        "samples": plan.total_samples,
        "missing_from_source": plan.missing_count,
    }


@task(name="sanity-raw", cache_policy=NO_CACHE, persist_result=False)
def raw_sanity_task(settings: dict, out_dir: str, units_left: list[int]) -> dict:
    s = settings_from(settings)
    report = raw_sanity_check(out_dir, read_plan(out_dir), image_writer(s), open_run_source(s),
                              ImageSpec.from_config(s.image), units_left=units_left)
    return small(report.to_json())


@task(name="write-raw-unit", task_run_name="write-raw-unit-{unit:06d}", retries=2, retry_delay_seconds=[10, 60],
      retry_jitter_factor=0.5, retry_condition_fn=retry_transient, cache_policy=NO_CACHE, persist_result=False)
def raw_unit_task(settings: dict, out_dir: str, unit: int) -> dict:
    s = settings_from(settings)
    result = encode_unit(out_dir, read_plan(out_dir), unit, None, open_run_source(s), ImageSpec.from_config(s.image),
                         batch_size=BATCH_SIZE, decode_workers=s.image.decode_workers,
                         sample_fields=image_writer(s).sample_fields)
    return {"unit": result.unit, "count": result.count, "rejected": result.rejected,
            "seconds": round(result.seconds, 3), "skipped": result.skipped, "worker": worker_name()}
