"""Peak memory of encoding N samples against 4N samples: it must be bounded by a unit, not by the dataset.

Each measurement runs in a fresh subprocess: ``fetch`` a plan over a directory
source, load the encoders, then ``encode_unit`` every unit (``shard_size``
samples each, so 4N samples is 4x the units). The child reports its peak RSS
(``resource.getrusage(RUSAGE_SELF).ru_maxrss``) and its peak before the first
unit (imports, encoders and one warm-up batch loaded: the floor every run pays).

Target: peak RSS for 4N grows by < 10% over N.

``--allocator`` (default ``both``): every size is measured twice per round,
children started with ``MALLOC_*`` unset, once with ``diffprep.run.allocator.tune_malloc()``
called first (how ``diffprep`` runs) and once with glibc's defaults: what the
allocator setting costs in peak RSS, same run. ``env``: one measurement per
size, children inheriting this process's environment (``--malloc``).

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
    if args.tune_malloc:
        from diffprep.run.allocator import tune_malloc

        if not tune_malloc().applied:
            raise RuntimeError(f"tune_malloc did not apply: {tune_malloc().reason}")
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


ALLOCATORS = {"diffprep": "diffprep's tune_malloc", "default": "glibc defaults", "env": "inherited environment"}


def run_child(args: argparse.Namespace, samples: int, source_count: int, allocator: str = "env") -> dict:
    command = [sys.executable, os.path.abspath(__file__), "--child", "--config", args.config,
               "--samples", str(samples), "--source-count", str(source_count), "--malloc", "inherit"]
    env = dict(os.environ)
    if allocator != "env":
        env = {k: v for k, v in env.items() if k not in (*_env.MALLOC_VARS, "DIFFPREP_MALLOC_TUNING")}
    if allocator == "diffprep":
        command.append("--tune-malloc")
    for flag in ("cache_dir", "work_dir", "batch_size", "decode_workers", "precision", "image_size", "t5_max_length",
                 "torch_threads"):
        value = getattr(args, flag)
        if value is not None:
            command += [f"--{flag.replace('_', '-')}", str(value)]
    done = subprocess.run(command, capture_output=True, text=True, check=False, env=env)
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
    parser.add_argument("--tune-malloc", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--allocator", choices=["both", "diffprep", "default", "env"], default="both",
                        help="children's malloc settings (see the module docstring; default %(default)s)")
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
    allocators = ["diffprep", "default"] if args.allocator == "both" else [args.allocator]
    runs: dict[tuple[str, int], list[dict]] = {(a, k): [] for a in allocators for k in (n, 4 * n)}
    for r in range(args.rounds):
        order = [(a, k) for a in allocators for k in (n, 4 * n)]
        for allocator, samples in (order if r % 2 == 0 else order[::-1]):
            result = run_child(args, samples, 4 * n, allocator)
            runs[allocator, samples].append(result)
            print(f"    round {r + 1}: {ALLOCATORS[allocator]:<22} {samples:5d} samples ({result['units']} units): "
                  f"peak {result['peak'] / MIB:7.1f} MiB, floor {result['floor'] / MIB:7.1f} MiB, "
                  f"{result['seconds']:.1f} s", flush=True)
    peak = {key: max(r["peak"] for r in v) for key, v in runs.items()}
    above = {key: max(r["peak"] - r["floor"] for r in v) for key, v in runs.items()}
    fastest = {key: min(r["seconds"] for r in v) for key, v in runs.items()}
    growth = {a: peak[a, 4 * n] / peak[a, n] - 1 for a in allocators}
    for a in allocators:
        print(f"  {ALLOCATORS[a]}:")
        print(f"    peak RSS      N: {peak[a, n] / MIB:8.1f} MiB   4N: {peak[a, 4 * n] / MIB:8.1f} MiB   "
              f"growth {growth[a]:+.1%}")
        print(f"    above floor   N: {above[a, n] / MIB:8.1f} MiB   4N: {above[a, 4 * n] / MIB:8.1f} MiB "
              "(what encoding added on top of imports, encoders and one batch)")
        print(f"    encode time   N: {fastest[a, n]:8.1f} s     4N: {fastest[a, 4 * n]:8.1f} s (fastest run)")
    main_side = allocators[0]
    cost = ""
    if len(allocators) == 2:
        extra = peak["diffprep", 4 * n] / peak["default", 4 * n] - 1
        speed = fastest["default", 4 * n] / fastest["diffprep", 4 * n]
        print(f"  allocator setting at 4N: peak RSS {extra:+.1%} "
              f"({(peak['diffprep', 4 * n] - peak['default', 4 * n]) / MIB:+.0f} MiB), encoding {speed:.2f}x as fast")
        cost = f"; tune_malloc costs {extra:+.1%} peak RSS at 4N for {speed:.2f}x encode speed"
    print(f"\nSUMMARY memory: peak RSS {peak[main_side, n] / MIB:.0f} MiB for {n} samples, "
          f"{peak[main_side, 4 * n] / MIB:.0f} MiB for {4 * n}: {growth[main_side]:+.1%} "
          f"(target < {TARGET_GROWTH:.0%}: "
          f"{c.verdict(growth[main_side], TARGET_GROWTH, at_most=True)}) [{ALLOCATORS[main_side]}]{cost}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
