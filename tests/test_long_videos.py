"""Long videos: shots found once in the plan, windows inside each shot, each window in its bucket.

Tiny real mp4 clips with hard cuts at known frames (solid blocks of very different colour and brightness).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from diffprep.media.buckets import Bucket
from diffprep.media.mp4 import mp4_bytes
from diffprep.media.scenes import detect_shots
from diffprep.media.windows import SceneSettings, Window, clip_id, parse_clip_id, shot_spans, shot_windows, source_windows

COLOURS = [(12, 12, 12), (240, 240, 240), (230, 40, 40), (20, 60, 220)]


def cut_frames(cuts: list[int], frames: int, width: int = 32, height: int = 24) -> torch.Tensor:
    """uint8 [F, 3, H, W]: a solid block per shot (a hard cut at each of ``cuts``), a small moving square."""
    out = torch.empty((frames, 3, height, width), dtype=torch.uint8)
    for i in range(frames):
        shot = sum(i >= c for c in cuts)
        out[i] = torch.tensor(COLOURS[shot % len(COLOURS)], dtype=torch.uint8)[:, None, None]
        out[i, :, :4, i % (width - 4):i % (width - 4) + 4] = 128
    return out


def cut_clip(cuts: list[int], frames: int, fps: float = 10.0, **size) -> bytes:
    return mp4_bytes(cut_frames(cuts, frames, **size), fps)


@pytest.mark.parametrize("detector", ["content", "adaptive", "histogram"])
def test_shots_are_found_at_the_hard_cuts(detector):
    shots = detect_shots(cut_clip([30, 75], 100), detector, 0.5)
    assert shots.shots == ((0, 29), (30, 74), (75, 99))
    assert shots.decoded_frames == 100 and shots.container_frames == 100


# --- the hard-cut suite: every cut the default detector must find, and a clip it must not cut ------------------

SUITE_W, SUITE_H, SUITE_SHOT = 64, 48, 20  # 20-frame shots at 10 fps


def texture(seed: int, width: int = SUITE_W) -> np.ndarray:
    """uint8 [H, W, 3]: smooth coloured blobs (a random 8x6 grid of colours upsampled), a picture with detail."""
    grid = np.random.default_rng(seed).integers(0, 256, (6, 8 * width // SUITE_W, 3), dtype=np.uint8)
    return np.asarray(Image.fromarray(grid).resize((width, SUITE_H), Image.Resampling.BICUBIC))


def flat(colour: tuple[int, int, int]) -> np.ndarray:
    return np.broadcast_to(np.array(colour, np.uint8), (SUITE_H, SUITE_W, 3)).copy()


def with_square(picture: np.ndarray, x: int, y: int) -> np.ndarray:
    out = picture.copy()
    out[y:y + 10, x:x + 10] = 255
    return out


def suite_clip(kind: str) -> tuple[bytes, list[int]]:
    """A clip of the suite (mp4 at 10 fps) and the frames its hard cuts are at.

    ``flat``: flat colours, blue to green first (ContentDetector scores it about 20, under its 27), then other hues
    and greys; ``texture``: four textures, each panning a pixel a frame; ``motion``: a white square moving across
    every shot at one speed while the background changes under it (flat blue, flat green, two textures);
    ``none``: no cut: a camera over a texture, still, then panning fast (2 pixels a frame), then still again, the
    square moving across it all the while."""
    if kind == "flat":
        colours = [(0, 0, 255), (0, 255, 0), (255, 0, 0), (128, 128, 128), (20, 20, 20), (240, 240, 240),
                   (255, 255, 0)]
        frames = [flat(colour) for colour in colours for _ in range(SUITE_SHOT)]
    elif kind == "texture":
        frames = [np.roll(texture(shot), i, axis=1) for shot in range(4) for i in range(SUITE_SHOT)]
    elif kind == "motion":
        backgrounds = [flat((0, 0, 255)), flat((0, 255, 0)), texture(10), texture(11)]
        frames = [with_square(backgrounds[n // SUITE_SHOT], 54 * n // 79, 10 + n // 8) for n in range(80)]
    else:
        wide = texture(20, 2 * SUITE_W)
        pan = [2 * min(max(i - SUITE_SHOT, 0), SUITE_SHOT) for i in range(60)]  # 0 ... 0, 2, 4 ... 40 ... 40
        frames = [with_square(wide[:, x:x + SUITE_W], 54 * i // 59, 15) for i, x in enumerate(pan)]
    pixels = torch.from_numpy(np.stack(frames)).permute(0, 3, 1, 2).contiguous()
    return mp4_bytes(pixels, 10.0), list(range(SUITE_SHOT, len(frames), SUITE_SHOT)) if kind != "none" else []


def shots_at(cuts: list[int], frames: int) -> tuple[tuple[int, int], ...]:
    starts = [0, *cuts]
    return tuple((a, b - 1) for a, b in zip(starts, [*cuts, frames]))


@pytest.mark.parametrize("kind", ["flat", "texture", "motion", "none"])
def test_the_default_detector_finds_every_hard_cut_of_the_suite(kind):
    """`--split-scenes` alone (adaptive, PySceneDetect's own default detector) with the default threshold and
    shortest shot finds every cut of the suite, each at its frame, and cuts nothing in the clip without cuts."""
    from diffprep.cli import build_parser, overrides_from
    from diffprep.config import load_settings
    from diffprep.encodings.clips import clip_spec

    typed = overrides_from(build_parser().parse_args(["raw", "--split-scenes", "--clip-mode", "chain"]))
    assert typed["video"] == {"split_scenes": "adaptive", "clip_mode": "chain"}  # the flag alone
    scene = clip_spec(load_settings(overrides=typed).video, "64x48x8", 2, 1).scenes
    assert scene.detector == "adaptive" and scene.threshold is None and scene.min_scene_seconds == 0.5
    data, cuts = suite_clip(kind)
    shots = detect_shots(data, scene.detector, scene.min_scene_seconds, threshold=scene.threshold)
    assert shots.shots == shots_at(cuts, shots.decoded_frames)


def test_scene_threshold_sets_the_detectors_own_threshold():
    """content's default 27 misses the flat blue-to-green and green-to-red cuts (about 20); --scene-threshold 18
    finds them, but also cuts where the fast pan starts and ends (21 to 27 a frame): why the default detector is
    adaptive. A threshold reaches adaptive too (its texture cuts score about 5 times their neighbours)."""
    flat_clip, flat_cuts = suite_clip("flat")
    assert detect_shots(flat_clip, "content", 0.5).shots == shots_at(flat_cuts[2:], 140)
    assert detect_shots(flat_clip, "content", 0.5, threshold=18).shots == shots_at(flat_cuts, 140)
    pan, _ = suite_clip("none")
    assert detect_shots(pan, "content", 0.5).shots == ((0, 59),)
    assert len(detect_shots(pan, "content", 0.5, threshold=18).shots) > 1
    textured, cuts = suite_clip("texture")
    assert detect_shots(textured, "adaptive", 0.5).shots == shots_at(cuts, 80)
    assert detect_shots(textured, "adaptive", 0.5, threshold=6).shots == ((0, 79),)


def test_scene_threshold_is_checked_and_fingerprinted_only_when_it_changes_the_cuts():
    import inspect

    from scenedetect import AdaptiveDetector, ContentDetector, HistogramDetector, ThresholdDetector

    from diffprep.errors import ConfigError
    from diffprep.config.scenes import DEFAULT_THRESHOLDS

    # An unset threshold is PySceneDetect's own default, so plans made before the flag keep their fingerprints.
    for name, kind, key in [("content", ContentDetector, "threshold"), ("adaptive", AdaptiveDetector,
                            "adaptive_threshold"), ("threshold", ThresholdDetector, "threshold"),
                            ("histogram", HistogramDetector, "threshold")]:
        assert DEFAULT_THRESHOLDS[name] == inspect.signature(kind).parameters[key].default
        assert SceneSettings(name, threshold=DEFAULT_THRESHOLDS[name]) == SceneSettings(name)
        assert "threshold" not in SceneSettings(name, threshold=DEFAULT_THRESHOLDS[name]).to_json()
    changed = SceneSettings("content", threshold=18)
    assert changed.to_json()["threshold"] == 18 and SceneSettings.from_json(changed.to_json()) == changed
    assert SceneSettings.from_json({"detector": "content", "min_scene_seconds": 0.5, "clip_mode": "chain",
                                    "clip_stride": None, "clips_per_scene": 1}).threshold is None
    with pytest.raises(ConfigError, match=r"--scene-threshold 2 is outside -1..1.*histogram"):
        SceneSettings("histogram", threshold=2)
    with pytest.raises(ConfigError, match=r"--scene-threshold 300 is outside 0..255.*content"):
        SceneSettings("content", threshold=300)
    # The settings refuse it before anything starts (the CLI, a YAML config, a flow's parameters).
    from diffprep.config import load_settings

    with pytest.raises(ConfigError, match=r"--scene-threshold 2 is outside -1..1.*histogram"):
        load_settings(overrides={"video": {"split_scenes": "histogram", "scene_threshold": 2}})


def test_min_scene_seconds_keeps_a_cut_from_following_too_soon():
    # The second cut is 0.5 s after the first: a 1 s shortest shot leaves it out.
    assert detect_shots(cut_clip([20, 25], 60), "content", 1.0).shots == ((0, 19), (20, 59))
    assert detect_shots(cut_clip([20, 25], 60), "content", 0.0).shots == ((0, 19), (20, 24), (25, 59))


def test_a_window_never_crosses_a_shot_and_its_frames_are_its_buckets():
    # Shots of 30, 45 and 25 frames; buckets of 8 and 20 frames.
    buckets = [Bucket(32, 24, 20), Bucket(32, 24, 8)]
    spans = [(0, 30), (30, 75), (75, 100)]
    windows, discarded = source_windows(32, 24, spans, buckets, SceneSettings(clip_mode="chain"))
    assert [(w.shot, w.first, w.last, w.bucket.frames) for w in windows] == [
        (0, 0, 19, 20), (0, 20, 27, 8), (1, 30, 49, 20), (1, 50, 69, 20), (2, 75, 94, 20)]
    assert discarded == {"chain_tail": 2 + 5 + 5}  # shot 0's tail of 10 takes an 8-frame window
    for w in windows:
        start, end = spans[w.shot]
        assert start <= w.first <= w.last < end and w.frames == w.bucket.frames
    # A shot shorter than every bucket gives no window; its frames are named.
    windows, discarded = source_windows(32, 24, [(0, 5), (5, 30)], buckets, SceneSettings(clip_mode="head"))
    assert [(w.first, w.last) for w in windows] == [(5, 24)] and discarded == {"short_shot": 5, "not_sampled": 5}


README_BUCKETS = "832x480x81;832x480x49;832x480x17"  # docs/video.md's long-video example, at --target-fps 16


def test_a_chain_fills_its_tail_with_the_shorter_buckets():
    """The docs' example buckets (docs/video.md, Long videos) on a shot of every length from one 17-frame window to 10 s at 16 fps: chaining
    only each shot's own bucket throws away 31% of the frames; filling each tail with the longest bucket that fits,
    again and again, leaves under 17 frames a shot (9%)."""
    from diffprep.media.buckets import parse_buckets

    buckets = parse_buckets(README_BUCKETS, 8, 4)
    lengths = list(range(17, 161))
    spans, start = [], 0
    for length in lengths:
        spans.append((start, start + length))
        start += length
    windows, discarded = source_windows(832, 480, spans, buckets, SceneSettings(clip_mode="chain"))
    total = sum(lengths)
    # Before: each shot chained with its own bucket only (the tail thrown away).
    before = sum(shot_windows(n, max(b.frames for b in buckets if b.frames <= n), SceneSettings())[1] for n in lengths)
    assert round(before / total, 3) == 0.306
    assert round(discarded["chain_tail"] / total, 3) == 0.085 and set(discarded) == {"chain_tail"}
    assert sum(w.frames for w in windows) + discarded["chain_tail"] == total
    for shot, (first, end) in enumerate(spans):
        mine = [w for w in windows if w.shot == shot]
        # Back to back from the shot's start, longest first, each window its bucket's length, under 17 frames left.
        assert [w.first for w in mine] == [first + sum(w.frames for w in mine[:k]) for k in range(len(mine))]
        assert [w.frames for w in mine] == sorted((w.frames for w in mine), reverse=True)
        assert all(w.frames == w.bucket.frames for w in mine) and 0 <= end - 1 - mine[-1].last < 17
    # A shot of 98 frames: 81 + 17; of 66: 49 + 17; of 40: 17 + 17 (6 left).
    assert [w.frames for w in windows if w.shot == 98 - 17] == [81, 17]
    assert [w.frames for w in windows if w.shot == 66 - 17] == [49, 17]
    assert [w.frames for w in windows if w.shot == 40 - 17] == [17, 17]


def test_chain_slide_and_uniform_give_the_windows_they_promise():
    assert shot_windows(45, 20, SceneSettings(clip_mode="head")) == ([0], 25)
    assert shot_windows(45, 20, SceneSettings(clip_mode="chain")) == ([0, 20], 5)
    assert shot_windows(45, 20, SceneSettings(clip_mode="slide", clip_stride=10)) == ([0, 10, 20], 5)
    assert shot_windows(45, 20, SceneSettings(clip_mode="slide")) == ([0, 20], 5)  # stride = the window
    assert shot_windows(45, 20, SceneSettings(clip_mode="uniform", clips_per_scene=3)) == ([0, 13, 25], 0)
    assert shot_windows(45, 20, SceneSettings(clip_mode="uniform", clips_per_scene=1)) == ([0], 25)
    assert shot_windows(21, 20, SceneSettings(clip_mode="uniform", clips_per_scene=5)) == ([0, 1], 0)
    with pytest.raises(ValueError, match="clip_mode must be one of head, chain, slide, uniform"):
        SceneSettings(clip_mode="every")


def test_shot_spans_follow_the_resampled_timeline():
    # 100 source frames at 10 fps resampled to 5 fps: timeline frame k is source frame 2k.
    timeline = list(range(0, 100, 2))
    assert shot_spans([(0, 29), (30, 74), (75, 99)], timeline) == [(0, 15), (15, 38), (38, 50)]


def test_clip_ids_round_trip():
    window = Window(2, 75, 94, Bucket(32, 24, 20))
    assert clip_id("talks/a#3.mp4", window) == "talks/a#3.mp4#2:75-94"
    assert parse_clip_id("talks/a#3.mp4#2:75-94") == ("talks/a#3.mp4", 2, 75, 94)
    assert parse_clip_id("talks/a.mp4") is None


# --- the whole run: raw video (no model), plan -> units -> audit -> finalize -> validate --------------------------

LONG_BUCKETS = "32x24x20;32x24x8"


def lying_mkv(cuts: list[int], frames: int, fps: int = 10, factor: int = 3) -> bytes:
    """A Matroska clip whose segment header states ``factor`` times its real duration (the frames unchanged)."""
    import struct

    import av

    buffer = __import__("io").BytesIO()
    with av.open(buffer, "w", format="matroska") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width, stream.height, stream.pix_fmt = 32, 24, "yuv420p"
        for frame in cut_frames(cuts, frames):
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame.permute(1, 2, 0).numpy(), format="rgb24")))
        container.mux(stream.encode())
    data = bytearray(buffer.getvalue())
    at = data.find(b"\x44\x89")  # the Segment Info's Duration element: an 8-byte float
    assert at > 0 and data[at + 2] == 0x88
    (duration,) = struct.unpack(">d", data[at + 3:at + 11])
    data[at + 3:at + 11] = struct.pack(">d", duration * factor)
    return bytes(data)


@pytest.fixture(scope="module")
def long_data(tmp_path_factory):
    root = tmp_path_factory.mktemp("long-videos") / "data"
    (root / "videos").mkdir(parents=True)
    (root / "captions").mkdir()
    (root / "videos" / "talk.mp4").write_bytes(cut_clip([30, 75], 100))
    (root / "videos" / "game.mkv").write_bytes(lying_mkv([12], 40))
    (root / "captions" / "talk.txt").write_text("a talk in three shots\n", encoding="utf-8")
    (root / "captions" / "game.txt").write_text("a game capture\n", encoding="utf-8")
    return root


def _long_settings(data, out, **video):
    from diffprep.config import load_settings

    return load_settings(overrides={
        "source": {"type": "directory", "input_dir": str(data)},
        "output": {"output_dir": str(out), "shard_size": 3, "accept_rejects": 0.0},
        "image": {"decode_workers": 1},
        "video": {"resolution_buckets": LONG_BUCKETS, "target_fps": 10, "split_scenes": "content",
                  "min_scene_seconds": 0.5, **video},
        "finalize": {"train_split": 1.0},
    })


def test_a_lying_container_is_planned_from_its_frames(long_data):
    import av

    data = (long_data / "videos" / "game.mkv").read_bytes()
    with av.open(__import__("io").BytesIO(data)) as container:
        assert container.duration / 1e6 * 10 == 120  # duration x fps says 120 frames
    from diffprep.encodings.clips import clip_spec
    from diffprep.run.long_videos import scene_record

    spec = clip_spec(_long_settings(long_data, long_data).video, LONG_BUCKETS, 2, 1)
    record = scene_record(data, spec)
    assert record["decoded_frames"] == 40 and record["timeline_frames"] == 40
    assert record["shots"] == [[0, 11], [12, 39]]
    # The 12-frame shot gives one 8-frame window, the 28-frame shot one of 20 and its tail one of 8: tails named.
    assert record["windows"] == [[0, 0, 7, "32x24x8"], [1, 12, 31, "32x24x20"], [1, 32, 39, "32x24x8"]]
    assert record["discarded"] == {"chain_tail": 4}


@pytest.mark.parametrize(("mode", "extra", "windows"), [
    ("head", {}, [[0, 0, 19], [1, 30, 49], [2, 75, 94]]),
    ("slide", {"clip_stride": 10}, [[0, 0, 19], [0, 10, 29], [1, 30, 49], [1, 40, 59], [1, 50, 69],
                                    [2, 75, 94]]),
    ("uniform", {"clips_per_scene": 2}, [[0, 0, 19], [0, 10, 29], [1, 30, 49], [1, 55, 74], [2, 75, 94],
                                         [2, 80, 99]]),
])
def test_each_clip_mode_plans_the_windows_it_promises(long_data, mode, extra, windows):
    from diffprep.encodings.clips import clip_spec
    from diffprep.run.long_videos import scene_record

    spec = clip_spec(_long_settings(long_data, long_data, clip_mode=mode, **extra).video, LONG_BUCKETS, 2, 1)
    record = scene_record((long_data / "videos" / "talk.mp4").read_bytes(), spec)
    assert [w[:3] for w in record["windows"]] == windows
    assert {w[3] for w in record["windows"]} == {"32x24x20"}
    for shot, first, last, _ in record["windows"]:
        start, end = record["shots"][shot]
        assert start <= first <= last <= end  # inside one shot (frames = the 10 fps timeline)


def test_long_videos_end_to_end_raw(prefect_server, long_data, tmp_path, monkeypatch):
    import hashlib
    import json

    from diffprep.phases.pipeline import run
    from diffprep.writer.plan import read_plan
    from flow_runs import shard_samples

    out = tmp_path / "out"
    result = run(_long_settings(long_data, out), "raw", ask=lambda *a, **k: pytest.fail(f"asked {a}"))
    assert not result.rejected and result.validation["ok"], result.validation
    plan = read_plan(out)
    assert set(plan.scenes) == {"talk.mp4", "game.mkv"}
    assert plan.scenes["talk.mp4"]["shots"] == [[0, 29], [30, 74], [75, 99]]
    planned = {sid: unit.bucket for unit in plan.units for sid in unit.source_ids}
    assert sorted(planned) == sorted(["game.mkv#0:0-7", "game.mkv#1:12-31", "game.mkv#1:32-39", "talk.mp4#0:0-19",
                                      "talk.mp4#0:20-27", "talk.mp4#1:30-49", "talk.mp4#1:50-69", "talk.mp4#2:75-94"])
    per_bucket: dict[str, int] = {}
    for bucket in planned.values():
        per_bucket[bucket] = per_bucket.get(bucket, 0) + 1
    assert result.validation["summary"]["samples_per_bucket"] == per_bucket
    # Frames no clip takes are counted and named, per source in plan.json and in total in the audit.
    assert plan.scenes["talk.mp4"]["discarded"] == {"chain_tail": 2 + 5 + 5}  # shot 0's tail: an 8-frame clip
    from diffprep import contract

    audit = json.loads((out / contract.STATE_DIR / contract.AUDIT_JSON).read_text())
    assert audit["discarded_frames"] == {"chain_tail": 12 + 4} and audit["inputs"] == len(planned)
    from diffprep.run.long_videos import scenes_table

    assert scenes_table(plan.scenes) == [
        {"source": "game.mkv", "frames": 40, "shots": 2, "clips": {"32x24x8": 2, "32x24x20": 1},
         "discarded": {"chain_tail": 4}, "note": ""},
        {"source": "talk.mp4", "frames": 100, "shots": 3, "clips": {"32x24x20": 4, "32x24x8": 1},
         "discarded": {"chain_tail": 12}, "note": ""}]

    stored = shard_samples(out)
    assert len(stored) == len(planned)
    for fields in stored.values():
        meta = json.loads(fields["json"])
        source, shot = meta["source"], meta["shot"]
        first, last = plan.scenes[source]["shots"][shot]
        assert meta["source_id"].startswith(f"{source}#{shot}:")
        assert all(first <= i <= last for i in meta["frame_indices"]), meta  # inside one shot
        assert len(meta["frame_indices"]) == int(planned[meta["source_id"]].split("x")[2])
        assert fields["txt"].decode() == (long_data / "captions" / (source.rsplit(".", 1)[0] + ".txt")).read_text().strip()

    # decode: each stored clip beside its window re-read from the source.
    from diffprep.validation.decode import decode_dataset

    report = decode_dataset(out, 3, to_dir=tmp_path / "previews")
    assert report.previews and all(p.psnr_db is not None and p.psnr_db > 25 for p in report.previews), report

    # A re-run reads the shots from plan.json (no detection) and writes nothing new; a fresh output: same bytes.
    import diffprep.run.long_videos as long_videos

    def no_detection(*args, **kwargs):
        raise AssertionError("shots detected again")

    monkeypatch.setattr(long_videos, "detect_shots", no_detection)
    again = run(_long_settings(long_data, out), "raw", ask=lambda *a, **k: "resume")
    assert again.validation["ok"] and read_plan(out).scenes == plan.scenes
    monkeypatch.undo()
    # `diffprep raw` in another process, two decode threads, the shots found again: the same bytes.
    import os
    import subprocess
    import sys
    from pathlib import Path

    from prefect.settings import PREFECT_API_URL

    fresh = tmp_path / "fresh"
    cli = subprocess.run(
        [sys.executable, "-m", "diffprep", "raw", "--source-type", "directory", "--input-dir", str(long_data),
         "--output-dir", str(fresh), "--shard-size", "3", "--resolution-buckets", LONG_BUCKETS, "--target-fps", "10",
         "--split-scenes", "content", "--min-scene-seconds", "0.5", "--clip-mode", "chain",
         "--decode-workers", "2", "--train-split", "1.0"],
        env=os.environ | {"PREFECT_API_URL": PREFECT_API_URL.value(),
                          "PYTHONPATH": str(Path(__file__).resolve().parents[1])},
        capture_output=True, text=True, timeout=300)
    assert cli.returncode == 0, cli.stdout[-2000:] + cli.stderr[-2000:]
    assert read_plan(fresh).scenes == plan.scenes

    # SIGKILLed at its fifth sample write (inside the second unit), then resumed: the same shards.
    from diffprep.cli import main
    from diffprep.run.failpoints import ENV as FAILPOINT_ENV

    killed = tmp_path / "killed"
    args = ["raw", "--source-type", "directory", "--input-dir", str(long_data), "--output-dir", str(killed),
            "--shard-size", "3", "--resolution-buckets", LONG_BUCKETS, "--target-fps", "10",
            "--split-scenes", "content", "--train-split", "1.0"]
    dead = subprocess.run([sys.executable, "-m", "diffprep", *args],
                          env=os.environ | {"PREFECT_API_URL": PREFECT_API_URL.value(), FAILPOINT_ENV: "shard-write@5",
                                            "PYTHONPATH": str(Path(__file__).resolve().parents[1])},
                          capture_output=True, text=True, timeout=300)
    assert dead.returncode != 0 and len(list(killed.glob("*.tar"))) < len(plan.units), dead.stdout[-2000:]
    assert main([*args, "--on-existing", "resume"]) == 0

    def hashes(path):
        return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.glob("*.tar"))}

    assert hashes(fresh) == hashes(out) == hashes(killed) and hashes(out)

    # An append: a new source is split, the planned ones keep their shots and units (no detection for them).
    detected = []
    real = long_videos.detect_shots

    def counting(data, *args, **kwargs):
        detected.append(len(data))
        return real(data, *args, **kwargs)

    monkeypatch.setattr(long_videos, "detect_shots", counting)
    (long_data / "videos" / "extra.mp4").write_bytes(cut_clip([25], 50))
    (long_data / "captions" / "extra.txt").write_text("one more\n", encoding="utf-8")
    try:
        grown = run(_long_settings(long_data, out), "raw", ask=lambda *a, **k: "resume")
    finally:
        (long_data / "videos" / "extra.mp4").unlink()
        (long_data / "captions" / "extra.txt").unlink()
    appended = read_plan(out)
    assert len(detected) == 1 and grown.validation["ok"]
    assert appended.units[:len(plan.units)] == plan.units
    assert {k: v for k, v in appended.scenes.items() if k != "extra.mp4"} == plan.scenes
    assert [sid for u in appended.units[len(plan.units):] for sid in u.source_ids] == [
        "extra.mp4#0:0-19", "extra.mp4#1:25-44"]
    assert hashes(out)  # the old shards untouched
    for name, digest in hashes(fresh).items():
        assert hashes(out)[name] == digest


def test_a_changed_source_is_reported_not_split_again():
    from diffprep.run.long_videos import changed_sources

    records = {"a.mp4": {"stamp": "10 100"}, "b.mp4": {"stamp": "20 200"}, "c.mp4": {}}
    assert changed_sources(records, {"a.mp4": "10 100", "b.mp4": "21 200", "c.mp4": "1"}) == ["b.mp4"]


def keyframed_clip(frames: int, gop: int, fps: int = 10) -> bytes:
    """An H.264 mp4 with a key frame every ``gop`` frames (no scene-cut key frames): seeking can skip ahead."""
    import io

    import av

    buffer = io.BytesIO()
    with av.open(buffer, "w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=fps, options={"g": str(gop), "keyint_min": str(gop),
                                                                    "sc_threshold": "0", "threads": "1"})
        stream.width, stream.height, stream.pix_fmt = 32, 24, "yuv420p"
        for frame in cut_frames([], frames):
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame.permute(1, 2, 0).numpy(), format="rgb24")))
        container.mux(stream.encode())
    return buffer.getvalue()


def test_a_window_is_decoded_from_the_key_frame_before_it_not_from_the_start():
    from diffprep.media.mp4 import mp4_frames
    from diffprep.media.window_decode import decode_window

    data = keyframed_clip(200, gop=10)
    everything = mp4_frames(data)
    work: dict[str, int] = {}
    pixels, meta = decode_window(data, Bucket(32, 24, 20), 150, 169, target_fps=None, work=work)
    assert torch.equal(pixels, everything[150:170])  # the same frames as decoding from the start
    assert meta["frame_indices"] == list(range(150, 170)) and meta["window"] == [150, 169]
    assert work["decoded"] <= 20 + 10  # the window and at most one group of pictures before it, not 170
    # At 5 fps the timeline takes every other frame: window 10..19 is source frames 20..38.
    pixels, meta = decode_window(data, Bucket(32, 24, 10), 10, 19, target_fps=5, work=work)
    assert meta["frame_indices"] == list(range(20, 40, 2)) and torch.equal(pixels, everything[20:40:2])
    from diffprep.errors import RejectError

    with pytest.raises(RejectError, match="window_out_of_range|the file changed"):
        decode_window(data, Bucket(32, 24, 20), 190, 209, target_fps=None)
    with pytest.raises(RejectError) as error:
        decode_window(data, Bucket(32, 24, 8), 0, 19, target_fps=None)
    assert error.value.reason == "window_frames_mismatch"


def test_long_videos_through_the_tiny_wan_encoders(long_data, tiny_wan, tmp_path):
    """The same windows pre-encoded by Wan's VAE: every clip a sample of its bucket's latent shape."""
    from diffprep.config import load_settings
    from diffprep.phases.pipeline import run
    from diffprep.writer.plan import read_plan

    out = tmp_path / "wan"
    settings = load_settings(overrides={
        "source": {"type": "directory", "input_dir": str(long_data)},
        "output": {"output_dir": str(out), "shard_size": 4, "accept_rejects": 0.0},
        "model": {"model_path": str(tiny_wan), "precision": "fp32", "device": "cpu", "batch_size": 2,
                  "t5_max_length": 16, "latent_mode": "mode", "min_psnr": 0.0},
        "video": {"resolution_buckets": "32x24x17;32x24x5", "target_fps": 10, "split_scenes": "content",
                  "clip_mode": "head"},
        "finalize": {"train_split": 1.0},
    })
    result = run(settings, "preencoded", ask=lambda *a, **k: pytest.fail(f"asked {a}"))
    assert not result.rejected and result.validation["ok"], result.validation
    plan = read_plan(out)
    ids = sorted(sid for unit in plan.units for sid in unit.source_ids)
    assert ids == ["game.mkv#0:0-4", "game.mkv#1:12-28", "talk.mp4#0:0-16", "talk.mp4#1:30-46", "talk.mp4#2:75-91"]
    assert result.validation["summary"]["samples_per_bucket"] == {"32x24x17": 4, "32x24x5": 1}


def test_the_plan_names_its_short_shots_and_asks_before_encoding(tmp_path):
    """A 6-frame shot (shorter than every bucket): the plan's table counts it, and the run asks before any
    encoding, offering the bucket that keeps it; an accept holds for the same shots, --accept-rejects above the
    fraction asks nothing."""
    from diffprep import contract
    from diffprep.run.approvals import ApprovalRefused
    from diffprep.run.long_videos import scenes_markdown, scenes_summary
    from diffprep.phases.pipeline import run
    from diffprep.writer.plan import read_plan

    data = tmp_path / "data"
    (data / "videos").mkdir(parents=True)
    (data / "captions").mkdir()
    (data / "videos" / "cut.mp4").write_bytes(cut_clip([30, 36], 60))
    (data / "captions" / "cut.txt").write_text("three shots, one short\n", encoding="utf-8")
    out = tmp_path / "out"
    settings = _long_settings(data, out)
    settings.output.accept_rejects = None
    asked = []

    def abort(question, preset=None, *, release=False):
        asked.append(question)
        return question.check("abort")

    with pytest.raises(ApprovalRefused, match="aborted"):
        run(settings, "raw", ask=abort)
    [question] = asked
    assert question.key == "discarded-frames" and "**6 of 60 frames**" in question.description
    assert "a clip of 6 frames" in question.description
    assert '--resolution-buckets "32x24x20;32x24x8;32x24x6"' in question.description  # the bucket that keeps it
    assert not list(out.glob("*.tar"))  # nothing encoded
    plan = read_plan(out)
    assert plan.scenes["cut.mp4"]["short_shots"] == [6] and plan.scenes["cut.mp4"]["discarded"]["short_shot"] == 6
    summary = scenes_summary(plan.scenes)
    assert summary == {"sources": 1, "unreadable": 0, "shots": 3, "frames": 60,
                       "clips": {"32x24x20": 2, "32x24x8": 1}, "discarded": {"chain_tail": 2 + 4, "short_shot": 6}}
    markdown = scenes_markdown(plan.scenes)
    assert "| 32x24x20 | 2 | 40 |" in markdown and "| `short_shot` | 6 |" in markdown and "`cut.mp4`" in markdown

    accepted = []
    result = run(settings, "raw", ask=lambda q, preset=None, *, release=False: accepted.append(q.key) or "accept")
    assert accepted == ["discarded-frames"] and result.samples == 3 and result.scenes == summary
    assert (out / contract.STATE_DIR / contract.DISCARD_ANSWER_JSON).is_file()
    settings.output.on_existing = "resume"
    run(settings, "raw", ask=lambda q, *a, **k: pytest.fail(f"asked {q.key}"))  # the same shots: not asked again
    settings.output.accept_rejects = 0.1  # 6 / 60 frames: accepted ahead of time
    from diffprep.run.long_videos import confirm_discarded
    from diffprep.output import Output

    (out / contract.STATE_DIR / contract.DISCARD_ANSWER_JSON).unlink()
    confirm_discarded(plan.scenes, Output(out), 0.1, lambda *a, **k: pytest.fail("asked"), lambda found: "")


def av_cut_clip(path, cuts: list[int], frames: int, *, fps: int = 24, size: int = 64, rate: int = 16000,
                codec: str = "aac") -> "np.ndarray":
    """A clip with hard cuts at ``cuts`` and a sound track (a tone rising with time): the samples written."""
    from fractions import Fraction

    import av
    import numpy as np

    seconds = frames / fps
    time = np.arange(int(seconds * rate), dtype=np.float32) / rate
    samples = (0.3 * np.sin(2 * np.pi * (200.0 + 300.0 * time) * time)).astype(np.float32)[None].repeat(2, 0)
    with av.open(str(path), mode="w") as out:
        video = out.add_stream("libx264", rate=fps)
        video.width, video.height, video.pix_fmt = size, size, "yuv420p"
        audio = out.add_stream(codec, rate=rate, layout="stereo")
        fmt = "fltp" if codec == "aac" else "s16"
        for start in [*range(0, samples.shape[1], 1024), None]:
            frame = None
            if start is not None:
                chunk = np.ascontiguousarray(samples[:, start:start + 1024])
                if fmt == "s16":
                    chunk = np.ascontiguousarray((chunk * 32767).astype(np.int16).T.reshape(1, -1))
                frame = av.AudioFrame.from_ndarray(chunk, format=fmt, layout="stereo")
                frame.sample_rate, frame.pts = rate, start
            for packet in audio.encode(frame):
                out.mux(packet)
        for index, pixels in enumerate(cut_frames(cuts, frames, size, size)):
            frame = av.VideoFrame.from_ndarray(pixels.permute(1, 2, 0).numpy(), format="rgb24")
            frame.pts, frame.time_base = index, Fraction(1, fps)
            out.mux(video.encode(frame))
        out.mux(video.encode())
    return samples


def test_a_window_gets_the_sound_of_its_own_frames(tmp_path):
    """load_clip_audio(start=...) seeks and drops the samples before the window: PCM exactly, AAC within its
    frame's rounding."""
    import io

    from diffprep.media.audio import load_clip_audio

    path = tmp_path / "pcm.mkv"
    av_cut_clip(path, [20], 40, codec="pcm_s16le")
    whole = load_clip_audio(io.BytesIO(path.read_bytes()))
    window = load_clip_audio(io.BytesIO(path.read_bytes()), start=0.75, duration=9 / 24)
    first = round(0.75 * whole.sample_rate)
    assert torch.equal(window.waveform, whole.waveform[:, first:first + int(9 / 24 * whole.sample_rate)])
    path = tmp_path / "aac.mp4"
    av_cut_clip(path, [20], 40)
    whole = load_clip_audio(io.BytesIO(path.read_bytes()))
    window = load_clip_audio(io.BytesIO(path.read_bytes()), start=0.75, duration=9 / 24)
    expected = whole.waveform[:, first:first + window.waveform.shape[1]]
    assert window.waveform.shape == expected.shape and (window.waveform - expected).abs().max() < 1e-3


def test_long_videos_with_audio_in_the_ltx_layout(tiny_ltx2, tmp_path):
    """LTX-2 with its audio: every window's records under a name of its own (the trainer pairs them by relative
    path), its audio latents the window's F / fps seconds."""
    import json

    from diffprep import contract
    from diffprep.config import load_settings
    from diffprep.phases.pipeline import run

    data = tmp_path / "data"
    (data / "clips").mkdir(parents=True)
    av_cut_clip(data / "clips" / "talk.mp4", [20], 40)
    listing = data / "dataset.json"
    listing.write_text(json.dumps([{"video": "clips/talk.mp4", "caption": "a talk"}]), encoding="utf-8")
    settings = load_settings(overrides={
        "source": {"type": "metadata", "metadata_file": str(listing)},
        "output": {"output_dir": str(data), "shard_size": 4, "layout": "ltx", "accept_rejects": 0.0},
        "model": {"model_path": str(tiny_ltx2), "precision": "fp32", "device": "cpu", "batch_size": 2,
                  "min_psnr": 0.0},
        "video": {"resolution_buckets": "64x64x9", "split_scenes": "content", "min_scene_seconds": 0.5},
        "finalize": {"train_split": 1.0},
    })
    result = run(settings, "preencoded", ask=lambda q, *a, **k: pytest.fail(f"asked {q.key}"))
    assert result.samples == 4 and result.validation["ok"], result.validation
    root = data / contract.PRECOMPUTED_DIR
    names = ["talk-shot0-0-8.pt", "talk-shot0-9-17.pt", "talk-shot1-20-28.pt", "talk-shot1-29-37.pt"]
    for kind in ("latents", "conditions", "audio_latents"):
        assert sorted(p.name for p in (root / kind / "clips").glob("*.pt")) == names
    for name in names:
        audio = torch.load(root / "audio_latents" / "clips" / name, weights_only=True)
        assert audio["duration"] == pytest.approx(9 / 24, abs=1e-3)
        assert torch.load(root / "latents" / "clips" / name, weights_only=True)["latents"].shape[1] == 2
    assert not any("#" in p.name or ":" in p.name for p in root.rglob("*"))


def test_scene_captions_caption_a_shot_or_one_window(long_data, tmp_path, caplog):
    import json

    from diffprep.encodings.clips import clip_spec
    from diffprep.errors import ConfigError
    from diffprep.run.long_videos import plan_clips, read_clips
    from diffprep.media.windows import read_scene_captions
    from diffprep.sources import open_source

    captions = tmp_path / "scenes.json"
    captions.write_text(json.dumps({"talk.mp4#1": "the second shot", "talk.mp4#0:0-19": "the first window",
                                    "gone.mp4#3": "nothing"}), encoding="utf-8")
    settings = _long_settings(long_data, tmp_path / "out", scene_captions=str(captions))
    spec = clip_spec(settings.video, LONG_BUCKETS, 2, 1)
    assert spec.scenes.to_json()["captions"] == [["gone.mp4#3", "nothing"], ["talk.mp4#0:0-19", "the first window"],
                                                 ["talk.mp4#1", "the second shot"]]
    assert "captions" not in clip_spec(_long_settings(long_data, tmp_path).video, LONG_BUCKETS, 2, 1).scenes.to_json()
    source = open_source(settings.source)
    with caplog.at_level("WARNING", logger="diffprep.long_videos"):
        ids, _, _ = plan_clips(source, ["talk.mp4"], spec, {}, workers=1)
    assert "gone.mp4#3" in caplog.text  # a key that names nothing is named
    got = {s.source_id: s.caption for s in read_clips(source, ids, spec.scenes)}
    assert got == {"talk.mp4#0:0-19": "the first window", "talk.mp4#0:20-27": "a talk in three shots",
                   "talk.mp4#1:30-49": "the second shot",
                   "talk.mp4#1:50-69": "the second shot", "talk.mp4#2:75-94": "a talk in three shots"}
    captions.write_text(json.dumps({"talk.mp4": "no shot"}), encoding="utf-8")
    with pytest.raises(ConfigError, match="keys must be"):
        read_scene_captions(str(captions))
    captions.write_text("[1, 2]", encoding="utf-8")
    with pytest.raises(ConfigError, match="JSON object of captions"):
        read_scene_captions(str(captions))


def test_a_fixed_source_is_split_again_and_its_old_reject_gives_way(tmp_path):
    """A source every clip of which was rejected (here: the file did not decode) and whose file changed since is
    split again in the next run, in new units; its old reject is superseded, the audit counts the new clips."""
    from diffprep.phases.pipeline import run
    from diffprep.writer.plan import read_plan

    data = tmp_path / "data"
    (data / "videos").mkdir(parents=True)
    (data / "captions").mkdir()
    (data / "videos" / "good.mp4").write_bytes(cut_clip([20], 40))
    (data / "videos" / "bad.mp4").write_bytes(b"not a video")
    for name in ("good", "bad"):
        (data / "captions" / f"{name}.txt").write_text(f"the {name} one\n", encoding="utf-8")
    settings = _long_settings(data, tmp_path / "out")
    settings.output.accept_rejects = 1.0
    first = run(settings, "raw", ask=lambda q, *a, **k: pytest.fail(f"asked {q.key}"))
    assert first.rejected == 1 and first.samples == 2
    (data / "videos" / "bad.mp4").write_bytes(cut_clip([12], 30))
    settings.output.on_existing, settings.output.accept_rejects = "resume", 0.0
    second = run(settings, "raw", ask=lambda q, *a, **k: pytest.fail(f"asked {q.key}"))
    plan = read_plan(tmp_path / "out")
    assert second.rejected == 0 and second.samples == 2 + 3 and second.retried == 1, second
    assert plan.scenes["bad.mp4"]["shots"] == [[0, 11], [12, 29]] and not plan.missing_count
    assert sorted(sid for unit in plan.units if unit.unit >= 2 for sid in unit.source_ids) == [
        "bad.mp4#0:0-7", "bad.mp4#1:12-19", "bad.mp4#1:20-27"]
    [old] = [unit.unit for unit in plan.units if "bad.mp4" in unit.source_ids]  # its reject, superseded
    assert set(plan.retried) == {"bad.mp4"} and plan.retried["bad.mp4"] > old
