"""Scaling across workers: 1 against 2 worker processes when the encoders' cost is waiting on a device.

The device is simulated: ``SimulatedDevice`` has the interface ``encode_unit``
uses from ``FluxEncoders`` (``encode_images``, ``encode_text``, ``device``);
each call sleeps (default 40 ms for images + 10 ms for text per batch, as a
busy accelerator would keep the host waiting) and returns tensors of the right
shapes. What is left on the host (reading, decoding, batching, writing shards,
committing manifests, handing out units) is the orchestration overhead that
would keep two real devices from doubling the throughput.

The workers are what the multi-worker runner uses: spawned processes, units
handed out one at a time as workers free up (``ProcessPoolExecutor``, as
Prefect's ``ProcessPoolTaskRunner``), each worker calling ``encode_unit`` on
disjoint units of one plan. When ``diffprep.run.workers.claim_device`` exists it
is the pool initializer, as in the real runner (device claim and the CPU
thread split); otherwise a plain one stands in. Prefect's own per-task cost
(API calls, state changes) is not included.

Target: 2 workers >= 1.8x the samples/s of 1 worker.

    python benchmarks/scaling.py
    python benchmarks/scaling.py --units 32 --image-ms 80 --workers 4
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import shutil
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import _env  # first: offline environment, --malloc re-exec before torch is imported

# isort: split

import _common as c
import torch

from diffprep.encodings.preencoded import preencoded_fields
from diffprep.run.units import encode_unit
from diffprep.families.flux import TextEmbeddings
from diffprep.phases.fetch import fetch
from diffprep.media.images import ImageSpec
from diffprep.writer.plan import Plan
from diffprep.sources import open_source

TARGET_SPEEDUP = 1.8


class SimulatedDevice:
    """An accelerator that only makes the host wait: FluxEncoders' encode interface, sleeping, right shapes."""

    def __init__(self, *, image_ms: float, text_ms: float, t5_max_length: int, t5_hidden: int = 4096,
                 clip_hidden: int = 768, latent_channels: int = 16, vae_scale_factor: int = 8,
                 dtype: torch.dtype = torch.bfloat16) -> None:
        self.device = torch.device("cpu")
        self.dtype = dtype
        self.image_s = image_ms / 1000
        self.text_s = text_ms / 1000
        self.t5_max_length = t5_max_length
        self.t5_hidden = t5_hidden
        self.clip_hidden = clip_hidden
        self.latent_channels = latent_channels
        self.vae_scale_factor = vae_scale_factor

    def encode_images(self, pixels: torch.Tensor, keys) -> torch.Tensor:
        time.sleep(self.image_s)
        batch, _, height, width = pixels.shape
        shape = (batch, self.latent_channels, height // self.vae_scale_factor, width // self.vae_scale_factor)
        return torch.full(shape, 0.5, dtype=self.dtype)

    def encode_text(self, captions) -> TextEmbeddings:
        time.sleep(self.text_s)
        batch = len(captions)
        return TextEmbeddings(
            prompt_embeds=torch.full((batch, self.t5_max_length, self.t5_hidden), 0.25, dtype=self.dtype),
            pooled_prompt_embeds=torch.full((batch, self.clip_hidden), 0.125, dtype=self.dtype),
            t5_truncated=[False] * batch,
        )


# --- the worker process ---------------------------------------------------------------------------

_worker: dict = {}


def _init_worker(devices: list[str], claim_dir: str, device_args: dict, source_settings, use_claim: bool,
                 background_writer: bool) -> None:
    c.use_background_writer(background_writer)
    if use_claim:
        from diffprep.run.workers import claim_device

        claim_device(devices, claim_dir)
    _worker["encoders"] = SimulatedDevice(**device_args)
    _worker["source"] = open_source(source_settings)


def _ready(seconds: float) -> int:
    time.sleep(seconds)  # long enough that every worker of the pool takes one
    return os.getpid()


def _encode(out_dir: str, plan: Plan, unit: int, spec: ImageSpec, batch_size: int, decode_workers: int) -> int:
    result = encode_unit(out_dir, plan, unit, preencoded_fields(_worker["encoders"]), _worker["source"], spec,
                         batch_size=batch_size, decode_workers=decode_workers)
    return result.count + result.rejected


def _uses_claim_device() -> bool:
    try:
        from diffprep.run import workers
    except ImportError:
        return False
    return hasattr(workers, "claim_device")


class Pool:
    """``workers`` spawned processes, started and warmed before any timing."""

    def __init__(self, workers: int, args: argparse.Namespace, plan: Plan, settings, spec: ImageSpec,
                 scratch: Path, use_claim: bool) -> None:
        self.workers = workers
        self.plan, self.spec, self.args = plan, spec, args
        self.out = scratch / f"out-{workers}-workers"
        claim_dir = scratch / f"claims-{workers}"
        claim_dir.mkdir()
        device_args = {"image_ms": args.image_ms, "text_ms": args.text_ms, "t5_max_length": args.t5_max_length,
                       "t5_hidden": args.t5_hidden}
        self.executor = ProcessPoolExecutor(
            max_workers=workers, mp_context=multiprocessing.get_context("spawn"), initializer=_init_worker,
            initargs=(["cpu"] * workers, str(claim_dir), device_args, settings.source, use_claim,
                      args.background_writer))
        for _ in range(5):
            pids = set(self.executor.map(_ready, [1.0] * workers))
            if len(pids) == workers:
                break
        else:
            print(f"  warning: only {len(pids)} of {workers} workers answered the warm-up", flush=True)

    def run(self) -> int:
        shutil.rmtree(self.out, ignore_errors=True)
        self.out.mkdir()
        futures = [self.executor.submit(_encode, str(self.out), self.plan, unit.unit, self.spec,
                                        self.args.batch_size, self.args.decode_workers)
                   for unit in self.plan.units]
        return sum(future.result() for future in futures)

    def close(self) -> None:
        self.executor.shutdown(wait=True, cancel_futures=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    c.add_common_flags(parser)
    parser.add_argument("--workers", type=int, default=2, help="worker processes compared with 1 (default 2)")
    parser.add_argument("--units", type=int, default=12, help="units in the plan (default 12)")
    parser.add_argument("--shard-size", type=int, default=32, help="samples per unit (default 32)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--image-ms", type=float, default=40.0, help="simulated VAE time per batch (default 40)")
    parser.add_argument("--text-ms", type=float, default=10.0, help="simulated T5 + CLIP time per batch (default 10)")
    parser.add_argument("--source-px", type=int, default=256, help="side of the source JPEGs (default 256)")
    parser.add_argument("--image-size", type=int, default=128, help="encoded image side (default 128)")
    parser.add_argument("--t5-max-length", type=int, default=64,
                        help="tokens of the simulated T5 output [L, 4096] bf16 (default 64; FLUX.1-dev: 512)")
    parser.add_argument("--t5-hidden", type=int, default=4096)
    parser.add_argument("--decode-workers", type=int, default=1, help="decode threads per worker (default 1)")
    parser.add_argument("--rounds", type=int, default=3, help="runs per worker count, interleaved (default 3)")
    parser.add_argument("--background-writer", action="store_true",
                        help="the proposed fix: shards written by a background thread (monkeypatched, see _common)")
    args = parser.parse_args(argv)
    if args.workers < 2:
        parser.error("--workers must be at least 2 (it is compared with 1)")

    use_claim = _uses_claim_device()
    samples = args.units * args.shard_size
    device_s = samples / args.batch_size * (args.image_ms + args.text_ms) / 1000
    print(f"scaling: {c.describe_machine()}")
    print(f"== {args.units} units x {args.shard_size} samples of {args.source_px} px JPEG -> {args.image_size} px, "
          f"batch {args.batch_size}, simulated device {args.image_ms:g} + {args.text_ms:g} ms per batch "
          f"({device_s:.1f} s of device time for one worker), T5 output [{args.t5_max_length}, {args.t5_hidden}] "
          f"bf16; worker initializer: {'diffprep.run.workers.claim_device' if use_claim else 'stand-in'}; "
          f"writer: {'background thread (proposed fix)' if args.background_writer else 'diffprep as is'}")
    cache = c.cache_dir(args.cache_dir)
    scratch, cleanup = c.work_dir(args.work_dir)
    pools: list[Pool] = []
    try:
        source_dir = c.jpeg_source(cache, samples, args.source_px)
        config = c.Config("scaling", model="tiny", image_size=args.image_size, t5_max_length=args.t5_max_length,
                          samples=samples, shard_size=args.shard_size, batch_size=args.batch_size,
                          source_px=args.source_px, precision="bf16", decode_workers=args.decode_workers)
        # The tiny model only gives fetch() a real encoder folder to plan against; nothing loads it.
        settings = c.settings_for(config, c.tiny_model(cache), source_dir, scratch / "unused")
        plan, _ = fetch(settings)
        spec = ImageSpec.from_config(settings.image)
        start = time.perf_counter()
        pools = [Pool(1, args, plan, settings, spec, scratch, use_claim),
                 Pool(args.workers, args, plan, settings, spec, scratch, use_claim)]
        print(f"  pools started and warmed in {time.perf_counter() - start:.1f} s (not timed)", flush=True)
        names = {pool.workers: f"{pool.workers} worker{'s' if pool.workers > 1 else ''}" for pool in pools}
        times = c.interleaved(args.rounds, {names[pool.workers]: pool.run for pool in pools}, cpu_time=False)
        identical = c.shard_hashes(pools[0].out) == c.shard_hashes(pools[1].out)
    finally:
        for pool in pools:
            pool.close()
        cleanup()
    rate = {name: samples / c.best(times[name]) for name in times}
    one, many = rate[names[1]], rate[names[args.workers]]
    speedup = many / one
    ideal = samples / device_s
    for name in times:
        print(f"  {name:<10} {rate[name]:8.1f} samples/s   (device-bound ideal per worker: {ideal:.1f})")
    print(f"  speed-up {speedup:.2f}x with {args.workers} workers   (shards byte-identical: "
          f"{'yes' if identical else 'NO'})")
    print(f"  one worker reaches {one / ideal:.0%} of its simulated device's pace")
    target = TARGET_SPEEDUP if args.workers == 2 else 0.9 * args.workers
    print(f"\nSUMMARY scaling: {args.workers} workers {speedup:.2f}x of 1 worker (target >= {target:.1f}x: "
          f"{c.verdict(speedup, target)}); 1 worker at {one / ideal:.0%} of the simulated device pace"
          f"{' (background writer)' if args.background_writer else ''} "
          f"[{_env.malloc_description()}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
