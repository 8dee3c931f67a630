"""The plan phase at 10k, 100k and 1M samples: plan.json with every id inline (before issue 37) against units
with their lists beside it (``diffprep.writer.unit_lists``).

Plan only: a synthetic listing of N ids (no source is opened), cut into units of 1000 and written to a
folder; then the plan is read back as a unit's worker does (plan.json, the sample count, one unit's ids).
Each step runs in a fresh process of its own so that its peak RSS is its own; RSS is reported over the
process's RSS after its imports. "old" is the planner as it was (sets of every id, the ids inline in
plan.json, kept here as the reference); "new" is ``diffprep.writer.plan``. Printed: seconds and peak RSS of
each step, new/old ratios at each size, and each step's growth exponent from the smallest size to the
largest (time ~ N^k).

    python benchmarks/plan_scale.py
    python benchmarks/plan_scale.py --sizes 10000 100000      # quicker
    python benchmarks/plan_scale.py --order random            # ids in no order (hashed names)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SHARD_SIZE = 1000


ORDER = os.environ.get("PLAN_SCALE_ORDER", "sorted")


def listing(n: int):
    """Ids as a large video source names them; a lazy stream (the source's, not the plan's). ``--order random``:
    ids in no order (hashed names, as a metadata file's rows or an object store's uuids come)."""
    if ORDER == "random":
        return (hashlib.blake2b(str(i).encode(), digest_size=12).hexdigest() + ".mp4" for i in range(n))
    return (f"clips/part-{i // 10000:05d}/clip-{i:09d}.mp4" for i in range(n))


def rss_kib() -> int:
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def old_plan(ids, shard_size: int) -> list[dict]:
    """The planner before issue 37 (diffprep/writer/plan.py at 3543500), reduced to a fresh plan's path: a set of
    every planned id, a set of every new id, every unit's ids in memory."""
    planned: set[str] = set()
    seen_new: set[str] = set()
    units, current = [], []
    for sid in ids:
        if sid in planned:
            continue
        if sid in seen_new:
            raise ValueError(sid)
        seen_new.add(sid)
        current.append(sid)
        if len(current) == shard_size:
            units.append({"unit": len(units), "source_ids": list(current)})
            current.clear()
    if current:
        units.append({"unit": len(units), "source_ids": current})
    return units


def step(kind: str, variant: str, n: int, folder: str) -> dict:
    """One measured step in this process: ``plan`` or ``reload``, ``old`` or ``new``."""
    from diffprep import contract
    from diffprep.writer.plan import Plan, fingerprint, plan_units, read_plan, write_plan
    from diffprep.writer.shards import atomic_write_json

    settings = {"shard_size": SHARD_SIZE}
    base = rss_kib()
    start = time.perf_counter()
    if kind == "plan":
        if variant == "old":
            units = old_plan(listing(n), SHARD_SIZE)
            data = {"fingerprint": fingerprint(settings), "settings": settings, "source": {}, "expected": {},
                    "units": units, "encoding": contract.ENCODING_PREENCODED, "missing": [], "missing_count": 0,
                    "version": contract.CONTRACT_VERSION, "split": None}
            path = Path(folder) / contract.STATE_DIR / contract.PLAN_JSON
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_json(path, data)
            samples = sum(len(u["source_ids"]) for u in units)
        else:
            units, _, _ = plan_units(listing(n), shard_size=SHARD_SIZE)
            write_plan(folder, Plan(fingerprint(settings), settings, {}, {}, units))
            samples = sum(u.count for u in units)
    else:  # a unit's worker: the plan, its sample count, one unit's ids (old plans are read as they always were)
        plan = read_plan(folder)
        samples = plan.total_samples
        assert len(plan.unit(len(plan.units) // 2).source_ids) == SHARD_SIZE
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    assert samples == n, (samples, n)
    return {"seconds": seconds, "rss_mib": max(0, peak - base) / 1024}


def measure(kind: str, variant: str, n: int, folder: str) -> dict:
    """``step`` in a fresh interpreter (its own peak RSS)."""
    out = subprocess.run([sys.executable, __file__, "--step", kind, variant, str(n), folder],
                         check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def exponent(small: float, large: float, n_small: int, n_large: int) -> float:
    return math.log(max(large, 1e-6) / max(small, 1e-6)) / math.log(n_large / n_small)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    parser.add_argument("--order", choices=("sorted", "random"), default=ORDER,
                        help="the listing's ids in sorted order (a directory) or in none (a metadata file's rows)")
    parser.add_argument("--step", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    os.environ["PLAN_SCALE_ORDER"] = args.order  # the measured steps' processes list the same ids
    if args.step:
        kind, variant, n, folder = args.step
        print(json.dumps(step(kind, variant, int(n), folder)))
        return
    results: dict[tuple[str, str, int], dict] = {}
    with tempfile.TemporaryDirectory(prefix="plan-scale-") as work:
        for n in args.sizes:
            for variant in ("old", "new"):
                folder = os.path.join(work, f"{variant}-{n}")
                for kind in ("plan", "reload"):
                    results[kind, variant, n] = r = measure(kind, variant, n, folder)
                    print(f"{kind:6} {variant} {n:>9,}: {r['seconds']:7.2f} s, peak RSS +{r['rss_mib']:7.1f} MiB",
                          flush=True)
                plan_json = Path(folder) / ".diffprep" / "plan.json"
                print(f"       {variant} {n:>9,}: plan.json {plan_json.stat().st_size / 1e6:.2f} MB", flush=True)
    print("\nnew / old (time, peak RSS over imports):")
    for n in args.sizes:
        for kind in ("plan", "reload"):
            old, new = results[kind, "old", n], results[kind, "new", n]
            print(f"  {kind:6} {n:>9,}: time {new['seconds'] / old['seconds']:.2f}x, "
                  f"RSS {new['rss_mib'] / max(old['rss_mib'], 0.1):.2f}x")
    small, large = args.sizes[0], args.sizes[-1]
    print(f"\ngrowth exponents from {small:,} to {large:,} (time ~ N^k; RSS ratio {large:,} / {small:,}):")
    for kind in ("plan", "reload"):
        for variant in ("old", "new"):
            a, b = results[kind, variant, small], results[kind, variant, large]
            print(f"  {kind:6} {variant}: time k = {exponent(a['seconds'], b['seconds'], small, large):.2f}, "
                  f"RSS +{a['rss_mib']:.1f} -> +{b['rss_mib']:.1f} MiB")


if __name__ == "__main__":
    main()
