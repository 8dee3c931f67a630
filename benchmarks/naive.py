"""The library's encode path against a naive reference loop, on the same inputs and encoders.

The naive loop (``_common.encode_naively``) reads a batch, decodes it with
``diffprep.media.images.prepare_image`` on one thread, encodes it, writes it with
``ShardWriter`` and only then reads the next: nothing overlaps. The library
path is ``diffprep.run.units.encode_unit`` (decode threads and a prefetch queue
running ahead of the encoders). Both write the same shards; the script checks
that they are byte-identical, so both did the same work.

Target: >= 1.5x in the input-bound configuration on 2 cores (more with more
cores). The compute-bound configuration is shown for reference: there the
encoders set the pace and the two should be about equal.

    python benchmarks/naive.py
    python benchmarks/naive.py --only input --samples 256 --rounds 3
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import _env  # first: offline environment, --malloc re-exec before torch is imported

# isort: split

import _common as c

TARGET_INPUT = 1.5


def measure(config: c.Config, cache: Path, scratch: Path, rounds: int) -> dict:
    print(f"\n== {config.describe()}", flush=True)
    setup = c.prepare(config, cache, scratch)
    c.warm_up(setup, c.decoded_batches(setup)[:1])
    naive_out = scratch / f"naive-{config.name}"
    times = c.interleaved(rounds, {
        "naive loop": lambda: c.encode_naively(setup, naive_out),
        "encode_unit": lambda: c.encode_with_library(setup),
    })
    identical = c.shard_hashes(naive_out) == c.shard_hashes(setup.out_dir)
    n = config.samples
    naive = n / c.best(times["naive loop"])
    library = n / c.best(times["encode_unit"])
    speedup = library / naive
    print(f"  naive loop   {naive:8.2f} samples/s")
    print(f"  encode_unit  {library:8.2f} samples/s")
    print(f"  speed-up     {speedup:8.2f}x   (shards byte-identical: {'yes' if identical else 'NO'})")
    return {"speedup": speedup, "identical": identical}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    c.add_common_flags(parser)
    c.add_config_flags(parser)
    parser.add_argument("--only", choices=sorted(c.CONFIGS), default=None, help="one configuration only")
    args = parser.parse_args(argv)
    c.apply_torch_threads(args)
    print(f"naive: {c.describe_machine()}")
    cache = c.cache_dir(args.cache_dir)
    scratch, cleanup = c.work_dir(args.work_dir)
    try:
        names = [args.only] if args.only else ["input", "compute"]
        results = {name: measure(c.config_from(c.CONFIGS[name], args), cache, scratch, args.rounds)
                   for name in names}
    finally:
        cleanup()
    parts = []
    if "input" in results:
        r = results["input"]
        parts.append(f"input-bound {r['speedup']:.2f}x (target >= {TARGET_INPUT}x: "
                     f"{c.verdict(r['speedup'], TARGET_INPUT)})")
    if "compute" in results:
        parts.append(f"compute-bound {results['compute']['speedup']:.2f}x (reference, no target)")
    if not all(r["identical"] for r in results.values()):
        parts.append("WARNING: shards differ between the two paths")
    print(f"\nSUMMARY naive: encode_unit vs naive loop: {'; '.join(parts)} [{_env.malloc_description()}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
