"""Caption de-duplication: text-encoder work and end-to-end samples/s with the caption cache and without it.

A class-label dataset (issue #15): 1,000 images of 10 classes, an HF ``ClassLabel`` dataset written locally
(``save_to_disk``), captioned by ``--caption-template "a photo of a {label}"``. End to end is
``diffprep.run.units.encode_unit`` over every unit of a real plan (``diffprep.phases.fetch.fetch`` on the HF source),
writing real shards and manifests, with the tiny encoder set. The two sides share the loaded encoders; each
round starts with an empty cache (``model.text_cache_mib`` as set, or 0). A second configuration, the same
number of JPEGs with distinct captions (a directory source), shows what the cache costs when nothing repeats.

Printed per side: T5 forward passes (hooked), captions put through the text encoders, and samples/s (the
fastest of the interleaved rounds); per configuration, whether the two sides wrote byte-identical shards.

    python benchmarks/caption_dedup.py                          # 1,000 images, 10 classes, 3 rounds
    python benchmarks/caption_dedup.py --samples 200 --rounds 2  # quicker
"""

from __future__ import annotations

import argparse
import io
import sys
from pathlib import Path

import _env  # first: offline environment, --malloc re-exec before torch is imported

# isort: split

import _common as c
import numpy as np

from diffprep.config import load_settings
from diffprep.families.flux import FluxEncoders
from diffprep.families.text_cache import TEXT_BATCH, TextCache, cache_bytes
from diffprep.phases.fetch import fetch
from diffprep.media.images import ImageSpec

# Ten class names both tiny tokenizers know as whole words.
CLASSES = ["cat", "dog", "bird", "horse", "tree", "flower", "car", "house", "mountain", "river"]
TEMPLATE = "a photo of a {label}"


def class_label_source(cache: Path, count: int, size: int, classes: int, seed: int = 0) -> Path:
    """An HF ClassLabel dataset of ``count`` ``size``-px JPEGs, labels drawn evenly from ``classes`` names."""
    import datasets

    root = cache / f"hf-classlabel-{count}x{size}px-{classes}classes-seed{seed}"
    if (root / ".complete").is_file():
        return root
    rng = np.random.default_rng(seed)
    labels = rng.permutation(np.arange(count) % classes).tolist()
    images = []
    for _ in range(count):
        buffer = io.BytesIO()
        c._photo_like(rng, size).save(buffer, "JPEG", quality=90)
        images.append({"bytes": buffer.getvalue(), "path": None})
    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=CLASSES[:classes])})
    datasets.Dataset.from_dict({"image": images, "label": labels}, features=features).save_to_disk(str(root))
    (root / ".complete").write_text("ok\n")
    return root


def setup_for(name: str, source: dict, args: argparse.Namespace, model: Path, scratch: Path) -> c.Setup:
    config = c.Config(name, model="tiny", image_size=args.image_size, t5_max_length=args.t5_max_length,
                      samples=args.samples, shard_size=args.shard_size, batch_size=args.batch_size,
                      source_px=args.source_px, precision=args.precision)
    out = scratch / f"out-{name}"
    settings = load_settings(overrides={
        "source": source,
        "output": {"output_dir": str(out), "shard_size": config.shard_size, "max_samples": config.samples},
        "model": {"model_path": str(model), "precision": config.precision, "device": "cpu",
                  "batch_size": config.batch_size, "t5_max_length": config.t5_max_length, "latent_mode": "sample"},
        "image": {"image_size": config.image_size, "decode_workers": config.decode_workers},
    })
    plan, opened = fetch(settings)
    if plan.total_samples != config.samples:
        raise RuntimeError(f"planned {plan.total_samples} samples, wanted {config.samples}")
    encoders = FluxEncoders.load(settings.model)
    return c.Setup(config, settings, plan, opened, ImageSpec.from_config(settings.image), encoders, out)


def measure(setup: c.Setup, args: argparse.Namespace, scratch: Path) -> dict:
    """Both sides interleaved; each round starts from an empty cache. Returns rates, counts and the shard check."""
    encoders = setup.encoders
    forwards: list[int] = []
    encoders.t5_text.register_forward_hook(lambda module, inputs, output: forwards.append(inputs[0].shape[0]))
    bounds = {"cache": cache_bytes(args.text_cache_mib), "no cache": 0}
    counts: dict[str, dict] = {}

    def side(name: str):
        def go() -> int:
            encoders.text_cache = TextCache(bounds[name])
            forwards.clear()
            done = c.encode_with_library(setup, scratch / f"{setup.config.name}-{name}")
            counts[name] = {"forwards": len(forwards), "rows": sum(forwards), **encoders.text_cache.stats.to_json()}
            return done
        return go

    c.encode_in_memory(encoders, c.decoded_batches(setup)[:1])  # warm-up: first calls build kernels
    times = c.interleaved(args.rounds, {name: side(name) for name in bounds})
    identical = (c.shard_hashes(scratch / f"{setup.config.name}-cache")
                 == c.shard_hashes(scratch / f"{setup.config.name}-no cache"))
    rates = {name: setup.config.samples / c.best(seconds) for name, seconds in times.items()}
    return {"rates": rates, "counts": counts, "identical": identical}


def report(name: str, setup: c.Setup, result: dict) -> str:
    print(f"\n  {name}: {setup.config.describe()}")
    for side, rate in result["rates"].items():
        n = result["counts"][side]
        print(f"    {side:<9} {rate:8.1f} samples/s; T5 forward passes {n['forwards']:5d} ({n['rows']} rows of "
              f"{TEXT_BATCH}-caption batches), captions encoded {n['encoded']:5d} of {n['captions']}, "
              f"from the cache {n['hits']}")
    speedup = result["rates"]["cache"] / result["rates"]["no cache"]
    calls = result["counts"]["no cache"]["forwards"] / max(1, result["counts"]["cache"]["forwards"])
    print(f"    cache / no cache: {speedup:.2f}x samples/s, {calls:.0f}x fewer T5 forward passes; shards "
          f"byte-identical: {'yes' if result['identical'] else 'NO'}")
    return (f"{name}: {speedup:.2f}x samples/s ({result['rates']['cache']:.1f} / {result['rates']['no cache']:.1f}), "
            f"text-encoder calls {result['counts']['cache']['forwards']} / {result['counts']['no cache']['forwards']}"
            f"{'' if result['identical'] else ', SHARDS DIFFER'}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    c.add_common_flags(parser)
    parser.add_argument("--samples", type=int, default=1000)
    parser.add_argument("--classes", type=int, default=10, choices=range(1, len(CLASSES) + 1), metavar="1..10")
    parser.add_argument("--rounds", type=int, default=3, help="measurements per side, interleaved (default 3)")
    parser.add_argument("--shard-size", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--image-size", type=int, default=64)
    parser.add_argument("--source-px", type=int, default=256)
    parser.add_argument("--t5-max-length", type=int, default=512)
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--text-cache-mib", type=int, default=None, help="the cache side's bound (default: "
                        "diffprep's own)")
    parser.add_argument("--only", choices=["classes", "distinct"], default=None)
    args = parser.parse_args()

    cache = c.cache_dir(args.cache_dir)
    scratch, cleanup = c.work_dir(args.work_dir)
    print(f"caption_dedup: {c.describe_machine()}")
    summary = []
    try:
        model = c.tiny_model(cache)
        if args.only in (None, "classes"):
            data = class_label_source(cache, args.samples, args.source_px, args.classes)
            source = {"type": "huggingface", "hf_dataset": str(data), "caption_template": TEMPLATE}
            setup = setup_for(f"{args.classes}-classes", source, args, model, scratch)
            summary.append(report(f"{args.classes} classes", setup, measure(setup, args, scratch)))
        if args.only in (None, "distinct"):
            data = c.jpeg_source(cache, args.samples, args.source_px)
            setup = setup_for("distinct", {"type": "directory", "input_dir": str(data)}, args, model, scratch)
            summary.append(report("distinct captions", setup, measure(setup, args, scratch)))
    finally:
        cleanup()
    print(f"\nSUMMARY caption_dedup, {args.samples} samples, cache / no cache: " + "; ".join(summary)
          + f" [{_env.malloc_description()}; load {c.load_average()}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
