"""Posed scenes stored raw (``--source-type scenes``, ``diffprep raw``): each scene's frames as an H.264 mp4 with a
camera per frame, for camera-conditioned training (GAE, FastGen).

A sample is one scene, or one ``chunk_NNN`` of a long one (``scenes.chunk_frames``),
prepared by the source's ``SceneSpec`` (``diffprep.media.scene_frames``: frame
sampling, centre crop and resize, K following every step, depth). Its fields
(Energon subflavor ``encoding: scenes``):

- ``mp4``: the N kept frames, H.264 (``diffprep.media.mp4``: reproducible bytes), at ``scenes.fps``;
- ``txt``: the caption;
- ``poses.npy``: float32 ``[N, 4, 4]`` OpenCV camera-to-world (+x right, +y down, +z forward);
- ``intrinsics.npy``: float32 ``[N, 4]`` = ``fx fy cx cy`` in pixels of the stored mp4;
- ``json``: ``fps``, ``width``, ``height``, ``num_frames`` and the rest of meta.json's scalars, the frames' names;
- ``depth.npy`` (depth sources): uint16 millimetres ``[N, d, d]``.

Row i of every array is decoded frame i of the mp4. ``--layout fastgen`` writes
these shards plus ``shard_counts.json`` (FastGen's documented camera-video
contract); ``--layout gae`` writes GAE's scene folders instead
(``diffprep.encodings.gae_layout``). Validation checks every camera of every
scene (``camera_problems``) and that the mp4 decodes to ``num_frames`` frames.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import replace
from typing import Any, Sequence

import numpy as np
import torch

from diffprep import contract
from diffprep.report.checks import Check, Findings
from diffprep.config import Settings
from diffprep.encodings.base import Encoding, SampleFields, with_caption_settings
from diffprep.encodings.scene_checks import camera_problems, check_scene, intrinsics_rows, load_npy, npy
from diffprep.errors import ConfigError
from diffprep.writer.layouts import LayoutPreset
from diffprep.media.mp4 import X264, mp4_bytes, mp4_frames
from diffprep.output import Output
from diffprep.writer.plan import Plan
from diffprep.run.reader import Batch, first_batch
from diffprep.run.sanity import TAR_MEMBER_OVERHEAD, MemoryWatch, SanityReport, check_round_trip, finish_sanity, project_run
from diffprep.writer.shards import Reject

BATCH_SIZE = 2  # scenes prepared per batch; only groups the work
DEPTH_FORMATS = ("scannetpp",)  # the scene formats whose frames come with depth maps


# --- settings ---------------------------------------------------------------------------------------------------


def scene_settings(settings: Settings) -> dict[str, Any]:
    """The ``scenes`` section of a scene plan's byte settings: what decides which frames a sample keeps and how."""
    source, scenes = settings.source, settings.scenes
    if source.scene_format is None:
        raise ConfigError("--source-type scenes needs --scene-format (re10k, dl3dv, scannetpp, mvssynth, nerfstudio, "
                          "colmap): the layout of the scenes under --input-dir")
    if settings.video.resolution_buckets:
        raise ConfigError("--resolution-buckets sizes clips; a scene is sized by --scene-resolution: remove it")
    sampling = settings.video.frame_sampling
    if sampling == "progressive" and scenes.frames is None:
        raise ConfigError("--frame-sampling progressive picks --scene-frames N frames: set it")
    depth = source.scene_format in DEPTH_FORMATS
    # The format and what it reads, then SceneSpec's own fields (``SceneSpec.describe()``: scene_spec reads them).
    return {
        "format": source.scene_format,
        "pose_key": source.pose_key if source.scene_format == "scannetpp" else None,
        "depth": depth,
        "frames": scenes.frames,
        "sampling": sampling,
        "resolution": scenes.resolution,
        "depth_resolution": scenes.depth_resolution,
        "fps": float(scenes.fps),
        "chunk_frames": scenes.chunk_frames,
        "max_pixels": settings.image.max_pixels,
    }


def has_depth(plan_settings: Mapping[str, Any]) -> bool:
    return bool(plan_settings["scenes"].get("depth"))


def scene_spec(plan_settings: Mapping[str, Any]) -> Any:
    """How the reader prepares a scene (``SceneSpec``), from a plan's byte settings."""
    from diffprep.media.scene_frames import SceneSpec

    return SceneSpec.from_description(plan_settings["scenes"])


# --- writing ----------------------------------------------------------------------------------------------------


def scene_meta(prepared: Any, caption: str, source_id: str, fps: float) -> dict[str, Any]:
    """meta.json of a prepared scene in GAE's key order: every scalar first (``scene_id, num_frames, fps, height,
    width, rgb_resolution, source``, the rest, ``caption``), then ``frames`` with each frame's c2w and K."""
    meta = dict(prepared.meta)
    frames = meta.pop("frames", [])
    pixels = prepared.pixels
    ordered: dict[str, Any] = {}
    height, width = int(pixels.shape[2]), int(pixels.shape[3])
    first = {"scene_id": meta.pop("scene_id", source_id), "num_frames": int(pixels.shape[0]),
             "fps": meta.pop("fps", None) or fps, "height": height, "width": width,
             "rgb_resolution": min(height, width), "source": meta.pop("source", None)}
    for name in ("num_frames", "height", "width", "rgb_resolution"):
        meta.pop(name, None)
    ordered.update(first)
    ordered.update({k: v for k, v in meta.items() if k != "caption"})
    ordered["source_id"] = source_id
    ordered["caption"] = caption
    c2w, K = np.asarray(prepared.c2w, dtype=np.float64), np.asarray(prepared.K, dtype=np.float64)
    ordered["frames"] = [{**{"index": i}, **frame, "c2w": c2w[i].tolist(), "K": K[i].tolist()}
                         for i, frame in enumerate(frames)]
    return ordered


class SceneWriter:
    """The raw scene pipeline's stand-in for the encoders: prepared scenes -> their fields (module docstring)."""

    def __init__(self, crf: int, depth: bool, fps: float) -> None:
        self.crf = crf
        self.depth = depth
        self.fps = fps

    def fields(self, prepared: Any, caption: str, source_id: str) -> dict[str, Any]:
        problems = camera_problems(prepared.c2w, prepared.K, int(prepared.pixels.shape[3]),
                                   int(prepared.pixels.shape[2]))
        if problems:
            return Reject(source_id, "bad_camera", "; ".join(problems[:3]), phase="encode")
        meta = scene_meta(prepared, caption, source_id, self.fps)
        fields = {
            contract.RAW_VIDEO: mp4_bytes(prepared.pixels, meta["fps"], crf=self.crf),
            contract.RAW_CAPTION: caption,
            contract.SCENE_POSES: npy(np.asarray(prepared.c2w, dtype=np.float32)),
            contract.SCENE_INTRINSICS: npy(intrinsics_rows(prepared.K)),
            contract.RAW_VIDEO_META: meta,
        }
        if self.depth:
            if prepared.depth is None or len(prepared.depth) != len(prepared.pixels):
                return Reject(source_id, "depth_decode_error", "the scene's depth maps do not match its frames",
                              phase="encode")
            fields[contract.SCENE_DEPTH] = npy(np.asarray(prepared.depth, dtype=np.uint16))
        return fields

    def sample_fields(self, batch: Batch, notes: Counter) -> list[dict | Reject]:
        return [self.fields(prepared, batch.captions[i], batch.source_ids[i])
                for i, prepared in enumerate(batch.scenes)]


def scene_fields(depth: bool) -> list[str]:
    return sorted(contract.SCENE_FIELDS + ((contract.SCENE_DEPTH,) if depth else ()))


# --- the encoding -----------------------------------------------------------------------------------------------


class ScenePlanned:
    """What every scene encoding shares: its source and reader take the plan's ``SceneSpec``; no buckets (one
    scene shape per plan)."""

    def media_spec(self, settings: Settings | None, plan: Plan | None = None) -> Any:
        return scene_spec(plan.settings)

    def source_options(self, plan_settings: Mapping[str, Any]) -> dict[str, Any]:
        return {"scenes": scene_spec(plan_settings)}

    def bucketed(self, plan_settings: dict[str, Any]) -> bool:
        return False


class Scenes(ScenePlanned, Encoding):
    """Posed scenes as mp4 + cameras; nothing is encoded. Layouts: energon, fastgen (shards), gae (folders)."""

    name = contract.ENCODING_SCENES
    layout_presets = {contract.LAYOUT_FASTGEN: LayoutPreset(members={}, shard_counts=True),
                      contract.LAYOUT_GAE: LayoutPreset(members={})}

    def plan_settings(self, settings: Settings, token: str | None) -> tuple[dict[str, Any], dict[str, Any]]:
        scenes = scene_settings(settings)
        if settings.output.layout == contract.LAYOUT_GAE and settings.output.output_dir.startswith("s3://"):
            raise ConfigError("--layout gae writes scene folders to a local output; write it to a folder and copy it "
                              "to the bucket, or use --layout fastgen (shards) for an s3:// output")
        byte = {"contract": contract.CONTRACT_VERSION, "encoding": self.name, "shard_size": settings.output.shard_size,
                "scenes": scenes, "raw": {"video": dict(X264, crf=settings.raw.video_crf)}}
        byte = with_caption_settings(byte, settings)
        size = scenes["resolution"]
        expected = {"fields": scene_fields(scenes["depth"]),
                    "scene": {"frames": scenes["frames"], "size": [size, size] if size else None,
                              "depth": scenes["depth"]}}
        return byte, expected

    def required_fields(self, expected: dict[str, Any]) -> tuple[str, ...]:
        return tuple(expected["fields"])

    def load(self, settings: Settings, token: str | None) -> SceneWriter:
        return SceneWriter(settings.raw.video_crf, settings.source.scene_format in DEPTH_FORMATS, settings.scenes.fps)

    def unit_writer(self, output: Output, plan: Plan):
        from diffprep.encodings import gae_layout

        return (lambda: gae_layout.SceneFolderWriter(output.local, plan)) if gae_layout.is_gae(plan) else None

    def own_folders(self, plan: Plan | None) -> Any:
        from diffprep.encodings import gae_layout

        return gae_layout if gae_layout.is_gae(plan) else None

    def sample_fields(self, settings: Settings, loaded: SceneWriter) -> SampleFields:
        return loaded.sample_fields

    def batch_size(self, settings: Settings) -> int:
        return BATCH_SIZE

    def sanity(self, output: Output, plan: Plan, loaded: SceneWriter, source: Any, spec: Any, *, settings: Settings,
               batch_size: int, units_left: Sequence[int] | None, workers: int,
               staged_samples: int | None) -> SanityReport:
        """The first scene that reads, written into the state folder (``sanity/scene/``, as its layout stores it)
        and checked: its cameras, its mp4 decoding to its frames; the run projected from it."""
        units = [u for u in plan.units if units_left is None or u.unit in set(units_left)] or plan.units
        start = time.perf_counter()
        batch = first_batch(plan, source, spec, 1, units=units)
        with MemoryWatch(torch.device("cpu")) as memory:
            samples = loaded.sample_fields(batch, Counter())
        seconds = time.perf_counter() - start
        problems = [f"{batch.source_ids[0]}: {s.reason}: {s.detail}" for s in samples if isinstance(s, Reject)]
        stored = batch.pixels
        sample = samples[0]
        per_sample = 0
        if not isinstance(sample, Reject):
            from diffprep.encodings import gae_layout

            files = gae_layout.scene_files(sample) if gae_layout.is_gae(plan) else {
                f"{batch.keys[0]}.{name}": (value if isinstance(value, bytes) else
                                            value.encode() if isinstance(value, str) else
                                            gae_layout.meta_bytes(value)) for name, value in sample.items()}
            for name, data in files.items():
                output.state.write_bytes(f"{contract.SANITY_DIR}/scene/{name}", data)
            per_sample = sum(len(d) for d in files.values()) + TAR_MEMBER_OVERHEAD * len(files)
            frames = mp4_frames(sample[contract.RAW_VIDEO])
            if frames.shape != batch.pixels[0].shape:
                problems.append(f"the stored mp4 decodes to {list(frames.shape)}, the scene is "
                                f"{list(batch.pixels[0].shape)}")
            else:
                stored = frames[None]
        from diffprep.encodings.clips import strips

        psnrs, sheet, _ = check_round_trip(output, replace(batch, pixels=strips(batch.pixels)), strips(stored), 0.0)
        remaining, projected_seconds, free = project_run(output, plan, units_left, seconds, 1, 1)
        report = SanityReport(
            ok=not problems, samples=1, shapes={contract.RAW_VIDEO: list(batch.pixels.shape[1:])},
            dtypes={contract.RAW_VIDEO: "uint8"}, finite=True, psnr_db=psnrs, seconds_per_batch=round(seconds, 4),
            peak_memory_bytes=memory.peak, bytes_per_sample=per_sample, projected_bytes=per_sample * remaining,
            projected_seconds=round(projected_seconds, 1), free_bytes=free, problems=problems,
            contact_sheet=str(sheet),
            local_bytes=None if staged_samples is None else per_sample * min(remaining, staged_samples))
        return finish_sanity(output, report, remaining)

    def oom_advice(self, settings: Settings, loaded: SceneWriter) -> str:
        return "use a smaller --scene-resolution or fewer --scene-frames"

    def holds(self, fields: Mapping[str, bytes]) -> bool:
        return contract.SCENE_POSES in fields

    def decode_stored(self, stored: Sequence[Any], plan: Plan | None, **options: Any
                      ) -> tuple[list[torch.Tensor], str | None]:
        """The stored mp4 files as they decode (no model)."""
        return [mp4_frames(sample.fields[contract.RAW_VIDEO]) for sample in stored], None

    def cameras(self, stored: Any) -> tuple[np.ndarray, np.ndarray]:
        """A stored sample's (c2w [N, 4, 4], fx fy cx cy [N, 4]): what ``diffprep decode`` draws."""
        return (load_npy(stored.fields[contract.SCENE_POSES], key=stored.key, field=contract.SCENE_POSES),
                load_npy(stored.fields[contract.SCENE_INTRINSICS], key=stored.key, field=contract.SCENE_INTRINSICS))

    def task_encoder(self) -> Any:
        from diffprep.writer.scene_cooker import SceneTaskEncoder

        return SceneTaskEncoder()

    def inspector(self, expected: dict[str, Any] | None) -> SceneInspector:
        return SceneInspector(expected)


class SceneInspector:
    """Validation of loaded scenes (``check_scene`` on each); counts scenes and frames."""

    def __init__(self, expected: dict[str, Any] | None) -> None:
        self.expected = (expected or {}).get("scene")
        self.findings = Findings("scenes")
        self.scenes = 0
        self.frames = 0

    def inspect(self, sample: Any) -> None:
        self.scenes += 1
        self.frames += len(sample.poses)
        for problem in check_scene(sample.__key__, sample.video, sample.poses, sample.intrinsics, sample.meta,
                                   sample.depth, self.expected):
            self.findings.add(problem)

    def checks(self) -> list[Check]:
        return [self.findings.check("every frame's camera is a finite rotation + translation with fx, fy > 0 and its "
                                    "principal point in the frame; every mp4 decodes to num_frames frames")]

    def summary(self) -> dict[str, Any]:
        return {"scenes": self.scenes, "frames": self.frames}

    def passed(self) -> tuple[list[Check], dict[str, Any], dict[str, bytes]]:
        return [], {}, {}


__all__ = ["DEPTH_FORMATS", "SceneInspector", "SceneWriter", "Scenes", "scene_meta", "scene_settings", "scene_spec"]
