"""What a posed-scene source gives: a scene's frames, each with its camera, before any sampling or resizing.

Every scene format (``--scene-format``) is read into these types, its cameras converted once
(``diffprep.sources.scenes.cameras``) to OpenCV camera-to-world 4x4 and a 3x3 K in pixels of the frame images as
stored in the source. ``SourceSample.scene`` carries one; ``diffprep.media.scene_frames`` samples,
crops and resizes it into a ``PreparedScene``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np


@dataclass(frozen=True)
class SceneFrame:
    name: str  # the frame's name in the source (its file stem): meta.json's "name"
    image: str  # the path of its image file
    c2w: np.ndarray  # float64 [4, 4]: OpenCV camera-to-world (+x right, +y down, +z forward)
    K: np.ndarray  # float64 [3, 3]: pinhole intrinsics in pixels of the image file as stored
    original_idx: int  # its index in the source's own sequence
    depth: str | None = None  # the path of its uint16 depth PNG (millimetres), depth sources only


@dataclass(frozen=True)
class Scene:
    scene_id: str  # the scene folder relative to the input (with the split where the format has one)
    source: str  # the scene format (re10k, dl3dv, ...): meta.json's "source"
    frames: tuple[SceneFrame, ...]  # every frame of the scene, in the source's order (before any sampling)
    caption: str | None
    split: str | None = None  # the format's split (re10k: train/test), None where it has none
    info: Mapping[str, Any] = field(default_factory=dict)  # format facts for meta.json (applied_gl2cv, pose_key)
    # A long scene's sample: which chunk (chunk_NNN) of its kept frames (media/scene_sampling.py); None: all of them.
    chunk: int | None = None


class SceneChunking(Protocol):
    """How a scenes source samples and chunks each scene, which decides its ids (``diffprep.media.scene_frames.
    SceneSpec`` is one): the frames kept per scene and how, the chunk size, and the settings a plan records."""

    frames: int | None
    sampling: str
    chunk_frames: int | None

    def describe(self) -> dict[str, Any]: ...

