"""nerfstudio captures (``--scene-format nerfstudio``): ``<input>/.../<scene>/transforms.json`` and the images its
frames name, as ``ns-process-data`` writes them. Also the parser DL3DV's reader shares (``dl3dv.py``).

transforms.json: intrinsics ``fl_x fl_y cx cy w h`` at the top and/or per frame (a frame's own keys win),
``camera_model`` (OPENCV, the default, or PINHOLE / SIMPLE_PINHOLE) with distortion ``k1 k2 k3 k4 p1 p2``;
``frames[*]``: ``file_path`` (relative to the transforms.json folder) and ``transform_matrix``, a camera-to-world in
nerfstudio's **OpenGL** axes (+x right, +y up, +z back), converted to OpenCV by ``c2w @ diag(1, -1, -1, 1)``.
K is rescaled from the stated ``w, h`` to the real size of the images (the first frame's): the files often point at
a downscaled copy (``images_2/``). A non-zero distortion coefficient, or a fisheye or equirectangular model, is
refused (``unsupported_camera_model``): undistort first (nerfstudio's ``ns-process-data`` does for COLMAP input).
Frames are ordered by the integer value of their file stems, by text when any is not an integer.
``original_idx``: the frame's position in that order. Caption: the scene folder's ``caption.txt``, else empty.
meta.json gets ``applied_gl2cv: true``. Ids: the scene folder relative to the input (no split).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from diffprep.sources.scenes import cameras
from diffprep.sources.base import reject
from diffprep.sources.scenes.base import Scene, SceneFrame
from diffprep.sources.scenes.common import (SceneDir, SceneFormat, by_stem, camera, frame_order, image_size, inside,
                                            make_frame, make_scene, number, own_caption, read_json, relative_id,
                                            walk_scenes)

NAME = "nerfstudio"
TRANSFORMS = "transforms.json"
DISTORTION = ("k1", "k2", "k3", "k4", "p1", "p2")
PINHOLE_MODELS = frozenset({"OPENCV", "PINHOLE", "SIMPLE_PINHOLE"})
INTRINSICS = ("fl_x", "fl_y", "cx", "cy", "w", "h")


def find(root: Path) -> Iterator[SceneDir]:
    for folder in walk_scenes(root, lambda path: (path / TRANSFORMS).is_file()):
        yield SceneDir(relative_id(root, folder), folder)


def locate(root: Path, scene_id: str) -> SceneDir | None:
    folder = inside(root, scene_id)
    return SceneDir(scene_id, folder) if folder is not None and (folder / TRANSFORMS).is_file() else None


def inputs(found: SceneDir) -> list[Path]:
    return [found.path / TRANSFORMS, found.path]


def load(root: Path, found: SceneDir, pose_key: str) -> Scene:
    frames, _ = parse(found.path / TRANSFORMS, lambda folder, entry: folder / entry["file_path"], distortion="refuse")
    return make_scene(found, NAME, frames, own_caption(found.path), {"applied_gl2cv": True})


def parse(path: Path, image_of, *, distortion: str,
          numeric: bool = True) -> tuple[list[SceneFrame], dict[str, float]]:
    """The frames of a nerfstudio transforms.json at ``path``; ``image_of(folder, entry)`` is a frame's image path.
    ``distortion``: ``refuse`` (a non-zero coefficient is the reject) or ``ignore`` (returned, for meta.json);
    ``numeric``: integer stems in integer order (else text order)."""
    data = read_json(path, "the camera file")
    if not isinstance(data, dict) or not isinstance(data.get("frames"), list):
        raise reject("scene_unreadable", f"{path.name} holds no frames list")
    folder = path.parent
    for entry in data["frames"]:
        if not isinstance(entry, dict) or not isinstance(entry.get("file_path"), str):
            raise reject("scene_unreadable", f"{path.name}: a frame without a file_path: {entry!r:.80}")
    entries: dict[str, dict[str, Any]] = by_stem(((e["file_path"], e) for e in data["frames"]), path.name)
    stems = frame_order(entries, numeric=numeric)
    if not stems:
        raise reject("too_few_frames", f"{path.name} lists no frames; a scene needs at least 2")
    size = image_size(image_of(folder, entries[stems[0]]), stems[0])
    found_distortion: dict[str, float] = {}
    frames = []
    for index, stem in enumerate(stems):
        entry = entries[stem]
        values = {**data, **entry}
        model = str(values.get("camera_model", "OPENCV"))
        coefficients = {key: number(values[key], f"{stem} {key}") for key in DISTORTION if values.get(key)}
        if model not in PINHOLE_MODELS or coefficients and distortion == "refuse":
            what = f"camera_model {model}" if model not in PINHOLE_MODELS else (
                "distortion " + " ".join(f"{k}={v:g}" for k, v in coefficients.items()))
            raise reject("unsupported_camera_model", f"frame {stem}: {what}; only pinhole cameras are read: "
                         "undistort the images first (ns-process-data, or COLMAP's image_undistorter)")
        found_distortion.update(coefficients)
        K = cameras.intrinsics(*(number(values.get(key), f"{path.name} {key}") for key in INTRINSICS[:4]))
        if values.get("w") is not None or values.get("h") is not None:
            stated = (number(values.get("w"), f"{path.name} w"), number(values.get("h"), f"{path.name} h"))
            K = camera(stem, lambda: cameras.rescale(K, stated, size), "invalid_intrinsics")
        if entry.get("transform_matrix") is None:
            raise reject("missing_pose", f"frame {stem}: {path.name} gives it no transform_matrix")
        c2w = camera(stem, lambda: cameras.opengl_to_opencv(cameras.as_4x4(entry["transform_matrix"],
                                                                           "transform_matrix")))
        frames.append(make_frame(stem, str(image_of(folder, entry)), c2w, K, index))
    return frames, found_distortion


FORMAT = SceneFormat(NAME, find, locate, load, inputs)
