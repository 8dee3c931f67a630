"""The Flux encoders: images to VAE latents, captions to T5 and CLIP embeddings.

Text embeddings are computed exactly as diffusers' ``FluxPipeline.encode_prompt``
does (``_get_t5_prompt_embeds`` / ``_get_clip_prompt_embeds``): T5 padded to
``t5_max_length`` and truncated, no attention mask; CLIP padded to its 77
tokens, ``pooler_output``. Latents are the VAE posterior's mean (``mode``) or a
draw from it (``sample``), normalized as ``(z - shift_factor) * scaling_factor``
with both read from the VAE's own config.

A ``sample`` draw uses noise seeded from the sample key alone, generated on the
CPU, so a sample's noise does not depend on the batch it is in, on the device,
or on where an interrupted run resumed. The VAE's own output is another
matter: on the CPU a batch of 1 and a batch of 2 take different convolution
kernels and differ in the last float bits (same-size batches do not), so
reproducible bytes need batches fixed by the plan, which they are.

Everything runs under ``torch.no_grad()``, as ``FluxPipeline.__call__`` does;
with autograd on, PyTorch picks other attention kernels and the last bits
differ. (Not inference mode: its tensors refuse in-place updates later.)

Precision: bf16 and fp32 are the supported choices. fp16 runs as asked, with
no silent upcast: T5 is known to overflow in fp16 and some CPU kernels lack
fp16 support, so prefer bf16.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from diffprep.config import LatentMode, ModelConfig
from diffprep.families.base import (DTYPES, LATENT_MODES, checked_captions, key_noise, removed_excerpt, resolve_device,
                                    truncation)
from diffprep.families.text_cache import TEXT_BATCH, TextCache, cache_bytes, fill_rows
from diffprep.families.hub import Part, ResolvedPart, resolve_parts
from diffprep.errors import ConfigError
from diffprep.families.imports import family_imports

if TYPE_CHECKING:
    from diffusers import AutoencoderKL
    from transformers import CLIPTextModel, CLIPTokenizer, T5EncoderModel, T5TokenizerFast

logger = logging.getLogger("diffprep.families.flux")


# The classes loaded for each part, as diffusers' FluxPipeline declares them.
FLUX_CLASSES: dict[str, str] = {
    "vae": "AutoencoderKL",
    "clip_text": "CLIPTextModel",
    "clip_tokenizer": "CLIPTokenizer",
    "t5_text": "T5EncoderModel",
    "t5_tokenizer": "T5TokenizerFast",
}


# Where each part sits in the FLUX.1-dev layout, and the override that replaces model_path for it.
FLUX_PARTS: tuple[Part, ...] = (
    Part("vae", "VAE", "vae_path", "vae", ("config.json",)),
    Part("clip_text", "CLIP", "clip_path", "text_encoder", ("config.json",)),
    Part("clip_tokenizer", "CLIP", "clip_path", "tokenizer", ("tokenizer_config.json", "tokenizer.json")),
    Part("t5_text", "T5", "t5_path", "text_encoder_2", ("config.json",)),
    Part("t5_tokenizer", "T5", "t5_path", "tokenizer_2", ("tokenizer_config.json", "tokenizer.json")),
)


def resolve_encoders(model: ModelConfig, *, token: str | None = None) -> dict[str, ResolvedPart]:
    """Every part of the Flux encoders resolved (downloaded if needed), keyed by part name (``FLUX_PARTS``)."""
    return resolve_parts(model, FLUX_PARTS, "FLUX.1-dev", token=token)


@dataclass(frozen=True)
class TextEmbeddings:
    """Embeddings of a batch of captions, on the CPU in the encoders' dtype."""

    prompt_embeds: torch.Tensor  # [B, t5_max_length, t5_hidden]
    pooled_prompt_embeds: torch.Tensor  # [B, clip_hidden]
    t5_truncated: list[bool]  # caption longer than t5_max_length tokens


def describe_flux(
    parts: Mapping[str, ResolvedPart], *, dtype: torch.dtype, t5_max_length: int, latent_mode: str
) -> dict[str, Any]:
    """JSON-able identity of a Flux encoder set, for the config fingerprint.

    Works from resolved folders alone, so the fetch phase can fingerprint a run
    without loading multi-GB models; ``FluxEncoders.describe()`` returns the same.
    """
    missing = [name for name in FLUX_CLASSES if name not in parts]
    if missing:
        raise ValueError(f"describe_flux: parts {missing} are missing; resolve them with hub.resolve_encoders")
    vae_config = json.loads((parts["vae"].path / "config.json").read_text(encoding="utf-8"))
    scaling_factor, shift_factor = _vae_normalization(vae_config)
    return {
        "family": "flux",
        "dtype": str(dtype).removeprefix("torch."),
        "t5_max_length": t5_max_length,
        "latent_mode": latent_mode,
        "scaling_factor": scaling_factor,
        "shift_factor": shift_factor,
        "components": {name: {"class": cls, **parts[name].identity()} for name, cls in FLUX_CLASSES.items()},
    }


class FluxEncoders:
    """The VAE, CLIP and T5 of a Flux model, on one device, ready to encode batches."""

    def __init__(
        self,
        vae: AutoencoderKL,
        clip_text: CLIPTextModel,
        clip_tokenizer: CLIPTokenizer,
        t5_text: T5EncoderModel,
        t5_tokenizer: T5TokenizerFast,
        *,
        device: torch.device,
        dtype: torch.dtype,
        t5_max_length: int,
        latent_mode: LatentMode = "sample",
        parts: Mapping[str, ResolvedPart] | None = None,
        text_cache_bytes: int | None = None,
    ) -> None:
        """Wrap loaded components; the models must already be on ``device`` in ``dtype``.

        ``parts`` records where the components came from (``load`` fills it);
        ``describe()`` needs it. ``text_cache_bytes``: the bound of the caption
        cache (None: the default; 0: none).
        """
        if latent_mode not in LATENT_MODES:
            raise ConfigError(f"latent_mode must be one of {', '.join(LATENT_MODES)}, got {latent_mode!r}")
        if t5_max_length < 1:
            raise ConfigError(f"t5_max_length must be >= 1, got {t5_max_length}")
        clip_max_length = clip_tokenizer.model_max_length
        if clip_max_length > clip_text.config.max_position_embeddings:
            raise ConfigError(
                f"the CLIP tokenizer pads to {clip_max_length} tokens but the CLIP model has only "
                f"{clip_text.config.max_position_embeddings} positions; "
                "set model_max_length in its tokenizer_config.json"
            )
        self.vae = vae
        self.clip_text = clip_text
        self.clip_tokenizer = clip_tokenizer
        self.t5_text = t5_text
        self.t5_tokenizer = t5_tokenizer
        self.device = device
        self.dtype = dtype
        self.t5_max_length = t5_max_length
        self.clip_max_length = clip_max_length
        self.latent_mode = latent_mode
        self.parts = dict(parts) if parts is not None else None
        self.text_cache = TextCache(cache_bytes(None) if text_cache_bytes is None else text_cache_bytes)

        self.scaling_factor, self.shift_factor = _vae_normalization(vae.config)
        self.latent_channels: int = vae.config.latent_channels
        self.vae_scale_factor: int = 2 ** (len(vae.config.block_out_channels) - 1)
        self.t5_hidden: int = t5_text.config.d_model
        self.clip_hidden: int = clip_text.config.hidden_size

    @classmethod
    def load(cls, model: ModelConfig, *, token: str | None = None) -> FluxEncoders:
        """Resolve (downloading only what is missing) and load the encoders named by ``model``."""
        with family_imports("flux"):
            from diffusers import AutoencoderKL
            from transformers import CLIPTextModel, CLIPTokenizer, T5EncoderModel, T5TokenizerFast

        parts = resolve_encoders(model, token=token)
        device = resolve_device(model.device)
        dtype = DTYPES[model.precision]

        vae = AutoencoderKL.from_pretrained(parts["vae"].path, dtype=dtype)
        clip_text = CLIPTextModel.from_pretrained(parts["clip_text"].path, dtype=dtype)
        clip_tokenizer = CLIPTokenizer.from_pretrained(parts["clip_tokenizer"].path)
        t5_text = T5EncoderModel.from_pretrained(parts["t5_text"].path, dtype=dtype)
        t5_tokenizer = T5TokenizerFast.from_pretrained(parts["t5_tokenizer"].path)
        for module in (vae, clip_text, t5_text):
            module.eval()
            module.requires_grad_(False)
            module.to(device)
        return cls(
            vae,
            clip_text,
            clip_tokenizer,
            t5_text,
            t5_tokenizer,
            device=device,
            dtype=dtype,
            t5_max_length=model.t5_max_length,
            latent_mode=model.latent_mode,
            parts=parts,
            text_cache_bytes=cache_bytes(model.text_cache_mib),
        )

    def describe(self) -> dict[str, Any]:
        """JSON-able identity of these encoders for the config fingerprint (see :func:`describe_flux`)."""
        if self.parts is None:
            raise ValueError(
                "describe() needs to know where the encoders came from; build them with FluxEncoders.load "
                "or pass parts= (from hub.resolve_encoders)"
            )
        return describe_flux(
            self.parts, dtype=self.dtype, t5_max_length=self.t5_max_length, latent_mode=self.latent_mode
        )

    # Images

    @torch.no_grad()
    def encode_images(self, pixels: torch.Tensor, keys: Sequence[str]) -> torch.Tensor:
        """uint8 RGB ``[B, 3, H, W]`` -> normalized latents ``[B, C, H/f, W/f]`` on the CPU in ``dtype``.

        ``keys`` are the sample keys: in ``sample`` mode each one seeds its
        sample's noise.
        """
        return self.encode_posterior(pixels, keys)[0]

    @torch.no_grad()
    def encode_posterior(self, pixels: torch.Tensor, keys: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor | None,
                                                                                   torch.Tensor | None]:
        """``(latents, mean, logvar)``: the normalized latents as ``encode_images``; in ``posterior`` mode also
        the raw posterior's mean and log-variance ``[B, C, H/f, W/f]`` (no shift or scale; logvar clamped to
        [-30, 20], as diffusers' ``DiagonalGaussianDistribution`` does), else None for both."""
        self._check_pixels(pixels, keys)
        # The same [-1, 1] mapping as diffusers' VaeImageProcessor: x / 255, then 2x - 1.
        images = 2.0 * (pixels.to(self.device).float() / 255.0) - 1.0
        posterior = self.vae.encode(images.to(self.dtype)).latent_dist
        if self.latent_mode in ("mode", "posterior"):
            latents = posterior.mode()
        else:
            noise = key_noise(keys, posterior.mean)
            latents = posterior.mean + posterior.std * noise
        latents = ((latents - self.shift_factor) * self.scaling_factor).to("cpu")
        if self.latent_mode != "posterior":
            return latents, None, None
        return latents, posterior.mean.to("cpu"), posterior.logvar.clamp(-30.0, 20.0).to("cpu")

    @torch.no_grad()
    def decode_latents(self, latents: torch.Tensor) -> torch.Tensor:
        """Normalized latents ``[B, C, h, w]`` -> float32 images ``[B, 3, h*f, w*f]`` in [-1, 1], on the CPU."""
        if latents.ndim != 4 or latents.shape[1] != self.latent_channels:
            raise ValueError(
                f"latents must be [B, {self.latent_channels}, h, w], got shape {list(latents.shape)}"
            )
        latents = latents.to(self.device, self.dtype) / self.scaling_factor + self.shift_factor
        images = self.vae.decode(latents).sample
        # The decoder can overshoot [-1, 1] slightly; clamp as image post-processing does.
        return images.float().clamp(-1.0, 1.0).to("cpu")

    def _check_pixels(self, pixels: torch.Tensor, keys: Sequence[str]) -> None:
        if pixels.dtype != torch.uint8:
            raise ValueError(f"pixels must be uint8, got {pixels.dtype}")
        if pixels.ndim != 4 or pixels.shape[1] != 3:
            raise ValueError(f"pixels must be [B, 3, H, W], got shape {list(pixels.shape)}")
        height, width = pixels.shape[2], pixels.shape[3]
        if height % self.vae_scale_factor or width % self.vae_scale_factor:
            raise ValueError(
                f"image height and width must be multiples of {self.vae_scale_factor} (the VAE's downsampling), "
                f"got {height}x{width}"
            )
        if len(keys) != pixels.shape[0]:
            raise ValueError(f"got {pixels.shape[0]} images but {len(keys)} keys; pass one key per image")

    # Text

    @torch.no_grad()
    def encode_text(self, captions: Sequence[str]) -> TextEmbeddings:
        """Captions -> T5 sequence embeddings and CLIP pooled embeddings, as FluxPipeline.encode_prompt.

        Each distinct caption is encoded once while this process's ``text_cache`` holds it, always in a batch of
        one shape (``encode_rows``): the bytes are the same with or without the cache, in any batch.
        """
        captions = checked_captions(captions)
        rows = self.text_cache.rows(captions, self.encode_rows)
        return TextEmbeddings(torch.stack([row[0] for row in rows]), torch.stack([row[1] for row in rows]),
                              [row[2] for row in rows])

    def encode_rows(self, prompts: list[str]) -> list[tuple[torch.Tensor, torch.Tensor, bool]]:
        """``(T5 [L, D], CLIP pooled [D], truncated)`` of each prompt, in forward passes of exactly
        ``TEXT_BATCH`` captions (the rest empty captions; see ``diffprep.families.text_cache``)."""
        t5_ids, truncated = self._t5_input_ids(prompts)
        clip_ids = self._clip_input_ids(prompts)
        t5_filler, _ = self._t5_input_ids([""])
        clip_filler = self._clip_input_ids([""])
        rows = []
        for start in range(0, len(prompts), TEXT_BATCH):
            n = min(TEXT_BATCH, len(prompts) - start)
            t5_batch = fill_rows(t5_ids[start : start + n], t5_filler)
            clip_batch = fill_rows(clip_ids[start : start + n], clip_filler)
            prompt_embeds = self.t5_text(t5_batch.to(self.device), output_hidden_states=False)[0]
            # Flux uses the pooled output of CLIPTextModel.
            pooled_prompt_embeds = self.clip_text(clip_batch.to(self.device), output_hidden_states=False).pooler_output
            prompt_embeds = prompt_embeds[:n].to(device="cpu", dtype=self.dtype)
            pooled_prompt_embeds = pooled_prompt_embeds[:n].to(device="cpu", dtype=self.dtype)
            # Cloned: a row of its own, not a view keeping the whole batch alive in the cache.
            rows += [(prompt_embeds[i].clone(), pooled_prompt_embeds[i].clone(), truncated[start + i])
                     for i in range(n)]
        return rows

    def _t5_input_ids(self, prompts: list[str]) -> tuple[torch.Tensor, list[bool]]:
        return _input_ids(self.t5_tokenizer, prompts, self.t5_max_length, logging.WARNING,
                          "T5: %d of %d captions were truncated because t5_max_length is %d tokens; removed text: %s")

    def _clip_input_ids(self, prompts: list[str]) -> torch.Tensor:
        # Info, not warning: Flux reads long captions through T5; CLIP's 77 tokens cut them by design.
        return _input_ids(self.clip_tokenizer, prompts, self.clip_max_length, logging.INFO,
                          "CLIP: %d of %d captions were truncated because CLIP reads at most %d tokens; "
                          "removed text: %s")[0]


def _input_ids(tokenizer: Any, prompts: list[str], max_length: int, level: int,
               message: str) -> tuple[torch.Tensor, list[bool]]:
    """``prompts`` as FluxPipeline tokenizes them (padded to ``max_length``), and which were truncated: logged at
    ``level`` with ``message`` (the count, the total, ``max_length`` and the removed text)."""
    input_ids = tokenizer(prompts, padding="max_length", max_length=max_length, truncation=True,
                          return_length=False, return_overflowing_tokens=False, return_tensors="pt").input_ids
    truncated, removed_text = truncation(tokenizer, prompts, max_length)
    if removed_text:
        logger.log(level, message, len(removed_text), len(prompts), max_length, removed_excerpt(removed_text))
    return input_ids, truncated


def _vae_normalization(config: Mapping[str, Any]) -> tuple[float, float]:
    """``(scaling_factor, shift_factor)`` from a VAE config; VAEs without a shift (SD's) shift by 0.0."""
    shift = config.get("shift_factor")
    return float(config["scaling_factor"]), 0.0 if shift is None else float(shift)
