"""Progress inside one unit: a line every few seconds with samples/s and the unit's ETA, and the same to a listener.

A unit is a shard (1,000 samples by default): minutes on a GPU between two
"unit done" lines. ``encode_unit`` reports each batch it writes; ``UnitProgress``
turns that into a log line at most every ``PROGRESS_SECONDS`` and hands the
same ``UnitStatus`` to the listener of this context (``listening``): the flow
sets one around the units it runs in its own thread, to keep its progress
artifact moving between units. No Prefect here.
"""

from __future__ import annotations

import logging
import time
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Callable, Iterator

log = logging.getLogger("diffprep.units")

PROGRESS_SECONDS = 10.0


@dataclass(frozen=True)
class UnitStatus:
    """Where one unit is: samples done (written or rejected) of its total, after ``seconds``."""

    unit: int
    done: int
    total: int
    seconds: float

    @property
    def samples_per_second(self) -> float:
        return self.done / self.seconds if self.seconds > 0 else 0.0

    @property
    def eta_seconds(self) -> float:
        rate = self.samples_per_second
        return (self.total - self.done) / rate if rate > 0 else float("inf")


Listener = Callable[[UnitStatus], None]
_listener: ContextVar[Listener | None] = ContextVar("diffprep_unit_listener", default=None)


@contextmanager
def listening(listener: Listener) -> Iterator[None]:
    """Units encoded in this context (this thread) also report their status to ``listener``."""
    token = _listener.set(listener)
    try:
        yield
    finally:
        _listener.reset(token)


class UnitProgress:
    """``encode_unit``'s per-batch callback: logs and tells the listener at most every ``every`` seconds."""

    def __init__(self, every: float | None = None, listener: Listener | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.every = PROGRESS_SECONDS if every is None else every
        self.listener = listener if listener is not None else _listener.get()
        self.clock = clock
        self.start = self.last = clock()

    def __call__(self, event: dict) -> None:
        now = self.clock()
        status = UnitStatus(event["unit"], event["samples"], event["total"], now - self.start)
        if now - self.last < self.every or status.done >= status.total:  # the unit's own line says it is done
            return
        self.last = now
        log.info("unit %06d: %d of %d samples, %.1f samples/s, ETA %.0f s for this unit", status.unit, status.done,
                 status.total, status.samples_per_second, status.eta_seconds)
        if self.listener is not None:
            self.listener(status)


__all__ = ["PROGRESS_SECONDS", "UnitProgress", "UnitStatus", "listening"]
