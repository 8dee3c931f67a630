"""A terminal run without a Prefect server: the pipeline runs Prefect-free, and the run is recorded afterwards.

With no ``PREFECT_API_URL``, the only server a flow run can talk to is the
embedded one the command starts itself, which nobody else can open while it
runs (its questions are asked on the terminal either way). Running the flow on
it cost a first run its whole start-up: the server's start (5-8 s on 2 cores,
far more in a fresh ``PREFECT_HOME``), then the flow engine's own (measured in
``benchmarks/README.md``, issue #29). So such a run is ``diffprep.phases.pipeline.run``
with the phases in this process (``Steps.here``), the questions on the terminal
(``ask_here``), and the embedded server started beside it at a low CPU priority.
Once the pipeline has ended, the run is written to that server as the flow run
the flow would have made: the flow's name and parameters, a task run per phase
and per unit with its start, end and outcome (the tasks' own names, so the UI
groups them as it does a live run), the flow's artifacts (plan, sanity report,
progress, audit, output link), the ``diffprep`` log lines, and its final state:
Completed, Failed with the error, or Crashed after a Ctrl-C. ``prefect server
start`` on the same ``PREFECT_HOME`` shows it.

The work does not wait for the server: a run that ends before the server is
up waits for it only to be recorded, and a server that does not start costs a
warning, never the run. Transient errors (network, storage) are retried as the
tasks retry them (``tasks/common.py``). ``DIFFPREP_LIVE_FLOW=1`` runs the flow
on the embedded server instead, as before.

With ``--devices``, the units are shared (``diffprep.run.pool``): this process,
whose encoders the sanity check loaded, encodes units on its own device when
that is one of the devices, and one plain process per other device loads its
encoders and takes units once it is ready (``unit_worker``). Each unit is still
``encode_one_unit`` (the same bytes whatever the split), recorded as its task
run with the worker that encoded it; the workers' log lines come back into
this process's log and the recording.
"""

from __future__ import annotations

import atexit
import logging
import os
import socket
import subprocess
import threading
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

from diffprep.config import Settings
from diffprep.flows.record_write import MAX_LOG_LINES, TaskRecord, final_state, write_flow_run

# diffprep.phases.pipeline and the tasks (torch, the encoders' libraries: seconds) are imported once the server's process
# has started, so that its start overlaps those imports.

log = logging.getLogger("diffprep.recorded")

LIVE_FLOW_ENV = "DIFFPREP_LIVE_FLOW"
SERVER_NICE = 10  # the embedded server's start competes with the encoders for the cores: it gets what they leave
CPU_WORKER_NICE = 19  # a CPU worker shares this process's cores: its start and its units get what this one leaves
POOL_THREAD = "diffprep-pool"  # diffprep.run.pool.THREAD_NAME (the library is imported late here: start-up time)


def wanted(settings: Settings) -> bool:
    """Whether this terminal run is recorded afterwards rather than run as a flow: no server to run it on, and
    nothing the run needs from the Prefect API while it runs (a credentials block, a fan-out deployment; several
    devices are shared here: ``diffprep.run.pool``), and not rank 0 of a torchrun / SLURM launch (the flow's
    ``ranks`` runner shares the units with the other ranks; run here, rank 0 encoded every unit and the others
    none)."""
    from prefect.settings import PREFECT_API_URL, PREFECT_SERVER_EPHEMERAL_ENABLED

    from diffprep.run import launch

    if PREFECT_API_URL.value() or os.environ.get(LIVE_FLOW_ENV, "").lower() in ("1", "true", "yes"):
        return False
    if launch.group() is not None:
        return False
    uses_api = (settings.auth.hf_credentials_block or settings.auth.aws_credentials_block
                or settings.workers.deployment)
    return not uses_api and bool(PREFECT_SERVER_EPHEMERAL_ENABLED.value())


class Recorder(logging.Handler):
    """What a Prefect-free run did, kept to be written to the server as a flow run: its task runs, artifacts and
    the ``diffprep`` log lines (each with the task run it came from)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.started = time.time()
        self.ended = 0.0
        self.tasks: list[TaskRecord] = []
        self.artifacts: list[Any] = []  # prefect.artifacts.Artifact objects, not yet created
        self.logs: list[tuple[logging.LogRecord, int | None]] = []
        self.current: int | None = None  # the task under way in the pipeline's thread (its phases, its units)
        self.units: dict[int, int] = {}  # unit -> its task's index, once it has one
        self.dropped = 0  # lines past MAX_LOG_LINES: counted, said in the recorded log
        self.records_lock = threading.Lock()  # shared units: the pool's thread records its workers' units

    def emit(self, record: logging.LogRecord) -> None:
        if hasattr(record, "pool_unit"):  # a worker's line (diffprep.run.pool): its unit's task, if in one
            task = self.units.get(record.pool_unit) if record.pool_unit is not None else None
        elif record.threadName == POOL_THREAD:  # the pool's reports (units done by workers): the run's
            task = None
        else:
            task = self.current
        with self.records_lock:
            if len(self.logs) < MAX_LOG_LINES:
                self.logs.append((record, task))
            else:
                self.dropped += 1

    def add(self, record: TaskRecord, unit: int | None = None) -> int:
        """``record``'s index; a unit's task is made once (a unit failed in a worker is retried in its task)."""
        with self.records_lock:
            if unit is not None and unit in self.units:
                return self.units[unit]
            self.tasks.append(record)
            index = len(self.tasks) - 1
            if unit is not None:
                self.units[unit] = index
            return index

    @contextmanager
    def task(self, task: str, name: str | None = None, unit: int | None = None) -> Iterator[None]:
        self.current = self.add(TaskRecord(task, name or task, time.time()), unit)
        record = self.tasks[self.current]
        record.error = None
        try:
            yield
        except BaseException as error:
            record.error = error
            raise
        finally:
            record.ended = time.time()
            self.current = None

    def timed(self, task: str, call: Callable[..., Any], delays: tuple[int, ...] = ()) -> Callable[..., Any]:
        def phase(*args: Any) -> Any:
            with self.task(task):
                return retried(lambda: call(*args), task, delays)
        return phase

    def steps(self, settings: Settings, token: str | None) -> Any:
        """``Steps.here``, each phase timed as its task, fetch and the units retried on transient errors."""
        from diffprep.phases.pipeline import Steps
        from diffprep.tasks.common import FETCH_RETRY_DELAYS

        here = Steps.here(token)

        def units(settings: Settings, output: Any, plan: Any, units: list[int], progress: Any) -> None:
            if settings.workers.devices:
                return self.shared_units(settings, output, plan, units, progress, token)
            for unit in units:
                progress.unit_done(self.encode_here(settings, output, plan, unit, token))

        return Steps(plan=self.timed("fetch", here.plan, FETCH_RETRY_DELAYS),
                     verify=self.timed("verify-existing", here.verify),
                     prepare=self.timed("prepare-output", here.prepare),
                     sanity=self.timed("sanity", here.sanity), units=units,
                     audit=self.timed("audit", here.audit), finalize=self.timed("finalize", here.finalize),
                     validate=self.timed("validate", here.validate))

    def encode_here(self, settings: Settings, output: Any, plan: Any, unit: int, token: str | None,
                    worker: str | None = None) -> dict:
        """One unit in this process, recorded as its task, retried on transient errors."""
        from diffprep.phases.pipeline import encode_one_unit
        from diffprep.tasks.common import UNIT_RETRY_DELAYS

        with self.task("encode-unit", f"encode-unit-{unit:06d}", unit):
            result = retried(lambda: encode_one_unit(settings, output, plan, unit, token), f"unit {unit:06d}",
                             UNIT_RETRY_DELAYS)
            record = self.tasks[self.units[unit]]
            record.worker = f"{record.worker}, then {worker}" if record.worker and worker else worker or ""
        done = {"unit": result.unit, "count": result.count, "rejected": result.rejected,
                "seconds": round(result.seconds, 3), "skipped": result.skipped}
        return done | ({"worker": worker} if worker else {})

    def shared_units(self, settings: Settings, output: Any, plan: Any, units: list[int], progress: Any,
                     token: str | None) -> None:
        """The units shared between this process (on its own device, when that is one of ``workers.devices``)
        and a worker process per other device, each taking units once its encoders are loaded."""
        import torch

        from diffprep.families.base import resolve_device
        from diffprep.output import ref_of
        from diffprep.run.pool import UnitDone, pid_name, share_units
        from diffprep.run.threads import CpuRecord, default_threads
        from diffprep.run.workers import cpu_workers_that_fit, parse_devices

        devices = parse_devices(settings.workers.devices)
        own = resolve_device(settings.model.device)
        own_name = f"cuda:{own.index if own.index is not None else torch.cuda.current_device()}" \
            if own.type == "cuda" else own.type
        others = list(devices)
        if own_name in others:
            others.remove(own_name)
        planned = CpuRecord.from_json(plan.cpu)
        threads, cores = planned.threads if planned else torch.get_num_threads(), default_threads()
        cpus = others.count("cpu")
        fit = cpu_workers_that_fit(cpus, threads, cores, own_name == "cpu" and own_name in devices)
        if fit < cpus:
            log.warning("workers.devices %s: %d CPU process(es) of %d encoder threads fill this machine's %d "
                        "cores, so %d more would only share them (slower, not faster): starting %d CPU "
                        "worker(s). For more CPU processes, plan fewer threads each (--encoder-threads)",
                        settings.workers.devices, cores // max(1, threads) or 1, threads, cores, cpus - fit, fit)
            others = [d for d in others if d != "cpu"] + ["cpu"] * fit
        here_name = pid_name(own_name)
        setups = [(device, partial(unit_worker, settings, ref_of(output), token, torch.get_num_threads(), device))
                  for device in others]
        log.info("encoding %d units on %s: %s", len(units), ", ".join(devices),
                 f"this process ({here_name}) and {len(others)} worker process(es)" if own_name in devices
                 else f"{len(others)} worker processes ({own_name}, model.device, is not one of them)")

        def started(unit: int, worker: str) -> None:
            self.add(TaskRecord("encode-unit", f"encode-unit-{unit:06d}", time.time(), worker=worker), unit)

        def done(finished: UnitDone) -> None:
            if finished.worker != here_name:
                record = self.tasks[self.units[finished.unit]]
                record.started, record.ended = finished.started, finished.ended
            progress.unit_done(finished.result)

        here = partial(self.encode_here, settings, output, plan, token=token, worker=here_name)
        share_units(units, here=here if own_name in devices else None, here_name=here_name, setups=setups, done=done,
                    started=started)


def unit_worker(settings: Settings, output: Any, token: str | None, threads: int,
                device: str) -> Callable[[int], dict]:
    """A shared run's worker process (``diffprep.run.pool``): ``device`` pinned, torch at the parent's thread
    count, the encoders loaded; returns its function for one unit (``encode_one_unit``, as this process's).

    A CPU worker runs at the lowest priority: on cores this process already fills, its start (imports, encoders:
    seconds) slowed this process's units more than its own units added (benchmarks/README.md, section 14); at
    nice 19 it gets the cycles this process leaves, and on idle cores the priority changes nothing."""
    from diffprep.encodings import get_encoding
    from diffprep.phases.pipeline import encode_one_unit
    from diffprep.run.pool import pid_name
    from diffprep.run.workers import pin_device

    if device == "cpu":
        os.nice(CPU_WORKER_NICE)
    pin_device(device, threads)
    opened = output.open()
    plan = opened.state.plan()
    get_encoding(plan.encoding).load(settings, token)
    name = pid_name(device)

    def encode(unit: int) -> dict:
        result = encode_one_unit(settings, opened, plan, unit, token)
        return {"unit": result.unit, "count": result.count, "rejected": result.rejected,
                "seconds": round(result.seconds, 3), "skipped": result.skipped, "worker": name}

    return encode


def retried(call: Callable[[], Any], what: str, delays: tuple[int, ...]) -> Any:
    """``call()``, again after each delay while it fails with a transient error (the tasks' retry policy)."""
    from diffprep.tasks.common import is_transient

    for delay in (*delays, None):
        try:
            return call()
        except Exception as error:
            if delay is None or not is_transient(error):
                raise
            log.warning("%s: %s: %s; retrying in %d s", what, type(error).__name__, error, delay)
            time.sleep(delay)
    raise AssertionError("unreachable")


def recording_events(recorder: Recorder) -> Any:
    """The flow's ``ArtifactEvents``, its artifacts kept for the recording; progress on the console."""
    from diffprep.flows.encode import ArtifactEvents
    from diffprep.phases.pipeline import Progress
    from diffprep.tasks.common import slug

    class RecordedProgress(Progress):
        """Progress logged as a run without Prefect logs it; its last value becomes the progress artifact."""

        def __init__(self, units: int, key: str) -> None:
            super().__init__(units)
            self.key = key

        def update(self) -> None:
            from prefect.artifacts import ProgressArtifact

            recorder.artifacts = [a for a in recorder.artifacts if a.key != self.key]
            recorder.artifacts.append(ProgressArtifact(key=self.key, progress=100.0 * self.done / max(1, self.total),
                                                       description=f"units encoded of {self.total}"))

    class RecordedEvents(ArtifactEvents):
        def publish(self, artifact: Any) -> None:
            recorder.artifacts.append(artifact)

        def log(self, message: str, *args: Any) -> None:
            log.info(message, *args)

        def progress(self, units: int, output: Any) -> Progress:
            return RecordedProgress(units, f"progress-{slug(output.uri)}")

    return RecordedEvents()


def run_recorded(settings: Settings, encoding: str, load_flow: Callable[[], Any], parameters: dict[str, Any], *,
                 then: Callable[[], None] = lambda: None) -> dict:
    """``encoding``'s pipeline in this process, then recorded as a run of the flow ``load_flow`` returns, with
    ``parameters``; ``then`` is called once the server's process has started (the caller's own slow set-up)."""
    logging.getLogger("diffprep").setLevel(logging.INFO)
    server = ServerStart()  # first: its process starts while this one imports the pipeline
    then()
    from diffprep.flows.startup import load_ahead
    from diffprep.phases.pipeline import ask_here, run, settings_output
    from diffprep.tasks.common import run_token

    warming = load_ahead(settings, encoding)
    recorder = Recorder()
    diffprep_log = logging.getLogger("diffprep")
    diffprep_log.addHandler(recorder)
    try:
        result = run(settings, encoding, output=settings_output(settings).open(), ask=ask_here,
                     steps=recorder.steps(settings, run_token(settings)), events=recording_events(recorder),
                     run_id=f"recorded-{uuid.uuid4()}")
    except BaseException as error:
        diffprep_log.removeHandler(recorder)
        recorder.ended = time.time()
        server.record(recorder, load_flow(), parameters, error)
        raise
    finally:
        if warming is not None:
            warming.join()
    diffprep_log.removeHandler(recorder)
    recorder.ended = time.time()
    server.record(recorder, load_flow(), parameters, None)
    return result.to_json()


class ServerStart:
    """The embedded server's process, started at once at a low CPU priority, answering ``/health`` (watched in a
    thread); the run written to it once the run is over; stopped at exit.

    The process is started here, from the main thread, as ``server_command`` gives it (never through
    ``prefect.server``, whose 3 s of imports in this process would slow the run): Linux ends it
    (``PR_SET_PDEATHSIG``) when the thread that started it ends, and the main thread lasts as long as the command.
    """

    def __init__(self) -> None:
        from diffprep.flows.server_command import server_command

        self.error: BaseException | None = None
        self.up = threading.Event()
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}/api"
        args, env = server_command(self.port, SERVER_NICE)
        self.process = subprocess.Popen(args, env=env, start_new_session=True)
        atexit.register(self.stop)
        log.info("embedded Prefect server starting on http://127.0.0.1:%d, to record this run when it ends", self.port)
        threading.Thread(target=self._wait, name="diffprep-server", daemon=True).start()

    def _wait(self) -> None:
        from prefect.settings import PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS

        deadline = time.monotonic() + PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS.value()
        try:
            while not _healthy(self.url):
                if self.process.poll() is not None:
                    raise RuntimeError(f"the embedded Prefect server exited with code {self.process.returncode}")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the embedded Prefect server did not answer on {self.url} within "
                                       f"{PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS.value()} s "
                                       "(PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS)")
                time.sleep(0.1)
            import prefect.client.orchestration  # noqa: F401 - loaded while the run goes on, for the recording
        except BaseException as error:  # noqa: BLE001 - said when the run is recorded; the run goes on
            self.error = error
        finally:
            self.up.set()

    def record(self, recorder: Recorder, flow: Any, parameters: dict[str, Any], error: BaseException | None) -> None:
        from prefect.settings import PREFECT_API_URL, temporary_settings

        self.up.wait()
        if self.error is None:
            try:
                with temporary_settings(updates={PREFECT_API_URL: self.url}):
                    flow_run = write_flow_run(recorder, flow, parameters, error)
                log.info("recorded as flow run '%s' (%s) in Prefect: `prefect server start` shows it",
                         flow_run.name, final_state(error).name)
                return
            except Exception as failed:  # noqa: BLE001 - the run's work is done and kept either way
                self.error = failed
        log.warning("the run was not recorded in Prefect (%s: %s); its output is complete as reported",
                    type(self.error).__name__, self.error)

    def stop(self) -> None:
        """End the server (its last writes done: SIGTERM, as uvicorn shuts down cleanly), at most 5 s."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
            return response.status == 200
    except OSError:  # refused while it starts; URLError is an OSError
        return False


__all__ = ["LIVE_FLOW_ENV", "Recorder", "run_recorded", "wanted", "write_flow_run"]
