"""A tiny random-weight Wan 2.x set in the real diffusers layout (tests, demos): ``diffprep tiny-model --family wan``.

vae/ (AutoencoderKLWan, 2.1 or the 2.2 5B structure), text_encoder/
(UMT5EncoderModel), tokenizer/, scheduler/ and a model_index.json naming
``WanPipeline``; loaded back by the same ``from_pretrained`` code as a real set.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from diffprep.errors import ConfigError
from diffprep.families.imports import family_imports
from diffprep.families.wan import PIPELINE_CLASS

# Wan 2.1's VAE normalization (diffusers' AutoencoderKLWan defaults, as in Wan2.1-T2V-1.3B-Diffusers/vae).
_WAN21_LATENTS_MEAN = [
    -0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508,
    0.4134, -0.0715, 0.5517, -0.3632, -0.1922, -0.9497, 0.2503, -0.2921,
]  # fmt: skip
_WAN21_LATENTS_STD = [
    2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743,
    3.2687, 2.1526, 2.8652, 1.5579, 1.6382, 1.1253, 2.8251, 1.9160,
]  # fmt: skip
TINY_VAE_VARIANTS: tuple[str, ...] = ("2.1", "2.2-5b")


def write_tiny_wan(path: str | Path, seed: int = 0, *, vae_variant: str = "2.1") -> Path:
    """Write a tiny random-weight Wan set under ``path`` (created if missing) and return it.

    The real diffusers layout and classes, small sizes: vae/ (AutoencoderKLWan),
    text_encoder/ (UMT5EncoderModel, hidden 32), tokenizer/ (a small T5-style
    unigram tokenizer: <pad>=0, </s>=1, <unk>=2 as umT5's, max length 512),
    scheduler/ (UniPC with flow sigmas, as Wan2.1-T2V-1.3B-Diffusers) and
    model_index.json (``WanPipeline``, no transformer). ``WanPipeline.from_pretrained(path,
    transformer=None)`` loads it. ``vae_variant``: ``2.1`` (16 channels, 8x spatial)
    or ``2.2-5b`` (Wan 2.2 TI2V-5B's structure: 48 channels, residual blocks,
    2x2 patchify, 16x spatial). The same seed gives the same files.
    """
    if vae_variant not in TINY_VAE_VARIANTS:
        raise ConfigError(f"vae_variant must be one of {', '.join(TINY_VAE_VARIANTS)}, got {vae_variant!r}")
    from diffprep.families.flux_tiny import tiny_t5_tokenizer

    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    if any((root / name).exists() for name in ("vae", "text_encoder", "tokenizer", "model_index.json")):
        raise FileExistsError(f"{root} already holds a model; pass an empty or new folder")
    tokenizer = tiny_t5_tokenizer()
    with torch.random.fork_rng(devices=[]):  # our seeding must not disturb the caller's global RNG
        torch.manual_seed(seed)
        vae = _tiny_vae(vae_variant)
        torch.manual_seed(seed + 1)
        text_encoder = _tiny_umt5(tokenizer)
    vae.save_pretrained(root / "vae")
    text_encoder.save_pretrained(root / "text_encoder")
    tokenizer.save_pretrained(root / "tokenizer")
    _tiny_scheduler().save_pretrained(root / "scheduler")
    _write_model_index(root)
    return root


def _tiny_vae(variant: str):
    with family_imports("wan"):
        from diffusers import AutoencoderKLWan

    common = {
        "dim_mult": [1, 2, 4, 4], "num_res_blocks": 1, "attn_scales": [], "temperal_downsample": [False, True, True]
    }  # fmt: skip
    if variant == "2.1":
        return AutoencoderKLWan(
            base_dim=8, z_dim=16, latents_mean=_WAN21_LATENTS_MEAN, latents_std=_WAN21_LATENTS_STD,
            scale_factor_spatial=8, scale_factor_temporal=4, **common,
        )  # fmt: skip
    # Wan 2.2 TI2V-5B: RGB is patchified 2x2 into 12 channels before the encoder, so 8 x 2 = 16x spatially.
    generator = torch.Generator().manual_seed(48)
    return AutoencoderKLWan(
        base_dim=8, decoder_base_dim=12, z_dim=48, in_channels=12, out_channels=12, is_residual=True, patch_size=2,
        latents_mean=(torch.randn(48, generator=generator) * 0.5).tolist(),
        latents_std=(torch.rand(48, generator=generator) + 0.5).tolist(),
        scale_factor_spatial=16, scale_factor_temporal=4, **common,
    )  # fmt: skip


def _tiny_umt5(tokenizer):
    with family_imports("wan"):
        from transformers import UMT5Config, UMT5EncoderModel

    # umT5-XXL's shape in miniature: gated GELU feed-forward, untied embeddings, relative attention per layer.
    config = UMT5Config(
        vocab_size=len(tokenizer), d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
        relative_attention_num_buckets=8, relative_attention_max_distance=32, feed_forward_proj="gated-gelu",
        tie_word_embeddings=False, is_encoder_decoder=False, use_cache=False,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
    )  # fmt: skip
    return UMT5EncoderModel(config)


def _tiny_scheduler():
    with family_imports("wan"):
        from diffusers import UniPCMultistepScheduler

    # diffprep never uses it: it completes the layout so that WanPipeline.from_pretrained loads the folder.
    return UniPCMultistepScheduler(
        num_train_timesteps=1000, prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0
    )


def _write_model_index(root: Path) -> None:
    with family_imports("wan"):
        import diffusers

    index = {
        "_class_name": PIPELINE_CLASS,
        "_diffusers_version": diffusers.__version__,
        "scheduler": ["diffusers", "UniPCMultistepScheduler"],
        "text_encoder": ["transformers", "UMT5EncoderModel"],
        "tokenizer": ["transformers", "T5TokenizerFast"],
        # The real repo names WanTransformer3DModel here; the tiny set has none.
        "transformer": [None, None],
        "vae": ["diffusers", "AutoencoderKLWan"],
    }
    (root / "model_index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n", encoding="utf-8")
