"""Video (Wan) efficiency: end-to-end clips/s of the library's encode path / clips/s of the encoders alone, and
what PyAV decoding costs per clip.

End to end is ``diffprep.run.units.encode_unit`` over every unit of a real Wan plan
(``diffprep.phases.fetch.fetch`` on a directory of H.264 clips: the plan probes each
clip into its bucket, one bucket per unit), writing real shards and manifests,
with the tiny Wan set (``diffprep tiny-model --family wan``). The compute limit
is the same encoders on the same batches, already decoded and stacked in memory
(``encode_video`` + ``encode_text``, no I/O); the library's reader alone (read,
decode, resample, crop, batch) is the input limit. Per clip, on one thread:
``prepare_clip`` (PyAV demux and decode up to the last frame kept, RGB, resize
and crop), the plan's probe (``ClipSpec.bucket_of``: the container's index and
one frame), and the raw video pipeline's mp4 write (``mp4_bytes``).

The clips are moving gradients with a moving square, written once into the
cache (``--source WxHxF``, 16 fps, crf 23); both orientations, so two buckets.

    python benchmarks/video.py                                  # 16 clips 160x120x17 -> 128x96x17
    python benchmarks/video.py --clips 4 --source 320x240x33 --bucket 256x192x33 --rounds 1  # 9 s a clip here
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from fractions import Fraction
from pathlib import Path

import _env  # first: offline environment, --malloc re-exec before torch is imported

# isort: split

import _common as c
import av
import numpy as np
import torch

from diffprep.config import load_settings
from diffprep.encodings import get_encoding
from diffprep.families.wan import WanEncoders
from diffprep.families.wan_tiny import write_tiny_wan
from diffprep.phases.fetch import fetch
from diffprep.media.buckets import Bucket, parse_bucket
from diffprep.media.mp4 import mp4_bytes
from diffprep.run.reader import iter_batches, prefetch
from diffprep.run.units import encode_unit

TARGET = 0.90  # as the image pipeline's compute-bound figure (efficiency.py)


def clip_source(cache: Path, count: int, width: int, height: int, frames: int) -> Path:
    """``count`` H.264 clips with captions in the directory layout (every other one portrait), written once."""
    root = cache / f"clips-{count}-{width}x{height}x{frames}"
    if (root / ".complete").is_file():
        return root
    shutil.rmtree(root, ignore_errors=True)
    (root / "videos").mkdir(parents=True)
    (root / "captions").mkdir()
    rng = np.random.default_rng(0)
    for i in range(count):
        w, h = (width, height) if i % 2 == 0 else (height, width)
        y, x = np.mgrid[0:h, 0:w]
        phase = rng.uniform(0, 6.28, 3)
        with av.open(str(root / "videos" / f"{i:05d}.mp4"), "w") as container:
            stream = container.add_stream("libx264", rate=Fraction(16), options={"crf": "23"})
            stream.width, stream.height, stream.pix_fmt = w, h, "yuv420p"
            for k in range(frames):
                rgb = np.stack([127 + 100 * np.sin(x / 17 + k / 5 + phase[0]),
                                127 + 100 * np.sin(y / 23 - k / 7 + phase[1]),
                                127 + 100 * np.sin((x + y) / 31 + phase[2])], axis=-1)
                side = min(w, h) // 4
                left, top = (k * 5) % (w - side), (k * 3) % (h - side)
                rgb[top:top + side, left:left + side] = (240, 240, 240)
                frame = av.VideoFrame.from_ndarray(rgb.astype(np.uint8), format="rgb24")
                container.mux(stream.encode(frame))
            container.mux(stream.encode())
        (root / "captions" / f"{i:05d}.txt").write_text(f"a white square drifting over coloured waves, clip {i}\n")
    (root / ".complete").write_text("ok\n")
    return root


def prepare_cost(source, plan, spec) -> tuple[float, float]:
    """One-thread seconds per clip: ``prepare_clip`` in the clip's planned bucket, and the plan's probe."""
    samples = [(sample, unit.bucket) for unit in plan.units for sample in source.read(unit.source_ids)]
    start = time.perf_counter()
    for sample, bucket in samples:
        spec.prepare(sample.media, video=True, bucket=parse_bucket(bucket))
    prepare_s = (time.perf_counter() - start) / len(samples)
    start = time.perf_counter()
    for sample, _ in samples:
        spec.bucket_of(sample.media, video=True)
    return prepare_s, (time.perf_counter() - start) / len(samples)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    c.add_common_flags(parser)
    parser.add_argument("--clips", type=int, default=16, help="source clips (default %(default)s)")
    parser.add_argument("--source", default="160x120x17", help="source clips WxHxF (default %(default)s)")
    parser.add_argument("--bucket", default="128x96x17", help="landscape bucket WxHxF; its portrait twin is added "
                        "(default %(default)s)")
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--decode-workers", type=int, default=2)
    parser.add_argument("--t5-max-length", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3, help="measurements per side, interleaved")
    args = parser.parse_args(argv)
    print(f"video: {c.describe_machine()}")
    cache = c.cache_dir(args.cache_dir)
    scratch, cleanup = c.work_dir(args.work_dir)
    try:
        width, height, frames = (int(v) for v in args.source.split("x"))
        bucket = parse_bucket(args.bucket)
        twin = Bucket(bucket.height, bucket.width, bucket.frames)
        model, data = (c.tiny_model(cache, "tiny-wan", write_tiny_wan),
                       clip_source(cache, args.clips, width, height, frames))
        out = scratch / "out"
        settings = load_settings(overrides={
            "source": {"type": "directory", "input_dir": str(data)},
            "output": {"output_dir": str(out), "shard_size": max(2, args.clips // 4)},
            "model": {"model_path": str(model), "precision": "fp32", "device": "cpu", "batch_size": args.batch_size,
                      "t5_max_length": args.t5_max_length, "latent_mode": "sample"},
            "image": {"decode_workers": args.decode_workers},
            "video": {"resolution_buckets": f"{bucket};{twin}"},
        })
        plan, source = fetch(settings)
        wan = get_encoding("wan")
        spec = wan.media_spec(settings, plan)
        encoders = WanEncoders.load(model, device="cpu", dtype="fp32", latent_mode="sample",
                                    text_max_length=args.t5_max_length)
        fields = wan.sample_fields(settings, encoders)
        print(f"\n== {args.clips} clips {args.source} -> {bucket} / {twin}, {len(plan.units)} units, batch "
              f"{args.batch_size}, {args.decode_workers} decode threads, tiny Wan set, fp32", flush=True)

        def batches():
            found = []
            for unit in plan.units:
                rejects: list = []
                found += list(iter_batches(source, unit, spec, args.batch_size, rejects, workers=args.decode_workers))
                if rejects:
                    raise RuntimeError(f"unit {unit.unit}: unexpected rejects {rejects[:3]}")
            return found

        decoded = batches()

        def compute_limit() -> int:
            for batch in decoded:
                encoders.encode_video(batch.pixels, batch.keys)
                encoders.encode_text(batch.captions)
            return sum(len(b.keys) for b in decoded)

        def end_to_end() -> int:
            shutil.rmtree(out, ignore_errors=True)
            out.mkdir(parents=True)
            return sum(encode_unit(out, plan, u.unit, fields, source, spec, batch_size=args.batch_size,
                                   decode_workers=args.decode_workers).count for u in plan.units)

        def input_limit() -> int:
            count = 0
            for unit in plan.units:
                rejects: list = []
                for batch in prefetch(iter_batches(source, unit, spec, args.batch_size, rejects,
                                                   workers=args.decode_workers)):
                    count += len(batch.keys)
            return count

        compute_limit()  # warm-up: first calls build kernels and allocate pools
        prepare_s, probe_s = prepare_cost(source, plan, spec)
        first = decoded[0].pixels[0]
        start = time.perf_counter()
        for _ in range(4):
            mp4_bytes(first, 16.0)
        write_s = (time.perf_counter() - start) / 4
        cpu: dict[str, list[float]] = {}

        def timed(name, side):  # this process's CPU seconds per run too (every thread): robust to other load
            def run() -> int:
                start = time.process_time()
                count = side()
                cpu.setdefault(name, []).append(time.process_time() - start)
                return count
            return run

        times = c.interleaved(args.rounds, {"compute limit": timed("compute", compute_limit),
                                            "end to end": timed("e2e", end_to_end), "input limit": input_limit})
        n = args.clips
        limit, e2e, reader = (n / c.best(times[name]) for name in ("compute limit", "end to end", "input limit"))
        encoder_cpu = c.best(times["compute limit"]) * torch.get_num_threads()
        sharing_bound = encoder_cpu / (encoder_cpu + n * prepare_s)
        efficiency = e2e / limit
        print(f"  compute limit  {limit:8.2f} clips/s   ({1000 / limit:7.1f} ms/clip, encoders alone)")
        print(f"  input limit    {reader:8.2f} clips/s   ({1000 / reader:7.1f} ms/clip, reader alone)")
        print(f"  end to end     {e2e:8.2f} clips/s   ({1000 / e2e:7.1f} ms/clip, encode_unit)")
        print(f"  one thread per clip: prepare_clip {prepare_s * 1000:.1f} ms ({args.source} -> {bucket}), probe "
              f"{probe_s * 1000:.1f} ms, mp4 write {write_s * 1000:.1f} ms")
        cpu_ratio = min(cpu["compute"]) / min(cpu["e2e"])
        print(f"  process CPU per clip: encoders alone {min(cpu['compute']) / n * 1000:.0f} ms, end to end "
              f"{min(cpu['e2e']) / n * 1000:.0f} ms (encoders' share of the pipeline's CPU: {cpu_ratio:.3f})")
        print(f"  efficiency (end to end / compute limit)  {efficiency:.3f}")
        print(f"  bound from sharing {torch.get_num_threads()} cores with decoding: {sharing_bound:.3f} "
              f"(efficiency / bound = {efficiency / sharing_bound:.3f})")
    finally:
        cleanup()
    print(f"\nSUMMARY video: end to end / compute limit {efficiency:.3f} (target >= {TARGET}: "
          f"{c.verdict(efficiency, TARGET)}; {e2e:.2f} / {limit:.2f} clips/s, input limit {reader:.2f}; CPU time: "
          f"encoders {cpu_ratio:.3f} of the pipeline's); PyAV "
          f"prepare_clip {prepare_s * 1000:.1f} ms/clip {args.source} -> {bucket}, probe {probe_s * 1000:.1f} ms, "
          f"mp4 write {write_s * 1000:.1f} ms [{_env.malloc_description()}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
