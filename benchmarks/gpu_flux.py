"""Efficiency at FLUX.1-dev scale on an accelerator: each encoder alone, the encoders together, end to end.

The encoders have the real FLUX.1-dev architectures with random weights (the
configs below are the public ones of ``vae/``, ``text_encoder/`` and
``text_encoder_2/``; nothing is downloaded): the 16-channel Flux VAE, the
CLIP-L text model and the T5-XXL encoder. They are built in memory on the
device, in the chosen precision, and wrapped in ``FluxEncoders``; the plan is
made by ``diffprep.phases.fetch.fetch`` over a model folder that holds the configs
and tokenizers only (fetch reads configs, never weights). The tokenizers are
diffprep's tiny ones: T5 pads to ``t5_max_length`` and CLIP to 77 tokens
whatever the words, so the encoders' work is the real one.

Figures (samples/s, sides interleaved, the fastest of ``--rounds``):
VAE alone; the text encoders (T5 and CLIP) on batches of exactly
``TEXT_BATCH`` captions as ``encode_text`` runs them, and on the batch as it
is, what that shape costs against (pre-stacked batches, no I/O; the caption
cache off); the compute
limit (all three), the input limit (the reader alone), end to end
(``encode_unit`` writing real shards) and end to end with the proposed
background shard writer. Efficiency = end to end / compute limit.

    python benchmarks/gpu_flux.py                        # cuda when available: 1024 px, bf16, 512 tokens
    python benchmarks/gpu_flux.py --smoke                # shrunken models and sizes, runs on a CPU in ~1 min
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import sys
import time
from pathlib import Path

import _env  # first: offline environment, --malloc re-exec before torch is imported

# isort: split

import _common as c
import torch

from diffprep.families.base import DTYPES, resolve_device
from diffprep.families.flux import FluxEncoders
from diffprep.families.flux import resolve_encoders
from diffprep.phases.fetch import fetch
from diffprep.media.images import ImageSpec
from diffprep.families.flux_tiny import write_tiny_model

# FLUX.1-dev vae/config.json (AutoencoderKL).
FLUX_VAE = {"block_out_channels": (128, 256, 512, 512), "layers_per_block": 2, "norm_num_groups": 32,
            "sample_size": 1024}
# FLUX.1-dev text_encoder/config.json (CLIP ViT-L/14 text tower).
FLUX_CLIP = {"vocab_size": 49408, "hidden_size": 768, "intermediate_size": 3072, "projection_dim": 768,
             "num_hidden_layers": 12, "num_attention_heads": 12, "layer_norm_eps": 1e-5}
# FLUX.1-dev text_encoder_2/config.json (T5 v1.1 XXL, encoder only).
FLUX_T5 = {"vocab_size": 32128, "d_model": 4096, "d_kv": 64, "d_ff": 10240, "num_layers": 24, "num_heads": 64,
           "relative_attention_num_buckets": 32, "relative_attention_max_distance": 128, "layer_norm_epsilon": 1e-6}

# --smoke: the same classes and code paths, shrunken until a CPU runs them in seconds.
SMOKE_VAE = {"block_out_channels": (16, 32, 32, 32), "layers_per_block": 1, "norm_num_groups": 8, "sample_size": 64}
SMOKE_CLIP = {"hidden_size": 64, "intermediate_size": 128, "projection_dim": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4}
SMOKE_T5 = {"d_model": 64, "d_kv": 16, "d_ff": 128, "num_layers": 2, "num_heads": 4,
            "relative_attention_num_buckets": 8, "relative_attention_max_distance": 32}


@contextlib.contextmanager
def building_on(device: torch.device, dtype: torch.dtype):
    """Create parameters directly on ``device`` in ``dtype``: no fp32 copy of T5-XXL (19 GB) in host memory."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            yield
    finally:
        torch.set_default_dtype(previous)


def build_encoders(args: argparse.Namespace, root: Path):
    """Random-weight VAE, CLIP and T5 built on the device, and ``root``: their configs and tokenizers, no weights."""
    device = resolve_device(args.device)
    dtype = DTYPES[args.precision]
    write_tiny_model(root)  # the tokenizers, scheduler and model_index.json; the three models are replaced below
    clip_tokenizer, t5_tokenizer = c.load_tokenizers(root)
    shapes = (SMOKE_VAE, SMOKE_CLIP, SMOKE_T5) if args.smoke else (FLUX_VAE, FLUX_CLIP, FLUX_T5)
    vae_shape, clip_shape, t5_shape = shapes
    start = time.perf_counter()
    with building_on(device, dtype):
        torch.manual_seed(0)
        vae = c.build_vae(**vae_shape)
        clip = c.build_clip(clip_tokenizer, **clip_shape)
        t5 = c.build_t5(t5_tokenizer, **t5_shape)
    for folder, module in (("vae", vae), ("text_encoder", clip), ("text_encoder_2", t5)):
        module.eval()
        module.requires_grad_(False)
        shutil.rmtree(root / folder)
        (root / folder).mkdir()
        if folder == "vae":
            module.save_config(root / folder)
        else:
            module.config.save_pretrained(root / folder)
    params = {name: sum(p.numel() for p in m.parameters()) for name, m in (("vae", vae), ("clip", clip), ("t5", t5))}
    print(f"  built on {device} in {dtype} in {time.perf_counter() - start:.1f} s: "
          + ", ".join(f"{name} {n / 1e6:,.1f} M params" for name, n in params.items()), flush=True)
    return vae, clip, clip_tokenizer, t5, t5_tokenizer, device, dtype


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    c.add_common_flags(parser)
    parser.add_argument("--smoke", action="store_true",
                        help="shrunken models and sizes on the CPU, to test the script (figures mean nothing)")
    parser.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    parser.add_argument("--precision", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--image-size", type=int, default=None, help="default 1024 (smoke: 64)")
    parser.add_argument("--source-px", type=int, default=None,
                        help="side of the source JPEGs (default 1024; smoke 128)")
    parser.add_argument("--t5-max-length", type=int, default=None, help="default 512 (smoke: 32)")
    parser.add_argument("--samples", type=int, default=None, help="default 256 (smoke: 16)")
    parser.add_argument("--shard-size", type=int, default=None, help="default 128 (smoke: 8)")
    parser.add_argument("--batch-size", type=int, default=None, help="default 8 (smoke: 4)")
    parser.add_argument("--decode-workers", type=int, default=2, help="decode threads (default 2, the library's)")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args(argv)
    smoke = args.smoke
    args.device = args.device or ("cpu" if smoke or not torch.cuda.is_available() else "cuda")
    config = c.Config(
        "flux-smoke" if smoke else "flux",
        model="flux",
        image_size=args.image_size or (64 if smoke else 1024),
        t5_max_length=args.t5_max_length or (32 if smoke else 512),
        samples=args.samples or (16 if smoke else 256),
        shard_size=args.shard_size or (8 if smoke else 128),
        batch_size=args.batch_size or (4 if smoke else 8),
        source_px=args.source_px or (128 if smoke else 1024),
        precision=args.precision,
        decode_workers=args.decode_workers,
    )
    print(f"gpu_flux: {c.describe_machine()}")
    print(f"== {config.describe()}, device {args.device}{' (SMOKE: shrunken models)' if smoke else ''}", flush=True)
    cache = c.cache_dir(args.cache_dir)
    scratch, cleanup = c.work_dir(args.work_dir)
    try:
        source_dir = c.jpeg_source(cache, config.samples, config.source_px)
        model_dir = scratch / "flux-configs"
        vae, clip, clip_tok, t5, t5_tok, device, dtype = build_encoders(args, model_dir)
        settings = c.settings_for(config, model_dir, source_dir, scratch / "out")
        plan, source = fetch(settings)
        encoders = FluxEncoders(vae, clip, clip_tok, t5, t5_tok, device=device, dtype=dtype,
                                t5_max_length=config.t5_max_length, latent_mode="sample",
                                parts=resolve_encoders(settings.model), text_cache_bytes=0)
        setup = c.Setup(config, settings, plan, source, ImageSpec.from_config(settings.image), encoders,
                        scratch / "out")
        batches = c.decoded_batches(setup)
        c.warm_up(setup, batches)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)

        def alone(step) -> int:
            for batch in batches:
                step(batch)
            return config.samples

        def background() -> int:
            c.use_background_writer(True)
            try:
                return c.encode_with_library(setup, scratch / "out-bg")
            finally:
                c.use_background_writer(False)

        # encode_rows: what encode_text runs on captions it has not seen (T5 and CLIP on batches of exactly
        # TEXT_BATCH captions, the rest empty ones, rows cloned for the cache; the cache itself off here);
        # text batched: one forward pass per encoder over the batch as it is, what that shape costs against.
        times = c.interleaved(args.rounds, {
            "VAE alone": lambda: alone(lambda b: encoders.encode_images(b.pixels, b.keys)),
            "text, fixed shape": lambda: alone(lambda b: encoders.encode_rows(b.captions)),
            "text batched": lambda: alone(lambda b: c.encode_text_batched(encoders, b.captions)),
            "compute limit": lambda: c.encode_in_memory(encoders, batches),
            "input limit": lambda: c.read_only(setup),
            "end to end": lambda: c.encode_with_library(setup),
            "end to end, bg writer": background,
        })
        peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
        identical = c.shard_hashes(scratch / "out") == c.shard_hashes(scratch / "out-bg")
    finally:
        cleanup()
    rate = {name: config.samples / c.best(seconds) for name, seconds in times.items()}
    for name, value in rate.items():
        print(f"  {name:<22} {value:9.2f} samples/s   ({1000 / value:8.1f} ms/sample)")
    efficiency = rate["end to end"] / rate["compute limit"]
    efficiency_bg = rate["end to end, bg writer"] / rate["compute limit"]
    print(f"  efficiency (end to end / compute limit): {efficiency:.3f}; with the background writer "
          f"{efficiency_bg:.3f} (shards byte-identical to the plain writer's: {'yes' if identical else 'NO'})")
    if peak is not None:
        print(f"  peak device memory {peak / 2**30:.1f} GiB")
    print(f"\nSUMMARY gpu_flux{' (smoke)' if smoke else ''} on {args.device}: VAE {rate['VAE alone']:.1f}, "
          f"text fixed shape {rate['text, fixed shape']:.1f} / batched {rate['text batched']:.1f}, "
          f"all {rate['compute limit']:.1f}, "
          f"end to end {rate['end to end']:.1f} samples/s: efficiency {efficiency:.3f} "
          f"({efficiency_bg:.3f} with the background writer) [{_env.malloc_description()}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
