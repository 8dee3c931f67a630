"""Ways to run the encode units, chosen by name; each has the same signature.

- ``in_process``: one worker, the flow's own process (``model.device``).
- ``process_pool``: one process per device (``workers.devices``); each claims a
  device, loads the encoders once and takes units as it frees up.
- ``fan_out``: chunks of units sent with ``run_deployment`` to the
  ``encode-units`` deployment (``workers.deployment``), i.e. to the workers of a
  work pool on other machines; the output must be on shared storage.

Progress (units done, samples/s per worker and overall, ETA) is reported from
the flow, as units finish: a progress artifact and one log line per unit.
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Callable

from prefect import get_run_logger
from prefect.artifacts import create_progress_artifact, update_progress_artifact

from diffprep import contract
from diffprep.config import Settings
from diffprep.outputs import Output
from diffprep.errors import DiffprepError
from diffprep.shards import read_manifests
from diffprep.workers import claim_device, claim_dir, parse_devices, split_chunks
from tasks.common import output_from
from tasks.encode import encode_unit_task

FAN_OUT_POLL_SECONDS = 5


class Progress:
    """Units done / total, samples/s per worker and overall, ETA; logged and kept in a progress artifact."""

    def __init__(self, units: int, key: str | None) -> None:
        self.total = units
        self.done = 0
        self.samples = 0
        self.start = time.perf_counter()
        self.per_worker: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])  # samples, busy seconds
        self.artifact = create_progress_artifact(progress=0.0, key=key, description=f"units encoded of {units}")

    def unit_done(self, result: dict) -> None:
        self.done += 1
        samples = result["count"] + result["rejected"]
        self.samples += samples
        worker = result.get("worker", "flow")
        self.per_worker[worker][0] += samples
        self.per_worker[worker][1] += result["seconds"]
        elapsed = time.perf_counter() - self.start
        rate = self.samples / elapsed if elapsed > 0 else 0.0
        eta = elapsed / self.done * (self.total - self.done)
        w_samples, w_seconds = self.per_worker[worker]
        get_run_logger().info(
            "unit %06d done (%d/%d) by %s: %d written, %d rejected; %.1f samples/s this worker, "
            "%.1f samples/s overall, ETA %.0f s",
            result["unit"], self.done, self.total, worker, result["count"], result["rejected"],
            w_samples / w_seconds if w_seconds > 0 else 0.0, rate, eta,
        )
        self.update()

    def update(self) -> None:
        update_progress_artifact(artifact_id=self.artifact, progress=100.0 * self.done / max(1, self.total))


def in_process(settings: Settings, params: dict, out_dir: str, units: list[int], progress: Progress) -> None:
    for unit in units:
        progress.unit_done(encode_unit_task(params, out_dir, unit))


def process_pool(settings: Settings, params: dict, out_dir: str, units: list[int], progress: Progress) -> None:
    from prefect.futures import as_completed
    from prefect.task_runners import ProcessPoolTaskRunner

    import torch

    devices = parse_devices(settings.workers.devices)
    runner = ProcessPoolTaskRunner(max_workers=len(devices), initializer=claim_device,
                                   initargs=(devices, claim_dir(), torch.get_num_threads()))
    with runner:
        futures = [runner.submit(encode_unit_task, {"settings": params, "out_dir": out_dir, "unit": unit})
                   for unit in units]
        for future in as_completed(futures):
            progress.unit_done(future.result(raise_on_failure=True))


def fan_out(settings: Settings, params: dict, out_dir: str, units: list[int], progress: Progress) -> None:
    from prefect.client.orchestration import get_client
    from prefect.deployments import run_deployment

    logger = get_run_logger()
    chunks = split_chunks(units, settings.workers.chunks or 2)
    child = params | {"workers": params["workers"] | {"deployment": None, "chunks": None}}
    runs = []
    for chunk in chunks:
        run = run_deployment(name=settings.workers.deployment, timeout=0, as_subflow=True,
                             parameters={"out_dir": out_dir, "settings": child, "units": chunk})
        logger.info("sent %d units to %s (flow run %s)", len(chunk), settings.workers.deployment, run.id)
        runs.append(run)
    wanted = set(units)
    output = output_from(settings, out_dir)
    with get_client(sync_client=True) as client:
        while True:
            states = [client.read_flow_run(run.id).state for run in runs]
            committed = wanted & committed_units(output)
            if len(committed) != progress.done:
                progress.done = len(committed)
                progress.update()
            if all(state is not None and state.is_final() for state in states):
                break
            time.sleep(FAN_OUT_POLL_SECONDS)
    failed = [f"{run.name} ({run.id}): {state.name}" for run, state in zip(runs, states) if not state.is_completed()]
    if failed:
        raise DiffprepError(
            "encode-units runs did not complete: " + "; ".join(failed)
            + ". Finished units are kept; re-run to encode the rest."
        )


def committed_units(output: Output) -> set[int]:
    """Units with a manifest (in the bucket, for a bucket output)."""
    if not output.remote:
        return set(read_manifests(output.local))
    folder = f"{contract.STATE_DIR}/{contract.UNITS_DIR}/"
    names = [name[len(folder):] for name in output.objects(refresh=True) if name.startswith(folder)]
    return {int(name.removesuffix(".json")) for name in names if name.removesuffix(".json").isdigit()}


RUNNERS: dict[str, Callable[[Settings, dict, str, list[int], Progress], None]] = {
    "in-process": in_process,
    "process-pool": process_pool,
    "fan-out": fan_out,
}


def runner_for(settings: Settings) -> str:
    if settings.workers.deployment:
        return "fan-out"
    if settings.workers.devices:
        return "process-pool"
    return "in-process"
