"""``--source-type scenes``: posed multi-view scenes, one module per ``--scene-format`` (re10k, dl3dv, scannetpp,
mvssynth, nerfstudio, colmap; each module's docstring has its layout and conventions), read into ``Scene``s with
every camera converted once (``diffprep.sources.scenes.cameras``).

Ids: a scene's folder relative to the input (the split first where the format has one). A scene whose kept
frames (``scenes.frames`` and ``--frame-sampling``, then ``scenes.chunk_frames``: ``media/scene_sampling.py``) make
more than one chunk is listed as ``<scene>/chunk_000``, ``<scene>/chunk_001``..., each a sample with the scene's
caption. Listing therefore reads each scene's camera files when chunks are possible (``chunk_frames`` set and
``frames`` unset or larger); it never reads pixels beyond one image header per scene. A scene that cannot be read
is listed once, under its folder, and its read is the reject.

``read`` gives one ``SourceSample`` per id with ``scene`` set (every frame of the scene, and ``Scene.chunk`` for a
chunk), its caption (empty where the format has none), or the reject; ``stamps`` the camera files' and frame
folders' sizes and times, so a re-run retries a reject once they change.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import replace
from pathlib import Path

from diffprep.errors import RejectError, SourceError
from diffprep.sources.scenes.sampling import chunk_name, chunk_ranges, kept_indices
from diffprep.sources.base import SourceSample, reject
from diffprep.sources.scenes import colmap, dl3dv, mvssynth, nerfstudio, re10k, scannetpp
from diffprep.sources.scenes.base import Scene, SceneChunking, SceneFrame
from diffprep.sources.scenes.common import SceneDir, SceneFormat, split_chunk, stamps_of


FORMATS: dict[str, SceneFormat] = {module.NAME: module.FORMAT
                                   for module in (re10k, dl3dv, scannetpp, mvssynth, nerfstudio, colmap)}


def chunks_of(scene: Scene, spec: SceneChunking) -> list[tuple[int, int]]:
    """The chunk ranges (over the kept frames) of ``scene`` under ``spec``'s sampling and chunk size."""
    kept = kept_indices([frame.c2w for frame in scene.frames], spec.frames, spec.sampling)
    return chunk_ranges(len(kept), spec.chunk_frames)


class SceneSource:
    """Scenes of one format under ``root``; ``spec`` (frames, sampling, chunk size) decides the chunk ids."""

    def __init__(self, root: str, scene_format: str | None, spec: SceneChunking, *, pose_key: str = "pose") -> None:
        if scene_format not in FORMATS:
            raise SourceError(f"source.scene_format is {scene_format!r}: set --scene-format to one of "
                              f"{', '.join(FORMATS)}")
        self.root = Path(root).expanduser()
        if not self.root.is_dir():
            raise SourceError(f"source.input_dir {root} is not a folder of scenes ({scene_format})")
        self.format = FORMATS[scene_format]
        self.spec = spec
        self.pose_key = pose_key

    def _may_chunk(self) -> bool:
        size = self.spec.chunk_frames
        return size is not None and (self.spec.frames is None or self.spec.frames > size)

    def list_ids(self) -> Iterator[str]:
        for found in self.format.find(self.root):
            count = 1
            if self._may_chunk():
                try:
                    count = len(chunks_of(self._load(found), self.spec))
                except RejectError:
                    count = 1  # listed once: reading it gives the reject
            if count == 1:
                yield found.scene_id
            else:
                yield from (f"{found.scene_id}/{chunk_name(i)}" for i in range(count))

    def _load(self, found: SceneDir) -> Scene:
        return self.format.load(self.root, found, self.pose_key)

    def _locate(self, source_id: str) -> tuple[SceneDir | None, int | None]:
        scene_id, chunk = split_chunk(source_id)
        if chunk is not None:
            found = self.format.locate(self.root, scene_id)
            if found is not None:
                return found, chunk
        return self.format.locate(self.root, source_id), None

    def read(self, ids: Sequence[str]) -> Iterator[SourceSample]:
        for source_id in ids:
            yield self._read_one(source_id)

    def _read_one(self, source_id: str) -> SourceSample:
        found, chunk = self._locate(source_id)
        if found is None:
            return SourceSample(source_id, None, None, reject(
                "missing_scene", f"no {self.format.name} scene {source_id} under {self.root} (moved or deleted "
                "since the plan)"))
        try:
            scene = self._load(found)
            ranges = chunks_of(scene, self.spec) if self._may_chunk() else [(0, len(scene.frames))]
            if chunk is None and len(ranges) > 1 or chunk is not None and chunk >= len(ranges):
                raise reject("scene_changed", f"{found.scene_id} now makes {len(ranges)} chunk(s) of "
                             f"{self.spec.chunk_frames} frames; the plan lists {source_id}: plan the run again "
                             "(--on-existing new-dir or overwrite)")
        except RejectError as error:
            return SourceSample(source_id, None, None, error)
        if chunk is not None:
            scene = replace(scene, chunk=chunk)
        return SourceSample(source_id, None, scene.caption or "", scene=scene)

    def stamps(self, ids: Sequence[str]) -> dict[str, str]:
        result = {}
        for source_id in ids:
            found, _ = self._locate(source_id)
            result[source_id] = stamps_of(self.format.inputs(found)) if found is not None else "-"
        return result

    def describe(self) -> dict:
        return {"type": "scenes", "input_dir": str(self.root), "scene_format": self.format.name,
                "pose_key": self.pose_key, "scenes": self.spec.describe()}


__all__ = ["FORMATS", "Scene", "SceneFrame", "SceneSource", "chunks_of"]
