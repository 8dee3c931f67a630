"""Peak memory of encoding N samples against 4N samples: it must be bounded by a unit, not by the dataset.

Each measurement runs in a fresh subprocess: ``fetch`` a plan over a directory
source, load the encoders, then ``encode_unit`` every unit (``shard_size``
samples each, so 4N samples is 4x the units). The child reports its peak RSS
(``resource.getrusage(RUSAGE_SELF).ru_maxrss``) and its peak before the first
unit (imports, encoders and one warm-up batch loaded: the floor every run pays).

Target: peak RSS for 4N grows by < 10% over N.

    python benchmarks/memory.py                    # N = 64 (2 units), 4N = 256 (8 units)
    python benchmarks/memory.py --samples 256 --config compute
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

import _env  # first: offline environment, --malloc re-exec before torch is imported

# isort: split

import _common as c

TARGET_GROWTH = 0.10
MIB = 1024 * 1024


def child(args: argparse.Namespace) -> int:
    """One measurement: encode every unit of ``args.samples`` samples and print a JSON line."""
    config = c.config_from(c.CONFIGS[args.config], args)
    cache = c.cache_dir(args.cache_dir)
    scratch, cleanup = c.work_dir(args.work_dir)
    try:
        # The source holds 4N images for both runs, so N and 4N read the same files (max_samples cuts it).
        setup = c.prepare(config, cache, scratch, source_count=args.source_count)
        c.warm_up(setup, c.decoded_batches(setup)[:1])
        floor = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        start = time.perf_counter()
        count = c.encode_with_library(setup)
        seconds = time.perf_counter() - start
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    finally:
        cleanup()
    print(json.dumps({"samples": count, "units": len(setup.plan.units), "floor": floor, "peak": peak,
                      "seconds": seconds}))
    return 0


def run_child(args: argparse.Namespace, samples: int, source_count: int) -> dict:
    command = [sys.executable, os.path.abspath(__file__), "--child", "--config", args.config,
               "--samples", str(samples), "--source-count", str(source_count), "--malloc", "inherit"]
    for flag in ("cache_dir", "work_dir", "batch_size", "decode_workers", "precision", "image_size", "t5_max_length",
                 "torch_threads"):
        value = getattr(args, flag)
        if value is not None:
            command += [f"--{flag.replace('_', '-')}", str(value)]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"child for {samples} samples failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    c.add_common_flags(parser)
    c.add_config_flags(parser)
    parser.add_argument("--config", choices=sorted(c.CONFIGS), default="input",
                        help="encoders and sizes (default input: tiny encoders, 1024 px JPEGs)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.set_defaults(rounds=2)  # each round is two fresh processes
    parser.add_argument("--source-count", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        c.apply_torch_threads(args)
        return child(args)

    base = c.config_from(c.CONFIGS[args.config], args)
    n = base.samples
    print(f"memory: {c.describe_machine()}")
    print(f"== {base.describe()}; N = {n} ({n // base.shard_size} units), 4N = {4 * n} "
          f"({4 * n // base.shard_size} units); one fresh process per run")
    c.jpeg_source(c.cache_dir(args.cache_dir), 4 * n, base.source_px)  # written once, before any timing
    runs: dict[int, list[dict]] = {n: [], 4 * n: []}
    for r in range(args.rounds):
        for samples in ([n, 4 * n] if r % 2 == 0 else [4 * n, n]):
            result = run_child(args, samples, 4 * n)
            runs[samples].append(result)
            print(f"    round {r + 1}: {samples:5d} samples ({result['units']} units): "
                  f"peak {result['peak'] / MIB:7.1f} "
                  f"MiB, floor {result['floor'] / MIB:7.1f} MiB, {result['seconds']:.1f} s", flush=True)
    peak = {k: max(r["peak"] for r in v) for k, v in runs.items()}
    above = {k: max(r["peak"] - r["floor"] for r in v) for k, v in runs.items()}
    growth = peak[4 * n] / peak[n] - 1
    print(f"  peak RSS      N: {peak[n] / MIB:8.1f} MiB   4N: {peak[4 * n] / MIB:8.1f} MiB   growth {growth:+.1%}")
    print(f"  above floor   N: {above[n] / MIB:8.1f} MiB   4N: {above[4 * n] / MIB:8.1f} MiB "
          "(what encoding added on top of imports, encoders and one batch)")
    print(f"\nSUMMARY memory: peak RSS {peak[n] / MIB:.0f} MiB for {n} samples, {peak[4 * n] / MIB:.0f} MiB for "
          f"{4 * n}: {growth:+.1%} (target < {TARGET_GROWTH:.0%}: {c.verdict(growth, TARGET_GROWTH, at_most=True)}) "
          f"[{_env.malloc_description()}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
