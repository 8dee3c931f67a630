"""The Wan 2.x family: clips to AutoencoderKLWan latents, captions to UMT5 embeddings.

(Over 400 lines: one family's components, encoding, decoding and identity; its tiny set is
``wan_tiny.py``.)

Layout (diffusers, ``model_index.json`` ``_class_name: WanPipeline``): ``vae/``
(``AutoencoderKLWan``), ``text_encoder/`` (``UMT5EncoderModel``),
``tokenizer/`` (the umT5 tokenizer). The transformer and scheduler are never
loaded.

Per sample (bucket ``W x H x F``):

- ``latents.pth`` ``[C, 1 + (F - 1) / t, H / s, W / s]``: the posterior's mean
  (``mode``) or a draw seeded by the sample key (``sample``), normalized per
  channel as ``(z - latents_mean) * (1 / latents_std)``, the step diffusers'
  ``WanImageToVideoPipeline`` applies after encoding and the exact inverse of
  ``WanPipeline``'s ``latents / (1 / latents_std) + latents_mean`` before
  decoding. ``C`` (``z_dim``), ``s`` and ``t`` come from the VAE's config
  (Wan 2.1: 16, 8, 4; Wan 2.2 TI2V-5B: 48, 16, 4), never from a model name.
- ``prompt_embeds.pth`` ``[L, D]`` (L = 512, D = 4096 for umT5-XXL): exactly
  ``WanPipeline.encode_prompt``: the caption cleaned as diffusers' ``prompt_clean``
  does, padded to ``L`` and truncated, encoded with the attention mask, then
  every position from the true token length on set to zero. No pooled
  embedding.

Input pixels are uint8 ``[B, F, 3, H, W]``, mapped to [-1, 1] as ``x / 255 * 2 - 1``
(diffusers' ``VideoProcessor``) and laid out ``[B, 3, F, H, W]`` for the VAE.
The VAE encodes 1 + 4 + 4... frames at a time (its causal cache), so memory
grows with the frame size, not the clip length; ``tiling`` cuts each frame
into overlapping tiles as well (for 720p and up), at the cost of results that
differ slightly from untiled ones (the tiles are blended).

``sample`` noise is generated on the CPU per sample key (see
:func:`diffprep.families.base.noise_seed`), so it does not depend on the
batch, the device or where a run resumed. Everything runs under
``torch.no_grad()``.
"""

from __future__ import annotations

import html
import importlib.metadata
import json
import logging
import re
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from diffprep.contract import LATENTS, PROMPT_EMBEDS
from diffprep.errors import ConfigError
from diffprep.families.base import (DTYPES, LATENT_MODES, checked_captions, key_noise, removed_excerpt, resolve_device,
                                    truncation)
from diffprep.families.imports import family_imports
from diffprep.families.text_cache import TEXT_BATCH, TextCache, cache_bytes, fill_rows
from diffprep.families.hub import ResolvedPart, resolve_component
from diffprep.media.buckets import Bucket

if TYPE_CHECKING:
    from diffusers import AutoencoderKLWan
    from transformers import PreTrainedTokenizerBase, UMT5EncoderModel

__all__ = [
    "PIPELINE_CLASS",
    "WAN_PARTS",
    "VaeTiling",
    "WanEncoders",
    "WanTextEmbeddings",
    "clean_caption",
    "decode_normalized",
    "describe_wan",
    "load_wan_vae",
    "resolve_wan",
    "vae_factors",
]

logger = logging.getLogger("diffprep.families.wan")

PIPELINE_CLASS = "WanPipeline"
TEXT_MAX_LENGTH = 512  # what WanPipeline.__call__ passes as max_sequence_length

# part name -> (subfolder in the diffusers layout, class loaded, marker file)
WAN_PARTS: dict[str, tuple[str, str, str]] = {
    "vae": ("vae", "AutoencoderKLWan", "config.json"),
    "text_encoder": ("text_encoder", "UMT5EncoderModel", "config.json"),
    "tokenizer": ("tokenizer", "AutoTokenizer", "tokenizer_config.json"),
}

# Unicode White_Space, what diffusers' prompt_clean matches with the `regex` module's \s. Python's own \s
# also matches U+001C..U+001F, which would change some captions' tokens.
_WHITESPACE = re.compile("[\t\n\v\f\r \x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000]+")


@dataclass(frozen=True)
class VaeTiling:
    """Spatial VAE tiling in pixels (diffusers' ``enable_tiling``): frames larger than ``min_size`` in
    either direction are encoded in ``min_size`` tiles every ``stride`` pixels, blended where they overlap."""

    min_size: int = 256
    stride: int = 192

    def __post_init__(self) -> None:
        if not 0 < self.stride <= self.min_size:
            raise ConfigError(f"VAE tiling: stride must be in 1..min_size ({self.min_size}), got {self.stride}")


@dataclass(frozen=True)
class WanTextEmbeddings:
    """Embeddings of a batch of captions, on the CPU in the encoders' dtype."""

    prompt_embeds: torch.Tensor  # [B, L, D], zero from lengths[i] on
    lengths: list[int]  # true token count of each caption (EOS included, at most L)
    truncated: list[bool]  # caption longer than L tokens


def clean_caption(text: str) -> str:
    """A caption as diffusers' Wan ``prompt_clean`` leaves it: ftfy's fix_text when ftfy is installed (as
    diffusers does), HTML entities unescaped twice, whitespace runs collapsed to one space, stripped."""
    ftfy = _ftfy()
    if ftfy is not None:
        text = ftfy.fix_text(text)
    text = html.unescape(html.unescape(text)).strip()
    return _WHITESPACE.sub(" ", text).strip()


def vae_factors(config: Mapping[str, Any]) -> tuple[int, int, int]:
    """``(channels, spatial factor, temporal factor)`` of an AutoencoderKLWan from its config.

    The factors are the ``scale_factor_spatial``/``scale_factor_temporal`` that
    diffusers' Wan pipelines read; a config written before diffusers saved them
    gets them from its structure (2 per spatial downsampling, times
    ``patch_size``; 2 per temporal one), and when both are there they must agree.
    """
    levels = len(config.get("dim_mult", [1, 2, 4, 4])) - 1
    spatial = 2**levels * (config.get("patch_size") or 1)
    temporal = 2 ** sum(bool(flag) for flag in config.get("temperal_downsample", [False, True, True]))
    stated_spatial = config.get("scale_factor_spatial")
    stated_temporal = config.get("scale_factor_temporal")
    if (stated_spatial or spatial, stated_temporal or temporal) != (spatial, temporal):
        raise ConfigError(
            f"the Wan VAE config says scale_factor_spatial={stated_spatial}, scale_factor_temporal={stated_temporal} "
            f"but its layers give {spatial} and {temporal}; the config is inconsistent"
        )
    channels = int(config.get("z_dim", 16))
    for name in ("latents_mean", "latents_std"):
        values = config.get(name)
        if values is None or len(values) != channels:
            raise ConfigError(
                f"the Wan VAE config's {name} must list {channels} values (z_dim), got "
                f"{'none' if values is None else len(values)}"
            )
    return channels, spatial, temporal


def resolve_wan(model_path: str, *, revision: str | None = None, token: str | None = None) -> dict[str, ResolvedPart]:
    """Find (downloading only these subfolders from the hub if needed) the vae, text encoder and tokenizer."""
    parts: dict[str, ResolvedPart] = {}
    is_local = Path(model_path).expanduser().is_dir()
    for name, (subfolder, _, marker) in WAN_PARTS.items():
        local_dir, found = resolve_component(model_path, subfolder, revision=revision, token=token, encoder=name)
        folder = local_dir / found if found else local_dir
        if found is None or not (folder / marker).is_file():
            raise ConfigError(
                f"{name}: {model_path} has no {subfolder}/{marker}; point model_path at a folder in the diffusers "
                "Wan layout (vae/, text_encoder/, tokenizer/ and model_index.json)"
            )
        parts[name] = ResolvedPart(
            name=name,
            source=str(local_dir) if is_local else model_path,
            revision=revision,
            commit=None if is_local else (local_dir.name if local_dir.parent.name == "snapshots" else None),
            local_dir=local_dir,
            subfolder=found,
        )
    return parts


def describe_wan(
    parts: Mapping[str, ResolvedPart],
    *,
    dtype: torch.dtype,
    vae_dtype: torch.dtype,
    text_max_length: int,
    latent_mode: str,
    tiling: VaeTiling | None,
) -> dict[str, Any]:
    """JSON-able identity of a Wan encoder set for the config fingerprint, from the resolved folders alone."""
    missing = [name for name in WAN_PARTS if name not in parts]
    if missing:
        raise ValueError(f"describe_wan: parts {missing} are missing; resolve them with resolve_wan")
    vae_config = json.loads((parts["vae"].path / "config.json").read_text(encoding="utf-8"))
    channels, spatial, temporal = vae_factors(vae_config)
    return {
        "family": "wan",
        "dtype": str(dtype).removeprefix("torch."),
        "vae_dtype": str(vae_dtype).removeprefix("torch."),
        "text_max_length": text_max_length,
        "latent_mode": latent_mode,
        "tiling": asdict(tiling) if tiling is not None else None,
        "latent_channels": channels,
        "spatial_factor": spatial,
        "temporal_factor": temporal,
        "latents_mean": [float(v) for v in vae_config["latents_mean"]],
        "latents_std": [float(v) for v in vae_config["latents_std"]],
        # ftfy changes captions when installed (diffusers uses it if importable): part of the identity.
        "caption_cleaning": {"ftfy": _ftfy_version()},
        "components": {name: {"class": cls, **parts[name].identity()} for name, (_, cls, _) in WAN_PARTS.items()},
    }


class WanEncoders:
    """The VAE, umT5 encoder and tokenizer of a Wan model, on one device, ready to encode batches."""

    def __init__(
        self,
        vae: AutoencoderKLWan,
        text_encoder: UMT5EncoderModel,
        tokenizer: PreTrainedTokenizerBase,
        *,
        device: torch.device,
        dtype: torch.dtype,
        vae_dtype: torch.dtype | None = None,
        latent_mode: str = "sample",
        tiling: VaeTiling | None = None,
        text_max_length: int = TEXT_MAX_LENGTH,
        parts: Mapping[str, ResolvedPart] | None = None,
        text_cache_bytes: int | None = None,
    ) -> None:
        """Wrap loaded components; the text encoder must be on ``device`` in ``dtype``, the VAE in ``vae_dtype``
        (default ``dtype``). Tiling is switched on (or off) on ``vae`` here. ``text_cache_bytes``: the bound of
        the caption cache (None: the default; 0: none)."""
        if latent_mode not in LATENT_MODES:
            raise ConfigError(f"latent_mode must be one of {', '.join(LATENT_MODES)}, got {latent_mode!r}")
        if text_max_length < 1:
            raise ConfigError(f"text_max_length must be >= 1, got {text_max_length}")
        self.vae = vae
        self.text_encoder = text_encoder
        self.tokenizer = tokenizer
        self.device = device
        self.dtype = dtype
        self.vae_dtype = vae_dtype or dtype
        self.latent_mode = latent_mode
        self.tiling = tiling
        self.text_max_length = text_max_length
        self.parts = dict(parts) if parts is not None else None
        self.text_cache = TextCache(cache_bytes(None) if text_cache_bytes is None else text_cache_bytes)

        self.latent_channels, self.spatial_factor, self.temporal_factor = vae_factors(vae.config)
        self.text_hidden: int = text_encoder.config.d_model
        # As diffusers' Wan pipelines build them: float32 tensors cast to the latents' dtype.
        self._latents_mean, self._latents_inv_std = _normalization(vae.config)
        if tiling is None:
            vae.disable_tiling()
        else:
            vae.enable_tiling(
                tile_sample_min_height=tiling.min_size,
                tile_sample_min_width=tiling.min_size,
                tile_sample_stride_height=tiling.stride,
                tile_sample_stride_width=tiling.stride,
            )

    @classmethod
    def load(
        cls,
        model_path: str | Path,
        *,
        device: str = "auto",
        dtype: str | torch.dtype = "bf16",
        vae_dtype: str | torch.dtype | None = None,
        latent_mode: str = "sample",
        tiling: VaeTiling | None = None,
        text_max_length: int = TEXT_MAX_LENGTH,
        revision: str | None = None,
        token: str | None = None,
        text_cache_mib: int | None = None,
    ) -> WanEncoders:
        """Resolve and load the VAE, text encoder and tokenizer of the Wan model at ``model_path``.

        ``dtype``/``vae_dtype``: ``bf16``, ``fp16``, ``fp32`` or a torch dtype. diffusers' Wan examples
        keep the VAE in fp32 while the text encoder runs in bf16.
        """
        with family_imports("wan"):
            from diffusers import AutoencoderKLWan
            from transformers import AutoTokenizer, UMT5EncoderModel

        parts = resolve_wan(str(model_path), revision=revision, token=token)
        torch_device = resolve_device(device)
        text_dtype = _dtype(dtype)
        vae_torch_dtype = _dtype(vae_dtype) if vae_dtype is not None else text_dtype
        vae = AutoencoderKLWan.from_pretrained(parts["vae"].path, dtype=vae_torch_dtype)
        text_encoder = UMT5EncoderModel.from_pretrained(parts["text_encoder"].path, dtype=text_dtype)
        tokenizer = AutoTokenizer.from_pretrained(parts["tokenizer"].path)
        for module in (vae, text_encoder):
            module.eval()
            module.requires_grad_(False)
            module.to(torch_device)
        return cls(
            vae, text_encoder, tokenizer,
            device=torch_device, dtype=text_dtype, vae_dtype=vae_torch_dtype, latent_mode=latent_mode,
            tiling=tiling, text_max_length=text_max_length, parts=parts, text_cache_bytes=cache_bytes(text_cache_mib),
        )  # fmt: skip

    def describe(self) -> dict[str, Any]:
        """JSON-able identity of these encoders for the config fingerprint (see :func:`describe_wan`)."""
        if self.parts is None:
            raise ValueError("describe() needs to know where the encoders came from; build them with WanEncoders.load")
        return describe_wan(
            self.parts, dtype=self.dtype, vae_dtype=self.vae_dtype, text_max_length=self.text_max_length,
            latent_mode=self.latent_mode, tiling=self.tiling,
        )  # fmt: skip

    def latent_shape(self, bucket: Bucket) -> tuple[int, int, int, int]:
        """``[C, 1 + (F - 1) / t, H / s, W / s]`` of one sample's latents."""
        self._check_size(bucket.frames, bucket.height, bucket.width)
        return (
            self.latent_channels,
            1 + (bucket.frames - 1) // self.temporal_factor,
            bucket.height // self.spatial_factor,
            bucket.width // self.spatial_factor,
        )

    def field_shapes(self, bucket: Bucket) -> dict[str, tuple[int, ...]]:
        """Shape of every tensor field of a sample in ``bucket`` (no pooled embedding in this family)."""
        return {LATENTS: self.latent_shape(bucket), PROMPT_EMBEDS: (self.text_max_length, self.text_hidden)}

    # Video

    @torch.no_grad()
    def encode_video(self, pixels: torch.Tensor, keys: Sequence[str]) -> torch.Tensor:
        """uint8 RGB ``[B, F, 3, H, W]`` -> normalized latents ``[B, C, F', H/s, W/s]`` on the CPU in ``dtype``.

        ``keys`` are the sample keys: in ``sample`` mode each one seeds its sample's noise.
        """
        if pixels.dtype != torch.uint8:
            raise ValueError(f"pixels must be uint8, got {pixels.dtype}")
        if pixels.ndim != 5 or pixels.shape[2] != 3:
            raise ValueError(f"pixels must be [B, F, 3, H, W], got shape {list(pixels.shape)}")
        self._check_size(pixels.shape[1], pixels.shape[3], pixels.shape[4])
        if len(keys) != pixels.shape[0]:
            raise ValueError(f"got {pixels.shape[0]} clips but {len(keys)} keys; pass one key per clip")
        video = pixels.to(self.device).permute(0, 2, 1, 3, 4).float()
        video = (video / 255.0 * 2.0 - 1.0).to(self.vae_dtype)  # diffusers' VideoProcessor: [0, 1] then 2x - 1
        posterior = self.vae.encode(video).latent_dist
        if self.latent_mode == "mode":
            latents = posterior.mode()
        else:
            latents = posterior.mean + posterior.std * key_noise(keys, posterior.mean)
        mean = self._latents_mean.to(latents.device, latents.dtype)
        inv_std = self._latents_inv_std.to(latents.device, latents.dtype)
        latents = (latents - mean) * inv_std
        return latents.to(device="cpu", dtype=self.dtype)

    @torch.no_grad()
    def decode_latents(self, latents: torch.Tensor) -> torch.Tensor:
        """Normalized latents ``[B, C, F', h, w]`` -> float32 frames ``[B, F, 3, h*s, w*s]`` in [-1, 1], on the CPU,
        undoing the normalization exactly as ``WanPipeline`` does before its VAE decode."""
        if latents.ndim != 5 or latents.shape[1] != self.latent_channels:
            raise ValueError(f"latents must be [B, {self.latent_channels}, F', h, w], got {list(latents.shape)}")
        return decode_normalized(self.vae, latents.to(self.device, self.vae_dtype))

    def _check_size(self, frames: int, height: int, width: int) -> None:
        t, s = self.temporal_factor, self.spatial_factor
        if frames < 1 or (frames - 1) % t:
            raise ValueError(f"frame count must be {t}k+1 (the VAE's temporal factor is {t}), got {frames}")
        if height % s or width % s:
            raise ValueError(
                f"height and width must be multiples of {s} (the VAE's spatial factor), got {height}x{width}"
            )

    # Text

    @torch.no_grad()
    def encode_text(self, captions: Sequence[str]) -> WanTextEmbeddings:
        """Captions -> umT5 embeddings ``[B, L, D]``, zero after each caption's tokens, as WanPipeline.encode_prompt.

        Each distinct caption is encoded once while this process's ``text_cache`` holds it, always in a batch of
        one shape (``encode_rows``): the bytes are the same with or without the cache, in any batch.
        """
        captions = checked_captions(captions)
        rows = self.text_cache.rows(captions, self.encode_rows)
        # Rows keep the embedding up to the true length only; the rest is zero, as WanPipeline sets it.
        prompt_embeds = torch.zeros((len(rows), self.text_max_length, self.text_hidden), dtype=self.dtype)
        for i, (head, length, _) in enumerate(rows):
            prompt_embeds[i, :length] = head
        return WanTextEmbeddings(prompt_embeds, [row[1] for row in rows], [row[2] for row in rows])

    def encode_rows(self, captions: list[str]) -> list[tuple[torch.Tensor, int, bool]]:
        """``(embedding up to the true length [n, D], n, truncated)`` of each caption, in forward passes of exactly
        ``TEXT_BATCH`` captions (the rest empty captions; see ``diffprep.families.text_cache``)."""
        prompts = [clean_caption(caption) for caption in captions]
        input_ids, mask = self._input_ids(prompts)
        filler_ids, filler_mask = self._input_ids([""])
        lengths = [int(n) for n in mask.gt(0).sum(dim=1)]
        truncated, removed_text = truncation(self.tokenizer, prompts, self.text_max_length)
        if removed_text:
            logger.warning(
                "umT5: %d of %d captions were truncated at %d tokens; removed text: %s",
                len(removed_text), len(prompts), self.text_max_length, removed_excerpt(removed_text),
            )  # fmt: skip
        rows = []
        for start in range(0, len(prompts), TEXT_BATCH):
            n = min(TEXT_BATCH, len(prompts) - start)
            ids = fill_rows(input_ids[start : start + n], filler_ids).to(self.device)
            hidden = self.text_encoder(ids, fill_rows(mask[start : start + n], filler_mask).to(self.device))
            hidden = hidden.last_hidden_state[:n].to(device="cpu", dtype=self.dtype)
            # Past the true length is the encoder's output for padding, which WanPipeline zeroes: not kept.
            rows += [(hidden[i, : lengths[start + i]].clone(), lengths[start + i], truncated[start + i])
                     for i in range(n)]
        return rows

    def _input_ids(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        text_inputs = self.tokenizer(
            prompts,
            padding="max_length",
            max_length=self.text_max_length,
            truncation=True,
            add_special_tokens=True,
            return_attention_mask=True,
            return_tensors="pt",
        )
        return text_inputs.input_ids, text_inputs.attention_mask

    def empty_prompt_embeds(self) -> torch.Tensor:
        """``[L, D]`` embedding of the empty caption, for classifier-free-guidance dropout at training time."""
        return self.encode_text([""]).prompt_embeds[0]


def _normalization(config: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """``latents_mean`` and ``1 / latents_std`` shaped ``[1, C, 1, 1, 1]``, float32, as diffusers' Wan pipelines
    build them."""
    channels = len(config.latents_mean)
    shape = (1, channels, 1, 1, 1)
    return torch.tensor(config.latents_mean).view(shape), (1.0 / torch.tensor(config.latents_std)).view(shape)


@torch.no_grad()
def decode_normalized(vae: AutoencoderKLWan, latents: torch.Tensor) -> torch.Tensor:
    """Normalized latents ``[B, C, F', h, w]`` (on the VAE's device and dtype) -> float32 frames
    ``[B, F, 3, H, W]`` in [-1, 1] on the CPU: ``latents / (1 / latents_std) + latents_mean``, then the VAE."""
    mean, inv_std = (t.to(latents.device, latents.dtype) for t in _normalization(vae.config))
    video = vae.decode(latents / inv_std + mean).sample  # AutoencoderKLWan clamps to [-1, 1]
    return video.float().permute(0, 2, 1, 3, 4).contiguous().to("cpu")


def load_wan_vae(folder: str | Path, *, device: str = "auto", dtype: torch.dtype = torch.float32) -> AutoencoderKLWan:
    """A Wan VAE alone (decode-and-verify: no text encoder), in eval mode on ``device``."""
    with family_imports("wan"):
        from diffusers import AutoencoderKLWan

    vae = AutoencoderKLWan.from_pretrained(folder, dtype=dtype)
    vae.eval()
    vae.requires_grad_(False)
    return vae.to(resolve_device(device))


def _dtype(value: str | torch.dtype) -> torch.dtype:
    if isinstance(value, torch.dtype):
        return value
    if value not in DTYPES:
        raise ConfigError(f"precision must be one of {', '.join(DTYPES)}, got {value!r}")
    return DTYPES[value]


def _ftfy():
    try:
        import ftfy
    except ImportError:
        return None
    return ftfy


def _ftfy_version() -> str | None:
    try:
        return importlib.metadata.version("ftfy") if _ftfy() is not None else None
    except importlib.metadata.PackageNotFoundError:
        return None
