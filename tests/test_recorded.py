"""A terminal run without a Prefect server (flows/recorded.py): the pipeline runs Prefect-free and is recorded
afterwards on the embedded server, as the flow run the flow would have made.

The command runs as a user starts it (a subprocess, no PREFECT_API_URL, a fresh PREFECT_HOME); what it recorded
is read from that home's database after the command and its server have exited.
"""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from diffprep import contract
from diffprep.flows.record_write import TaskRecord, folded
from diffprep.tools.demo import write_demo_dataset

REPO = Path(__file__).resolve().parents[1]


def _env(home: Path) -> dict[str, str]:
    env = {name: value for name, value in os.environ.items() if name not in ("PREFECT_API_URL", "DIFFPREP_LIVE_FLOW")}
    return env | {"PYTHONPATH": str(REPO), "PREFECT_HOME": str(home)}


def _encode(data: Path, model: Path, out: Path, home: Path, *extra: str,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    args = ["encode", "--source-type", "directory", "--input-dir", str(data), "--model-path", str(model),
            "--output-dir", str(out), "--shard-size", "4", "--batch-size", "2", "--precision", "fp32",
            "--image-size", "64", "--t5-max-length", "16", *extra]
    return subprocess.run([sys.executable, "-m", "diffprep", *args], env=_env(home) | (env or {}),
                          capture_output=True, text=True, timeout=600)


def _recorded(home: Path) -> dict:
    """The last flow run in ``home``'s database: its flow, state, parameters, task runs, artifacts and log lines."""
    with sqlite3.connect(home / "prefect.db") as db:
        run_id, name, flow, state, parameters, tags = db.execute(
            "select r.id, r.name, f.name, r.state_type, r.parameters, r.tags from flow_run r join flow f "
            "on f.id = r.flow_id order by r.created desc limit 1").fetchone()
        message = db.execute("select s.message from flow_run r join flow_run_state s on s.id = r.state_id "
                             "where r.id = ?", (run_id,)).fetchone()[0]
        tasks = db.execute("select t.name, t.state_type, s.message from task_run t join task_run_state s "
                           "on s.id = t.state_id where t.flow_run_id = ? order by t.created", (run_id,)).fetchall()
        artifacts = {key: kind for key, kind in db.execute(
            "select key, type from artifact where flow_run_id = ?", (run_id,))}
        logs = [m for (m,) in db.execute("select message from log where flow_run_id = ?", (run_id,))]
    return {"name": name, "flow": flow, "state": state, "message": message, "parameters": json.loads(parameters),
            "tags": json.loads(tags), "tasks": tasks, "artifacts": artifacts, "logs": logs}


@pytest.mark.slow
def test_a_run_without_a_server_is_recorded_as_the_flow_run_with_its_tasks_artifacts_and_logs(tiny_model, tmp_path):
    data = write_demo_dataset(tmp_path / "data", samples=12)
    home = tmp_path / "prefect"
    # Past DIFFPREP_RECORD_UNITS units (here 1 of 3), the rest are one task run: the record stays bounded.
    done = _encode(data, tiny_model, tmp_path / "out", home, "--min-psnr", "0", env={"DIFFPREP_RECORD_UNITS": "1"})
    assert done.returncode == 0, done.stderr
    assert "samples written: 12" in done.stdout and "validation: passed" in done.stdout
    assert "recorded as flow run" in done.stderr and "not recorded" not in done.stderr, done.stderr

    run = _recorded(home)
    assert (run["flow"], run["state"], run["tags"]) == ("encode-dataset", "COMPLETED", ["recorded"])
    assert run["message"].startswith("ran without a server at ")
    given = run["parameters"]["parameters"]
    assert given["source"] == {"type": "directory", "input_dir": str(data)}  # the parameters the command gave
    assert [(name, state) for name, state, _ in run["tasks"]] == [
        ("fetch", "COMPLETED"), ("verify-existing", "COMPLETED"), ("prepare-output", "COMPLETED"),
        ("sanity", "COMPLETED"), ("encode-unit-000000", "COMPLETED"),
        ("encode-unit-000001..000002 (2 units, one task run: DIFFPREP_RECORD_UNITS=1)", "COMPLETED"),
        ("audit", "COMPLETED"), ("finalize", "COMPLETED"), ("validate", "COMPLETED")]
    assert all(message.startswith("ran at ") for _, _, message in run["tasks"])
    assert run["artifacts"] == {"plan-out": "table", "sanity-out": "markdown", "progress-out": "progress",
                                "audit-out": "table", "output-out": "markdown"}
    assert any(line.startswith("planned 12 samples in 3 units") for line in run["logs"])
    assert any(line.startswith("unit 000002: 4 written") for line in run["logs"])


@pytest.mark.slow
def test_a_failed_run_is_recorded_failed_with_its_error_and_the_phase_it_failed_in(tiny_model, tmp_path):
    data = write_demo_dataset(tmp_path / "data", samples=4)
    home = tmp_path / "prefect"
    # Random tiny weights decode far below 99 dB: the sanity check fails before any unit.
    done = _encode(data, tiny_model, tmp_path / "out", home, "--min-psnr", "99")
    assert done.returncode != 0
    run = _recorded(home)
    assert run["state"] == "FAILED" and "PSNR" in run["message"], run["message"]
    assert [(name, state) for name, state, _ in run["tasks"]][-1] == ("sanity", "FAILED")
    assert not list((tmp_path / "out" / contract.STATE_DIR / contract.UNITS_DIR).glob("*.json"))


def test_retried_retries_transient_errors_only(monkeypatch) -> None:
    from diffprep.flows import recorded

    monkeypatch.setattr(recorded.time, "sleep", lambda seconds: None)
    calls = []

    def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise ConnectionError("reset by peer")
        return "done"

    assert recorded.retried(flaky, "fetch", (5, 30)) == "done" and len(calls) == 3
    calls.clear()
    with pytest.raises(ConnectionError):
        recorded.retried(flaky, "fetch", (5,))  # two failures, one retry
    calls.clear()

    def bad_setting():
        calls.append(1)
        raise ValueError("a bad setting stays bad")

    with pytest.raises(ValueError):
        recorded.retried(bad_setting, "fetch", (5, 30))
    assert len(calls) == 1


def test_a_run_is_recorded_only_where_no_server_or_api_is_needed(monkeypatch, settings_for, tmp_path) -> None:
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from diffprep.flows.recorded import LIVE_FLOW_ENV, wanted

    settings = settings_for(tmp_path / "out", tmp_path / "in", tmp_path / "model")
    with temporary_settings(updates={PREFECT_API_URL: None}):
        assert wanted(settings)
        monkeypatch.setenv(LIVE_FLOW_ENV, "1")
        assert not wanted(settings)  # the flow on the embedded server, as before
        monkeypatch.delenv(LIVE_FLOW_ENV)
        settings.auth.hf_credentials_block = "hf"  # a block is loaded through the API
        assert not wanted(settings)
        settings.auth.hf_credentials_block = None
        settings.workers.devices = "cuda:0,cuda:1"  # shared here (diffprep.run.pool), no API needed
        assert wanted(settings)
        settings.workers.deployment = "encode-units/encode-units"  # run_deployment needs the API
        assert not wanted(settings)
    with temporary_settings(updates={PREFECT_API_URL: "http://127.0.0.1:4200/api"}):
        assert not wanted(settings_for(tmp_path / "out", tmp_path / "in", tmp_path / "model"))  # a server someone can open: the live flow, with its UI questions


def _task(name: str, started: float, error: BaseException | None = None, worker: str = "") -> TaskRecord:
    return TaskRecord("encode-unit" if name.startswith("encode-unit") else name, name, started, started + 1, error,
                      worker)


def test_units_past_the_limit_are_one_task_run_and_failed_units_keep_theirs() -> None:
    phases = [_task("fetch", 0), _task("sanity", 1)]
    units = [_task(f"encode-unit-{u:06d}", 2 + u, RuntimeError("x") if u == 7 else None, f"w{u % 2}")
             for u in range(10)]
    tasks, where = folded(phases + units + [_task("audit", 20)], limit=3)
    assert [t.name for t in tasks] == [
        "fetch", "sanity", "encode-unit-000000", "encode-unit-000001", "encode-unit-000002",
        "encode-unit-000003..000009 (6 units, one task run: DIFFPREP_RECORD_UNITS=3)", "encode-unit-000007", "audit"]
    summary = tasks[5]
    assert (summary.started, summary.ended, summary.worker, summary.error) == (5, 12, "w0, w1", None)
    assert where[2 + 3] == where[2 + 9] == 5 and where[2 + 7] == 6 and where[-1] == 7  # log lines follow their task
    assert folded(phases + units, limit=10) == (phases + units, list(range(12)))
