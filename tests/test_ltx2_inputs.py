"""LTX-2's other per-clip inputs (media/clip_inputs.py, encodings/ltx2_masks.py): a clip's sound as a file of its
own, reference audio, inpainting masks in the latent grid (cropped as their clip), their rejects, and one run in the
trainer's layout that its reading rules find whole."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import diffprep.flows.encode  # noqa: F401  (Prefect's log handler bound at collection, as in test_ltx2_pipeline)

from diffprep import contract
from diffprep.tools.demo import write_av_clip
from diffprep.encodings.ltx2_masks import audio_mask_latent, video_mask_latent
from diffprep.errors import RejectError
from diffprep.media.audio import write_test_tone
from diffprep.media.buckets import Bucket
from diffprep.media.clip_inputs import audio_mask_envelope, prepare_with_inputs
from diffprep.media.mp4 import mp4_bytes
from diffprep.media.video import ClipSpec
from diffprep.phases.pipeline import run
from diffprep.sources.metadata import MetadataSource
from test_ltx2_pipeline import FPS, never_ask, settings_for, trainer_samples

WAV = {"codec": "pcm_s16le", "container_format": "wav"}
ALL = ("audio", "reference_audio", "video_mask", "audio_mask")


def png(width: int, height: int, white: tuple[int, int]) -> bytes:
    """A black image with the columns ``white[0] <= x < white[1]`` white."""
    pixels = np.zeros((height, width, 3), np.uint8)
    pixels[:, white[0]:white[1]] = 255
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def test_video_mask_latent_is_the_trainers_grid():
    """Average pool by 32, any masked frame of a group of 8 masks it, the first F' groups, > 0.5."""
    mask = torch.zeros(17, 64, 64)
    mask[9, :, :32] = 1.0  # frame 9: group 1 (frames 8..15), left half
    mask[0, :40, 32:] = 1.0  # frame 0, right half, 40 of 64 rows: pooled 1.0 in the top cell, 0.25 below
    grid = video_mask_latent(mask, (128, 3, 2, 2))
    assert grid.shape == (3, 2, 2) and grid.dtype == torch.float32
    assert grid[0].tolist() == [[0.0, 1.0], [0.0, 0.0]]
    assert grid[1].tolist() == [[1.0, 0.0], [1.0, 0.0]]
    assert grid[2].tolist() == [[0.0, 0.0], [0.0, 0.0]]  # frame 16 alone in its (padded) group


def test_mask_overlay_tints_the_masked_cells():
    from diffprep.encodings.ltx2_masks import overlay

    frames = torch.zeros(9, 3, 64, 64, dtype=torch.uint8)
    mask = torch.zeros(2, 2, 2)
    mask[1, 0, 0] = 1.0  # frames 8.., top-left cell
    tinted = overlay(frames, mask)
    assert tinted[8, 0, :32, :32].eq(128).all() and tinted[8, 0, 32:].eq(0).all() and tinted[:8].eq(0).all()


def test_soft_masks_are_counted():
    from collections import Counter
    from types import SimpleNamespace

    from diffprep.encodings.ltx2_masks import masks_of

    hard, soft = torch.zeros(9, 64, 64), torch.full((9, 64, 64), 0.5)
    hard[:, :, :32] = 1.0
    notes: Counter = Counter()
    found = masks_of(SimpleNamespace(video_masks=[hard, soft], audio_masks=None), torch.zeros(2, 128, 2, 2, 2),
                     None, notes)
    assert notes["mask_not_binary"] == 1 and found[contract.VIDEO_MASK].shape == (2, 2, 2, 2)


def test_a_run_without_masks_says_nothing_about_them(capsys):
    """No mask column: no mask_not_binary note at all (not a count of 0), and the summary prints no zero count that
    an earlier diffprep's manifests recorded."""
    from collections import Counter
    from types import SimpleNamespace

    from diffprep.cli import print_summary
    from diffprep.encodings.ltx2_masks import masks_of

    notes: Counter = Counter()
    assert masks_of(SimpleNamespace(video_masks=None, audio_masks=None), torch.zeros(1, 128, 2, 2, 2), None,
                    notes) == {}
    assert "mask_not_binary" not in notes
    print_summary({"out_dir": "out", "action": "fresh", "fingerprint": "f", "samples": 2, "rejected": 0, "units": 1,
                   "encoded_units": 1, "seconds": 1.0, "notes": {"caption_truncated": 1, "mask_not_binary": 0}})
    printed = capsys.readouterr().out
    assert "kept, caption_truncated: 1" in printed and "mask_not_binary" not in printed


def test_audio_mask_latent_is_nearest_resampled():
    assert audio_mask_latent(torch.tensor([0.0, 1.0, 1.0, 0.2]), 8).tolist() == [0, 0, 1, 1, 1, 1, 0, 0]
    envelope = audio_mask_envelope("m.pt", _saved({"mask": torch.tensor([[0, 1], [1, 0]])}), 1.0)
    assert envelope.tolist() == [0.0, 1.0, 1.0, 0.0]
    with pytest.raises(RejectError) as error:
        audio_mask_envelope("m.pt", b"not a tensor", 1.0)
    assert error.value.reason == "audio_mask_decode_error"


def _saved(value) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def test_a_mask_is_cropped_as_its_clip_when_the_aspect_ratio_differs(tmp_path):
    """A 96x64 clip in a 64x64 bucket keeps x in [16, 80): a mask white on [16, 48) is white on the bucket's left
    half exactly (stretched to the bucket, as the trainer does, it would start at x = 11); a half-size mask image
    and a mask clip land the same; a mask clip shorter than its clip is named."""
    clip = tmp_path / "c.mp4"
    write_av_clip(clip, width=96, height=64, frames=9, fps=FPS)
    spec = ClipSpec((Bucket(64, 64, 9),), audio=False, inputs=("video_mask",))
    want = torch.zeros(9, 64, 64)
    want[:, :, :32] = 1.0
    white = torch.zeros(9, 3, 64, 96, dtype=torch.uint8)
    white[:, :, :, 16:48] = 255
    masks = {"full.png": png(96, 64, (16, 48)), "half.png": png(48, 32, (8, 24)), "m.mp4": mp4_bytes(white, FPS)}
    for name, data in masks.items():
        prepared = prepare_with_inputs(spec, clip.read_bytes(), {"video_mask": (name, data)}, video=True)
        got = (prepared.video_mask > 0.5).float()
        assert got.shape == (9, 64, 64)
        assert (got[:, 4:60, 2:30] == 1).all() and (got[:, 4:60, 34:62] == 0).all(), name
        assert prepared.meta["video_mask"] == name
    with pytest.raises(RejectError) as error:
        prepare_with_inputs(spec, clip.read_bytes(), {"video_mask": ("s.mp4", mp4_bytes(white[:5], FPS))}, video=True)
    assert error.value.reason == "video_mask_too_short"
    with pytest.raises(RejectError) as error:
        prepare_with_inputs(spec, clip.read_bytes(), {"video_mask": ("x.png", b"no image")}, video=True)
    assert error.value.reason == "video_mask_decode_error"


def test_sound_file_is_fitted_to_the_frames_and_no_audio_stream_comes_first(tmp_path):
    """The clip's own sound file, trimmed to F / fps as its track would be; a clip without sound is rejected before
    its frames are decoded; a sound file that is not audio is named."""
    clip = tmp_path / "c.mp4"
    write_av_clip(clip, frames=9, fps=FPS, audio_layout=None)
    tone = io.BytesIO()
    write_test_tone(tone, seconds=2.0, sample_rate=16000, **WAV)
    spec = ClipSpec((Bucket(64, 64, 9),), audio=True, inputs=("audio", "reference_audio"))
    prepared = prepare_with_inputs(spec, clip.read_bytes(), {"audio": ("s.wav", tone.getvalue()),
                                                             "reference_audio": ("r.wav", tone.getvalue())}, video=True)
    assert prepared.audio.waveform.shape == (2, int(9 / FPS * 16000)) == prepared.reference_audio.waveform.shape
    assert prepared.meta["audio"]["file"] == "s.wav"
    with pytest.raises(RejectError) as error:
        ClipSpec((Bucket(64, 64, 9),), audio=True).prepare(clip.read_bytes(), video=True)
    assert error.value.reason == "no_audio_stream"
    with pytest.raises(RejectError) as error:
        prepare_with_inputs(spec, clip.read_bytes(), {"audio": ("s.wav", tone.getvalue()),
                                                      "reference_audio": ("r.wav", b"noise")}, video=True)
    assert error.value.reason == "reference_audio_audio_decode_error"


def test_metadata_extra_columns_and_their_rejects(tmp_path):
    (tmp_path / "a.mp4").write_bytes(b"clip")
    (tmp_path / "m.png").write_bytes(b"mask")
    rows = [{"video": "a.mp4", "caption": "x", "video_mask": "m.png"},
            {"video": "a.mp4", "caption": "y"},
            {"video": "a.mp4", "caption": "z", "video_mask": "gone.png"}]
    listing = tmp_path / "d.json"
    listing.write_text(json.dumps(rows))
    source = MetadataSource(str(listing))
    assert source.extra_columns == ["video_mask"]
    first, second, third = source.read(list(source.list_ids()))
    assert first.extras == {"video_mask": ("m.png", b"mask")}
    assert second.reject.reason == "missing_video_mask" and third.reject.reason == "video_mask_not_found"


def write_level_wav(path: Path, levels: list[float], rate: int = 16000) -> None:
    import wave

    with wave.open(str(path), "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(rate)
        out.writeframes(np.asarray(np.array(levels) * 32767, dtype="<i2").tobytes())


def write_inputs_dataset(root: Path) -> Path:
    """Two 96x64 clips without sound of their own, each with a sound file, a reference sound, a mask image or
    clip and an audio mask (.wav envelope, .pt tensor); a third row whose mask is missing."""
    rows = []
    for index, name in enumerate(("a", "b", "c")):
        write_av_clip(root / f"{name}.mp4", width=96, height=64, frames=9, fps=FPS, audio_layout=None, seed=index)
        write_test_tone(root / f"{name}.wav", seconds=1.0, sample_rate=16000, frequency=220.0 * (index + 1), **WAV)
        write_test_tone(root / f"{name}_ref.wav", seconds=0.2, sample_rate=16000, **WAV)
        rows.append({"video": f"{name}.mp4", "caption": f"a cat {index}", "audio": f"{name}.wav",
                     "reference_audio": f"{name}_ref.wav", "video_mask": f"{name}_mask.png",
                     "audio_mask": f"{name}_mask.wav" if index == 0 else f"{name}_mask.pt"})
    (root / "a_mask.png").write_bytes(png(96, 64, (16, 48)))
    (root / "b_mask.png").write_bytes(png(96, 64, (48, 80)))
    write_level_wav(root / "a_mask.wav", [0.9] * 8000 + [0.0] * 8000)  # loud, then silent: the first half masked
    (root / "b_mask.pt").write_bytes(_saved(torch.tensor([0.0, 1.0])))
    listing = root / "dataset.json"
    listing.write_text(json.dumps(rows), encoding="utf-8")
    return listing


def test_sound_files_reference_audio_and_masks_in_the_ltx_layout(tiny_ltx2, tmp_path):
    """AV2AV + inpainting in one run: every folder the modes name holds one record per sample under the same name,
    the masks in the latents' grid and on their clips, the reference sound as long as the target's; the row whose
    mask is missing is named."""
    data = tmp_path / "dataset"
    data.mkdir()
    listing = write_inputs_dataset(data)
    settings = settings_for(data, listing, tiny_ltx2, output={"layout": "ltx", "accept_rejects": 0.34},
                            video={"resolution_buckets": "64x64x9"})
    result = run(settings, "preencoded", ask=never_ask)
    assert result.samples == 2 and result.rejects_by_reason == {"video_mask_not_found": 1}
    assert not (result.notes or {}).get("mask_not_binary")
    root = data / contract.PRECOMPUTED_DIR
    folders = ("latents", "conditions", "audio_latents", "reference_audio_latents", "video_masks", "audio_masks")
    assert sorted(p.name for p in root.iterdir()) == sorted((".diffprep",) + folders)
    samples = trainer_samples(root, folders)
    assert sorted(samples) == ["a.pt", "b.pt"]
    for name, sample in samples.items():
        audio, reference = sample["audio_latents"], sample["reference_audio_latents"]
        assert reference["latents"].shape == audio["latents"].shape and reference["duration"] == audio["duration"]
        assert audio["duration"] == pytest.approx(9 / FPS, 1e-3)
        video_mask = sample["video_masks"]["mask"]
        assert set(sample["video_masks"]) == {"mask"} and video_mask.dtype == torch.float32
        assert video_mask.shape == sample["latents"]["latents"].shape[1:] == (2, 2, 2)
        left = [[1.0, 0.0], [1.0, 0.0]] if name == "a.pt" else [[0.0, 1.0], [0.0, 1.0]]
        assert video_mask.tolist() == [left, left]
        audio_mask = sample["audio_masks"]["mask"]
        assert audio_mask.shape == (audio["num_time_steps"],) and audio_mask.dtype == torch.float32
        steps = audio["num_time_steps"]
        # a: 9/24 s of a 1 s wav mask, all in its loud half; b: a 2-value tensor stretched over the steps.
        assert audio_mask.tolist() == ([1.0] * steps if name == "a.pt" else
                                       [0.0] * ((steps + 1) // 2) + [1.0] * (steps // 2))
    assert result.validation["ok"] and result.validation["summary"]["folders"] == {f: 2 for f in folders}

    from diffprep.validation.decode import decode_dataset

    decoded = tmp_path / "decoded"
    report = decode_dataset(root, 2, to_dir=decoded, device="cpu")
    assert all(p.audio_mel_l1 is not None for p in report.previews)  # against the sound file, as encoded
    for preview in report.previews:
        assert (decoded / f"{preview.key}.mask.png").is_file() and (decoded / f"{preview.key}.reference.wav").is_file()

    # verify-existing covers the new folders: the same run again is complete; a mask record changed behind
    # diffprep's back damages its unit, which the next run encodes again.
    assert run(settings, "preencoded", ask=never_ask).action == "complete"
    first = root / "video_masks" / "a.pt"
    torch.save({"mask": torch.full((2, 2, 2), 0.5)}, first)
    assert run(settings, "preencoded", ask=never_ask).action == "resume"
    assert torch.load(first, weights_only=True)["mask"].tolist() == samples["a.pt"]["video_masks"]["mask"].tolist()

    # A mask file changed after its clip was written: the unit is damaged (its manifest's stamps), encoded again
    # with the new mask, and complete after that.
    from diffprep.phases.existing import inspect_output
    from diffprep.phases.fetch import fetch
    from diffprep.output import Output

    (data / "b_mask.png").write_bytes(png(96, 64, (16, 48)))  # b's mask now covers a's columns
    plan, _ = fetch(settings, root)
    assert plan.changed_units == [0] and inspect_output(Output(root), plan).damaged_units == [0]
    assert run(settings, "preencoded", ask=never_ask).action == "resume"
    left = [[1.0, 0.0], [1.0, 0.0]]
    assert torch.load(root / "video_masks" / "b.pt", weights_only=True)["mask"].tolist() == [left, left]
    assert run(settings, "preencoded", ask=never_ask).action == "complete"


def test_reference_audio_and_masks_in_energon_shards(tiny_ltx2, tmp_path):
    """The same inputs in the Energon layout: their fields in every sample, read back through the cooker."""
    from flow_runs import shard_samples

    data = tmp_path / "dataset"
    data.mkdir()
    listing = write_inputs_dataset(data)
    rows = json.loads(listing.read_text())[:2]
    listing.write_text(json.dumps(rows))
    result = run(settings_for(tmp_path / "out", listing, tiny_ltx2), "preencoded", ask=never_ask)
    assert result.samples == 2 and result.validation["ok"]
    from diffprep.writer.shards import load_tensor

    samples = shard_samples(tmp_path / "out")
    assert len(samples) == 2
    for key, sample in samples.items():
        tensor = {name: load_tensor(sample[name], key=key, field=name) for name in (
            contract.LATENTS, contract.AUDIO_LATENTS, contract.REFERENCE_AUDIO_LATENTS, contract.VIDEO_MASK,
            contract.AUDIO_MASK)}
        assert tensor[contract.REFERENCE_AUDIO_LATENTS].shape == tensor[contract.AUDIO_LATENTS].shape
        assert tensor[contract.VIDEO_MASK].shape == tensor[contract.LATENTS].shape[1:]
        assert tensor[contract.AUDIO_MASK].shape == tensor[contract.AUDIO_LATENTS].shape[1:2]
        assert set(tensor[contract.VIDEO_MASK].unique().tolist()) <= {0.0, 1.0}


def test_folders_ownership_and_record_checks_cover_the_new_folders():
    """folders() (the audit, verify-existing, ownership) names a folder per input read; the trainer's folders are
    recognized as read by it; a mask record with soft values or another shape is a finding."""
    from types import SimpleNamespace

    from diffprep.encodings import ltx_layout
    from diffprep.encodings.ltx2_masks import mask_problems

    plan = SimpleNamespace(settings={"video": {"audio": True, "inputs": ["audio", "reference_audio", "video_mask",
                                                                          "audio_mask"]}})
    assert ltx_layout.folders(plan) == ["latents", "conditions", "audio_latents", "reference_audio_latents",
                                        "video_masks", "audio_masks"]
    assert all(ltx_layout.read_by_trainer(f"{kind}/a.pt") for kind in ltx_layout.folders(plan))
    expected = SimpleNamespace(expected={"video_mask": [None, None, None], "audio_mask": [None],
                                         "dtypes": {"video_mask": "float32", "audio_mask": "float32"}})
    assert ltx_layout.record_problem("video_masks", {"mask": torch.ones(2, 2, 2)}, expected) is None
    assert "other than 0 and 1" in ltx_layout.record_problem("video_masks", {"mask": torch.full((2, 2, 2), 0.5)},
                                                             expected)
    assert "expected keys" in ltx_layout.record_problem("audio_masks", {"latents": torch.ones(3)}, expected)
    assert ltx_layout.record_problem("audio_masks", {"mask": torch.ones(3, dtype=torch.float64)}, expected)
    latents, audio = torch.zeros(128, 2, 2, 2), torch.zeros(8, 9, 16)
    assert mask_problems(latents, audio, torch.ones(2, 2, 2), torch.ones(9)) == []
    assert mask_problems(latents, audio, torch.ones(3, 2, 2), torch.ones(8)) == [
        "video_mask has shape [3, 2, 2], its latents' grid is [2, 2, 2]",
        "audio_mask has shape [8], its latents' grid is [9]"]


def test_a2a_reference_audio_and_audio_masks_without_video(tiny_ltx2, tmp_path):
    """Audio only (A2A IC-LoRA + audio inpainting): no latents/; the reference sound fitted to the target's duration
    bucket (a short one padded), the audio mask in the audio latents' grid; a missing reference named."""
    data = tmp_path / "dataset"
    data.mkdir()
    rows = []
    for index, name in enumerate(("a", "b", "c")):
        write_test_tone(data / f"{name}.wav", seconds=2.2, sample_rate=16000, frequency=220.0 * (index + 1), **WAV)
        write_test_tone(data / f"{name}_ref.wav", seconds=1.0 if index else 3.0, sample_rate=16000, **WAV)
        rows.append({"audio": f"{name}.wav", "caption": f"a dog {index}",
                     "reference_audio": f"{name}_ref.wav" if index < 2 else "gone.wav", "audio_mask": "m.pt"})
    (data / "m.pt").write_bytes(_saved(torch.tensor([1.0, 0.0])))
    listing = data / "dataset.json"
    listing.write_text(json.dumps(rows), encoding="utf-8")
    settings = settings_for(data, listing, tiny_ltx2, output={"layout": "ltx", "accept_rejects": 0.34},
                            video={"audio_durations": "2.0", "resolution_buckets": None})
    result = run(settings, "preencoded", ask=never_ask)
    assert result.samples == 2 and result.rejects_by_reason == {"reference_audio_not_found": 1}
    root = data / contract.PRECOMPUTED_DIR
    folders = ("conditions", "audio_latents", "reference_audio_latents", "audio_masks")
    assert sorted(p.name for p in root.iterdir()) == sorted((".diffprep",) + folders)
    samples = trainer_samples(root, folders)
    assert sorted(samples) == ["a.pt", "b.pt"]
    for sample in samples.values():
        audio, reference = sample["audio_latents"], sample["reference_audio_latents"]
        assert reference["latents"].shape == audio["latents"].shape and audio["duration"] == pytest.approx(2.0)
        steps = audio["num_time_steps"]
        assert sample["audio_masks"]["mask"].tolist() == [1.0] * ((steps + 1) // 2) + [0.0] * (steps // 2)
    assert result.validation["ok"]
