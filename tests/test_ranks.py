"""torchrun and SLURM: N ranks share the units of one run, rank 0 audits, finalizes and validates.

Real launches on the CPU: ``torchrun --nproc_per_node=N -m diffprep encode
...`` (and ``--no-python diffprep``) and two processes with an srun step's
variables, talking through torch.distributed (gloo) on loopback. The steps
the ranks take together (tests/rank_scenarios.py) are tested with units that
sleep: a rank that raises, a rank killed, rank 0 failing before or after the
units, a rank alone. Torch's CPU kernels sum in an order
that depends on the thread count, and torchrun gives each rank one thread
(``OMP_NUM_THREADS=1``) where a single process has one per core: the plan fixes
the count every rank encodes with (diffprep/run/threads.py), so the reference is a
plain single process at its default count, and the ranks write its bytes.
"""

from __future__ import annotations

import hashlib
import os
import random
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from diffprep import contract
from diffprep.tools.demo import write_demo_dataset
from diffprep.errors import ConfigError
from diffprep.run.launch import Ranks, array_shard, detect_ranks, my_units, rank_device
from diffprep.writer.plan import read_plan
from diffprep.writer.shards import load_tensor, read_manifests
from diffprep.run.threads import default_threads
from flow_runs import shard_samples
from latent_direct import close32, direct

REPO = Path(__file__).resolve().parents[1]
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
    assert rank_device("auto", ranks) == "cpu"  # no GPU here: a CPU process per rank
    # auto and cuda: the rank's own GPU, cuda:LOCAL_RANK; cuda:0 where each rank is shown one GPU.
    for device in ("auto", "cuda"):
        assert rank_device(device, ranks, gpus=8) == "cuda:1"
        assert rank_device(device, Ranks(11, 16, 3, "slurm"), gpus=8) == "cuda:3"
        assert rank_device(device, Ranks(11, 16, 3, "slurm"), gpus=1) == "cuda:0"  # srun --gpus-per-task=1
    assert rank_device("cuda:5", ranks, gpus=8) == "cuda:5"  # an explicit GPU stays as given
    assert rank_device("cpu", ranks, gpus=8) == "cpu"
    assert rank_device("cuda", Ranks(0, 1, 0, "single"), gpus=8) == "cuda"  # one process: as given
    assert rank_device("auto", ranks, gpus=0) == "cpu"
    with pytest.raises(ConfigError, match="rank 1 sees no GPU"):
        rank_device("cuda", ranks, gpus=0)
    with pytest.raises(ConfigError, match="local rank 3 but its machine shows 2 GPUs"):
        rank_device("cuda", Ranks(7, 8, 3, "torchrun"), gpus=2)


def test_the_sbatch_scripts_parse() -> None:
    for script in ("slurm-encode.sbatch", "slurm-encode-array.sbatch"):
        subprocess.run(["bash", "-n", str(REPO / "configs" / script)], check=True)


# --- the steps the ranks take together, with units that sleep (tests/rank_scenarios.py) -----------------------------


def _free_ports(count: int) -> list[int]:
    """Ports free now, below the kernel's ephemeral range: the scenarios take them one after the other, later,
    and no outgoing connection is given one meanwhile."""
    ports: list[int] = []
    while len(ports) < count:
        port = random.randrange(20000, 32000)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        if port not in ports:
            ports.append(port)
    return ports


def test_the_ranks_stop_together_naming_the_rank_that_failed() -> None:
    """Two ranks through the scenarios of tests/rank_scenarios.py, each scenario's lines by rank."""
    ports = ",".join(map(str, _free_ports(5)))
    ranks = [
        subprocess.Popen([sys.executable, str(REPO / "tests" / "rank_scenarios.py"), ports], stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, cwd=REPO,
                         env=_env(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1"))
        for rank in range(2)
    ]
    outputs = [rank.communicate(timeout=240)[0] for rank in ranks]
    assert [rank.returncode for rank in ranks] == [0, -9], outputs
    said = [{} for _ in ranks]
    for lines, output in zip(said, outputs):
        for scenario, text in re.findall(r"^\[(\w+)\] (.*)$", output, re.M):
            lines.setdefault(scenario, []).append(text)
    zero, one = said

    # A rank that raises: every rank names it and its error; rank 0 stops after its current unit (which lasts
    # until the failure is posted).
    failed = "error: rank 1 failed: ValueError: unit 1 is bad on purpose. Every rank stopped after its current unit"
    for lines in (zero, one):
        assert any(line.startswith(failed) for line in lines["raise"]), lines["raise"]
    assert zero["raise"][-1] == one["raise"][-1] == "status 2"
    assert len([line for line in zero["raise"] if line.startswith("unit ")]) <= 1, zero["raise"]
    # Rank 0 failing after the units (its audit) or before deciding (its sanity check): the other rank is told.
    assert "error: audit failed: on purpose" in zero["after"]
    told = "error: rank 0 did not finish the run after the units: DiffprepError: audit failed: on purpose"
    assert told in one["after"]
    told = "error: rank 0 stopped the run before encoding: DiffprepError: sanity check failed: on purpose"
    assert told in one["stop"]
    assert zero["stop"][-1] == one["stop"][-1] == "status 2"
    # ... and before that, rank 0's progress had rank 1's units as they finished, with rank 1's seconds.
    seen = dict(re.match(r"seen (\d) by rank 1 in ([\d.]+) s", line).groups() for line in zero["after"]
                if line.startswith("seen") and "rank 1" in line)
    assert sorted(seen) == ["1", "3", "5"] and all(float(s) >= 0.3 for s in seen.values()), zero["after"]
    # A rank killed: the exchange at the end of the units breaks, and rank 0 names the rank that never reached it.
    assert any(line.startswith("error: rank 1 never reached the end of the units: it is gone (killed, out of memory")
               for line in zero["kill"]), zero["kill"]
    assert "kill" not in one  # rank 1 died at once: rank 0 is the one that can tell
    # A rank alone (a SLURM script running diffprep itself, without srun): the others never join.
    [alone, status] = zero["alone"]
    assert alone.startswith("error: rank 0 of 2: the ranks did not all meet at 127.0.0.1:") and status == "status 2"
    assert "Start one process per rank" in alone


# --- real launches ---------------------------------------------------------------------------------------------------


def _args(data: Path, model: Path, out: Path, *extra: str) -> list[str]:
    return ["encode", "--source-type", "directory", "--input-dir", str(data), "--model-path", str(model),
            "--output-dir", str(out), "--shard-size", "4", "--batch-size", "4", "--precision", "fp32",
            "--image-size", "32", "--t5-max-length", "16", "--min-psnr", "0", "--decode-workers", "1", "--full-cov",
            *extra]


def _hashes(out: Path) -> dict[str, str]:
    """The shards' hashes, and each unit's saved latent moments (as bytes, without the run's fingerprint)."""
    from diffprep.writer.shards import torch_bytes

    moments = {p.name: hashlib.sha256(torch_bytes(torch.load(p, weights_only=True)["fields"])).hexdigest()
               for p in sorted((out / contract.STATE_DIR / contract.UNIT_STATS_DIR).glob("*.pt"))}
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(out.glob("*.tar"))} | moments


def _merged_stats(out: Path) -> bytes:
    """The latent statistics merged from ``out``'s units: what a finalized run saves, to the byte."""
    from diffprep.report.latent_stats import merged_unit_stats
    from diffprep.output import Output
    from diffprep.writer.shards import torch_bytes

    output = Output(out)
    return torch_bytes(merged_unit_stats(output, output.state.plan()))


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_",
                                                                         "MASTER_", "DIFFPREP_"))}
    env.pop("OMP_NUM_THREADS", None)  # torchrun sets 1 for each rank; a single process has one thread per core
    return env | extra


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _torchrun(ranks: int, args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    """``torchrun ... --no-python args``, or ``torchrun ... -m diffprep ...`` when args start with ``-m``."""
    command = [TORCHRUN, "--nproc_per_node", str(ranks), "--master_addr", "127.0.0.1", "--master_port",
               str(_free_port()), *([] if args[0] == "-m" else ["--no-python"]), *args]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=TIMEOUT)


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return write_demo_dataset(tmp_path_factory.mktemp("ranks") / "data", samples=20)  # 5 units of 4


@pytest.fixture(scope="module")
def reference(prefect_server, data, tiny_model, tmp_path_factory) -> dict[str, str]:
    """Shard hashes of one process at its default thread count (torchrun gives each rank one thread)."""
    out = tmp_path_factory.mktemp("reference") / "out"
    done = subprocess.run([DIFFPREP, *_args(data, tiny_model, out, "--no-finalize")], env=_env(),
                          capture_output=True, text=True, timeout=TIMEOUT)
    assert done.returncode == 0, done.stdout + done.stderr
    hashes = _hashes(out)
    assert len(hashes) == 10  # 5 shards, 5 units' moments
    return hashes | {contract.LATENT_STATS: hashlib.sha256(_merged_stats(out)).hexdigest()}


def _stats_hash(out: Path) -> dict[str, str]:
    """The finalized run's latent statistics (the units' merge, in unit order whoever wrote them)."""
    saved = (out / contract.STATE_DIR / contract.LATENT_STATS).read_bytes()
    assert saved == _merged_stats(out)
    return {contract.LATENT_STATS: hashlib.sha256(saved).hexdigest()}


@pytest.mark.slow
def test_torchrun_two_ranks_encode_finalize_and_validate_in_one_command(prefect_server, data, tiny_model, reference,
                                                                        tmp_path) -> None:
    out = tmp_path / "out"
    done = _torchrun(2, ["-m", "diffprep", *_args(data, tiny_model, out)], _env())
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert _hashes(out) | _stats_hash(out) == reference  # the shards, the units' moments and their merge
    # With --full-cov, the two ranks' merged units are the statistics of every stored latent, taken at once.
    saved = torch.load(out / contract.STATE_DIR / contract.LATENT_STATS, weights_only=True)
    latents = [load_tensor(fields[contract.LATENTS]) for fields in shard_samples(out).values()]
    mean, std, cov = direct(latents)
    assert len(latents) == 20 and int(saved["samples"]) == 20 and int(saved["count"]) == 20 * latents[0][0].numel()
    assert close32(saved["mean"], mean) and close32(saved["std"], std) and close32(saved["cov"], cov)
    assert read_plan(out).cpu["threads"] == default_threads()  # not torchrun's 1
    assert "rank 1: encoded units 000001, 000003" in done.stdout
    assert "validation: passed" in done.stdout and "samples written: 20" in done.stdout
    assert (out / contract.NV_META / contract.INFO_JSON).is_file()
    # Rank 0's progress has rank 1's units, with rank 1's own timings (a real rate, not 0.0).
    rates = dict(re.findall(r"unit (00000[13]) done \(\d/5\) by rank 1: 4 written, 0 rejected; ([\d.]+) samples/s "
                            "this worker", done.stdout + done.stderr))
    assert sorted(rates) == ["000001", "000003"] and all(float(r) > 0 for r in rates.values()), done.stdout[-3000:]


@pytest.mark.slow
def test_a_killed_rank_stops_the_run_and_any_number_of_ranks_finishes_it(prefect_server, data, tiny_model,
                                                                         reference, tmp_path) -> None:
    out = tmp_path / "out"
    # Rank 1 is killed while it writes its second unit (000003), after committing 000001.
    script = (f'if [ "$RANK" = 1 ]; then export DIFFPREP_FAILPOINT=shard-write@6; fi; '
              f'exec "{DIFFPREP}" "$@"')
    done = _torchrun(2, ["sh", "-c", script, "sh", *_args(data, tiny_model, out)], _env())
    assert done.returncode != 0
    # torchrun stops rank 0 and names the dead rank (without a launcher that does, rank 0 would: see above).
    assert re.search(r"rank\s*: 1 \(local_rank: 1\)\n\s*exitcode\s*: -9", done.stderr), done.stderr[-3000:]
    assert "000003" not in {m.shard[:6] for m in read_manifests(out).values()}
    assert not (out / contract.NV_META).exists()  # never finalized

    again = _torchrun(3, [DIFFPREP, *_args(data, tiny_model, out)], _env())
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert _hashes(out) | _stats_hash(out) == reference
    assert "validation: passed" in again.stdout
    assert not list((out / contract.STATE_DIR / contract.TMP_DIR).iterdir())


def _srun(data: Path, model: Path, out: Path, rank_env: dict[int, dict[str, str]] | None = None
          ) -> list[tuple[int, str]]:
    """Two ranks of an srun step (its variables, as srun sets them) running the same command."""
    port = str(_free_port())
    ranks = [
        subprocess.Popen([DIFFPREP, *_args(data, model, out)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True, env=_env(SLURM_PROCID=str(rank), SLURM_NTASKS="2", SLURM_LOCALID=str(rank),
                                             SLURM_JOB_ID="4242", MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
                                             **(rank_env or {}).get(rank, {})))
        for rank in range(2)
    ]
    outputs = [rank.communicate(timeout=TIMEOUT)[0] for rank in ranks]
    return [(rank.returncode, output) for rank, output in zip(ranks, outputs)]


@pytest.mark.slow
def test_srun_step_a_rank_that_raises_stops_both_then_the_same_step_finishes(prefect_server, data, tiny_model,
                                                                              reference, tmp_path) -> None:
    out = tmp_path / "out"
    # Rank 1 raises while it writes its second unit (000003), after committing 000001.
    failed = _srun(data, tiny_model, out, {1: {"DIFFPREP_FAILPOINT": "shard-write@6:raise"}})
    assert [status for status, _ in failed] == [2, 2], failed
    for _, output in failed:  # both ranks name rank 1 and its error
        assert "rank 1 failed: FailpointError: failpoint shard-write raised on purpose" in output, output[-3000:]
    assert "Task run 'audit-" not in failed[0][1] and not (out / contract.NV_META).exists()  # rank 0 never audited
    committed = {m.shard[:6] for m in read_manifests(out).values()}
    assert "000001" in committed and "000003" not in committed

    ranks = _srun(data, tiny_model, out)
    assert [status for status, _ in ranks] == [0, 0], ranks
    assert _hashes(out) | _stats_hash(out) == reference
    assert "validation: passed" in ranks[0][1] and "rank 1: encoded units 000003 " in ranks[1][1]
