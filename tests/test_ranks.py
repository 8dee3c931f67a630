"""torchrun and SLURM: N ranks share the units of one run, rank 0 audits, finalizes and validates.

Real launches on the CPU: ``torchrun --nproc_per_node=N --no-python diffprep
encode ...`` and two processes with an srun step's variables, talking through
torch.distributed (gloo) on loopback. Torch's CPU kernels sum in an order
that depends on the thread count, and torchrun gives each rank one thread
(``OMP_NUM_THREADS=1``), so the single-process reference runs with one thread
too: the same settings and threads give the same bytes whatever the number of
ranks.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from diffprep import contract
from diffprep.demo import write_demo_dataset
from diffprep.errors import ConfigError
from diffprep.launch import Ranks, array_shard, detect_ranks, my_units, rank_device
from diffprep.shards import read_manifests

DIFFPREP = shutil.which("diffprep", path=os.path.dirname(sys.executable))
TORCHRUN = shutil.which("torchrun", path=os.path.dirname(sys.executable))
TIMEOUT = 300


# --- which rank am I ------------------------------------------------------------------------------------------------


def test_ranks_from_torchrun_and_srun_variables() -> None:
    assert detect_ranks({}) == Ranks(0, 1, 0, "single")
    assert detect_ranks({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1"}) == Ranks(3, 8, 1, "torchrun")
    assert detect_ranks({"SLURM_PROCID": "5", "SLURM_NTASKS": "6", "SLURM_LOCALID": "2"}) == Ranks(5, 6, 2, "slurm")
    # An array task is a job of its own, not a rank: it becomes a manual shard.
    array = {"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_ARRAY_TASK_ID": "7", "SLURM_ARRAY_TASK_COUNT": "4",
             "SLURM_ARRAY_TASK_MIN": "5"}
    assert detect_ranks(array) == Ranks(0, 1, 0, "single")
    assert array_shard(array) == (4, 2) and array_shard({}) is None
    with pytest.raises(ConfigError, match="rank 4 of 4"):
        detect_ranks({"RANK": "4", "WORLD_SIZE": "4"})
    with pytest.raises(ConfigError, match="'x' is not a number"):
        detect_ranks({"RANK": "x", "WORLD_SIZE": "4"})


def test_units_and_devices_per_rank() -> None:
    ranks = Ranks(1, 3, 1, "torchrun")
    assert my_units([0, 1, 2, 3, 4, 7], ranks) == [1, 4, 7]
    assert rank_device("cuda:0", ranks) == "cuda:0"  # an explicit device stays
    assert rank_device("auto", ranks) == "cpu"  # no GPU here: a CPU process per rank


# --- real launches ---------------------------------------------------------------------------------------------------


def _args(data: Path, model: Path, out: Path, *extra: str) -> list[str]:
    return ["encode", "--source-type", "directory", "--input-dir", str(data), "--model-path", str(model),
            "--output-dir", str(out), "--shard-size", "4", "--batch-size", "4", "--precision", "fp32",
            "--image-size", "32", "--t5-max-length", "16", "--min-psnr", "0", "--decode-workers", "1", *extra]


def _hashes(out: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(out.glob("*.tar"))}


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_",
                                                                         "MASTER_", "DIFFPREP_"))}
    return env | {"OMP_NUM_THREADS": "1"} | extra


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _torchrun(ranks: int, args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    command = [TORCHRUN, "--nproc_per_node", str(ranks), "--master_addr", "127.0.0.1", "--master_port",
               str(_free_port()), "--no-python", *args]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=TIMEOUT)


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return write_demo_dataset(tmp_path_factory.mktemp("ranks") / "data", samples=20)  # 5 units of 4


@pytest.fixture(scope="module")
def reference(prefect_server, data, tiny_model, tmp_path_factory) -> dict[str, str]:
    """Shard hashes of one process with one thread, as each rank has."""
    out = tmp_path_factory.mktemp("reference") / "out"
    done = subprocess.run([DIFFPREP, *_args(data, tiny_model, out, "--no-finalize")], env=_env(),
                          capture_output=True, text=True, timeout=TIMEOUT)
    assert done.returncode == 0, done.stdout + done.stderr
    hashes = _hashes(out)
    assert len(hashes) == 5
    return hashes


@pytest.mark.slow
def test_torchrun_two_ranks_encode_finalize_and_validate_in_one_command(prefect_server, data, tiny_model, reference,
                                                                        tmp_path) -> None:
    out = tmp_path / "out"
    done = _torchrun(2, [DIFFPREP, *_args(data, tiny_model, out)], _env())
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert _hashes(out) == reference
    assert "rank 1: encoded units 000001, 000003" in done.stdout
    assert "validation: passed" in done.stdout and "samples written: 20" in done.stdout
    assert (out / contract.NV_META / contract.INFO_JSON).is_file()


@pytest.mark.slow
def test_a_killed_rank_stops_the_run_and_any_number_of_ranks_finishes_it(prefect_server, data, tiny_model,
                                                                         reference, tmp_path) -> None:
    out = tmp_path / "out"
    # Rank 1 is killed while it writes its second unit (000003), after committing 000001.
    script = (f'if [ "$RANK" = 1 ]; then export DIFFPREP_FAILPOINT=shard-write@6; fi; '
              f'exec "{DIFFPREP}" "$@"')
    done = _torchrun(2, ["sh", "-c", script, "sh", *_args(data, tiny_model, out)], _env())
    assert done.returncode != 0
    assert "000003" not in {m.shard[:6] for m in read_manifests(out).values()}
    assert not (out / contract.NV_META).exists()  # never finalized

    again = _torchrun(3, [DIFFPREP, *_args(data, tiny_model, out)], _env())
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert _hashes(out) == reference
    assert "validation: passed" in again.stdout
    assert not list((out / contract.STATE_DIR / contract.TMP_DIR).iterdir())


@pytest.mark.slow
def test_srun_step_variables_split_and_finalize_the_same_way(prefect_server, data, tiny_model, reference,
                                                             tmp_path) -> None:
    out = tmp_path / "out"
    port = str(_free_port())
    ranks = [
        subprocess.Popen([DIFFPREP, *_args(data, tiny_model, out)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True, env=_env(SLURM_PROCID=str(rank), SLURM_NTASKS="2", SLURM_LOCALID=str(rank),
                                             SLURM_JOB_ID="4242", MASTER_ADDR="127.0.0.1", MASTER_PORT=port))
        for rank in range(2)
    ]
    outputs = [rank.communicate(timeout=TIMEOUT)[0] for rank in ranks]
    assert [rank.returncode for rank in ranks] == [0, 0], outputs
    assert _hashes(out) == reference
    assert "validation: passed" in outputs[0] and "rank 1: encoded units 000001, 000003" in outputs[1]
