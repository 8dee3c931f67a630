"""Energon cookers and task encoders for posed-scene datasets (``encoding: scenes`` shards, ``encoding: wan_scenes``).

Training-side usage (a Wan scene dataset)::

    from diffprep.writer.scene_cooker import WanSceneTaskEncoder

    dataset = get_train_dataset(path, batch_size=None, ..., task_encoder=WanSceneTaskEncoder())
    for sample in get_loader(dataset):
        sample.latents          # [C, 1 + (N - 1) / 4, S / 8, S / 8]
        sample.prompt_embeds    # [512, 4096]
        sample.c2w              # float32 [N, 4, 4] OpenCV camera-to-world, one per source frame
        sample.intrinsics       # float32 [N, 3, 3] K in pixels of the encoded frames
        sample.latent_frames    # the source frames each latent frame covers

A raw scene shard loads with ``SceneTaskEncoder``: the mp4 bytes, the caption,
``poses`` [N, 4, 4] and ``intrinsics`` [N, 4] (fx fy cx cy) as numpy arrays, the
metadata, and the depth maps where the scenes have them. Tensors load with
``weights_only=True`` and arrays with ``allow_pickle=False``.
"""

from __future__ import annotations

import io
from typing import Any

import numpy as np
import torch
from megatron.energon import Cooker, DefaultTaskEncoder, Sample, basic_sample_keys, edataclass, stateless

from diffprep import contract
from diffprep.writer.cooker import _bucket_of, _field, _in_fields, _meta_of, _tensor, _text
from diffprep.writer.shards import SampleLoadError


@edataclass
class SceneSample(Sample):
    """One raw posed scene: the mp4 as stored and a camera per decoded frame."""

    video: bytes
    caption: str
    poses: np.ndarray  # float32 [N, 4, 4] OpenCV camera-to-world
    intrinsics: np.ndarray  # float32 [N, 4] fx fy cx cy in pixels of the mp4
    meta: dict  # fps, width, height, num_frames, scene_id, source, frames' names...
    depth: np.ndarray | None = None  # uint16 [N, d, d] millimetres (depth sources)


@edataclass
class WanSceneSample(Sample):
    """One pre-encoded posed scene (Wan): latents, text, and each source frame's camera."""

    latents: torch.Tensor
    prompt_embeds: torch.Tensor
    c2w: torch.Tensor  # float32 [N, 4, 4]
    intrinsics: torch.Tensor  # float32 [N, 3, 3]
    latent_frames: list  # latent frame j -> the source frames it covers
    caption: str
    meta: dict
    bucket: str


def _array(sample: dict, name: str) -> np.ndarray:
    try:
        return np.load(io.BytesIO(_field(sample, name)), allow_pickle=False)
    except SampleLoadError:
        raise
    except Exception as error:  # noqa: BLE001 - anything np.load refuses, named with the sample
        raise SampleLoadError(f"sample {sample.get('__key__')!r} field {name!r} is not a plain .npy: {error}") from None


@stateless
def cook_scene(sample: dict) -> SceneSample:
    sample = _in_fields(sample)
    return SceneSample(
        **basic_sample_keys(sample),
        video=_field(sample, contract.RAW_VIDEO),
        caption=_text(sample, contract.RAW_CAPTION),
        poses=_array(sample, contract.SCENE_POSES),
        intrinsics=_array(sample, contract.SCENE_INTRINSICS),
        meta=_meta_of(sample, contract.RAW_VIDEO_META),
        depth=_array(sample, contract.SCENE_DEPTH) if contract.SCENE_DEPTH in sample else None,
    )


@stateless
def cook_wan_scene(sample: dict) -> WanSceneSample:
    sample = _in_fields(sample)
    meta = _meta_of(sample)
    return WanSceneSample(
        **basic_sample_keys(sample),
        latents=_tensor(sample, contract.LATENTS),
        prompt_embeds=_tensor(sample, contract.PROMPT_EMBEDS),
        c2w=_tensor(sample, contract.SCENE_C2W),
        intrinsics=_tensor(sample, contract.SCENE_K),
        latent_frames=meta.get("latent_frames", []),
        caption=_text(sample, contract.CAPTION),
        meta=meta,
        bucket=_bucket_of(sample, meta),
    )


SCENE_COOKER = Cooker(cook_scene, has_subflavors={"encoding": contract.ENCODING_SCENES})
WAN_SCENE_COOKER = Cooker(cook_wan_scene, has_subflavors={"encoding": contract.ENCODING_WAN_SCENES})


class SceneTaskEncoder(DefaultTaskEncoder[SceneSample, SceneSample, Any, Any]):
    """Loads a raw scene dataset (``encoding: scenes``) sample by sample (decode the mp4 in your ``encode_sample``)."""

    decoder = None
    cookers = [SCENE_COOKER]


class WanSceneTaskEncoder(DefaultTaskEncoder[WanSceneSample, WanSceneSample, Any, Any]):
    """Loads a Wan scene dataset (``encoding: wan_scenes``) sample by sample; every sample of a plan has one shape,
    so a subclass may stack them in its ``batch``."""

    decoder = None
    cookers = [WAN_SCENE_COOKER]


__all__ = ["SceneSample", "SceneTaskEncoder", "WanSceneSample", "WanSceneTaskEncoder", "cook_scene",
           "cook_wan_scene"]
