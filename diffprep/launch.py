"""Runs started by torchrun or SLURM: which rank this process is, and how the ranks of one run talk.

``torchrun --nproc_per_node=N -m diffprep.cli encode ...`` (or ``srun diffprep
encode ...``) starts N processes with the same command. Rank 0 runs the whole
job (the Prefect flow: plan, questions, sanity, audit, finalize, validate);
when it has decided where the output goes and which units to encode, it
broadcasts that decision, and every rank encodes the units ``u % N == rank``.
Rank 0 follows the others' units as their manifests land, then all meet at a
barrier and rank 0 audits and finalizes; the ranks leave the group together. A rank that dies makes the launcher
stop the others (torchrun's default; ``srun --kill-on-bad-exit``); a re-run
with any number of ranks finishes the rest, byte-identically (units are
independent and idempotent).

The ranks talk through ``torch.distributed`` with the gloo backend (CPU and
GPU machines alike: only small objects travel); torchrun sets
``MASTER_ADDR``/``MASTER_PORT``, a SLURM script exports them
(``configs/slurm-encode.sbatch``). SLURM array jobs are separate jobs, not
ranks: ``SLURM_ARRAY_TASK_ID``/``SLURM_ARRAY_TASK_COUNT`` become
``--shard-index``/``--num-shards``.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from diffprep.errors import ConfigError

STOP = "stop"  # what rank 0 broadcasts when the run ends without encoding (reuse, refused, failed)


@dataclass(frozen=True)
class Ranks:
    rank: int
    world_size: int
    local_rank: int
    launcher: str  # torchrun | slurm | single

    @property
    def many(self) -> bool:
        return self.world_size > 1


def _int(env: Mapping[str, str], name: str) -> int:
    try:
        return int(env[name])
    except ValueError:
        raise ConfigError(f"{name}={env[name]!r} is not a number") from None


def detect_ranks(env: Mapping[str, str] = os.environ) -> Ranks:
    """This process's rank from torchrun's (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``) or an srun step's
    (``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID``) variables; one rank otherwise."""
    if "RANK" in env and "WORLD_SIZE" in env:
        ranks = Ranks(_int(env, "RANK"), _int(env, "WORLD_SIZE"), _int(env, "LOCAL_RANK") if "LOCAL_RANK" in env
                      else 0, "torchrun")
    elif "SLURM_PROCID" in env and "SLURM_NTASKS" in env and "SLURM_ARRAY_TASK_ID" not in env:
        ranks = Ranks(_int(env, "SLURM_PROCID"), _int(env, "SLURM_NTASKS"),
                      _int(env, "SLURM_LOCALID") if "SLURM_LOCALID" in env else 0, "slurm")
    else:
        return Ranks(0, 1, 0, "single")
    if not 0 <= ranks.rank < ranks.world_size:
        raise ConfigError(f"{ranks.launcher} says rank {ranks.rank} of {ranks.world_size}: not a rank of this run")
    return ranks


def array_shard(env: Mapping[str, str] = os.environ) -> tuple[int, int] | None:
    """(num_shards, shard_index) of a SLURM array task, or None outside one."""
    if "SLURM_ARRAY_TASK_ID" not in env or "SLURM_ARRAY_TASK_COUNT" not in env:
        return None
    first = _int(env, "SLURM_ARRAY_TASK_MIN") if "SLURM_ARRAY_TASK_MIN" in env else 0
    return _int(env, "SLURM_ARRAY_TASK_COUNT"), _int(env, "SLURM_ARRAY_TASK_ID") - first


def rank_device(device: str, ranks: Ranks) -> str:
    """``auto`` on a rank: its own GPU (``cuda:LOCAL_RANK``) where there are GPUs, else the CPU."""
    if device != "auto" or not ranks.many:
        return device
    import torch

    return f"cuda:{ranks.local_rank}" if torch.cuda.is_available() else "cpu"


class Group:
    """The ranks of one run, joined through ``torch.distributed`` (gloo)."""

    def __init__(self, ranks: Ranks, timeout_s: float) -> None:
        import torch.distributed as dist

        self.ranks = ranks
        self._dist = dist
        self.sent = False
        if ranks.launcher == "slurm":
            # torch.distributed's env:// rendezvous reads these; torchrun sets them itself.
            os.environ.setdefault("RANK", str(ranks.rank))
            os.environ.setdefault("WORLD_SIZE", str(ranks.world_size))
        missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if name not in os.environ]
        if missing:
            raise ConfigError(f"{' and '.join(missing)} must be set for the {ranks.world_size} ranks to meet: "
                              "torchrun sets them; in a SLURM script export MASTER_ADDR (the first node) and "
                              "MASTER_PORT (configs/slurm-encode.sbatch)")
        dist.init_process_group("gloo", rank=ranks.rank, world_size=ranks.world_size,
                                timeout=datetime.timedelta(seconds=timeout_s))

    def broadcast(self, message: Any = None) -> Any:
        """Rank 0 sends ``message`` (once); every other rank gets it."""
        box = [message if self.ranks.rank == 0 else None]
        self._dist.broadcast_object_list(box, src=0)
        if self.ranks.rank == 0:
            self.sent = True
        return box[0]

    def barrier(self) -> None:
        self._dist.barrier()

    def close(self) -> None:
        """Rank 0 tells ranks still waiting that nothing will come; then the ranks end the group together.

        The last barrier keeps every rank in the group until rank 0 has
        audited and finalized: a rank tearing its gloo connections down while
        a peer still holds them can abort the process at exit.
        """
        if self.ranks.rank == 0 and not self.sent:
            self.broadcast(STOP)
        self._dist.barrier()
        self._dist.destroy_process_group()


_GROUP: Group | None = None


def join(ranks: Ranks, timeout_s: float) -> Group:
    global _GROUP
    _GROUP = Group(ranks, timeout_s)
    return _GROUP


def group() -> Group | None:
    """The group this process joined, if it is one of several ranks."""
    return _GROUP


def leave() -> None:
    global _GROUP
    if _GROUP is not None:
        _GROUP.close()
        _GROUP = None


def my_units(units: list[int], ranks: Ranks) -> list[int]:
    """The units this rank encodes: ``u % world_size == rank``."""
    return [u for u in units if u % ranks.world_size == ranks.rank]


__all__ = ["Group", "Ranks", "array_shard", "detect_ranks", "group", "join", "leave", "my_units", "rank_device"]
