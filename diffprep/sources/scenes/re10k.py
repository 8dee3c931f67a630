"""RealEstate10K (``--scene-format re10k``), in GAE's layout and as the original release's camera files.

GAE's layout: ``<input>/[process/]<split>/<shard>/<scene>/`` (``process/`` used when present; any depth of folders
below the split) holding ``transforms.json`` and the frame PNGs. transforms.json: ``fl_x fl_y cx cy`` (pixels),
optional ``w h`` (the size they are stated for; else the frames' own size), and ``frames[*]`` with ``file_path``
and ``transform_matrix`` (OpenCV camera-to-world, 4x4 or 3x4, used as it is, no axis flip). Frame ``i``'s image is
``<scene>/<stem of file_path>.png``. Frames are ordered by the integer value of their stems (``1, 2, 10``), by text
when any stem is not an integer. One K for every frame: ``fl_x, cx`` times ``W / w``, ``fl_y, cy`` times ``H / h``
(W, H: the first frame image's size).

The original release: ``<input>/<split>/<clip>.txt`` -- a URL line, then per frame ``timestamp fx fy cx cy k1 k2``
and the 12 values of a row-major 3x4 **world-to-camera** matrix, intrinsics divided by the image width (fx, cx)
and height (fy, cy) -- next to ``<split>/<clip>/`` holding the frames extracted for it, named
``<timestamp>.png`` (or ``.jpg``). Camera-to-world is the inverse (float64); K is the normalized intrinsics times
the frames' size. A non-zero k1 or k2 is refused (``unsupported_camera_model``). meta.json gets the clip's ``url``.

Ids: the scene folder (or the clip's txt without ``.txt``) relative to ``[process/]``, so they start with the
split: ``train/000/5a1b...``. Captions: ``<input>/<split>_caption.json`` (``{scene folder name: caption}``); a
scene it does not name has an empty caption. ``original_idx``: the frame's position in the ordered frames.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from diffprep.sources.scenes import cameras
from diffprep.sources.base import normalize_caption, reject
from diffprep.sources.scenes.base import Scene
from diffprep.sources.scenes.common import (SceneDir, SceneFormat, by_stem, camera, frame_order, image_size, inside,
                                            make_frame, make_scene, number, read_json, read_text, relative_id)

NAME = "re10k"
TRANSFORMS = "transforms.json"
PROCESS = "process"
FRAME_EXTENSIONS = (".png", ".jpg", ".jpeg")


def _base(root: Path) -> Path:
    return root / PROCESS if (root / PROCESS).is_dir() else root


def find(root: Path) -> Iterator[SceneDir]:
    base = _base(root)
    yield from _walk(base, base)


def _walk(base: Path, folder: Path) -> Iterator[SceneDir]:
    try:
        entries = sorted(os.scandir(folder), key=lambda entry: entry.name)
    except OSError:
        return
    names = {entry.name for entry in entries}
    for entry in entries:
        path = Path(entry.path)
        if entry.name.startswith("."):
            continue
        if entry.is_dir():
            if (path / TRANSFORMS).is_file():
                yield _scene(base, path)
            elif entry.name + ".txt" not in names:  # a clip's frames folder is yielded with its txt
                yield from _walk(base, path)
        elif entry.name.endswith(".txt") and folder != base:  # camera files live in a split folder
            if not (folder / entry.name[:-4] / TRANSFORMS).is_file():  # that folder is a scene of its own
                yield _scene(base, path)


def _scene(base: Path, path: Path) -> SceneDir:
    scene_id = relative_id(base, path.with_suffix("") if path.suffix == ".txt" else path)
    return SceneDir(scene_id, path, scene_id.split("/")[0])


def locate(root: Path, scene_id: str) -> SceneDir | None:
    base = _base(root)
    folder = inside(base, scene_id)
    if folder is None or "/" not in scene_id:
        return None
    if (folder / TRANSFORMS).is_file():
        return _scene(base, folder)
    txt = folder.with_name(folder.name + ".txt")
    return _scene(base, txt) if txt.is_file() else None


def inputs(found: SceneDir) -> list[Path]:
    if found.path.suffix == ".txt":
        return [found.path, found.path.with_suffix("")]
    return [found.path / TRANSFORMS, found.path]


def load(root: Path, found: SceneDir, pose_key: str) -> Scene:
    caption = _caption(root, found)
    if found.path.suffix == ".txt":
        return _load_txt(found, caption)
    return _load_transforms(found, caption)


def _load_transforms(found: SceneDir, caption: str | None) -> Scene:
    folder = found.path
    data = read_json(folder / TRANSFORMS, "the camera file")
    if not isinstance(data, dict) or not isinstance(data.get("frames"), list):
        raise reject("scene_unreadable", f"{TRANSFORMS} holds no frames list")
    for entry in data["frames"]:
        if not isinstance(entry, dict) or not isinstance(entry.get("file_path"), str):
            raise reject("scene_unreadable", f"{TRANSFORMS}: a frame without a file_path: {entry!r:.80}")
    entries = by_stem(((entry["file_path"], entry) for entry in data["frames"]), TRANSFORMS)
    stems = frame_order(entries)
    if not stems:
        raise reject("too_few_frames", f"{TRANSFORMS} lists no frames; a scene needs at least 2")
    size = image_size(folder / f"{stems[0]}.png", stems[0])
    K = cameras.intrinsics(*(number(data.get(key), f"{TRANSFORMS} {key}") for key in ("fl_x", "fl_y", "cx", "cy")))
    if data.get("w") is not None or data.get("h") is not None:
        stated = (number(data.get("w"), f"{TRANSFORMS} w"), number(data.get("h"), f"{TRANSFORMS} h"))
        K = camera("(all)", lambda: cameras.rescale(K, stated, size), "invalid_intrinsics")
    frames = []
    for index, stem in enumerate(stems):
        entry = entries[stem]
        if entry.get("transform_matrix") is None:
            raise reject("missing_pose", f"frame {stem}: {TRANSFORMS} gives it no transform_matrix")
        c2w = camera(stem, lambda: cameras.as_4x4(entry["transform_matrix"], "transform_matrix"))
        frames.append(make_frame(stem, str(folder / f"{stem}.png"), c2w, K, index))
    return make_scene(found, NAME, frames, caption)


def _load_txt(found: SceneDir, caption: str | None) -> Scene:
    lines = [line.strip() for line in read_text(found.path, "the camera file").splitlines()]
    lines = [line for line in lines if line]
    if not lines:
        raise reject("scene_unreadable", f"{found.path.name} is empty (expected a URL line, then one line a frame)")
    url, rows = lines[0], {}
    for number_, line in enumerate(lines[1:], start=2):
        fields = line.split()
        try:
            values = [float(value) for value in fields]
        except ValueError:
            values = []
        if len(values) != 19:
            raise reject("scene_unreadable", f"{found.path.name} line {number_}: expected 19 numbers (timestamp, fx "
                         f"fy cx cy k1 k2, a 3x4 world-to-camera), got {len(fields)} fields")
        rows[fields[0]] = values
    folder = found.path.with_suffix("")
    stems = frame_order(rows)
    if not stems:
        raise reject("too_few_frames", f"{found.path.name} lists no frames; a scene needs at least 2")
    images = {stem: _frame_image(folder, stem) for stem in stems}
    size = image_size(images[stems[0]], stems[0])
    frames = []
    for index, stem in enumerate(stems):
        values = rows[stem]
        if values[5] != 0 or values[6] != 0:
            raise reject("unsupported_camera_model", f"frame {stem}: radial distortion k1={values[5]:g} "
                         f"k2={values[6]:g}; only pinhole cameras are read (undistort the frames first)")
        K = cameras.from_normalized(*values[1:5], *size)
        c2w = camera(stem, lambda: cameras.w2c_to_c2w(cameras.as_4x4(np.reshape(values[7:], (3, 4)))))
        frames.append(make_frame(stem, str(images[stem]), c2w, K, index))
    return make_scene(found, NAME, frames, caption, {"url": url})


def _frame_image(folder: Path, stem: str) -> Path:
    for extension in FRAME_EXTENSIONS:
        if (folder / f"{stem}{extension}").is_file():
            return folder / f"{stem}{extension}"
    if not folder.is_dir():
        raise reject("missing_frame", f"no folder {folder.name}/ of frames extracted for {folder.name}.txt")
    raise reject("missing_frame", f"frame {stem}: no {stem}.png (or .jpg) in {folder.name}/")


def _caption(root: Path, found: SceneDir) -> str | None:
    path = root / f"{found.split}_caption.json"
    if not path.is_file():
        return None
    stat = path.stat()
    captions = _captions(str(path), stat.st_size, stat.st_mtime_ns)
    name = found.scene_id.rsplit("/", 1)[-1]
    return normalize_caption(captions[name], f"{path.name}[{name}]") if name in captions else None


@functools.lru_cache(maxsize=8)
def _captions(path: str, size: int, mtime: int) -> dict:
    data = read_json(Path(path), "the caption file")
    if not isinstance(data, dict):
        raise reject("scene_unreadable", f"{Path(path).name} is not a {{scene: caption}} object")
    return data


FORMAT = SceneFormat(NAME, find, locate, load, inputs)
