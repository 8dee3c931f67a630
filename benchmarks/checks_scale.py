"""How the checks after the encode grow: audit, and validation by default, with --full, and --full in 2 processes.

A captions-only (``raw --prompts-only``) dataset is written directly with the real ``ShardWriter`` (``txt`` and
``json`` per sample, 1000 samples per shard, a committed manifest per unit and a plan), finalized once, then
each check is timed alone at every size:

- ``audit``: plan, manifests (one at a time) and shards (size and sha256; headers only where they differ);
- ``audit x2``: the same with ``workers=2``;
- ``validate``: the default (every shard's headers, count and digest; one sample drawn from each shard loaded);
- ``validate --full``: every sample through Energon's loader, one process;
- ``validate --full x2``: every sample read by 2 processes, inspected here.

Prints each time, the ratios to ``validate --full`` at the same size, and each check's growth exponent
log(t2/t1)/log(n2/n1) between consecutive sizes (1.0: linear in the samples). Times on a shared machine are
noisy: each figure is the best of ``--rounds``.

    python benchmarks/checks_scale.py                       # 10k and 100k samples
    python benchmarks/checks_scale.py --sizes 10000 30000 --rounds 1
"""

from __future__ import annotations

import argparse
import math
import shutil
import tempfile
from pathlib import Path

import _env  # noqa: F401  first: offline environment
from _common import fastest_of

# isort: split

from diffprep import contract
from diffprep.phases.audit import audit
from diffprep.run.energon import finalize
from diffprep.validation import validate_dataset
from diffprep.writer.plan import Plan, UnitPlan, fingerprint, write_plan
from diffprep.writer.shards import ShardWriter, UnitManifest, write_manifest

SHARD = 1000
SETTINGS = {"shard_size": SHARD, "benchmark": "checks_scale"}


def write_dataset(out: Path, samples: int) -> Plan:
    """``samples`` caption-only samples in shards of ``SHARD``, committed, planned and finalized."""
    units = []
    print_every = max(1, samples // SHARD // 10)
    for unit, start in enumerate(range(0, samples, SHARD)):
        ids = [f"row{i:09d}" for i in range(start, min(start + SHARD, samples))]
        keys = []
        with ShardWriter(out, unit) as writer:
            for index, source_id in enumerate(ids):
                key = contract.sample_key(unit, index)
                writer.write(key, {contract.RAW_CAPTION: f"a caption of {source_id}",
                                   contract.RAW_VIDEO_META: {"source_id": source_id}})
                keys.append(key)
            info = writer.commit()
        write_manifest(out, UnitManifest(unit=unit, shard=info.name, fingerprint=fingerprint(SETTINGS), keys=keys,
                                         source_ids=ids, count=info.count, bytes=info.bytes, sha256=info.sha256))
        units.append(UnitPlan(unit, ids))
        if unit % print_every == 0:
            print(f"  wrote {unit + 1} shards", flush=True)
    plan = Plan(fingerprint=fingerprint(SETTINGS), settings=SETTINGS, source={"type": "metadata"},
                expected={"fields": [contract.RAW_CAPTION, contract.RAW_VIDEO_META]},
                units=units, encoding=contract.ENCODING_PROMPTS)
    write_plan(out, plan)
    finalize(out, encoding=contract.ENCODING_PROMPTS, train_split=1.0)
    return plan


def checked(report, what: str):
    if not report.ok:
        raise RuntimeError(f"{what} failed:\n{report.to_markdown()}")
    return report


def measure(out: Path, plan: Plan, rounds: int) -> dict[str, float]:
    def audit_one() -> None:
        if not audit(out, plan).ok:
            raise RuntimeError("audit failed")

    def audit_two() -> None:
        if not audit(out, plan, workers=2).ok:
            raise RuntimeError("audit workers=2 failed")

    return {
        "audit": fastest_of(rounds, audit_one),
        "audit x2": fastest_of(rounds, audit_two),
        "validate": fastest_of(rounds, lambda: checked(validate_dataset(out, previews=0), "validate")),
        "validate --full": fastest_of(rounds, lambda: checked(validate_dataset(out, previews=0, full=True), "--full")),
        "validate --full x2": fastest_of(rounds, lambda: checked(
            validate_dataset(out, previews=0, full=True, workers=2), "--full x2")),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--work-dir", type=Path, default=None, help="where to write the datasets (default: a "
                        "temporary folder, removed after)")
    args = parser.parse_args()
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="checks-scale-"))
    results: dict[int, dict[str, float]] = {}
    try:
        for samples in args.sizes:
            out = work / f"n{samples}"
            shutil.rmtree(out, ignore_errors=True)
            print(f"writing {samples} samples ({math.ceil(samples / SHARD)} shards)...", flush=True)
            plan = write_dataset(out, samples)
            results[samples] = measure(out, plan, args.rounds)
            print(f"{samples:>9} samples: " + ", ".join(f"{name} {t:.2f} s" for name, t in results[samples].items()),
                  flush=True)
    finally:
        if args.work_dir is None:
            shutil.rmtree(work, ignore_errors=True)

    names = list(next(iter(results.values())))
    print("\n| check | " + " | ".join(f"{n:,} samples" for n in results) + " | vs --full (largest) |")
    print("|---|" + "---:|" * (len(results) + 1))
    largest = results[max(results)]
    for name in names:
        cells = " | ".join(f"{results[n][name]:.2f} s" for n in results)
        print(f"| {name} | {cells} | {largest[name] / largest['validate --full']:.3f}× |")
    sizes = sorted(results)
    if len(sizes) > 1:
        print("\ngrowth exponents (1.0: linear in the samples):")
        for name in names:
            exponents = [math.log(results[b][name] / results[a][name]) / math.log(b / a)
                         for a, b in zip(sizes, sizes[1:])]
            print(f"  {name}: " + ", ".join(f"{e:.2f}" for e in exponents))


if __name__ == "__main__":
    main()
