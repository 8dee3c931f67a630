"""Energon cookers and task encoders for loading diffprep datasets in training code.

(Over 400 lines on purpose: every encoding's sample type, cooker and task encoder side by side, in the one
module training code imports.)

A finalized diffprep output is a ``CrudeWebdataset``: Energon hands each sample
to a *cooker* as a plain dict of raw bytes per field, and the cooker that
matches the dataset's subflavor (``encoding: preencoded`` or ``encoding: raw``)
turns it into a typed sample. Tensors are decoded here with
``torch.load(weights_only=True)``: the task encoders set ``decoder = None`` so
Energon's default webdataset decoder, which unpickles ``.pth`` files with
``weights_only=False`` (arbitrary code execution from a shard), never runs.

Training-side usage::

    from megatron.energon import WorkerConfig, get_loader, get_train_dataset
    from diffprep.writer.cooker import FluxPreencodedTaskEncoder

    worker_config = WorkerConfig(rank=rank, world_size=world_size, num_workers=4)
    dataset = get_train_dataset(
        "/data/my-dataset",
        batch_size=8,
        shuffle_buffer_size=100,
        max_samples_per_sequence=100,
        task_encoder=FluxPreencodedTaskEncoder(),
        worker_config=worker_config,
    )
    for batch in get_loader(dataset):
        batch.latents               # [B, 16, H/8, W/8], normalized (z - shift) * scale, unpacked
        batch.prompt_embeds         # [B, t5_max_length, 4096]
        batch.pooled_prompt_embeds  # [B, 768]
        batch.caption, batch.meta   # lists

Every layout loads the same way: a ``--layout fastgen`` or ``--key-map``
dataset records its member map in dataset.yaml's subflavors, and the cookers
read the members back under these names (``diffprep.writer.layouts``).

Batches are stacked, never padded: samples of different latent sizes in one
batch raise a ``ValueError``. Aspect-bucketed (``--buckets``) and variable-size
datasets load with ``FluxBucketedTaskEncoder``, which batches samples of one
size together (Energon's ``batch_group_criterion``); video datasets with
``VideoPreencodedTaskEncoder`` (one resolution bucket per batch). Raw datasets load with ``FluxRawTaskEncoder``,
which yields the image file's bytes and the caption (decode and augment in
your own ``encode_sample``); raw video datasets with ``RawVideoTaskEncoder`` (the mp4 bytes) or
``RawVideoFramesTaskEncoder`` (decoded frames, one bucket per batch). An ingested MLPerf Flux dataset
(``encoding: preencoded_numpy``) loads with ``NumpyPreencodedTaskEncoder``: its uint16 ``.npy`` words as bfloat16.
"""

from __future__ import annotations

import dataclasses
import io
import json
from typing import Any

import numpy as np
import torch
from megatron.energon import Batch, Cooker, DefaultTaskEncoder, Sample, basic_sample_keys, edataclass, stateless

from diffprep import contract
from diffprep.writer.layouts import Layout
from diffprep.writer.shards import SampleLoadError, load_tensor

# Fields of a raw (not pre-encoded) sample: one image file and its caption.
RAW_IMAGE_FIELDS = contract.RAW_IMAGE_FIELDS
RAW_CAPTION = contract.RAW_CAPTION


@edataclass
class FluxPreencodedSample(Sample):
    """One pre-encoded sample: VAE latents and the two text embeddings of its caption."""

    #: [16, H/8, W/8], already normalized with the VAE's shift and scaling factors.
    latents: torch.Tensor
    #: T5 sequence embeddings [t5_max_length, 4096].
    prompt_embeds: torch.Tensor
    #: CLIP pooled embedding [768].
    pooled_prompt_embeds: torch.Tensor
    caption: str
    #: Source id, original size, crop box.
    meta: dict
    #: latent_mode "posterior" only: the VAE posterior's raw mean and log-variance [16, H/8, W/8] (no shift or
    #: scale), for drawing a fresh latent every epoch: scale * (mean + exp(logvar / 2) * noise - shift).
    mean: torch.Tensor | None = None
    logvar: torch.Tensor | None = None


@edataclass
class FluxPreencodedBatch(Batch):
    latents: torch.Tensor
    prompt_embeds: torch.Tensor
    pooled_prompt_embeds: torch.Tensor
    caption: list[str]
    meta: list[dict]


@edataclass
class FluxRawSample(Sample):
    """One raw sample: the image file as stored and its caption."""

    image: bytes
    #: The image's field name in the shard: one of ``RAW_IMAGE_FIELDS``.
    image_format: str
    caption: str


def _field(sample: dict, name: str) -> bytes:
    try:
        return sample[name]
    except KeyError:
        fields = sorted(k for k in sample if not k.startswith("__"))
        raise SampleLoadError(f"sample {sample.get('__key__')!r} has no {name!r} field (it has {fields})") from None


def _text(sample: dict, name: str) -> str:
    try:
        return _field(sample, name).decode("utf-8")
    except UnicodeDecodeError as error:
        raise SampleLoadError(f"sample {sample.get('__key__')!r} field {name!r} is not UTF-8 text: {error}") from None


def _in_fields(sample: dict) -> dict:
    """A crude sample under the fields' own names, whatever layout wrote it (dataset.yaml's subflavors name it)."""
    return Layout.of_subflavors(sample.get("__subflavors__")).read(sample, sample.get("__key__", "?"))


def _tensor(sample: dict, name: str) -> torch.Tensor:
    """A tensor field: loaded from its bytes (weights only), or already loaded out of a tuple member."""
    value = _field(sample, name)
    return value if isinstance(value, torch.Tensor) else load_tensor(value, key=sample.get("__key__", "?"), field=name)


@stateless
def cook_preencoded(sample: dict) -> FluxPreencodedSample:
    """Turn a crude pre-encoded sample (raw bytes per field) into a ``FluxPreencodedSample``."""
    sample = _in_fields(sample)
    tensors = {
        contract.field_stem(name): _tensor(sample, name)
        for name in contract.TENSOR_FIELDS + contract.POSTERIOR_FIELDS
        if name in sample or name in contract.TENSOR_FIELDS
    }
    meta = _meta_of(sample)
    return FluxPreencodedSample(
        **basic_sample_keys(sample),
        latents=tensors["latents"],
        prompt_embeds=tensors["prompt_embeds"],
        pooled_prompt_embeds=tensors["pooled_prompt_embeds"],
        caption=_text(sample, contract.CAPTION),
        meta=meta,
        mean=tensors.get("mean"),
        logvar=tensors.get("logvar"),
    )


@stateless
def cook_raw(sample: dict) -> FluxRawSample:
    """Turn a crude raw sample into a ``FluxRawSample`` (image bytes untouched)."""
    images = [name for name in RAW_IMAGE_FIELDS if name in sample]
    if len(images) != 1:
        fields = sorted(k for k in sample if not k.startswith("__"))
        raise SampleLoadError(
            f"sample {sample.get('__key__')!r} must have exactly one image field of {list(RAW_IMAGE_FIELDS)}, "
            f"it has {fields}"
        )
    return FluxRawSample(
        **basic_sample_keys(sample),
        image=sample[images[0]],
        image_format=images[0],
        caption=_text(sample, RAW_CAPTION),
    )


@edataclass
class VideoPreencodedSample(Sample):
    """One pre-encoded clip of a video family (Wan): latents of its bucket and its caption's text sequence."""

    #: [C, 1 + (F - 1) / t, H / s, W / s], normalized per channel with the VAE's latents_mean / latents_std.
    latents: torch.Tensor
    #: [L, D] (umT5: [512, 4096]), zero after the caption's tokens.
    prompt_embeds: torch.Tensor
    caption: str
    meta: dict
    #: "WxHxF": the resolution bucket (samples of one bucket batch together).
    bucket: str
    #: --depth-column: the depth clip's latents, shaped and normalized as ``latents``; else None.
    depth_latent: torch.Tensor | None = None


@edataclass
class VideoPreencodedBatch(Batch):
    latents: torch.Tensor
    prompt_embeds: torch.Tensor
    caption: list[str]
    meta: list[dict]
    bucket: list[str]
    depth_latent: torch.Tensor | None = None


def _meta_of(sample: dict, name: str = contract.META) -> dict:
    key = sample.get("__key__", "?")
    try:
        meta = json.loads(_text(sample, name))
    except json.JSONDecodeError as error:
        raise SampleLoadError(f"sample {key!r} field {name!r} is not valid JSON: {error}") from None
    if not isinstance(meta, dict):
        raise SampleLoadError(f"sample {key!r} field {name!r} holds a {type(meta).__name__}, expected an object")
    return meta


def _bucket_of(sample: dict, meta: dict) -> str:
    bucket = meta.get("bucket")
    if not (isinstance(bucket, list) and len(bucket) == 3):
        raise SampleLoadError(f"sample {sample.get('__key__', '?')!r} metadata has no bucket [W, H, F]")
    return "x".join(str(v) for v in bucket)


@stateless
def cook_video(sample: dict) -> VideoPreencodedSample:
    """Turn a crude pre-encoded clip into a ``VideoPreencodedSample`` (its bucket from meta.json)."""
    sample = _in_fields(sample)
    meta = _meta_of(sample)
    bucket = _bucket_of(sample, meta)
    return VideoPreencodedSample(
        **basic_sample_keys(sample),
        latents=_tensor(sample, contract.LATENTS),
        prompt_embeds=_tensor(sample, contract.PROMPT_EMBEDS),
        caption=_text(sample, contract.CAPTION),
        meta=meta,
        bucket=bucket,
        depth_latent=_tensor(sample, contract.DEPTH_LATENT) if contract.DEPTH_LATENT in sample else None,
    )


@edataclass
class RawVideoSample(Sample):
    """One raw clip (``encoding: raw_video``): the H.264 mp4 as stored, its caption and metadata."""

    #: The mp4 file's bytes: the clip's frames at its bucket size (``meta["fps"]`` frames per second).
    video: bytes
    caption: str
    #: Source id, fps, frame indices and times, bucket, crop box.
    meta: dict
    #: "WxHxF": the resolution bucket.
    bucket: str
    #: ``RawVideoFramesTaskEncoder`` only: the decoded frames, uint8 RGB [F, 3, H, W].
    frames: torch.Tensor | None = None


@edataclass
class RawVideoBatch(Batch):
    frames: torch.Tensor  # uint8 [B, F, 3, H, W]
    caption: list[str]
    meta: list[dict]
    bucket: list[str]


@stateless
def cook_raw_video(sample: dict) -> RawVideoSample:
    """Turn a crude raw clip into a ``RawVideoSample`` (mp4 bytes untouched, its bucket from the metadata)."""
    sample = _in_fields(sample)
    meta = _meta_of(sample, contract.RAW_VIDEO_META)
    return RawVideoSample(
        **basic_sample_keys(sample),
        video=_field(sample, contract.RAW_VIDEO),
        caption=_text(sample, RAW_CAPTION),
        meta=meta,
        bucket=_bucket_of(sample, meta),
    )


@edataclass
class Ltx2Sample(Sample):
    """One LTX-2 sample: the tensors of the LTX-2 trainer's records (reference/consumer-formats.md A1)."""

    #: [128, 1 + (F - 1) / 8, H / 32, W / 32] bf16, normalized posterior mean (the trainer's latents/); None in
    #: an audio-only dataset (``encoding: ltx2_audio``).
    latents: torch.Tensor | None
    #: [1024, D] bf16: the Gemma feature extractor's video output (conditions/ video_prompt_embeds).
    prompt_embeds: torch.Tensor
    #: [1024, D_a] bf16: its audio output (LTX-2: a copy of prompt_embeds; LTX-2.3: a projection of its own).
    audio_prompt_embeds: torch.Tensor
    #: [1024] int64, left-padded (conditions/ prompt_attention_mask).
    prompt_attention_mask: torch.Tensor
    #: [8, T, 16] float32 (audio_latents/), None in a --skip-audio dataset.
    audio_latents: torch.Tensor | None
    #: IC-LoRA datasets: the reference clip's latents (reference_latents/), else None.
    reference_latents: torch.Tensor | None
    caption: str
    meta: dict
    #: ``WxHxF``; audio only: the duration bucket (``2s``).
    bucket: str
    #: A2A / AV2AV IC-LoRA: the reference sound's audio latents [8, T, 16] float32 (reference_audio_latents/).
    reference_audio_latents: torch.Tensor | None = None
    #: Inpainting: float 0/1 masks in the latent grid, video [F', H', W'] (video_masks/), audio [T'] (audio_masks/).
    video_mask: torch.Tensor | None = None
    audio_mask: torch.Tensor | None = None


def _cook_ltx2(sample: dict, *, video: bool) -> Ltx2Sample:
    sample = _in_fields(sample)
    key = sample.get("__key__", "?")
    meta = _meta_of(sample)

    def tensor(name: str, required: bool = True) -> torch.Tensor | None:
        if not required and name not in sample:
            return None
        return load_tensor(_field(sample, name), key=key, field=name)

    prompt_embeds = tensor(contract.PROMPT_EMBEDS)
    audio_prompt_embeds = tensor(contract.AUDIO_PROMPT_EMBEDS, required=False)
    return Ltx2Sample(
        **basic_sample_keys(sample),
        latents=tensor(contract.LATENTS) if video else None,
        prompt_embeds=prompt_embeds,
        audio_prompt_embeds=prompt_embeds if audio_prompt_embeds is None else audio_prompt_embeds,
        prompt_attention_mask=tensor(contract.PROMPT_ATTENTION_MASK),
        audio_latents=tensor(contract.AUDIO_LATENTS, required=not video),
        reference_latents=tensor(contract.REFERENCE_LATENTS, required=False) if video else None,
        caption=_text(sample, contract.CAPTION),
        meta=meta,
        bucket=("x".join(str(v) for v in meta.get("bucket") or ["?"]) if video else str(meta.get("bucket", "?"))),
        reference_audio_latents=tensor(contract.REFERENCE_AUDIO_LATENTS, required=False),
        video_mask=tensor(contract.VIDEO_MASK, required=False),
        audio_mask=tensor(contract.AUDIO_MASK, required=False),
    )


@stateless
def cook_ltx2(sample: dict) -> Ltx2Sample:
    """Turn a crude LTX-2 sample into an ``Ltx2Sample``; the optional tensors are None where the dataset has none."""
    return _cook_ltx2(sample, video=True)


@stateless
def cook_ltx2_audio(sample: dict) -> Ltx2Sample:
    """Turn a crude audio-only LTX-2 sample (T2A) into an ``Ltx2Sample`` without video latents."""
    return _cook_ltx2(sample, video=False)


@edataclass
class NumpyPreencodedSample(Sample):
    """One ingested MLPerf Flux sample (``encoding: preencoded_numpy``), as Primus's trainer reads it: bfloat16."""

    prompt_embeds: torch.Tensor  # T5 sequence [L, 4096]
    pooled_prompt_embeds: torch.Tensor  # CLIP pooled [768]
    mean: torch.Tensor  # the VAE posterior's mean [16, H/8, W/8]
    logvar: torch.Tensor  # and its log-variance
    meta: dict  # the row's key and source id


def load_bf16_npy(data: bytes, *, key: str = "?", field: str = "?") -> torch.Tensor:
    """uint16 ``.npy`` bytes (no pickle) as the bfloat16 tensor they hold."""
    try:
        array = np.load(io.BytesIO(data), allow_pickle=False)
    except Exception as error:  # noqa: BLE001 - numpy's errors, named with the sample
        raise SampleLoadError(f"sample {key!r} field {field!r} is not a plain .npy: {error}") from None
    if array.dtype.kind != "u" or array.dtype.itemsize != 2:
        raise SampleLoadError(f"sample {key!r} field {field!r} is {array.dtype}, not uint16 words of bfloat16")
    return torch.from_numpy(array.astype("<u2", copy=True)).view(torch.bfloat16)


@stateless
def cook_preencoded_numpy(sample: dict) -> NumpyPreencodedSample:
    key = sample.get("__key__", "?")
    tensors = {name: load_bf16_npy(_field(sample, member), key=key, field=member)
               for name, member in (("prompt_embeds", contract.T5_BYTES), ("pooled_prompt_embeds", contract.CLIP_BYTES),
                                    ("mean", contract.MEAN_BYTES), ("logvar", contract.LOGVAR_BYTES))}
    return NumpyPreencodedSample(**basic_sample_keys(sample), **tensors,
                                 meta=json.loads(_text(sample, contract.INGESTED_META)))


PREENCODED_COOKER = Cooker(cook_preencoded, has_subflavors={"encoding": contract.ENCODING_PREENCODED})
RAW_COOKER = Cooker(cook_raw, has_subflavors={"encoding": contract.ENCODING_RAW})
WAN_COOKER = Cooker(cook_video, has_subflavors={"encoding": contract.ENCODING_WAN})
LTX2_COOKER = Cooker(cook_ltx2, has_subflavors={"encoding": contract.ENCODING_LTX2})
LTX2_AUDIO_COOKER = Cooker(cook_ltx2_audio, has_subflavors={"encoding": contract.ENCODING_LTX2_AUDIO})
RAW_VIDEO_COOKER = Cooker(cook_raw_video, has_subflavors={"encoding": contract.ENCODING_RAW_VIDEO})
NUMPY_COOKER = Cooker(cook_preencoded_numpy, has_subflavors={"encoding": contract.ENCODING_PREENCODED_NUMPY})
COOKERS = [PREENCODED_COOKER, RAW_COOKER, WAN_COOKER, LTX2_COOKER, LTX2_AUDIO_COOKER, RAW_VIDEO_COOKER, NUMPY_COOKER]


def _stack(samples: list[Any], name: str) -> torch.Tensor:
    tensors = [getattr(sample, name) for sample in samples]
    shapes = {tuple(t.shape) for t in tensors}
    if len(shapes) > 1:
        raise ValueError(
            f"cannot batch {name} of different shapes {sorted(shapes)}: use batch_size=1 or group samples "
            "by size with batch_group_criterion"
        )
    return torch.stack(tensors)


class FluxPreencodedTaskEncoder(
    DefaultTaskEncoder[FluxPreencodedSample, FluxPreencodedSample, FluxPreencodedBatch, FluxPreencodedBatch]
):
    """Loads a pre-encoded diffprep dataset; batches are stacked ``FluxPreencodedBatch``es."""

    # No webdataset decoding: the cooker gets raw bytes and loads tensors with weights_only=True.
    decoder = None
    cookers = [PREENCODED_COOKER]

    @stateless
    def batch(self, samples: list[FluxPreencodedSample]) -> FluxPreencodedBatch:
        return FluxPreencodedBatch.from_samples(
            samples,
            latents=_stack(samples, "latents"),
            prompt_embeds=_stack(samples, "prompt_embeds"),
            pooled_prompt_embeds=_stack(samples, "pooled_prompt_embeds"),
            caption=[sample.caption for sample in samples],
            meta=[sample.meta for sample in samples],
        )


class FluxBucketedTaskEncoder(FluxPreencodedTaskEncoder):
    """Loads an aspect-bucketed pre-encoded dataset (``--buckets``) for training: a batch holds samples of one
    latent size only (Energon's ``batch_group_criterion``). Needs a ``batch_size``."""

    def batch_group_criterion(self, sample: FluxPreencodedSample) -> tuple[tuple[int, ...], None]:
        return tuple(sample.latents.shape), None  # None: the loader's batch_size for every bucket


class FluxRawTaskEncoder(DefaultTaskEncoder[FluxRawSample, FluxRawSample, Any, Any]):
    """Loads a raw diffprep dataset as ``FluxRawSample``s (image bytes + caption).

    Decode and transform images in a subclass's ``encode_sample``; the default
    batch is a list-valued ``FluxRawSample``.
    """

    decoder = None
    cookers = [RAW_COOKER]


class VideoSampleTaskEncoder(
    DefaultTaskEncoder[VideoPreencodedSample, VideoPreencodedSample, VideoPreencodedBatch, VideoPreencodedBatch]
):
    """Loads a pre-encoded video dataset (``encoding: wan``) sample by sample (``batch_size=None``: validation)."""

    decoder = None
    cookers = [WAN_COOKER]


class _OneBucketPerBatch:
    """Batches of one resolution bucket only (Energon's ``batch_group_criterion``): clips of different sizes are
    never stacked together."""

    def batch_group_criterion(self, sample: Any) -> tuple[str, None]:
        return sample.bucket, None  # None: the loader's batch_size for every bucket


def _bucket_batch(batch_type: type, samples: list[Any], *tensors: str) -> Any:
    """A batch of one bucket's samples: ``tensors`` stacked, captions, metas and buckets as lists."""
    return batch_type.from_samples(samples, **{name: _stack(samples, name) for name in tensors},
                                   caption=[s.caption for s in samples], meta=[s.meta for s in samples],
                                   bucket=[s.bucket for s in samples])


class VideoPreencodedTaskEncoder(_OneBucketPerBatch, VideoSampleTaskEncoder):
    """Loads a pre-encoded video dataset for training, one bucket per batch. Needs a ``batch_size``."""

    @stateless
    def batch(self, samples: list[VideoPreencodedSample]) -> VideoPreencodedBatch:
        depth = ("depth_latent",) if samples[0].depth_latent is not None else ()
        return _bucket_batch(VideoPreencodedBatch, samples, "latents", "prompt_embeds", *depth)


class Ltx2SampleTaskEncoder(DefaultTaskEncoder[Ltx2Sample, Ltx2Sample, Any, Any]):
    """Loads an LTX-2 dataset (``encoding: ltx2``, or ``ltx2_audio``: audio only) sample by sample:
    ``Ltx2Sample``s with the trainer's tensors.

    Training: ``batch_size=1`` as the LTX-2 trainer (several buckets, and audio lengths that follow each clip's
    frame rate, do not stack), or a subclass grouping by ``sample.bucket`` with ``batch_group_criterion``.
    """

    decoder = None
    cookers = [LTX2_COOKER, LTX2_AUDIO_COOKER]


class RawVideoTaskEncoder(DefaultTaskEncoder[RawVideoSample, RawVideoSample, Any, Any]):
    """Loads a raw video dataset (``encoding: raw_video``) as ``RawVideoSample``s: the mp4 bytes, caption, metadata
    (sample by sample: validation; decode and augment in your own ``encode_sample``)."""

    decoder = None
    cookers = [RAW_VIDEO_COOKER]


class RawVideoFramesTaskEncoder(_OneBucketPerBatch, RawVideoTaskEncoder):
    """Loads a raw video dataset for training: each mp4 decoded to uint8 frames ``[F, 3, H, W]``
    (``diffprep.media.mp4.mp4_frames``), a batch holding one bucket only. Needs a ``batch_size``."""

    @stateless
    def encode_sample(self, sample: RawVideoSample) -> RawVideoSample:
        from diffprep.media.mp4 import mp4_frames

        try:
            frames = mp4_frames(sample.video)
        except Exception as error:  # noqa: BLE001 - av's errors and an empty clip, named with the sample
            raise SampleLoadError(f"sample {sample.__key__!r} mp4 does not decode: {type(error).__name__}: "
                                  f"{error}") from None
        return dataclasses.replace(sample, frames=frames)

    @stateless
    def batch(self, samples: list[RawVideoSample]) -> RawVideoBatch:
        return _bucket_batch(RawVideoBatch, samples, "frames")


class NumpyPreencodedTaskEncoder(DefaultTaskEncoder[NumpyPreencodedSample, NumpyPreencodedSample, Any, Any]):
    """Loads an ingested MLPerf Flux dataset (``encoding: preencoded_numpy``): bfloat16 tensors, Energon's default
    batching."""

    decoder = None
    cookers = [NUMPY_COOKER]
