"""The ``sd-vae`` family: Stable Diffusion's VAE alone (``stabilityai/sd-vae-ft-mse``, ``-ema``), the latents of
FastGen's ``ImageNet256_Loader_Config``.

The model is a diffusers ``AutoencoderKL`` folder (``config.json`` + weights, no
text encoders, no ``model_index.json``) with 4 latent channels; the family is told
by that config (``_class_name`` AutoencoderKL, ``latent_channels`` 4), never by a
name. What it stores per image is the posterior itself, ``[8, H/8, W/8]`` float32:
the mean and the standard deviation of ``vae.encode(x).latent_dist``
concatenated on the channel axis, from pixels mapped to [-1, 1] as the VAE was
trained, unscaled: FastGen's DiT network draws ``mean + randn * std`` and applies
the VAE's ``scaling_factor`` itself. (EDM2's ``dataset_tool.py encode`` stores
the same two tensors.)
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from diffprep.errors import ConfigError
from diffprep.families.imports import family_imports
from diffprep.media.images import to_model_input

CONFIG = "config.json"
VAE_CLASS = "AutoencoderKL"
LATENT_CHANNELS = 4
SPATIAL = 8  # three downsamplings: latents are H/8 x W/8
POSTERIOR_CHANNELS = 2 * LATENT_CHANNELS  # mean, then std
DEFAULT_MODEL = "stabilityai/sd-vae-ft-mse"


def is_sd_vae_folder(path: str | Path) -> bool:
    """Whether ``path`` is a folder holding an ``AutoencoderKL`` config with 4 latent channels."""
    config = Path(path).expanduser() / CONFIG
    if not config.is_file():
        return False
    try:
        data = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return data.get("_class_name") == VAE_CLASS and data.get("latent_channels") == LATENT_CHANNELS


def latent_shape(image_size: int) -> list[int]:
    """The stored posterior's shape for a square ``image_size`` image."""
    if image_size % SPATIAL:
        raise ConfigError(f"image.image_size must be a multiple of {SPATIAL} for the SD VAE, got {image_size}")
    return [POSTERIOR_CHANNELS, image_size // SPATIAL, image_size // SPATIAL]


@dataclass(eq=False)  # hashed by identity: the pipeline keeps a working batch size per loaded model
class SdVae:
    """The loaded VAE and where it runs."""

    vae: Any
    device: torch.device
    model_path: str

    @torch.no_grad()
    def posterior(self, pixels: torch.Tensor) -> torch.Tensor:
        """uint8 RGB [B, 3, H, W] -> float32 [B, 8, H/8, W/8]: the posterior's mean and std, unscaled."""
        x = to_model_input(pixels, torch.float32).to(self.device)
        dist = self.vae.encode(x).latent_dist
        return torch.cat([dist.mean, dist.std], dim=1).float().cpu()


def load_sd_vae(model_path: str, *, device: str | torch.device = "cpu", revision: str | None = None,
                token: str | None = None, local_only: bool = False) -> SdVae:
    """The VAE of ``model_path`` (a local folder or a hub repo of the sd-vae layout), in float32, refused when it
    is not an ``AutoencoderKL`` with 4 latent channels. A hub repo's root files are downloaded (or read from the
    cache) through :mod:`diffprep.families.hub`, whose errors name the three ways out of a refusal or of being offline."""
    with family_imports("sd-vae"):
        from diffusers import AutoencoderKL

    from diffprep.families.hub import resolve_component

    folder = model_path
    if not Path(model_path).expanduser().is_dir() and not local_only:
        local_dir, _ = resolve_component(model_path, None, revision=revision, token=token, encoder="VAE")
        folder, revision = str(local_dir), None
    vae = AutoencoderKL.from_pretrained(folder, revision=revision, token=token, local_files_only=local_only,
                                        torch_dtype=torch.float32)
    channels = vae.config.latent_channels
    if channels != LATENT_CHANNELS:
        raise ConfigError(f"{model_path} is an AutoencoderKL with {channels} latent channels; the sd-vae family is "
                          f"Stable Diffusion's {LATENT_CHANNELS}-channel VAE (e.g. {DEFAULT_MODEL}): pass its folder")
    device = torch.device(device)
    return SdVae(vae.to(device).eval().requires_grad_(False), device, str(model_path))


__all__ = ["DEFAULT_MODEL", "POSTERIOR_CHANNELS", "SdVae", "is_sd_vae_folder", "latent_shape", "load_sd_vae"]
