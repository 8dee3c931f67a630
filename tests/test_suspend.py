"""A question asked with ``release=True`` suspends a deployment run: no process waits, the answer resumes it.

A real process worker (``prefect worker start --run-once``) runs a deployment
of tests/suspend_flow.py from this checkout's prefect.yaml: the run commits its
units, asks, and is Suspended with the worker and the run's process gone.
Resumed with an answer, a second worker runs the flow again from the top: it
finds every unit committed, gets the stored answer without suspending again,
and completes. Without a deployment the same call pauses in-process.

The last test runs encode-dataset itself from prefect.yaml on data with a
rejected sample: suspended on its rejects question, resumed, it completes
without writing any shard or manifest again.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

# Prefect's console log handler keeps the stream it finds when prefect is first imported (see test_deploy.py).
import diffprep.flows.validate  # noqa: F401

from prefect_cli import REPO, Process, run, shell_env, wait_for_state

POOL = "diffprep-suspend-test"
DEPLOYMENT = "diffprep-suspend-test/suspend-test"
ENCODE_POOL = "diffprep-gpu"  # prefect.yaml's
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def env(prefect_server, tmp_path_factory) -> dict[str, str]:
    from prefect.settings import PREFECT_API_URL

    env = shell_env(PREFECT_API_URL.value(), tmp_path_factory.mktemp("prefect-home"))
    # As prefect.yaml's job variables do: the approvals' log lines reach the run log.
    return env | {"PREFECT_LOGGING_EXTRA_LOGGERS": "diffprep"}


@pytest.fixture(scope="module")
def deployed(env) -> None:
    run(["prefect", "work-pool", "create", POOL, "--type", "process"], env)
    run(["prefect", "--no-prompt", "deploy", "tests/suspend_flow.py:units_then_question", "--name", "suspend-test",
         "--pool", POOL, "--tag", "diffprep"], env, cwd=REPO)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _messages(flow_run_id) -> list[str]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    with get_client(sync_client=True) as client:
        logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])))
    return [log.message for log in logs]


def _worker(env: dict[str, str], cwd: Path, name: str, pool: str = POOL) -> Process:
    return Process(["prefect", "worker", "start", "--pool", pool, "--run-once"], env, cwd, cwd / f"{name}.log")


def test_a_deployment_run_suspends_without_a_process_and_resumes_without_redoing_units(deployed, env, tmp_path):
    from prefect.client.orchestration import get_client
    from prefect.deployments import run_deployment
    from prefect.flow_runs import resume_flow_run

    work = tmp_path / "work"
    work.mkdir()
    flow_run = run_deployment(name=DEPLOYMENT, parameters={"work_dir": str(work)}, timeout=0)

    first = _worker(env, tmp_path, "worker-1")
    try:
        suspended = wait_for_state(flow_run.id, lambda state: state.is_paused(), 180, first)
        first.popen.wait(timeout=120)  # --run-once: the worker exits once its run's process has
        assert first.popen.returncode == 0, first.tail()
    finally:
        first.stop()
    [pid] = (work / "attempts").read_text().split()
    assert not _alive(int(pid)), "the suspended run's process is still running"
    assert (work / "encoded").read_text().split() == ["0", "1", "2"]
    assert not (work / "answer").exists()

    details = suspended.state.state_details
    assert suspended.state.name == "Suspended" and details.pause_reschedule and details.pause_key == "rejects"
    time.sleep(2)  # nothing is left to change it: still Suspended, not Crashed
    with get_client(sync_client=True) as client:
        assert client.read_flow_run(flow_run.id).state.name == "Suspended"
        # The UI's Resume form: the question's Markdown is stored with the run.
        description = json.loads(client.read_flow_run_input(flow_run.id, details.run_input_keyset["description"]))
    assert "corrupt image" in description

    with pytest.raises(RuntimeError, match="Cannot resume"):
        resume_flow_run(flow_run.id, run_input={"answer": "maybe"})  # not a choice: refused, still suspended
    resume_flow_run(flow_run.id, run_input={"answer": "accept"})

    second = _worker(env, tmp_path, "worker-2")
    try:
        finished = wait_for_state(flow_run.id, lambda state: state.is_final(), 180, second)
        second.popen.wait(timeout=120)
    finally:
        second.stop()
    assert finished.state.is_completed(), f"{finished.state!r}:\n{second.tail()}"
    attempts = (work / "attempts").read_text().split()
    assert len(attempts) == 2 and attempts[0] != attempts[1]  # run again from the top, in a new process
    assert (work / "encoded").read_text().split() == ["0", "1", "2"]  # no unit encoded twice
    assert (work / "answer").read_text() == "accept"
    messages = _messages(flow_run.id)
    assert sum("suspending the run" in m for m in messages) == 1, messages
    assert any("asked before this run was resumed" in m for m in messages), messages


def test_a_run_without_a_deployment_pauses_in_its_process(prefect_server, tmp_path):
    """``diffprep encode`` against a server: no deployment to reschedule, so the run pauses and keeps its process."""
    import threading

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName
    from prefect.flow_runs import resume_flow_run

    from suspend_flow import units_then_question

    name = f"pause-{tmp_path.name}"
    results: list = []
    thread = threading.Thread(target=lambda: results.append(units_then_question.with_options(flow_run_name=name)(
        str(tmp_path), timeout=120)), daemon=True)
    thread.start()
    deadline = time.monotonic() + 120
    with get_client(sync_client=True) as client:
        while True:
            runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=[name])))
            if runs and runs[0].state.is_paused() and runs[0].state.state_details.run_input_keyset:
                try:  # the form is saved a moment after the state
                    client.read_flow_run_input(runs[0].id, runs[0].state.state_details.run_input_keyset["schema"])
                    break
                except Exception:  # noqa: BLE001 - not saved yet
                    pass
            assert thread.is_alive() and time.monotonic() < deadline, f"no pause: {results}"
            time.sleep(0.5)
    assert runs[0].state.name == "Paused" and not runs[0].state.state_details.pause_reschedule
    resume_flow_run(runs[0].id, run_input={"answer": "accept"})
    thread.join(60)
    assert results == ["accept"]
    assert (tmp_path / "attempts").read_text().split() == [str(os.getpid())]


# --- encode-dataset itself: suspended on its rejected-samples question ------------------------------------


@pytest.fixture(scope="module")
def encode_deployed(env) -> None:
    """prefect.yaml's deployments on its process pool (created here unless another module already did)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate

    with get_client(sync_client=True) as client:
        client.create_work_pool(WorkPoolCreate(name=ENCODE_POOL, type="process"), overwrite=True)
    run(["prefect", "--no-prompt", "deploy", "--all"], env, cwd=REPO)


def _committed(out: Path) -> dict[str, tuple[int, int]]:
    """Every shard and unit manifest -> (inode, mtime): a file written again (atomically) changes both."""
    return {str(p.relative_to(out)): (p.stat().st_ino, p.stat().st_mtime_ns)
            for p in sorted(out.rglob("*")) if p.is_file() and (p.suffix == ".tar" or "manifest" in str(p))}


def test_encode_dataset_suspends_on_rejects_and_finishes_without_encoding_again(encode_deployed, env, tiny_model,
                                                                                tmp_path):
    from prefect.deployments import run_deployment
    from prefect.flow_runs import resume_flow_run

    from diffprep.tools.demo import write_demo_dataset
    from diffprep.validation import validate_dataset

    data = write_demo_dataset(tmp_path / "demo", samples=8)
    (data / "images" / "broken.jpg").write_bytes(b"this is not a jpeg")
    (data / "captions" / "broken.txt").write_text("a broken file")
    out = tmp_path / "out"
    flow_run = run_deployment(name="encode-dataset/default", timeout=0, parameters={"parameters": {
        "source": {"type": "directory", "input_dir": str(data)},
        "output": {"output_dir": str(out), "shard_size": 4, "approval_timeout": 300},
        "model": {"model_path": str(tiny_model), "precision": "fp32", "t5_max_length": 16, "device": "cpu",
                  "batch_size": 4, "min_psnr": 0.0},  # the tiny VAE cannot reconstruct images
        "image": {"image_size": 32, "decode_workers": 1},
    }})
    first = _worker(env, tmp_path, "worker-1", ENCODE_POOL)
    try:
        waiting = wait_for_state(flow_run.id, lambda state: state.is_paused() or state.is_final(), 300, first)
        assert waiting.state.state_details.pause_key == "rejected-samples", f"{waiting.state!r}:\n{first.tail()}"
        if waiting.state.name != "Suspended":  # paused in its process: answer so that nothing is left waiting
            time.sleep(3)
            resume_flow_run(flow_run.id, run_input={"answer": "abort"})
        first.popen.wait(timeout=120)
    finally:
        first.stop()
    assert waiting.state.name == "Suspended", "the run waits in its process (Paused), holding it"
    assert first.popen.returncode == 0, first.tail()
    committed = _committed(out)
    assert any(name.endswith(".tar") for name in committed), committed

    resume_flow_run(flow_run.id, run_input={"answer": "accept"})
    second = _worker(env, tmp_path, "worker-2", ENCODE_POOL)
    try:
        finished = wait_for_state(flow_run.id, lambda state: state.is_final(), 300, second)
        second.popen.wait(timeout=120)
    finally:
        second.stop()
    assert finished.state.is_completed(), f"{finished.state!r}:\n{second.tail()}"
    assert _committed(out) == committed  # not one shard or manifest written again
    messages = _messages(flow_run.id)
    assert any("every unit is already encoded with these settings: nothing to encode" in m for m in messages), messages
    assert validate_dataset(out).ok
