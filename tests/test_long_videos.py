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
