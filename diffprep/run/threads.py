"""The CPU facts a latent's last bits depend on, fixed by the plan: torch's intra-op thread count and CPU kernels.

On the CPU, oneDNN picks its convolution kernels by the thread count: the tiny
Flux VAE's 16-channel convolution sums in another order at 1 thread than at 2,
and its latents differ in the last bits (max |Δ| 4.8e-7 through the whole
encode). Group norm, the linear layers and attention agree bit for bit at 1
and 2 threads (benchmarks/threads.py measures both). A ``torchrun`` rank starts
with ``OMP_NUM_THREADS=1``, a single process with one thread per core, so the
same plan would give other bytes by the number of ranks.

Measured on this 2-core AVX-512 machine (benchmarks/threads.py, interleaved):
oneDNN off makes the convolutions thread-invariant but costs 2.2x and changes
every shard; ``torch.backends.mkldnn.deterministic`` does not make them agree;
one thread everywhere costs a single process 1.3-1.8x. So the plan fixes the
count instead, and every process that encodes on the CPU sets it around its
encoders (:func:`planned_threads`): a single process keeps its speed and its
bytes; CPU ranks or workers sharing the cores oversubscribe them (two
processes at 2 threads each on 2 cores: 0.94x and 1.27x the time of 1 thread
each in two runs, the second under other load).

The plan records (``plan.json`` ``cpu``) the count and the CPU capability
(``torch.backends.cpu.get_cpu_capability()``: AVX2 and AVX-512 kernels differ
in the last bits too). A resume, rank or worker on a CPU of another capability
cannot compute the planned bits: it says so before it writes. GPU processes
are left alone: their bits come from the GPU's kernels.
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

__all__ = ["CpuRecord", "default_threads", "record", "planned_threads", "differences", "encoding_device"]

log = logging.getLogger("diffprep.threads")

_said: set[str] = set()  # what this process already said (once per process)


@dataclass(frozen=True)
class CpuRecord:
    """What plan.json's ``cpu`` holds: the CPU kernels (capability) and the encoders' intra-op thread count."""

    capability: str
    threads: int

    def to_json(self) -> dict[str, Any]:
        return {"capability": self.capability, "threads": self.threads}

    @classmethod
    def from_json(cls, data: dict[str, Any] | None) -> "CpuRecord | None":
        return cls(str(data["capability"]), int(data["threads"])) if data else None


def capability() -> str:
    import torch

    return torch.backends.cpu.get_cpu_capability()


def default_threads(sys_cpu: Path = Path("/sys/devices/system/cpu")) -> int:
    """The machine's default: the physical cores this process may run on (torch's own default with no
    ``OMP_NUM_THREADS``), whatever ``OMP_NUM_THREADS`` a launcher set for this process."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    cores = set()
    for cpu in cpus:
        topology = sys_cpu / f"cpu{cpu}" / "topology"
        try:
            cores.add(((topology / "physical_package_id").read_text().strip(),
                       (topology / "core_id").read_text().strip()))
        except OSError:
            cores.add(("cpu", str(cpu)))  # no topology to read: one core per CPU
    return max(1, len(cores))


def record(threads: int | None = None) -> CpuRecord:
    """This machine's record for a new plan: ``threads`` as set (``workers.encoder_threads``), else the default."""
    return CpuRecord(capability(), threads or default_threads())


def differences(planned: CpuRecord | None) -> list[str]:
    """How this process's CPU kernels differ from the plan's (empty: the planned bits)."""
    if planned is None:
        return []
    here = capability()
    return [] if here == planned.capability else [f"CPU kernels {here}, the plan's {planned.capability}"]


def encoding_device(settings: Any) -> Any:
    """The device this process's encoders compute on: its claimed worker device, else ``model.device``."""
    from diffprep.families.base import resolve_device
    from diffprep.run.workers import claimed_device

    return resolve_device(claimed_device() or settings.model.device)


@contextlib.contextmanager
def planned_threads(planned: CpuRecord | None, device: Any, what: str = "this process") -> Iterator[None]:
    """Encode on the plan's thread count in this thread (torch's count is per thread for OpenMP), the previous
    count restored after; first say, once per process, when this CPU cannot give the planned bits.

    A plan without a record (written before it existed) and GPU devices change nothing."""
    import torch

    if planned is None or torch.device(device).type != "cpu":
        yield
        return
    for difference in differences(planned):
        if difference not in _said:
            _said.add(difference)
            log.warning("%s encodes with %s: its latents will differ in the last bits from the planned machine's "
                        "(valid, not byte-identical to a run there)", what, difference)
    before = torch.get_num_threads()
    torch.set_num_threads(planned.threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)
