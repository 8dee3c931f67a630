"""Named points where crash tests kill the process, the way a power cut or the OOM killer would.

``DIFFPREP_FAILPOINT=before-manifest`` (or ``before-manifest@2``: at its
second hit) makes the process SIGKILL itself when it reaches that point.
Unset, a failpoint is one dictionary lookup.
"""

from __future__ import annotations

import os
import signal
import threading

ENV = "DIFFPREP_FAILPOINT"
POINTS = ("decode", "encode", "shard-write", "before-manifest", "finalize")

_hits: dict[str, int] = {}
_lock = threading.Lock()


def failpoint(name: str) -> None:
    wanted = os.environ.get(ENV)
    if not wanted:
        return
    point, _, nth = wanted.partition("@")
    if point != name:
        return
    with _lock:
        _hits[name] = _hits.get(name, 0) + 1
        if _hits[name] >= int(nth or 1):
            os.kill(os.getpid(), signal.SIGKILL)
