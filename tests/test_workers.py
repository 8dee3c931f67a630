"""Full encode across workers: one process per device, a killed worker, shard runs (SLURM arrays), fan-out to pools."""

from __future__ import annotations

import hashlib
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

import diffprep.flows.encode  # noqa: F401  (Prefect's log handler must bind to pytest's session stream)
from diffprep import contract
from diffprep.cli import main
from diffprep.tools.demo import write_demo_dataset
from diffprep.errors import ConfigError, LockedError
from diffprep.output import OutputLock
from diffprep.writer.shards import read_manifests, temp_pid
from diffprep.run.workers import cpu_workers_that_fit, parse_devices, split_chunks, units_for_shard

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def _args(data: Path, model: Path, out: Path, *extra: str) -> list[str]:
    return ["encode", "--source-type", "directory", "--input-dir", str(data), "--model-path", str(model),
            "--output-dir", str(out), "--shard-size", "4", "--batch-size", "4", "--precision", "fp32",
            "--image-size", "32", "--t5-max-length", "16", "--min-psnr", "0", "--no-finalize", *extra]


def _hashes(out: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(out.glob("*.tar"))}


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return write_demo_dataset(tmp_path_factory.mktemp("workers") / "data", samples=16)


@pytest.fixture(scope="module")
def reference(prefect_server, data, tiny_model, tmp_path_factory) -> dict[str, str]:
    """Shard hashes of an uninterrupted single-worker run."""
    out = tmp_path_factory.mktemp("reference") / "out"
    assert main(_args(data, tiny_model, out)) == 0
    hashes = _hashes(out)
    assert len(hashes) == 4
    return hashes


def test_device_specs():
    assert parse_devices("cpu:3") == ["cpu", "cpu", "cpu"]
    assert parse_devices("0, 2") == ["cuda:0", "cuda:2"]
    with pytest.raises(ConfigError, match="twice"):
        parse_devices("1,1")
    with pytest.raises(ConfigError, match="cpu:N"):
        parse_devices("gpu0")
    assert units_for_shard(range(7), 3, 2) == [2, 5]
    assert split_chunks([0, 1, 2, 3, 4], 2) == [[0, 2, 4], [1, 3]]
    # CPU workers beside a CPU parent: as many as the cores hold at the planned threads, never one that only shares
    assert cpu_workers_that_fit(1, threads=2, cores=2, parent_on_cpu=True) == 0
    assert cpu_workers_that_fit(1, threads=1, cores=2, parent_on_cpu=True) == 1
    assert cpu_workers_that_fit(3, threads=4, cores=16, parent_on_cpu=True) == 3
    assert cpu_workers_that_fit(2, threads=8, cores=16, parent_on_cpu=False) == 2
    assert cpu_workers_that_fit(2, threads=32, cores=16, parent_on_cpu=False) == 1


def test_two_cpu_workers_write_the_same_bytes_as_one(prefect_server, data, tiny_model, reference, tmp_path):
    out = tmp_path / "out"
    assert main(_args(data, tiny_model, out, "--devices", "cpu:2")) == 0
    assert _hashes(out) == reference


def test_two_cpu_workers_of_a_terminal_run_share_its_units_and_are_recorded_once(prefect_server, data, tiny_model,
                                                                                  tmp_path):
    """Issue 35: ``diffprep encode --devices cpu:2`` as a user types it (no PREFECT_API_URL, a fresh PREFECT_HOME)
    is a recorded run (flows/recorded.py): the command's own process encodes units at once with the encoders the
    sanity check loaded, one worker process loads its own and takes units once ready (diffprep/run/pool.py; on
    this tiny set it may still be loading at the end, and is ended). One Prefect server, the run's own, started
    beside it (before: the live flow waited for it; before that, each worker started one more). The shards are a
    one-worker run's; every unit is one task run of the recorded flow run, naming the process that encoded it.
    One encoder thread per process, so that two CPU processes fit any machine of 2 cores or more
    (``cpu_workers_that_fit``)."""
    home = tmp_path / "prefect"
    env = {name: value for name, value in os.environ.items() if name not in ("PREFECT_API_URL", "DIFFPREP_LIVE_FLOW")}
    env |= {"PYTHONPATH": os.pathsep.join(filter(None, (str(REPO), os.environ.get("PYTHONPATH")))),
            "PREFECT_HOME": str(home)}
    out = tmp_path / "out"
    one = tmp_path / "one"
    assert main(_args(data, tiny_model, one, "--encoder-threads", "1")) == 0
    done = subprocess.run([sys.executable, "-m", "diffprep", *_args(data, tiny_model, out, "--devices", "cpu:2",
                                                                     "--encoder-threads", "1")],
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    printed = done.stderr
    servers = printed.count("Starting temporary server") + printed.count("embedded Prefect server starting")
    assert servers == 1, f"{servers} Prefect servers started:\n{printed}"
    assert "recorded as flow run" in printed and "(Completed)" in printed, printed
    here = re.search(r"this process \((\S+/cpu)\) and 1 worker process", printed).group(1)
    worker = re.search(r"worker (\S+/cpu) loading its encoders", printed).group(1)
    by = dict(re.findall(r"unit (\d{6}) done \(\d/4\) by (\S+):", printed))
    assert sorted(by) == [f"{u:06d}" for u in range(4)], printed  # each unit once, with who encoded it
    assert set(by.values()) <= {here, worker} and here in by.values(), printed
    assert _hashes(out) == _hashes(one)

    # Each unit one task run of the run, naming its process; the unit's lines are the run's, whoever wrote them.
    with sqlite3.connect(home / "prefect.db") as db:
        (run_id,) = db.execute("select id from flow_run").fetchone()
        units = db.execute("select t.name, t.state_type, s.message from task_run t join task_run_state s "
                           "on s.id = t.state_id where t.flow_run_id = ? and t.name like 'encode-unit-%' "
                           "order by t.name", (run_id,)).fetchall()
        logs = [m for (m,) in db.execute("select message from log where flow_run_id = ?", (run_id,))]
    assert [(name, state) for name, state, _ in units] == [(f"encode-unit-{u:06d}", "COMPLETED") for u in range(4)]
    assert [message.split(" at ")[0] for _, _, message in units] == [f"ran on {by[f'{u:06d}']}" for u in range(4)]
    assert all(any(line.startswith(f"unit {u:06d}: 4 written") for line in logs) for u in range(4))
    assert not any(line.startswith("Traceback") for line in printed.splitlines()), printed


def test_ctrl_c_on_a_terminal_devices_run_ends_its_workers_and_records_it_crashed(data, tiny_model, tmp_path):
    """Ctrl-C to the whole process group of ``diffprep encode --devices cpu:2`` (no server) once a unit is
    committed: the workers ignore it and the command ends them (a worker is started with SIGINT ignored, so one
    still importing prints no traceback); the run is recorded as crashed on its embedded server."""
    home = tmp_path / "prefect"
    env = {name: value for name, value in os.environ.items() if name not in ("PREFECT_API_URL", "DIFFPREP_LIVE_FLOW")}
    env |= {"PYTHONPATH": os.pathsep.join(filter(None, (str(REPO), os.environ.get("PYTHONPATH")))),
            "PREFECT_HOME": str(home)}
    out = tmp_path / "out"
    slow = write_demo_dataset(tmp_path / "slow", samples=16)
    args = _args(slow, tiny_model, out, "--devices", "cpu:2", "--image-size", "256", "--batch-size", "1",
                 "--encoder-threads", "1")  # two CPU processes fit 2 cores (cpu_workers_that_fit)
    printed = tmp_path / "log"
    with printed.open("w") as sink:
        run = subprocess.Popen([sys.executable, "-m", "diffprep", *args], env=env, stdout=sink,
                               stderr=subprocess.STDOUT, start_new_session=True,
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        try:
            units = out / contract.STATE_DIR / contract.UNITS_DIR
            deadline = time.monotonic() + 300
            while not (units.is_dir() and any(units.glob("*.json"))):
                assert run.poll() is None, printed.read_text()
                assert time.monotonic() < deadline, printed.read_text()
                time.sleep(0.05)
            os.killpg(run.pid, signal.SIGINT)
            code = run.wait(timeout=120)
        finally:
            if run.poll() is None:
                os.killpg(run.pid, signal.SIGKILL)
                run.wait()
    text = printed.read_text()
    assert code != 0 and "recorded as flow run" in text and "(Crashed)" in text, text
    assert "Traceback" not in text, text
    (worker,) = re.findall(r"worker \S+:(\d+)/cpu loading its encoders", text)
    with pytest.raises(ProcessLookupError):
        os.kill(int(worker), 0)  # gone with the command
    with sqlite3.connect(home / "prefect.db") as db:
        assert db.execute("select state_type from flow_run").fetchall() == [("CRASHED",)]


def test_killed_worker_then_rerun_with_another_worker_count(prefect_server, data, tiny_model, reference, tmp_path):
    """SIGKILL a worker while it writes a shard; the re-run with one worker completes the same dataset."""
    from prefect.settings import PREFECT_API_URL

    out = tmp_path / "out"
    tmp_dir = out / contract.STATE_DIR / contract.TMP_DIR
    # Workers that look for runs every second: each takes one of the two chunks (--limit 1).
    env = os.environ | {"PREFECT_API_URL": PREFECT_API_URL.value(), "PYTHONPATH": str(REPO),
                        "PREFECT_WORKER_QUERY_SECONDS": "1"}
    # Slow every unit down enough to catch a worker in the middle of one: big images, 2 per batch.
    slow = write_demo_dataset(tmp_path / "slow", samples=16)
    slow_args = _args(slow, tiny_model, out, "--devices", "cpu:2", "--image-size", "256", "--batch-size", "1")
    run = subprocess.Popen([sys.executable, "-m", "diffprep", *slow_args], env=env,
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    killed = None
    try:
        deadline = time.monotonic() + 240
        while killed is None and time.monotonic() < deadline and run.poll() is None:
            for temp in tmp_dir.glob("*.tar.*.tmp") if tmp_dir.is_dir() else []:
                pid = temp_pid(temp.name, socket.gethostname())
                os.kill(pid, signal.SIGKILL)
                killed = temp.name
                break
            time.sleep(0.005)
        assert killed is not None, "no worker was caught writing a shard"
        assert run.wait(timeout=240) != 0
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
    manifests = read_manifests(out)
    assert len(manifests) < 4
    assert (tmp_dir / killed).exists()  # the dead writer's temporary file, never committed

    # Same settings as the reference from here on: re-run over the first output with one worker.
    ref_out = tmp_path / "ref"
    assert main(_args(slow, tiny_model, ref_out, "--image-size", "256", "--batch-size", "1")) == 0
    assert main(_args(slow, tiny_model, out, "--image-size", "256", "--batch-size", "1")) == 0
    assert _hashes(out) == _hashes(ref_out)
    assert list(tmp_dir.iterdir()) == []
    assert sorted(m.shard for m in read_manifests(out).values()) == sorted(p.name for p in out.glob("*.tar"))
    counts = [m.count for m in read_manifests(out).values()]
    assert sum(counts) == 16


def test_slurm_array_tasks_then_a_plain_run_finalizes(prefect_server, data, tiny_model, reference, tmp_path, capsys,
                                                      monkeypatch):
    """``sbatch --array=5-6`` then a dependent plain job (configs/slurm-encode-array.sbatch): each task is a shard
    run from its array variables; the plain run audits, finalizes and validates, with a single run's bytes."""
    out = tmp_path / "out"
    monkeypatch.setenv("SLURM_JOB_ID", "4243")
    for task, units in ((6, [1, 3]), (5, [0, 1, 2, 3])):  # the second task to start is task 0
        with monkeypatch.context() as array:
            for name, value in (("SLURM_ARRAY_TASK_ID", task), ("SLURM_ARRAY_TASK_MIN", 5),
                                ("SLURM_ARRAY_TASK_COUNT", 2), ("SLURM_PROCID", 0), ("SLURM_NTASKS", 1)):
                array.setenv(name, str(value))
            assert main(_args(data, tiny_model, out)) == 0
        assert f"shard {task - 5}/2" in capsys.readouterr().out
        assert sorted(read_manifests(out)) == units
    args = [a for a in _args(data, tiny_model, out) if a != "--no-finalize"]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "0 encoded this run" in printed and "validation: passed" in printed
    assert _hashes(out) == reference



def test_plain_run_and_shard_runs_exclude_each_other(tmp_path):
    with OutputLock(tmp_path, shard=3):
        with pytest.raises(LockedError, match="--shard-index run"):
            OutputLock(tmp_path).acquire()
        with OutputLock(tmp_path, shard=4):  # shard runs share the output
            pass
    with OutputLock(tmp_path):
        with pytest.raises(LockedError, match="plain run"):
            OutputLock(tmp_path, shard=0).acquire()


def test_fan_out_to_two_pool_workers(prefect_server, data, tiny_model, reference, tmp_path):
    """The parent flow sends chunks to the encode-units deployment; two process workers on one pool run them."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.settings import PREFECT_API_URL

    from diffprep.flows.encode_units import encode_units

    pool = "diffprep-fanout-test"
    with get_client(sync_client=True) as client:
        client.create_work_pool(WorkPoolCreate(name=pool, type="process"), overwrite=True)
    encode_units.from_source(source=str(REPO), entrypoint="flows/encode_units.py:encode_units").deploy(
        name="encode-units", work_pool_name=pool, print_next_steps=False
    )
    # Workers that look for runs every second: each takes one of the two chunks (--limit 1).
    env = os.environ | {"PREFECT_API_URL": PREFECT_API_URL.value(), "PYTHONPATH": str(REPO),
                        "PREFECT_WORKER_QUERY_SECONDS": "1"}
    workers = [
        subprocess.Popen([sys.executable, "-m", "prefect", "worker", "start", "--pool", pool, "--limit", "1",
                          "--name", f"test-worker-{i}"], env=env, cwd=REPO,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for i in range(2)
    ]
    try:
        out = tmp_path / "out"
        assert main(_args(data, tiny_model, out, "--encode-deployment", "encode-units/encode-units",
                          "--chunks", "2")) == 0
        assert _hashes(out) == reference
        with get_client(sync_client=True) as client:
            deployment = client.read_deployment_by_name("encode-units/encode-units")
            runs = [r for r in client.read_flow_runs() if r.deployment_id == deployment.id
                    and r.parameters["output"]["location"] == str(out.resolve())]
        # This run's two chunks, each completed, each by its own worker, together exactly the plan's units.
        assert len(runs) == 2 and all(r.state is not None and r.state.is_completed() for r in runs)
        assert sorted(r.labels.get("prefect.worker.name") for r in runs) == ["test-worker-0", "test-worker-1"]
        units = sorted(u for r in runs for u in r.parameters["units"])
        assert units == sorted(read_manifests(out))
    finally:
        for worker in workers:
            worker.terminate()
        for worker in workers:
            try:
                worker.wait(timeout=30)
            except subprocess.TimeoutExpired:
                worker.kill()
                worker.wait()
