"""What the model families share: dtypes by name, the device, per-key VAE noise, caption checks, truncation.

Each family module (``flux``, ``wan``, ``ltx2``) declares its own components, loading and encoding; these
are the few rules they must apply alike so that, for instance, a sample's VAE noise depends on its key alone
whatever the family.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch

from diffprep.errors import ConfigError

DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
LATENT_MODES: tuple[str, ...] = ("sample", "mode", "posterior")


def resolve_device(name: str) -> torch.device:
    """``auto`` -> the first CUDA device when there is one, else the CPU; otherwise the device named."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ConfigError(f"model.device {name!r} is not a device; use auto, cpu, cuda or cuda:N") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"model.device is {name!r} but CUDA is not available here; use cpu or auto")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ConfigError(
                f"model.device is {name!r} but there are {torch.cuda.device_count()} CUDA devices "
                f"(cuda:0 to cuda:{torch.cuda.device_count() - 1})"
            )
    return device


def noise_seed(key: str) -> int:
    """Seed of a sample's VAE noise: the first 8 bytes of sha256(key), so it depends on the key alone."""
    return int.from_bytes(hashlib.sha256(key.encode("utf-8")).digest()[:8], "big")


def checked_captions(captions: Sequence[str]) -> list[str]:
    """The captions as a list; a single string, an empty batch or a non-string caption is refused, named."""
    if isinstance(captions, str):
        raise TypeError("captions must be a sequence of strings, got a single string; wrap it in a list")
    captions = list(captions)
    if not captions:
        raise ValueError("captions is empty; pass at least one caption")
    for position, caption in enumerate(captions):
        if not isinstance(caption, str):
            raise TypeError(f"captions[{position}] must be a string, got {type(caption).__name__}")
    return captions


def key_noise(keys: Sequence[str], like: torch.Tensor) -> torch.Tensor:
    """Standard normal noise shaped like ``like`` [B, ...], each sample's drawn from its key alone.

    One CPU generator per sample: a sample's noise does not depend on the batch
    it is in, on the device, or on where an interrupted run resumed.
    """
    draws = [
        torch.randn(like.shape[1:], generator=torch.Generator("cpu").manual_seed(noise_seed(key)))
        for key in keys
    ]
    return torch.stack(draws).to(like.device, like.dtype)


def truncation(tokenizer, prompts: list[str], max_length: int) -> tuple[list[bool], list[str]]:
    """Which prompts lose tokens at ``max_length``, and the text each truncated one loses."""
    untruncated_ids = tokenizer(prompts).input_ids
    truncated = [len(ids) > max_length for ids in untruncated_ids]
    # What is kept ends with max_length - 1 tokens then EOS; what followed them, up to EOS, is lost.
    removed_ids = [ids[max_length - 1 : -1] for ids, cut in zip(untruncated_ids, truncated) if cut]
    return truncated, tokenizer.batch_decode(removed_ids)


# What a truncation warning shows of the text a caption lost: a few captions, the start of each.
REMOVED_EXCERPT_CHARS = 120
REMOVED_EXCERPT_CAPTIONS = 3


def removed_excerpt(removed_text: Sequence[str]) -> str:
    """The text truncated captions lose, bounded for one log line: the start of the first few, with the counts
    of characters and captions left out (a scraped caption can lose thousands of characters)."""
    shown = []
    for text in removed_text[:REMOVED_EXCERPT_CAPTIONS]:
        cut = len(text) - REMOVED_EXCERPT_CHARS
        shown.append(repr(text[:REMOVED_EXCERPT_CHARS]) + (f"... (+{cut} characters)" if cut > 0 else ""))
    more = len(removed_text) - len(shown)
    return "; ".join(shown) + (f"; and {more} more caption(s)" if more > 0 else "")


__all__ = ["DTYPES", "REMOVED_EXCERPT_CHARS", "LATENT_MODES", "checked_captions", "key_noise", "noise_seed", "removed_excerpt", "resolve_device",
           "truncation"]
