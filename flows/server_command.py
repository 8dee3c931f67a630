"""The command line and environment of diffprep's embedded Prefect server process, without Prefect's server modules.

The server process is ``python -m diffprep.flows.embedded_server PARENT NICE
UVICORN-ARGS`` (Prefect 3.9.1's own uvicorn command for its temporary server,
with diffprep's module in front: it dies with its parent and seeds a fresh
``PREFECT_HOME``'s database, ``embedded_server.py``). Building it needs only
``prefect`` and its settings, not ``prefect.server`` (3 s of imports on 2
cores): a run recorded afterwards (``recorded.py``) starts the process without
ever importing them, and ``embedded_server.DetachedServer`` starts the same.
"""

from __future__ import annotations

import os
import sys

import prefect
from prefect.settings import get_current_settings

MODULE = "diffprep.flows.embedded_server"


def server_command(port: int, nice: int = 0) -> tuple[list[str], dict[str, str]]:
    """The server's arguments and environment, on 127.0.0.1:``port``, its niceness raised by ``nice``."""
    server_env = {"PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1", "PREFECT__SERVER_FINAL": "1"}
    args = [sys.executable, "-m", MODULE, str(os.getpid()), str(nice),
            "--app-dir", str(prefect.__module_path__.parent),
            "--factory", "prefect.server.api.server:create_app", "--host", "127.0.0.1",
            "--port", str(port), "--log-level", "error", "--lifespan", "on"]
    return args, {**os.environ, **server_env, **get_current_settings().to_environment_variables(exclude_unset=True)}


__all__ = ["MODULE", "server_command"]
