"""A clip's audio track as the LTX-2 trainer reads it, decoded with PyAV alone (no ltx-core): channels, duration,
the named rejects and the audio backend's test tone. Real AAC files written here."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch

from diffprep.tools.demo import write_av_clip
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
    # From memory (how a clip's bytes are read): no object repr in the message, which its sample id goes with.
    with pytest.raises(RejectError) as caught:
        clip_audio.load_clip_audio(io.BytesIO(clip.read_bytes()))
    assert str(caught.value).endswith("the file has no audio stream") and "BytesIO" not in str(caught.value)


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


def test_duration_buckets_take_the_longest_that_fits_and_name_the_short_files(tmp_path):
    """--audio-durations as the trainer: the longest bucket not longer than the file's audio, trimmed to it."""
    assert clip_audio.parse_durations(" 4.0; 2 ") == (2.0, 4.0)
    spec = clip_audio.AudioSpec(clip_audio.parse_durations("2.0;4.0"))
    files = {}
    for name, seconds, rate in (("long.wav", 4.5, 22050), ("mid.flac", 2.3, 44100), ("short.wav", 1.9, 16000)):
        buffer = io.BytesIO()
        codec = ("flac", "flac") if name.endswith("flac") else ("pcm_s16le", "wav")
        clip_audio.write_test_tone(buffer, seconds=seconds, sample_rate=rate, layout="mono", codec=codec[0],
                                   container_format=codec[1])
        files[name] = buffer.getvalue()
    assert spec.bucket_of(files["long.wav"]) == 4.0 and spec.bucket_of(files["mid.flac"]) == 2.0
    prepared = spec.prepare(files["long.wav"])
    assert prepared.audio.waveform.shape == (2, 4 * 22050) and prepared.audio.sample_rate == 22050
    assert prepared.meta["bucket"] == "4s" and prepared.meta["audio"]["source_duration"] == pytest.approx(4.5, 1e-3)
    assert prepared.pixels.numel() == 0
    short = "1.900 s, shorter than every duration bucket (the shortest is 2s)"
    for data, bucket, words in ((files["short.wav"], None, short), (files["mid.flac"], 4.0, "2.300 s, its bucket 4s")):
        with pytest.raises(RejectError) as caught:  # too short for every bucket, or for the one planned
            spec.prepare(data, bucket=bucket)
        assert caught.value.reason == clip_audio.REJECT_TOO_SHORT_AUDIO == "too_short_audio"
        assert words in caught.value.detail
    with pytest.raises(ValueError, match="repeats"):
        clip_audio.parse_durations("2;2.0")


def test_mp4_with_sound_is_byte_stable_and_wav_is_lossless():
    """diffprep decode's files: the mp4's AAC track (same inputs, same bytes: the pinned av wheel's encoder at a
    fixed bit rate) and the WAV of an audio-only sample (16-bit PCM)."""
    from diffprep.media.mp4 import mp4_bytes

    frames = torch.randint(0, 256, (FRAMES, 3, 64, 64), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    time = torch.arange(int(24000 * FRAMES / FPS)) / 24000
    sound = clip_audio.ClipAudio(torch.stack([0.3 * torch.sin(2 * np.pi * 440 * time),
                                              0.3 * torch.sin(2 * np.pi * 660 * time)]).float(), 24000, 2)
    first = mp4_bytes(frames, FPS, audio=sound)
    assert first == mp4_bytes(frames, FPS, audio=sound) and first != mp4_bytes(frames, FPS)
    back = clip_audio.load_clip_audio(io.BytesIO(first))
    assert back.sample_rate == 24000 and abs(back.duration - FRAMES / FPS) < 0.05
    wav = clip_audio.load_clip_audio(io.BytesIO(clip_audio.wav_bytes(sound)))
    assert wav.waveform.shape == sound.waveform.shape
    assert (wav.waveform - sound.waveform).abs().max() <= 1 / 32767


def test_only_the_kept_audio_is_decoded(tmp_path, monkeypatch):
    """With a duration, decoding stops once the kept samples are there: the same waveform as the whole track
    trimmed, from a fraction of its frames."""
    import av

    path = tmp_path / "long.m4a"
    clip_audio.write_test_tone(path, seconds=6.0, sample_rate=16000)
    whole = clip_audio.load_clip_audio(path)
    decoded = []
    original = av.container.InputContainer.decode

    def counting(self, *args, **kwargs):
        for frame in original(self, *args, **kwargs):
            decoded.append(frame.samples)
            yield frame

    monkeypatch.setattr(av.container.InputContainer, "decode", counting)
    kept = clip_audio.load_clip_audio(path, duration=0.5)
    assert torch.equal(kept.waveform, whole.waveform[:, :8000])
    assert 8000 <= sum(decoded) < 16000  # well under the file's 96 000 samples
