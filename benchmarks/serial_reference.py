"""The serial reference for benchmarks/cli.py: the same work as ``diffprep encode``, written naively.

What a user would write by hand: decode every image first (one thread, into a
list), then encode batch by batch with the same encoders and settings, clone
and ``torch.save`` each sample's tensors, and append them to tar shards of
``--shard-size`` samples. No Prefect, no plan, manifests, threads, audit or
validation. It uses diffprep's own image preparation and encoders, so the
pixels and tensors are the same work; what differs is the pipeline around them.

    python benchmarks/serial_reference.py INPUT_DIR MODEL_DIR OUT_DIR --samples 1024

``--malloc-tuning`` applies ``diffprep.run.allocator.tune_malloc()`` first (the
default is glibc's defaults, as a hand-written script runs). Prints one JSON
line: samples, seconds from start to the last shard, peak RSS.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import resource
import sys
import tarfile
import time
from pathlib import Path

START = time.perf_counter()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("input_dir", help="a directory source: images/<stem>.jpg and captions/<stem>.txt")
    parser.add_argument("model", help="a Flux encoder folder (diffprep tiny-model)")
    parser.add_argument("out_dir")
    parser.add_argument("--samples", type=int, required=True, help="the first N images, by name")
    parser.add_argument("--image-size", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--shard-size", type=int, default=64)
    parser.add_argument("--precision", default="fp32")
    parser.add_argument("--t5-max-length", type=int, default=512)
    parser.add_argument("--malloc-tuning", action="store_true", help="diffprep.run.allocator.tune_malloc() first")
    args = parser.parse_args(argv)
    if args.malloc_tuning:
        from diffprep.run.allocator import tune_malloc

        tune_malloc()

    import torch

    from diffprep.config import ImageConfig, load_settings
    from diffprep.families.flux import FluxEncoders
    from diffprep.media.images import ImageSpec, prepare_image

    settings = load_settings(overrides={"model": {
        "model_path": args.model, "precision": args.precision, "device": "cpu", "batch_size": args.batch_size,
        "t5_max_length": args.t5_max_length, "latent_mode": "sample"}})
    encoders = FluxEncoders.load(settings.model)
    spec = ImageSpec.from_config(ImageConfig(image_size=args.image_size))

    # 1. decode everything
    images_dir, captions_dir = Path(args.input_dir) / "images", Path(args.input_dir) / "captions"
    names = sorted(p.name for p in images_dir.iterdir())[: args.samples]
    samples = []
    for name in names:
        stem = name.rsplit(".", 1)[0]
        prepared = prepare_image((images_dir / name).read_bytes(), spec)
        caption = (captions_dir / f"{stem}.txt").read_text(encoding="utf-8").strip()
        meta = {"source_id": name, "original_size": list(prepared.original_size),
                "crop_box": list(prepared.crop_box), "size": [args.image_size, args.image_size]}
        samples.append((meta, prepared.pixels, caption))

    # 2. encode batch by batch, save, tar
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tar = None
    for start in range(0, len(samples), args.batch_size):
        batch = samples[start:start + args.batch_size]
        keys = [f"{(start + i) // args.shard_size:06d}_{(start + i) % args.shard_size:06d}" for i in range(len(batch))]
        pixels = torch.stack([pixels for _, pixels, _ in batch])
        latents = encoders.encode_images(pixels, keys)
        text = encoders.encode_text([caption for _, _, caption in batch])
        for i, (meta, _, caption) in enumerate(batch):
            index = start + i
            if index % args.shard_size == 0:
                if tar is not None:
                    tar.close()
                tar = tarfile.open(out / f"{index // args.shard_size:06d}.tar", "w")
            members = {"latents.pth": latents[i], "prompt_embeds.pth": text.prompt_embeds[i],
                       "pooled_prompt_embeds.pth": text.pooled_prompt_embeds[i], "caption.txt": caption,
                       "meta.json": json.dumps(meta)}
            for ext, value in members.items():
                if isinstance(value, str):
                    data = value.encode("utf-8")
                else:
                    buffer = io.BytesIO()
                    torch.save(value.clone(), buffer)
                    data = buffer.getvalue()
                info = tarfile.TarInfo(f"{keys[i]}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    if tar is not None:
        tar.close()
    print(json.dumps({"samples": len(samples), "seconds": time.perf_counter() - START,
                      "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                      "malloc_tuning": bool(args.malloc_tuning), "pid": os.getpid()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
