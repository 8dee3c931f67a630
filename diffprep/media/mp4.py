"""uint8 frames to an H.264 mp4 and back, byte for byte reproducible.

``mp4_bytes`` spells out every setting that shapes the bytes instead of
leaving it to FFmpeg's defaults: libx264 from the FFmpeg inside PyAV's wheel
(``av`` is pinned in pyproject.toml, and with it the x264 build), ``crf``,
``preset``, yuv420p tagged BT.601 limited range, constant frame rate (frame
``k`` at ``k / fps``), no metadata. Two x264 settings are there for
reproducibility, not quality:

- **one thread**: x264's output depends on its thread count (slices, frame
  threads), which "auto" takes from the machine's cores;
- **no macroblock tree** (``mbtree=0``): with it, the same frames gave other
  bytes from one call to the next within a process (3 variants in 8 calls on
  a 5-frame clip, whatever the thread count; memory left by an earlier decode
  changed them), so its lookahead reads memory it did not write. Without it:
  identical in every trial (benchmarks/README.md, video). It costs some bits
  at the same crf.

The RGB -> YUV 4:2:0 conversion is done here in integer arithmetic, and every
byte of the encoder's input picture (row padding too) is written, so nothing
of swscale's CPU-dependent code or of uninitialized memory reaches the encoder.

With ``audio`` (``diffprep decode`` of an LTX-2 dataset: the decoded sound) the
mp4 gets an AAC-LC track at a fixed bit rate (``AAC``), from FFmpeg's own AAC
encoder in the same pinned wheel: the same waveform gives the same bytes.

``mp4_frames`` reads one back as uint8 RGB ``[F, 3, H, W]``.
"""

from __future__ import annotations

import io
from fractions import Fraction

import av
import numpy as np
import torch

from diffprep.media.audio import ClipAudio, add_audio_stream, mux_audio

__all__ = ["AAC", "X264", "mp4_bytes", "mp4_frames", "yuv420p_planes"]

# What the encoder is told (a raw video plan fingerprints it with the crf).
X264 = {"codec": "libx264", "pix_fmt": "yuv420p", "preset": "medium", "threads": 1, "x264-params": "mbtree=0",
        "colorspace": "bt601-limited"}
# The sound track, when there is one: stereo AAC-LC at 128 kb/s (the waveform clipped to [-1, 1]).
AAC = {"codec": "aac", "bit_rate": 128_000, "layout": "stereo"}


def yuv420p_planes(frame: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """uint8 RGB ``[H, W, 3]`` (even H and W) -> uint8 Y ``[H, W]``, U and V ``[H/2, W/2]``.

    BT.601 limited range with 8-bit fixed-point coefficients (``Y = ((66 R +
    129 G + 25 B + 128) >> 8) + 16``...), the matrix FFmpeg assumes for an
    untagged clip; each chroma sample is the rounded mean of its 2x2 block.
    """
    rgb = frame.astype(np.int32)
    r, g, b = rgb[..., 0], rgb[..., 1], rgb[..., 2]
    height, width = r.shape

    def half(plane: np.ndarray) -> np.ndarray:
        return (plane.reshape(height // 2, 2, width // 2, 2).sum(axis=(1, 3)) + 2) >> 2

    y = ((66 * r + 129 * g + 25 * b + 128) >> 8) + 16
    u = half(((-38 * r - 74 * g + 112 * b + 128) >> 8) + 128)
    v = half(((112 * r - 94 * g - 18 * b + 128) >> 8) + 128)
    return tuple(np.clip(p, 0, 255).astype(np.uint8) for p in (y, u, v))


def mp4_bytes(frames: torch.Tensor, fps: float = 16.0, *, crf: int = 18, audio: ClipAudio | None = None) -> bytes:
    """uint8 RGB ``[F, 3, H, W]`` (even H and W) -> an H.264 mp4 playing at ``fps``; same input, same bytes.

    ``crf`` 0..51 (x264's constant quality; 18 looks lossless to most eyes, 0 is lossless in Y'CbCr).
    ``audio``: a stereo waveform, muxed as the clip's AAC track.
    """
    if audio is not None and audio.waveform.shape[0] != 2:
        raise ValueError(f"audio must be stereo [2, samples], got shape {list(audio.waveform.shape)}")
    if frames.dtype != torch.uint8 or frames.ndim != 4 or frames.shape[1] != 3:
        raise ValueError(f"frames must be uint8 [F, 3, H, W], got {frames.dtype} {list(frames.shape)}")
    count, _, height, width = (int(v) for v in frames.shape)
    if count < 1 or height % 2 or width % 2:
        raise ValueError(f"an H.264 4:2:0 clip needs a frame or more and even sides, got {width}x{height}x{count}")
    if not 0 <= crf <= 51:
        raise ValueError(f"crf must be in 0..51, got {crf}")
    if not fps > 0:
        raise ValueError(f"fps must be > 0, got {fps}")
    rate = Fraction(str(fps)).limit_denominator(1001)
    buffer = io.BytesIO()
    with av.open(buffer, "w", format="mp4") as container:
        stream = container.add_stream(X264["codec"], rate=rate, options={
            "crf": str(crf), "preset": X264["preset"], "threads": str(X264["threads"]),
            "x264-params": X264["x264-params"]})
        stream.height, stream.width, stream.pix_fmt = height, width, X264["pix_fmt"]
        context = stream.codec_context
        context.time_base = 1 / rate
        context.colorspace = context.color_primaries = context.color_trc = 6  # SMPTE 170M (BT.601)
        context.color_range = 1  # limited ("tv") range
        sound = None if audio is None else add_audio_stream(container, audio.sample_rate, layout=AAC["layout"],
                                                            codec=AAC["codec"], bit_rate=AAC["bit_rate"])
        for index, frame in enumerate(frames.permute(0, 2, 3, 1).contiguous().numpy()):
            picture = av.VideoFrame(width, height, X264["pix_fmt"])
            for plane, values in zip(picture.planes, yuv420p_planes(frame)):
                rows = np.frombuffer(plane, dtype=np.uint8).reshape(-1, plane.line_size)
                rows[:] = 0  # the padding at the end of each row too: no uninitialized byte reaches x264
                rows[: values.shape[0], : values.shape[1]] = values
            picture.pts = index
            container.mux(stream.encode(picture))
        container.mux(stream.encode())
        if sound is not None:
            mux_audio(container, sound, audio.waveform.clamp(-1.0, 1.0).numpy())
    return buffer.getvalue()


def mp4_frames(data: bytes) -> torch.Tensor:
    """An mp4's video frames as uint8 RGB ``[F, 3, H, W]`` (FFmpeg's decoder and YUV -> RGB conversion)."""
    with av.open(io.BytesIO(data), mode="r") as container:
        stream = container.streams.video[0]
        frames = [frame.to_ndarray(format="rgb24") for frame in container.decode(stream)]
    if not frames:
        raise ValueError("the mp4 holds no decodable video frame")
    return torch.from_numpy(np.stack(frames)).permute(0, 3, 1, 2).contiguous()
