"""A tiny random-weight SD VAE in the ``sd-vae-ft-mse`` layout (tests, demos): ``diffprep tiny-model --family sd-vae``.

One folder: ``config.json`` (``AutoencoderKL``, 4 latent channels, three
downsamplings: latents H/8 x W/8, SD's scaling factor) and its safetensors
weights, loaded back by the same ``from_pretrained`` code as the real VAE. The
same seed gives the same files.
"""

from __future__ import annotations

from pathlib import Path

import torch

from diffprep.families.imports import family_imports

SD_SCALING_FACTOR = 0.18215  # the value in sd-vae-ft-mse's config.json


def tiny_sd_vae(seed: int = 0):
    with family_imports("sd-vae"):
        from diffusers import AutoencoderKL

    torch.manual_seed(seed)
    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(8, 16, 16, 16),
        layers_per_block=1,
        latent_channels=4,
        norm_num_groups=8,
        sample_size=32,
        scaling_factor=SD_SCALING_FACTOR,
    )


def write_tiny_sd_vae(path: str | Path, seed: int = 0) -> Path:
    """Write the tiny VAE folder at ``path`` (created if missing) and return it."""
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    tiny_sd_vae(seed).save_pretrained(root, safe_serialization=True)
    return root


__all__ = ["SD_SCALING_FACTOR", "tiny_sd_vae", "write_tiny_sd_vae"]
