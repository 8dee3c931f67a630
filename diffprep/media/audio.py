"""A clip's audio track as the LTX-2 trainer feeds it to its audio encoder, decoded with PyAV.

Stereo float32 at the source rate (mono duplicated, 5.1/7.1 folded down),
trimmed or zero-padded to the clip's duration; a clip that should have audio
and has no audio stream, or whose audio does not decode, is a named reject.
``check_audio_backend`` is the sanity check's test tone.

Audio-only runs (T2A): ``AudioSpec`` puts a file in the longest duration
bucket not longer than its decoded audio and trims it to that, as the trainer's
``--audio-durations``; a file shorter than every bucket is ``too_short_audio``.
Writing sound back: ``mux_audio`` (the AAC track of ``diffprep decode``'s mp4s),
``wav_bytes``.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from diffprep.errors import RejectError

# Reject reasons (counted in the audit).
REJECT_NO_AUDIO_STREAM = "no_audio_stream"
REJECT_AUDIO_DECODE_ERROR = "audio_decode_error"
REJECT_TOO_SHORT_AUDIO = "too_short_audio"

# ITU-R BS.775 fold-down of 5.1 / 7.1 to stereo (FFmpeg's default channel order:
# FL FR FC LFE BL BR [SL SR]); the LFE channel is dropped.
_CENTER_GAIN = 1.0 / math.sqrt(2.0)
_SURROUND_GAIN = 1.0 / math.sqrt(2.0)


# --------------------------------------------------------------------------- audio from a clip


@dataclass(frozen=True)
class ClipAudio:
    """A clip's audio track as the trainer feeds it to the encoder: stereo float32 at the source rate."""

    waveform: torch.Tensor  # [2, samples], float32
    sample_rate: int
    source_channels: int

    @property
    def duration(self) -> float:
        return self.waveform.shape[-1] / self.sample_rate


PRE_ROLL = 0.25  # seconds decoded before a window's start and dropped (load_clip_audio's start)


def load_clip_audio(source: str | Path | io.BytesIO, *, duration: float | None = None, key: str = "",
                    start: float = 0.0) -> ClipAudio:
    """Decode a clip's audio with PyAV (FFmpeg's best audio stream): stereo, at its own rate, fitted to ``duration``.

    Channels: mono is duplicated, stereo kept, 5.1 and 7.1 folded down to stereo
    (ITU-R BS.775, LFE dropped); other layouts are a decode error. ``duration``
    (seconds; the trainer uses frames / fps of the encoded video) trims the
    waveform to ``int(duration * rate)`` samples or pads it with zeros, as the
    trainer does. Resampling to the checkpoint's rate is left to ltx-core's
    ``AudioProcessor``, as in the trainer. ``start`` (seconds after the stream's first sample; a long video's
    window, ``--split-scenes``): the decoder seeks there and the samples before it are dropped, so a window
    gets the sound of its own frames, as the trainer's clip cut at that shot would have.

    Raises ``RejectError`` ``no_audio_stream`` when the file has no audio stream
    and ``audio_decode_error`` when it has one that does not decode; ``key``
    names the sample in the message.
    """
    import av

    # A file in memory has no name of its own: the reject is recorded under its sample's id.
    name = key or ("the file" if isinstance(source, io.BytesIO) else str(source))
    try:
        container = av.open(source if isinstance(source, io.BytesIO) else str(source))
    except (av.error.FFmpegError, OSError) as error:
        raise RejectError(REJECT_AUDIO_DECODE_ERROR, f"{name}: cannot open the file: {error}") from None
    with container:
        if not container.streams.audio:
            raise RejectError(REJECT_NO_AUDIO_STREAM, f"{name} has no audio stream")
        # FFmpeg's own choice among several audio streams (av_find_best_stream), as torchaudio.load makes it.
        stream = container.streams.best("audio")
        # Planar float32 at the stream's own rate and layout: one row per channel.
        resampler = av.AudioResampler(format="fltp")
        chunks: list[np.ndarray] = []
        sample_rate = stream.codec_context.sample_rate or stream.rate
        # Only the audio that is kept is decoded: up to the duration's samples (the rest would be trimmed).
        wanted = int(duration * sample_rate) if duration is not None and sample_rate else None
        have = 0
        skip = round(start * sample_rate) if start > 0 and sample_rate else 0  # samples before the window
        try:
            if skip:
                origin = stream.start_time if stream.start_time is not None else 0
                # backward, PRE_ROLL early: a decoder that starts at a seek point reconstructs its first frame
                # only in part (AAC's overlapped transform); the samples before the start are dropped by timestamp.
                at = max(0.0, start - PRE_ROLL)
                container.seek(origin + int(at / stream.time_base), stream=stream, backward=True)
            first = None
            for frame in container.decode(stream):
                if skip and first is None:
                    at = 0 if frame.pts is None else round((frame.pts - origin) * stream.time_base * sample_rate)
                    skip, first = max(0, skip - at), at
                for converted in resampler.resample(frame):
                    chunk = converted.to_ndarray()
                    if skip:
                        dropped = min(skip, chunk.shape[-1])
                        chunk, skip = chunk[..., dropped:], skip - dropped
                    chunks.append(chunk)
                    have += chunks[-1].shape[-1]
                if wanted is not None and have >= wanted:
                    break
            else:
                for converted in resampler.resample(None):
                    chunks.append(converted.to_ndarray())
        except (av.error.FFmpegError, ValueError) as error:
            raise RejectError(REJECT_AUDIO_DECODE_ERROR, f"{name}: audio stream does not decode: {error}") from None
    if not chunks or sum(chunk.shape[-1] for chunk in chunks) == 0:
        raise RejectError(REJECT_AUDIO_DECODE_ERROR, f"{name}: the audio stream decoded to no samples")
    if not sample_rate:
        raise RejectError(REJECT_AUDIO_DECODE_ERROR, f"{name}: the audio stream has no sample rate")
    waveform = torch.from_numpy(np.concatenate(chunks, axis=-1).astype(np.float32, copy=False))
    source_channels = waveform.shape[0]
    try:
        stereo = to_stereo(waveform)
    except ValueError as error:
        raise RejectError(REJECT_AUDIO_DECODE_ERROR, f"{name}: {error}") from None
    if duration is not None:
        stereo = fit_duration(stereo, sample_rate, duration)
    return ClipAudio(waveform=stereo.contiguous(), sample_rate=int(sample_rate), source_channels=source_channels)


def to_stereo(waveform: torch.Tensor) -> torch.Tensor:
    """``[channels, samples]`` -> ``[2, samples]``: mono duplicated, 5.1/7.1 folded down, stereo unchanged."""
    channels = waveform.shape[0]
    if channels == 2:
        return waveform
    if channels == 1:
        return waveform.expand(2, -1).clone()
    if channels in (6, 8):
        front_left, front_right, center = waveform[0], waveform[1], waveform[2]
        left = front_left + _CENTER_GAIN * center + _SURROUND_GAIN * waveform[4]
        right = front_right + _CENTER_GAIN * center + _SURROUND_GAIN * waveform[5]
        if channels == 8:
            left = left + _SURROUND_GAIN * waveform[6]
            right = right + _SURROUND_GAIN * waveform[7]
        return torch.stack([left, right])
    raise ValueError(f"{channels}-channel audio is not supported; expected mono, stereo, 5.1 or 7.1")


def fit_duration(waveform: torch.Tensor, sample_rate: int, duration: float) -> torch.Tensor:
    """Trim or zero-pad ``[channels, samples]`` to ``int(duration * sample_rate)`` samples (the trainer's rule)."""
    if duration <= 0:
        raise ValueError(f"duration must be > 0 seconds, got {duration}")
    target = int(duration * sample_rate)
    current = waveform.shape[-1]
    if current > target:
        return waveform[..., :target]
    if current < target:
        return torch.nn.functional.pad(waveform, (0, target - current))
    return waveform


def write_test_tone(
    target: str | Path | io.BytesIO,
    *,
    seconds: float = 1.0,
    sample_rate: int = 48000,
    frequency: float = 440.0,
    layout: str = "stereo",
    codec: str = "aac",
    container_format: str = "mp4",
) -> np.ndarray:
    """Write a sine tone as an audio-only file (AAC in MP4 by default) and return the samples written [channels, n]."""
    import av

    channels = av.AudioLayout(layout).nb_channels
    count = int(seconds * sample_rate)
    time = np.arange(count, dtype=np.float32) / sample_rate
    tone = (0.5 * np.sin(2 * np.pi * frequency * time)).astype(np.float32)
    samples = np.stack([tone * (1.0 - 0.1 * channel) for channel in range(channels)])
    with av.open(target if isinstance(target, io.BytesIO) else str(target), mode="w", format=container_format) as out:
        mux_audio(out, add_audio_stream(out, sample_rate, layout=layout, codec=codec), samples)
    return samples


def add_audio_stream(container, sample_rate: int, *, layout: str = "stereo", codec: str = "aac",
                     bit_rate: int | None = None):
    """An audio stream of an open PyAV output ``container`` (add every stream before muxing any packet)."""
    stream = container.add_stream(codec, rate=sample_rate, layout=layout)
    if bit_rate is not None:
        stream.bit_rate = bit_rate
    return stream


def mux_audio(container, stream, samples: np.ndarray) -> None:
    """Encode float samples ``[channels, n]`` (planar, in [-1, 1]) into ``stream`` of ``container``, in
    1024-sample frames (AAC's frame size) with timestamps counted in samples, then flush it."""
    import av

    rate, layout = stream.codec_context.sample_rate, stream.codec_context.layout.name
    frame_size = 1024
    for start in range(0, samples.shape[-1], frame_size):
        frame = av.AudioFrame.from_ndarray(
            np.ascontiguousarray(samples[:, start : start + frame_size], dtype=np.float32), format="fltp", layout=layout
        )
        frame.sample_rate = rate
        frame.pts = start
        for packet in stream.encode(frame):
            container.mux(packet)
    for packet in stream.encode(None):
        container.mux(packet)


def check_audio_backend(*, tolerance: float = 0.05) -> None:
    """Sanity check: encode a 440 Hz AAC test tone in memory and decode it back through ``load_clip_audio``.

    Raises ``RuntimeError`` naming what failed when the audio backend cannot
    decode it (the trainer's failure mode: audio silently missing from a whole
    run). Run it before an audio run starts.
    """
    buffer = io.BytesIO()
    try:
        written = write_test_tone(buffer, seconds=1.0)
    except Exception as error:  # noqa: BLE001 - any encoder failure means the backend is unusable
        raise RuntimeError(f"the audio backend (PyAV) cannot write an AAC test tone: {error}") from error
    buffer.seek(0)
    try:
        decoded = load_clip_audio(buffer, key="audio-backend-test-tone")
    except RejectError as error:
        raise RuntimeError(
            f"the audio backend (PyAV) cannot decode an AAC test tone ({error}); "
            "audio latents would be missing from every clip: reinstall `av` and check `python -c 'import av'`"
        ) from error
    # AAC adds priming samples and loses a little; compare the tone's level, not sample by sample.
    expected_rms = float(np.sqrt(np.mean(written[0] ** 2)))
    got_rms = float(decoded.waveform[0].pow(2).mean().sqrt())
    if decoded.sample_rate != 48000 or abs(got_rms - expected_rms) > tolerance * 10 * expected_rms:
        raise RuntimeError(
            f"the audio backend decoded the test tone wrongly: rate {decoded.sample_rate} Hz (expected 48000), "
            f"RMS {got_rms:.4f} (expected {expected_rms:.4f})"
        )




# --------------------------------------------------------------------------- audio-only runs (T2A)


def parse_durations(text: str) -> tuple[float, ...]:
    """``"2.0;4.0"`` -> the duration buckets in seconds, sorted; each > 0, no repeats (a ``ValueError`` says which)."""
    values = []
    for part in (p.strip() for p in str(text).split(";")):
        try:
            value = float(part)
        except ValueError:
            raise ValueError(f"--audio-durations: {part!r} is not a number of seconds (e.g. \"2.0;4.0\")") from None
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"--audio-durations: {part!r} must be a number of seconds > 0")
        values.append(value)
    if len(set(values)) != len(values):
        raise ValueError(f"--audio-durations {text!r} repeats a duration")
    return tuple(sorted(values))


def duration_name(seconds: float) -> str:
    """A duration bucket's name in plan.json and meta.json: ``2s``, ``2.5s``."""
    return f"{seconds:g}s"


@dataclass(frozen=True)
class PreparedAudio:
    """One audio-only sample: its waveform trimmed to its duration bucket; no frames (``pixels`` is empty)."""

    audio: ClipAudio
    seconds: float  # the duration bucket
    meta: dict[str, Any]
    pixels: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.uint8))
    reference: None = None
    reference_audio: ClipAudio | None = None  # A2A IC-LoRA (AudioSpec.inputs, media/clip_inputs.py)
    audio_mask: torch.Tensor | None = None  # audio inpainting: the mask's 1-D signal (AudioSpec.inputs)


@dataclass(frozen=True)
class AudioSpec:
    """How an audio-only run prepares a sample: the duration buckets (seconds) a file is trimmed to."""

    durations: tuple[float, ...]
    audio: bool = True  # the reader hands each sample's waveform to the encoder
    inputs: tuple[str, ...] = ()  # its other inputs read (media/clip_inputs.py): reference_audio, audio_mask

    def bucket_of(self, data: bytes) -> float:
        """The longest duration bucket not longer than the file's decoded audio (the trainer's rule)."""
        return self._fit(load_clip_audio(io.BytesIO(data)))

    def prepare(self, data: bytes, *, bucket: float | None = None) -> PreparedAudio:
        """The file's audio at its own rate, stereo, trimmed to ``bucket`` (the plan's) or to its own bucket."""
        full = load_clip_audio(io.BytesIO(data))
        seconds = self._fit(full) if bucket is None else bucket
        if full.duration < seconds:
            raise RejectError(REJECT_TOO_SHORT_AUDIO, f"the audio is {full.duration:.3f} s, its bucket "
                              f"{duration_name(seconds)} (the file changed since planning)")
        audio = ClipAudio(fit_duration(full.waveform, full.sample_rate, seconds).contiguous(), full.sample_rate,
                          full.source_channels)
        meta = {"audio": {"sample_rate": full.sample_rate, "source_channels": full.source_channels,
                          "source_duration": round(full.duration, 6), "duration": audio.duration},
                "bucket": duration_name(seconds)}
        return PreparedAudio(audio=audio, seconds=seconds, meta=meta)

    def _fit(self, audio: ClipAudio) -> float:
        fitting = [d for d in self.durations if d <= audio.duration]
        if not fitting:
            raise RejectError(REJECT_TOO_SHORT_AUDIO, f"the audio is {audio.duration:.3f} s, shorter than every "
                              f"duration bucket (the shortest is {duration_name(min(self.durations))})")
        return max(fitting)


def wav_bytes(audio: ClipAudio) -> bytes:
    """A waveform as a 16-bit PCM WAV file (clipped to [-1, 1]): lossless, for listening to a decoded sample."""
    import av

    buffer = io.BytesIO()
    layout = "stereo" if audio.waveform.shape[0] == 2 else "mono"
    with av.open(buffer, mode="w", format="wav") as out:
        mux_audio(out, add_audio_stream(out, audio.sample_rate, layout=layout, codec="pcm_s16le"),
                  audio.waveform.clamp(-1.0, 1.0).numpy())
    return buffer.getvalue()
