"""A clip's audio track as the LTX-2 trainer reads it, decoded with PyAV alone (no ltx-core): channels, duration,
the named rejects and the audio backend's test tone. Real AAC files written here."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch

from diffprep.demo import write_av_clip
from diffprep.errors import RejectError
from diffprep.media import audio as clip_audio

FPS = 24
FRAMES = 9


def test_short_audio_is_padded_and_channels_fold_down():
    audio = torch.ones(1, 100)
    assert clip_audio.fit_duration(audio, 100, 1.5).shape == (1, 150)
    assert clip_audio.fit_duration(audio, 100, 0.5).shape == (1, 50)
    assert clip_audio.fit_duration(audio, 100, 1.5)[0, 100:].abs().sum() == 0

    fl, fr, fc, lfe, bl, br = (torch.full((1, 4), v) for v in (1.0, 2.0, 4.0, 100.0, 8.0, 16.0))
    stereo = clip_audio.to_stereo(torch.cat([fl, fr, fc, lfe, bl, br]))
    g = 1 / np.sqrt(2)
    torch.testing.assert_close(stereo[:, 0], torch.tensor([1 + g * 4 + g * 8, 2 + g * 4 + g * 16], dtype=torch.float32))
    assert clip_audio.to_stereo(torch.zeros(8, 3)).shape == (2, 3)
    with pytest.raises(ValueError, match="3-channel"):
        clip_audio.to_stereo(torch.zeros(3, 3))


def test_clip_without_audio_is_rejected(tmp_path):
    clip = tmp_path / "silent.mp4"
    write_av_clip(clip, frames=FRAMES, fps=FPS, audio_layout=None)
    with pytest.raises(RejectError) as caught:
        clip_audio.load_clip_audio(clip, duration=FRAMES / FPS, key="000000_000001")
    assert caught.value.reason == clip_audio.REJECT_NO_AUDIO_STREAM == "no_audio_stream"
    assert "000000_000001" in str(caught.value)


def test_audio_that_does_not_decode_is_rejected(tmp_path):
    buffer = io.BytesIO()
    clip_audio.write_test_tone(buffer, seconds=1.0)
    data = bytearray(buffer.getvalue())
    start, end = data.find(b"mdat"), data.find(b"moov")
    assert 0 < start < end  # the sample data sits before the index: corrupt the data, keep the index
    data[start + 4 : end - 4] = np.random.default_rng(0).integers(0, 256, end - start - 8, dtype=np.uint8).tobytes()
    path = tmp_path / "broken.m4a"
    path.write_bytes(bytes(data))
    with pytest.raises(RejectError) as caught:
        clip_audio.load_clip_audio(path)
    assert caught.value.reason == clip_audio.REJECT_AUDIO_DECODE_ERROR == "audio_decode_error"
    assert str(path) in str(caught.value)


def test_audio_backend_check_passes_and_fails(monkeypatch):
    clip_audio.check_audio_backend()

    def broken(*args, **kwargs):
        raise RejectError(clip_audio.REJECT_AUDIO_DECODE_ERROR, "decoder missing")

    monkeypatch.setattr(clip_audio, "load_clip_audio", broken)
    with pytest.raises(RuntimeError, match="cannot decode an AAC test tone"):
        clip_audio.check_audio_backend()


def test_broken_audio_in_a_clip_with_good_video_is_a_decode_error(tmp_path):
    clip = tmp_path / "broken.mp4"
    write_av_clip(clip, frames=FRAMES, fps=FPS, broken_audio=True)
    from diffprep.media.video import probe

    assert probe(clip).frames == FRAMES and probe(clip).has_audio  # the video and the stream are there
    with pytest.raises(RejectError) as caught:
        clip_audio.load_clip_audio(clip, duration=FRAMES / FPS)
    assert caught.value.reason == "audio_decode_error" and "does not decode" in str(caught.value)
