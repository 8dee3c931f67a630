"""Task: encode one work unit into its shard and commit it (diffprep.phases.pipeline.encode_one_unit).

The encoders are loaded once per process and kept for the next units; so is the
plan (read again only when plan.json changed: a new run) and the opened source
(``pipeline.opened_source``), so a unit costs what it reads. A unit
that runs out of device memory is encoded again with half the batch size, down
to 1 (and the next units start at the size that fitted); its shard is
committed only once it is whole, so a failed try leaves nothing behind.
"""

from __future__ import annotations

import os
import socket
import threading
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from diffprep import contract
from diffprep.config import Settings
from diffprep.output import Output, OutputRef
from diffprep.phases.pipeline import encode_one_unit
from diffprep.run.workers import claimed_device
from diffprep.tasks.common import UNIT_RETRY_DELAYS, output_of, retry_transient, run_token, settings_from
from diffprep.writer.plan import Plan

# The plan this process read last, by its file's identity: every unit of a run reads the same plan.json, and
# reading it per unit cost N²/shard size in all (issue #37: ~36 days at 100M samples).
_PLAN: dict[str, Any] = {}
_PLAN_LOCK = threading.Lock()


def plan_of(out: Output) -> Plan | None:
    """The output's plan, read once per process for as long as plan.json stays the same file (path, inode, size,
    mtime): a run that writes a new plan is read anew."""
    out.state.ensure_current()
    path = out.state.path(contract.PLAN_JSON)
    try:
        info = path.stat()
    except FileNotFoundError:
        return None
    key = (str(path), info.st_ino, info.st_size, info.st_mtime_ns)
    with _PLAN_LOCK:
        if _PLAN.get("key") != key:
            _PLAN.clear()
            _PLAN.update(key=key, plan=out.state.plan())
        return _PLAN["plan"]


def worker_name() -> str:
    return f"{socket.gethostname()}:{os.getpid()}/{claimed_device() or 'flow'}"


@task(name="encode-unit", task_run_name="encode-unit-{unit:06d}", retries=len(UNIT_RETRY_DELAYS),
      retry_delay_seconds=list(UNIT_RETRY_DELAYS),
      retry_jitter_factor=0.5, retry_condition_fn=retry_transient, cache_policy=NO_CACHE, persist_result=False)
def encode_unit_task(settings: Settings | dict, output: OutputRef, unit: int) -> dict:
    """One unit of the plan in ``output``; a unit already committed there is left as it is."""
    settings = settings_from(settings)
    out = output_of(output)
    result = encode_one_unit(settings, out, plan_of(out), unit, run_token(settings))
    return {"unit": result.unit, "count": result.count, "rejected": result.rejected,
            "seconds": round(result.seconds, 3), "skipped": result.skipped, "worker": worker_name()}
