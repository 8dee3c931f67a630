"""The Prefect CLI as a user runs it, from tests: a shell environment for a server, commands, background processes."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path
from uuid import UUID

from user_shell import REPO, terminal_env


def shell_env(api_url: str, home: Path) -> dict[str, str]:
    """The environment of a user's shell pointed at ``api_url``: a fresh terminal's (``user_shell.terminal_env``)
    with a server named."""
    return terminal_env(home) | {"PREFECT_API_URL": api_url}


def run(args: list[str], env: dict[str, str], cwd: Path = REPO, timeout: float = 180,
        check: bool = True) -> subprocess.CompletedProcess:
    """Run a command to completion; with ``check``, fail the test with its output when it fails."""
    done = subprocess.run(args, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    if check:
        assert done.returncode == 0, (f"{' '.join(args)} exited with {done.returncode}:\n"
                                      f"{(done.stdout + done.stderr)[-4000:]}")
    return done


class Process:
    """A background command whose output goes to a file; stopped by its pid."""

    def __init__(self, args: list[str], env: dict[str, str], cwd: Path, log: Path) -> None:
        self.log = log
        self._file = log.open("wb")
        self.popen = subprocess.Popen(args, env=env, cwd=cwd, stdout=self._file, stderr=subprocess.STDOUT)

    def tail(self, chars: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-chars:]

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(timeout=30)
        self._file.close()


def wait_for_state(flow_run_id: UUID, done, seconds: float, process: Process | None = None):
    """The flow run once ``done(state)`` holds; fails after ``seconds`` with the state and the process's output."""
    import pytest
    from prefect.client.orchestration import get_client

    deadline = time.monotonic() + seconds
    with get_client(sync_client=True) as client:
        while True:
            flow_run = client.read_flow_run(flow_run_id)
            if flow_run.state is not None and done(flow_run.state):
                return flow_run
            if time.monotonic() > deadline:
                output = f"; {process.popen.args[0]} output:\n{process.tail()}" if process else ""
                pytest.fail(f"flow run {flow_run_id} still {flow_run.state!r} after {seconds} s{output}")
            time.sleep(0.5)
