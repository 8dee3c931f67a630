"""Flux encoders against diffusers' own FluxPipeline, on the tiny offline model set.

The reference is a real ``FluxPipeline`` loaded from the same tiny folder
(without a transformer). Its ``__call__`` runs ``encode_prompt`` under
``torch.no_grad()``, and so do these tests: with autograd on, PyTorch picks
other attention kernels and the last bits differ.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from diffusers import FluxPipeline

from diffprep.config import ModelConfig
from diffprep.families.base import noise_seed, resolve_device
from diffprep.families.flux import FluxEncoders, describe_flux, resolve_encoders
from diffprep.families.text_cache import TEXT_BATCH
from diffprep.errors import ConfigError
from diffprep.families.flux_tiny import write_tiny_model

T5_LENGTH = 16  # short, so that ordinary captions get truncated
CAPTIONS = [
    "a photo of a cat",
    "",
    "Ünïcödé café 日本 🐱 — “quotes”",
    "a detailed oil painting of a red horse standing in a green field under a bright blue sky with white clouds",
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "flux")


def _model(tiny: Path, **overrides) -> ModelConfig:
    settings = {"model_path": str(tiny), "precision": "fp32", "device": "cpu", "t5_max_length": T5_LENGTH}
    return ModelConfig(**{**settings, **overrides})


@pytest.fixture(scope="module")
def encoders(tiny) -> FluxEncoders:
    return FluxEncoders.load(_model(tiny, latent_mode="mode"))


@pytest.fixture(scope="module")
def sampling(encoders) -> FluxEncoders:
    """The same models, drawing latents from the posterior."""
    e = encoders
    return FluxEncoders(
        e.vae, e.clip_text, e.clip_tokenizer, e.t5_text, e.t5_tokenizer,
        device=e.device, dtype=e.dtype, t5_max_length=e.t5_max_length, latent_mode="sample", parts=e.parts,
    )  # fmt: skip


@pytest.fixture(scope="module")
def pipe(tiny) -> FluxPipeline:
    return FluxPipeline.from_pretrained(tiny, transformer=None, dtype=torch.float32)


def _pixels(batch: int, height: int, width: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (batch, 3, height, width), dtype=torch.uint8, generator=generator)


def _to_vae_input(pixels: torch.Tensor) -> torch.Tensor:
    # diffusers' VaeImageProcessor: pil_to_numpy (x / 255) then normalize (2x - 1).
    from diffusers.image_processor import VaeImageProcessor

    return VaeImageProcessor.normalize(pixels.float() / 255.0)


# The tiny model


def test_tiny_model_layout_size_and_determinism(tiny, tmp_path):
    index = json.loads((tiny / "model_index.json").read_text())
    assert index["_class_name"] == "FluxPipeline"
    assert index["vae"] == ["diffusers", "AutoencoderKL"]
    assert index["tokenizer_2"] == ["transformers", "T5TokenizerFast"]
    vae_config = json.loads((tiny / "vae" / "config.json").read_text())
    assert vae_config["latent_channels"] == 16
    assert (vae_config["scaling_factor"], vae_config["shift_factor"]) == (0.3611, 0.1159)
    files = sorted(p.relative_to(tiny) for p in tiny.rglob("*") if p.is_file())
    assert sum((tiny / f).stat().st_size for f in files) < 5 * 2**20

    again = write_tiny_model(tmp_path / "again")
    assert sorted(p.relative_to(again) for p in again.rglob("*") if p.is_file()) == files
    for name in files:
        assert (tiny / name).read_bytes() == (again / name).read_bytes(), name
    with pytest.raises(FileExistsError):
        write_tiny_model(again)


def test_tiny_tokenizers_have_flux_special_tokens(encoders):
    t5, clip = encoders.t5_tokenizer, encoders.clip_tokenizer
    assert (t5.pad_token_id, t5.eos_token, t5.model_max_length) == (0, "</s>", 512)
    assert (clip.pad_token, clip.eos_token, clip.model_max_length) == ("<|endoftext|>", "<|endoftext|>", 77)
    words = "a photo of a cat".split()
    assert t5(" ".join(words)).input_ids == [t5.convert_tokens_to_ids(f"▁{word}") for word in words] + [1]


# Text


def test_text_embeddings_equal_flux_pipeline(encoders, pipe, caplog):
    with caplog.at_level(logging.WARNING, logger="diffprep.families.flux"):
        ours = encoders.encode_text(CAPTIONS)
    with torch.no_grad():
        prompt_embeds, pooled_prompt_embeds, _ = pipe.encode_prompt(
            prompt=CAPTIONS, prompt_2=None, device="cpu", max_sequence_length=T5_LENGTH
        )
    assert ours.prompt_embeds.shape == (len(CAPTIONS), T5_LENGTH, encoders.t5_hidden)
    assert ours.pooled_prompt_embeds.shape == (len(CAPTIONS), encoders.clip_hidden)
    assert torch.equal(ours.prompt_embeds, prompt_embeds)
    assert torch.equal(ours.pooled_prompt_embeds, pooled_prompt_embeds)
    assert ours.t5_truncated == [False, False, True, True]
    # The warning shows the text that was cut.
    assert "2 of 4 captions were truncated because t5_max_length is 16" in caplog.text
    assert "blue sky with white clouds" in caplog.text


def test_text_embeddings_equal_flux_pipeline_in_bf16(tiny):
    encoders = FluxEncoders.load(_model(tiny, precision="bf16", t5_max_length=512))
    pipe = FluxPipeline.from_pretrained(tiny, transformer=None, dtype=torch.bfloat16)
    ours = encoders.encode_text(CAPTIONS)
    with torch.no_grad():
        prompt_embeds, pooled_prompt_embeds, _ = pipe.encode_prompt(prompt=CAPTIONS, max_sequence_length=512)
    assert ours.prompt_embeds.dtype == ours.pooled_prompt_embeds.dtype == torch.bfloat16
    assert ours.prompt_embeds.shape == (len(CAPTIONS), 512, encoders.t5_hidden)
    assert torch.equal(ours.prompt_embeds, prompt_embeds)
    assert torch.equal(ours.pooled_prompt_embeds, pooled_prompt_embeds)
    assert ours.t5_truncated == [False] * len(CAPTIONS)


def _with_cache(e: FluxEncoders, text_cache_bytes: int | None = None) -> FluxEncoders:
    """The same models with a cache of their own."""
    return FluxEncoders(
        e.vae, e.clip_text, e.clip_tokenizer, e.t5_text, e.t5_tokenizer, device=e.device, dtype=e.dtype,
        t5_max_length=e.t5_max_length, latent_mode=e.latent_mode, parts=e.parts, text_cache_bytes=text_cache_bytes,
    )  # fmt: skip


def test_each_distinct_caption_is_encoded_once_in_a_fixed_shape_and_kept(encoders, pipe):
    fresh = _with_cache(encoders)
    captions = [CAPTIONS[0], CAPTIONS[3], CAPTIONS[0], CAPTIONS[1], CAPTIONS[3]]
    batch_sizes: list[int] = []
    hooks = [module.register_forward_hook(lambda module, args, output: batch_sizes.append(args[0].shape[0]))
             for module in (fresh.t5_text, fresh.clip_text)]
    try:
        ours = fresh.encode_text(captions)
        again = fresh.encode_text([CAPTIONS[3], CAPTIONS[2], CAPTIONS[0]])
    finally:
        for hook in hooks:
            hook.remove()
    # 3 distinct captions, then 1 new one: each through T5 and CLIP once, in batches of exactly TEXT_BATCH
    # (filled with empty captions), so that no caption's bytes depend on how many were encoded with it.
    assert batch_sizes == [TEXT_BATCH] * 4
    assert (fresh.text_cache.stats.encoded, fresh.text_cache.stats.calls, fresh.text_cache.stats.hits) == (4, 2, 2)
    assert len(fresh.text_cache) == 4
    with torch.no_grad():
        prompt_embeds, pooled_prompt_embeds, _ = pipe.encode_prompt(prompt=captions, max_sequence_length=T5_LENGTH)
    assert torch.equal(ours.prompt_embeds, prompt_embeds)
    assert torch.equal(ours.pooled_prompt_embeds, pooled_prompt_embeds)
    assert ours.t5_truncated == [False, True, False, False, True]
    # A hit hands back the bytes of the miss; the new caption is what encoding it alone gives.
    assert torch.equal(again.prompt_embeds[0], ours.prompt_embeds[1])
    assert torch.equal(again.pooled_prompt_embeds[2], ours.pooled_prompt_embeds[0])
    alone = encoders.encode_rows([CAPTIONS[2]])[0]
    assert torch.equal(again.prompt_embeds[1], alone[0]) and torch.equal(again.pooled_prompt_embeds[1], alone[1])


def test_text_cache_is_bounded_in_bytes(encoders):
    one = encoders.t5_max_length * encoders.t5_hidden * 4 + encoders.clip_hidden * 4  # fp32 T5 row + pooled row
    small = _with_cache(encoders, text_cache_bytes=one + 64)
    first = small.encode_text(CAPTIONS[:2])
    assert len(small.text_cache) == 1 and small.text_cache.bytes <= one + 64
    assert small.text_cache.stats.evicted == 1  # the least recently used went out
    assert torch.equal(small.encode_text(CAPTIONS[:2]).prompt_embeds, first.prompt_embeds)
    assert small.text_cache.stats.encoded == 3  # CAPTIONS[0] again; CAPTIONS[1] from the cache
    off = _with_cache(encoders, text_cache_bytes=0)
    for _ in range(2):
        assert torch.equal(off.encode_text(CAPTIONS[:2] * 2).prompt_embeds, torch.cat([first.prompt_embeds] * 2))
    assert (len(off.text_cache), off.text_cache.stats.encoded, off.text_cache.stats.calls) == (0, 4, 2)


def test_text_input_checks(encoders):
    with pytest.raises(TypeError, match="single string"):
        encoders.encode_text("a photo of a cat")
    with pytest.raises(TypeError, match=r"captions\[1\] must be a string, got NoneType"):
        encoders.encode_text(["a cat", None])
    with pytest.raises(ValueError, match="captions is empty"):
        encoders.encode_text([])


# Images


@pytest.mark.parametrize("height, width", [(64, 64), (64, 32)])
def test_mode_latents_equal_diffusers_and_decode_back(encoders, pipe, height, width):
    pixels = _pixels(2, height, width)
    latents = encoders.encode_images(pixels, ["000000_000000", "000000_000001"])
    assert latents.shape == (2, 16, height // 8, width // 8) and latents.dtype == torch.float32
    with torch.no_grad():
        mean = pipe.vae.encode(_to_vae_input(pixels)).latent_dist.mode()
    shift, scale = pipe.vae.config.shift_factor, pipe.vae.config.scaling_factor
    assert torch.equal(latents, (mean - shift) * scale)

    images = encoders.decode_latents(latents)
    assert images.shape == (2, 3, height, width) and images.dtype == torch.float32
    assert images.min() >= -1.0 and images.max() <= 1.0
    with torch.no_grad():
        reference = pipe.vae.decode(latents / scale + shift).sample.clamp(-1, 1)
    assert torch.equal(images, reference)


def test_sampled_latents_use_noise_seeded_by_the_key(sampling, pipe):
    pixels = _pixels(2, 64, 64)
    keys = ["000003_000007", "000003_000008"]
    latents = sampling.encode_images(pixels, keys)
    with torch.no_grad():
        posterior = pipe.vae.encode(_to_vae_input(pixels)).latent_dist
    shape = posterior.mean.shape[1:]
    noise = torch.stack([torch.randn(shape, generator=torch.Generator().manual_seed(noise_seed(k))) for k in keys])
    expected = (posterior.mean + posterior.std * noise - sampling.shift_factor) * sampling.scaling_factor
    assert torch.equal(latents, expected)
    assert torch.equal(sampling.encode_images(pixels, keys), latents)  # reproducible
    other = sampling.encode_images(pixels, ["000003_000009", "000003_000008"])
    assert not torch.equal(other[0], latents[0])  # another key, another draw
    assert torch.equal(other[1], latents[1])


def test_sampled_latent_does_not_depend_on_batch_companions(sampling):
    a, b, c = _pixels(3, 64, 64).unbind(0)
    with_a = sampling.encode_images(torch.stack([a, b]), ["k_a", "k_b"])[1]
    with_c = sampling.encode_images(torch.stack([c, b]), ["k_c", "k_b"])[1]
    assert torch.equal(with_a, with_c)
    # Alone (batch of 1), the CPU convolutions take another code path: equal to float32 rounding only.
    alone = sampling.encode_images(b[None], ["k_b"])[0]
    torch.testing.assert_close(alone, with_a, rtol=0, atol=1e-5)


def test_image_input_checks(encoders):
    with pytest.raises(ValueError, match="uint8"):
        encoders.encode_images(_pixels(1, 64, 64).float(), ["k"])
    with pytest.raises(ValueError, match="multiples of 8.*got 60x64"):
        encoders.encode_images(_pixels(1, 60, 64), ["k"])
    with pytest.raises(ValueError, match="got 2 images but 1 keys"):
        encoders.encode_images(_pixels(2, 64, 64), ["k"])
    with pytest.raises(ValueError, match=r"latents must be \[B, 16, h, w\]"):
        encoders.decode_latents(torch.zeros(1, 4, 8, 8))


# Loading and identity


def test_properties_come_from_the_configs(encoders):
    assert (encoders.scaling_factor, encoders.shift_factor) == (0.3611, 0.1159)
    assert (encoders.latent_channels, encoders.vae_scale_factor) == (16, 8)
    assert (encoders.t5_hidden, encoders.clip_hidden, encoders.clip_max_length) == (32, 32, 77)
    assert encoders.device == torch.device("cpu") and encoders.dtype == torch.float32
    assert not any(p.requires_grad for p in encoders.t5_text.parameters())
    assert not encoders.vae.training


def test_overrides_load_the_same_encoders(tiny, encoders):
    # model_path is not looked at when every encoder is overridden.
    model = _model(tiny, latent_mode="mode", model_path=str(tiny / "missing"),
                   vae_path=str(tiny / "vae"), t5_path=str(tiny), clip_path=str(tiny))  # fmt: skip
    loaded = FluxEncoders.load(model)
    assert loaded.parts["vae"].subfolder is None and loaded.parts["t5_text"].subfolder == "text_encoder_2"
    pixels = _pixels(1, 32, 32)
    assert torch.equal(loaded.encode_images(pixels, ["k"]), encoders.encode_images(pixels, ["k"]))
    ours, theirs = loaded.encode_text(CAPTIONS[:2]), encoders.encode_text(CAPTIONS[:2])
    assert torch.equal(ours.prompt_embeds, theirs.prompt_embeds)


def _describe_folder(folder: Path) -> dict:
    parts = resolve_encoders(_model(folder))
    return describe_flux(parts, dtype=torch.float32, t5_max_length=T5_LENGTH, latent_mode="mode")


def test_describe_is_stable_and_needs_no_loading(tiny, encoders, tmp_path):
    model = _model(tiny, latent_mode="mode")
    first = encoders.describe()
    assert FluxEncoders.load(model).describe() == first
    assert _describe_folder(tiny) == first
    assert json.loads(json.dumps(first)) == first
    assert first["dtype"] == "float32" and first["shift_factor"] == 0.1159
    assert first["components"]["t5_text"]["class"] == "T5EncoderModel"

    # A changed config file changes the identity; so does another folder with the same files.
    copy = tmp_path / "copy"
    shutil.copytree(tiny, copy)
    moved = _describe_folder(copy)
    assert moved["components"]["vae"]["files_sha256"] == first["components"]["vae"]["files_sha256"]
    assert moved != first
    config = json.loads((copy / "vae" / "config.json").read_text())
    (copy / "vae" / "config.json").write_text(json.dumps({**config, "scaling_factor": 0.5}))
    changed = _describe_folder(copy)
    assert changed["scaling_factor"] == 0.5
    assert changed["components"]["vae"]["files_sha256"] != first["components"]["vae"]["files_sha256"]


def test_describe_needs_the_origin(encoders):
    e = encoders
    bare = FluxEncoders(e.vae, e.clip_text, e.clip_tokenizer, e.t5_text, e.t5_tokenizer,
                        device=e.device, dtype=e.dtype, t5_max_length=8)  # fmt: skip
    with pytest.raises(ValueError, match="FluxEncoders.load"):
        bare.describe()


def test_device_names():
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device("auto") == torch.device(expected)
    assert resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(ConfigError, match="'gpu0' is not a device"):
        resolve_device("gpu0")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="CUDA is not available"):
            resolve_device("cuda:0")
