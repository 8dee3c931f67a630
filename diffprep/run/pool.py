"""Units shared between this process and worker processes that take one only once they are ready.

A terminal ``--devices`` run (``flows/recorded.py``) has its encoders loaded
already when the units start (the sanity check loaded them), while a new
worker process needs seconds to import torch and the model libraries and to
load its own (8-17 s on 2 cores). So this process encodes units itself, on its
own device, and starts one process per OTHER device; a worker says "ready"
once its ``setup`` has run, and only then is it handed a unit, one at a time.
No unit ever waits on a cold worker while this process could do it, and at the
end the workers still warming up (holding no unit) are ended: they wrote
nothing.

The workers are plain ``multiprocessing`` (spawn) processes: no Prefect in
them. ``setup`` (picklable, run in the worker) pins the device, loads the
encoders and returns the function that encodes one unit. A worker's log lines
of the loggers named (``diffprep``) come back through a queue and are handled
by this process's loggers (the console, a run's recorder), each tagged with
the unit it belongs to (``record.pool_unit``, None outside a unit).

A unit that fails in a worker is done again by this process (by the next free
worker when this process encodes none); a second failure ends the run, as a
unit's failure does. Ctrl-C, or any error here, ends every worker (SIGTERM; a
unit cut short commits nothing: units are idempotent).

Nothing here knows what a unit is: ``here`` and the workers' functions take a
unit number and return a picklable result (tests/test_pool.py uses stand-ins).
"""

from __future__ import annotations

import contextlib
import logging
import logging.handlers
import multiprocessing
import os
import queue
import signal
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from diffprep.errors import DiffprepError

log = logging.getLogger("diffprep.pool")

Encode = Callable[[int], Any]
Setup = Callable[[], Encode]  # run in the worker: device pinned, encoders loaded; returns its unit function
POLL_SECONDS = 0.2  # how often a wait looks again (a dead worker, Ctrl-C, the parent's exit)
THREAD_NAME = "diffprep-pool"  # the thread that hands units to workers and reports theirs


@dataclass
class UnitDone:
    """One unit's result, who encoded it, and when (``time.time()``)."""

    unit: int
    result: Any
    worker: str
    started: float
    ended: float


@dataclass
class PoolReport:
    """What each worker did: units per worker name, and the workers ended while still loading."""

    units: dict[str, list[int]] = field(default_factory=dict)
    ended_loading: list[str] = field(default_factory=list)


class _Worker:
    def __init__(self, context: Any, device: str, setup: Setup, outbox: Any, logs: Any, index: int,
                 loggers: Sequence[str]) -> None:
        self.device = device
        self.inbox = context.Queue()
        self.inbox.cancel_join_thread()  # a unit number or a stop: nothing to flush once the worker is gone
        self.process = context.Process(target=_worker_main, name=f"diffprep-worker-{index}", daemon=True,
                                       args=(index, setup, self.inbox, outbox, logs, tuple(loggers)))
        with _sigint_ignored():  # inherited from birth: a Ctrl-C while it imports is the parent's to handle
            self.process.start()
        self.name = f"{socket.gethostname()}:{self.process.pid}/{device}"
        self.state = "loading"  # -> idle <-> busy; gone
        self.unit: int | None = None
        self.since = time.monotonic()


def share_units(units: Sequence[int], *, here: Encode | None, here_name: str, setups: Sequence[tuple[str, Setup]],
                done: Callable[[UnitDone], None], started: Callable[[int, str], None] = lambda unit, worker: None,
                loggers: Sequence[str] = ("diffprep",)) -> PoolReport:
    """Every unit of ``units`` encoded once: by ``here(unit)`` in this thread (None: this process encodes none)
    and by one worker process per ``(device, setup)``, each taking units once it is ready.

    ``done`` is called once per unit, from one thread at a time; ``started(unit, worker)`` when a unit is handed
    to a worker. Raises the first error that ends the run, after ending every worker."""
    if not units:
        return PoolReport()
    pool = _Pool(list(units), here is not None, done, started)
    context = multiprocessing.get_context("spawn")
    logs = context.Queue()
    listener = _Listener(logs, _Reemit())
    listener.start()
    outbox = context.Queue()
    try:
        for index, (device, setup) in enumerate(setups):
            worker = _Worker(context, device, setup, outbox, logs, index, loggers)
            pool.workers[index] = worker
            pool.report.units[worker.name] = []
            log.info("worker %s loading its encoders; this process encodes units meanwhile", worker.name)
        dispatcher = threading.Thread(target=pool.dispatch, args=(outbox,), name=THREAD_NAME, daemon=True)
        dispatcher.start()
        try:
            if here is not None:
                pool.report.units[here_name] = []
                pool.encode_here(here, here_name)
            pool.wait_all()
        finally:
            pool.finish()
            dispatcher.join()
            pool.end_workers()
    finally:
        listener.stop()
        outbox.close()
        logs.close()
    return pool.report


class _Pool:
    def __init__(self, units: list[int], parent_encodes: bool, done: Callable[[UnitDone], None],
                 started: Callable[[int, str], None]) -> None:
        self.pending = deque(units)
        self.retry_here: deque[int] = deque()  # failed in a worker: this process does them
        self.outstanding = set(units)
        self.failures: dict[int, int] = {}
        self.parent_encodes = parent_encodes
        self.workers: dict[int, _Worker] = {}
        self.cond = threading.Condition()
        self.report_lock = threading.Lock()  # ``done`` from one thread at a time
        self.error: BaseException | None = None
        self.finished = False
        self.done = done
        self.started = started
        self.report = PoolReport()

    # --- this process's own units (the calling thread) ---

    def encode_here(self, here: Encode, name: str) -> None:
        while True:
            with self.cond:
                unit = self._next_here()
            if unit is None:
                return
            began = time.time()
            result = here(unit)
            self._report(UnitDone(unit, result, name, began, time.time()))

    def _next_here(self) -> int | None:
        """The next unit for this process: a unit failed in a worker first; None once none is left for it."""
        while True:
            self._raise_error()
            if self.retry_here:
                return self.retry_here.popleft()
            if self.pending:
                return self.pending.popleft()
            if not self.outstanding:
                return None
            self.cond.wait(POLL_SECONDS)  # the workers' last units: one may fail and come back here

    def wait_all(self) -> None:
        with self.cond:
            while self.outstanding:
                self._raise_error()
                if not self.parent_encodes and not any(w.state != "gone" for w in self.workers.values()):
                    raise DiffprepError(f"every worker process ended with {len(self.outstanding)} units left: see "
                                        "the errors above; finished units are kept, run the same command again")
                self.cond.wait(POLL_SECONDS)
            self._raise_error()

    def _raise_error(self) -> None:
        if self.error is not None:
            raise self.error

    def _report(self, finished: UnitDone) -> None:
        with self.report_lock:
            self.done(finished)
        with self.cond:
            self.outstanding.discard(finished.unit)
            self.report.units.setdefault(finished.worker, []).append(finished.unit)
            self.cond.notify_all()

    # --- the workers (the dispatcher thread) ---

    def dispatch(self, outbox: Any) -> None:
        """Hand units to ready workers and report theirs, until the run is over; a worker that dies is noticed."""
        try:
            while not self.finished:
                try:
                    message = outbox.get(timeout=POLL_SECONDS)
                except queue.Empty:
                    self._notice_dead()
                    continue
                self._handle(*message)
        except BaseException as error:  # noqa: BLE001 - ends the run in the calling thread
            with self.cond:
                self.error = self.error or error
                self.cond.notify_all()

    def _handle(self, kind: str, index: int, *rest: Any) -> None:
        worker = self.workers[index]
        if worker.state == "gone":
            return
        if kind == "ready":
            log.info("worker %s ready after %.1f s", worker.name, time.monotonic() - worker.since)
        elif kind == "broken":
            log.warning("worker %s could not start: %s; the other workers and this process go on", worker.name,
                        rest[0])
            worker.state = "gone"
            with self.cond:
                self.cond.notify_all()
            return
        elif kind == "done":
            unit, result, began, ended = rest
            worker.unit = None
            self._report(UnitDone(unit, result, worker.name, began, ended))
        elif kind == "failed":
            unit, error = rest
            worker.unit = None
            self._failed(unit, worker, error)
        worker.state = "idle"
        self._hand_out()

    def _failed(self, unit: int, worker: _Worker, error: str) -> None:
        with self.cond:
            self.failures[unit] = self.failures.get(unit, 0) + 1
            if self.failures[unit] > 1:
                self.error = self.error or DiffprepError(
                    f"unit {unit:06d} failed twice, last in worker {worker.name}: {error}. Finished units are "
                    "kept; run the same command again to encode the rest")
            elif self.parent_encodes:
                log.warning("unit %06d failed in worker %s (%s): this process encodes it again", unit, worker.name,
                            error)
                self.retry_here.append(unit)
            else:
                log.warning("unit %06d failed in worker %s (%s): the next free worker encodes it again", unit,
                            worker.name, error)
                self.pending.appendleft(unit)
            self.cond.notify_all()

    def _hand_out(self) -> None:
        for worker in self.workers.values():
            if worker.state != "idle":
                continue
            with self.cond:
                if not self.pending or self.finished:
                    return
                unit = self.pending.popleft()
            worker.state, worker.unit = "busy", unit
            self.started(unit, worker.name)
            worker.inbox.put(unit)

    def _notice_dead(self) -> None:
        for worker in self.workers.values():
            if worker.state == "gone" or worker.process.is_alive():
                continue
            worker.state = "gone"
            log.warning("worker %s ended (exit code %s)%s", worker.name, worker.process.exitcode,
                        f" during unit {worker.unit:06d}" if worker.unit is not None else "")
            if worker.unit is not None:
                unit, worker.unit = worker.unit, None
                self._failed(unit, worker, f"the process ended with exit code {worker.process.exitcode}")
            with self.cond:
                self.cond.notify_all()
        self._hand_out()

    # --- the end ---

    def finish(self) -> None:
        with self.cond:
            self.finished = True
            self.cond.notify_all()

    def end_workers(self) -> None:
        """Idle workers are told to stop; loading ones (holding no unit) and, after an error, busy ones are ended
        (once the idle ones have stopped: a process ended while it writes to a queue leaves the queue's lock
        held, and a worker that exits waits to flush its lines through it)."""
        idle = [worker for worker in self.workers.values() if worker.state == "idle"]
        for worker in idle:
            worker.inbox.put(None)
        for worker in idle:
            worker.process.join(timeout=10)
        for worker in self.workers.values():
            if worker.state != "idle" and worker.process.is_alive():
                if worker.state == "loading":
                    log.info("worker %s still loading at the end: ended, it holds no unit", worker.name)
                    self.report.ended_loading.append(worker.name)
                worker.process.terminate()
        for worker in self.workers.values():
            worker.process.join(timeout=10)
            if worker.process.is_alive():
                worker.process.kill()
                worker.process.join()


@contextlib.contextmanager
def _sigint_ignored() -> Iterator[None]:
    """SIGINT ignored in this thread's process while a worker is started (the main thread only can set it)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, before)


# --- in the worker process ---


class _Listener(logging.handlers.QueueListener):
    """A ``QueueListener`` that stops without putting anything on the queue: a worker ended while it wrote to the
    queue can leave its write lock held, and a stop sentinel put then would never arrive. It polls instead, and
    once stopping, ends at the first empty poll (the lines already sent are handled first)."""

    stopping = False

    def dequeue(self, block: bool) -> Any:
        while True:
            try:
                return self.queue.get(timeout=POLL_SECONDS)
            except queue.Empty:
                if self.stopping:
                    raise

    def enqueue_sentinel(self) -> None:
        self.stopping = True


class _Reemit(logging.Handler):
    """A worker's log record, handled by this process's logger of the same name (its handlers, its parents')."""

    def handle(self, record: logging.LogRecord) -> bool:
        logger = logging.getLogger(record.name)
        if logger.isEnabledFor(record.levelno):
            logger.handle(record)
        return True


class _Tag(logging.Filter):
    def __init__(self) -> None:
        super().__init__()
        self.unit: int | None = None

    def filter(self, record: logging.LogRecord) -> bool:
        record.pool_unit = self.unit
        return True


def _worker_main(index: int, setup: Setup, inbox: Any, outbox: Any, logs: Any, loggers: tuple[str, ...]) -> None:
    """A worker: its loggers sent to the parent, ``setup()``, "ready", then units until told to stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the parent ends the workers
    # (ignored from its start too: ``_sigint_ignored``)
    tag = _Tag()
    handler = logging.handlers.QueueHandler(logs)
    handler.addFilter(tag)
    for name in loggers:
        logger = logging.getLogger(name)
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False
    try:
        encode = setup()
    except Exception as error:  # noqa: BLE001 - said by the parent, which goes on without this worker
        outbox.put(("broken", index, f"{type(error).__name__}: {error}"))
        return
    outbox.put(("ready", index))
    while True:
        unit = _next_unit(inbox)
        if unit is None:
            return
        tag.unit = unit
        began = time.time()
        try:
            result = encode(unit)
        except Exception as error:  # noqa: BLE001 - the parent encodes it again
            logging.getLogger(loggers[0] if loggers else "diffprep").warning(
                "unit %06d: %s: %s", unit, type(error).__name__, error, exc_info=True)
            outbox.put(("failed", index, unit, f"{type(error).__name__}: {error}"))
        else:
            outbox.put(("done", index, unit, result, began, time.time()))
        finally:
            tag.unit = None


def _next_unit(inbox: Any) -> int | None:
    """The next unit the parent sends; None when it says stop or has gone (a killed parent leaves no worker)."""
    parent = multiprocessing.parent_process()
    while True:
        try:
            return inbox.get(timeout=POLL_SECONDS)
        except queue.Empty:
            if parent is not None and not parent.is_alive():
                return None


def pid_name(device: str) -> str:
    """This process's worker name: host, pid and device (as the workers' names are made)."""
    return f"{socket.gethostname()}:{os.getpid()}/{device}"


__all__ = ["PoolReport", "UnitDone", "pid_name", "share_units"]
