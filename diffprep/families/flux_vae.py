"""A dataset's Flux VAE, loaded alone (no text encoders), to decode its latents for verification.

Found from ``plan.json``'s record of the encoders or a given path. It decodes
with ``FluxEncoders.decode_latents`` itself, so undoing the scale and shift is
the same code as in the encoders, with the factors of the VAE's own config.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from diffprep.families.flux import FluxEncoders, _vae_normalization, resolve_device
from diffprep.families.imports import family_imports
from diffprep.families.hub import resolve_component
from diffprep.errors import ConfigError
from diffprep.media.images import to_uint8
from diffprep.writer.plan import Plan


class VaeDecoder:
    """A dataset's VAE, loaded alone: normalized latents -> images, as ``FluxEncoders.decode_latents`` does."""

    # The encoders' own method: it reads only vae, device, dtype, latent_channels and the two factors,
    # so the inverse of the normalization lives in one place.
    decode_latents = FluxEncoders.decode_latents

    def __init__(self, vae, *, device: torch.device, dtype: torch.dtype, folder: Path | None = None) -> None:
        self.vae = vae
        self.device = device
        self.dtype = dtype
        self.folder = folder
        self.scaling_factor, self.shift_factor = _vae_normalization(vae.config)
        self.latent_channels: int = vae.config.latent_channels

    @classmethod
    def load(cls, folder: str | os.PathLike, *, dtype: torch.dtype, device: str = "auto") -> "VaeDecoder":
        with family_imports("flux"):
            from diffusers import AutoencoderKL

        target = resolve_device(device)
        vae = AutoencoderKL.from_pretrained(folder, dtype=dtype)
        vae.eval()
        vae.requires_grad_(False)
        vae.to(target)
        return cls(vae, device=target, dtype=dtype, folder=Path(folder))

    @classmethod
    def for_plan(cls, plan: Plan, *, model_path: str | None = None, device: str = "auto",
                 token: str | None = None, local_only: bool = False) -> "VaeDecoder":
        """The VAE that encoded ``plan``'s dataset (or the one at ``model_path``), in the plan's precision.

        ``local_only``: a hub VAE is taken from the local cache only, never downloaded.
        Raises ConfigError when it cannot be found or when its scale and shift
        differ from those the latents were normalized with.
        """
        encoders = plan.settings.get("encoders") or {}
        folder = planned_vae_folder(plan, model_path=model_path, token=token, local_only=local_only)
        dtype = getattr(torch, str(encoders.get("dtype", "float32")), None)
        if not isinstance(dtype, torch.dtype):
            raise ConfigError(f"plan.json records encoder dtype {encoders.get('dtype')!r}, not a torch dtype")
        decoder = cls.load(folder, dtype=dtype, device=device)
        planned = (encoders.get("scaling_factor"), encoders.get("shift_factor"))
        if planned != (None, None) and planned != (decoder.scaling_factor, decoder.shift_factor):
            raise ConfigError(
                f"the VAE at {decoder.folder} has scaling_factor {decoder.scaling_factor} and shift_factor "
                f"{decoder.shift_factor}, the latents were normalized with {planned[0]} and {planned[1]} "
                "(plan.json): decode with the VAE that encoded the dataset (--model-path)"
            )
        return decoder

    def decode_one(self, latents: torch.Tensor) -> torch.Tensor:
        """Latents [C, h, w] -> uint8 [3, h*f, w*f]."""
        return to_uint8(self.decode_latents(latents[None]))[0]


def _cached_component(repo_id: str, subfolder: str | None, revision: str | None) -> Path:
    """A hub component's folder in the local Hugging Face cache; ConfigError when it is not there."""
    from huggingface_hub import try_to_load_from_cache  # imported whole by diffprep.families.hub, at its top

    config = try_to_load_from_cache(repo_id, f"{subfolder}/config.json" if subfolder else "config.json",
                                    revision=revision)
    if not isinstance(config, str):
        raise ConfigError(
            f"the VAE of hub repo {repo_id} is not in the local cache and is not downloaded here; "
            "`diffprep decode OUT` downloads it"
        )
    return Path(config).parent


def planned_vae_folder(plan: Plan, *, model_path: str | None = None, token: str | None = None,
                       local_only: bool = False) -> Path:
    """The folder of the VAE that encoded ``plan``'s dataset (plan.json's record), or the one at ``model_path``."""
    encoders = plan.settings.get("encoders") or {}
    record = (encoders.get("components") or {}).get("vae")
    if model_path:
        local_dir, subfolder = resolve_component(model_path, "vae", revision=None, token=token, encoder="VAE")
        return local_dir / subfolder if subfolder else local_dir
    if not record:
        raise ConfigError("plan.json records no VAE for this dataset; pass the VAE with --model-path")
    source, subfolder = record["source"], record.get("subfolder")
    revision = record.get("commit") or record.get("revision")
    if local_only and not Path(source).is_absolute():  # a hub repo id (plan.json records folders absolute)
        return _cached_component(source, subfolder, revision)
    local_dir, subfolder = resolve_component(source, subfolder, revision=revision, token=token, encoder="VAE")
    return local_dir / subfolder if subfolder else local_dir
