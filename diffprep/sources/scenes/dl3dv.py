"""DL3DV-10K (``--scene-format dl3dv``): ``<input>/<split>/<scene>/[nerfstudio/]transforms.json`` beside
``images_4/`` (the 4x-downscaled frames), as GAE's packer reads it.

transforms.json is nerfstudio's (``nerfstudio.py`` parses it): OpenGL camera-to-world converted to OpenCV
(``c2w @ diag(1, -1, -1, 1)``, meta.json ``applied_gl2cv: true``); ``fl_x fl_y cx cy`` are stated for the
full-resolution capture ``w, h`` and rescaled to the real ``images_4`` size (``x W/w``, ``y H/h``). Frame ``i``'s
image is ``images_4/<stem of file_path>.png``; frames are ordered by stem text (GAE's order). Distortion
coefficients (DL3DV states small k1 k2 p1 p2) are ignored, as GAE ignores them -- not silently: meta.json's
``distortion_ignored`` lists the non-zero ones. Caption: ``wan2_caption.json`` in the scene folder (or beside
transforms.json): its ``caption`` key, or the whole file as text; none: empty. Ids: ``<split>/<scene>`` (the
split is the first folder, e.g. ``1K``). ``original_idx``: the frame's position in that order.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from diffprep.sources.base import decode_caption_bytes, normalize_caption
from diffprep.sources.scenes import nerfstudio
from diffprep.sources.scenes.base import Scene
from diffprep.sources.scenes.common import SceneDir, SceneFormat, inside, make_scene, relative_id, walk_scenes

NAME = "dl3dv"
CAPTION = "wan2_caption.json"
NERFSTUDIO = "nerfstudio"


def _transforms(folder: Path) -> Path | None:
    for path in (folder / NERFSTUDIO / nerfstudio.TRANSFORMS, folder / nerfstudio.TRANSFORMS):
        if path.is_file():
            return path
    return None


def _scene(root: Path, folder: Path) -> SceneDir:
    scene_id = relative_id(root, folder)
    return SceneDir(scene_id, folder, scene_id.split("/")[0] if "/" in scene_id else None)


def find(root: Path) -> Iterator[SceneDir]:
    for folder in walk_scenes(root, lambda path: _transforms(path) is not None and path.name != NERFSTUDIO):
        yield _scene(root, folder)


def locate(root: Path, scene_id: str) -> SceneDir | None:
    folder = inside(root, scene_id)
    return _scene(root, folder) if folder is not None and _transforms(folder) is not None else None


def inputs(found: SceneDir) -> list[Path]:
    transforms = _transforms(found.path)
    return [transforms, transforms.parent / "images_4"] if transforms else [found.path]


def load(root: Path, found: SceneDir, pose_key: str) -> Scene:
    transforms = _transforms(found.path) or found.path / nerfstudio.TRANSFORMS
    frames, distortion = nerfstudio.parse(
        transforms, lambda folder, entry: folder / "images_4" / f"{Path(entry['file_path']).stem}.png",
        distortion="ignore", numeric=False)  # GAE orders DL3DV's frames by stem text
    info: dict = {"applied_gl2cv": True}
    if distortion:
        info["distortion_ignored"] = distortion
    return make_scene(found, NAME, frames, _caption(found.path, transforms.parent), info)


def _caption(folder: Path, beside: Path) -> str | None:
    for path in (folder / CAPTION, beside / CAPTION):
        if path.is_file():
            text = decode_caption_bytes(path.read_bytes(), f"{folder.name}/{CAPTION}")
            try:
                data = json.loads(text)
            except json.JSONDecodeError:
                return text
            if isinstance(data, dict) and "caption" in data:
                return normalize_caption(data["caption"], f"{folder.name}/{CAPTION} caption")
            return text
    return None


FORMAT = SceneFormat(NAME, find, locate, load, inputs)
