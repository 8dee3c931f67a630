"""Video probing and decoding with PyAV, on real files the tests write with PyAV itself.

Each clip has frame ``i`` filled with red = 20 * i (and a green 8x8 marker in
the top-left corner), so the tests can tell which source frame an output
frame came from after lossy compression.
"""

from __future__ import annotations

import io
import time
from fractions import Fraction

import av
import numpy as np
import pytest
import torch
from PIL import Image

from diffprep.errors import RejectError
from diffprep.media.buckets import Bucket
from diffprep.media.video import cover_box, prepare_clip, prepare_image_clip, probe, sample_indices

REASONS = {"empty_file", "video_decode_error", "no_video_stream", "video_too_large", "video_no_timestamps",
           "video_truncated", "too_few_frames"}  # fmt: skip


def write_clip(
    fmt: str = "mp4",
    codec: str = "libx264",
    audio: str | None = "aac",
    *,
    frames: int = 12,
    fps: int = 24,
    size: tuple[int, int] = (64, 48),
    gaps_ms: list[int] | None = None,
    rotation: int | None = None,
) -> bytes:
    """A clip of ``frames`` frames; ``gaps_ms`` (cycled) makes it variable-rate with those frame intervals."""
    width, height = size
    buffer = io.BytesIO()
    with av.open(buffer, "w", format=fmt) as container:
        stream = container.add_stream(codec, rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        if gaps_ms is not None:
            stream.codec_context.time_base = stream.time_base = Fraction(1, 1000)
        if rotation is not None:
            stream.set_display_rotation(rotation)
        sound = container.add_stream(audio, rate=48000, layout="mono") if audio else None
        clock = 0
        for i in range(frames):
            pixels = np.zeros((height, width, 3), np.uint8)
            pixels[..., 0] = 20 * i % 256
            pixels[:8, :8, 1] = 255
            frame = av.VideoFrame.from_ndarray(pixels, format="rgb24")
            if gaps_ms is not None:
                frame.pts, frame.time_base = clock, Fraction(1, 1000)
                clock += gaps_ms[i % len(gaps_ms)]
            container.mux(stream.encode(frame))
        container.mux(stream.encode())
        if sound is not None:
            tone = np.sin(np.arange(24000, dtype=np.float32) / 10)[None]
            chunk = av.AudioFrame.from_ndarray(tone, format="fltp", layout="mono")
            chunk.sample_rate = 48000
            container.mux(sound.encode(chunk))
            container.mux(sound.encode())
    return buffer.getvalue()


def write_audio_only() -> bytes:
    buffer = io.BytesIO()
    with av.open(buffer, "w", format="mp4") as container:
        sound = container.add_stream("aac", rate=48000)
        chunk = av.AudioFrame.from_ndarray(np.zeros((1, 4800), np.float32), format="fltp", layout="mono")
        chunk.sample_rate = 48000
        container.mux(sound.encode(chunk))
        container.mux(sound.encode())
    return buffer.getvalue()


def red_levels(pixels) -> list[int]:
    """Mean red of each frame [F, 3, H, W], as the source frame index it encodes (red = 20 * i)."""
    return [round(float(frame[0].float().mean()) / 20) for frame in pixels]


@pytest.fixture(scope="module")
def mp4() -> bytes:
    return write_clip()


BUCKETS = [Bucket(32, 32, 9), Bucket(64, 32, 5)]


def test_probe_mp4_with_audio(mp4):
    info = probe(mp4)
    assert (info.codec, info.width, info.height, info.frames, info.fps) == ("h264", 64, 48, 12, 24.0)
    assert info.frame_times == tuple(Fraction(i, 24) for i in range(12))
    assert info.end_time == Fraction(12, 24) and not info.variable_frame_rate
    assert (info.has_audio, info.audio_codec, info.audio_sample_rate, info.audio_channels) == (True, "aac", 48000, 1)


def test_head_frames_cover_resized_and_centre_cropped(mp4, tmp_path):
    start = time.perf_counter()
    clip = prepare_clip(mp4, BUCKETS)
    elapsed = time.perf_counter() - start
    print(f"decode of a 12-frame 64x48 H.264 clip into 32x32x9: {elapsed * 1000:.1f} ms")
    assert clip.bucket == Bucket(32, 32, 9)  # 4:3 is nearer 1:1 than 2:1
    assert clip.pixels.shape == (9, 3, 32, 32) and clip.pixels.dtype == torch.uint8
    assert red_levels(clip.pixels) == list(range(9))
    meta = clip.meta
    assert meta["frame_indices"] == list(range(9)) and meta["frame_sampling"] == "head"
    assert meta["frame_times"] == [round(i / 24, 6) for i in range(9)]
    assert meta["bucket"] == [32, 32, 9] and meta["crop_box"] == [8, 0, 56, 48]
    assert (meta["source_fps"], meta["source_frames"], meta["has_audio"]) == (24.0, 12, True)
    assert meta["fps"] == 24.0  # the kept frames play at the source's rate
    # A path gives the same pixels as the bytes.
    path = tmp_path / "clip.mp4"
    path.write_bytes(mp4)
    assert prepare_clip(path, BUCKETS).pixels.equal(clip.pixels)


def test_uniform_sampling_spreads_over_the_clip(mp4):
    clip = prepare_clip(mp4, BUCKETS, frame_sampling="uniform")
    assert clip.meta["frame_indices"] == [0, 1, 3, 4, 6, 7, 8, 10, 11]
    assert clip.meta["fps"] == round(24 * 8 / 11, 6)  # 9 frames spread over 12: real speed at a lower rate
    assert red_levels(clip.pixels) == clip.meta["frame_indices"]
    assert sample_indices(12, 1, "uniform") == [0]
    assert sample_indices(5, 5, "uniform") == [0, 1, 2, 3, 4]


def test_target_fps_resamples_by_timestamp(mp4):
    clip = prepare_clip(mp4, [Bucket(64, 32, 5)], target_fps=12)
    assert clip.meta["frame_indices"] == [0, 2, 4, 6, 8] and clip.meta["fps"] == 12
    assert red_levels(clip.pixels) == [0, 2, 4, 6, 8]
    # 12 frames at 24 fps last 0.5 s: 6 frames at 12 fps, fewer than 9, so the 9-frame bucket is out.
    assert prepare_clip(mp4, BUCKETS, target_fps=12).bucket == Bucket(64, 32, 5)
    # Upsampling repeats frames: at 48 fps each source frame is shown twice.
    up = prepare_clip(mp4, [Bucket(32, 32, 9)], target_fps=48)
    assert up.meta["frame_indices"] == [0, 0, 1, 1, 2, 2, 3, 3, 4]


def test_variable_frame_rate_timestamps_and_resampling():
    vfr = write_clip(audio=None, frames=10, gaps_ms=[20, 40])
    info = probe(vfr)
    assert info.variable_frame_rate and info.frames == 10
    assert info.frame_times == tuple(Fraction(t, 1000) for t in (0, 20, 60, 80, 120, 140, 180, 200, 240, 260))
    # At 50 fps (every 20 ms) the frame on screen at 0, 20, 40, 60... ms: the 40 ms gaps hold a frame twice.
    clip = prepare_clip(vfr, [Bucket(32, 32, 9)], target_fps=50)
    assert clip.meta["frame_indices"] == [0, 1, 1, 2, 3, 3, 4, 5, 5]
    assert red_levels(clip.pixels) == clip.meta["frame_indices"]
    assert clip.meta["variable_frame_rate"] is True
    # Without target_fps the source frames are kept as they are.
    assert prepare_clip(vfr, [Bucket(32, 32, 9)]).meta["frame_indices"] == list(range(9))


@pytest.mark.parametrize("codec, audio, name", [("libvpx-vp9", "libopus", "vp9"), ("libvpx", None, "vp8")])
def test_webm(codec, audio, name):
    webm = write_clip("webm", codec, audio, frames=9, size=(32, 64))
    info = probe(webm)
    assert (info.codec, info.frames, info.has_audio, info.width, info.height) == (name, 9, audio is not None, 32, 64)
    clip = prepare_clip(webm, [Bucket(32, 64, 9), Bucket(32, 32, 9)])
    assert clip.bucket == Bucket(32, 64, 9) and clip.pixels.shape == (9, 3, 64, 32)
    assert red_levels(clip.pixels) == list(range(9))


def test_rotation_from_the_container_is_applied():
    rotated = write_clip(audio=None, frames=5, size=(64, 32), rotation=90)
    info = probe(rotated)
    assert (info.rotation, info.width, info.height) == (90, 32, 64)
    clip = prepare_clip(rotated, [Bucket(32, 64, 5)])
    # 90 degrees counter-clockwise: the top-left marker ends bottom-left.
    green = clip.pixels[0, 1].float()
    assert green[-8:, :8].mean() > 200 and green[:8, :8].mean() < 50


def test_too_few_frames_names_the_count_and_the_smallest_bucket(mp4):
    with pytest.raises(RejectError) as info:
        prepare_clip(mp4, [Bucket(32, 32, 13), Bucket(32, 32, 17)])
    assert info.value.reason == "too_few_frames"
    assert "12 frames" in info.value.detail and "32x32x13" in info.value.detail


def test_empty_file(tmp_path):
    with pytest.raises(RejectError) as info:
        prepare_clip(b"", BUCKETS)
    assert info.value.reason == "empty_file"
    empty = tmp_path / "empty.mp4"
    empty.write_bytes(b"")
    with pytest.raises(RejectError, match="empty_file"):
        probe(empty)


def test_audio_only_file_is_no_video_stream():
    with pytest.raises(RejectError) as info:
        prepare_clip(write_audio_only(), BUCKETS)
    assert info.value.reason == "no_video_stream" and "audio (aac)" in info.value.detail


def test_random_bytes_are_a_decode_error():
    noise = np.random.default_rng(0).integers(0, 256, 5000, dtype=np.uint8).tobytes()
    with pytest.raises(RejectError) as info:
        prepare_clip(noise, BUCKETS)
    assert info.value.reason == "video_decode_error"
    assert "0x" not in info.value.detail  # no memory address: rejects read the same every run


def test_truncated_mp4_is_rejected(mp4):
    # PyAV writes the index (moov) at the end: without it nothing can be decoded.
    with pytest.raises(RejectError) as info:
        prepare_clip(mp4[: len(mp4) // 2], BUCKETS)
    assert info.value.reason == "video_decode_error"


@pytest.mark.parametrize("cut", [0.3, 0.6, 0.9])
def test_truncated_webm_is_a_reject_or_a_shorter_clip(cut):
    webm = write_clip("webm", "libvpx", None, frames=12, size=(64, 64))
    part = webm[: int(len(webm) * cut)]
    try:
        clip = prepare_clip(part, [Bucket(32, 32, 1)])
    except RejectError as reject:
        assert reject.reason in REASONS
    else:
        assert clip.pixels.shape == (1, 3, 32, 32) and 1 <= clip.info.frames < 12


@pytest.mark.parametrize("seed", range(6))
def test_damaged_bytes_inside_a_clip_never_crash(mp4, seed):
    rng = np.random.default_rng(seed)
    data = bytearray(mp4)
    start = int(rng.integers(0, len(data) - 200))
    data[start : start + 200] = rng.integers(0, 256, 200, dtype=np.uint8).tobytes()
    try:
        clip = prepare_clip(bytes(data), BUCKETS)
    except RejectError as reject:
        assert reject.reason in REASONS
    else:
        assert clip.pixels.shape[1:] == (3, 32, 32) or clip.pixels.shape[1:] == (3, 32, 64)


def test_too_large_is_refused_before_decoding(mp4):
    with pytest.raises(RejectError) as info:
        prepare_clip(mp4, BUCKETS, max_pixels=1000)
    assert info.value.reason == "video_too_large" and "64x48" in info.value.detail


def test_image_as_a_one_frame_clip():
    buffer = io.BytesIO()
    Image.new("RGB", (80, 40), (200, 10, 10)).save(buffer, format="PNG")
    clip = prepare_image_clip(buffer.getvalue(), [Bucket(32, 32, 9), Bucket(64, 32, 1)])
    assert clip.bucket == Bucket(64, 32, 1) and clip.pixels.shape == (1, 3, 32, 64)
    assert clip.meta["crop_box"] == [0, 0, 80, 40]
    assert int(clip.pixels[0, 0].float().mean().round()) == 200
    with pytest.raises(RejectError, match="too_few_frames"):
        prepare_image_clip(buffer.getvalue(), [Bucket(32, 32, 9)])


def test_cover_box_is_centred_and_keeps_the_bucket_aspect():
    assert cover_box(1920, 1080, Bucket(64, 64, 1)) == (420, 0, 1500, 1080)
    assert cover_box(1080, 1920, Bucket(64, 32, 1)) == (0, 690, 1080, 1230)
    assert cover_box(64, 32, Bucket(64, 32, 1)) == (0, 0, 64, 32)
