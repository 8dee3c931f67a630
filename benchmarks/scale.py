"""Each phase's time and peak memory at 10k, 100k and 1M samples, and how they grow (issue #37).

The cheap path: ``diffprep raw --prompts-only`` (captions stored, no model, no pixels), so that no sample costs
anything and what is left is the cost of the phases themselves: listing the source and planning, the units,
verifying an existing output, the audit, Energon's finalize and the validation. Two sources: a metadata JSONL
(one row per sample, each naming the same tiny image by a path of its own: ``./`` and ``.//`` segments) and a
webdataset of input tars of 10k samples each, a caption and a tiny image per sample (1 tar at 10k, 100 at 1M).

Every phase runs alone in a fresh process (``--phase``), over the output the phases before it wrote, as the
run would order them; the process reports the phase's seconds and its peak RSS above what the process held
before the phase began (imports, settings). ``verify`` is a re-run over the finished output (plan + verify
existing), what a user's second ``diffprep raw`` costs before it finds nothing to do.

Printed per source: a table of seconds and MiB per size, the growth exponent between successive sizes
(t ∝ N^k), and the time extrapolated to 100M samples from the two largest sizes.

    python benchmarks/scale.py                            # 10k and 100k
    python benchmarks/scale.py --sizes 10000 100000 1000000 --sources metadata
"""

from __future__ import annotations

import argparse
import io
import json
import math
import resource
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import _env  # first: offline environment

PHASES = ("plan", "units", "audit", "finalize", "validate", "verify")
SHARD_SIZE = 1000
TARGET = 100_000_000
METADATA = "rows.jsonl"  # (metadata.jsonl in the cache was written by a version whose rows all named one path)
WEBDATASET = "wds-10k"  # (wds/ in the cache: four tars, whatever the size)
SAMPLES_PER_TAR = 10_000
PNG = bytes.fromhex(  # a 1x1 grey PNG: every row names it, by a path of its own
    "89504e470d0a1a0a0000000d4948445200000001000000010800000000"
    "3a7e9b550000000a49444154789c636800000082008177cd72b60000000049454e44ae426082")


# --- inputs -----------------------------------------------------------------------------------------------------


def row_path(i: int) -> str:
    """The one image under a path of row ``i``'s own: ``./`` or ``.//`` spell its bits, so that every row is a sample
    with an id of its own (as in a real file, where each row names another clip) without a million files."""
    return "".join(".//" if i >> bit & 1 else "./" for bit in range(max(1, i.bit_length()))) + "pixel.png"


def write_metadata(folder: Path, n: int) -> Path:
    path = folder / METADATA
    if not path.exists():
        (folder / "pixel.png").write_bytes(PNG)
        with open(path.with_suffix(".tmp"), "w", encoding="utf-8") as f:
            for i in range(n):
                f.write(f'{{"image": "{row_path(i)}", "caption": "caption {i}"}}\n')
        path.with_suffix(".tmp").rename(path)
    return path


def write_webdataset(folder: Path, n: int) -> Path:
    """Input tars of ``SAMPLES_PER_TAR`` samples each (img2dataset's default cut), as many as ``n`` needs."""
    root = folder / WEBDATASET
    if not (root / "done").exists():
        root.mkdir(parents=True, exist_ok=True)
        for t in range(math.ceil(n / SAMPLES_PER_TAR)):
            with tarfile.open(root / f"input-{t:05d}.tar", "w") as tar:
                for i in range(t * SAMPLES_PER_TAR, min(n, (t + 1) * SAMPLES_PER_TAR)):
                    for ext, data in (("png", PNG), ("txt", f"caption {i}".encode())):
                        info = tarfile.TarInfo(f"s{i:09d}.{ext}")
                        info.size = len(data)
                        tar.addfile(info, io.BytesIO(data))
        (root / "done").touch()
    return root


def overrides(source: str, inputs: Path, out: Path) -> dict:
    src = ({"type": "metadata", "metadata_file": str(inputs / METADATA)} if source == "metadata"
           else {"type": "webdataset", "input_path": str(inputs / WEBDATASET / "input-*.tar")})
    return {"source": src, "raw": {"prompts_only": True},
            "output": {"output_dir": str(out), "shard_size": SHARD_SIZE, "on_existing": "resume"}}


# --- one phase, in this process ------------------------------------------------------------------------------------


def rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_phase(phase: str, source: str, inputs: Path, out: Path) -> dict:
    from diffprep import contract
    from diffprep.config import load_settings
    from diffprep.phases import pipeline
    from diffprep.phases.audit import audit
    from diffprep.phases.existing import decide
    from diffprep.output import OutputRef

    settings = load_settings(overrides=overrides(source, inputs, out))
    output = OutputRef(location=str(out)).open()
    plan = output.state.plan()
    before = rss_mib()
    start = time.perf_counter()
    if phase in ("plan", "verify"):
        plan = pipeline.plan_output(settings, output, contract.ENCODING_RAW)
        inspection = pipeline.verify_output(output, plan)
        if phase == "plan":
            output.local.mkdir(parents=True, exist_ok=True)
            pipeline.prepare_output(output, decide(inspection, "resume", output, plan.fingerprint), inspection,
                                    plan, settings.workers)
        elif inspection.units_left or inspection.damaged_units:
            raise SystemExit(f"verify: the finished output has units left: {inspection.units_left[:5]}")
    elif phase == "units":
        pipeline.write_units_here(settings, output, plan, [u.unit for u in plan.units],
                                  pipeline.Progress(len(plan.units)))
    elif phase == "audit":
        report = audit(output, plan)
        if report.problems:
            raise SystemExit(f"audit: {report.problems[:3]}")
    elif phase == "finalize":
        pipeline.finalize_split(output, plan.encoding, settings.finalize, False)
    elif phase == "validate":
        pipeline.validate_output(output, plan.encoding).raise_if_failed()
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "peak_mib": max(0.0, rss_mib() - before), "baseline_mib": before}


# --- the driver -----------------------------------------------------------------------------------------------------


def growth(sizes: list[int], values: list[float]) -> list[str]:
    out = []
    for (n1, v1), (n2, v2) in zip(zip(sizes, values), zip(sizes[1:], values[1:])):
        out.append(f"{math.log(max(v2, 1e-3) / max(v1, 1e-3)) / math.log(n2 / n1):.2f}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000])
    parser.add_argument("--sources", nargs="+", choices=("metadata", "webdataset"), default=["metadata", "webdataset"])
    parser.add_argument("--phases", nargs="+", choices=PHASES, default=list(PHASES))
    parser.add_argument("--cache-dir", default=str(Path.home() / ".cache" / "diffprep-bench" / "scale"))
    parser.add_argument("--malloc", choices=_env.MALLOC_MODES, default="tuned", help=_env.MALLOC_HELP)
    parser.add_argument("--phase", choices=PHASES, help=argparse.SUPPRESS)  # a child: one phase
    parser.add_argument("--source", help=argparse.SUPPRESS)
    parser.add_argument("--inputs", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.phase:
        print(json.dumps(run_phase(args.phase, args.source, Path(args.inputs), Path(args.out))))
        return

    results: dict[tuple[str, int, str], dict] = {}
    with tempfile.TemporaryDirectory(prefix="diffprep-scale-") as scratch:
        for source in args.sources:
            for n in args.sizes:
                inputs = Path(args.cache_dir) / f"{n}"
                inputs.mkdir(parents=True, exist_ok=True)
                (write_metadata if source == "metadata" else write_webdataset)(inputs, n)
                out = Path(scratch) / f"{source}-{n}"
                for phase in args.phases:
                    done = subprocess.run([sys.executable, __file__, "--phase", phase, "--source", source,
                                           "--inputs", str(inputs), "--out", str(out)],
                                          capture_output=True, text=True)
                    if done.returncode != 0:
                        sys.exit(f"{source} {n} {phase} failed:\n{done.stderr[-3000:]}")
                    results[source, n, phase] = json.loads(done.stdout.strip().splitlines()[-1])
                    r = results[source, n, phase]
                    print(f"{source:10s} {n:>9,d} {phase:9s} {r['seconds']:9.2f} s {r['peak_mib']:8.0f} MiB",
                          flush=True)

    sizes = args.sizes
    for source in args.sources:
        print(f"\n## {source} source, shard size {SHARD_SIZE}\n")
        head = " | ".join(f"s at {n:,}" for n in sizes)
        print(f"| phase | {head} | growth k | peak MiB, {sizes[0]:,} → {sizes[-1]:,} | 100M, extrapolated |")
        print("|---" * (len(sizes) + 4) + "|")
        for phase in args.phases:
            seconds = [results[source, n, phase]["seconds"] for n in sizes]
            mib = [results[source, n, phase]["peak_mib"] for n in sizes]
            k = growth(sizes, seconds)
            if len(sizes) > 1:
                last = float(k[-1])
                hours = seconds[-1] * (TARGET / sizes[-1]) ** last / 3600
                extrapolated = f"{hours:.2f} h (k={last:.2f})"
            else:
                extrapolated = "—"
            print(f"| {phase} | {' | '.join(f'{s:.2f}' for s in seconds)} | {', '.join(k) or '—'} | "
                  f"{mib[0]:.0f} → {mib[-1]:.0f} | {extrapolated} |")


if __name__ == "__main__":
    main()
