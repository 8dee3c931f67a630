"""ScanNet++ iPhone scans (``--scene-format scannetpp``), with depth.

Two layouts: GAE's -- ``<input>/<scene>/rgb/frame_*.jpg``, ``depth/frame_*.png``, ``colmap/pose_intrinsic_imu.json``
-- and the official toolkit's (``iphone/prepare_iphone_data.py``) -- ``<input>/data/<scene>/iphone/`` holding
``rgb/frame_%06d.jpg``, ``depth/frame_%06d.png`` (uint16 millimetres, 256x192) and ``pose_intrinsic_imu.json``
with no ``colmap/`` parent. pose_intrinsic_imu.json: ``{frame: {pose, aligned_pose, intrinsic, imu...}}``;
``--pose-key pose | aligned_pose`` picks the 4x4 camera-to-world, used as OpenCV as it is; ``intrinsic`` is the
3x3 K in pixels of the RGB frames. The frames are the sorted (by text) intersection of the RGB, depth and pose
names (GAE's rule; meta.json's ``frames_without_all_inputs`` counts the names left out, when any); a frame whose
pose is non-finite or not a rotation is the scene's reject (GAE drops such frames). ``original_idx`` is the
number in the name (``frame_000120`` -> 120). Depth maps: ``media/scene_frames.py`` crops them as the frames and
resizes them nearest. Caption: the scene folder's ``caption.txt``, else empty. Ids: the scene folder relative to
the input, ``/iphone`` left out (``data/<scene>``). meta.json gets ``pose_key``.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

from diffprep.sources.scenes import cameras
from diffprep.sources.base import reject
from diffprep.sources.scenes.base import Scene
from diffprep.sources.scenes.common import (SceneDir, SceneFormat, by_stem, camera, inside, make_frame, make_scene,
                                            own_caption, read_json, relative_id, walk_scenes)

NAME = "scannetpp"
POSES = "pose_intrinsic_imu.json"
IPHONE = "iphone"


def _poses(folder: Path) -> Path | None:
    for path in (folder / "colmap" / POSES, folder / POSES):
        if path.is_file():
            return path
    return None


def _data(folder: Path) -> Path | None:
    """The folder holding rgb/ of a scene folder: itself, or its iphone/."""
    for data in (folder, folder / IPHONE):
        if (data / "rgb").is_dir() and _poses(data) is not None:
            return data
    return None


def find(root: Path) -> Iterator[SceneDir]:
    for folder in walk_scenes(root, lambda path: _data(path) is not None):
        yield SceneDir(relative_id(root, folder), folder)


def locate(root: Path, scene_id: str) -> SceneDir | None:
    folder = inside(root, scene_id)
    return SceneDir(scene_id, folder) if folder is not None and _data(folder) is not None else None


def inputs(found: SceneDir) -> list[Path]:
    data = _data(found.path) or found.path
    return [_poses(data) or data / POSES, data / "rgb", data / "depth"]


def _stems(folder: Path, suffixes: tuple[str, ...]) -> dict[str, Path]:
    if not folder.is_dir():
        return {}
    return by_stem(((path.name, path) for path in sorted(folder.iterdir())
                    if path.suffix.lower() in suffixes and not path.name.startswith(".")), folder.name)


def load(root: Path, found: SceneDir, pose_key: str) -> Scene:
    data = _data(found.path)
    if data is None:
        raise reject("scene_unreadable", f"no rgb/ and {POSES} in {found.scene_id}")
    poses = read_json(_poses(data), "the pose file")
    if not isinstance(poses, dict):
        raise reject("scene_unreadable", f"{POSES} is not a {{frame: {{pose, intrinsic}}}} object")
    rgb = _stems(data / "rgb", (".jpg", ".jpeg", ".png"))
    depth = _stems(data / "depth", (".png",))
    if not depth:
        raise reject("depth_unreadable", f"{found.scene_id} has no depth/ PNGs (ScanNet++ scenes are read with "
                     "their depth)")
    names = sorted(set(rgb) & set(depth) & set(poses))
    frames = []
    for name in names:
        entry = poses[name]
        if not isinstance(entry, dict) or entry.get(pose_key) is None:
            raise reject("missing_pose", f"frame {name}: {POSES} gives it no {pose_key} (--pose-key)")
        c2w = camera(name, lambda: cameras.matrix(entry[pose_key], 4, 4, pose_key))
        K = camera(name, lambda: cameras.matrix(entry.get("intrinsic"), 3, 3, "intrinsic"), "invalid_intrinsics")
        match = re.fullmatch(r"frame_(\d+)", name)
        frames.append(make_frame(name, str(rgb[name]), c2w, K, int(match[1]) if match else len(frames),
                                 depth=str(depth[name])))
    info: dict = {"pose_key": pose_key}
    left_out = len(set(rgb) | set(depth) | set(poses)) - len(names)
    if left_out:
        info["frames_without_all_inputs"] = left_out
    return make_scene(found, NAME, frames, own_caption(found.path), info)


FORMAT = SceneFormat(NAME, find, locate, load, inputs)
