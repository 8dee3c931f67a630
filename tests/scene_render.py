"""Synthetic posed scenes with KNOWN cameras, written in every scene format's real layout, and the check that stored
cameras re-project the markers onto the stored frames.

A scene: coloured discs (markers) at known 3D points on a black background, seen by a camera moving sideways and
turning a little, frames non-square (default 96x64) so a centre square crop matters. Two markers sit in the side
strips that a centre square crop removes.

Use::

    scene = render(tmp_path / "in", "dl3dv", frames=8)      # writes <in>/1K/scene0/... ; scene.source_id
    ...                                                     # prepare / store / decode the frames
    assert marker_error(c2w, K, frames, scene.points) < 1.0 # stored c2w [N,4,4], K [N,3,3], frames uint8

``render(root, fmt, ...)`` returns a ``RenderedScene`` (the id the source lists, the true OpenCV c2w and K of each
frame in the format's order, the marker points). ``marker_error(c2w, K, frames, points)`` finds each marker's
colour-weighted centroid in each decoded frame ([N, 3, H, W] or [N, H, W, 3] uint8) and returns the worst distance
(pixels) to its projection; ``inf`` when a marker projected inside a frame is not there, when one projected outside
(or behind) is there, or when a frame has fewer than two markers to check. Pixel coordinates are
``diffprep.sources.scenes.cameras``'s: pixel (i, j) covers [i, i+1) x [j, j+1).

Conventions written (what each reader must undo): re10k transforms.json (OpenCV c2w, K stated for a 2x larger
``w, h``, stems ``1, 2, ... 10`` listed shuffled), re10k txt (world-to-camera 3x4, intrinsics normalized by W, H,
frames named by timestamp), dl3dv (OpenGL c2w, K for ``w, h`` 4x the images_4 frames), nerfstudio (OpenGL, K for a
2x ``w, h``, zero distortion), mvssynth (world-to-camera 4x4), colmap (world-to-camera quaternion, PINHOLE),
scannetpp (JPEG frames, 16-bit depth PNGs at a third of the size whose values encode their pixel:
``1 + x + 64 y``; an RGB frame with no pose, which the intersection drops; ``aligned_pose`` = ALIGN @ pose).
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from PIL import Image

from diffprep.sources.scenes import cameras

COLOURS = ((255, 0, 0), (0, 255, 0), (0, 0, 255), (255, 255, 255), (255, 0, 255), (255, 255, 0), (0, 255, 255))
# Five markers the middle square sees, two in the side strips (x = +-2.3 at depth 4: cropped away).
POINTS = np.array([[-0.9, -0.5, 4.0], [0.8, -0.6, 4.5], [0.0, 0.1, 3.5], [-0.6, 0.6, 5.0], [0.7, 0.5, 4.0],
                   [-2.3, 0.0, 4.0], [2.3, 0.2, 4.0]])
RADIUS = 2.5  # marker disc radius in rendered pixels
ALIGN = np.array([[0.0, -1.0, 0.0, 0.5], [1.0, 0.0, 0.0, -0.2], [0.0, 0.0, 1.0, 0.1], [0.0, 0.0, 0.0, 1.0]])
FORMATS = ("re10k", "re10k-txt", "dl3dv", "scannetpp", "scannetpp-iphone", "mvssynth", "nerfstudio", "colmap")


@dataclass
class RenderedScene:
    root: Path  # the --input-dir
    fmt: str  # the --scene-format (re10k-txt -> re10k, scannetpp-iphone -> scannetpp)
    source_id: str  # the id the source lists for it (unchunked)
    names: list[str]  # frame names in the format's order
    c2w: np.ndarray  # [N, 4, 4] true OpenCV camera-to-world (the world the markers are in)
    K: np.ndarray  # [3, 3] true K in pixels of the rendered frames
    size: tuple[int, int]  # (W, H) of the rendered frames
    points: np.ndarray = field(default_factory=lambda: POINTS.copy())  # [M, 3] markers (aligned_pose: aligned_points)
    depth_size: tuple[int, int] | None = None  # (w, h) of the depth maps (scannetpp)

    @property
    def aligned_points(self) -> np.ndarray:
        return POINTS @ ALIGN[:3, :3].T + ALIGN[:3, 3]


def path_c2w(frames: int) -> np.ndarray:
    """The camera path: sideways from x=-0.3 to 0.3, rising a little, turning from -4 to 4 degrees of yaw."""
    poses = []
    for i in range(frames):
        t = i / max(1, frames - 1)
        yaw = math.radians(-4 + 8 * t)
        R = np.array([[math.cos(yaw), 0, math.sin(yaw)], [0, 1, 0], [-math.sin(yaw), 0, math.cos(yaw)]])
        pose = np.eye(4)
        pose[:3, :3], pose[:3, 3] = R, [-0.3 + 0.6 * t, 0.05 * t, 0.1 * t]
        poses.append(pose)
    return np.stack(poses)


def default_K(width: int, height: int) -> np.ndarray:
    return cameras.intrinsics(0.62 * width, 0.62 * width, width / 2 + 0.3, height / 2 - 0.2)


def draw(c2w: np.ndarray, K: np.ndarray, size: tuple[int, int], points: np.ndarray = POINTS,
         radius: float = RADIUS, supersample: int = 8) -> np.ndarray:
    """One frame uint8 [H, W, 3]: each marker a disc of ``radius`` px at its projection, anti-aliased by coverage."""
    width, height = size
    image = np.zeros((height, width, 3), np.float64)
    uv, z = cameras.project(c2w, K, points)
    offsets = (np.arange(supersample) + 0.5) / supersample
    for (u, v), depth, colour in zip(uv, z, COLOURS):
        if depth <= 0:
            continue
        x0, x1 = max(0, int(u - radius) - 1), min(width, int(u + radius) + 2)
        y0, y1 = max(0, int(v - radius) - 1), min(height, int(v + radius) + 2)
        for y in range(y0, y1):
            for x in range(x0, x1):
                sx, sy = np.meshgrid(x + offsets, y + offsets)
                coverage = float(np.mean((sx - u) ** 2 + (sy - v) ** 2 <= radius ** 2))
                image[y, x] = np.maximum(image[y, x], coverage * np.array(colour))
    return np.round(image).astype(np.uint8)


def _weights(frame: np.ndarray, colour: tuple[int, int, int]) -> np.ndarray:
    pixels = frame.astype(np.float64)
    on = [c for c in range(3) if colour[c]]
    off = [c for c in range(3) if not colour[c]]
    weight = pixels[..., on].min(axis=-1) - (pixels[..., off].max(axis=-1) if off else 0.0)
    return np.where(weight > 48, weight, 0.0)


def marker_error(c2w: np.ndarray, K: np.ndarray, frames: np.ndarray, points: np.ndarray = POINTS, *,
                 margin: float = 4.0) -> float:
    """The worst distance (px) between a marker's centroid in a stored frame and its projection by the stored
    camera; ``inf`` for a marker where it should not be, one missing, or a frame with under two markers checked."""
    frames = np.asarray(frames)
    if frames.ndim == 4 and frames.shape[1] == 3 and frames.shape[-1] != 3:
        frames = frames.transpose(0, 2, 3, 1)
    c2w, K = np.asarray(c2w, np.float64), np.asarray(K, np.float64)
    if K.ndim == 2:
        K = np.broadcast_to(K, (len(frames), 3, 3))
    worst = 0.0
    for pose, k, frame in zip(c2w, K, frames, strict=True):
        height, width = frame.shape[:2]
        uv, z = cameras.project(pose, k, points)
        checked = 0
        for (u, v), depth, colour in zip(uv, z, COLOURS):
            weight = _weights(frame, colour)
            mass = float(weight.sum())
            present = mass > 2 * 255
            inside = depth > 0 and margin <= u <= width - margin and margin <= v <= height - margin
            outside = depth <= 0 or not (-margin <= u <= width + margin and -margin <= v <= height + margin)
            if inside:
                if not present:
                    return math.inf
                ys, xs = np.nonzero(weight)
                w = weight[ys, xs]
                cu, cv = float((w * (xs + 0.5)).sum() / w.sum()), float((w * (ys + 0.5)).sum() / w.sum())
                worst = max(worst, math.hypot(cu - u, cv - v))
                checked += 1
            elif outside and present:
                return math.inf
        if checked < 2:
            return math.inf
    return worst


# --- writing the formats ---------------------------------------------------------------------------------------


def render(root: Path, fmt: str, *, scene: str = "scene0", split: str | None = None, frames: int = 8,
           size: tuple[int, int] = (96, 64), caption: str | None = None) -> RenderedScene:
    """Write one scene under ``root`` in ``fmt`` (one of FORMATS) and return what was written."""
    root = Path(root)
    c2w = path_c2w(frames)
    K = default_K(*size)
    images = [draw(pose, K, size) for pose in c2w]
    writer = {"re10k": _re10k, "re10k-txt": _re10k_txt, "dl3dv": _dl3dv, "scannetpp": _scannetpp,
              "scannetpp-iphone": _scannetpp, "mvssynth": _mvssynth, "nerfstudio": _nerfstudio,
              "colmap": _colmap}[fmt]
    return writer(root, fmt, scene, split, c2w, K, size, images, caption)


def _png(path: Path, pixels: np.ndarray) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(pixels).save(path)


def _json(path: Path, value) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(value, indent=1))


def _captions(path: Path, key: str, caption: str | None) -> None:
    if caption is None:
        return
    known = json.loads(path.read_text()) if path.is_file() else {}
    _json(path, {**known, key: caption})


def _re10k(root, fmt, scene, split, c2w, K, size, images, caption):
    split = split or "train"
    folder = root / split / "000" / scene
    names = [str(i + 1) for i in range(len(images))]  # 1, 2, ... 10: integer order, not text order
    stated = (2 * size[0], 2 * size[1])
    Ks = cameras.rescale(K, size, stated)
    entries = [{"file_path": f"images/{name}.png", "transform_matrix": pose.tolist()} for name, pose in zip(names, c2w)]
    random.Random(7).shuffle(entries)
    _json(folder / "transforms.json", {"fl_x": Ks[0, 0], "fl_y": Ks[1, 1], "cx": Ks[0, 2], "cy": Ks[1, 2],
                                       "w": stated[0], "h": stated[1], "frames": entries})
    for name, image in zip(names, images):
        _png(folder / f"{name}.png", image)
    _captions(root / f"{split}_caption.json", scene, caption)
    return RenderedScene(root, "re10k", f"{split}/000/{scene}", names, c2w, K, size)


def _re10k_txt(root, fmt, scene, split, c2w, K, size, images, caption):
    split = split or "test"
    width, height = size
    names = [str(900000 + 33367 * i) for i in range(len(images))]
    lines = [f"https://www.youtube.com/watch?v={scene}"]
    for name, pose in zip(names, c2w):
        w2c = np.linalg.inv(pose)[:3, :4].reshape(-1)
        values = [K[0, 0] / width, K[1, 1] / height, K[0, 2] / width, K[1, 2] / height, 0.0, 0.0, *w2c]
        lines.append(" ".join([name, *(repr(float(v)) for v in values)]))
    (root / split).mkdir(parents=True, exist_ok=True)
    (root / split / f"{scene}.txt").write_text("\n".join(lines) + "\n")
    for name, image in zip(names, images):
        _png(root / split / scene / f"{name}.png", image)
    _captions(root / f"{split}_caption.json", scene, caption)
    return RenderedScene(root, "re10k", f"{split}/{scene}", names, c2w, K, size)


def _nerfstudio_json(c2w, K, size, factor, names, folder_name):
    stated = (factor * size[0], factor * size[1])
    Ks = cameras.rescale(K, size, stated)
    return {"camera_model": "OPENCV", "fl_x": Ks[0, 0], "fl_y": Ks[1, 1], "cx": Ks[0, 2], "cy": Ks[1, 2],
            "w": stated[0], "h": stated[1], "k1": 0.0, "k2": 0.0, "p1": 0.0, "p2": 0.0,
            "frames": [{"file_path": f"{folder_name}/{name}.png",
                        "transform_matrix": (pose @ cameras.GL_TO_CV).tolist()}  # OpenCV -> OpenGL: its own inverse
                       for name, pose in zip(names, c2w)]}


def _dl3dv(root, fmt, scene, split, c2w, K, size, images, caption):
    split = split or "1K"
    folder = root / split / scene
    names = [f"frame_{i + 1:05d}" for i in range(len(images))]
    data = _nerfstudio_json(c2w, K, size, 4, names, "images")
    _json(folder / "nerfstudio" / "transforms.json", data)
    for name, image in zip(names, images):
        _png(folder / "nerfstudio" / "images_4" / f"{name}.png", image)
    if caption is not None:
        _json(folder / "wan2_caption.json", {"caption": caption})
    return RenderedScene(root, "dl3dv", f"{split}/{scene}", names, c2w, K, size)


def _nerfstudio(root, fmt, scene, split, c2w, K, size, images, caption):
    folder = root / scene
    names = [f"frame_{i + 1:05d}" for i in range(len(images))]
    _json(folder / "transforms.json", _nerfstudio_json(c2w, K, size, 2, names, "images_2"))
    for name, image in zip(names, images):
        _png(folder / "images_2" / f"{name}.png", image)
    if caption is not None:
        (folder / "caption.txt").write_text(caption)
    return RenderedScene(root, "nerfstudio", scene, names, c2w, K, size)


def _mvssynth(root, fmt, scene, split, c2w, K, size, images, caption):
    folder = root / scene
    names = [f"{i:04d}" for i in range(len(images))]
    for name, pose, image in zip(names, c2w, images):
        _png(folder / "images" / f"{name}.png", image)
        _json(folder / "poses" / f"{name}.json", {"f_x": K[0, 0], "f_y": K[1, 1], "c_x": K[0, 2], "c_y": K[1, 2],
                                                  "extrinsic": np.linalg.inv(pose).tolist()})
    return RenderedScene(root, "mvssynth", scene, names, c2w, K, size)


def _colmap(root, fmt, scene, split, c2w, K, size, images, caption):
    folder = root / scene
    names = [f"img_{i:03d}" for i in range(len(images))]
    model = folder / "sparse" / "0"
    model.mkdir(parents=True, exist_ok=True)
    (model / "cameras.txt").write_text(
        "# Camera list with one line of data per camera:\n#   CAMERA_ID, MODEL, WIDTH, HEIGHT, PARAMS[]\n"
        f"1 PINHOLE {size[0]} {size[1]} " + " ".join(repr(float(v)) for v in (K[0, 0], K[1, 1], K[0, 2], K[1, 2]))
        + "\n")
    lines = ["# Image list with two lines of data per image:",
             "#   IMAGE_ID, QW, QX, QY, QZ, TX, TY, TZ, CAMERA_ID, NAME",
             "#   POINTS2D[] as (X, Y, POINT3D_ID)"]
    for index in reversed(range(len(names))):  # listed out of order: the reader sorts by name
        w2c = np.linalg.inv(c2w[index])
        q, t = cameras.rotation_to_quaternion(w2c[:3, :3]), w2c[:3, 3]
        lines.append(" ".join([str(index + 1), *(repr(float(v)) for v in (*q, *t)), "1", f"{names[index]}.png"]))
        lines.append("")
    (model / "images.txt").write_text("\n".join(lines) + "\n")
    (model / "points3D.txt").write_text("# 3D point list (none)\n")
    for name, image in zip(names, images):
        _png(folder / "images" / f"{name}.png", image)
    return RenderedScene(root, "colmap", scene, names, c2w, K, size)


def _scannetpp(root, fmt, scene, split, c2w, K, size, images, caption):
    iphone = fmt == "scannetpp-iphone"
    folder = root / "data" / scene / "iphone" if iphone else root / scene
    names = [f"frame_{10 * i:06d}" for i in range(len(images))]
    width, height = size
    depth_size = (width // 3, height // 3)
    xs, ys = np.meshgrid(np.arange(depth_size[0]), np.arange(depth_size[1]))
    depth = (1 + xs + 64 * ys).astype(np.uint16)
    poses = {}
    for name, pose, image in zip(names, c2w, images):
        (folder / "rgb").mkdir(parents=True, exist_ok=True)
        Image.fromarray(image).save(folder / "rgb" / f"{name}.jpg", quality=95, subsampling=0)
        (folder / "depth").mkdir(parents=True, exist_ok=True)
        Image.fromarray(depth).save(folder / "depth" / f"{name}.png")
        poses[name] = {"pose": pose.tolist(), "aligned_pose": (ALIGN @ pose).tolist(), "intrinsic": K.tolist(),
                       "imu": {"gravity": [0.0, -9.8, 0.0]}}
    extra = f"frame_{10 * len(images):06d}"  # an RGB frame and depth with no pose: not a frame of the scene
    Image.fromarray(images[-1]).save(folder / "rgb" / f"{extra}.jpg", quality=95, subsampling=0)
    Image.fromarray(depth).save(folder / "depth" / f"{extra}.png")
    _json(folder / "pose_intrinsic_imu.json" if iphone else folder / "colmap" / "pose_intrinsic_imu.json", poses)
    return RenderedScene(root, "scannetpp", f"data/{scene}" if iphone else scene, names, c2w, K, size,
                         depth_size=depth_size)
