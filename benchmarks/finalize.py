"""Finalize's time against the shard and sample counts: diffprep's index from the writer's records against
Energon's prepare (what finalize ran before), over the same shards, in one run.

The shards are tiny synthetic ones written by the real ``ShardWriter`` (small random tensors, a caption and a
meta per sample: five tar members) with a committed ``UnitManifest`` per unit. Each case is written once; every
round finalizes a fresh copy of it (finalize writes ``.nv-meta/`` and the ``.tar.idx`` files), so only finalize
is timed. A case is ``SHARDSxSAMPLES`` (shards x samples per shard).

For each method the growth exponent is printed between the cases of equal shard size (in the shard count) and
between the cases of equal shard count (in the samples per shard), and the time is extrapolated linearly to
100M samples from the case with the most samples. Target: every exponent <= 1.05 for the records path.

    python benchmarks/finalize.py                                # 100x4 and 1000x4, quick
    python benchmarks/finalize.py --cases 100x10 1000x10 10000x10 10x1000 100x1000 --prepare --rounds 1
    python benchmarks/finalize.py --cases 100x1000 --profile     # cProfile of the largest case
"""

from __future__ import annotations

import argparse
import cProfile
import io
import math
import pstats
import resource
import shutil
import sys
import time
from pathlib import Path

import _env  # first: offline environment, --malloc re-exec before torch is imported

# isort: split

import _common as c
import torch

from diffprep import contract
from diffprep.run.energon import assign_splits, finalize
from diffprep.writer.shards import ShardWriter, UnitManifest, write_manifest

TARGET_EXPONENT = 1.05
TARGET_SAMPLES = 100_000_000


def parse_case(text: str) -> tuple[int, int]:
    shards, _, samples = text.lower().partition("x")
    if not (shards.isdigit() and samples.isdigit()) or int(shards) < 3 or int(samples) < 1:
        raise argparse.ArgumentTypeError(f"a case is SHARDSxSAMPLES with at least 3 shards, e.g. 1000x10, not {text!r}")
    return int(shards), int(samples)


def write_shards(out: Path, shards: int, samples: int) -> None:
    """``shards`` committed units of ``samples`` samples each (latents [16, 4, 4], T5 [16, 32], pooled [32])."""
    generator = torch.Generator().manual_seed(0)
    for unit in range(shards):
        keys = []
        with ShardWriter(out, unit) as writer:
            for index in range(samples):
                key = contract.sample_key(unit, index)
                writer.write(key, {
                    contract.LATENTS: torch.randn(16, 4, 4, generator=generator),
                    contract.PROMPT_EMBEDS: torch.randn(16, 32, generator=generator),
                    contract.POOLED_PROMPT_EMBEDS: torch.randn(32, generator=generator),
                    contract.CAPTION: f"caption {unit} {index}",
                    contract.META: {"source_id": f"img{unit:06d}_{index}.png"},
                })
                keys.append(key)
            info = writer.commit()
        write_manifest(out, UnitManifest(unit=unit, shard=info.name, fingerprint="benchmark", keys=keys,
                                         source_ids=[f"img{unit:06d}_{i}.png" for i in range(samples)],
                                         count=info.count, bytes=info.bytes, sha256=info.sha256))


def run_records(target: Path, shards: int, args: argparse.Namespace) -> None:
    """diffprep's finalize: the index from the writer's records (a local output)."""
    result = finalize(target, encoding=contract.ENCODING_PREENCODED, train_split=args.train_split,
                      workers=args.workers)
    if sum(len(names) for names in result.splits.values()) != shards:
        raise RuntimeError(f"finalize indexed {result.splits} of {shards} shards")


def run_prepare(target: Path, shards: int, args: argparse.Namespace) -> None:
    """Energon's prepare over the same shards and splits, as finalize ran it before (exact-name split patterns)."""
    from megatron.energon.flavors.webdataset.base_webdataset import BaseWebdatasetFactory

    names = [contract.shard_name(unit) for unit in range(shards)]
    assignment = assign_splits(names, {}, args.train_split, 42)
    patterns = [(split, "^(?:" + "|".join(n.removesuffix(".tar") for n in names if assignment[n] == split)
                 + ")[.]tar$") for split in contract.SPLITS if split in assignment.values()]
    BaseWebdatasetFactory.prepare_dataset(target, names, split_parts_patterns=patterns,
                                          split_config=contract.SPLIT_YAML, shuffle_seed=None, workers=args.workers)


METHODS = {"records": run_records, "prepare": run_prepare}


def cpu_seconds() -> float:
    """CPU time of this process and its finished children (prepare's worker processes): on a machine shared with
    other work this is what grows with the shards, while the wall time also holds the waits for a core."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def timed(method: str, template: Path, target: Path, shards: int, args: argparse.Namespace,
          profiler: cProfile.Profile | None = None) -> tuple[float, float]:
    """(wall, CPU) seconds of one finalize of a fresh copy of ``template``."""
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(template, target)
    cpu, start = cpu_seconds(), time.perf_counter()
    if profiler is not None:
        profiler.enable()
    METHODS[method](target, shards, args)
    if profiler is not None:
        profiler.disable()
    return time.perf_counter() - start, cpu_seconds() - cpu


def exponent(small: tuple[float, int], large: tuple[float, int]) -> float:
    return math.log(large[0] / small[0]) / math.log(large[1] / small[1])


def growth(seconds: dict[tuple[int, int], float]) -> list[tuple[str, float]]:
    """(label, exponent) between the smallest and largest case of each equal shard size and equal shard count."""
    found = []
    for size in sorted({samples for _, samples in seconds}):
        row = sorted(case for case in seconds if case[1] == size)
        if len(row) > 1:
            a, b = row[0], row[-1]
            found.append((f"shards {a[0]}->{b[0]} at {size}/shard", exponent((seconds[a], a[0]), (seconds[b], b[0]))))
    for count in sorted({shards for shards, _ in seconds}):
        row = sorted(case for case in seconds if case[0] == count)
        if len(row) > 1:
            a, b = row[0], row[-1]
            found.append((f"samples/shard {a[1]}->{b[1]} at {count} shards",
                          exponent((seconds[a], a[1]), (seconds[b], b[1]))))
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    c.add_common_flags(parser)
    parser.add_argument("--cases", type=parse_case, nargs="+", default=[(100, 4), (1000, 4)],
                        help="SHARDSxSAMPLES cases (default 100x4 1000x4)")
    parser.add_argument("--prepare", action="store_true", help="also time Energon's prepare over the same shards")
    parser.add_argument("--rounds", type=int, default=2, help="finalizes per case and method, interleaved (default 2)")
    parser.add_argument("--workers", type=int, default=2, help="Energon prepare processes (default 2)")
    parser.add_argument("--train-split", type=float, default=0.8)
    parser.add_argument("--profile", action="store_true", help="print a cProfile of each method on the largest case")
    args = parser.parse_args(argv)
    cases = sorted(set(args.cases), key=lambda case: (case[0] * case[1], case))
    methods = ["records", "prepare"] if args.prepare else ["records"]
    print(f"finalize: {c.describe_machine()}")
    scratch, cleanup = c.work_dir(args.work_dir)
    times: dict[str, dict[tuple[int, int], list[float]]] = {m: {case: [] for case in cases} for m in methods}
    cpus: dict[str, dict[tuple[int, int], list[float]]] = {m: {case: [] for case in cases} for m in methods}
    try:
        templates = {}
        for shards, samples in cases:
            start = time.perf_counter()
            templates[shards, samples] = scratch / f"shards-{shards}x{samples}"
            write_shards(templates[shards, samples], shards, samples)
            print(f"  wrote {shards} shards x {samples} samples in {time.perf_counter() - start:.1f} s", flush=True)
        for method in methods:  # untimed: Energon's imports (several seconds) land on no case
            timed(method, templates[cases[0]], scratch / "target", cases[0][0], args)
        # Interleaved like every benchmark here (A B B A); the copy of the template is not timed.
        for r in range(args.rounds):
            for case in cases if r % 2 == 0 else cases[::-1]:
                for method in methods if r % 2 == 0 else methods[::-1]:
                    wall, cpu = timed(method, templates[case], scratch / "target", case[0], args)
                    times[method][case].append(wall)
                    cpus[method][case].append(cpu)
                    print(f"    round {r + 1}: {method:7s} {case[0]:6d} x {case[1]:5d}: {wall:8.2f} s, "
                          f"CPU {cpu:8.2f} s", flush=True)
        if args.profile:
            for method in methods:
                profiler = cProfile.Profile()
                timed(method, templates[cases[-1]], scratch / "target", cases[-1][0], args, profiler)
                text = io.StringIO()
                pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(25)
                print(f"--- {method}, {cases[-1][0]} x {cases[-1][1]} (main process only)\n{text.getvalue()}")
    finally:
        cleanup()
    seconds = {m: {case: c.best(times[m][case]) for case in cases} for m in methods}
    cpu = {m: {case: c.best(cpus[m][case]) for case in cases} for m in methods}
    for case in cases:
        line = "   ".join(f"{m} {seconds[m][case]:7.2f} s (CPU {cpu[m][case]:7.2f} s)" for m in methods)
        ratio = (f"   prepare / records: wall {seconds['prepare'][case] / seconds['records'][case]:.1f}, "
                 f"CPU {cpu['prepare'][case] / cpu['records'][case]:.1f}" if args.prepare else "")
        print(f"  {case[0]:6d} x {case[1]:5d} ({case[0] * case[1]:8d} samples): {line}{ratio}")
    largest = max(cases, key=lambda case: (case[0] * case[1], case[1]))
    exponents = []
    for m in methods:
        for label, value in growth(seconds[m]):
            print(f"  {m}: exponent {value:5.2f} in {label} (CPU {dict(growth(cpu[m]))[label]:5.2f})")
            if m == "records":
                exponents.append(value)
        scale = TARGET_SAMPLES / (largest[0] * largest[1]) / 3600
        print(f"  {m}: {seconds[m][largest] * scale:.2f} h wall, {cpu[m][largest] * scale:.2f} h CPU at "
              f"{TARGET_SAMPLES:,} samples ({largest[1]} per shard, linear from {largest[0] * largest[1]:,})")
    if exponents:
        worst = max(exponents)
        print(f"\nSUMMARY finalize: records path, worst growth exponent {worst:.2f} (target <= {TARGET_EXPONENT}: "
              f"{c.verdict(worst, TARGET_EXPONENT, at_most=True)}) [{_env.malloc_description()}]")
    else:
        print("\nSUMMARY finalize: one case, no growth exponent (give --cases of equal shard size or count)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
