"""Units shared between this process and worker processes (diffprep/run/pool.py), with stand-in unit functions.

The workers are real spawned processes; what they run is a function of this module (they import it): a ``setup``
that is ready at once, late, or never, and a unit function that returns its unit or fails. No test waits on a
clock: readiness and the parent's progress are tied to events, so each order asserted is the only one possible.
"""

from __future__ import annotations

import logging
import multiprocessing
import threading
from functools import partial

import pytest

from diffprep.errors import DiffprepError
from diffprep.run.pool import UnitDone, share_units

WAIT = 120  # seconds an event may take before the test goes on (and its assertions fail): a hang guard only
SPAWN = multiprocessing.get_context("spawn")


def _ready_after(event, fail: bool = False):
    """A worker's setup: ready once ``event`` is set (None: at once); its units fail when ``fail``."""
    if event is not None:
        event.wait(WAIT * 5)

    def encode(unit: int) -> dict:
        logging.getLogger("diffprep.test").info("worker encoding unit %d", unit)
        if fail:
            raise ValueError(f"stand-in failure of unit {unit}")
        return {"unit": unit}

    return encode


class Units:
    """Who encoded which unit; ``here`` for the parent, which can be held until an event."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.by: list[tuple[int, str]] = []
        self.all_done = threading.Event()
        self.worker_did_one = threading.Event()
        self.handed = threading.Event()
        self.threads: set[str] = set()

    def done(self, finished: UnitDone) -> None:
        assert finished.result == {"unit": finished.unit}
        self.by.append((finished.unit, finished.worker))
        self.threads.add(threading.current_thread().name)
        if finished.worker != "parent":
            self.worker_did_one.set()
        if len(self.by) == self.total:
            self.all_done.set()

    def started(self, unit: int, worker: str) -> None:
        self.handed.set()

    def here(self, unit: int, wait_for: threading.Event | None = None) -> dict:
        if wait_for is not None and not self.by:  # the parent's first unit waits
            wait_for.wait(WAIT)
        return {"unit": unit}

    def workers_units(self) -> list[int]:
        return [unit for unit, worker in self.by if worker != "parent"]


def _share(units: Units, here, setups, **kwargs):
    return share_units(range(units.total), here=here, here_name="parent", setups=setups, done=units.done,
                       started=units.started, **kwargs)


def test_a_worker_ready_after_the_parent_finished_every_unit_gets_none():
    units = Units(6)
    ready = SPAWN.Event()
    finished = Units.done

    def done(result: UnitDone) -> None:
        finished(units, result)
        if units.all_done.is_set():
            ready.set()  # the worker becomes ready only now

    report = share_units(range(6), here=units.here, here_name="parent", setups=[("cpu", partial(_ready_after, ready))],
                         done=done)
    assert sorted(units.by) == [(u, "parent") for u in range(6)]
    (worker,) = [name for name in report.units if name != "parent"]
    assert report.units[worker] == [] and report.units["parent"] == list(range(6))
    assert multiprocessing.active_children() == []


def test_a_worker_still_loading_at_the_end_is_ended():
    units = Units(3)
    never = SPAWN.Event()
    report = _share(units, units.here, [("cpu", partial(_ready_after, never))])
    assert [worker for _, worker in units.by] == ["parent"] * 3
    assert report.ended_loading == [name for name in report.units if name != "parent"]
    assert multiprocessing.active_children() == []


def test_a_ready_worker_takes_units_and_its_log_lines_reach_this_process(caplog):
    units = Units(8)
    with caplog.at_level(logging.INFO, logger="diffprep"):
        report = _share(units, partial(units.here, wait_for=units.worker_did_one),
                        [("cpu", partial(_ready_after, None))])
    assert sorted(unit for unit, _ in units.by) == list(range(8))  # every unit once
    assert units.workers_units(), units.by  # the parent held its first unit until the worker had done one
    assert units.threads == {"MainThread", "diffprep-pool"}  # ``done`` from both, one at a time (a lock)
    worker = next(name for name in report.units if name != "parent")
    assert sorted(report.units[worker]) == sorted(units.workers_units())
    tagged = {record.pool_unit for record in caplog.records if record.name == "diffprep.test"}
    assert tagged == set(units.workers_units())  # each line with its unit
    assert any(f"worker {worker} ready" in record.getMessage() for record in caplog.records)


def test_two_workers_without_the_parent_share_every_unit():
    units = Units(10)
    report = _share(units, None, [("cpu", partial(_ready_after, None)), ("cpu", partial(_ready_after, None))])
    assert sorted(unit for unit, _ in units.by) == list(range(10))
    assert "parent" not in report.units and len(report.units) == 2


def test_a_unit_failing_in_a_worker_is_encoded_again_by_the_parent(caplog):
    units = Units(5)
    with caplog.at_level(logging.INFO, logger="diffprep"):
        _share(units, partial(units.here, wait_for=units.handed), [("cpu", partial(_ready_after, None, fail=True))])
    assert sorted(units.by) == [(u, "parent") for u in range(5)]  # each once, the failed ones by the parent
    failed = [r.getMessage() for r in caplog.records if "failed in worker" in r.getMessage()]
    assert failed and all("this process encodes it again" in line for line in failed), failed
    assert any("stand-in failure" in r.getMessage() and r.pool_unit is not None for r in caplog.records
               if hasattr(r, "pool_unit"))  # the worker's own line, with its unit


def test_a_second_failure_ends_the_run():
    units = Units(3)
    with pytest.raises(DiffprepError, match=r"unit 00000\d failed twice.*run the same command again"):
        _share(units, None, [("cpu", partial(_ready_after, None, fail=True))])
    assert units.by == []
    assert multiprocessing.active_children() == []


def test_a_failure_here_ends_every_worker():
    def here(unit: int) -> dict:
        raise KeyboardInterrupt  # as a Ctrl-C in the middle of the parent's unit

    with pytest.raises(KeyboardInterrupt):
        _share(Units(4), here, [("cpu", partial(_ready_after, SPAWN.Event()))])
    assert multiprocessing.active_children() == []
