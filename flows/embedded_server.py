"""The embedded Prefect server of a terminal run, out of the terminal's reach.

Prefect starts its embedded server (``SubprocessASGIServer``) as a plain
child: same process group, so a Ctrl-C in the terminal reaches the server too.
It dies at once, and the run can then neither record that it was interrupted
nor end: the client retries the dead API for minutes (issue 27: about 150 s of
httpx tracebacks, the run left RUNNING).

``DetachedServer`` is the same server started in a session of its own: only
diffprep gets the SIGINT, the flow engine marks the run Crashed on a server
that still answers, and the server is stopped at exit (Prefect's ``atexit``),
after the last log lines and events have reached it.
So that it never outlives the command (a closed terminal, a SIGKILL), the
child asks Linux to send it SIGTERM when its parent dies (``PR_SET_PDEATHSIG``)
before it runs uvicorn: ``python -m diffprep.flows.embedded_server PID ARGS``
is ``python -m uvicorn ARGS`` with that set (and its niceness raised by NICE: ``PID NICE ARGS``), after seeding a fresh
``PREFECT_HOME``'s database from a migrated template (``prefect_home.py``).

``start_detached_server`` registers it as Prefect's default instance
(``SubprocessASGIServer()`` is a per-port singleton), so every Prefect client
of the process uses it.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import runpy
import signal
import subprocess
import sys
from typing import Any

from prefect.server.api.server import SubprocessASGIServer

from diffprep.flows.server_command import server_command

PR_SET_PDEATHSIG = 1
DRAIN_SECONDS = 5


class DetachedServer(SubprocessASGIServer):
    """Prefect's embedded server in a session of its own, ended with its parent."""

    nice = 0  # added to the server process's niceness

    def _run_uvicorn_command(self) -> subprocess.Popen[Any]:
        args, env = server_command(self.port, self.nice)
        return subprocess.Popen(args=args, env=env, start_new_session=True)


def start_detached_server(nice: int = 0) -> SubprocessASGIServer:
    """Start (once) the embedded server in its own session, as Prefect's default instance (``nice`` added to its
    process's niceness); returns it."""
    current = SubprocessASGIServer._instances.get(None)
    if current is not None and current.running:
        return current  # already up (started here before, or by an API call)
    SubprocessASGIServer._instances.pop(None, None)
    server = DetachedServer()  # stored under the None key: SubprocessASGIServer() now returns it
    server.nice = nice
    server.start()  # registers its stop at exit
    atexit.register(_drain_to_server)  # after it, so it runs before the stop
    return server


def _drain_to_server() -> None:
    """Send the run's last log lines and events while the server still answers: drained after the stop (Prefect's
    order at exit), they wait seconds on a closed port (measured 4 s after a Ctrl-C) and are lost."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    for worker in (APILogWorker, EventsWorker):
        worker.drain_all(timeout=DRAIN_SECONDS)


def _die_with_parent(parent: int) -> None:
    """SIGTERM to this process when ``parent`` exits (Linux); elsewhere only the check below."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != parent:  # the parent died before the request above
        sys.exit(0)


if __name__ == "__main__":
    _die_with_parent(int(sys.argv[1]))
    os.nice(int(sys.argv[2]))
    from diffprep.flows.prefect_home import seed_database

    seed_database()  # a fresh PREFECT_HOME's database copied from a migrated template (prefect_home.py)
    sys.argv = ["uvicorn", *sys.argv[3:]]
    runpy.run_module("uvicorn", run_name="__main__", alter_sys=True)
