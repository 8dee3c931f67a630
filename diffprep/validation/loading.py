"""Samples loaded back as a trainer loads them, judged by the encoding's inspector: drawn, or every one.

Loading every sample in one process took 136 s at 100k samples (~38 h at 100M), so validation by default
loads one sample drawn from every shard (``drawn_index``: the same one every time, from the shard's name) and
checks the rest of every shard from its tar headers and index (``checks.check_shards``). ``--full`` loads
every sample: in one process through Energon's own loader (``checks.check_loading``), or with ``workers`` > 1
by ``load_in_processes``, a process pool over pieces of shards whose cooked samples come back in the order
the one-process loader yields them, so that the inspector sees the same samples in the same order and the
report is the same.

A sample is read as Energon's loader reads it: its members at the offsets of the shard's ``.tar.idx``
(Energon's ``ShardInfosITarReader``), made into Energon's crude sample with the dataset's subflavors, cooked
by the encoding's task encoder (tensors with ``weights_only=True``) and passed through its ``encode_sample``.
"""

from __future__ import annotations

import hashlib
import inspect as pyinspect
import multiprocessing
import warnings
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from typing import Any

from diffprep import contract
from diffprep.report.checks import Check, Findings
from diffprep.encodings import Encoding, get_encoding
from diffprep.output import Output
from diffprep.validation.dataset import Dataset

PIECE = 32  # samples per job of the process pool: a few MB of tensors in flight per job, not a whole shard
AHEAD = 2  # jobs in flight per worker process


def drawn_index(shard: str, count: int) -> int:
    """The sample of ``shard`` (of ``count`` samples) that validation loads by default: fixed by the shard's
    name (the first 8 bytes of its sha256, modulo the count), so a re-run loads the same one."""
    return int.from_bytes(hashlib.sha256(shard.encode("utf-8")).digest()[:8], "big") % count


def split_shards(ds: Dataset, split: str) -> list[str]:
    """The shards of ``split`` in the order Energon's loader reads them (split.yaml's, which finalize sorts)."""
    return sorted(name for name, part in (ds.split_of or {}).items() if part == split and name in (ds.info or {}))


class SampleReader:
    """Samples of one dataset folder read and cooked as Energon's loader does (see the module docstring)."""

    def __init__(self, root: Any, encoding: str, subflavors: dict[str, Any] | None) -> None:
        self.root = str(root)  # a folder, or the msc:// path of a bucket prefix (no Path: it would drop a slash)
        self.task_encoder = get_encoding(encoding).task_encoder()
        self.subflavors = dict(subflavors or {})
        self.cooker = next((c for c in self.task_encoder.cookers if c.is_match(self.subflavors)), None)

    def samples(self, shard: str, count: int, indices: range | list[int]) -> Iterator[Any]:
        """The cooked samples at ``indices`` of ``shard``; the first that cannot be loaded raises."""
        from megatron.energon.epathlib import EPath
        from megatron.energon.flavors.webdataset.itar_reader import ShardInfosITarReader
        from megatron.energon.flavors.webdataset.structs import ShardInfo

        if self.cooker is None:
            raise ValueError(f"no cooker of {type(self.task_encoder).__name__} matches the subflavors "
                             f"{self.subflavors}")
        root = EPath(self.root)
        reader = ShardInfosITarReader(root, [ShardInfo(name=shard, path=root / shard, count=count)])
        try:
            for index in indices:
                raw = reader[index]
                crude = {"__key__": raw["__key__"],
                         **{name: value for name, value in raw.items() if not name.startswith("__")},
                         "__restore_key__": raw["__restore_key__"], "__subflavors__": self.subflavors,
                         "__sources__": ()}
                cooked = self.task_encoder.cook_crude_sample(crude, self.cooker, {})
                encoded = self.task_encoder.encode_sample(cooked)
                yield from (encoded if pyinspect.isgenerator(encoded) else [encoded])
        finally:
            reader.close()


def check_drawn(ds: Dataset, output: Output, encoding: Encoding, inspector: Any, splits: dict[str, Any],
                progress: Any = None) -> list[Check]:
    """One sample drawn from every shard loaded and inspected; ``splits[split]["loaded"]`` is filled in."""
    checks = []
    with warnings.catch_warnings(), output.energon_access() as path:
        warnings.filterwarnings("ignore", message=".*pin_memory.*")
        reader = SampleReader(path, encoding.name, ds.layout_subflavors)
        for split, info in splits.items():
            problems = Findings(f"load {split}")
            shards = split_shards(ds, split)
            loaded = 0
            for done, shard in enumerate(shards, start=1):
                count = ds.info[shard]
                index = drawn_index(shard, count)
                try:
                    for sample in reader.samples(shard, count, [index]):
                        inspector.inspect(sample)
                    loaded += 1
                except Exception as error:  # noqa: BLE001 - a sample that does not load is a finding
                    problems.add(f"{shard} sample {index} (the drawn one) failed to load: "
                                 f"{type(error).__name__}: {error}")
                if progress is not None and (done % 100 == 0 or done == len(shards)):
                    progress(f"load {split}", done, len(shards))
            info["loaded"] = loaded
            checks.append(problems.check(
                f"{loaded} of {info['samples']} samples loaded: one drawn from each of its {len(shards)} shards "
                "(--full loads every sample)"))
    return checks + inspector.checks()


def _load_piece(root: str, encoding: str, subflavors: dict[str, Any] | None, shard: str, count: int, start: int,
                stop: int) -> tuple[list[Any], str | None]:
    """A pool job: the cooked samples ``start:stop`` of ``shard``, and the first error (then the samples before
    it). Runs in a worker process."""
    warnings.filterwarnings("ignore", message=".*pin_memory.*")
    samples: list[Any] = []
    try:
        for sample in SampleReader(root, encoding, subflavors).samples(shard, count, range(start, stop)):
            samples.append(sample)
    except Exception as error:  # noqa: BLE001 - reported as the one-process loader reports it
        return samples, f"{type(error).__name__}: {error}"
    return samples, None


def load_in_processes(ds: Dataset, output: Output, encoding: Encoding, inspector: Any, splits: dict[str, Any],
                      workers: int, progress: Any = None) -> list[Check]:
    """Every sample of every split, read and cooked by ``workers`` processes, inspected here in the one-process
    loader's order; the checks read as ``checks.check_loading``'s."""
    checks = []
    context = multiprocessing.get_context("spawn")  # clean workers: this process may hold a Prefect client
    with ProcessPoolExecutor(max_workers=workers, mp_context=context) as pool:
        for split, info in splits.items():
            problems = Findings(f"load {split}")
            total = info["samples"]
            jobs = ((shard, start, min(start + PIECE, ds.info[shard])) for shard in split_shards(ds, split)
                    for start in range(0, ds.info[shard], PIECE))
            pending: deque[Future] = deque()
            loaded, failure = 0, None
            root = str(output.local)
            while True:
                while len(pending) < AHEAD * workers and (job := next(jobs, None)) is not None:
                    shard, start, stop = job
                    pending.append(pool.submit(_load_piece, root, encoding.name, ds.layout_subflavors, shard,
                                               ds.info[shard], start, stop))
                if not pending:
                    break
                samples, failure = pending.popleft().result()
                for sample in samples:
                    loaded += 1
                    inspector.inspect(sample)
                    if progress is not None and (loaded % 100 == 0 or loaded == total):
                        progress(f"load {split}", loaded, total)
                if failure is not None:
                    for future in pending:
                        future.cancel()
                    break
            if failure is not None:
                problems.add(f"loading failed after {loaded} samples: {failure}")
            elif loaded != total:
                problems.add(f"Energon yielded {loaded} samples, {contract.INFO_JSON} counts {total}")
            info["loaded"] = loaded
            checks.append(problems.check(f"{loaded} of {total} samples loaded through Energon"))
    return checks + inspector.checks()


__all__ = ["SampleReader", "check_drawn", "drawn_index", "load_in_processes", "split_shards"]
