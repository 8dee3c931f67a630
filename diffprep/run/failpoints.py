"""Named points where crash tests kill the process, the way a power cut or the OOM killer would.

``DIFFPREP_FAILPOINT=before-manifest`` (or ``before-manifest@2``: at its
second hit) makes the process SIGKILL itself when it reaches that point;
``before-manifest@2:raise`` raises ``FailpointError`` there instead (an error
the code did not expect, the way a bug or a lost disk would). Unset, a
failpoint is one dictionary lookup.
"""

from __future__ import annotations

import os
import signal
import threading

ENV = "DIFFPREP_FAILPOINT"
POINTS = ("decode", "encode", "shard-write", "before-manifest", "finalize")

_hits: dict[str, int] = {}
_lock = threading.Lock()


class FailpointError(RuntimeError):
    """Raised at a failpoint set to ``:raise``."""


def failpoint(name: str) -> None:
    wanted = os.environ.get(ENV)
    if not wanted:
        return
    where, _, mode = wanted.partition(":")
    point, _, nth = where.partition("@")
    if point != name:
        return
    with _lock:
        _hits[name] = _hits.get(name, 0) + 1
        if _hits[name] < int(nth or 1):
            return
    if mode == "raise":
        raise FailpointError(f"failpoint {name} raised on purpose (hit {_hits[name]}; {ENV}={wanted})")
    os.kill(os.getpid(), signal.SIGKILL)
