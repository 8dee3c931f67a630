"""Two CPU workers against one on the same units: ``diffprep encode`` as a user types it, without a server (issue 35).

Every run is a fresh ``diffprep encode`` process with no ``PREFECT_API_URL`` and a new, empty ``PREFECT_HOME``,
over the same JPEGs (written once under ``--cache-dir``) with the tiny encoder set and the same settings, so the
same plan, the same units and the same bytes. Sides (``--sides``):

- ``in-process``: no ``--devices``: one process encodes every unit, recorded on the embedded server afterwards
  (``flows/recorded.py``), what a terminal run does by default;
- ``cpu:1``: ``--devices cpu:1``: recorded too; the command's process is the one device's worker;
- ``cpu:2``: ``--devices cpu:2``: the command's process and one spawned worker process, which takes units once
  its encoders are loaded (``diffprep/run/pool.py``). (Before issue 35's second fix both ``--devices`` sides were
  the live flow on the embedded server with one spawned worker per device.) Only the CPU workers the cores hold at
  the plan's thread count start: at the default threads on 2 cores, none (``cpu_workers_that_fit``).

Per run: the whole command's seconds (start to exit), the units' seconds (from the sanity check's line to the
last unit's line: with a pool, its workers' start is in them), how many Prefect servers it started (the embedded
server's start line; before issue 35's fix each pool worker started one more), and how many units each process
encoded. Rounds interleaved, the order reversed each round, each side the
fastest of its rounds. Every side's shards must be byte-identical to the first side's.

The workers' encoders run at the plan's thread count (``diffprep/run/threads.py``: the machine's physical cores by
default), so two CPU workers share the cores at that count each; ``--encoder-threads 1`` plans one thread per
worker instead (both sides then run the same plan, with its own bytes).

Target: two workers no slower than one on the same units (``cpu:2`` samples/s >= ``cpu:1``'s and the
in-process run's, whole command).

    python benchmarks/workers.py                               # 256 images, 8 units, 2 rounds
    python benchmarks/workers.py --samples 1024 --encoder-threads 1
"""

from __future__ import annotations

import argparse
import re
import shutil
import sys
from pathlib import Path

import _common as c  # first: offline environment

# isort: split

from cli import child_env, run_command

SIDES = {"in-process": [], "cpu:1": ["--devices", "cpu:1"], "cpu:2": ["--devices", "cpu:2"]}
# The command's own server (live flow: Prefect's temporary server; recorded run: diffprep's line) and any
# temporary server a pool worker starts.
SERVER_LINE = re.compile(r"Starting temporary server|embedded Prefect server starting")
SANITY_DONE = re.compile(r"sanity: [\d.]+ s per batch")  # every side's last line before its units
UNIT_DONE = re.compile(r"unit \d{6} done \(\d+/\d+\)|unit \d{6}: \d+ written")
UNIT_BY = re.compile(r"unit \d{6} done \(\d+/\d+\) by (\S+):")


def command(source: Path, model: Path, out: Path, args: argparse.Namespace, side: str) -> list[str]:
    threads = ["--encoder-threads", str(args.encoder_threads)] if args.encoder_threads else []
    return [sys.executable, "-m", "diffprep", "encode", "--source-type", "directory", "--input-dir", str(source),
            "--model-path", str(model), "--output-dir", str(out), "--max-samples", str(args.samples),
            "--shard-size", str(args.shard_size), "--batch-size", "8", "--precision", "fp32",
            "--image-size", str(args.image_size), "--t5-max-length", str(args.t5_max_length), "--min-psnr", "0",
            "--no-finalize", *threads, *SIDES[side]]


def units_seconds(lines: list[tuple[float, str]]) -> float | None:
    """From the sanity check's line to the last unit's line: the units, with the pool's start (its workers'
    processes, imports and encoders) where there is a pool."""
    start = next((at for at, line in lines if SANITY_DONE.search(line)), None)
    ends = [at for at, line in lines if UNIT_DONE.search(line)]
    return ends[-1] - start if ends and start is not None else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    c.add_common_flags(parser)
    parser.add_argument("--samples", type=int, default=256)
    parser.add_argument("--shard-size", type=int, default=32, help="samples per unit (default 32: 8 units)")
    parser.add_argument("--image-size", type=int, default=256)
    parser.add_argument("--t5-max-length", type=int, default=128)
    parser.add_argument("--encoder-threads", type=int, default=None,
                        help="the plan's encoder thread count (default: the machine's physical cores)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--sides", nargs="+", choices=list(SIDES), default=list(SIDES))
    args = parser.parse_args(argv)

    cache = c.cache_dir(args.cache_dir)
    scratch, cleanup = c.work_dir(args.work_dir)
    print(f"machine: {c.describe_machine()}")
    source = c.jpeg_source(cache, args.samples, size=512)
    model = c.tiny_model(cache)
    print(f"{args.samples} images of 512 px -> {args.image_size} px, {-(-args.samples // args.shard_size)} units, "
          f"tiny set, T5 {args.t5_max_length}, encoder threads {args.encoder_threads or 'default'}; "
          f"{args.rounds} rounds", flush=True)
    runs: dict[str, list[dict]] = {side: [] for side in args.sides}
    reference: dict[str, str] | None = None
    try:
        for r in range(args.rounds):
            for side in args.sides if r % 2 == 0 else args.sides[::-1]:
                run_dir = scratch / f"{side.replace(':', '')}-{r}"
                out = run_dir / "out"
                env = child_env(PREFECT_HOME=str(run_dir / "prefect"))
                run = run_command(command(source, model, out, args, side), env, out)
                run["servers"] = sum(1 for _, line in run["lines"] if SERVER_LINE.search(line))
                run["units"] = units_seconds(run["lines"])
                by: dict[str, int] = {}
                for _, line in run["lines"]:
                    if match := UNIT_BY.search(line):
                        by[match.group(1)] = by.get(match.group(1), 0) + 1
                run["sanity"] = next((at for at, line in run["lines"] if SANITY_DONE.search(line)), float("nan"))
                hashes = c.shard_hashes(out)
                reference = reference or hashes
                if hashes != reference:
                    raise RuntimeError(f"{side}: shards differ from the first side's")
                runs[side].append(run)
                units = f"{run['units']:6.1f}" if run["units"] is not None else "     -"
                print(f"    round {r + 1}: {side:<10} {run['seconds']:7.1f} s, sanity done at {run['sanity']:5.1f} s, "
                      f"units {units} s, "
                      f"{run['servers']} Prefect server(s) started, {len(hashes)} shards, units per process "
                      f"{'+'.join(str(n) for n in sorted(by.values(), reverse=True)) or '-'} "
                      f"(load {c.load_average()})",
                      flush=True)
                shutil.rmtree(run_dir, ignore_errors=True)
    finally:
        cleanup()

    best = {side: c.best([run["seconds"] for run in side_runs]) for side, side_runs in runs.items()}
    best_units = {side: c.best([run["units"] for run in side_runs if run["units"] is not None] or [float("nan")])
                  for side, side_runs in runs.items()}
    print("\nside        command s  samples/s  units s  servers")
    for side in args.sides:
        servers = sorted({run["servers"] for run in runs[side]})
        print(f"{side:<10} {best[side]:10.1f} {args.samples / best[side]:10.1f} {best_units[side]:8.1f}  {servers}")
    summary = []
    if "cpu:2" in best:
        for one in ("cpu:1", "in-process"):
            if one in best:
                ratio = best[one] / best["cpu:2"]
                units = best_units[one] / best_units["cpu:2"]
                summary.append(f"cpu:2 / {one} {ratio:.2f}x (units alone {units:.2f}x) {c.verdict(ratio, 1.0)}")
    extra = sorted({run["servers"] for side_runs in runs.values() for run in side_runs})
    summary.append(f"servers per run {extra}")
    print("SUMMARY workers: " + "; ".join(summary) + f"; {args.samples} images, load {c.load_average()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
