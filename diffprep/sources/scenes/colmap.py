"""COLMAP text models (``--scene-format colmap``): ``<input>/.../<scene>/`` with ``images/`` and a text model in
``sparse/0/``, ``sparse/`` or the scene folder itself (``cameras.txt`` + ``images.txt``; ``colmap model_converter
--output_type TXT`` writes them from a binary model).

cameras.txt: ``CAMERA_ID MODEL WIDTH HEIGHT PARAMS...``; only the pinhole models are read -- ``SIMPLE_PINHOLE f cx
cy`` and ``PINHOLE fx fy cx cy``; every other model (SIMPLE_RADIAL, RADIAL, OPENCV, FULL_OPENCV, fisheye...) has
distortion and is refused by name (``unsupported_camera_model``): run ``colmap image_undistorter``, which writes a
PINHOLE model and undistorted images. images.txt: two lines per image, ``IMAGE_ID QW QX QY QZ TX TY TZ CAMERA_ID
NAME`` then its 2D points (not read); the pose is **world-to-camera** in OpenCV axes (``R(q)``, ``t``),
camera-to-world its inverse. COLMAP's pixel convention (the top-left pixel's centre at (0.5, 0.5)) is diffprep's.
K is rescaled from WIDTH x HEIGHT to the real image size when the images in ``images/`` differ. Frames are ordered
by the integer value of their name stems, by text when any is not an integer; ``original_idx`` is the position in
that order. Caption: the scene folder's ``caption.txt``, else empty. Ids: the scene folder relative to the input.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from diffprep.sources.scenes import cameras
from diffprep.sources.base import reject
from diffprep.sources.scenes.base import Scene
from diffprep.sources.scenes.common import (SceneDir, SceneFormat, by_stem, camera, frame_order, image_size, inside,
                                            make_frame, make_scene, own_caption, read_text, relative_id,
                                            walk_scenes)

NAME = "colmap"
MODEL_FOLDERS = (("sparse", "0"), ("sparse",), ())
PINHOLE = {"SIMPLE_PINHOLE": 3, "PINHOLE": 4}


def _model(folder: Path) -> Path | None:
    for parts in MODEL_FOLDERS:
        model = folder.joinpath(*parts)
        if (model / "cameras.txt").is_file() and (model / "images.txt").is_file():
            return model
    return None


def _is_scene(folder: Path) -> bool:
    return (folder / "images").is_dir() and _model(folder) is not None


def find(root: Path) -> Iterator[SceneDir]:
    for folder in walk_scenes(root, _is_scene):
        yield SceneDir(relative_id(root, folder), folder)


def locate(root: Path, scene_id: str) -> SceneDir | None:
    folder = inside(root, scene_id)
    return SceneDir(scene_id, folder) if folder is not None and _is_scene(folder) else None


def inputs(found: SceneDir) -> list[Path]:
    model = _model(found.path) or found.path
    return [model / "cameras.txt", model / "images.txt", found.path / "images"]


def _data_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if not line.startswith("#")]


def _cameras(path: Path) -> dict[str, tuple[str, int, int, list[float]]]:
    found = {}
    for line in _data_lines(read_text(path, "the camera file")):
        fields = line.split()
        if not fields:
            continue
        try:
            found[fields[0]] = (fields[1], int(fields[2]), int(fields[3]), [float(v) for v in fields[4:]])
        except (IndexError, ValueError):
            raise reject("scene_unreadable",
                         f"{path.name}: not CAMERA_ID MODEL WIDTH HEIGHT PARAMS: {line:.80}") from None
    return found


def _images(path: Path) -> dict[str, tuple[list[float], str]]:
    lines = _data_lines(read_text(path, "the image file"))
    found = {}
    for number in range(0, len(lines), 2):  # an image line, then its points line (possibly empty)
        fields = lines[number].split(maxsplit=9)
        if not fields:
            continue
        try:
            pose = [float(v) for v in fields[1:8]]
            found[fields[9].strip()] = (pose, fields[8])
        except (IndexError, ValueError):
            raise reject("scene_unreadable", f"{path.name}: not IMAGE_ID QW QX QY QZ TX TY TZ CAMERA_ID NAME: "
                         f"{lines[number]:.80}") from None
    return found


def load(root: Path, found: SceneDir, pose_key: str) -> Scene:
    model = _model(found.path)
    if model is None:
        raise reject("scene_unreadable", "no cameras.txt + images.txt in sparse/0/, sparse/ or the scene folder")
    known = _cameras(model / "cameras.txt")
    images = _images(model / "images.txt")
    names = by_stem(((name, name) for name in images), "images.txt")
    frames = []
    for index, stem in enumerate(frame_order(names)):
        name = names[stem]
        pose, camera_id = images[name]
        if camera_id not in known:
            raise reject("missing_pose", f"frame {stem}: images.txt names camera {camera_id}, which cameras.txt "
                         "does not list")
        model_name, width, height, params = known[camera_id]
        if model_name not in PINHOLE:
            raise reject("unsupported_camera_model", f"frame {stem}: camera {camera_id} is COLMAP's {model_name}, "
                         "a model with distortion; only SIMPLE_PINHOLE and PINHOLE are read: run `colmap "
                         "image_undistorter` first")
        if len(params) != PINHOLE[model_name]:
            raise reject("invalid_intrinsics", f"frame {stem}: {model_name} takes {PINHOLE[model_name]} parameters, "
                         f"cameras.txt gives {len(params)}")
        fx, fy, cx, cy = params if model_name == "PINHOLE" else (params[0], params[0], params[1], params[2])
        image = str(found.path / "images" / name)
        K = cameras.intrinsics(fx, fy, cx, cy)
        if index == 0:
            size = image_size(Path(image), stem)
        if size != (width, height):
            K = camera(stem, lambda: cameras.rescale(K, (width, height), size), "invalid_intrinsics")
        c2w = camera(stem, lambda: cameras.colmap_c2w(pose[:4], pose[4:]))
        frames.append(make_frame(stem, image, c2w, K, index))
    return make_scene(found, NAME, frames, own_caption(found.path))


FORMAT = SceneFormat(NAME, find, locate, load, inputs)
