"""The whole ``diffprep encode`` command against a serial script doing the same work, as subprocesses.

Sides (``--sides``), each a fresh process per run, all on the same inputs
(512 px JPEGs written once under ``--cache-dir``), the same tiny encoder set
(``diffprep tiny-model``) and the settings issue #17 measured: 256 px, fp32,
batch 8, shard size 64, t5_max_length 512, ``--no-finalize``:

- ``server``: ``diffprep encode`` with ``PREFECT_API_URL`` pointing at a
  ``prefect server start`` this script started on a free 127.0.0.1 port (and
  stops at the end);
- ``embedded``: ``diffprep encode`` with no API URL: the pipeline runs without
  Prefect while the embedded server starts beside it, and the run is recorded on
  it afterwards (``flows/recorded.py``); all of it is in the time;
- ``embedded-flow``: the same with ``DIFFPREP_LIVE_FLOW=1``: the flow itself runs on
  the embedded server, started first (how every terminal run without a server ran before);
- ``embedded-fresh``: the same in a new, empty ``PREFECT_HOME`` every run (what
  a CI job, a container or a first-time user has: the database is copied from
  the migrated template in the user's cache, ``flows/prefect_home.py``);
- ``embedded-fresh-unseeded``: ``embedded-fresh`` with ``DIFFPREP_PREFECT_TEMPLATE=0``
  (Prefect creates and migrates the database inside the command);
- ``server-untuned``: ``server`` with ``DIFFPREP_MALLOC_TUNING=0`` (glibc's defaults);
- ``serial``: ``benchmarks/serial_reference.py`` (decode all, encode batch by
  batch, torch.save, tar) with glibc's defaults, as a hand-written script runs;
- ``serial-tuned``: the same with ``diffprep.run.allocator.tune_malloc()`` first;
- ``primus``: AMD Primus's own ``primus data diffusion-encoded``, unmodified, from ``--primus-checkout DIR``
  or ``--primus-git MIRROR`` (``benchmarks/primus_side.py``); skipped, with a line saying so, without either.
  Before the rounds, 8 images through both with the posterior mean (diffprep ``--latent-mode mode``, Primus
  ``--vae-latent-mode resample``) check that the tensors agree.

The children get this process's environment without ``MALLOC_*`` and
``DIFFPREP_MALLOC_TUNING``: "default environment variables", so diffprep's own
allocator setting is what differs between ``server`` and ``server-untuned``.

Figures per size: samples/s of the whole command (start to exit) and the ratio
diffprep / serial (fastest run of each side; rounds interleaved, the order
reversed every round); seconds from start to the first committed unit
(``.diffprep/units/000000.json`` appears) and where they went, from the
command's own log lines; the units' pace against the sanity batch's pace;
peak RSS of each command (``wait4``); bytes on disk per sample against the
tensor payload, here and computed at FLUX.1-dev shapes.

``--load N`` runs the rounds under other load, the same for every side: N
processes that each keep one core busy (a one-thread loop of small float
matrix products, at the children's priority) from the first timed run to the
last, each ending by itself after ``--load-limit`` seconds at the latest. What
a shared machine does to each side is then measured, not left to chance.

``--phases`` first breaks the embedded server's fixed cost down, each phase
in fresh processes (``benchmarks/prefect_phases.py``): imports, database
creation and migrations, block registration, the template's copy, the
server's start to ``/health`` in a fresh home (unseeded, seeded) and a used
one, a trivial flow run on it, its stop.

Target: diffprep (server) >= 1.5x serial at 4,096 images under default environment variables.

    python benchmarks/cli.py                           # --sizes 256 1024 4096, 2 rounds
    python benchmarks/cli.py --sizes 256 1024 --rounds 2 --sides server embedded serial
"""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import threading
import time
import urllib.request
from pathlib import Path

import _common as c  # first: offline environment (this process only; see child_env)

# isort: split

import primus_side

import torch

from diffprep import contract

REPO = Path(__file__).resolve().parents[1]
TARGET = 1.5
MIB = 1024 * 1024
SIDES = ("server", "embedded", "embedded-flow", "embedded-fresh", "embedded-fresh-unseeded", "server-untuned",
         "serial", "serial-tuned", "primus")
DIFFPREP_SIDES = ("server", "embedded", "embedded-flow", "embedded-fresh", "server-untuned")
SETTINGS = {"image_size": 256, "precision": "fp32", "batch_size": 8, "shard_size": 64, "t5_max_length": 512}

# Log lines of `diffprep encode` that mark the start-up phases, in the order they happen.
MARKS = {
    "prefect server started (embedded)": re.compile(r"Starting temporary server|embedded Prefect server starting"),
    "flow run began": re.compile(r"Beginning flow run"),
    "planned": re.compile(r"planned \d+ samples in"),
    "fetch done": re.compile(r"Task run 'fetch-.*Finished"),
    "verify done": re.compile(r"Task run 'verify-existing-.*Finished"),
    "sanity done": re.compile(r"Task run 'sanity-.*Finished|sanity: [\d.]+ s per batch"),
    "units started": re.compile(r"encoding \d+ units with"),
}
UNIT_LINE = re.compile(r"unit \d+: (\d+) written, (\d+) rejected in ([\d.]+) s")
SANITY_LINE = re.compile(r"sanity: ([\d.]+) s per batch")


def child_env(**extra: str) -> dict[str, str]:
    drop = (*c._env.MALLOC_VARS, "DIFFPREP_MALLOC_TUNING", "PREFECT_API_URL")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.update(DO_NOT_TRACK="1", PREFECT_SERVER_ANALYTICS_ENABLED="false", PYTHONUNBUFFERED="1")
    return env | extra


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class PrefectServer:
    """``prefect server start`` on a free loopback port, in its own process group; stopped by ``stop()``."""

    def __init__(self, home: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/api"
        self.log = open(home / "server.log", "w")
        env = child_env(PREFECT_HOME=str(home), PREFECT_UI_API_URL=self.url, PREFECT_UI_ENABLED="false")
        self.process = subprocess.Popen(
            [str(Path(sys.executable).parent / "prefect"), "server", "start", "--host", "127.0.0.1",
             "--port", str(self.port)], env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        start = time.perf_counter()
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"prefect server exited with {self.process.returncode}; see {self.log.name}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            if time.perf_counter() - start > 120:
                self.stop()
                raise RuntimeError("prefect server did not answer /api/health within 120 s")
            time.sleep(0.5)
        self.startup = time.perf_counter() - start

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        self.log.close()


# One core's worth of other work: small float matrix products on one thread, until the deadline.
LOAD_LOOP = """
import sys, time
import numpy as np
deadline = time.monotonic() + float(sys.argv[1])
a = np.random.default_rng(0).standard_normal((256, 256)).astype(np.float32)
while time.monotonic() < deadline:
    for _ in range(50):
        a = np.tanh(a @ a.T * 1e-2)
"""


class BackgroundLoad:
    """``n`` processes keeping one core busy each (``LOAD_LOOP``), each in its own process group and ending by itself
    after ``limit`` seconds; ``stop()`` ends them sooner."""

    def __init__(self, n: int, limit: float) -> None:
        env = child_env(OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
        self.processes = [subprocess.Popen([sys.executable, "-c", LOAD_LOOP, str(limit)], env=env,
                                           start_new_session=True) for _ in range(n)]

    def stop(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
        for process in self.processes:
            process.wait()


def run_command(command: list[str], env: dict[str, str], out_dir: Path) -> dict:
    """Run ``command``; its wall time, peak RSS (wait4: it and the children it waited for), log lines with
    their arrival times, and when ``out_dir``'s first unit manifest appeared."""
    lines: list[tuple[float, str]] = []
    first_unit = out_dir / contract.STATE_DIR / contract.UNITS_DIR / contract.unit_manifest_name(0)
    seen: dict[str, float] = {}
    start = time.perf_counter()
    process = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, errors="replace")

    def read() -> None:
        for line in process.stdout:
            lines.append((time.perf_counter() - start, line.rstrip("\n")))

    def watch() -> None:
        while process.returncode is None and "first unit" not in seen:
            if first_unit.is_file():
                seen["first unit"] = time.perf_counter() - start
            time.sleep(0.05)

    threads = [threading.Thread(target=read, daemon=True), threading.Thread(target=watch, daemon=True)]
    for thread in threads:
        thread.start()
    _, status, usage = os.wait4(process.pid, 0)
    seconds = time.perf_counter() - start
    process.returncode = os.waitstatus_to_exitcode(status)
    for thread in threads:
        thread.join(timeout=5)
    if process.returncode != 0:
        tail = "\n".join(line for _, line in lines[-30:])
        raise RuntimeError(f"{' '.join(command[:4])}... exited with {process.returncode}:\n{tail}")
    return {"seconds": seconds, "peak_rss": usage.ru_maxrss * 1024, "lines": lines,
            "first_unit": seen.get("first unit")}


def diffprep_command(source: Path, model: Path, out: Path, samples: int) -> list[str]:
    s = SETTINGS
    return [sys.executable, "-m", "diffprep", "encode", "--source-type", "directory", "--input-dir", str(source),
            "--model-path", str(model), "--output-dir", str(out), "--max-samples", str(samples),
            "--shard-size", str(s["shard_size"]), "--batch-size", str(s["batch_size"]), "--precision", s["precision"],
            "--image-size", str(s["image_size"]), "--t5-max-length", str(s["t5_max_length"]), "--min-psnr", "0",
            "--no-finalize"]


def serial_command(source: Path, model: Path, out: Path, samples: int, tuned: bool) -> list[str]:
    s = SETTINGS
    return [sys.executable, str(Path(__file__).with_name("serial_reference.py")), str(source), str(model), str(out),
            "--samples", str(samples), "--image-size", str(s["image_size"]), "--batch-size", str(s["batch_size"]),
            "--shard-size", str(s["shard_size"]), "--precision", s["precision"],
            "--t5-max-length", str(s["t5_max_length"]), *(["--malloc-tuning"] if tuned else [])]


def analyse(run: dict) -> dict:
    """Start-up marks, the units' pace and the sanity pace from a diffprep run's log lines."""
    marks: dict[str, float] = {}
    unit_samples = unit_seconds = 0.0
    sanity = None
    for at, line in run["lines"]:
        for name, pattern in MARKS.items():
            if name not in marks and pattern.search(line):
                marks[name] = at
        if m := UNIT_LINE.search(line):
            unit_samples += int(m[1]) + int(m[2])
            unit_seconds += float(m[3])
        if (m := SANITY_LINE.search(line)) and sanity is None:
            sanity = float(m[1])
    if run["first_unit"] is not None:
        marks["first unit committed"] = run["first_unit"]
    units_pace = unit_samples / unit_seconds if unit_seconds else None
    sanity_pace = SETTINGS["batch_size"] / sanity if sanity else None
    return {"marks": marks, "units_pace": units_pace, "sanity_pace": sanity_pace}


def disk_figures(out: Path, samples: int) -> dict:
    """Bytes of the shards per sample, and the tensors' own bytes (numel x itemsize) per sample."""
    shards = sorted(out.glob(f"*{contract.SHARD_SUFFIX}"))
    total = sum(p.stat().st_size for p in shards)
    payload = 0
    with tarfile.open(shards[0]) as tar:
        first_key = None
        for member in tar:
            key, _, ext = member.name.partition(".")
            first_key = first_key or key
            if key != first_key:
                break
            if ext.endswith(".pth"):
                tensor = torch.load(io.BytesIO(tar.extractfile(member).read()), weights_only=True)
                payload += tensor.numel() * tensor.element_size()
    return {"bytes_per_sample": total / samples, "payload_per_sample": payload}


def flux_dev_overhead() -> dict:
    """Bytes on disk per sample against the tensor payload at FLUX.1-dev shapes (1024 px, 512 T5 tokens, bf16):
    real torch.save sizes, tar members of 512-byte headers padded to 512, plus a caption and meta.json."""
    fields = {"latents.pth": (16, 128, 128), "prompt_embeds.pth": (512, 4096), "pooled_prompt_embeds.pth": (768,)}
    payload = on_disk = 0
    for shape in fields.values():
        tensor = torch.zeros(shape, dtype=torch.bfloat16)
        buffer = io.BytesIO()
        torch.save(tensor, buffer)
        payload += tensor.numel() * tensor.element_size()
        on_disk += 512 + -(-len(buffer.getvalue()) // 512) * 512
    meta = json.dumps({"source_id": "images/000000.jpg", "original_size": [1024, 1024], "crop_box": [0, 0, 1024, 1024],
                       "size": [1024, 1024], "notes": []})
    for text in ("a caption of about a hundred characters, as long as a typical alt-text caption in a web dataset",
                 meta):
        on_disk += 512 + -(-len(text.encode()) // 512) * 512
    return {"payload": payload, "on_disk": on_disk, "ratio": on_disk / payload}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    c.add_common_flags(parser)
    parser.add_argument("--sizes", type=int, nargs="+", default=[256, 1024, 4096], help="images per run")
    parser.add_argument("--rounds", type=int, default=2, help="runs per side and size, interleaved")
    parser.add_argument("--sides", nargs="+", choices=SIDES, default=list(SIDES))
    parser.add_argument("--source-px", type=int, default=512)
    parser.add_argument("--primus-checkout", help="a Primus source tree, for the primus side")
    parser.add_argument("--primus-git", help="a bare git mirror of Primus (HEAD:primus exported), for the primus side")
    parser.add_argument("--phases", action="store_true", help="first, the embedded server's fixed cost by phase")
    parser.add_argument("--load", type=int, default=0, help="processes keeping one core busy each during the rounds")
    parser.add_argument("--load-limit", type=float, default=7200.0,
                        help="seconds after which each load process ends by itself")
    args = parser.parse_args(argv)

    cache = c.cache_dir(args.cache_dir)
    scratch, cleanup = c.work_dir(args.work_dir)
    primus_tree = primus_side.checkout(args.primus_checkout, args.primus_git, scratch)
    if "primus" in args.sides and primus_tree is None:
        print("  primus side skipped: no --primus-checkout DIR or --primus-git MIRROR given")
        args.sides = [side for side in args.sides if side != "primus"]
    elif primus_tree is not None:
        print(f"  primus side: {primus_side.tree_revision(primus_tree, args.primus_git)}, run unmodified by "
              f"{sys.executable} with PYTHONPATH at the tree, --device {primus_side.device()}")
    source = c.jpeg_source(cache, max(args.sizes), args.source_px)
    model = c.tiny_model(cache)
    print(f"cli: {os.cpu_count()} CPUs, torch {torch.__version__}; children run with MALLOC_* and "
          f"DIFFPREP_MALLOC_TUNING unset, OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'unset')} "
          f"(diffprep sets PASSIVE for itself); load average {c.load_average()}")
    print(f"== tiny encoders, {args.source_px} px JPEG -> {SETTINGS}, --no-finalize; sizes {args.sizes}; "
          f"sides {args.sides}; {args.rounds} rounds")
    if args.phases:
        import prefect_phases

        prefect_phases.report(child_env(), scratch)
    server = load = None
    results: dict[int, dict[str, list[dict]]] = {n: {side: [] for side in args.sides} for n in args.sizes}
    try:
        if any(side.startswith("server") for side in args.sides):
            (scratch / "server-home").mkdir()
            server = PrefectServer(scratch / "server-home")
            print(f"  prefect server on {server.url}: answered /health {server.startup:.1f} s after start")
        embedded_home = scratch / "embedded-home"
        embedded_home.mkdir()

        def run_side(side: str, n: int, tag: str) -> dict:
            out = scratch / f"out-{side}-{n}-{tag}"
            if side.startswith("serial"):
                run = run_command(serial_command(source, model, out, n, side == "serial-tuned"), child_env(), out)
            elif side == "primus":
                command = primus_side.command(sys.executable, primus_tree, source,
                                              primus_side.flux_named(model, scratch), out, n, SETTINGS)
                run = run_command(command, primus_side.env(child_env(), primus_tree), out)
            else:
                fresh = scratch / f"fresh-home-{side}-{n}-{tag}"
                home = {"embedded": embedded_home, "embedded-flow": embedded_home, "embedded-fresh": fresh,
                        "embedded-fresh-unseeded": fresh}.get(side, scratch / "server-home")
                home.mkdir(exist_ok=True)
                env = child_env(PREFECT_HOME=str(home))
                if side == "embedded-fresh-unseeded":
                    env["DIFFPREP_PREFECT_TEMPLATE"] = "0"
                if side == "embedded-flow":
                    env["DIFFPREP_LIVE_FLOW"] = "1"
                if not side.startswith("embedded"):
                    env["PREFECT_API_URL"] = server.url
                if side == "server-untuned":
                    env["DIFFPREP_MALLOC_TUNING"] = "0"
                run = run_command(diffprep_command(source, model, out, n), env, out)
                run |= analyse(run)
            run |= disk_figures(out, n)
            run["samples"] = primus_side.count_samples(out)
            shutil.rmtree(out, ignore_errors=True)
            run.pop("lines")
            return run

        # One small run per kind first: Prefect's database, flow registration, file caches; not timed.
        for side in dict.fromkeys(s if not s.startswith("server") else "server" for s in args.sides):
            run_side(side, 16, "warmup")
        if "primus" in args.sides:
            same = {"diffprep": scratch / "same-diffprep", "primus": scratch / "same-primus"}
            run_command([*diffprep_command(source, model, same["diffprep"], 8), "--latent-mode", "mode"],
                        child_env(PREFECT_HOME=str(embedded_home)), same["diffprep"])
            run_command(primus_side.command(sys.executable, primus_tree, source, primus_side.flux_named(
                model, scratch), same["primus"], 8, SETTINGS, "resample"),
                primus_side.env(child_env(), primus_tree), same["primus"])
            print("  same tensors (8 images, posterior mean): "
                  + primus_side.describe(primus_side.differences(same["diffprep"], same["primus"])))
        if args.load:
            load = BackgroundLoad(args.load, args.load_limit)
            print(f"  other load: {args.load} busy process(es), one core each, for every timed run")
        for n in args.sizes:
            for r in range(args.rounds):
                order = args.sides if r % 2 == 0 else args.sides[::-1]
                for side in order:
                    run = run_side(side, n, str(r))
                    results[n][side].append(run)
                    extra = ""
                    if "marks" in run:
                        extra = (f", first unit at {run['first_unit'] or float('nan'):.1f} s, units "
                                 f"{run['units_pace'] or 0:.1f} samples/s = "
                                 f"{(run['units_pace'] or 0) / (run['sanity_pace'] or 1):.2f} of sanity pace")
                    print(f"    {n:5d} round {r + 1}: {side:<15} {run['seconds']:7.1f} s, {n / run['seconds']:5.1f} "
                          f"samples/s, {run['samples']} samples, peak RSS {run['peak_rss'] / MIB:6.0f} MiB{extra} (load {c.load_average()})",
                          flush=True)
    finally:
        if load is not None:
            load.stop()
        if server is not None:
            server.stop()
        cleanup()

    summary, versus_primus = [], []
    for n in args.sizes:
        best = {side: min(runs, key=lambda run: run["seconds"]) for side, runs in results[n].items()}
        print(f"\n  {n} images:")
        for side, run in best.items():
            spread = max(r["seconds"] for r in results[n][side]) / run["seconds"] - 1
            print(f"    {side:<15} {n / run['seconds']:6.1f} samples/s (best of {len(results[n][side])}, slowest "
                  f"+{spread:.0%}), peak RSS {run['peak_rss'] / MIB:6.0f} MiB, "
                  f"{run['bytes_per_sample'] / run['payload_per_sample']:.3f} x payload on disk")
            if "marks" in run:
                marks = run["marks"]
                steps, previous = [], 0.0
                for name, at in sorted(marks.items(), key=lambda item: item[1]):
                    steps.append(f"{name} +{at - previous:.1f}")
                    previous = at
                print("      start-up to first committed unit "
                      f"{marks.get('first unit committed', float('nan')):.1f} s: "
                      + ", ".join(steps))
                print(f"      units {run['units_pace']:.1f} samples/s against sanity batch {run['sanity_pace']:.1f}: "
                      f"{run['units_pace'] / run['sanity_pace']:.2f}")
        if "serial" in best:
            for side in DIFFPREP_SIDES:
                if side in best:
                    ratio = best["serial"]["seconds"] / best[side]["seconds"]
                    print(f"    {side} / serial: {ratio:.2f}x")
                    if side == "server":
                        summary.append(f"{n}: {ratio:.2f}x")
            if "serial-tuned" in best and "server" in best:
                print(f"    server / serial-tuned (same allocator): "
                      f"{best['serial-tuned']['seconds'] / best['server']['seconds']:.2f}x")
        if "primus" in best:
            for side in DIFFPREP_SIDES:
                if side in best:
                    ratio = best["primus"]["seconds"] / best[side]["seconds"]
                    print(f"    {side} / primus: {ratio:.2f}x samples/s (target >= {TARGET}x: "
                          f"{c.verdict(ratio, TARGET)}), peak RSS {best[side]['peak_rss'] / MIB:.0f} against "
                          f"{best['primus']['peak_rss'] / MIB:.0f} MiB, samples {best[side]['samples']} against "
                          f"{best['primus']['samples']}")
                    if side == "server":
                        versus_primus.append(f"{n}: {ratio:.2f}x")
        for fresh in ("embedded-fresh", "embedded-fresh-unseeded"):
            if "embedded" in best and fresh in best:
                extra = best[fresh]["seconds"] - best["embedded"]["seconds"]
                print(f"    a fresh PREFECT_HOME ({fresh}) costs {extra:+.1f} s over a used one "
                      f"({best[fresh]['seconds'] / best['embedded']['seconds'] - 1:+.0%}; target <= +10%)")
    if "server" in results[args.sizes[0]] and len(args.sizes) > 1:
        rss = [f"{n}: {min(r['peak_rss'] for r in results[n]['server']) / MIB:.0f} MiB" for n in args.sizes]
        print(f"\n  peak RSS of diffprep (server side) by size: {', '.join(rss)}")
    flux = flux_dev_overhead()
    print(f"  FLUX.1-dev shapes (1024 px, 512 T5 tokens, bf16): {flux['on_disk']} bytes on disk per sample for "
          f"{flux['payload']} of tensors: {flux['ratio']:.4f}x (target <= 1.1x)")
    largest = max(args.sizes)
    verdict = ""
    if "server" in results[largest] and "serial" in results[largest]:
        ratio = (min(r["seconds"] for r in results[largest]["serial"])
                 / min(r["seconds"] for r in results[largest]["server"]))
        verdict = f"; at {largest} (target >= {TARGET}x at 4096): {c.verdict(ratio, TARGET)}"
    print(f"\nSUMMARY cli: diffprep (server) / serial samples/s {', '.join(summary) or 'n/a'}{verdict}; "
          f"FLUX.1-dev disk/payload {flux['ratio']:.4f}x [children: MALLOC_* unset]")
    if versus_primus:
        print(f"SUMMARY cli: diffprep (server) / Primus samples/s {', '.join(versus_primus)} (target >= {TARGET}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
