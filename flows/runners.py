"""Ways to run the encode units, chosen by name; each has the same signature.

- ``in-process``: one worker, the flow's own process (``model.device``).
- ``process-pool``: one process per device (``workers.devices``); each claims a
  device, loads the encoders once and takes units as it frees up. The workers
  report to the flow run's own API, the embedded server of a terminal run
  included (``workers_api``): none starts a server of its own.
- ``fan-out``: chunks of units sent with ``run_deployment`` to the
  ``encode-units`` deployment (``workers.deployment``), i.e. to the workers of a
  work pool on other machines; the output must be on shared storage.
- ``ranks``: the ranks of a torchrun / SLURM launch (``diffprep.run.launch``): the
  decision is broadcast, each rank encodes ``u % N == rank``, this flow (rank 0)
  reports the others' units as they finish; a failed rank stops them all.

Progress (units done, samples/s per worker and overall, ETA) is reported from
the flow, as units finish: a progress artifact and one log line per unit. Inside
a unit, its worker logs a line every few seconds (samples/s, the unit's ETA); the
in-process runner's units also move the artifact then (``diffprep.run.unit_progress``).
"""

from __future__ import annotations

import time
from typing import Any, Callable

from prefect import get_run_logger
from prefect.artifacts import create_progress_artifact, update_progress_artifact
from prefect.settings import temporary_settings

from diffprep.run import launch
from diffprep.config import Settings
from diffprep.errors import DiffprepError
from diffprep.output import Output, ref_of
from diffprep.phases.pipeline import Progress
from diffprep.writer.plan import Plan
from diffprep.run.unit_progress import UnitStatus, listening
from diffprep.run.workers import claim_device, claim_dir, parse_devices, split_chunks
from diffprep.tasks.encode import encode_unit_task

FAN_OUT_POLL_SECONDS = 5


class ArtifactProgress(Progress):
    """Progress logged to the run log and kept in a progress artifact."""

    def __init__(self, units: int, key: str | None) -> None:
        super().__init__(units)
        self.artifact = create_progress_artifact(progress=0.0, key=key, description=f"units encoded of {units}")

    def log(self, message: str, *args: Any) -> None:
        get_run_logger().info(message, *args)

    def update(self) -> None:
        update_progress_artifact(artifact_id=self.artifact, progress=self.percent())

    def percent(self, within: UnitStatus | None = None) -> float:
        """Units done, plus the share of the unit under way."""
        part = within.done / max(1, within.total) if within is not None else 0.0
        return 100.0 * min(self.total, self.done + part) / max(1, self.total)

    def within_unit(self, status: UnitStatus) -> None:
        """The unit under way, every few seconds (``diffprep.run.unit_progress``): the artifact moves between units,
        with the unit's rate and ETA in its description."""
        update_progress_artifact(
            artifact_id=self.artifact, progress=self.percent(status),
            description=f"units encoded of {self.total}: {self.done} done; unit {status.unit:06d} at "
                        f"{status.done}/{status.total} samples, {status.samples_per_second:.1f} samples/s, "
                        f"ETA {status.eta_seconds:.0f} s for this unit")


def in_process(settings: Settings, output: Output, plan: Plan, units: list[int], progress: Progress) -> None:
    # The units run one after another in the flow's own thread: the artifact is updated from the flow, never by two
    # writers at once. (The other runners' workers log their lines; the artifact moves as their units finish.)
    within = progress.within_unit if isinstance(progress, ArtifactProgress) else None
    for unit in units:
        if within is None:
            progress.unit_done(encode_unit_task(settings, ref_of(output), unit))
            continue
        with listening(within):
            result = encode_unit_task(settings, ref_of(output), unit)
        progress.unit_done(result)


def process_pool(settings: Settings, output: Output, plan: Plan, units: list[int], progress: Progress) -> None:
    from prefect.futures import as_completed
    from prefect.task_runners import ProcessPoolTaskRunner

    import torch

    devices = parse_devices(settings.workers.devices)
    runner = ProcessPoolTaskRunner(max_workers=len(devices), initializer=claim_device,
                                   initargs=(devices, claim_dir(), torch.get_num_threads()))
    with runner:
        with temporary_settings(updates=workers_api()):  # each submit hands its worker the settings it is made in
            futures = [runner.submit(encode_unit_task, {"settings": settings, "output": ref_of(output), "unit": unit})
                       for unit in units]
        for future in as_completed(futures):
            progress.unit_done(future.result(raise_on_failure=True))


def workers_api() -> dict[Any, str]:
    """The settings that send the pool's workers to this run's own API: ``PREFECT_API_URL`` as this process's
    client reaches it, when no setting names it (a terminal run on its embedded server).

    A worker gets the settings of the submit that sent it its unit. Without an API URL among them, each worker's
    first API call started a temporary server of its own (about 40 s each on 2 cores: issue 35), on the same
    ``PREFECT_HOME``; with it, the workers report to the server the flow run is on, and start none."""
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL

    if PREFECT_API_URL.value():
        return {}  # the workers get it with the rest of the settings
    with get_client(sync_client=True) as client:  # the embedded server this run is on (started already)
        return {PREFECT_API_URL: str(client.api_url).rstrip("/")}


def fan_out(settings: Settings, output: Output, plan: Plan, units: list[int], progress: Progress) -> None:
    from prefect.client.orchestration import get_client
    from prefect.deployments import run_deployment

    logger = get_run_logger()
    chunks = split_chunks(units, settings.workers.chunks or 2)
    params = settings.model_dump(mode="json")
    child = params | {"workers": params["workers"] | {"deployment": None, "chunks": None}}
    runs = []
    for chunk in chunks:
        run = run_deployment(name=settings.workers.deployment, timeout=0, as_subflow=True,
                             parameters={"output": ref_of(output).model_dump(), "settings": child, "units": chunk})
        logger.info("sent %d units to %s (flow run %s)", len(chunk), settings.workers.deployment, run.id)
        runs.append(run)
    wanted = set(units)
    with get_client(sync_client=True) as client:
        while True:
            states = [client.read_flow_run(run.id).state for run in runs]
            committed = wanted & output.state.manifest_units()
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


def ranks(settings: Settings, output: Output, plan: Plan, units: list[int], progress: Progress) -> None:
    group = launch.group()
    group.decide({"output": ref_of(output).model_dump(), "units": units, "fingerprint": plan.fingerprint})
    # This rank's units, and the other ranks' as they finish (their counts and seconds, posted by each rank);
    # raises naming the ranks that failed, so nothing is audited after a failure.
    group.encode(launch.my_units(units, group.ranks), lambda unit: encode_unit_task(settings, ref_of(output), unit),
                 progress.unit_done)


RUNNERS: dict[str, Callable[[Settings, Output, Plan, list[int], Progress], None]] = {
    "in-process": in_process,
    "process-pool": process_pool,
    "fan-out": fan_out,
    "ranks": ranks,
}


def runner_for(settings: Settings) -> str:
    if launch.group() is not None:
        return "ranks"
    if settings.workers.deployment:
        return "fan-out"
    if settings.workers.devices:
        return "process-pool"
    return "in-process"


def run_units(settings: Settings, output: Output, plan: Plan, units: list[int], progress: Progress) -> None:
    """The units with the runner the settings choose."""
    runner = runner_for(settings)
    get_run_logger().info("encoding %d units with the %s runner", len(units), runner)
    RUNNERS[runner](settings, output, plan, units, progress)
