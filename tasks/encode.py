"""Task: encode one work unit into its shard and commit it (diffprep.phases.pipeline.encode_one_unit).

The encoders are loaded once per process and kept for the next units. A unit
that runs out of device memory is encoded again with half the batch size, down
to 1 (and the next units start at the size that fitted); its shard is
committed only once it is whole, so a failed try leaves nothing behind.
"""

from __future__ import annotations

import os
import socket

from prefect import task
from prefect.cache_policies import NO_CACHE

from diffprep.config import Settings
from diffprep.output import OutputRef
from diffprep.phases.pipeline import encode_one_unit
from diffprep.run.workers import claimed_device
from diffprep.tasks.common import UNIT_RETRY_DELAYS, output_of, retry_transient, run_token, settings_from


def worker_name() -> str:
    return f"{socket.gethostname()}:{os.getpid()}/{claimed_device() or 'flow'}"


@task(name="encode-unit", task_run_name="encode-unit-{unit:06d}", retries=len(UNIT_RETRY_DELAYS),
      retry_delay_seconds=list(UNIT_RETRY_DELAYS),
      retry_jitter_factor=0.5, retry_condition_fn=retry_transient, cache_policy=NO_CACHE, persist_result=False)
def encode_unit_task(settings: Settings | dict, output: OutputRef, unit: int) -> dict:
    """One unit of the plan in ``output``; a unit already committed there is left as it is."""
    settings = settings_from(settings)
    out = output_of(output)
    result = encode_one_unit(settings, out, out.state.plan(), unit, run_token(settings))
    return {"unit": result.unit, "count": result.count, "rejected": result.rejected,
            "seconds": round(result.seconds, 3), "skipped": result.skipped, "worker": worker_name()}
