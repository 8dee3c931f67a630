"""LTX-2 inpainting masks in the latent grid, as the trainer's ``compute_video_masks`` / ``compute_audio_masks``
make them from the prepared masks (``diffprep.media.clip_inputs``).

Video: ``[F, H, W]`` in [0, 1] -> float 0/1 ``[F', H', W']``: each frame average-pooled by the VAE's spatial factor,
the frames taken in groups of its temporal factor (padded with zeros at the end) of which any masked one masks the
group, the first ``F'`` groups kept, then ``> 0.5``. Audio: a 1-D signal -> float 0/1 ``[T']``, nearest-resampled
to the audio latents' length, then ``> 0.5``. The factors are read off the shapes (pixels vs latents).
"""

from __future__ import annotations

from collections import Counter

import torch

from diffprep import contract

THRESHOLD = 0.5


def video_mask_latent(mask: torch.Tensor, latent_shape: tuple[int, ...] | torch.Size) -> torch.Tensor:
    """``mask`` float ``[F, H, W]`` -> float 0/1 ``[F', H', W']`` for latents of shape ``[C, F', H', W']``."""
    frames, height, width = mask.shape
    latent_frames, latent_height = int(latent_shape[-3]), int(latent_shape[-2])
    space = height // latent_height
    time = (frames - 1) // (latent_frames - 1) if latent_frames > 1 else max(frames, 1)
    pooled = torch.nn.functional.avg_pool2d(mask.float().unsqueeze(1), kernel_size=space).squeeze(1)
    pad = (time - frames % time) % time
    if pad:
        pooled = torch.nn.functional.pad(pooled, (0, 0, 0, 0, 0, pad))
    grouped = pooled.reshape(-1, time, pooled.shape[1], pooled.shape[2]).amax(dim=1)[:latent_frames]
    return (grouped > THRESHOLD).float()


def audio_mask_latent(mask: torch.Tensor, steps: int) -> torch.Tensor:
    """A 1-D ``mask`` -> float 0/1 ``[steps]`` (the audio latents' time steps), nearest-resampled."""
    resampled = torch.nn.functional.interpolate(mask.float().reshape(1, 1, -1), size=steps, mode="nearest")
    return (resampled.reshape(steps) > THRESHOLD).float()


def overlay(frames: torch.Tensor, mask: torch.Tensor, *, tint: tuple[int, int, int] = (255, 0, 0)) -> torch.Tensor:
    """Decoded frames uint8 ``[F, 3, H, W]`` with their latent-grid ``mask`` ``[F', H', W']`` tinted on at half
    strength (``diffprep decode``): each cell spread over its pixels, latent frame ``f // t`` over frame ``f``, as
    the mask was made from the frames."""
    frames_count, _, height, width = frames.shape
    latent_frames = mask.shape[0]
    time = (frames_count - 1) // (latent_frames - 1) if latent_frames > 1 else max(frames_count, 1)
    groups = torch.clamp(torch.arange(frames_count) // time, max=latent_frames - 1)
    spread = torch.nn.functional.interpolate(mask.float()[groups].unsqueeze(1), size=(height, width),
                                             mode="nearest")  # [F, 1, H, W]
    colour = torch.tensor(tint, dtype=torch.float32).view(1, 3, 1, 1)
    mixed = frames.float() * (1 - 0.5 * spread) + colour * 0.5 * spread
    return mixed.round().clamp(0, 255).to(torch.uint8)


SOFT = (0.25, 0.75)  # a prepared mask value strictly between these is neither clearly masked nor clear
SOFT_SHARE = 0.01  # a mask with more of its values soft than this is counted (the note mask_not_binary)


def is_soft(mask: torch.Tensor) -> bool:
    """Whether a prepared mask (values in [0, 1]) is far from binary: more than 1% of its values in (0.25, 0.75)
    (a greyscale or blurred mask, which the 0.5 threshold decides for you)."""
    soft = (mask > SOFT[0]) & (mask < SOFT[1])
    return bool(soft.float().mean() > SOFT_SHARE)


def masks_of(batch, latents: torch.Tensor | None, audio_latents: torch.Tensor | None,
             notes: Counter | None = None) -> dict[str, torch.Tensor]:
    """A batch's masks stacked per field (none when its spec reads none); ``notes`` counts the soft ones."""
    if notes is not None:
        soft = sum(is_soft(m) for masks in (batch.video_masks, batch.audio_masks) for m in masks or ())
        if soft:  # counted only when there is one: a run without masks has nothing to say about them
            notes["mask_not_binary"] += soft
    found: dict[str, torch.Tensor] = {}
    if batch.video_masks is not None:
        found[contract.VIDEO_MASK] = torch.stack([video_mask_latent(m, latents.shape[1:]) for m in batch.video_masks])
    if batch.audio_masks is not None:
        steps = audio_latents.shape[-2]
        found[contract.AUDIO_MASK] = torch.stack([audio_mask_latent(m, steps) for m in batch.audio_masks])
    return found


def mask_problems(latents, audio_latents, video_mask, audio_mask) -> list[str]:
    """Masks against their sample's latents: the latent grid's shape, values 0 and 1 only."""
    problems = []
    for name, mask, grid in (("video_mask", video_mask, None if latents is None else list(latents.shape[1:])),
                             ("audio_mask", audio_mask, None if audio_latents is None else [audio_latents.shape[-2]])):
        if mask is None:
            continue
        if grid is not None and list(mask.shape) != grid:
            problems.append(f"{name} has shape {list(mask.shape)}, its latents' grid is {grid}")
        if not bool(((mask == 0) | (mask == 1)).all()):
            problems.append(f"{name} holds values other than 0 and 1")
    return problems
