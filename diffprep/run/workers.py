"""Which units a worker encodes, and on which device.

Workers are processes that each pin one device, load the encoders once and
take units as they free up (a slow device takes fewer). Every unit is an
independent, idempotent piece of work, so the output does not depend on how
many workers there were or which one encoded what.
"""

from __future__ import annotations

import fcntl
import os
import tempfile
from pathlib import Path
from typing import Sequence

from diffprep.run.allocator import tune_malloc
from diffprep.errors import ConfigError

_claimed: str | None = None
_claim_fd: int | None = None


def parse_devices(spec: str) -> list[str]:
    """``'0,1'`` -> cuda:0, cuda:1; ``'auto'`` -> every visible GPU (else one CPU worker);
    ``'cpu:N'`` -> N CPU workers."""
    spec = spec.strip()
    if spec == "auto":
        import torch

        count = torch.cuda.device_count()
        return [f"cuda:{i}" for i in range(count)] if count else ["cpu"]
    if spec.startswith("cpu"):
        _, _, n = spec.partition(":")
        try:
            workers = int(n or 1)
        except ValueError:
            raise ConfigError(f"workers.devices {spec!r}: expected cpu:N with N a number, e.g. cpu:2") from None
        if workers < 1:
            raise ConfigError(f"workers.devices {spec!r}: N must be >= 1")
        return ["cpu"] * workers
    devices = []
    for part in spec.split(","):
        part = part.strip().removeprefix("cuda:")
        if not part.isdigit():
            raise ConfigError(
                f"workers.devices {spec!r}: expected CUDA indices like 0,1,2,3, or auto, or cpu:N"
            )
        devices.append(f"cuda:{int(part)}")
    if len(set(devices)) != len(devices):
        raise ConfigError(f"workers.devices {spec!r} names a device twice")
    return devices


def claim_device(devices: Sequence[str], claim_dir: str, cpu_threads: int | None = None) -> None:
    """Process-pool initializer: take the first device no other worker of this pool holds.

    A device is held through an flock on ``<claim_dir>/<slot>.lock`` for the
    life of the process, so a replacement for a dead worker takes its device.
    ``cpu_threads``: torch's intra-op threads, set to the parent's count. CPU
    kernels sum in an order that depends on the thread count, so workers use
    the same count as a single-process run to write the same bytes (CPU
    workers then share the cores; on GPUs this does not matter).
    """
    global _claimed, _claim_fd
    _prepare(cpu_threads)
    for slot, device in enumerate(devices):
        fd = os.open(Path(claim_dir) / f"{slot}.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        _claimed, _claim_fd = device, fd
        return
    raise RuntimeError(f"every device of {list(devices)} is already held by a worker of this pool")


def pin_device(device: str, cpu_threads: int | None = None) -> None:
    """A worker process given its device by its parent (``diffprep.run.pool``, one process per device): what
    ``claim_device`` does once it holds a device, with no lock to take."""
    global _claimed
    _prepare(cpu_threads)
    _claimed = device


def _prepare(cpu_threads: int | None) -> None:
    tune_malloc()  # a worker process: before its encoders load (diffprep/run/allocator.py)
    if cpu_threads is not None:
        import torch

        torch.set_num_threads(cpu_threads)


def claimed_device() -> str | None:
    """The device this worker process claimed, or None outside a worker pool."""
    return _claimed


def claim_dir() -> str:
    return tempfile.mkdtemp(prefix="diffprep-devices-")


def cpu_workers_that_fit(requested: int, threads: int, cores: int, parent_on_cpu: bool) -> int:
    """How many of ``requested`` CPU worker processes get cores of their own: each encodes with ``threads``
    threads, on ``cores`` physical cores, the parent's own share first when it encodes on the CPU too.

    A CPU worker past that only shares the cores the others fill: on 2 cores, with 2 threads per process, a
    second process made a run slower (benchmarks/README.md, section 14), never faster."""
    fit = max(1, cores // max(1, threads)) - (1 if parent_on_cpu else 0)
    return max(0, min(requested, fit))


def units_for_shard(units: Sequence[int], num_shards: int | None, shard_index: int | None) -> list[int]:
    """The units of manual shard ``shard_index`` of ``num_shards`` (``u % num_shards == shard_index``)."""
    if num_shards is None:
        return list(units)
    return [u for u in units if u % num_shards == shard_index]


def split_chunks(units: Sequence[int], chunks: int) -> list[list[int]]:
    """``units`` in ``chunks`` interleaved lists (unit sizes are equal, so interleaving balances them)."""
    chunks = max(1, min(chunks, len(units)))
    return [list(units[i::chunks]) for i in range(chunks)] if units else []
