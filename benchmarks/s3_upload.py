"""Writing to a bucket: a shard uploaded while it is written, against the same shard uploaded after it.

Each unit is encoded with a simulated device (``scaling.SimulatedDevice``: the
host waits, as on a busy accelerator) into a bucket prefix on moto's S3
server on loopback, and committed there (``S3Output.publish_unit``):

- ``after``: ``encode_unit`` writes the shard, then ``publish_unit`` uploads it
  (what a store without streaming would do);
- ``streamed``: the shard's bytes go to an ``ObjectUpload`` sink as they are
  written, so its parts are on their way while the device works; ``publish_unit``
  only sends the last part and completes the upload (diffprep's way).

Both commit identical objects. Loopback is faster than a real link, so the
ratio is a lower bound of what streaming saves when the upload takes as long
as the encoding; ``--image-ms`` sets the device time.

Target: streamed >= 1.3x the samples/s of after, at the default sizes.

    python benchmarks/s3_upload.py
    python benchmarks/s3_upload.py --units 4 --shard-size 64 --image-ms 200
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

import _env  # first: offline environment, --malloc re-exec before torch is imported

# isort: split

import _common as c
import boto3
from moto.server import ThreadedMotoServer
from scaling import SimulatedDevice

from diffprep.encode import encode_unit
from diffprep.fetch import fetch
from diffprep.images import ImageSpec
from diffprep.outputs import open_output
from diffprep.plan import write_plan
from diffprep.sources import open_source

TARGET_SPEEDUP = 1.3
BUCKET = "bench"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    c.add_common_flags(parser)
    parser.add_argument("--units", type=int, default=3, help="units per run (default 3)")
    parser.add_argument("--shard-size", type=int, default=48, help="samples per unit (default 48)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--image-ms", type=float, default=150.0, help="simulated VAE time per batch (default 150)")
    parser.add_argument("--text-ms", type=float, default=50.0, help="simulated T5 + CLIP time per batch (default 50)")
    parser.add_argument("--t5-max-length", type=int, default=512, help="T5 output [L, 4096] bf16: 4 MiB a sample")
    parser.add_argument("--rounds", type=int, default=3, help="runs per side, interleaved (default 3)")
    args = parser.parse_args(argv)

    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    for name, value in {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench",
                        "AWS_DEFAULT_REGION": "us-east-1"}.items():
        os.environ.setdefault(name, value)
    samples = args.units * args.shard_size
    print(f"s3_upload: {c.describe_machine()}")
    print(f"== {args.units} units x {args.shard_size} samples, batch {args.batch_size}, simulated device "
          f"{args.image_ms:g} + {args.text_ms:g} ms per batch, T5 [{args.t5_max_length}, 4096] bf16; "
          f"moto on 127.0.0.1")
    cache = c.cache_dir(args.cache_dir)
    scratch, cleanup = c.work_dir(args.work_dir)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        endpoint = f"http://127.0.0.1:{server.get_host_and_port()[1]}"
        boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=BUCKET)
        os.environ["DIFFPREP_STAGING_DIR"] = str(scratch / "staging")
        source_dir = c.jpeg_source(cache, samples, 256)
        config = c.Config("s3_upload", model="tiny", image_size=128, t5_max_length=args.t5_max_length,
                          samples=samples, shard_size=args.shard_size, batch_size=args.batch_size, source_px=256,
                          precision="bf16", decode_workers=1)
        settings = c.settings_for(config, c.tiny_model(cache), source_dir, scratch / "unused")
        plan, _ = fetch(settings)
        spec = ImageSpec.from_config(settings.image)
        device = SimulatedDevice(image_ms=args.image_ms, text_ms=args.text_ms, t5_max_length=args.t5_max_length)
        source = open_source(settings.source)
        runs = {"after": 0, "streamed": 0}

        def run(side: str) -> int:
            runs[side] += 1
            output = open_output(f"s3://{BUCKET}/{side}-{runs[side]}", endpoint_url=endpoint)
            write_plan(output.local, plan)
            done = 0
            for unit in plan.units:
                upload = output.shard_upload(unit.unit) if side == "streamed" else None
                result = encode_unit(output.local, plan, unit.unit, device, source, spec,
                                     batch_size=args.batch_size, decode_workers=1, sink=upload)
                output.publish_unit(unit.unit, upload)
                done += result.count + result.rejected
            return done

        start = time.perf_counter()
        times = c.interleaved(args.rounds, {"after": lambda: run("after"), "streamed": lambda: run("streamed")})
        after, streamed = c.best(times["after"]), c.best(times["streamed"])
        speedup = after / streamed
        print(f"   after     {samples / after:7.1f} samples/s   (best of {args.rounds}: {after:.2f} s)")
        print(f"   streamed  {samples / streamed:7.1f} samples/s   (best of {args.rounds}: {streamed:.2f} s)")
        print(f"   speedup {speedup:.2f}x (target >= {TARGET_SPEEDUP}x): {c.verdict(speedup, TARGET_SPEEDUP)}; "
              f"{time.perf_counter() - start:.0f} s in all")
        return 0 if speedup >= TARGET_SPEEDUP else 1
    finally:
        server.stop()
        cleanup()


if __name__ == "__main__":
    sys.exit(main())
