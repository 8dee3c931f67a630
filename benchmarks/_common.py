"""Shared pieces of the benchmarks: environment, cached inputs and model sets, the two encode paths, timing.

Inputs (JPEG sources, model folders) are written once under a cache folder
(``--cache-dir``, default ``~/.cache/diffprep-bench``) and reused by every
script. Nothing is downloaded: the models are random-weight sets in the
FLUX.1-dev folder layout, written with the same diffusers/transformers classes
that ``diffprep.families.flux_tiny`` uses.

Times on a shared machine are noisy, so every figure is a ratio of two
measurements taken in the same process, interleaved (A B B A ...), each side
the fastest of its rounds (see ``best``).
"""

from __future__ import annotations

import _env  # first: offline environment, --malloc re-exec before torch is imported

# isort: split

import argparse
import os
import shutil
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from diffprep import contract
from diffprep.config import Settings, load_settings
from diffprep.encodings.preencoded import preencoded_fields
from diffprep.run.reader import Batch, iter_batches, prefetch
from diffprep.run.units import encode_unit
from diffprep.families.flux import FluxEncoders
from diffprep.phases.fetch import fetch
from diffprep.media.images import ImageSpec, prepare_image
from diffprep.writer.plan import Plan
from diffprep.writer.shards import ShardWriter, UnitManifest, write_manifest
from diffprep.sources import Source
from diffprep.families.flux_tiny import write_tiny_model

# --- environment ---------------------------------------------------------------------------------


def add_common_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cache-dir", default=None,
                        help="where generated JPEG sources and model sets are kept (default ~/.cache/diffprep-bench)")
    parser.add_argument("--work-dir", default=None,
                        help="folder for the scratch outputs, removed at the end (default: a new temporary folder)")
    parser.add_argument("--malloc", choices=_env.MALLOC_MODES, default="tuned", help=_env.MALLOC_HELP)


def describe_machine() -> str:
    return (f"{os.cpu_count()} CPUs, torch {torch.__version__} with {torch.get_num_threads()} threads, "
            f"CUDA {'yes: ' + torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no'}; "
            f"{_env.malloc_description()}; load average {load_average()}")


def load_average() -> str:
    """The machine's 1-minute load average: above the CPU count, other work shares the cores and times are noisy."""
    return f"{os.getloadavg()[0]:.1f}"


def cache_dir(arg: str | None) -> Path:
    if arg:
        path = Path(arg).expanduser()
    else:
        path = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "diffprep-bench"
    path.mkdir(parents=True, exist_ok=True)
    return path


def work_dir(arg: str | None) -> tuple[Path, Callable[[], None]]:
    """A new scratch folder and the function that removes it."""
    import tempfile

    if arg:
        path = Path(arg).expanduser() / f"diffprep-bench-{os.getpid()}"
        path.mkdir(parents=True)
    else:
        path = Path(tempfile.mkdtemp(prefix="diffprep-bench-"))
    return path, lambda: shutil.rmtree(path, ignore_errors=True)


# --- cached inputs ---------------------------------------------------------------------------------

_WORDS = ("red", "green", "blue", "yellow", "small", "large", "old", "bright", "dark", "cat", "dog", "bird", "tree",
          "house", "car", "river", "mountain", "city", "flower", "sky", "sitting", "standing", "running", "beside",
          "under", "near", "photo", "painting")


def _caption(index: int) -> str:
    # Distinct captions built from words both tiny tokenizers know; nothing is de-duplicated by luck.
    words = [_WORDS[(index * 7 + k * 3) % len(_WORDS)] for k in range(6)]
    return f"a photo of {' '.join(words)} number {index}"


def _photo_like(rng: np.random.Generator, size: int) -> Image.Image:
    """A smooth random field plus grain: JPEG decodes it at the cost of a photo, unlike a flat colour."""
    coarse = rng.integers(0, 256, (12, 12, 3), dtype=np.uint8)
    image = np.asarray(Image.fromarray(coarse).resize((size, size), Image.Resampling.BICUBIC), dtype=np.int16)
    grain = rng.integers(-10, 11, image.shape, dtype=np.int16)
    return Image.fromarray(np.clip(image + grain, 0, 255).astype(np.uint8))


def jpeg_source(cache: Path, count: int, size: int = 1024, seed: int = 0) -> Path:
    """A directory source of at least ``count`` ``size``-px JPEGs with captions, written once under ``cache``.

    Image ``i`` is the same in every set of the same size and seed, so a larger set already written
    serves (settings' ``max_samples`` reads its first ``count``).
    """
    prefix, suffix = f"jpeg-{size}px-", f"-seed{seed}"
    written = sorted(int(p.name[len(prefix):-len(suffix)]) for p in cache.glob(f"{prefix}*{suffix}")
                     if (p / ".complete").is_file() and p.name[len(prefix):-len(suffix)].isdigit())
    larger = [n for n in written if n >= count]
    if larger:
        return cache / f"{prefix}{larger[0]}{suffix}"
    root = cache / f"{prefix}{count}{suffix}"
    tmp = cache / f".{root.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / "images").mkdir(parents=True)
    (tmp / "captions").mkdir()
    rng = np.random.default_rng(seed)
    for i in range(count):
        _photo_like(rng, size).save(tmp / "images" / f"{i:06d}.jpg", "JPEG", quality=90)
        (tmp / "captions" / f"{i:06d}.txt").write_text(_caption(i) + "\n", encoding="utf-8")
    (tmp / ".complete").write_text("ok\n")
    shutil.rmtree(root, ignore_errors=True)
    tmp.rename(root)
    return root


# --- model sets -------------------------------------------------------------------------------------

FLUX_SCALING_FACTOR = 0.3611
FLUX_SHIFT_FACTOR = 0.1159

# A "medium" set: big enough that encoding dominates decoding on a 2-core CPU at 256 px (the VAE has half
# FLUX.1-dev's channels: about 0.4 s per sample against 17 ms to decode a 1024 px JPEG), small enough to
# write in seconds. Same classes as FLUX.1-dev.
MEDIUM_VAE = {"block_out_channels": (64, 128, 256, 256), "layers_per_block": 2, "norm_num_groups": 32}
MEDIUM_CLIP = {"hidden_size": 256, "intermediate_size": 1024, "projection_dim": 256, "num_hidden_layers": 4,
               "num_attention_heads": 4}
MEDIUM_T5 = {"d_model": 256, "d_kv": 64, "d_ff": 1024, "num_layers": 4, "num_heads": 4,
             "relative_attention_num_buckets": 32, "relative_attention_max_distance": 128}


def tiny_model(cache: Path, name: str = "tiny-flux", write: Callable[[Path], Path] = write_tiny_model) -> Path:
    """A tiny set in the cache (``write`` it once: the Flux set, or another family's writer)."""
    root = cache / name
    if not (root / "model_index.json").is_file():
        shutil.rmtree(root, ignore_errors=True)
        write(root)
    return root


def load_tokenizers(model_root: Path):
    from transformers import CLIPTokenizer, T5TokenizerFast

    return (CLIPTokenizer.from_pretrained(model_root / "tokenizer"),
            T5TokenizerFast.from_pretrained(model_root / "tokenizer_2"))


def build_vae(**kwargs):
    from diffusers import AutoencoderKL

    config = {"in_channels": 3, "out_channels": 3, "down_block_types": ("DownEncoderBlock2D",) * 4,
              "up_block_types": ("UpDecoderBlock2D",) * 4, "latent_channels": 16, "act_fn": "silu",
              "scaling_factor": FLUX_SCALING_FACTOR, "shift_factor": FLUX_SHIFT_FACTOR,
              "use_quant_conv": False, "use_post_quant_conv": False, "mid_block_add_attention": True}
    return AutoencoderKL(**(config | kwargs))


def build_clip(tokenizer, **kwargs):
    from transformers import CLIPTextConfig, CLIPTextModel

    config = {"vocab_size": len(tokenizer), "max_position_embeddings": 77, "hidden_act": "quick_gelu",
              "bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
              "pad_token_id": tokenizer.pad_token_id}
    return CLIPTextModel(CLIPTextConfig(**(config | kwargs)))


def build_t5(tokenizer, **kwargs):
    from transformers import T5Config, T5EncoderModel

    # T5 v1.1 as in FLUX.1-dev: gated GELU, untied embeddings, encoder only.
    config = {"vocab_size": len(tokenizer), "feed_forward_proj": "gated-gelu", "tie_word_embeddings": False,
              "is_encoder_decoder": False, "use_cache": False, "pad_token_id": tokenizer.pad_token_id,
              "eos_token_id": tokenizer.eos_token_id}
    return T5EncoderModel(T5Config(**(config | kwargs)))


def medium_model(cache: Path, seed: int = 0) -> Path:
    """The medium random-weight set, written once: diffprep's tiny set with bigger VAE, CLIP and T5."""
    root = cache / "medium-flux-v2"
    if (root / ".complete").is_file():
        return root
    tmp = cache / f".{root.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    write_tiny_model(tmp, seed=seed)  # tokenizers, scheduler, model_index.json: the layout stays the real one
    clip_tokenizer, t5_tokenizer = load_tokenizers(tmp)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        parts = {"vae": build_vae(**MEDIUM_VAE), "text_encoder": build_clip(clip_tokenizer, **MEDIUM_CLIP),
                 "text_encoder_2": build_t5(t5_tokenizer, **MEDIUM_T5)}
    for folder, module in parts.items():
        shutil.rmtree(tmp / folder)
        module.save_pretrained(tmp / folder)
    (tmp / ".complete").write_text("ok\n")
    shutil.rmtree(root, ignore_errors=True)
    tmp.rename(root)
    return root


# --- configurations ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Config:
    """One benchmark configuration: which encoders, how big the inputs and outputs are."""

    name: str
    model: str  # "medium" or "tiny"
    image_size: int
    t5_max_length: int
    samples: int
    shard_size: int
    batch_size: int = 8
    source_px: int = 1024
    precision: str = "fp32"  # bf16 text encoding is several times slower than fp32 on most CPUs
    decode_workers: int = 2

    def scaled(self, samples: int | None = None, **changes: Any) -> Config:
        return replace(self, samples=samples or self.samples, **{k: v for k, v in changes.items() if v is not None})

    def describe(self) -> str:
        return (f"{self.name}: {self.model} encoders, {self.samples} samples of {self.source_px} px JPEG -> "
                f"{self.image_size} px, t5_max_length {self.t5_max_length}, batch {self.batch_size}, "
                f"shard_size {self.shard_size}, {self.precision}, decode_workers {self.decode_workers}")


# The tiny VAE costs ~0.15 s per image at 256 px on 2 cores, ten times a 1024 px JPEG decode: at 256 px
# the tiny set is compute-bound too. At 64 px it costs less than the decode, which is what input-bound means.
COMPUTE_BOUND = Config("compute-bound", model="medium", image_size=256, t5_max_length=128, samples=16, shard_size=8)
INPUT_BOUND = Config("input-bound", model="tiny", image_size=64, t5_max_length=32, samples=64, shard_size=32)
# What benchmarks/cli.py runs as a whole command (issue #17): the tiny set at 256 px, compute-bound with
# the decode of a 512 px JPEG a fifth of each sample's CPU.
CLI_CONFIG = Config("cli compute-bound", model="tiny", image_size=256, t5_max_length=512, samples=256,
                    shard_size=64, source_px=512)
CONFIGS = {"compute": COMPUTE_BOUND, "input": INPUT_BOUND, "cli": CLI_CONFIG}


def add_config_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--samples", type=int, default=None, help="samples per configuration (default: each "
                        f"configuration's own: compute {COMPUTE_BOUND.samples}, input {INPUT_BOUND.samples}, "
                        f"cli {CLI_CONFIG.samples})")
    parser.add_argument("--rounds", type=int, default=5,
                        help="measurements per side, interleaved (default %(default)s)")
    parser.add_argument("--batch-size", type=int, default=None)
    parser.add_argument("--image-size", type=int, default=None)
    parser.add_argument("--t5-max-length", type=int, default=None)
    parser.add_argument("--decode-workers", type=int, default=None)
    parser.add_argument("--precision", choices=["fp32", "bf16"], default=None)
    parser.add_argument("--torch-threads", type=int, default=None,
                        help="torch.set_num_threads for both sides (default: torch's own, one per core)")


def apply_torch_threads(args: argparse.Namespace) -> None:
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)


def config_from(base: Config, args: argparse.Namespace) -> Config:
    config = base.scaled(args.samples, batch_size=args.batch_size, decode_workers=args.decode_workers,
                         precision=args.precision, image_size=args.image_size, t5_max_length=args.t5_max_length)
    if args.samples and args.samples < config.shard_size:
        config = replace(config, shard_size=args.samples)
    return config


def settings_for(config: Config, model: Path, input_dir: Path, out_dir: Path) -> Settings:
    return load_settings(overrides={
        "source": {"type": "directory", "input_dir": str(input_dir)},
        "output": {"output_dir": str(out_dir), "shard_size": config.shard_size, "max_samples": config.samples},
        # text_cache_mib 0: rounds repeat the same captions, which a cache would answer from memory from the second
        # round on; a run over distinct captions never does. caption_dedup.py measures the cache.
        "model": {"model_path": str(model), "precision": config.precision, "device": "cpu",
                  "batch_size": config.batch_size, "t5_max_length": config.t5_max_length, "latent_mode": "sample",
                  "text_cache_mib": 0},
        "image": {"image_size": config.image_size, "decode_workers": config.decode_workers},
    })


@dataclass
class Setup:
    config: Config
    settings: Settings
    plan: Plan
    source: Source
    spec: ImageSpec
    encoders: FluxEncoders
    out_dir: Path


def prepare(config: Config, cache: Path, scratch: Path, *, source_count: int | None = None) -> Setup:
    """Inputs, model and a real plan (``diffprep.phases.fetch.fetch`` on a directory source) for ``config``."""
    model = medium_model(cache) if config.model == "medium" else tiny_model(cache)
    source_dir = jpeg_source(cache, source_count or config.samples, config.source_px)
    out_dir = scratch / f"out-{config.name}"
    settings = settings_for(config, model, source_dir, out_dir)
    plan, source = fetch(settings)
    if plan.total_samples != config.samples:
        raise RuntimeError(f"planned {plan.total_samples} samples, wanted {config.samples}")
    encoders = FluxEncoders.load(settings.model)
    return Setup(config, settings, plan, source, ImageSpec.from_config(settings.image), encoders, out_dir)


# --- the paths being compared ---------------------------------------------------------------------


def decoded_batches(setup: Setup) -> list[Batch]:
    """Every unit's batches, decoded ahead by the library's own batching (identical batch composition)."""
    batches: list[Batch] = []
    for unit in setup.plan.units:
        rejects: list = []
        batches += list(iter_batches(setup.source, unit, setup.spec, setup.config.batch_size, rejects,
                                     workers=setup.config.decode_workers))
        if rejects:
            raise RuntimeError(f"unit {unit.unit}: unexpected rejects {rejects[:3]}")
    return batches


def read_only(setup: Setup) -> int:
    """The input limit: the library's reader (source read, decode threads, batching, prefetch), nothing else."""
    count = 0
    for unit in setup.plan.units:
        rejects: list = []
        batches = iter_batches(setup.source, unit, setup.spec, setup.config.batch_size, rejects,
                               workers=setup.config.decode_workers)
        for batch in prefetch(batches):
            count += len(batch.keys)
        count += len(rejects)
    return count


def encode_in_memory(encoders, batches: Iterable[Batch]) -> int:
    """The compute limit: the encoders alone on batches already decoded and stacked; no I/O."""
    count = 0
    for batch in batches:
        encoders.encode_images(batch.pixels, batch.keys)
        encoders.encode_text(batch.captions)
        count += len(batch.keys)
    return count


@torch.no_grad()
def encode_text_batched(encoders: FluxEncoders, captions: list[str]) -> int:
    """T5 and CLIP on a batch of captions as it is, one forward pass each: what ``encode_text`` did before it
    encoded in batches of exactly ``TEXT_BATCH`` (``FluxEncoders.encode_rows``), the reference for what that costs."""
    t5_ids, _ = encoders._t5_input_ids(captions)
    clip_ids = encoders._clip_input_ids(captions)
    encoders.t5_text(t5_ids.to(encoders.device))[0].to("cpu")
    encoders.clip_text(clip_ids.to(encoders.device)).pooler_output.to("cpu")
    return len(captions)


def encode_with_library(setup: Setup, out_dir: Path | None = None, encoders=None) -> int:
    """End to end: ``encode_unit`` for every unit of the plan into a fresh output folder."""
    out = out_dir or setup.out_dir
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    count = 0
    for unit in setup.plan.units:
        result = encode_unit(out, setup.plan, unit.unit, preencoded_fields(encoders or setup.encoders), setup.source,
                             setup.spec, batch_size=setup.config.batch_size, decode_workers=setup.config.decode_workers)
        count += result.count + result.rejected
    return count


def _batched(items: list, size: int) -> Iterable[list]:
    for start in range(0, len(items), size):
        yield items[start:start + size]


def encode_naively(setup: Setup, out_dir: Path) -> int:
    """The naive reference: per batch, decode (one thread), encode, write; nothing overlaps.

    Writes the same fields, shards and manifests as ``encode_unit`` (byte-identical shards when
    every sample decodes and has the same size).
    """
    shutil.rmtree(out_dir, ignore_errors=True)
    out_dir.mkdir(parents=True)
    encoders, spec = setup.encoders, setup.spec
    count = 0
    for unit in setup.plan.units:
        keys: list[str] = []
        with ShardWriter(out_dir, unit.unit) as writer:
            samples = list(enumerate(setup.source.read(unit.source_ids)))
            for chunk in _batched(samples, setup.config.batch_size):
                prepared = [prepare_image(sample.image, spec) for _, sample in chunk]
                pixels = torch.stack([image.pixels for image in prepared])
                batch_keys = [contract.sample_key(unit.unit, index) for index, _ in chunk]
                captions = [sample.caption for _, sample in chunk]
                latents = encoders.encode_images(pixels, batch_keys)
                text = encoders.encode_text(captions)
                for i, ((_, sample), image) in enumerate(zip(chunk, prepared, strict=True)):
                    writer.write(batch_keys[i], {
                        contract.LATENTS: latents[i],
                        contract.PROMPT_EMBEDS: text.prompt_embeds[i],
                        contract.POOLED_PROMPT_EMBEDS: text.pooled_prompt_embeds[i],
                        contract.CAPTION: captions[i],
                        contract.META: {"source_id": sample.source_id, "original_size": list(image.original_size),
                                        "crop_box": list(image.crop_box),
                                        "size": [int(image.pixels.shape[2]), int(image.pixels.shape[1])],
                                        "notes": list(image.notes)},
                    })
                    keys.append(batch_keys[i])
            info = writer.commit()
        write_manifest(out_dir, UnitManifest(unit=unit.unit, shard=info.name, fingerprint=setup.plan.fingerprint,
                                             keys=keys, source_ids=list(unit.source_ids), count=info.count,
                                             bytes=info.bytes, sha256=info.sha256))
        count += info.count
    return count


def shard_hashes(out_dir: Path) -> dict[str, str]:
    from diffprep.writer.shards import file_sha256

    return {path.name: file_sha256(path)[1] for path in sorted(out_dir.glob(f"*{contract.SHARD_SUFFIX}"))}


def warm_up(setup: Setup, batches: list[Batch]) -> None:
    """One batch through the encoders: first calls build kernels and allocate pools."""
    encode_in_memory(setup.encoders, batches[:1])


# --- proposed fix, demonstrated by monkeypatching ------------------------------------------------------


def use_background_writer(enabled: bool = True) -> None:
    """Make ``diffprep.run.units.encode_unit`` write with the background writer (its default) or the plain one."""
    import diffprep.run.units
    from diffprep.writer.shards import BackgroundShardWriter, ShardWriter

    diffprep.run.units.UnitWriter = BackgroundShardWriter if enabled else ShardWriter


# --- timing ------------------------------------------------------------------------------------------


def interleaved(rounds: int, sides: dict[str, Callable[[], int]], *, cpu_time: bool = True) -> dict[str, list[float]]:
    """Seconds per run of each side, run in A B B A A B ... order so drift on the machine hits both alike.

    Each callable returns the number of samples it handled; all sides must handle the same number.
    ``cpu_time``: also print this process's CPU seconds per run (all its threads; not its children).
    """
    names = list(sides)
    times: dict[str, list[float]] = {name: [] for name in names}
    counts: dict[str, int] = {}
    for r in range(rounds):
        order = names if r % 2 == 0 else names[::-1]
        for name in order:
            cpu = time.process_time()
            start = time.perf_counter()
            counts[name] = sides[name]()
            times[name].append(time.perf_counter() - start)
            used = f"process CPU {time.process_time() - cpu:6.2f} s, " if cpu_time else ""
            print(f"    round {r + 1}: {name:<22} {times[name][-1]:8.2f} s  ({used}load {load_average()})", flush=True)
    if len(set(counts.values())) != 1:
        raise RuntimeError(f"the sides handled different numbers of samples: {counts}")
    return times


def best(values: list[float]) -> float:
    """The fastest run of a side. Other work on a shared machine only ever adds time, so the fastest run is
    the closest to the undisturbed time; both sides of a ratio are reduced the same way."""
    return min(values)


def fastest_of(rounds: int, run: Callable[[], Any]) -> float:
    """Seconds of the fastest of ``rounds`` calls of ``run`` (``best``'s reason)."""
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return best(times)


def verdict(value: float, target: float, *, at_most: bool = False) -> str:
    ok = value <= target if at_most else value >= target
    return "PASS" if ok else "FAIL"
