"""Writing to a bucket: a shard uploaded while it is written, against the same shard uploaded after it.

Each unit is encoded with a simulated device (``scaling.SimulatedDevice``: the
host waits, as on a busy accelerator) into a bucket prefix on moto's S3
server on loopback, and committed there (``S3Output.publish_unit``):

- ``after``: ``encode_unit`` writes the shard, then ``publish_unit`` uploads it
  (what a store without streaming would do);
- ``streamed``: the shard's bytes go to an ``ObjectUpload`` sink as they are
  written, so its parts are on their way while the device works; ``publish_unit``
  only sends the last part and completes the upload (diffprep's way).

Both commit identical objects. A real store is a network link away: the
requests go through a proxy that holds each request body for its time on a
link of ``--link-mbps`` (0: loopback as it is). moto runs in this process, so
its own work (hashing, storing) shares the CPUs with the encoding, as it
would not on a real store.

Target: streamed >= 1.3x the samples/s of after, at the default sizes.

    python benchmarks/s3_upload.py
    python benchmarks/s3_upload.py --link-mbps 0          # loopback: upload is CPU work here
    python benchmarks/s3_upload.py --units 4 --shard-size 64 --image-ms 300
"""

from __future__ import annotations

import argparse
import http.client
import logging
import os
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import _env  # first: offline environment, --malloc re-exec before torch is imported

# isort: split

import _common as c
import boto3
from moto.server import ThreadedMotoServer
from scaling import SimulatedDevice

import diffprep.output.upload
from diffprep.encodings.preencoded import preencoded_fields
from diffprep.run.units import encode_unit
from diffprep.phases.fetch import fetch
from diffprep.media.images import ImageSpec
from diffprep.output import open_output
from diffprep.writer.plan import write_plan
from diffprep.sources import open_source

TARGET_SPEEDUP = 1.3
BUCKET = "bench"


class LinkProxy:
    """Forwards HTTP to ``upstream_port`` over an emulated link of ``mbps``, shared by all connections: request
    bodies pass one after another, each held for its transfer time."""

    def __init__(self, upstream_port: int, mbps: float) -> None:
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def forward(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0) or 0))
                if proxy.mbps > 0 and body:
                    with proxy.lock:  # the link is busy until the bodies before this one are through
                        now = time.monotonic()
                        proxy.free_at = max(now, proxy.free_at) + len(body) / (proxy.mbps * 1e6)
                        until = proxy.free_at
                    time.sleep(max(0.0, until - time.monotonic()))
                upstream = http.client.HTTPConnection("127.0.0.1", proxy.upstream_port, timeout=120)
                try:
                    upstream.request(self.command, self.path, body=body or None, headers=dict(self.headers.items()))
                    response = upstream.getresponse()
                    data = response.read()
                    self.send_response(response.status)
                    for name, value in response.getheaders():
                        if name.lower() not in ("transfer-encoding", "connection", "content-length"):
                            self.send_header(name, value)
                    self.send_header("Content-Length", response.getheader("Content-Length", "0")
                                     if self.command == "HEAD" else str(len(data)))
                    self.end_headers()
                    if self.command != "HEAD":
                        self.wfile.write(data)
                finally:
                    upstream.close()

            do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = forward

        self.upstream_port, self.mbps = upstream_port, mbps
        self.lock, self.free_at = threading.Lock(), 0.0
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    c.add_common_flags(parser)
    parser.add_argument("--units", type=int, default=3, help="units per run (default 3)")
    parser.add_argument("--shard-size", type=int, default=48, help="samples per unit (default 48)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--image-ms", type=float, default=300.0, help="simulated VAE time per batch (default 300)")
    parser.add_argument("--text-ms", type=float, default=100.0, help="simulated T5 + CLIP time per batch (default 100)")
    parser.add_argument("--t5-max-length", type=int, default=128,
                        help="T5 output [L, 4096] bf16 (default 128: 1 MiB a sample; FLUX.1-dev: 512)")
    parser.add_argument("--part-mib", type=int, default=8,
                        help="multipart part size (default 8: a 50 MiB shard in 8 MiB parts stands for a GiB shard "
                             "in diffprep's 64 MiB parts; at least 5)")
    parser.add_argument("--link-mbps", type=float, default=20.0,
                        help="emulated link to the store, MB/s (default 20: as long as the device per unit; "
                             "0: loopback as it is)")
    parser.add_argument("--rounds", type=int, default=3, help="runs per side, interleaved (default 3)")
    args = parser.parse_args(argv)
    if args.part_mib < 5:
        parser.error("--part-mib must be at least 5 (S3's smallest part)")
    diffprep.output.upload.MULTIPART_CHUNK = args.part_mib << 20

    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    for name, value in {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench",
                        "AWS_DEFAULT_REGION": "us-east-1"}.items():
        os.environ.setdefault(name, value)
    samples = args.units * args.shard_size
    print(f"s3_upload: {c.describe_machine()}")
    print(f"== {args.units} units x {args.shard_size} samples, batch {args.batch_size}, simulated device "
          f"{args.image_ms:g} + {args.text_ms:g} ms per batch, T5 [{args.t5_max_length}, 4096] bf16; "
          f"{args.part_mib} MiB parts, moto on 127.0.0.1, link "
          f"{f'{args.link_mbps:g} MB/s' if args.link_mbps else 'loopback'}")
    cache = c.cache_dir(args.cache_dir)
    scratch, cleanup = c.work_dir(args.work_dir)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    link = LinkProxy(server.get_host_and_port()[1], args.link_mbps)
    try:
        endpoint = link.url
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
            if side == "after":  # no sink: the unit's commit uploads the finished shard
                output.shard_sink = lambda unit: None
            done = 0
            for unit in plan.units:
                result = encode_unit(output, plan, unit.unit, preencoded_fields(device), source, spec,
                                     batch_size=args.batch_size, decode_workers=1)
                done += result.count + result.rejected
            return done

        start = time.perf_counter()
        times = c.interleaved(args.rounds, {"after": lambda: run("after"), "streamed": lambda: run("streamed")})
        after, streamed = c.best(times["after"]), c.best(times["streamed"])
        speedup = after / streamed
        print(f"   after     {samples / after:7.1f} samples/s   (best of {args.rounds}: {after:.2f} s)")
        print(f"   streamed  {samples / streamed:7.1f} samples/s   (best of {args.rounds}: {streamed:.2f} s)")
        print(f"   speedup {speedup:.2f}x; {time.perf_counter() - start:.0f} s in all")
        store = f"{args.link_mbps:g} MB/s link" if args.link_mbps else "loopback"
        print(f"\nSUMMARY s3_upload: streamed upload {speedup:.2f}x the samples/s of upload after the shard "
              f"({store}; target >= {TARGET_SPEEDUP}x: {c.verdict(speedup, TARGET_SPEEDUP)}) "
              f"[{_env.malloc_description()}]")
        return 0 if speedup >= TARGET_SPEEDUP else 1
    finally:
        link.stop()
        server.stop()
        cleanup()


if __name__ == "__main__":
    sys.exit(main())
