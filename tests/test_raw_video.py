"""Raw video: bucketed clips stored as H.264 mp4 + txt + json, reproducible, validated, loaded through Energon.

Real mp4 clips and an image the tests write; the same frames the Wan pipeline would encode.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import av
import pytest
import torch
from PIL import Image

import diffprep.flows.encode  # noqa: F401  (Prefect's log handler must bind to pytest's session stream)
from diffprep import contract
from diffprep.config import load_settings
from diffprep.validation.decode import decode_dataset
from diffprep.tools.demo import write_demo_clips
from diffprep.encodings import encoding_for, get_encoding
from diffprep.encodings.raw_video import RawVideoInspector
from diffprep.errors import ConfigError
from diffprep.media.buckets import Bucket
from diffprep.media.mp4 import mp4_bytes, mp4_frames
from diffprep.media.video import ClipSpec
from diffprep.media.images import psnr
from diffprep.phases.pipeline import run
from diffprep.writer.plan import read_plan
from diffprep.validation import validate_dataset
from flow_runs import shard_samples

REPO = Path(__file__).resolve().parents[1]
BUCKETS = "32x24x5;24x32x5;24x24x5;32x24x1"


def _frames(count: int = 5, width: int = 32, height: int = 24, seed: int = 0) -> torch.Tensor:
    """Smooth moving gradients (what a codec sees in real clips), uint8 [F, 3, H, W]."""
    y, x = torch.meshgrid(torch.arange(height), torch.arange(width), indexing="ij")
    frames = [torch.stack([(x * 7 + k * 9 + seed) % 256, (y * 9 + k * 5) % 256, ((x + y) * 4 + k * 3) % 256])
              for k in range(count)]
    return torch.stack(frames).to(torch.uint8)


def _settings(data: Path, out: Path, **video):
    return load_settings(overrides={
        "source": {"type": "directory", "input_dir": str(data)},
        "output": {"output_dir": str(out), "shard_size": 2, "accept_rejects": 0.0},
        "image": {"decode_workers": 1},
        "video": {"resolution_buckets": BUCKETS, "target_fps": 8, **video},
        "finalize": {"train_split": 1.0},
    })


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """Five clips (one of 3 frames: the F = 1 bucket takes it) and an image (a one-frame clip)."""
    root = write_demo_clips(tmp_path_factory.mktemp("raw-video") / "data", samples=5)
    (root / "images").mkdir()
    Image.new("RGB", (64, 40), (30, 120, 200)).save(root / "images" / "still.png")
    (root / "captions" / "still.txt").write_text("a still blue frame\n", encoding="utf-8")
    return root


def test_mp4_bytes_are_reproducible_and_decode_to_the_frames():
    frames = _frames()
    first = mp4_bytes(frames, 8.0)
    # Other work between the calls leaves other memory behind: x264's macroblock tree (now off) made that change
    # the bytes of this very clip in 3 of 8 calls.
    other = mp4_bytes(_frames(9, 64, 48, seed=1), 8.0)
    clip = _frames(5, 48, 64)
    variants = set()
    for size in range(1, 7):
        mp4_frames(other)
        _ = bytearray(os.urandom(100_000 * size))
        variants.add(mp4_bytes(clip, 8.0))
        assert mp4_bytes(frames, 8.0) == first
    assert len(variants) == 1
    assert mp4_bytes(frames, 8.0, crf=30) != first
    with av.open(io.BytesIO(first)) as container:
        stream = container.streams.video[0]
        assert (stream.codec_context.name, stream.average_rate, stream.codec_context.pix_fmt) == ("h264", 8, "yuv420p")
        assert [frame.pts * stream.time_base for frame in container.decode(stream)] == [k / 8 for k in range(5)]
    assert b"threads=1 " in first  # x264's settings string: one thread, whatever the machine's cores
    assert b" mbtree=0 " in first  # and no macroblock tree: with it, the same frames gave other bytes
    back = mp4_frames(first)
    assert back.shape == frames.shape and psnr(back, frames) > 30
    lossless_grey = torch.full((1, 3, 8, 8), 128, dtype=torch.uint8)
    assert torch.equal(mp4_frames(mp4_bytes(lossless_grey, 8.0, crf=0)), lossless_grey)
    with pytest.raises(ValueError, match="even sides"):
        mp4_bytes(_frames(width=31), 8.0)


def test_raw_video_buckets_are_checked_without_a_vae(tmp_path):
    settings = _settings(tmp_path, tmp_path)
    assert encoding_for(settings, "raw") == "raw_video"
    assert encoding_for(load_settings(), "raw") == "raw"
    byte, expected = get_encoding("raw_video").plan_settings(settings, None)
    assert byte["video"]["buckets"] == BUCKETS.split(";") and byte["raw"]["video"]["threads"] == 1
    assert expected == {"fields": ["json", "mp4", "txt"], "buckets": {
        "32x24x5": [5, 3, 24, 32], "24x32x5": [5, 3, 32, 24], "24x24x5": [5, 3, 24, 24], "32x24x1": [1, 3, 24, 32]}}
    # F needs no 4k+1 here (no VAE), W and H only evenness.
    assert get_encoding("raw_video").plan_settings(_settings(tmp_path, tmp_path, resolution_buckets="30x22x6"),
                                                   None)[1]["buckets"] == {"30x22x6": [6, 3, 22, 30]}
    with pytest.raises(ConfigError, match="width 33 is not a multiple of 2 .H.264 stores 4:2:0 chroma"):
        get_encoding("raw_video").plan_settings(_settings(tmp_path, tmp_path, resolution_buckets="33x24x5"), None)
    with pytest.raises(ConfigError, match="at least 1 frame"):
        get_encoding("raw_video").plan_settings(_settings(tmp_path, tmp_path, resolution_buckets="32x24x0"), None)
    with pytest.raises(ConfigError, match="--target-fps applies to clips"):
        get_encoding("raw").plan_settings(load_settings(overrides={"video": {"target_fps": 8}}), None)
    crf = load_settings(overrides={"video": {"resolution_buckets": BUCKETS}, "raw": {"video_crf": 23}})
    assert get_encoding("raw_video").plan_settings(crf, None)[0] != byte  # the crf is fingerprinted


def test_raw_video_end_to_end_as_the_wan_pipeline_prepares_clips(prefect_server, data, tmp_path):
    """Library run (one decode thread) and `diffprep raw` in another process (two): the same bytes; the clips
    are the frames Wan would encode, at the target fps; validation, Energon loading and decode read them back."""
    out = tmp_path / "out"
    result = run(_settings(data, out), "raw", ask=lambda *a, **k: pytest.fail(f"asked {a}"))
    assert result.samples == 6 and not result.rejected and result.validation["ok"]
    summary = result.validation["summary"]
    assert summary["encoding"] == "raw_video"
    # Counted over the loaded samples: --full loads every one (the run's own validation one per shard).
    assert validate_dataset(out, previews=0, full=True).summary["samples_per_bucket"] == {
        "24x24x5": 1, "24x32x5": 1, "32x24x1": 2, "32x24x5": 2}
    plan = read_plan(out)
    assert plan.encoding == "raw_video" and all(u.bucket for u in plan.units)

    spec = ClipSpec(tuple(Bucket(*map(int, b.split("x"))) for b in BUCKETS.split(";")), target_fps=8)
    stored = shard_samples(out)
    for key, fields in stored.items():
        assert sorted(fields) == ["json", "mp4", "txt"], key
        meta = json.loads(fields["json"])
        source = data / ("videos" if meta["source_id"].endswith(".mp4") else "images") / meta["source_id"]
        prepared = spec.prepare(source.read_bytes(), video=source.suffix == ".mp4")
        assert meta == {"source_id": meta["source_id"], "fps": 8, **prepared.meta}  # images: fps added
        assert fields["txt"].decode() == (data / "captions" / f"{source.stem}.txt").read_text().strip()
        frames = mp4_frames(fields["mp4"])
        assert frames.shape == prepared.pixels.shape and psnr(frames, prepared.pixels) > 25, key
        assert get_encoding("raw_video").field_problem(list(fields), plan.expected) == ""

    # Another process, two decode threads, through the CLI and the encode-raw flow: byte-identical shards.
    again = tmp_path / "again"
    from prefect.settings import PREFECT_API_URL

    cli = subprocess.run(
        [sys.executable, "-m", "diffprep", "raw", "--source-type", "directory", "--input-dir", str(data),
         "--output-dir", str(again), "--shard-size", "2", "--resolution-buckets", BUCKETS, "--target-fps", "8",
         "--decode-workers", "2", "--train-split", "1.0"],
        env=os.environ | {"PREFECT_API_URL": PREFECT_API_URL.value(), "PYTHONPATH": str(REPO)},
        capture_output=True, text=True, timeout=300)
    assert cli.returncode == 0, cli.stdout[-2000:] + cli.stderr[-2000:]
    assert "validation: passed" in cli.stdout

    def hashes(path: Path) -> dict[str, str]:
        return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.glob("*.tar"))}

    assert hashes(again) == hashes(out) and len(hashes(out)) == len(plan.units)

    # Training: Energon batches one bucket at a time, the frames decoded from the mp4.
    from megatron.energon import WorkerConfig, get_loader, get_train_dataset

    from diffprep.writer.cooker import RawVideoFramesTaskEncoder

    dataset = get_train_dataset(out, batch_size=2, shuffle_buffer_size=None, max_samples_per_sequence=None,
                                task_encoder=RawVideoFramesTaskEncoder(), repeat=False,
                                worker_config=WorkerConfig(rank=0, world_size=1, num_workers=0))
    seen = 0
    for batch in get_loader(dataset):
        [bucket] = set(batch.bucket)
        width, height, count = map(int, bucket.split("x"))
        assert batch.frames.shape == (len(batch.bucket), count, 3, height, width) and batch.frames.dtype == torch.uint8
        for key, frames in zip(batch.__key__, batch.frames):
            assert torch.equal(frames, mp4_frames(stored[key]["mp4"]))
        seen += len(batch.bucket)
    assert seen == 6

    # decode: the stored clips as they are, next to the re-prepared source.
    report = decode_dataset(out, 3, to_dir=tmp_path / "previews")
    assert report.encoding == "raw_video" and all(p.psnr_db > 25 for p in report.previews)
    assert all((tmp_path / "previews" / f"{p.key}.mp4").is_file() for p in report.previews)

    # A key map renames the members; validation loads the renamed samples through Energon's cooker.
    renamed = tmp_path / "renamed"
    settings = _settings(data, renamed)
    settings.output.key_map = "mp4=clip.mp4"
    result = run(settings, "raw", ask=lambda *a, **k: pytest.fail(f"asked {a}"))
    assert result.validation["ok"], result.validation
    assert all(sorted(fields) == ["clip.mp4", "json", "txt"] for fields in shard_samples(renamed).values())


def test_raw_video_inspector_names_a_broken_or_misplaced_clip():
    inspector = RawVideoInspector({"buckets": {"32x24x5": [5, 3, 24, 32]}})
    good = mp4_bytes(_frames(), 8.0)
    inspector.inspect(SimpleNamespace(__key__="000000_000000", bucket="32x24x5", video=good))
    inspector.inspect(SimpleNamespace(__key__="000000_000001", bucket="32x24x5", video=mp4_bytes(_frames(3), 8.0)))
    inspector.inspect(SimpleNamespace(__key__="000000_000002", bucket="32x24x5", video=good[:200]))
    inspector.inspect(SimpleNamespace(__key__="000000_000003", bucket="64x48x5", video=good))
    [check] = inspector.checks()
    assert not check.ok
    text = json.dumps(check.__dict__, default=str)
    assert "000000_000000" not in text
    assert "000000_000001 holds h264 32x24, 3 frames; its bucket is 32x24x5" in text
    assert "000000_000002" in text and "which the plan does not list" in text
    assert inspector.summary() == {"samples_per_bucket": {"32x24x5": 3, "64x48x5": 1}}


def test_raw_video_keeps_each_clips_audio_and_scores_for_fastgens_loaders(tmp_path):
    """--keep-audio: each mp4 holds its clip's stereo AAC cut to the kept frames (F / fps seconds), the channels
    as they were; a clip without sound is the named reject; the inspector names a track that is missing.
    --score-column: the json member's top-level numbers as FastGen's presets_filter compares them; a row without
    a number (absent, NaN) leaves the field out, a word is the reject invalid_score."""
    import numpy as np

    from diffprep.tools.demo import write_av_clip
    from diffprep.media.audio import load_clip_audio

    data = tmp_path / "data"
    rows = {"loud": ("stereo", {"aesthetic_score": 6.5, "motion": 3}), "mono": ("mono", {"aesthetic_score": "NaN"}),
            "silent": (None, {"aesthetic_score": 1.0}), "wordy": ("stereo", {"aesthetic_score": "high"})}
    (data / "clips").mkdir(parents=True)
    lines = []
    for name, (layout, scores) in rows.items():
        write_av_clip(data / "clips" / f"{name}.mp4", width=32, height=24, frames=12, fps=8, seconds=2.0,
                      audio_layout=layout)
        row = {"media_path": f"clips/{name}.mp4", "caption": f"a {name} clip", **scores}
        lines.append(json.dumps(row).replace('"NaN"', "NaN"))  # a JSON file may carry NaN (Python writes it)
    (data / "dataset.jsonl").write_text("\n".join(lines), encoding="utf-8")
    out = tmp_path / "out"
    settings = _settings(data, out, resolution_buckets="32x24x5")
    settings.source = type(settings.source)(type="metadata", metadata_file=str(data / "dataset.jsonl"),
                                            score_columns="aesthetic_score,motion")
    settings.raw.keep_audio = True
    settings.output.accept_rejects = 0.5
    byte, expected = get_encoding("raw_video").plan_settings(settings, None)
    assert byte["video"]["audio"] is True and byte["raw"]["audio"]["codec"] == "aac"
    assert byte["scores"] == ["aesthetic_score", "motion"]
    assert expected["audio"] == {"codec": "aac", "channels": 2}
    result = run(settings, "raw", ask=lambda *a, **k: pytest.fail(f"asked {a}"))
    assert result.samples == 2 and result.validation["ok"], result.validation
    rejects = {r["source_id"]: r["reason"]
               for r in json.loads((out / ".diffprep" / "audit.json").read_text())["rejected_ids"]}
    assert rejects == {"clips/silent.mp4": "no_audio_stream", "clips/wordy.mp4": "invalid_score"}

    stored = shard_samples(out)
    assert len(stored) == 2
    for key, fields in stored.items():
        meta = json.loads(fields["json"])
        # FastGen's score filter: the json member's top-level score_key, compared with the threshold.
        if meta["source_id"] == "clips/loud.mp4":
            assert (meta["aesthetic_score"], meta["motion"]) == (6.5, 3) and not meta["aesthetic_score"] < 5.5
        else:
            assert "aesthetic_score" not in meta and "motion" not in meta  # NaN and absent: left out
        seconds = 5 / 8
        assert meta["audio"]["duration"] == pytest.approx(seconds, abs=1e-3), key
        # What FastGen's audio-video loader does: the waveform decoded from the same mp4 container.
        with av.open(io.BytesIO(fields["mp4"])) as container:
            [stream] = container.streams.audio
            assert (stream.codec_context.name, stream.codec_context.channels) == ("aac", 2)
        sound = load_clip_audio(io.BytesIO(fields["mp4"]))
        assert abs(sound.waveform.shape[1] / sound.sample_rate - seconds) < 0.05, key
        spectrum = np.abs(np.fft.rfft(sound.waveform.numpy(), axis=1))
        peaks = spectrum[:, 5:].argmax(axis=1) + 5
        heard = peaks * sound.sample_rate / sound.waveform.shape[1]
        # The source's tones: 220 Hz left, 330 Hz right (a mono source: 220 Hz on both).
        want = [220.0, 220.0] if meta["source_id"] == "clips/mono.mp4" else [220.0, 330.0]
        assert heard == pytest.approx(want, abs=4.0), (key, heard)

    # Through FastGen's loader rules (VideoAudioLoaderConfig's key map: mp4 + txt): every clip kept, its caption
    # stripped, the mp4 bytes as stored; presets_filter's score filter reads the json member's aesthetic_score.
    from fastgen_loader import fastgen_samples

    key_map = {"real": contract.RAW_VIDEO, "condition": contract.RAW_CAPTION}
    loaded = fastgen_samples(out, key_map)
    assert [item["__key__"] for item in loaded] == sorted(stored)
    source_of = {key: json.loads(fields["json"])["source_id"] for key, fields in stored.items()}
    for item in loaded:
        assert item[contract.RAW_VIDEO] == stored[item["__key__"]]["mp4"]
        assert item[contract.RAW_CAPTION] == f"a {Path(source_of[item['__key__']]).stem} clip"
    kept = {threshold: [source_of[item["__key__"]] for item in fastgen_samples(
        out, key_map, presets_filter={"score": {"threshold": threshold, "score_key": "aesthetic_score"}})]
        for threshold in (5.5, 7.0)}
    # 6.5 passes 5.5 and not 7.0; the clip whose score was NaN has none, so the filter keeps it at any threshold.
    assert kept == {5.5: ["clips/loud.mp4", "clips/mono.mp4"], 7.0: ["clips/mono.mp4"]}

    inspector = RawVideoInspector(expected)
    inspector.inspect(SimpleNamespace(__key__="000000_000009", bucket="32x24x5", video=mp4_bytes(_frames(), 8.0)))
    [check] = inspector.checks()
    assert not check.ok and "000000_000009 mp4: has no audio track" in json.dumps(check.__dict__, default=str)
