"""Crashes at any moment are fixed by re-running: SIGKILL at named points and at random times, a full disk,
a concurrent run, and the Prefect server going away mid-run."""

from __future__ import annotations

import errno
import hashlib
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import diffprep.flows.encode  # noqa: F401  (Prefect's log handler must bind to pytest's session stream)
from diffprep import contract
from diffprep.cli import main
from diffprep.tools.demo import write_demo_dataset
from diffprep.encodings.preencoded import preencoded_fields
from diffprep.run.units import DiskSpaceError, encode_unit
from diffprep.families.flux import FluxEncoders
from diffprep.run.failpoints import ENV as FAILPOINT_ENV
from diffprep.phases.fetch import fetch
from diffprep.media.images import ImageSpec
from diffprep.writer.plan import write_plan
from diffprep.writer.shards import ShardWriter, read_manifests

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def _args(data: Path, model: Path, out: Path, *extra: str) -> list[str]:
    return ["encode", "--source-type", "directory", "--input-dir", str(data), "--model-path", str(model),
            "--output-dir", str(out), "--shard-size", "4", "--batch-size", "2", "--precision", "fp32",
            "--image-size", "32", "--t5-max-length", "16", "--min-psnr", "0", "--train-split", "0.5", *extra]


def _snapshot(out: Path) -> dict[str, str]:
    """What must be identical to an uninterrupted run: shards, their manifests, Energon's counts and split."""
    files = sorted(out.glob("*.tar")) + sorted((out / contract.STATE_DIR / contract.UNITS_DIR).glob("*.json"))
    files += [out / contract.NV_META / contract.SPLIT_YAML, out / contract.NV_META / contract.INFO_JSON]
    return {str(p.relative_to(out)): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


def _leftovers(out: Path) -> list[str]:
    return sorted(str(p.relative_to(out)) for p in out.rglob("*")
                  if p.name.endswith(".tmp") or p.name.startswith("lock"))


def _env() -> dict[str, str]:
    from prefect.settings import PREFECT_API_URL

    return os.environ | {"PREFECT_API_URL": PREFECT_API_URL.value(), "PYTHONPATH": str(REPO)}


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return write_demo_dataset(tmp_path_factory.mktemp("crash") / "data", samples=12)


@pytest.fixture(scope="module")
def reference(prefect_server, data, tiny_model, tmp_path_factory) -> dict[str, str]:
    out = tmp_path_factory.mktemp("reference") / "out"
    assert main(_args(data, tiny_model, out)) == 0
    return _snapshot(out)


@pytest.mark.parametrize("point", ["decode", "encode@2", "shard-write@5", "before-manifest@2", "finalize"])
def test_killed_at_a_point_then_rerun_gives_the_same_dataset(point, prefect_server, data, tiny_model, reference,
                                                            tmp_path):
    out = tmp_path / "out"
    run = subprocess.run([sys.executable, "-m", "diffprep", *_args(data, tiny_model, out)],
                         env=_env() | {FAILPOINT_ENV: point}, capture_output=True, text=True, timeout=300)
    assert run.returncode == -signal.SIGKILL, run.stderr[-2000:]
    assert main(_args(data, tiny_model, out)) == 0
    assert _snapshot(out) == reference
    assert _leftovers(out) == []


def test_killed_at_random_moments(prefect_server, data, tiny_model, reference, tmp_path):
    rng = random.Random(7)
    out = tmp_path / "out"
    for _ in range(2):
        run = subprocess.Popen([sys.executable, "-m", "diffprep", *_args(data, tiny_model, out)], env=_env(),
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            run.wait(timeout=rng.uniform(4.0, 12.0))
        except subprocess.TimeoutExpired:
            run.send_signal(signal.SIGKILL)
            run.wait()
    assert main(_args(data, tiny_model, out)) == 0
    assert _snapshot(out) == reference
    assert _leftovers(out) == []


def test_a_second_run_on_the_same_output_is_refused(prefect_server, data, tiny_model, tmp_path, capsys):
    out = tmp_path / "out"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\nfrom diffprep.output import OutputLock\n"
         "OutputLock(sys.argv[1], run='other-run').acquire()\nprint('locked', flush=True)\ntime.sleep(120)", str(out)],
        stdout=subprocess.PIPE, text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        assert main(_args(data, tiny_model, out)) == 2
        err = capsys.readouterr().err
        assert f"pid {holder.pid}" in err and socket.gethostname() in err and "other-run" in err
        assert not list(out.glob("*.tar"))
    finally:
        holder.kill()
        holder.wait()
    assert main(_args(data, tiny_model, out)) == 0  # the dead holder's lock does not block


def test_disk_full_fails_the_unit_cleanly_and_a_rerun_completes(data, tiny_model, tmp_path, settings_for,
                                                                monkeypatch):
    out = tmp_path / "out"
    settings = settings_for(out, data, tiny_model)
    plan, source = fetch(settings, out)
    write_plan(out, plan)
    encoders = FluxEncoders.load(settings.model)
    spec = ImageSpec.from_config(settings.image)

    def encode(unit: int):
        return encode_unit(out, plan, unit, preencoded_fields(encoders), source, spec, batch_size=2, decode_workers=1)

    encode(0)
    real_write = ShardWriter.write

    def full_disk(self, key, fields):
        if self.unit == 1 and key.endswith("_000002"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(self, key, fields)

    monkeypatch.setattr(ShardWriter, "write", full_disk)
    with pytest.raises(DiskSpaceError) as info:
        encode(1)
    message = str(info.value)
    assert "unit 000001" in message and "free" in message and "re-run" in message
    assert sorted(read_manifests(out)) == [0]
    assert sorted(p.name for p in out.glob("*.tar")) == ["000000.tar"]
    assert _leftovers(out) == []

    monkeypatch.setattr(ShardWriter, "write", real_write)
    for unit in range(len(plan.units)):
        encode(unit)
    assert sorted(read_manifests(out)) == [0, 1, 2]


def test_prefect_server_going_away_mid_run_leaves_no_half_written_files(prefect_server, data, tiny_model,
                                                                         tmp_path, reference):
    home = tmp_path / "prefect-home"
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = os.environ | {"PREFECT_HOME": str(home), "PYTHONPATH": str(REPO)}
    server = subprocess.Popen([sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1",
                               "--port", str(port)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    out = tmp_path / "out"
    run = None
    try:
        url = f"http://127.0.0.1:{port}/api"
        deadline = time.monotonic() + 120
        import urllib.request

        while True:
            try:
                urllib.request.urlopen(f"{url}/health", timeout=2)
                break
            except OSError:
                assert time.monotonic() < deadline, "prefect server did not start"
                time.sleep(0.5)
        # One retry of a failed API call, not Prefect's default five with backoff: the server stays gone.
        run = subprocess.Popen([sys.executable, "-m", "diffprep", *_args(data, tiny_model, out)],
                               env=env | {"PREFECT_API_URL": url, "PREFECT_CLIENT_MAX_RETRIES": "1"},
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        while not read_manifests(out) and run.poll() is None:
            time.sleep(0.05)
        server.send_signal(signal.SIGKILL)
        server.wait()
        try:
            run.wait(timeout=120)
        except subprocess.TimeoutExpired:
            run.kill()
            run.wait()
    finally:
        for process in (server, run):
            if process is not None and process.poll() is None:
                process.kill()
                process.wait()
    # Whatever the run did without its server: every shard on disk is committed, nothing is half written.
    manifests = {m.shard: m for m in read_manifests(out).values()}
    for shard in out.glob("*.tar"):
        if shard.name in manifests:
            assert shard.stat().st_size == manifests[shard.name].bytes
    assert all(contract.STATE_DIR in p.relative_to(out).parts for p in out.rglob("*.tmp"))
    assert main(_args(data, tiny_model, out)) == 0
    assert _snapshot(out) == reference
    assert _leftovers(out) == []
