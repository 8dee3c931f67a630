"""Runs started by torchrun or SLURM: which rank this process is, and how the ranks of one run talk.

``torchrun --nproc_per_node=N -m diffprep encode ...`` (or ``srun diffprep
encode ...``) starts N processes with the same command. Rank 0 runs the whole
job (the Prefect flow: plan, questions, sanity, audit, finalize, validate).
The ranks of a run go through the same steps, in order:

1. ``decide``: rank 0 broadcasts where the output goes and which units to
   encode (or that it stops: reuse, a refusal, an error, named to the others);
2. ``encode``: every rank encodes the units ``u % N == rank``, posting each
   finished unit (its counts and seconds) for rank 0's progress; a rank that
   raises posts its error, and every rank stops after its current unit;
3. the end of the units: the ranks exchange their outcomes (an all-gather), so
   every rank stops with a message naming a rank that failed and its error,
   and rank 0 never audits a run with a failed rank; a rank that died breaks
   the exchange and the others name the ranks that never reached it;
4. ``outcome``: rank 0 audits, finalizes and validates, then tells the others
   how that went; the ranks leave the group together.

A re-run with any number of ranks finishes the rest, byte-identically (units
are independent and idempotent). The ranks talk through ``torch.distributed``
with the gloo backend (CPU and GPU machines alike: only small objects travel)
and its key-value store; torchrun sets ``MASTER_ADDR``/``MASTER_PORT``, a SLURM
script exports them (``configs/slurm-encode.sbatch``). SLURM array jobs are
separate jobs, not ranks: ``SLURM_ARRAY_TASK_ID``/``SLURM_ARRAY_TASK_COUNT``
become ``--shard-index``/``--num-shards``.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import re
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable

from diffprep.errors import ConfigError, DiffprepError

log = logging.getLogger("diffprep.launch")
JOIN_SECONDS = 900  # how long the ranks wait for each other to start
FOLLOW_SECONDS = 1.0  # how often rank 0 looks for the other ranks' finished units while it waits for them
RERUN = "finished units are kept: re-run with any number of ranks to encode the rest"


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


def rank_device(device: str, ranks: Ranks, gpus: int | None = None) -> str:
    """The device of one rank: ``auto`` and ``cuda`` become the rank's own GPU, ``cuda:N`` stays as given.

    The rank's own GPU is ``cuda:LOCAL_RANK``, or ``cuda:0`` when the launcher
    shows each rank one GPU (``srun --gpus-per-task=1``, ``CUDA_VISIBLE_DEVICES``
    per rank); ``auto`` without GPUs is a CPU process per rank. ``gpus``: the
    GPUs this process sees (default: torch's count).
    """
    if not ranks.many or device not in ("auto", "cuda"):
        if ranks.many and device.startswith("cuda:"):
            log.info("rank %d encodes on %s as given (ranks on one machine then share it; --device cuda gives each "
                     "rank its own GPU)", ranks.rank, device)
        return device
    if gpus is None:
        import torch

        gpus = torch.cuda.device_count()
    if gpus == 0:
        if device == "cuda":
            raise ConfigError(f"--device cuda, but rank {ranks.rank} sees no GPU: use --device auto or cpu")
        return "cpu"
    if gpus == 1:
        return "cuda:0"
    if ranks.local_rank >= gpus:
        raise ConfigError(f"rank {ranks.rank} is local rank {ranks.local_rank} but its machine shows {gpus} GPUs: "
                          f"start at most {gpus} ranks per machine (--nproc_per_node, --ntasks-per-node)")
    return f"cuda:{ranks.local_rank}"


def my_units(units: list[int], ranks: Ranks) -> list[int]:
    """The units this rank encodes: ``u % world_size == rank``."""
    return [u for u in units if u % ranks.world_size == ranks.rank]


def describe(error: BaseException) -> str:
    """An error in a line or a few, for another rank's message."""
    text = str(error).strip()
    return f"{type(error).__name__}: {text}"[:2000] if text else type(error).__name__


def _said(error: BaseException) -> str:
    """What gloo or the store said, without its source location and its advice."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return re.sub(r"^\[[^\]]*\]\s*", "", text).split(". This is typically")[0]


def _named(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(str(r) for r in ranks)


class _Stopped(Exception):
    """Another rank failed: this one stops after its current unit."""


class Group:
    """The ranks of one run, joined through ``torch.distributed`` (gloo) and its key-value store."""

    def __init__(self, ranks: Ranks, timeout_s: float, join_s: float = JOIN_SECONDS) -> None:
        import torch.distributed as dist

        self.ranks = ranks
        self.worker = f"rank {ranks.rank}"
        self._dist = dist
        self._phase = "start"  # -> encoding | stopped -> ended | failed | broken -> told
        self._posted = 0  # this rank's finished units posted so far
        self._followed = [0] * ranks.world_size  # rank 0: the other ranks' posted units it has reported
        if ranks.launcher == "slurm":
            # torch.distributed's env:// rendezvous reads these; torchrun sets them itself.
            os.environ.setdefault("RANK", str(ranks.rank))
            os.environ.setdefault("WORLD_SIZE", str(ranks.world_size))
        missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if name not in os.environ]
        if missing:
            raise ConfigError(f"{' and '.join(missing)} must be set for the {ranks.world_size} ranks to meet: "
                              "torchrun sets them; in a SLURM script export MASTER_ADDR (the first node) and "
                              "MASTER_PORT (configs/slurm-encode.sbatch)")
        where = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
        try:
            store, _, _ = next(dist.rendezvous("env://", rank=ranks.rank, world_size=ranks.world_size,
                                               timeout=datetime.timedelta(seconds=join_s)))
            dist.init_process_group("gloo", store=dist.PrefixStore("default_pg", store), rank=ranks.rank,
                                    world_size=ranks.world_size, timeout=datetime.timedelta(seconds=timeout_s))
        except RuntimeError as error:
            raise DiffprepError(
                f"rank {ranks.rank} of {ranks.world_size}: the ranks did not all meet at {where} within {join_s:.0f} s "
                f"({_said(error)}). Start one process per "
                "rank (torchrun, or srun inside a SLURM script: a script that runs diffprep itself is one process)"
            ) from None
        store.set_timeout(datetime.timedelta(seconds=timeout_s))
        self.store = dist.PrefixStore("diffprep/", store)

    # --- 1. the decision -------------------------------------------------------------------------------------------

    def decide(self, message: dict | None = None) -> dict | None:
        """Rank 0 sends where the output is and which units to encode; the others get it.

        ``{"stop": None}`` (or ``{"stop": "the error"}``) ends the run without
        encoding; the others get None (or an error naming rank 0's).
        """
        box = [message if self.ranks.rank == 0 else None]
        try:
            self._dist.broadcast_object_list(box, src=0)
        except RuntimeError as broken:
            self._phase = "broken"
            raise DiffprepError(f"a rank is gone before the units started (see its log; {_said(broken)})") from None
        message = box[0]
        if "stop" in message:
            self._phase = "stopped"
            if message["stop"] and self.ranks.rank != 0:
                raise DiffprepError(f"rank 0 stopped the run before encoding: {message['stop']}")
            return None
        self._phase = "encoding"
        return message

    # --- 2. the units, 3. their end ------------------------------------------------------------------------------

    def encode(self, units: list[int], encode_unit: Callable[[int], dict], done: Callable[[dict], None]) -> None:
        """This rank's ``units`` through ``encode_unit`` (a dict with unit, count, rejected, seconds), each given
        to ``done``; on rank 0, ``done`` also gets the other ranks' units as they finish. Stops after the current
        unit when another rank failed; returns when every rank has finished its units, raises naming the ranks
        that failed."""
        error: BaseException | None = None
        unit = None
        try:
            for unit in units:
                if self._stop_posted():
                    raise _Stopped()
                self._follow(done)
                result = dict(encode_unit(unit), worker=self.worker)
                if self.ranks.rank != 0:
                    self._post(result)
                done(result)
        except _Stopped as stopped:
            error = stopped
        except Exception as failure:  # noqa: BLE001 - every rank is told, then it is raised
            error = failure
            log.error("rank %d failed in unit %s", self.ranks.rank, "-" if unit is None else f"{unit:06d}",
                      exc_info=failure)
            self._post_stop()
        except BaseException:  # Ctrl-C, SystemExit: the others find this rank gone
            self._post_stop()
            self._phase = "broken"
            raise
        self._end(error, done)

    def _end(self, error: BaseException | None, done: Callable[[dict], None]) -> None:
        own = None if isinstance(error, _Stopped) else error  # this rank's own failure, if it failed
        status = {"error": None if own is None else describe(own)}
        try:
            self.store.set(f"end/{self.ranks.rank}", "1")
        except RuntimeError:
            pass  # the store went with rank 0: the exchange below names it
        try:
            statuses = self._gather(status, done)
        except RuntimeError as broken:  # gloo: a peer's connection closed
            self._phase = "broken"
            self._post_stop()
            gone = self._not_ended()
            who = (f"{_named(gone)} never reached the end of the units: "
                   + ("it is" if len(gone) == 1 else "at least one of them is")) if gone else "a rank is"
            raise DiffprepError(f"{who} gone (killed, out of memory or its machine lost: see its log); {RERUN} "
                                f"({_said(broken)})") from own
        failed = {rank: s["error"] for rank, s in enumerate(statuses) if s["error"]}
        if failed:
            self._phase = "failed"
            told = "; ".join(f"rank {rank} failed: {text}" for rank, text in failed.items())
            raise DiffprepError(f"{told}. Every rank stopped after its current unit; {RERUN}") from own
        self._phase = "ended"

    def _gather(self, status: dict, done: Callable[[dict], None]) -> list[dict]:
        box: list[Any] = [None] * self.ranks.world_size
        if self.ranks.rank != 0:
            self._dist.all_gather_object(box, status)
            return box
        failure: list[BaseException] = []

        def meet() -> None:
            try:
                self._dist.all_gather_object(box, status)
            except BaseException as error:  # noqa: BLE001 - raised in the caller's thread
                failure.append(error)

        thread = threading.Thread(target=meet, name="diffprep-ranks", daemon=True)
        thread.start()
        while True:  # the other ranks' units, reported as they finish; once more after the last of them
            thread.join(FOLLOW_SECONDS)
            if not failure:
                self._follow(done)
            if not thread.is_alive():
                break
        if failure:
            raise failure[0]
        return box

    # --- through the store: finished units, failures --------------------------------------------------------------

    def _post(self, result: dict) -> None:
        self.store.set(f"done/{self.ranks.rank}/{self._posted}", json.dumps(result))
        self._posted += 1

    def _follow(self, done: Callable[[dict], None]) -> None:
        """Rank 0: the units the other ranks finished since the last look, to ``done``."""
        if self.ranks.rank != 0:
            return
        for rank in range(1, self.ranks.world_size):
            while self.store.check([key := f"done/{rank}/{self._followed[rank]}"]):
                self._followed[rank] += 1
                done(json.loads(self.store.get(key)))

    def _post_stop(self) -> None:
        try:
            self.store.add("stop", 1)
        except RuntimeError:
            pass  # the store is gone with its host: the others find out at the end of their units

    def _stop_posted(self) -> bool:
        return self.store.add("stop", 0) > 0

    def _not_ended(self) -> list[int] | None:
        try:
            return [rank for rank in range(self.ranks.world_size) if not self.store.check([f"end/{rank}"])]
        except RuntimeError:
            return [0] if self.ranks.launcher == "slurm" else None  # srun: rank 0 held the store

    # --- 4. the outcome, leaving ---------------------------------------------------------------------------------

    def outcome(self, error: str | None = None) -> None:
        """After the units: rank 0 tells how its audit, finalize and validation went; the others wait for it
        and raise when it failed."""
        box = [error if self.ranks.rank == 0 else None]
        try:
            self._dist.broadcast_object_list(box, src=0)
        except RuntimeError as broken:
            self._phase = "broken"
            if self.ranks.rank == 0:  # the run is over: a rank left before hearing how it ended
                log.warning("a rank left before hearing how the run ended (%s)", _said(broken))
                return
            raise DiffprepError(f"rank 0 is gone before telling how the run ended (see its log; {_said(broken)})"
                                ) from None
        self._phase = "told"
        if box[0] and self.ranks.rank != 0:
            raise DiffprepError(f"rank 0 did not finish the run after the units: {box[0]}")

    def close(self, error: BaseException | None = None) -> None:
        """The steps this rank has not taken yet, with ``error`` as its outcome; then the ranks leave together.

        The last barrier keeps every rank in the group until rank 0 has
        finished: a rank tearing its gloo connections down while a peer still
        holds them can abort the process at exit.
        """
        try:
            self._finish(error)
        except (DiffprepError, RuntimeError) as later:
            if error is None:
                raise
            log.warning("rank %d: %s", self.ranks.rank, later)  # this rank is failing already
        finally:
            if self._phase != "broken":
                try:
                    self._dist.barrier()
                except RuntimeError:
                    pass
            self._dist.destroy_process_group()

    def _finish(self, error: BaseException | None) -> None:
        text = None if error is None else describe(error)
        if self._phase == "start" and self.ranks.rank == 0:
            self.decide({"stop": text})
        elif self._phase == "start":
            self.decide()  # in step with rank 0; its units follow
        if self._phase == "encoding":  # failed between the decision and its units
            self._post_stop()
            self._end(error or RuntimeError("left before its units"), lambda result: None)
        if self._phase == "ended":
            self.outcome(text)


_GROUP: Group | None = None


def join(ranks: Ranks, timeout_s: float) -> Group:
    global _GROUP
    _GROUP = Group(ranks, timeout_s)
    return _GROUP


def group() -> Group | None:
    """The group this process joined, if it is one of several ranks."""
    return _GROUP


def leave(error: BaseException | None = None) -> None:
    global _GROUP
    if _GROUP is not None:
        try:
            _GROUP.close(error)
        finally:
            _GROUP = None


__all__ = ["Group", "Ranks", "array_shard", "describe", "detect_ranks", "group", "join", "leave", "my_units",
           "rank_device"]
