"""Task: encode one work unit into its shard and manifest (diffprep.encode.encode_unit).

The encoders are loaded once per process and kept for the next units. A unit
that runs out of device memory is encoded again with half the batch size, down
to 1; its shard is committed only once it is whole, so a failed try leaves
nothing behind.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import socket
import threading
from collections.abc import Callable
from typing import TypeVar

import torch
from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.exceptions import MissingContextError

from diffprep.config import Settings
from diffprep.encode import UnitResult, encode_unit
from diffprep.encoders import FluxEncoders
from diffprep.errors import DiffprepError
from diffprep.images import ImageSpec
from diffprep.outputs import Output
from diffprep.plan import Plan, read_plan
from diffprep.shards import ShardSink
from diffprep.sources import Source, open_source
from diffprep.workers import claimed_device
from tasks.common import output_from, retry_transient, run_token, settings_from

T = TypeVar("T")

_ENCODERS: dict[str, FluxEncoders] = {}
_LOCK = threading.Lock()


def load_encoders(settings: Settings) -> FluxEncoders:
    """The encoders for ``settings``, loaded once per process, on the device this worker claimed (if any)."""
    model = settings.model
    if claimed_device() is not None:
        model = model.model_copy(update={"device": claimed_device()})
    key = json.dumps(model.model_dump(mode="json"), sort_keys=True)
    with _LOCK:
        if key not in _ENCODERS:
            _ENCODERS.clear()  # one encoder set per process: free the previous one first
            _ENCODERS[key] = FluxEncoders.load(model, token=run_token(settings))
        return _ENCODERS[key]


def worker_name() -> str:
    return f"{socket.gethostname()}:{os.getpid()}/{claimed_device() or 'flow'}"


def open_run_source(settings: Settings) -> Source:
    return open_source(settings.source, token=run_token(settings))


def free_device_memory() -> None:
    """Return what a failed batch held: Python garbage first, then the CUDA allocator's cached blocks."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _logger() -> logging.Logger | logging.LoggerAdapter:
    """The task run's logger (shipped to the run log); the module's logger when called outside a run."""
    try:
        return get_run_logger()
    except MissingContextError:
        return logging.getLogger(__name__)


def oom_advice(settings: Settings, encoders: FluxEncoders) -> str:
    """What to change when even a batch of one does not fit."""
    return (f"lower --image-size (now {settings.image.image_size}) or --t5-max-length (now "
            f"{settings.model.t5_max_length}), use --precision bf16 (now {settings.model.precision}), "
            f"or free memory on {encoders.device}")


def with_smaller_batches_on_oom(attempt: Callable[[int], T], batch_size: int, *, what: str, advice: str) -> T:
    """``attempt(batch_size)``; out of device memory, free it and try again at half the batch size, down to 1.

    ``attempt`` must leave nothing behind when it fails (a unit commits its
    shard only once it is whole). Other errors are not caught.
    """
    while True:
        try:
            return attempt(batch_size)
        except torch.OutOfMemoryError as exc:
            error = str(exc).splitlines()[0] if str(exc) else "out of memory"
        # Freed outside the except block: the traceback's frames hold the failed batch's tensors.
        free_device_memory()
        if batch_size <= 1:
            raise DiffprepError(f"{what} ran out of memory even at batch size 1: {advice} ({error})")
        smaller = batch_size // 2
        _logger().warning("%s ran out of memory at batch size %d: retrying it at batch size %d (%s)",
                          what, batch_size, smaller, error)
        batch_size = smaller


@task(name="encode-unit", task_run_name="encode-unit-{unit:06d}", retries=2, retry_delay_seconds=[10, 60],
      retry_jitter_factor=0.5, retry_condition_fn=retry_transient, cache_policy=NO_CACHE, persist_result=False)
def encode_unit_task(settings: dict, out_dir: str, unit: int) -> dict:
    s = settings_from(settings)

    def encode(output: Output, plan: Plan, sink: ShardSink | None) -> UnitResult:
        encoders = load_encoders(s)
        spec = ImageSpec.from_config(s.image)
        return with_smaller_batches_on_oom(
            lambda batch_size: encode_unit(output.local, plan, unit, encoders, open_run_source(s), spec,
                                           batch_size=batch_size, decode_workers=s.image.decode_workers, sink=sink),
            s.model.batch_size, what=f"unit {unit}", advice=oom_advice(s, encoders),
        )

    return write_unit(s, out_dir, unit, encode)


def write_unit(settings: Settings, out_dir: str, unit: int,
               encode: Callable[[Output, Plan, ShardSink | None], UnitResult]) -> dict:
    """One unit of either pipeline into the output, by ``encode(output, plan, sink)``; the task's result.

    A bucket output skips a unit it already holds (a retried task, a re-sent
    chunk), takes the shard's bytes as they are written (the sink), and
    commits the unit there once it is whole.
    """
    output = output_from(settings, out_dir)
    plan = read_plan(output.local)
    done = output.committed_unit(unit, plan.fingerprint)
    if done is not None:
        return {"unit": unit, "count": done.count, "rejected": len(done.rejects), "seconds": 0.0, "skipped": True,
                "worker": worker_name()}
    upload = output.shard_upload(unit)
    result = encode(output, plan, upload)
    output.publish_unit(unit, upload)
    return {"unit": result.unit, "count": result.count, "rejected": result.rejected,
            "seconds": round(result.seconds, 3), "skipped": result.skipped, "worker": worker_name()}
