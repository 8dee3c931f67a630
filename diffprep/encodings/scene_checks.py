"""The checks every stored posed scene passes, whatever its layout: each frame's camera, and the video, arrays and
depth maps agreeing with each other and with the plan (validation, sanity and the writers run them).

Also the two array forms a scene's cameras are stored in: ``.npy`` bytes (plain arrays, no pickle) and
intrinsics as rows ``fx fy cx cy``.
"""

from __future__ import annotations

import io
from collections.abc import Mapping
from typing import Any

import numpy as np

from diffprep.errors import DatasetValidationError
from diffprep.media.mp4 import mp4_frames

ROTATION_TOLERANCE = 1e-3
PRINCIPAL_POINT_SPAN = 1.25  # the principal point must lie inside the frame scaled by this about its centre


def intrinsics_rows(K: np.ndarray) -> np.ndarray:
    """``[N, 3, 3]`` pinhole matrices -> float32 ``[N, 4]`` rows ``fx fy cx cy``."""
    K = np.asarray(K, dtype=np.float64)
    return np.stack([K[:, 0, 0], K[:, 1, 1], K[:, 0, 2], K[:, 1, 2]], axis=1).astype(np.float32)


def camera_problems(c2w: np.ndarray, K: np.ndarray, width: int, height: int) -> list[str]:
    """What is wrong with each frame's camera (empty: nothing): finite values, last row ``[0, 0, 0, 1]``, a rotation
    within ``ROTATION_TOLERANCE`` (orthonormal, det 1), ``fx, fy > 0``, the principal point inside the frame
    scaled by ``PRINCIPAL_POINT_SPAN`` about its centre. ``K``: ``[N, 3, 3]`` or rows ``[N, 4]``."""
    c2w, K = np.asarray(c2w, dtype=np.float64), np.asarray(K, dtype=np.float64)
    if c2w.ndim != 3 or c2w.shape[1:] != (4, 4):
        return [f"camera-to-world has shape {list(c2w.shape)}, expected [N, 4, 4]"]
    rows = K if K.ndim == 2 else (intrinsics_rows(K) if K.ndim == 3 and K.shape[1:] == (3, 3) else None)
    if rows is None or rows.shape != (len(c2w), 4):
        return [f"intrinsics have shape {list(K.shape)} for {len(c2w)} frames, expected [N, 3, 3] or [N, 4]"]
    problems = []
    half_w, half_h = PRINCIPAL_POINT_SPAN * width / 2, PRINCIPAL_POINT_SPAN * height / 2
    for i, (pose, (fx, fy, cx, cy)) in enumerate(zip(c2w, rows)):
        if not (np.isfinite(pose).all() and np.isfinite([fx, fy, cx, cy]).all()):
            problems.append(f"frame {i}: non-finite camera values")
            continue
        if not np.allclose(pose[3], [0, 0, 0, 1], atol=1e-6):
            problems.append(f"frame {i}: last row of camera-to-world is {pose[3].tolist()}, not [0, 0, 0, 1]")
        rotation = pose[:3, :3]
        error = float(np.abs(rotation.T @ rotation - np.eye(3)).max())
        det = float(np.linalg.det(rotation))
        if error > ROTATION_TOLERANCE or abs(det - 1) > ROTATION_TOLERANCE:
            problems.append(f"frame {i}: not a rotation (|R^T R - I| {error:.2e}, det {det:.4f})")
        if not (fx > 0 and fy > 0):
            problems.append(f"frame {i}: focal lengths fx {fx:.3f}, fy {fy:.3f} must be > 0")
        if abs(cx - width / 2) > half_w or abs(cy - height / 2) > half_h:
            problems.append(f"frame {i}: principal point ({cx:.1f}, {cy:.1f}) outside {PRINCIPAL_POINT_SPAN}x the "
                            f"{width}x{height} frame")
    return problems


def npy(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, np.ascontiguousarray(array), allow_pickle=False)
    return buffer.getvalue()


def load_npy(data: bytes, *, key: str, field: str) -> np.ndarray:
    try:
        return np.load(io.BytesIO(data), allow_pickle=False)
    except Exception as error:  # noqa: BLE001 - any unreadable array is named with its sample
        raise DatasetValidationError(f"sample {key} {field} is not a plain .npy array: {error}") from None



def check_scene(key: str, video: bytes, c2w: np.ndarray, K: np.ndarray, meta: Mapping[str, Any],
                depth: np.ndarray | None, expected: Mapping[str, Any] | None) -> list[str]:
    """Every check of one stored scene: its cameras, the mp4's decoded frame count and size against its metadata and
    arrays, the depth maps' count and dtype, the planned frame count and size."""
    problems = []
    count, width, height = meta.get("num_frames"), meta.get("width"), meta.get("height")
    try:
        frames = mp4_frames(video)
    except Exception as error:  # noqa: BLE001 - an unreadable video is a finding
        return [f"{key}: the mp4 does not decode ({type(error).__name__}: {error})"]
    if (frames.shape[0], frames.shape[3], frames.shape[2]) != (count, width, height):
        problems.append(f"{key}: the mp4 decodes to {frames.shape[0]} frames of {frames.shape[3]}x{frames.shape[2]}, "
                        f"its metadata says {count} of {width}x{height}")
    if len(c2w) != frames.shape[0] or len(K) != frames.shape[0]:
        problems.append(f"{key}: {len(c2w)} poses and {len(K)} intrinsics for {frames.shape[0]} frames")
    else:
        problems += [f"{key} {p}" for p in camera_problems(c2w, K, int(frames.shape[3]), int(frames.shape[2]))[:5]]
    if depth is not None:
        if depth.dtype != np.uint16 or depth.ndim != 3 or len(depth) != frames.shape[0]:
            problems.append(f"{key}: depth {depth.dtype} {list(depth.shape)} for {frames.shape[0]} frames, expected "
                            "uint16 [N, d, d]")
    elif expected and expected.get("depth"):
        problems.append(f"{key}: no depth maps; the plan writes them")
    if expected:
        if expected.get("frames") and frames.shape[0] != expected["frames"]:
            problems.append(f"{key}: {frames.shape[0]} frames, the plan keeps {expected['frames']}")
        if expected.get("size") and [frames.shape[3], frames.shape[2]] != list(expected["size"]):
            problems.append(f"{key}: {frames.shape[3]}x{frames.shape[2]}, the plan stores {expected['size']}")
    return problems


__all__ = ["PRINCIPAL_POINT_SPAN", "ROTATION_TOLERANCE", "camera_problems", "check_scene", "intrinsics_rows",
           "load_npy", "npy"]
