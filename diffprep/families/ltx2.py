"""The LTX-2 family: clips to video and audio latents, captions to Gemma features, as the LTX-2 trainer stores them.

(Over 400 lines on purpose: one family's encoders and their loading on ltx-core. The checkpoint (its files,
config, scale factors and identity) is ``ltx2_files``, re-exported here; a clip's audio track is
``diffprep.media.audio``; Gemma and the feature extractor are ``ltx2_gemma``; the trainer's ``.precomputed/``
records are ``ltx2_precomputed``.)

Everything numerical is Lightricks' ``ltx-core`` (1.0.0): the video VAE encoder
(``VideoEncoder``: posterior mean, normalized per channel with the checkpoint's
``mean-of-means``/``std-of-means``), the audio VAE encoder (``AudioEncoder``,
same normalization over the 128 ``(channel, frequency)`` features), the
waveform-to-mel step (``AudioProcessor``: resample to the checkpoint's rate, log
mel) and the Gemma feature extractor (``FeatureExtractorV1``/``V2``). This module
only loads those pieces, feeds them what the trainer's ``process_dataset.py``
feeds them; ``ltx2_precomputed`` shapes what they return into the trainer's
``.precomputed/`` records (reference/consumer-formats.md A1).

Loading. The LTX-2 checkpoint is one ``.safetensors`` file whose ``"config"``
metadata entry describes every component; the video and audio encoders are
built from it by ltx-core's ``SingleGPUModelBuilder`` with its own
configurators and key filters, exactly as the trainer's ``model_loader`` does.
The Gemma text encoder and the feature extractor cannot take that road with the
versions pinned here: ``ltx2_gemma`` loads them.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from diffprep.errors import ConfigError
from diffprep.families.ltx2_gemma import (
    TEXT_MAX_LENGTH,
    feature_extractor_configurator,
    feature_extractor_key_ops,
    load_gemma,
)
from diffprep.families.ltx2_files import (  # the checkpoint side, re-exported: callers import it from here
    FAMILY,
    Ltx2Parts,
    VideoScaleFactors,
    describe_ltx2,
    read_checkpoint_config,
    resolve_ltx2,
    video_scale_factors,
)
from diffprep.families.imports import family_imports
from diffprep.media.audio import ClipAudio

if TYPE_CHECKING:
    from ltx_core.model.audio_vae import AudioDecoder, AudioEncoder, Vocoder
    from ltx_core.model.audio_vae.ops import AudioProcessor
    from ltx_core.model.video_vae import VideoDecoder, VideoEncoder
    from ltx_core.text_encoders.gemma import GemmaTextEncoder

logger = logging.getLogger("diffprep.families.ltx2")


# The dtypes the trainer stores (consumer-formats.md A1): video latents and text features bf16, audio latents
# float32, the mask int64.
VIDEO_LATENTS_DTYPE = torch.bfloat16
AUDIO_LATENTS_DTYPE = torch.float32
CONDITIONS_DTYPE = torch.bfloat16
MASK_DTYPE = torch.int64

# --------------------------------------------------------------------------- encoders


@dataclass(frozen=True)
class AudioLatents:
    """One clip's normalized audio latents ``[channels, time, frequency]`` (float32) and the seconds encoded."""

    latents: torch.Tensor
    duration: float


@dataclass(frozen=True)
class TextConditions:
    """One caption's Gemma features after the feature extractor (before the connectors), on the CPU."""

    video_prompt_embeds: torch.Tensor  # [1024, D]
    audio_prompt_embeds: torch.Tensor | None  # [1024, D_a]; None for a video-only checkpoint
    prompt_attention_mask: torch.Tensor  # [1024] int64, left-padded
    truncated: bool


class Ltx2Encoders:
    """LTX-2's video VAE encoder, audio VAE encoder + mel processor and Gemma + feature extractor, on one device."""

    def __init__(
        self,
        *,
        checkpoint: Path,
        config: Mapping[str, Any],
        device: torch.device,
        dtype: torch.dtype,
        audio_dtype: torch.dtype,
        video_encoder: VideoEncoder | None = None,
        video_decoder: VideoDecoder | None = None,
        audio_encoder: AudioEncoder | None = None,
        audio_processor: AudioProcessor | None = None,
        audio_decoder: AudioDecoder | None = None,
        vocoder: Vocoder | None = None,
        text_encoder: GemmaTextEncoder | None = None,
        feature_extractor: torch.nn.Module | None = None,
        text_encoder_path: Path | None = None,
        text_encoder_8bit: bool = False,
        decoder_factories: Mapping[str, Callable[[], torch.nn.Module]] | None = None,
    ) -> None:
        self.checkpoint = checkpoint
        self.config = dict(config)
        self.device = device
        self.dtype = dtype
        self.audio_dtype = audio_dtype
        self.video_encoder = video_encoder
        self.audio_encoder = audio_encoder
        self.audio_processor = audio_processor
        # The decoders and the vocoder: given, or built on first use from their factories (only the sanity check
        # and decoding use them, so an encoding process that never asks never holds them).
        self._decoders: dict[str, Any] = {"video_decoder": video_decoder, "audio_decoder": audio_decoder,
                                          "vocoder": vocoder}
        self._factories = dict(decoder_factories or {})
        self._decoders_lock = threading.Lock()
        self.text_encoder = text_encoder
        self.feature_extractor = feature_extractor
        self.text_encoder_path = text_encoder_path
        self.text_encoder_8bit = text_encoder_8bit
        self.scale = video_scale_factors(config)
        self.latent_channels: int = int(config.get("vae", {}).get("latent_channels", 128))

    @classmethod
    def load(
        cls,
        checkpoint: str | Path,
        text_encoder_path: str | Path | None = None,
        *,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.bfloat16,
        audio_dtype: torch.dtype = torch.float32,
        video: bool = True,
        audio: bool = True,
        text: bool = True,
        decoders: bool = False,
        text_encoder_8bit: bool = False,
    ) -> Ltx2Encoders:
        """Load the components asked for from an LTX-2 checkpoint and a Gemma folder.

        ``dtype`` is the video VAE's and Gemma's precision (the trainer: bf16);
        ``audio_dtype`` the audio VAE's (the trainer: float32). ``video=False``
        is the audio-only modes, ``audio=False`` is ``--skip-audio``;
        ``decoders`` adds the decoders for round-trip checks and ``diffprep
        decode``: the video VAE decoder, and with ``audio`` the audio VAE decoder
        and the vocoder (mel -> waveform), in ``audio_dtype``.
        """
        with family_imports(FAMILY):  # torchaudio checked first (ltx2_torchaudio), then ltx-core and transformers
            from ltx_core.loader import SingleGPUModelBuilder
            from ltx_core.model.audio_vae import (
                AUDIO_VAE_DECODER_COMFY_KEYS_FILTER,
                AUDIO_VAE_ENCODER_COMFY_KEYS_FILTER,
                VOCODER_COMFY_KEYS_FILTER,
                AudioDecoderConfigurator,
                AudioEncoderConfigurator,
                AudioProcessor,
                VocoderConfigurator,
            )
            from ltx_core.model.video_vae import (
                VAE_DECODER_COMFY_KEYS_FILTER,
                VAE_ENCODER_COMFY_KEYS_FILTER,
                VideoDecoderConfigurator,
                VideoEncoderConfigurator,
            )

        checkpoint = Path(checkpoint)
        config = read_checkpoint_config(checkpoint)
        device = torch.device(device)

        def build(configurator, sd_ops, what: str, build_dtype: torch.dtype) -> torch.nn.Module:
            module = SingleGPUModelBuilder(
                model_path=str(checkpoint), model_class_configurator=configurator, model_sd_ops=sd_ops
            ).build(device=device, dtype=build_dtype)
            return _ready(module, what, checkpoint)

        video_encoder = audio_encoder = audio_processor = None
        factories: dict[str, Callable[[], torch.nn.Module]] = {}
        if video:
            video_encoder = build(VideoEncoderConfigurator, VAE_ENCODER_COMFY_KEYS_FILTER, "video VAE encoder", dtype)
        if video and decoders:
            factories["video_decoder"] = lambda: build(VideoDecoderConfigurator, VAE_DECODER_COMFY_KEYS_FILTER,
                                                       "video VAE decoder", dtype)
        if audio:
            audio_encoder = build(
                AudioEncoderConfigurator, AUDIO_VAE_ENCODER_COMFY_KEYS_FILTER, "audio VAE encoder", audio_dtype
            )
            # The processor the trainer and ltx-core's encode_audio build from the encoder's own settings.
            audio_processor = AudioProcessor(
                target_sample_rate=audio_encoder.sample_rate,
                mel_bins=audio_encoder.mel_bins,
                mel_hop_length=audio_encoder.mel_hop_length,
                n_fft=audio_encoder.n_fft,
            ).to(device)
        if audio and decoders:
            factories["audio_decoder"] = lambda: build(AudioDecoderConfigurator, AUDIO_VAE_DECODER_COMFY_KEYS_FILTER,
                                                       "audio VAE decoder", audio_dtype)
            factories["vocoder"] = lambda: build(VocoderConfigurator, VOCODER_COMFY_KEYS_FILTER, "vocoder", audio_dtype)

        text_encoder = feature_extractor = None
        gemma_root = None
        if text:
            if text_encoder_path is None:
                raise ConfigError("text encoding needs the Gemma folder; pass text_encoder_path (--text-encoder-path)")
            gemma_root = Path(text_encoder_path)
            text_encoder = load_gemma(gemma_root, device=device, dtype=dtype, load_in_8bit=text_encoder_8bit)
            text_config = text_encoder.model.config.text_config
            feature_extractor = SingleGPUModelBuilder(
                model_path=str(checkpoint),
                model_class_configurator=feature_extractor_configurator(
                    text_config.hidden_size, text_config.num_hidden_layers
                ),
                model_sd_ops=feature_extractor_key_ops(),
            ).build(device=device, dtype=dtype)
            feature_extractor = _ready(feature_extractor, "Gemma feature extractor", checkpoint)

        return cls(
            checkpoint=checkpoint,
            config=config,
            device=device,
            dtype=dtype,
            audio_dtype=audio_dtype,
            video_encoder=video_encoder,
            audio_encoder=audio_encoder,
            audio_processor=audio_processor,
            decoder_factories=factories,
            text_encoder=text_encoder,
            feature_extractor=feature_extractor,
            text_encoder_path=gemma_root,
            text_encoder_8bit=text_encoder_8bit,
        )

    def _decoder(self, name: str) -> Any:
        with self._decoders_lock:
            if self._decoders[name] is None and name in self._factories:
                self._decoders[name] = self._factories.pop(name)()
            return self._decoders[name]

    @property
    def video_decoder(self) -> VideoDecoder | None:
        return self._decoder("video_decoder")

    @property
    def audio_decoder(self) -> AudioDecoder | None:
        return self._decoder("audio_decoder")

    @property
    def vocoder(self) -> Vocoder | None:
        return self._decoder("vocoder")

    def decoders_built(self) -> list[str]:
        """The decoders built so far (the others are built on first use, or not asked for)."""
        return [name for name, module in self._decoders.items() if module is not None]

    @property
    def separate_audio_text(self) -> bool:
        """Whether the feature extractor projects audio features of their own (V2, LTX-2.3); V1's are a copy."""
        return type(self.feature_extractor).__name__ == "FeatureExtractorV2"

    # Identity

    def describe(self) -> dict[str, Any]:
        """JSON-able identity for the config fingerprint (see :func:`describe_ltx2`)."""
        return describe_ltx2(
            self.checkpoint,
            self.text_encoder_path,
            dtype=self.dtype,
            audio_dtype=self.audio_dtype,
            video=self.video_encoder is not None,
            audio=self.audio_encoder is not None,
            text=self.text_encoder is not None,
            text_encoder_8bit=self.text_encoder_8bit,
        )

    # Video

    @torch.no_grad()
    def encode_video(self, pixels: torch.Tensor) -> torch.Tensor:
        """uint8 RGB ``[B, F, 3, H, W]`` -> normalized latents ``[B, C, 1+(F-1)/t, H/s, W/s]`` on the CPU in ``dtype``.

        The frames map to [-1, 1] as the trainer's (x / 255 - 0.5) / 0.5; ltx-core's
        ``VideoEncoder`` keeps the posterior mean and normalizes it per channel.
        """
        encoder = self._require(self.video_encoder, "video")
        self._check_pixels(pixels)
        video = pixels.permute(0, 2, 1, 3, 4).to(self.device, torch.float32)
        video = (video / 255.0 - 0.5) / 0.5
        latents = encoder(video.to(self.dtype))
        return latents.to("cpu")

    @torch.no_grad()
    def decode_video(self, latents: torch.Tensor, *, seed: int = 0) -> torch.Tensor:
        """Normalized latents ``[C, F', H', W']`` -> uint8 frames ``[F, H, W, 3]`` with ltx-core's ``decode_video``."""
        with family_imports(FAMILY):
            from ltx_core.model.video_vae import decode_video

        decoder = self._require(self.video_decoder, "video decoding (load with decoders=True)")
        if latents.ndim != 4 or latents.shape[0] != self.latent_channels:
            raise ValueError(f"latents must be [{self.latent_channels}, F', H', W'], got shape {list(latents.shape)}")
        generator = torch.Generator(device=self.device).manual_seed(seed)
        chunks = decode_video(latents[None].to(self.device, self.dtype), decoder, generator=generator)
        return torch.cat([chunk.to("cpu") for chunk in chunks])

    def _check_pixels(self, pixels: torch.Tensor) -> None:
        if pixels.dtype != torch.uint8:
            raise ValueError(f"pixels must be uint8, got {pixels.dtype}")
        if pixels.ndim != 5 or pixels.shape[2] != 3:
            raise ValueError(f"pixels must be [B, F, 3, H, W], got shape {list(pixels.shape)}")
        frames, height, width = pixels.shape[1], pixels.shape[3], pixels.shape[4]
        if (frames - 1) % self.scale.time:
            # ltx-core would silently drop the extra frames; the bucket should not have asked for them.
            raise ValueError(f"frame count must be {self.scale.time}k+1 (1, {1 + self.scale.time}, ...), got {frames}")
        if height % self.scale.space or width % self.scale.space:
            raise ValueError(f"height and width must be multiples of {self.scale.space}, got {height}x{width}")

    # Audio

    @torch.no_grad()
    def encode_audio(self, audio: ClipAudio) -> AudioLatents:
        """A clip's stereo waveform -> normalized audio latents ``[8, T, 16]`` (float32, CPU).

        As the trainer: ltx-core's ``AudioProcessor`` resamples to the checkpoint's
        rate and computes the log-mel spectrogram ``[1, 2, frames, mel_bins]``, then
        ``AudioEncoder`` (posterior mean, per-channel normalized) encodes it.
        ``duration`` is the waveform's length at its source rate.
        """
        with family_imports(FAMILY):
            from ltx_core.types import Audio

        encoder = self._require(self.audio_encoder, "audio")
        if audio.waveform.ndim != 2 or audio.waveform.shape[0] != 2:
            raise ValueError(f"audio.waveform must be stereo [2, samples], got shape {list(audio.waveform.shape)}")
        waveform = audio.waveform[None].to(self.device, self.audio_dtype)
        mel = self.audio_processor.waveform_to_mel(Audio(waveform=waveform, sampling_rate=audio.sample_rate))
        latents = encoder(mel.to(self.audio_dtype))
        return AudioLatents(latents=latents[0].to("cpu", AUDIO_LATENTS_DTYPE), duration=audio.duration)

    @torch.no_grad()
    def decode_audio(self, latents: torch.Tensor) -> ClipAudio:
        """Normalized audio latents ``[8, T, 16]`` -> stereo float32 waveform on the CPU at the vocoder's rate.

        ltx-core's ``decode_audio``: the audio VAE decoder gives the log-mel
        spectrogram ``[1, 2, frames, mel_bins]``, the vocoder the waveform (24 kHz for LTX-2).
        """
        with family_imports(FAMILY):
            from ltx_core.model.audio_vae import decode_audio

        decoder = self._require(self.audio_decoder, "audio decoding (load with audio=True, decoders=True)")
        if latents.ndim != 3:
            raise ValueError(f"audio latents must be [C, T, F] (one clip), got shape {list(latents.shape)}")
        audio = decode_audio(latents[None].to(self.device, self.audio_dtype), decoder, self.vocoder)
        waveform = audio.waveform.to("cpu", torch.float32).contiguous()
        return ClipAudio(waveform=waveform, sample_rate=int(audio.sampling_rate), source_channels=waveform.shape[0])

    @torch.no_grad()
    def log_mel(self, audio: ClipAudio) -> torch.Tensor:
        """A waveform's log-mel spectrogram ``[2, frames, mel_bins]`` as the audio encoder sees it (ltx-core's
        ``AudioProcessor``: resampled to the checkpoint's rate, natural log clamped at 1e-5)."""
        with family_imports(FAMILY):
            from ltx_core.types import Audio

        self._require(self.audio_processor, "audio")
        waveform = audio.waveform[None].to(self.device, torch.float32)
        mel = self.audio_processor.waveform_to_mel(Audio(waveform=waveform, sampling_rate=audio.sample_rate))
        return mel[0].to("cpu", torch.float32)

    # Text

    @torch.no_grad()
    def encode_text(self, captions: Sequence[str]) -> list[TextConditions]:
        """Captions -> Gemma features after the feature extractor, one caption at a time (as the trainer).

        ltx-core's tokenizer strips the caption, truncates it to 1024 tokens and
        left-pads it to 1024 with BOS first; ``GemmaTextEncoder.encode`` returns all
        hidden states and the mask, and the feature extractor normalizes and
        projects them (V1: audio is a copy of video; V2: separate projections).
        """
        text_encoder = self._require(self.text_encoder, "text")
        if isinstance(captions, str):
            raise TypeError("captions must be a sequence of strings, got a single string; wrap it in a list")
        results = []
        for position, caption in enumerate(captions):
            if not isinstance(caption, str):
                raise TypeError(f"captions[{position}] must be a string, got {type(caption).__name__}")
            hidden_states, mask = text_encoder.encode(caption, padding_side="left")
            video, audio = self.feature_extractor(hidden_states, mask, "left")
            truncated = len(text_encoder.tokenizer.tokenizer(caption.strip()).input_ids) > TEXT_MAX_LENGTH
            if truncated:
                logger.warning(
                    "Gemma: caption %d is longer than %d tokens and was truncated", position, TEXT_MAX_LENGTH
                )
            results.append(
                TextConditions(
                    video_prompt_embeds=video[0].to("cpu"),
                    audio_prompt_embeds=None if audio is None else audio[0].to("cpu"),
                    prompt_attention_mask=mask[0].to("cpu", MASK_DTYPE),
                    truncated=truncated,
                )
            )
        return results

    @staticmethod
    def _require(module, what: str):
        if module is None:
            raise ConfigError(f"{what} encoding was not loaded; load Ltx2Encoders with it enabled")
        return module


# --------------------------------------------------------------------------- loading helpers


def _ready(module: torch.nn.Module, what: str, checkpoint: Path) -> torch.nn.Module:
    """Refuse a module the builder left partly on the meta device (tensors missing from the checkpoint)."""
    missing = [name for name, tensor in [*module.named_parameters(), *module.named_buffers()] if tensor.is_meta]
    if missing:
        raise ConfigError(
            f"{checkpoint} lacks the {what}'s tensors ({len(missing)} missing, e.g. {missing[:3]}); "
            "pass a full LTX-2 checkpoint"
        )
    module.eval()
    module.requires_grad_(False)
    return module
