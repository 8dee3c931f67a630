"""Ctrl-C in a terminal run: the command ends in seconds, the run is recorded as crashed, a re-run resumes.

The signal goes to the command's whole process group, as a terminal sends it. Two runs: one on the session's
Prefect server (its flow run's final state is read there), one on the embedded server the command starts itself
(which, in Prefect's own process group, died with the Ctrl-C and left the command retrying it for 150 s); that
run, Prefect-free, is recorded on it as crashed (flows/recorded.py).
"""

from __future__ import annotations

import os
import re
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from diffprep import contract
from diffprep.cli import INTERRUPTED, main
from diffprep.tools.demo import write_demo_dataset

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow

EXIT_SECONDS = 10  # from the Ctrl-C to the command's exit


def _args(data: Path, model: Path, out: Path) -> list[str]:
    return ["encode", "--source-type", "directory", "--input-dir", str(data), "--model-path", str(model),
            "--output-dir", str(out), "--shard-size", "2", "--batch-size", "2", "--precision", "fp32",
            "--image-size", "64", "--t5-max-length", "16", "--min-psnr", "0"]


def _interrupt_once_units_run(args: list[str], env: dict[str, str], out: Path, log: Path) -> tuple[int, float]:
    """Start ``diffprep`` in a process group of its own, send SIGINT to the group once a unit is committed; returns
    the exit code and the seconds from the signal to the exit."""
    with log.open("w") as sink:
        # SIGINT at its default, as in a terminal: a shell starting pytest in the background ignores it, and a
        # child inherits that (Python then installs no KeyboardInterrupt for it).
        run = subprocess.Popen([sys.executable, "-m", "diffprep", *args], env=env, stdout=sink,
                               stderr=subprocess.STDOUT, start_new_session=True,
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        units = out / contract.STATE_DIR / contract.UNITS_DIR
        deadline = time.monotonic() + 300
        while not (units.is_dir() and any(units.glob("*.json"))):
            assert run.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        sent = time.monotonic()
        os.killpg(run.pid, signal.SIGINT)
        try:
            code = run.wait(timeout=120)
        finally:
            if run.poll() is None:
                os.killpg(run.pid, signal.SIGKILL)
                run.wait()
        return code, time.monotonic() - sent


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return write_demo_dataset(tmp_path_factory.mktemp("interrupt") / "data", samples=24)


def test_ctrl_c_ends_the_run_as_crashed_and_a_rerun_resumes(prefect_server, data, tiny_model, tmp_path, capsys):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.sorting import FlowRunSort
    from prefect.settings import PREFECT_API_URL

    out = tmp_path / "out"
    env = os.environ | {"PREFECT_API_URL": PREFECT_API_URL.value(), "PYTHONPATH": str(REPO)}
    code, seconds = _interrupt_once_units_run(_args(data, tiny_model, out), env, out, tmp_path / "log")
    printed = (tmp_path / "log").read_text()
    assert code == INTERRUPTED, printed
    assert seconds < EXIT_SECONDS, printed
    assert "run the same command again to resume" in printed and "httpx" not in printed
    with get_client(sync_client=True) as client:
        last = client.read_flow_runs(sort=FlowRunSort.START_TIME_DESC, limit=1)[0]
    assert last.state is not None and last.state.type.value in ("CRASHED", "CANCELLED"), last.state
    done = len(list((out / contract.STATE_DIR / contract.UNITS_DIR).glob("*.json")))
    assert 0 < done < 12

    capsys.readouterr()
    assert main(_args(data, tiny_model, out)) == 0  # resumes from the committed units
    printed = capsys.readouterr().out
    assert "samples written: 24" in printed and f"({12 - done} encoded this run)" in printed, printed
    assert "validation: passed" in printed


def test_ctrl_c_with_the_embedded_server_does_not_hang(data, tiny_model, tmp_path):
    env = {name: value for name, value in os.environ.items() if name != "PREFECT_API_URL"}
    env |= {"PYTHONPATH": str(REPO), "PREFECT_HOME": str(tmp_path / "prefect")}
    out = tmp_path / "out"
    code, seconds = _interrupt_once_units_run(_args(data, tiny_model, out), env, out, tmp_path / "log")
    printed = (tmp_path / "log").read_text()
    assert code == INTERRUPTED, printed
    assert seconds < EXIT_SECONDS, printed
    # The server outlived the signal long enough to record the run as crashed, and is gone with the command.
    assert "recorded as flow run" in printed and "(Crashed)" in printed and "httpx" not in printed, printed
    with sqlite3.connect(tmp_path / "prefect" / "prefect.db") as db:
        assert db.execute("select state_type from flow_run").fetchall() == [("CRASHED",)]
    port = int(re.search(r"embedded Prefect server starting on http://127\.0\.0\.1:(\d+)", printed).group(1))
    with socket.socket() as sock:
        assert sock.connect_ex(("127.0.0.1", port)) != 0, "the embedded server outlived the command"
    assert not list(out.glob("*.tmp")) and (out / contract.STATE_DIR / contract.PLAN_JSON).is_file()
