"""Long videos: shots found once in the plan, windows inside each shot, each window in its bucket.

Tiny real mp4 clips with hard cuts at known frames (solid blocks of very different colour and brightness).
"""

from __future__ import annotations

import pytest
import torch

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
        (0, 0, 19, 20), (1, 30, 49, 20), (1, 50, 69, 20), (2, 75, 94, 20)]
    assert discarded == {"chain_tail": 10 + 5 + 5}
    for w in windows:
        start, end = spans[w.shot]
        assert start <= w.first <= w.last < end and w.frames == w.bucket.frames
    # A shot shorter than every bucket gives no window; its frames are named.
    windows, discarded = source_windows(32, 24, [(0, 5), (5, 30)], buckets, SceneSettings(clip_mode="head"))
    assert [(w.first, w.last) for w in windows] == [(5, 24)] and discarded == {"short_shot": 5, "not_sampled": 5}


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

