"""diffprep.run.threads: the plan's CPU record, the thread count set around the encoders, another CPU said first.

The end-to-end check is tests/test_ranks.py: two torchrun ranks (one thread each from torchrun) write the shards of
a single process at its default thread count, byte for byte.
"""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import torch

from diffprep.run import threads
from diffprep.writer.plan import Plan, UnitPlan, read_plan, write_plan
from diffprep.run.threads import CpuRecord, default_threads, planned_threads, record


def _topology(root: Path, cores: dict[int, tuple[int, int]]) -> Path:
    for cpu, (package, core) in cores.items():
        folder = root / f"cpu{cpu}" / "topology"
        folder.mkdir(parents=True)
        (folder / "physical_package_id").write_text(f"{package}\n")
        (folder / "core_id").write_text(f"{core}\n")
    return root


def test_the_default_is_the_physical_cores_whatever_a_launcher_set(tmp_path: Path) -> None:
    cpus = sorted(threads.os.sched_getaffinity(0))
    # Two CPUs of one core (hyper-threads) count once; no topology to read: one core per CPU.
    siblings = _topology(tmp_path / "ht", {cpu: (0, 0) for cpu in cpus})
    assert default_threads(siblings) == 1
    assert default_threads(tmp_path / "none") == len(cpus)
    # torchrun's OMP_NUM_THREADS=1 changes torch's count, not the plan's default.
    code = "import torch; from diffprep.run.threads import default_threads; print(torch.get_num_threads(), default_threads())"
    one = subprocess.run([sys.executable, "-c", code], env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"},
                         capture_output=True, text=True, check=True).stdout.split()
    assert one == ["1", str(default_threads())]
    assert record(3) == CpuRecord(torch.backends.cpu.get_cpu_capability(), 3)
    assert record().threads == default_threads()


def test_the_plans_count_around_the_encoders_and_restored(caplog) -> None:
    before = torch.get_num_threads()
    here = torch.backends.cpu.get_cpu_capability()
    planned = CpuRecord(here, before + 1)
    with planned_threads(planned, "cpu"):
        assert torch.get_num_threads() == before + 1
    assert torch.get_num_threads() == before
    with planned_threads(planned, "cuda:0"), planned_threads(None, "cpu"):  # a GPU, an older plan: left alone
        assert torch.get_num_threads() == before
    assert not caplog.records


def test_another_cpu_says_so_before_it_writes_once_per_process(caplog) -> None:
    other = "AVX2" if torch.backends.cpu.get_cpu_capability() != "AVX2" else "AVX512"
    planned = CpuRecord(other, 1)
    threads._said.clear()
    with caplog.at_level(logging.WARNING, logger="diffprep.threads"):
        for unit in range(2):
            with planned_threads(planned, "cpu", what=f"unit {unit:06d}"):
                pass
    [said] = [r.getMessage() for r in caplog.records]
    assert said.startswith(f"unit 000000 encodes with CPU kernels {torch.backends.cpu.get_cpu_capability()}, "
                           f"the plan's {other}: its latents will differ in the last bits"), said
    threads._said.clear()


def test_plan_json_keeps_the_record_and_reads_older_plans(tmp_path) -> None:
    plan = Plan("f", {}, {}, {}, [UnitPlan(0, ["a"])], cpu=record(2).to_json())
    data = plan.to_json()
    assert data["cpu"] == {"capability": torch.backends.cpu.get_cpu_capability(), "threads": 2}
    write_plan(tmp_path, plan)  # plan.json and its units' lists
    assert read_plan(tmp_path) == plan
    del data["cpu"]
    older = Plan.from_json(data)
    assert older.cpu is None and CpuRecord.from_json(older.cpu) is None and "cpu" not in older.to_json()
