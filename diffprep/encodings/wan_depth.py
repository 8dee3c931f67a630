"""Wan's depth latents (``--depth-column``): each clip's depth clip through the same VAE as the clip.

FastGen's VACE v2v recipes read ``key_map["depth_latent"] = "depth_latent.pth"`` (``fastgen/configs/data.py``) and
hand it to ``prepare_vid_conditioning(real_raw, condition_latents=depth_latent)`` (``fastgen/trainer.py``), where
it takes the place of ``vae.encode(depth video in [-1, 1])``: so ``depth_latent.pth`` is shaped and normalized
exactly as ``latent.pth`` (``(z - latents_mean) / latents_std``, ``[C, 1 + (F - 1) / t, H / s, W / s]``), in the
same latent mode. In ``sample`` mode its noise is seeded by ``<key>/depth``, not the clip's key: the two draws are
independent, and each depends on its key alone.

The depth clips go through the VAE in a call of their own after the clips'. One call of ``2B`` clips was measured
(tiny Wan set, CPU, fp32, 1 and 2 threads): batches of 2 and 4 give the same bits, but a batch of 1 differs from a
batch of 2 by up to 4.8e-7, so a unit's last batch of one clip would get other ``latent.pth`` bytes with depth
than without. Two calls keep the clips' latents byte-identical to a run without depth; the one call was about 15%
faster on that set.
"""

from __future__ import annotations

from typing import Any

import torch

from diffprep import contract
from diffprep.config import Settings
from diffprep.errors import ConfigError
from diffprep.media.depth_video import DEPTH

DEPTH_NOISE_SUFFIX = "/depth"


def depth_inputs(settings: Settings) -> list[str]:
    """``[DEPTH]`` when this run reads a depth column (``--depth-column``), else ``[]``."""
    return [DEPTH] if settings.source.depth_key else []


def refuse_depth(settings: Settings, encoding: str) -> None:
    """--depth-column with an encoding that stores no depth latents: refused by name, never dropped."""
    if settings.source.depth_key:
        raise ConfigError(f"--depth-column {settings.source.depth_key}: the {encoding} encoding stores no depth "
                          "latents (only Wan does, depth_latent.pth for FastGen's VACE v2v); remove it")


def plans_depth(expected: dict[str, Any] | None) -> bool:
    return contract.field_stem(contract.DEPTH_LATENT) in (expected or {})


def encode_clips(loaded: Any, batch: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(latents, depth latents or None)`` of a batch, each ``[B, C, F', h, w]``: its clips, then, when it holds
    them, its depth clips (``[B, F, 3, H, W]``) in a ``loaded.encode_video`` call of their own."""
    latents = loaded.encode_video(batch.pixels, batch.keys)
    if batch.depths is None:
        return latents, None
    return latents, loaded.encode_video(torch.stack(batch.depths), [key + DEPTH_NOISE_SUFFIX for key in batch.keys])


__all__ = ["DEPTH_NOISE_SUFFIX", "depth_inputs", "encode_clips", "plans_depth", "refuse_depth"]
