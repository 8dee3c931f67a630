"""Time to finalize 100 and 1000 shards with ``diffprep.run.energon.finalize``: it must grow at most linearly.

The shards are tiny synthetic ones, written as the tests write them: the real
``ShardWriter`` (a few samples of small random tensors each) and a committed
``UnitManifest`` per unit. Each size is written once; every round finalizes a
fresh copy of it (Energon prepare writes ``.nv-meta/`` and ``.tar.idx``
files), so only ``finalize`` is timed.

Target: t(1000) / t(100) <= 10 (linear).

    python benchmarks/finalize.py
    python benchmarks/finalize.py --sizes 100 1000 5000 --profile
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import shutil
import sys
import time
from pathlib import Path

import _env  # first: offline environment, --malloc re-exec before torch is imported

# isort: split

import _common as c
import torch

from diffprep import contract
from diffprep.run.energon import finalize
from diffprep.writer.shards import ShardWriter, UnitManifest, write_manifest

TARGET_RATIO = 10.0


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


def run_finalize(template: Path, target: Path, args: argparse.Namespace) -> float:
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(template, target)
    start = time.perf_counter()
    result = finalize(target, encoding=contract.ENCODING_PREENCODED, train_split=args.train_split,
                      workers=args.workers)
    seconds = time.perf_counter() - start
    shards = sum(len(names) for names in result.splits.values())
    if shards != len(list(template.glob(f"*{contract.SHARD_SUFFIX}"))):
        raise RuntimeError(f"finalize indexed {shards} shards of {template}")
    return seconds


def profile_finalize(template: Path, target: Path, args: argparse.Namespace) -> str:
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(template, target)
    profiler = cProfile.Profile()
    profiler.enable()
    finalize(target, encoding=contract.ENCODING_PREENCODED, train_split=args.train_split, workers=args.workers)
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(25)
    return text.getvalue()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    c.add_common_flags(parser)
    parser.add_argument("--sizes", type=int, nargs="+", default=[100, 1000],
                        help="shard counts to finalize (default 100 1000); the ratio is last / first")
    parser.add_argument("--samples-per-shard", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2, help="finalizes per size, interleaved (default 2)")
    parser.add_argument("--workers", type=int, default=2, help="Energon prepare processes (default 2)")
    parser.add_argument("--train-split", type=float, default=0.8)
    parser.add_argument("--profile", action="store_true", help="print a cProfile of finalizing the largest size")
    args = parser.parse_args(argv)
    sizes = sorted(set(args.sizes))
    if len(sizes) < 2:
        parser.error("--sizes needs at least two different shard counts")
    print(f"finalize: {c.describe_machine()}")
    scratch, cleanup = c.work_dir(args.work_dir)
    try:
        templates = {}
        for size in sizes:
            start = time.perf_counter()
            templates[size] = scratch / f"shards-{size}"
            write_shards(templates[size], size, args.samples_per_shard)
            print(f"  wrote {size} shards x {args.samples_per_shard} samples in {time.perf_counter() - start:.1f} s",
                  flush=True)
        # Interleaved like every benchmark here; the copy of the template is not timed.
        times: dict[int, list[float]] = {size: [] for size in sizes}
        for r in range(args.rounds):
            for size in sizes if r % 2 == 0 else sizes[::-1]:
                times[size].append(run_finalize(templates[size], scratch / "target", args))
                print(f"    round {r + 1}: finalize {size:6d} shards {times[size][-1]:8.2f} s", flush=True)
        if args.profile:
            print(profile_finalize(templates[sizes[-1]], scratch / "target", args))
    finally:
        cleanup()
    seconds = {size: c.best(times[size]) for size in sizes}
    for size in sizes:
        print(f"  {size:6d} shards: {seconds[size]:7.2f} s   ({seconds[size] / size * 1000:6.2f} ms per shard)")
    small, large = sizes[0], sizes[-1]
    ratio = seconds[large] / seconds[small]
    linear = large / small
    print(f"\nSUMMARY finalize: {small} shards {seconds[small]:.2f} s, {large} shards {seconds[large]:.2f} s: ratio "
          f"{ratio:.2f} for {linear:.0f}x the shards (target <= {linear:.0f}: {c.verdict(ratio, linear, at_most=True)})"
          f" [{_env.malloc_description()}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
