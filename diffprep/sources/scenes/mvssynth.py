"""MVS-Synth (``--scene-format mvssynth``): ``<input>/.../<scene>/images/*.png`` with ``poses/<stem>.json`` each, as
the GTAV_540 / GTAV_720 releases hold them (``depths/`` is not read).

A pose file: ``f_x f_y c_x c_y`` (pixels of the image as stored) and ``extrinsic``, a 4x4 **world-to-camera**;
camera-to-world is its inverse in float64 (GAE does exactly this: no rescaling of ``f_x``, no swap of world axes,
which other readers of GTAV_540 do). A frame image with no pose file is ``missing_pose``. Frames are ordered by
the integer value of their stems (``0000, 0001...``), by text when any is not an integer; ``original_idx`` is the
position in that order. Caption: the scene folder's ``caption.txt``, else empty (GAE writes ``caption: ""``).
Ids: the scene folder relative to the input.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from diffprep.sources.scenes import cameras
from diffprep.sources.base import reject
from diffprep.sources.scenes.base import Scene
from diffprep.sources.scenes.common import (SceneDir, SceneFormat, by_stem, camera, frame_order, inside, make_frame,
                                            make_scene, number, own_caption, read_json, relative_id, walk_scenes)

NAME = "mvssynth"
IMAGES, POSES = "images", "poses"


def _is_scene(folder: Path) -> bool:
    return (folder / IMAGES).is_dir() and (folder / POSES).is_dir()


def find(root: Path) -> Iterator[SceneDir]:
    for folder in walk_scenes(root, _is_scene):
        yield SceneDir(relative_id(root, folder), folder)


def locate(root: Path, scene_id: str) -> SceneDir | None:
    folder = inside(root, scene_id)
    return SceneDir(scene_id, folder) if folder is not None and _is_scene(folder) else None


def inputs(found: SceneDir) -> list[Path]:
    return [found.path / IMAGES, found.path / POSES]


def load(root: Path, found: SceneDir, pose_key: str) -> Scene:
    images = by_stem(((path.name, path) for path in sorted((found.path / IMAGES).iterdir())
                      if path.suffix.lower() == ".png" and not path.name.startswith(".")), IMAGES)
    frames = []
    for index, stem in enumerate(frame_order(images)):
        pose_path = found.path / POSES / f"{stem}.json"
        if not pose_path.is_file():
            raise reject("missing_pose", f"frame {stem}: no {POSES}/{stem}.json beside {IMAGES}/{stem}.png")
        data = read_json(pose_path, "the pose file")
        if not isinstance(data, dict) or data.get("extrinsic") is None:
            raise reject("missing_pose", f"frame {stem}: {POSES}/{stem}.json has no extrinsic")
        K = cameras.intrinsics(*(number(data.get(key), f"{stem}.json {key}") for key in ("f_x", "f_y", "c_x", "c_y")))
        c2w = camera(stem, lambda: cameras.w2c_to_c2w(cameras.matrix(data["extrinsic"], 4, 4, "extrinsic")))
        frames.append(make_frame(stem, str(images[stem]), c2w, K, index))
    return make_scene(found, NAME, frames, own_caption(found.path))


FORMAT = SceneFormat(NAME, find, locate, load, inputs)
