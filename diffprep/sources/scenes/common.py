"""What the scene formats share: the scene folders they find, frame ordering, JSON and image headers read as named
rejects, and every frame's camera checked before a ``Scene`` is built.

Rejects a scene format gives (``RejectError`` with phase ``read``): ``scene_unreadable`` (a camera file that is
not valid JSON or text of the format), ``missing_frame`` (a frame the camera file lists whose image does not
exist, whether or not sampling would keep it: ``make_frame``), ``missing_pose``
(a frame with no camera), ``invalid_pose`` (not 4x4 / 3x4, non-finite, last row not [0, 0, 0, 1]),
``invalid_rotation`` (|det R - 1| > 1e-3 or not orthonormal), ``invalid_intrinsics`` (fx, fy <= 0, non-finite),
``unsupported_camera_model`` (a model with distortion), ``too_few_frames`` (under two frames),
``frame_decode_error`` (a frame image whose header does not read).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from diffprep.errors import RejectError
from diffprep.sources.scenes.cameras import CameraError, intrinsics_problem, pose_problem
from diffprep.sources.base import decode_caption_bytes, file_stamp, reject
from diffprep.sources.scenes.base import Scene, SceneFrame

CAPTION_FILE = "caption.txt"  # a scene's own caption beside its frames (the formats that have no caption files)
_CHUNK = re.compile(r"^(?P<scene>.+)/chunk_(?P<index>\d{3,})$")


@dataclass(frozen=True)
class SceneDir:
    """A scene a format found: its id, where it lives (its folder, or its camera file), its split."""

    scene_id: str
    path: Path
    split: str | None = None


@dataclass(frozen=True)
class SceneFormat:
    """A scene format's reader: ``find(root)`` the scenes under ``root`` (sorted, streamed), ``locate(root, id)``
    one by id (None: no such scene), ``load(root, found, pose_key)`` the scene or a RejectError, ``inputs(found)``
    the files and folders whose stamps say the scene changed."""

    name: str
    find: Callable[[Path], Iterator[SceneDir]]
    locate: Callable[[Path, str], SceneDir | None]
    load: Callable[[Path, SceneDir, str], Scene]
    inputs: Callable[[SceneDir], list[Path]]


def split_chunk(source_id: str) -> tuple[str, int | None]:
    """``scene/chunk_002`` -> (``scene``, 2); any other id -> (id, None)."""
    match = _CHUNK.match(source_id)
    return (match["scene"], int(match["index"])) if match else (source_id, None)


def sorted_dirs(folder: Path) -> list[Path]:
    try:
        entries = sorted(os.scandir(folder), key=lambda entry: entry.name)
    except OSError:
        return []
    return [Path(entry.path) for entry in entries if entry.is_dir() and not entry.name.startswith(".")]


def walk_scenes(root: Path, is_scene: Callable[[Path], bool], base: Path | None = None) -> Iterator[Path]:
    """Folders under ``root`` (depth first, sorted by name) for which ``is_scene`` holds; not descended into."""
    for folder in sorted_dirs(root):
        if is_scene(folder):
            yield folder
        else:
            yield from walk_scenes(folder, is_scene, base)


def relative_id(root: Path, folder: Path) -> str:
    return folder.relative_to(root).as_posix()


def inside(root: Path, scene_id: str) -> Path | None:
    """``root / scene_id`` when the id is a plain relative path (no ``..``, not absolute), else None."""
    parts = scene_id.split("/")
    if not scene_id or scene_id.startswith("/") or any(part in ("", ".", "..") for part in parts):
        return None
    return root.joinpath(*parts)


def frame_order(stems: Iterable[str], *, numeric: bool = True) -> list[str]:
    """Frame names in the format's order: by integer value when every stem is an integer (``1, 2, 10``) and
    ``numeric``, else by text."""
    stems = list(stems)
    if numeric and stems and all(re.fullmatch(r"[+-]?\d+", stem) for stem in stems):
        return sorted(stems, key=lambda stem: (int(stem), stem))
    return sorted(stems)


def by_stem(items: Iterable[tuple[str, Any]], where: str) -> dict[str, Any]:
    """``{stem: item}`` of ``(name, item)`` pairs; two frames of one stem are ``scene_unreadable`` (never one
    silently kept)."""
    found: dict[str, Any] = {}
    for name, item in items:
        stem = Path(name).stem
        if stem in found:
            raise reject("scene_unreadable", f"{where}: two frames are named {stem} ({name} and another)")
        found[stem] = item
    return found


def read_json(path: Path, what: str) -> Any:
    try:
        with open(path, "rb") as handle:
            return json.loads(handle.read().decode("utf-8-sig"))
    except FileNotFoundError:
        raise reject("scene_unreadable", f"{what} {path.name} does not exist") from None
    except OSError as error:
        raise reject("scene_unreadable", f"{what} {path.name}: {error.strerror}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise reject("scene_unreadable", f"{what} {path.name} is not valid JSON: {error}") from None


def read_text(path: Path, what: str) -> str:
    try:
        return path.read_bytes().decode("utf-8-sig")
    except FileNotFoundError:
        raise reject("scene_unreadable", f"{what} {path.name} does not exist") from None
    except OSError as error:
        raise reject("scene_unreadable", f"{what} {path.name}: {error.strerror}") from None
    except UnicodeDecodeError as error:
        raise reject("scene_unreadable", f"{what} {path.name} is not UTF-8 text: {error}") from None


def number(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise reject("invalid_intrinsics", f"{what} is {value!r}, not a number")
    return float(value)


def image_size(path: Path, frame: str) -> tuple[int, int]:
    """(W, H) of a frame image from its header only; ``missing_frame`` / ``frame_decode_error``."""
    try:
        with Image.open(path) as img:
            return img.size
    except FileNotFoundError:
        raise reject("missing_frame", f"frame {frame}: its image {path.name} does not exist") from None
    except Exception as error:  # noqa: BLE001 - Pillow's header parsers raise many types (a bomb too): the reject
        raise reject("frame_decode_error", f"frame {frame}: {path.name} does not read as an image: "
                     f"{type(error).__name__}: {error}") from None


def require(path: Path, frame: str) -> str:
    if not path.is_file():
        raise reject("missing_frame", f"frame {frame}: its image {path.name} does not exist")
    return str(path)


def own_caption(folder: Path) -> str | None:
    """A scene folder's ``caption.txt`` (strict UTF-8, stripped), or None when it has none."""
    path = folder / CAPTION_FILE
    if not path.is_file():
        return None
    return decode_caption_bytes(path.read_bytes(), f"{folder.name}/{CAPTION_FILE}")


def camera(frame: str, build: Callable[[], np.ndarray], reason: str = "invalid_pose") -> np.ndarray:
    """A frame's matrix from ``build``; a CameraError becomes the frame's ``reason`` reject."""
    try:
        return build()
    except CameraError as error:
        raise reject(reason, f"frame {frame}: {error}") from None


def make_frame(name: str, image: str, c2w: np.ndarray, K: np.ndarray, original_idx: int,
               depth: str | None = None) -> SceneFrame:
    """A checked frame: its image a file, its pose a rotation, its K a pinhole K with positive focal lengths (else
    the reject).

    Every format builds its frames here, so a frame its camera file lists without an image is ``missing_frame`` in
    every format, whichever frames sampling keeps later: a scene is never stored with ``source_frames`` counting a
    frame that is not there (one stat per frame, no pixels read)."""
    require(Path(image), name)
    for problem in (pose_problem(c2w), intrinsics_problem(K)):
        if problem is not None:
            raise reject(problem[0], f"frame {name}: {problem[1]}")
    return SceneFrame(name=name, image=image, c2w=np.asarray(c2w, np.float64), K=np.asarray(K, np.float64),
                      original_idx=int(original_idx), depth=depth)


def make_scene(found: SceneDir, source: str, frames: Sequence[SceneFrame], caption: str | None,
               info: dict[str, Any] | None = None) -> Scene:
    if len(frames) < 2:
        raise reject("too_few_frames", f"the scene has {len(frames)} frame(s); a scene needs at least 2")
    return Scene(scene_id=found.scene_id, source=source, frames=tuple(frames), caption=caption, split=found.split,
                 info=dict(info or {}))


def stamps_of(paths: Iterable[Path]) -> str:
    """One stamp for a scene's inputs: each file's or folder's ``size:mtime`` (a folder's changes as files come
    and go)."""
    return ";".join(file_stamp(str(path)) for path in paths)


def reject_text(error: RejectError) -> str:
    return f"{error.reason}: {error.detail}"
