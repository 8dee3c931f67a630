"""diffprep.sources.scenes.cameras alone: each conversion against a hand-made camera, the checks' rejects, the crop + resize
rule against Pillow's real resize (markers re-project within a fraction of a pixel; the pixel-centre-at-integer
rule is measurably worse), and the frame sampling and chunk rules of media/scene_sampling.py by hand."""

from __future__ import annotations

import math

import numpy as np
import pytest
from PIL import Image

from diffprep.sources.scenes import cameras
from diffprep.sources.scenes.sampling import chunk_ranges, kept_indices, progressive_indices, uniform_indices
from scene_render import default_K, draw, marker_error, path_c2w


def rotation(axis: str, degrees: float) -> np.ndarray:
    a = math.radians(degrees)
    c, s = math.cos(a), math.sin(a)
    return {"x": np.array([[1, 0, 0], [0, c, -s], [0, s, c]]), "y": np.array([[c, 0, s], [0, 1, 0], [-s, 0, c]]),
            "z": np.array([[c, -s, 0], [s, c, 0], [0, 0, 1]])}[axis]


def pose(R: np.ndarray, t) -> np.ndarray:
    out = np.eye(4)
    out[:3, :3], out[:3, 3] = R, t
    return out


def test_opengl_to_opencv_keeps_the_centre_and_flips_y_and_z():
    gl = pose(rotation("y", 30), [1.0, 2.0, 3.0])
    cv = cameras.opengl_to_opencv(gl)
    assert np.allclose(cv[:3, 3], [1, 2, 3])
    assert np.allclose(cv[:3, 0], gl[:3, 0])
    assert np.allclose(cv[:3, 1], -gl[:3, 1]) and np.allclose(cv[:3, 2], -gl[:3, 2])
    # A point straight ahead of an OpenGL camera (its -z) is straight ahead (+z) of the OpenCV one.
    ahead = gl[:3, 3] - 2.0 * gl[:3, 2]
    uv, z = cameras.project(cv, cameras.intrinsics(10, 10, 5, 5), ahead[None])
    assert z[0] == pytest.approx(2.0) and np.allclose(uv[0], [5, 5])


def test_world_to_camera_inverse_and_3x4():
    c2w = pose(rotation("z", 20) @ rotation("x", -10), [0.5, -1.0, 2.0])
    w2c = np.linalg.inv(c2w)
    assert np.allclose(cameras.w2c_to_c2w(w2c), c2w, atol=1e-12)
    assert cameras.as_4x4(c2w[:3].tolist()).tolist() == c2w.tolist()
    with pytest.raises(cameras.CameraError, match="shape"):
        cameras.as_4x4([[1, 2, 3]])
    with pytest.raises(cameras.CameraError, match="singular"):
        cameras.w2c_to_c2w(np.zeros((4, 4)))


def test_normalized_and_rescaled_intrinsics():
    K = cameras.from_normalized(0.5, 0.8, 0.5, 0.5, 640, 360)
    assert K.tolist() == [[320, 0, 320], [0, 288, 180], [0, 0, 1]]
    assert cameras.rescale(K, (640, 360), (160, 90)).tolist() == [[80, 0, 80], [0, 72, 45], [0, 0, 1]]


def test_colmap_quaternion_round_trip():
    for R in (rotation("x", 170), rotation("y", -95) @ rotation("z", 40), np.eye(3), rotation("z", 180)):
        q = cameras.rotation_to_quaternion(R)
        assert np.allclose(cameras.quaternion_to_rotation(*q), R, atol=1e-12)
    # COLMAP: a 90 degree turn about y, camera at x=2: w2c t = -R c.
    R = rotation("y", 90)
    q = cameras.rotation_to_quaternion(R)
    c2w = cameras.colmap_c2w(q, -R @ np.array([2.0, 0, 0]))
    assert np.allclose(c2w[:3, 3], [2, 0, 0]) and np.allclose(c2w[:3, :3], R.T)


def test_crop_then_resize_intrinsics_by_hand():
    K = cameras.intrinsics(100, 90, 60, 40)
    assert np.allclose(cameras.crop_resize(K, 20, 0, 80, 40), [[50, 0, 20], [0, 45, 20], [0, 0, 1]])


@pytest.mark.parametrize("resolution", [64, 48, 32])
def test_crop_resize_reprojects_through_pillows_resize(resolution):
    """The rule in the pixel-corner convention is exact for Pillow's resize; the pixel-centre-at-integer rule
    (``(c + 0.5) s - 0.5`` applied to a corner-convention K) is off by ``0.5 (1 - s)``."""
    K = default_K(96, 64)
    worst, worst_other = 0.0, 0.0
    for c2w in path_c2w(4):
        frame = draw(c2w, K, (96, 64))
        stored = np.asarray(Image.fromarray(frame).resize((resolution, resolution), Image.Resampling.BOX,
                                                          box=(16, 0, 80, 64)))[None]
        Kr = cameras.crop_resize(K, 16, 0, 64, resolution)
        worst = max(worst, marker_error(c2w[None], Kr, stored, margin=3))
        scale = resolution / 64
        other = Kr.copy()
        other[:2, 2] = (K[:2, 2] - [16, 0] + 0.5) * scale - 0.5
        worst_other = max(worst_other, marker_error(c2w[None], other, stored, margin=3))
    assert worst < 0.3
    if resolution == 32:
        assert worst < 0.12 and worst_other > worst + 0.15


def test_checks_name_the_problem():
    good = pose(rotation("y", 10), [0, 0, 1])
    assert cameras.pose_problem(good) is None
    nan = good.copy()
    nan[0, 3] = np.nan
    assert cameras.pose_problem(nan)[0] == "invalid_pose"
    row = good.copy()
    row[3] = [0, 0, 1, 1]
    assert "last row" in cameras.pose_problem(row)[1]
    flipped = good @ np.diag([1, 1, -1, 1])
    assert cameras.pose_problem(flipped) == ("invalid_rotation", cameras.pose_problem(flipped)[1])
    assert "reflection" in cameras.pose_problem(flipped)[1]
    sheared = good.copy()
    sheared[0, 1] += 0.01
    assert cameras.pose_problem(sheared)[0] == "invalid_rotation"
    assert cameras.intrinsics_problem(cameras.intrinsics(10, 10, 5, 5), (10, 10)) is None
    assert cameras.intrinsics_problem(cameras.intrinsics(0, 10, 5, 5))[0] == "invalid_intrinsics"
    assert "outside" in cameras.intrinsics_problem(cameras.intrinsics(10, 10, 50, 5), (10, 10))[1]


def test_uniform_sampling_by_hand():
    assert uniform_indices(10, 4) == [0, 3, 6, 9]
    assert uniform_indices(6, 5) == [0, 1, 2, 4, 5]  # 2.5 rounds to the even 2 (Python's round, as GAE)
    assert uniform_indices(7, 1) == [3]
    assert uniform_indices(3, 5) == [0, 1, 2]
    assert kept_indices(np.tile(np.eye(4), (9, 1, 1)), 3, "head") == [0, 1, 2]
    assert kept_indices(np.tile(np.eye(4), (9, 1, 1)), None, "uniform") == list(range(9))


def centres(xs) -> np.ndarray:
    return np.array([[x, 0.0, 0.0] for x in xs])


def test_progressive_sampling_by_hand():
    # 21 cameras 0.1 apart along x: extent 2.0, so steps of 0.05 normalized -- within [0.005, 0.2]: every frame.
    assert progressive_indices(centres(np.arange(21) * 0.1), 5) == [0, 1, 2, 3, 4]
    # Frames 0-9 standing still, then 20 moving 0.05 a frame (extent 1.0). Frames 1..8 do not move (d < 0.005):
    # the 8th skip forces frame 8 in; frame 9 (still) is skipped once; frame 10 moved 0.05: taken; then each one.
    xs = [0.0] * 10 + list(np.linspace(0.05, 1.0, 20))
    assert progressive_indices(centres(xs), 6) == [0, 8, 10, 11, 12, 13]
    # A camera jumping between x=0 and x=1 (20 frames): from a frame at 0, the jumps (d=1 > 0.2) and the stills
    # (d=0) are skips; the 8th skip is a still, taken (frames 8, 16): 3 < 0.8 * 4, so the fallback (skip 16) runs:
    # [0, 16]; midpoint rounds add 8, then 4 and 12: [0, 4, 8, 12, 16], the first 4 kept.
    far = [0.0, 1.0] * 10
    assert progressive_indices(centres(far), 4) == [0, 4, 8, 12]


def test_chunk_ranges():
    assert chunk_ranges(450, 400) == [(0, 450)]
    assert chunk_ranges(650, 400) == [(0, 400), (400, 650)]
    assert chunk_ranges(999, 400) == [(0, 400), (400, 999)]
    assert chunk_ranges(1200, 400) == [(0, 400), (400, 800), (800, 1200)]
    assert chunk_ranges(999, None) == [(0, 999)]
