"""Every camera convention a scene format uses, converted once, to what diffprep stores: an OpenCV
camera-to-world 4x4 (+x right, +y down, +z forward, float64) and a 3x3 pinhole K in pixels.

Pixel coordinates (all K here, in and out): continuous, origin at the image's top-left *corner*; pixel
``(i, j)`` (column, row) covers ``[i, i+1) x [j, j+1)`` and its centre is ``(i + 0.5, j + 0.5)``. This is
COLMAP's convention (the upper-left pixel's centre is (0.5, 0.5)), the one nerfstudio's rays and
RealEstate10K's normalized intrinsics use, and the one in which GAE's rules are exact:

- rescaling a K from the ``w, h`` a file states to the real image size is ``fx, cx *= W/w``, ``fy, cy *= H/h``;
- a crop at ``(x0, y0)`` shifts the principal point (``cx -= x0``, ``cy -= y0``);
- a resize of a ``side x side`` box to ``res x res`` scales fx, fy, cx, cy by ``res / side``.

Pillow's ``resize(size, box=...)`` maps output pixel centres the same way (output centre ``i + 0.5`` samples
the source at ``x0 + (i + 0.5) * side / res``), so a point re-projects onto the stored pixels exactly. (In
OpenCV's "centre at integer" convention the resize would need ``(c + 0.5) * s - 0.5`` instead; no format
read here uses it.)

The checks (:func:`pose_problem`, :func:`intrinsics_problem`) return ``(reason, text)`` for a named reject, or
None; they never raise. The conversions raise :class:`CameraError` (a ``ValueError``) with the problem as text,
which the sources turn into rejects.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

# nerfstudio / OpenGL camera axes (+x right, +y up, +z back) <-> OpenCV: negate the camera's Y and Z columns.
GL_TO_CV = np.diag([1.0, -1.0, -1.0, 1.0])
ROTATION_TOLERANCE = 1e-3  # |det R - 1| and max |R^T R - I| above this: not a rotation
PRINCIPAL_POINT_SLACK = 1.25  # validation: the principal point lies within 1.25x the frame around its centre


class CameraError(ValueError):
    """A camera value that cannot be converted (wrong shape, not numbers, a zero quaternion)."""


def matrix(value: Any, rows: int, cols: int, what: str) -> np.ndarray:
    """``value`` (nested lists, an array) as a float64 ``rows x cols`` matrix, or a CameraError naming ``what``."""
    try:
        array = np.asarray(value, dtype=np.float64)
    except (TypeError, ValueError):
        raise CameraError(f"{what} is not a {rows}x{cols} matrix of numbers") from None
    if array.shape != (rows, cols):
        raise CameraError(f"{what} has shape {list(array.shape)}, expected [{rows}, {cols}]")
    return array


def as_4x4(value: Any, what: str = "pose") -> np.ndarray:
    """A 3x4 or 4x4 pose as a float64 4x4 (a 3x4 gets the row ``[0, 0, 0, 1]``)."""
    try:
        array = np.asarray(value, dtype=np.float64)
    except (TypeError, ValueError):
        raise CameraError(f"{what} is not a matrix of numbers") from None
    if array.shape == (3, 4):
        return np.vstack([array, [0.0, 0.0, 0.0, 1.0]])
    if array.shape == (4, 4):
        return array.copy()
    raise CameraError(f"{what} has shape {list(array.shape)}, expected [3, 4] or [4, 4]")


def opengl_to_opencv(c2w_gl: np.ndarray) -> np.ndarray:
    """An OpenGL/nerfstudio camera-to-world as OpenCV's: ``c2w @ diag(1, -1, -1, 1)`` (camera centre unchanged)."""
    return np.asarray(c2w_gl, dtype=np.float64) @ GL_TO_CV


def w2c_to_c2w(w2c: np.ndarray) -> np.ndarray:
    """A world-to-camera 4x4 inverted, in float64 (a singular matrix is a CameraError)."""
    w2c = np.asarray(w2c, dtype=np.float64)
    if not np.all(np.isfinite(w2c)):
        raise CameraError("the world-to-camera matrix holds non-finite values")
    try:
        return np.linalg.inv(w2c)
    except np.linalg.LinAlgError:
        raise CameraError("the world-to-camera matrix is singular (has no inverse)") from None


def intrinsics(fx: float, fy: float, cx: float, cy: float) -> np.ndarray:
    """The 3x3 pinhole K of focal lengths and principal point, in pixels."""
    return np.array([[fx, 0.0, cx], [0.0, fy, cy], [0.0, 0.0, 1.0]], dtype=np.float64)


def from_normalized(fx: float, fy: float, cx: float, cy: float, width: int, height: int) -> np.ndarray:
    """RealEstate10K's intrinsics (divided by the image width / height) in pixels of a ``width x height`` image."""
    return intrinsics(fx * width, fy * height, cx * width, cy * height)


def rescale(K: np.ndarray, file_size: tuple[float, float], image_size: tuple[int, int]) -> np.ndarray:
    """K stated for a ``file_size`` (w, h) image, in pixels of the real ``image_size`` (W, H): x by W/w, y by H/h."""
    (w, h), (W, H) = file_size, image_size
    if not (w > 0 and h > 0):
        raise CameraError(f"the camera file states an image size of {w}x{h}")
    scale = np.diag([W / w, H / h, 1.0])
    return scale @ np.asarray(K, dtype=np.float64)


def quaternion_to_rotation(qw: float, qx: float, qy: float, qz: float) -> np.ndarray:
    """The rotation of a (normalized here) Hamilton quaternion ``qw qx qy qz``, COLMAP's order."""
    q = np.array([qw, qx, qy, qz], dtype=np.float64)
    norm = float(np.linalg.norm(q))
    if not np.isfinite(norm) or norm < 1e-12:
        raise CameraError(f"the quaternion {q.tolist()} has no direction (norm {norm})")
    w, x, y, z = q / norm
    return np.array([
        [1 - 2 * (y * y + z * z), 2 * (x * y - w * z), 2 * (x * z + w * y)],
        [2 * (x * y + w * z), 1 - 2 * (x * x + z * z), 2 * (y * z - w * x)],
        [2 * (x * z - w * y), 2 * (y * z + w * x), 1 - 2 * (x * x + y * y)],
    ])


def rotation_to_quaternion(R: np.ndarray) -> np.ndarray:
    """``qw qx qy qz`` (qw >= 0) of a rotation matrix: the inverse of :func:`quaternion_to_rotation`."""
    R = np.asarray(R, dtype=np.float64)
    trace = float(np.trace(R))
    if trace > 0:
        s = 2.0 * np.sqrt(trace + 1.0)
        q = [0.25 * s, (R[2, 1] - R[1, 2]) / s, (R[0, 2] - R[2, 0]) / s, (R[1, 0] - R[0, 1]) / s]
    else:
        i = int(np.argmax(np.diag(R)))
        j, k = (i + 1) % 3, (i + 2) % 3
        s = 2.0 * np.sqrt(1.0 + R[i, i] - R[j, j] - R[k, k])
        q = [0.0] * 4
        q[0] = (R[k, j] - R[j, k]) / s
        q[1 + i] = 0.25 * s
        q[1 + j] = (R[j, i] + R[i, j]) / s
        q[1 + k] = (R[k, i] + R[i, k]) / s
    q = np.array(q)
    return -q if q[0] < 0 else q


def colmap_c2w(qvec: Sequence[float], tvec: Sequence[float]) -> np.ndarray:
    """COLMAP's image pose (world-to-camera ``qw qx qy qz`` and ``tx ty tz``, OpenCV axes) as camera-to-world."""
    w2c = np.eye(4)
    w2c[:3, :3] = quaternion_to_rotation(*qvec)
    w2c[:3, 3] = np.asarray(tvec, dtype=np.float64)
    return w2c_to_c2w(w2c)


def crop_resize(K: np.ndarray, x0: int, y0: int, side: int, resolution: int) -> np.ndarray:
    """K after cropping the ``side x side`` box at ``(x0, y0)`` and resizing it to ``resolution`` square."""
    K = np.asarray(K, dtype=np.float64).copy()
    K[0, 2] -= x0
    K[1, 2] -= y0
    scale = resolution / side
    K[:2, :] *= scale
    K[2] = [0.0, 0.0, 1.0]
    return K


def project(c2w: np.ndarray, K: np.ndarray, points: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """World ``points`` [M, 3] seen by one camera: pixel coordinates [M, 2] (this module's convention) and depth
    along the camera's +z [M] (<= 0: behind it)."""
    w2c = np.linalg.inv(np.asarray(c2w, dtype=np.float64))
    cam = np.asarray(points, dtype=np.float64) @ w2c[:3, :3].T + w2c[:3, 3]
    z = cam[:, 2]
    with np.errstate(divide="ignore", invalid="ignore"):
        uv = (cam @ np.asarray(K, dtype=np.float64).T)[:, :2] / z[:, None]
    return uv, z


def pose_problem(c2w: np.ndarray) -> tuple[str, str] | None:
    """Why ``c2w`` is not a camera-to-world (``invalid_pose`` / ``invalid_rotation``, the text), or None."""
    c2w = np.asarray(c2w, dtype=np.float64)
    if c2w.shape != (4, 4):
        return "invalid_pose", f"the pose has shape {list(c2w.shape)}, expected [4, 4]"
    if not np.all(np.isfinite(c2w)):
        return "invalid_pose", "the pose holds non-finite values (NaN or inf)"
    if not np.allclose(c2w[3], [0.0, 0.0, 0.0, 1.0], atol=1e-9, rtol=0.0):
        return "invalid_pose", f"the pose's last row is {c2w[3].tolist()}, expected [0, 0, 0, 1]"
    R = c2w[:3, :3]
    det = float(np.linalg.det(R))
    if abs(det - 1.0) > ROTATION_TOLERANCE:
        return "invalid_rotation", (f"the pose's 3x3 block has determinant {det:.6g}, not 1 (within "
                                    f"{ROTATION_TOLERANCE}): {'a reflection (flipped axis)' if det < 0 else 'scaled'}")
    error = float(np.max(np.abs(R.T @ R - np.eye(3))))
    if error > ROTATION_TOLERANCE:
        return "invalid_rotation", f"the pose's 3x3 block is not orthonormal (max |R^T R - I| = {error:.3g})"
    return None


def intrinsics_problem(K: np.ndarray, size: tuple[int, int] | None = None) -> tuple[str, str] | None:
    """Why ``K`` is not a pinhole K (``invalid_intrinsics``, the text), or None. With ``size`` (W, H): also a
    principal point farther than 1.25x the frame from its centre."""
    K = np.asarray(K, dtype=np.float64)
    if K.shape != (3, 3):
        return "invalid_intrinsics", f"K has shape {list(K.shape)}, expected [3, 3]"
    if not np.all(np.isfinite(K)):
        return "invalid_intrinsics", "K holds non-finite values (NaN or inf)"
    if not (K[0, 0] > 0 and K[1, 1] > 0):
        return "invalid_intrinsics", f"the focal lengths fx={K[0, 0]:.6g}, fy={K[1, 1]:.6g} must be > 0"
    if not np.allclose(K[2], [0.0, 0.0, 1.0]) or K[1, 0] != 0 or K[0, 1] != 0:
        return "invalid_intrinsics", f"K is not a pinhole matrix [[fx,0,cx],[0,fy,cy],[0,0,1]]: {K.tolist()}"
    if size is not None:
        width, height = size
        half_w, half_h = PRINCIPAL_POINT_SLACK * width / 2, PRINCIPAL_POINT_SLACK * height / 2
        if abs(K[0, 2] - width / 2) > half_w or abs(K[1, 2] - height / 2) > half_h:
            return "invalid_intrinsics", (f"the principal point ({K[0, 2]:.2f}, {K[1, 2]:.2f}) lies outside "
                                          f"{PRINCIPAL_POINT_SLACK}x the {width}x{height} frame")
    return None
