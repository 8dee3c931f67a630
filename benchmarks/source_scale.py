"""The units phase's source cost at 10k and 100k rows: re-opening the source per unit (the old path) against one
opened source per process reading each unit at its planned positions (issue #37).

The cheap path (``raw --prompts-only``: a sample costs nothing but its read) on a metadata JSONL, shard size
1000. What is timed is what the units phase asks of the source: for every unit, open it (old: per unit; new:
once per process) and read the unit's samples. Three sides:

- ``old``: the code before this change (``--old-commit``, default main's 3543500, exported with ``git archive``
  and run in a subprocess): ``open_source`` + ``read(ids)`` per unit, which parsed the whole file each time.
  It costs minutes at 100k, so ``--old-units`` units spread over the plan are timed and the phase is that mean
  times the number of units (said so in the output).
- ``new-ids``: this checkout, a plan written before positions: one open (the file checked), rows looked up by id
  (the file read whole once per process), every unit timed.
- ``new-at``: this checkout, a plan with positions (``list_entries``) and the source's description: one open that
  reads nothing of the file, every unit read at its rows.

Each side prints the phase's seconds at each size; the summary gives old/new ratios and the growth exponent
``log(t(100k) / t(10k)) / log(10)`` of each side (1: linear in the rows; 2: quadratic).

    python benchmarks/source_scale.py                  # 10k and 100k rows (about 3 min on 2 busy cores)
    python benchmarks/source_scale.py --sizes 10000 --old-units 3
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))

SHARD_SIZE = 1000
DISTINCT_FILES = 100  # rows name these media files in turn (ids: path, then path#row)

# Run by the old side in a subprocess: the code of --old-commit on its path, nothing of this checkout.
OLD_SIDE = """
import json, sys, time
from diffprep.config import SourceConfig
from diffprep.sources import open_source
path, shard, picks = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
cfg = SourceConfig(type="metadata", metadata_file=path)
ids = list(open_source(cfg).list_ids())
seconds = []
for unit in picks:
    start = time.perf_counter()
    source = open_source(cfg)  # what encode_one_unit did for every unit
    for sample in source.read(ids[unit * shard:(unit + 1) * shard]):
        assert sample.reject is None, sample.reject
    seconds.append(time.perf_counter() - start)
print(json.dumps({"seconds": seconds, "units": -(-len(ids) // shard)}))
"""


def write_source(folder: Path, rows: int) -> Path:
    (folder / "img").mkdir(parents=True, exist_ok=True)
    for i in range(DISTINCT_FILES):
        (folder / "img" / f"{i:03d}.png").write_bytes(b"")  # a prompts run reads the file, never decodes it
    path = folder / f"rows-{rows}.jsonl"
    with open(path, "w", encoding="utf-8") as out:
        for i in range(rows):
            out.write(json.dumps({"image": f"img/{i % DISTINCT_FILES:03d}.png",
                                  "caption": f"a photo of thing number {i} on a plain background"}) + "\n")
    return path


def old_side(code: Path, path: Path, rows: int, picks: int) -> tuple[float, int, int]:
    """(the phase's seconds extrapolated from ``picks`` units, units timed, units)."""
    units = -(-rows // SHARD_SIZE)
    chosen = sorted({round(i * (units - 1) / max(1, picks - 1)) for i in range(picks)})
    env = {**os.environ, "PYTHONPATH": str(code)}
    done = subprocess.run([sys.executable, "-c", OLD_SIDE, str(path), str(SHARD_SIZE), json.dumps(chosen)],
                          env=env, check=True, capture_output=True, text=True, cwd=code)
    found = json.loads(done.stdout.strip().splitlines()[-1])
    return sum(found["seconds"]) / len(found["seconds"]) * units, len(chosen), units


def new_side(path: Path, positions: bool) -> tuple[float, float, int]:
    """(the units phase's seconds, the listing's seconds, whole-file lookups) in this process, every unit read."""
    from diffprep.config import SourceConfig
    from diffprep.sources import MetadataSource, open_source
    from diffprep.sources.base import list_planned, read_planned
    from diffprep.sources import metadata_rows

    cfg = SourceConfig(type="metadata", metadata_file=str(path))
    metadata_rows._LAYOUTS.clear()  # the units' process has not seen the file: its one opening is timed
    start = time.perf_counter()
    listing = open_source(cfg)
    entries = list(list_planned(listing))  # the plan phase, once
    listed = time.perf_counter() - start
    metadata_rows._LAYOUTS.clear()
    indexed = MetadataSource.indexed
    start = time.perf_counter()
    # Once per process (pipeline.opened_source), with the plan's description of the source when the plan is new.
    source = open_source(cfg, planned=listing.describe() if positions else None)
    for first in range(0, len(entries), SHARD_SIZE):
        unit = entries[first:first + SHARD_SIZE]
        ids = [source_id for source_id, _ in unit]
        for sample in read_planned(source, ids, [at for _, at in unit] if positions else None):
            assert sample.reject is None, sample.reject
    return time.perf_counter() - start, listed, MetadataSource.indexed - indexed


def exponent(small: float, large: float, factor: float) -> float:
    return math.log(large / small) / math.log(factor)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="10000,100000", help="row counts, comma-separated (default 10k,100k)")
    parser.add_argument("--old-units", type=int, default=3, help="units timed on the old side per size")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of each new side (the fastest is kept)")
    parser.add_argument("--old-commit", default="3543500", help="the commit of the old side (before positions)")
    args = parser.parse_args()
    sizes = [int(size) for size in args.sizes.split(",")]
    with tempfile.TemporaryDirectory(prefix="diffprep-source-scale-") as tmp:
        old_code = Path(tmp) / "old"
        old_code.mkdir()
        archive = subprocess.run(["git", "-C", str(REPO), "archive", args.old_commit, "diffprep", "tasks", "flows",
                                  "blocks"], check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(old_code)], input=archive, check=True)
        results: dict[int, dict[str, float]] = {}
        for rows in sizes:
            path = write_source(Path(tmp) / "data", rows)
            old, timed, units = old_side(old_code, path, rows, args.old_units)
            # The new sides interleaved, each the fastest of its rounds (a busy machine's times are noise).
            rounds = [(new_side(path, positions=False), new_side(path, positions=True)) for _ in range(args.rounds)]
            by_id, listed, indexed_ids = min((ids_side for ids_side, _ in rounds), key=lambda side: side[0])
            at, _, indexed_at = min((at_side for _, at_side in rounds), key=lambda side: side[0])
            results[rows] = {"old": old, "new-ids": by_id, "new-at": at}
            print(f"{rows:>8} rows, {units} units: listing {listed:.2f} s once; units phase: old {old:.1f} s "
                  f"({timed} units timed, x{units}), new-ids {by_id:.2f} s ({indexed_ids} whole-file lookup), "
                  f"new-at {at:.2f} s ({indexed_at} whole-file lookups); old/new-at {old / at:.0f}x", flush=True)
        summary = [f"old/new-at {results[n]['old'] / results[n]['new-at']:.0f}x at {n}" for n in sizes]
        if len(sizes) > 1:
            small, large = sizes[0], sizes[-1]
            factor = large / small
            for side in ("old", "new-ids", "new-at"):
                summary.append(f"{side} grows N^{exponent(results[small][side], results[large][side], factor):.2f}")
        print("SUMMARY source_scale: " + "; ".join(summary))


if __name__ == "__main__":
    main()
