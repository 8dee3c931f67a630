"""Posed scenes pre-encoded with a Wan 2.x model (``--source-type scenes``, ``diffprep encode``), cameras kept.

A scene (or chunk) is prepared as for the raw scene pipeline (``encodings.scenes``:
the source's ``SceneSpec``), then its frames go through the Wan VAE and its
caption through umT5 exactly as a clip's do (``encodings.wan``: the same
encoders, normalization, seeded sampling). Per sample (Energon subflavor
``encoding: wan_scenes``):

- ``latents.pth`` ``[C, 1 + (N - 1) / t, S / s, S / s]``, ``prompt_embeds.pth`` ``[L, D]``, ``caption.txt``;
- ``c2w.pth`` float32 ``[N, 4, 4]`` OpenCV camera-to-world and ``intrinsics.pth`` float32 ``[N, 3, 3]`` K in
  pixels of the encoded frames, one per source frame;
- ``meta.json``: meta.json's scalars and frame names, the bucket ``[S, S, N]``, and ``latent_frames``: the source
  frames each latent frame covers (Wan's causal VAE: latent 0 is frame 0, latent j >= 1 frames
  ``t(j-1)+1 .. tj``).

Wan encodes ``N = 1 + k t`` frames (t = 4: 17, 21, 33, 81...) at sides that are
multiples of its spatial factor, so the plan refuses ``--scene-frames`` and
``--scene-resolution`` that are not, naming the nearest values: every sample of
a plan has the same shape. ``diffprep.writer.scene_cooker.WanSceneTaskEncoder`` loads them.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import replace
from typing import Any, Sequence

import numpy as np
import torch

from diffprep import contract
from diffprep.config import Settings
from diffprep.encodings.base import SampleFields, encoded_samples, with_caption_settings
from diffprep.encodings.scene_checks import camera_problems
from diffprep.encodings.scenes import ScenePlanned, scene_meta, scene_settings
from diffprep.encodings.wan import VideoInspector, Wan
from diffprep.errors import ConfigError
from diffprep.families.base import DTYPES
from diffprep.families.wan import VaeTiling, WanEncoders, describe_wan, resolve_wan
from diffprep.media.images import to_uint8
from diffprep.output import Output
from diffprep.writer.plan import Plan, dtype_name
from diffprep.run.reader import Batch, first_batch
from diffprep.run.sanity import MemoryWatch, SanityReport, check_round_trip, finish_sanity, project_run
from diffprep.writer.shards import Reject, tensor_bytes


def latent_frames(frames: int, temporal: int) -> list[list[int]]:
    """The source frames each latent frame of an ``frames``-frame clip covers (Wan's causal temporal compression)."""
    return [[0]] + [list(range(temporal * (j - 1) + 1, temporal * j + 1)) for j in range(1, 1 + (frames - 1) // temporal)]


def check_scene_shape(frames: int | None, size: int | None, spatial: int, temporal: int) -> None:
    """Refuse scene settings Wan cannot encode as one shape, naming the flag and the nearest values that work."""
    if frames is None:
        raise ConfigError(f"a Wan scene run needs --scene-frames N with N = 1 + {temporal}k (e.g. 17, 21, 33): the "
                          "frames every scene keeps")
    if (frames - 1) % temporal:
        low = 1 + (frames - 1) // temporal * temporal
        raise ConfigError(f"--scene-frames {frames}: Wan encodes 1 + {temporal}k frames; use {low} or "
                          f"{low + temporal}")
    if size is None:
        raise ConfigError(f"a Wan scene run needs --scene-resolution S (a multiple of {spatial}): the side every "
                          "scene is cropped and resized to")
    if size % spatial:
        low = size // spatial * spatial
        raise ConfigError(f"--scene-resolution {size}: Wan needs a multiple of {spatial}; use {low or spatial} or "
                          f"{low + spatial}")


class WanScenes(ScenePlanned, Wan):  # one scene shape for the whole plan (check_scene_shape)
    """Wan 2.x over posed scenes: latents and umT5 as for clips, plus each source frame's camera."""

    name = contract.ENCODING_WAN_SCENES
    layout_presets = None  # member names fixed: no trainer reads other names for these yet

    def variant(self, settings: Settings) -> str:
        return self.name

    def plan_settings(self, settings: Settings, token: str | None) -> tuple[dict[str, Any], dict[str, Any]]:
        model = settings.model
        if model.latent_mode == "posterior":
            raise ConfigError("latent_mode posterior is Flux only (Primus's resample mode); use sample or mode for Wan")
        scenes = scene_settings(settings)
        parts = resolve_wan(model.model_path, revision=model.revision, token=token)
        identity = describe_wan(parts, dtype=DTYPES[model.precision], vae_dtype=DTYPES[model.precision],
                                text_max_length=model.t5_max_length, latent_mode=model.latent_mode,
                                tiling=VaeTiling() if settings.video.vae_tiling else None)
        channels, s, t = identity["latent_channels"], identity["spatial_factor"], identity["temporal_factor"]
        check_scene_shape(scenes["frames"], scenes["resolution"], s, t)
        byte = {"contract": contract.CONTRACT_VERSION, "encoding": self.name, "encoders": identity,
                "shard_size": settings.output.shard_size, "scenes": scenes}
        byte = with_caption_settings(byte, settings)
        text_config = json.loads((parts["text_encoder"].path / "config.json").read_text(encoding="utf-8"))
        frames, size = scenes["frames"], scenes["resolution"]
        expected = {
            contract.field_stem(contract.LATENTS): [channels, 1 + (frames - 1) // t, size // s, size // s],
            contract.field_stem(contract.PROMPT_EMBEDS): [model.t5_max_length, text_config["d_model"]],
            "c2w": [frames, 4, 4], "intrinsics": [frames, 3, 3],
            "dtype": dtype_name(DTYPES[model.precision]),
        }
        return byte, expected

    def required_fields(self, expected: dict[str, Any]) -> tuple[str, ...]:
        return contract.WAN_SCENE_FIELDS

    def field_problem(self, fields: Sequence[str], expected: dict[str, Any] | None) -> str:
        missing = [f for f in contract.WAN_SCENE_FIELDS if f not in fields]
        return f"missing {missing}" if missing else ""

    def sample_fields(self, settings: Settings, loaded: WanEncoders) -> SampleFields:
        temporal = loaded.temporal_factor
        fps = settings.scenes.fps

        def fields(batch: Batch, notes: Counter) -> list[dict | Reject]:
            return scene_samples(loaded, batch, notes, temporal, fps)

        return fields

    def sanity(self, output: Output, plan: Plan, loaded: WanEncoders, source: Any, spec: Any, *, settings: Settings,
               batch_size: int, units_left: Sequence[int] | None, workers: int,
               staged_samples: int | None) -> SanityReport:
        """One batch of scenes encoded, its latents decoded again (PSNR), shapes and cameras checked; projected."""
        from diffprep.encodings.clips import strips

        units = [u for u in plan.units if units_left is None or u.unit in set(units_left)] or plan.units
        start = time.perf_counter()
        batch = first_batch(plan, source, spec, batch_size, units=units)
        decode_seconds = time.perf_counter() - start
        temporal = plan.settings["encoders"]["temporal_factor"]
        with MemoryWatch(loaded.device) as memory:
            start = time.perf_counter()
            samples = scene_samples(loaded, batch, Counter(), temporal, settings.scenes.fps)
            seconds = time.perf_counter() - start
        problems = [f"{s.source_id}: {s.reason}: {s.detail}" for s in samples if isinstance(s, Reject)]
        kept = [s for s in samples if not isinstance(s, Reject)]
        psnrs, sheet = [], None
        shapes: dict[str, list[int]] = {}
        dtypes: dict[str, str] = {}
        if kept:
            latents = torch.stack([s[contract.LATENTS] for s in kept])
            for name in (contract.LATENTS, contract.PROMPT_EMBEDS, contract.SCENE_C2W, contract.SCENE_K):
                tensor = kept[0][name]
                stem = contract.field_stem(name)
                shapes[name], dtypes[name] = list(tensor.shape), dtype_name(tensor.dtype)
                want = plan.expected.get(stem)
                if want is not None and list(tensor.shape) != want:
                    problems.append(f"{name}: shape {list(tensor.shape)}, planned {want}")
            decoded = to_uint8(loaded.decode_latents(latents).flatten(0, 1)).view(batch.pixels[:len(kept)].shape)
            kept_batch = replace(batch, pixels=strips(batch.pixels[:len(kept)]), keys=batch.keys[:len(kept)])
            psnrs, sheet, problem = check_round_trip(output, kept_batch, strips(decoded), settings.model.min_psnr)
            if problem:
                problems.append(problem)
        per_sample = sum(len(tensor_bytes(kept[0][n])) for n in (contract.LATENTS, contract.PROMPT_EMBEDS,
                                                                 contract.SCENE_C2W, contract.SCENE_K)) + 8192 \
            if kept else 0
        remaining, projected_seconds, free = project_run(output, plan, units_left, seconds + decode_seconds,
                                                         len(batch.keys), workers)
        report = SanityReport(
            ok=not problems, samples=len(batch.keys), shapes=shapes, dtypes=dtypes, finite=not any(
                "non_finite" in p for p in problems), psnr_db=psnrs, seconds_per_batch=round(seconds, 4),
            peak_memory_bytes=memory.peak, bytes_per_sample=per_sample, projected_bytes=per_sample * remaining,
            projected_seconds=round(projected_seconds, 1), free_bytes=free, problems=problems,
            min_psnr=settings.model.min_psnr, contact_sheet=str(sheet) if sheet else None,
            local_bytes=None if staged_samples is None else per_sample * min(remaining, staged_samples))
        return finish_sanity(output, report, remaining)

    def holds(self, fields: Mapping[str, bytes]) -> bool:
        return contract.SCENE_C2W in fields

    def cameras(self, stored: Any) -> tuple[np.ndarray, np.ndarray]:
        """A stored sample's (c2w [N, 4, 4], fx fy cx cy [N, 4]): what ``diffprep decode`` draws."""
        from diffprep.encodings.scene_checks import intrinsics_rows
        from diffprep.writer.shards import load_tensor

        c2w = load_tensor(stored.fields[contract.SCENE_C2W], key=stored.key, field=contract.SCENE_C2W)
        K = load_tensor(stored.fields[contract.SCENE_K], key=stored.key, field=contract.SCENE_K)
        return c2w.numpy(), intrinsics_rows(K.numpy())

    def task_encoder(self) -> Any:
        from diffprep.writer.scene_cooker import WanSceneTaskEncoder

        return WanSceneTaskEncoder()

    def inspector(self, expected: dict[str, Any] | None) -> WanSceneInspector:
        return WanSceneInspector(expected)


def scene_samples(loaded: WanEncoders, batch: Batch, notes: Counter, temporal: int, fps: float) -> list[dict | Reject]:
    """A batch of prepared scenes through the VAE and umT5, each with its cameras and latent-frame coverage."""
    latents = loaded.encode_video(batch.pixels, batch.keys)
    text = loaded.encode_text(batch.captions)
    metas = []
    for i, prepared in enumerate(batch.scenes):
        meta = scene_meta(prepared, batch.captions[i], batch.source_ids[i], fps)
        frames = meta.pop("frames")
        count, height, width = (int(v) for v in (prepared.pixels.shape[0], prepared.pixels.shape[2],
                                                 prepared.pixels.shape[3]))
        metas.append(meta | {"frames": [{k: f[k] for k in f if k not in ("c2w", "K")} for f in frames],
                             "bucket": [width, height, count], "latent_frames": latent_frames(count, temporal)})

    def fields(i: int) -> dict[str, Any]:
        prepared = batch.scenes[i]
        return {contract.LATENTS: latents[i], contract.PROMPT_EMBEDS: text.prompt_embeds[i],
                contract.SCENE_C2W: torch.from_numpy(np.asarray(prepared.c2w, dtype=np.float32)),
                contract.SCENE_K: torch.from_numpy(np.asarray(prepared.K, dtype=np.float32))}

    samples = encoded_samples(replace(batch, metas=metas), latents, text.truncated, notes, "scene", fields)
    for i, sample in enumerate(samples):
        if isinstance(sample, Reject):
            continue
        prepared = batch.scenes[i]
        problems = camera_problems(prepared.c2w, prepared.K, int(prepared.pixels.shape[3]),
                                   int(prepared.pixels.shape[2]))
        if problems:
            samples[i] = Reject(batch.source_ids[i], "bad_camera", "; ".join(problems[:3]), phase="encode")
    return samples


class WanSceneInspector(VideoInspector):
    """Validation of loaded Wan scenes: as for clips, plus every frame's camera and one per source frame."""

    def __init__(self, expected: dict[str, Any] | None) -> None:
        super().__init__(expected)
        from diffprep.report.checks import Findings

        self.cameras = Findings("cameras")

    def inspect(self, sample: Any) -> None:
        super().inspect(sample)
        width, height, count = sample.meta["bucket"]
        if len(sample.c2w) != count or len(sample.intrinsics) != count:
            self.cameras.add(f"{sample.__key__}: {len(sample.c2w)} poses, {len(sample.intrinsics)} K for {count} "
                             "frames")
        covered = [f for group in sample.meta.get("latent_frames", []) for f in group]
        if covered != list(range(count)) or len(sample.meta.get("latent_frames", [])) != sample.latents.shape[1]:
            self.cameras.add(f"{sample.__key__}: latent_frames do not cover frames 0..{count - 1} once each over "
                             f"{sample.latents.shape[1]} latent frames")
        for problem in camera_problems(sample.c2w.numpy(), sample.intrinsics.numpy(), width, height)[:5]:
            self.cameras.add(f"{sample.__key__} {problem}")

    def checks(self) -> list:
        return super().checks() + [self.cameras.check("every frame's camera valid, one per source frame")]


__all__ = ["WanSceneInspector", "WanScenes", "check_scene_shape", "latent_frames", "scene_samples"]
