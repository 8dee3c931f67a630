"""The Wan family against diffusers' own Wan code, on tiny offline model sets.

The reference is a real ``WanPipeline`` loaded from the same tiny folder
(without a transformer): text through its ``encode_prompt``, latents through
its ``vae`` and the normalization its pipelines apply. Everything runs under
``torch.no_grad()``, as the pipeline does.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import json
import time
from pathlib import Path

import pytest
import torch
from diffusers import WanPipeline

from diffprep.contract import LATENTS, PROMPT_EMBEDS
from diffprep.families.base import noise_seed
from diffprep.errors import ConfigError
from diffprep.families import detect_family, family_for_class, get_family
from diffprep.families.wan import VaeTiling, WanEncoders, clean_caption, vae_factors
from diffprep.families.wan_tiny import write_tiny_wan
from diffprep.media.buckets import Bucket, parse_buckets
from diffprep.media.video import prepare_clip

CAPTIONS = [
    "a photo of a cat",
    "",
    "  tom &amp;amp; jerry\t\u3000running\n in the \xa0 street  ",
    "Ünïcödé café 日本 🐱 — “quotes”",
    "a detailed oil painting of a red horse standing in a green field under a bright blue sky with white clouds",
]


@pytest.fixture(scope="module")
def tiny(tiny_wan) -> Path:
    return tiny_wan  # the session's tiny Wan set (conftest.py)


@pytest.fixture(scope="module")
def encoders(tiny) -> WanEncoders:
    return WanEncoders.load(tiny, device="cpu", dtype="fp32", latent_mode="mode")


@pytest.fixture(scope="module")
def pipe(tiny) -> WanPipeline:
    return WanPipeline.from_pretrained(tiny, transformer=None, dtype=torch.float32)


def _with(encoders: WanEncoders, **overrides) -> WanEncoders:
    """The same models with other settings."""
    e = encoders
    settings = dict(device=e.device, dtype=e.dtype, latent_mode=e.latent_mode, tiling=e.tiling,
                    text_max_length=e.text_max_length, parts=e.parts)  # fmt: skip
    return WanEncoders(e.vae, e.text_encoder, e.tokenizer, **{**settings, **overrides})


def _clips(batch: int, frames: int, height: int, width: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (batch, frames, 3, height, width), dtype=torch.uint8, generator=generator)


def _encode_prompt(pipe: WanPipeline, prompt, max_sequence_length: int):
    return pipe.encode_prompt(
        prompt, do_classifier_free_guidance=False, max_sequence_length=max_sequence_length, device="cpu"
    )


def _reference_latents(pipe: WanPipeline, pixels: torch.Tensor):
    """diffusers' own path: VideoProcessor's [-1, 1], [B, 3, F, H, W], the VAE's posterior, and the
    normalization WanImageToVideoPipeline applies (the inverse of WanPipeline's decode step)."""
    video = (pixels.float() / 255.0 * 2.0 - 1.0).permute(0, 2, 1, 3, 4)
    with torch.no_grad():
        posterior = pipe.vae.encode(video).latent_dist
    z_dim = pipe.vae.config.z_dim
    mean = torch.tensor(pipe.vae.config.latents_mean).view(1, z_dim, 1, 1, 1)
    inv_std = 1.0 / torch.tensor(pipe.vae.config.latents_std).view(1, z_dim, 1, 1, 1)
    return posterior, mean, inv_std


# The tiny set and the family registry


def test_tiny_set_layout_determinism_and_detection(tiny, tmp_path):
    index = json.loads((tiny / "model_index.json").read_text())
    assert index["_class_name"] == "WanPipeline"
    assert index["vae"] == ["diffusers", "AutoencoderKLWan"]
    assert index["text_encoder"] == ["transformers", "UMT5EncoderModel"]
    assert detect_family(tiny).name == "wan" and detect_family({"_class_name": "FluxPipeline"}).name == "flux"
    files = sorted(p.relative_to(tiny) for p in tiny.rglob("*") if p.is_file())
    assert sum((tiny / f).stat().st_size for f in files) < 8 * 2**20
    again = write_tiny_wan(tmp_path / "again")
    assert sorted(p.relative_to(again) for p in again.rglob("*") if p.is_file()) == files
    for name in files:
        assert (tiny / name).read_bytes() == (again / name).read_bytes(), name
    with pytest.raises(FileExistsError):
        write_tiny_wan(again)


def test_family_registry_refusals(tmp_path):
    known = r"known: FluxPipeline \(flux\), WanPipeline \(wan\)"
    with pytest.raises(ConfigError, match=r"'StableDiffusionPipeline'.*" + known):
        family_for_class("StableDiffusionPipeline")
    with pytest.raises(ConfigError, match="known families: flux, wan"):
        get_family("ltx")
    with pytest.raises(ConfigError, match="model_index.json does not exist"):
        detect_family(tmp_path)
    assert get_family("wan").load_module().PIPELINE_CLASS == "WanPipeline"
    # One list of families: the settings' Literal and the CLI's choices are the registry's.
    from typing import get_args

    from diffprep.cli import build_parser
    from diffprep.config import FamilyName
    from diffprep.families import FAMILIES

    assert list(get_args(FamilyName)) == [family.name for family in FAMILIES]
    with pytest.raises(SystemExit):
        build_parser().parse_args(["tiny-model", str(tmp_path), "--family", "sd3"])
    assert build_parser().parse_args(["tiny-model", str(tmp_path), "--family", "ltx2"]).family == "ltx2"


# Text


def test_captions_are_cleaned_as_diffusers_does():
    from diffusers.pipelines.wan.pipeline_wan import prompt_clean

    odd = ["a\x1cb", "x\u2028y\u3000z", "&lt;b&gt;", "&amp;lt;", " \t\n "]
    for caption in CAPTIONS + odd:
        assert clean_caption(caption) == prompt_clean(caption), repr(caption)


def test_text_embeddings_equal_wan_pipeline(encoders, pipe):
    start = time.perf_counter()
    ours = encoders.encode_text(CAPTIONS)
    print(f"tiny umT5, {len(CAPTIONS)} captions at 512 tokens: {(time.perf_counter() - start) * 1000:.0f} ms")
    with torch.no_grad():
        reference, _ = _encode_prompt(pipe, CAPTIONS, 512)
    assert ours.prompt_embeds.shape == (len(CAPTIONS), 512, 32) and ours.prompt_embeds.dtype == torch.float32
    assert torch.equal(ours.prompt_embeds, reference)
    assert ours.lengths == [6, 1, 15, 29, 33] and ours.truncated == [False] * 5
    for row, length in zip(ours.prompt_embeds, ours.lengths):
        assert row[length:].abs().sum() == 0 and row[length - 1].abs().sum() > 0
    # Again, in another order: every caption from the cache, the same bytes; the cache keeps the rows only up to
    # each caption's true length (the rest is zero).
    encoded = encoders.text_cache.stats.encoded
    again = encoders.encode_text(CAPTIONS[::-1])
    assert torch.equal(again.prompt_embeds, ours.prompt_embeds.flip(0)) and again.lengths == ours.lengths[::-1]
    assert encoders.text_cache.stats.encoded == encoded
    kept = sum(ours.lengths) * 32 * 4 + sum(len(c.encode()) for c in CAPTIONS)
    assert encoders.text_cache.bytes == kept


def test_truncated_text_equals_wan_pipeline_and_warns(encoders, pipe, caplog):
    short = _with(encoders, text_max_length=16)
    with caplog.at_level("WARNING", logger="diffprep.families.wan"):
        ours = short.encode_text(CAPTIONS)
    with torch.no_grad():
        reference, _ = _encode_prompt(pipe, CAPTIONS, 16)
    assert torch.equal(ours.prompt_embeds, reference)
    assert ours.truncated == [False, False, False, True, True] and ours.lengths[3:] == [16, 16]
    assert "2 of 5 captions were truncated at 16 tokens" in caplog.text and "white clouds" in caplog.text


def test_text_embeddings_equal_wan_pipeline_in_bf16(tiny):
    encoders = WanEncoders.load(tiny, device="cpu", dtype="bf16", latent_mode="mode")
    pipe = WanPipeline.from_pretrained(tiny, transformer=None, dtype=torch.bfloat16)
    ours = encoders.encode_text(CAPTIONS)
    with torch.no_grad():
        reference, _ = _encode_prompt(pipe, CAPTIONS, 512)
    assert ours.prompt_embeds.dtype == torch.bfloat16 and torch.equal(ours.prompt_embeds, reference)


def test_empty_prompt_embedding(encoders, pipe):
    empty = encoders.empty_prompt_embeds()
    assert empty.shape == (512, 32)
    assert empty[0].abs().sum() > 0 and empty[1:].abs().sum() == 0  # only </s>
    with torch.no_grad():
        reference, _ = _encode_prompt(pipe, "", 512)
    assert torch.equal(empty, reference[0])


# Video


@pytest.mark.parametrize("frames, height, width", [(5, 32, 32), (9, 32, 48)])
def test_mode_latents_equal_diffusers_and_decode_back(encoders, pipe, frames, height, width):
    pixels = _clips(2, frames, height, width)
    start = time.perf_counter()
    latents = encoders.encode_video(pixels, ["000000_000000", "000000_000001"])
    elapsed = (time.perf_counter() - start) * 1000
    print(f"tiny Wan VAE encode {list(pixels.shape)} -> {list(latents.shape)}: {elapsed:.0f} ms")
    assert latents.shape == (2, 16, 1 + (frames - 1) // 4, height // 8, width // 8) and latents.dtype == torch.float32
    assert latents.shape[1:] == encoders.latent_shape(Bucket(width, height, frames))
    posterior, mean, inv_std = _reference_latents(pipe, pixels)
    assert torch.equal(latents, (posterior.mode() - mean) * inv_std)

    video = encoders.decode_latents(latents)
    assert video.shape == (2, frames, 3, height, width) and video.dtype == torch.float32
    with torch.no_grad():
        # WanPipeline.__call__'s decode step: latents / latents_std(inverted) + latents_mean.
        reference = pipe.vae.decode(latents / inv_std + mean).sample
    assert torch.equal(video, reference.permute(0, 2, 1, 3, 4))
    assert video.min() >= -1.0 and video.max() <= 1.0


def test_sampled_latents_use_noise_seeded_by_the_key(encoders, pipe):
    sampling = _with(encoders, latent_mode="sample")
    pixels = _clips(2, 5, 32, 32, seed=1)
    keys = ["000003_000007", "000003_000008"]
    latents = sampling.encode_video(pixels, keys)
    posterior, mean, inv_std = _reference_latents(pipe, pixels)
    shape = posterior.mean.shape[1:]
    noise = torch.stack([torch.randn(shape, generator=torch.Generator().manual_seed(noise_seed(k))) for k in keys])
    assert torch.equal(latents, (posterior.mean + posterior.std * noise - mean) * inv_std)
    # A draw within bounds of the posterior: |sample - mode| <= 6 standard deviations everywhere.
    mode = (posterior.mode() - mean) * inv_std
    assert ((latents - mode).abs() <= 6 * posterior.std * inv_std).all()
    assert torch.equal(sampling.encode_video(pixels, keys), latents)  # reproducible
    other = sampling.encode_video(pixels, ["000003_000009", "000003_000008"])
    assert not torch.equal(other[0], latents[0]) and torch.equal(other[1], latents[1])


def test_tiling_encodes_tile_by_tile(encoders):
    pixels = _clips(1, 5, 64, 64, seed=2)
    untiled = encoders.encode_video(pixels, ["k"])
    # Default tiles (256 px) do not split a 64 px clip: identical to untiled.
    assert torch.equal(_with(encoders, tiling=VaeTiling()).encode_video(pixels, ["k"]), untiled)

    tiled = _with(encoders, tiling=VaeTiling(min_size=32, stride=16))
    seen: list[tuple[int, ...]] = []
    hook = tiled.vae.encoder.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(tuple(args[0].shape)), with_kwargs=True
    )
    try:
        latents = tiled.encode_video(pixels, ["k"])
    finally:
        hook.remove()
        encoders.vae.disable_tiling()  # the VAE is shared with the other tests
    assert latents.shape == untiled.shape and torch.isfinite(latents).all()
    # The encoder never saw more than one 32 px tile of at most 4 frames at once.
    assert seen and max(s[2] for s in seen) <= 4 and max(max(s[3], s[4]) for s in seen) <= 32
    # Blended tiles are not the untiled result (by design); measured on this random tiny VAE.
    relative = float((latents - untiled).abs().mean() / untiled.abs().mean())
    print(f"tiled vs untiled mean relative difference (tiny random VAE, 32 px tiles): {relative:.3f}")
    assert relative < 0.3


def test_input_checks(encoders):
    with pytest.raises(ValueError, match=r"frame count must be 4k\+1"):
        encoders.encode_video(_clips(1, 4, 32, 32), ["k"])
    with pytest.raises(ValueError, match="multiples of 8"):
        encoders.encode_video(_clips(1, 5, 36, 32), ["k"])
    with pytest.raises(ValueError, match="must be uint8"):
        encoders.encode_video(_clips(1, 5, 32, 32).float(), ["k"])
    with pytest.raises(ValueError, match="one key per clip"):
        encoders.encode_video(_clips(2, 5, 32, 32), ["k"])
    with pytest.raises(TypeError, match="single string"):
        encoders.encode_text("a cat")


def test_field_shapes_and_describe(encoders, tiny):
    assert encoders.field_shapes(Bucket(832, 480, 81)) == {LATENTS: (16, 21, 60, 104), PROMPT_EMBEDS: (512, 32)}
    described = encoders.describe()
    json.dumps(described)
    assert (described["family"], described["latent_channels"], described["spatial_factor"]) == ("wan", 16, 8)
    assert described["temporal_factor"] == 4 and described["tiling"] is None and "ftfy" in described["caption_cleaning"]
    assert set(described["components"]) == {"vae", "text_encoder", "tokenizer"}
    assert _with(encoders, tiling=VaeTiling()).describe()["tiling"] == {"min_size": 256, "stride": 192}
    assert _with(encoders, latent_mode="sample").describe() != described


def test_vae_factors_come_from_the_config():
    config = {"z_dim": 16, "latents_mean": [0.0] * 16, "latents_std": [1.0] * 16}
    assert vae_factors(config) == (16, 8, 4)  # a config saved before diffusers wrote the factors
    with pytest.raises(ConfigError, match="inconsistent"):
        vae_factors({**config, "scale_factor_spatial": 16})
    with pytest.raises(ConfigError, match="latents_std must list 16 values"):
        vae_factors({**config, "latents_std": [1.0] * 48})


def test_wan22_5b_vae_48_channels_16x(tmp_path):
    tiny = write_tiny_wan(tmp_path / "wan22", vae_variant="2.2-5b")
    encoders = WanEncoders.load(tiny, device="cpu", dtype="fp32", latent_mode="mode")
    assert (encoders.latent_channels, encoders.spatial_factor, encoders.temporal_factor) == (48, 16, 4)
    pixels = _clips(1, 5, 32, 64)
    latents = encoders.encode_video(pixels, ["k"])
    assert latents.shape == (1, 48, 2, 2, 4)
    pipe = WanPipeline.from_pretrained(tiny, transformer=None, dtype=torch.float32)
    posterior, mean, inv_std = _reference_latents(pipe, pixels)
    assert torch.equal(latents, (posterior.mode() - mean) * inv_std)
    assert encoders.decode_latents(latents).shape == (1, 5, 3, 32, 64)
    with pytest.raises(ConfigError, match="width 40 is not a multiple of 16"):
        parse_buckets("40x32x5", encoders.spatial_factor, encoders.temporal_factor)


def test_a_real_clip_end_to_end(encoders):
    from test_video import write_clip

    clip = prepare_clip(write_clip(frames=12, size=(96, 64)), parse_buckets("48x32x9;32x32x9", 8, 4))
    latents = encoders.encode_video(clip.pixels[None], ["000000_000000"])
    assert latents.shape[1:] == encoders.field_shapes(clip.bucket)[LATENTS] == (16, 3, 4, 6)


def test_cli_writes_the_tiny_wan_set(tmp_path, capsys):
    from diffprep.cli import main

    assert main(["tiny-model", str(tmp_path / "wan"), "--family", "wan", "--wan-vae", "2.2-5b"]) == 0
    assert "tiny Wan encoder set (VAE 2.2-5b)" in capsys.readouterr().out
    assert detect_family(tmp_path / "wan").name == "wan"
    assert json.loads((tmp_path / "wan" / "vae" / "config.json").read_text())["z_dim"] == 48
