"""Reading a unit: its source samples decoded in a thread pool and batched by size, a batch or two ahead.

A unit is read and decoded in a background thread (images decoded by a small
thread pool, a bounded queue of ready batches in between) while the encoders
work on the previous batch. A sample that cannot be used becomes a reject with
a reason; it never stops the unit.

``spec`` says how: an ``ImageSpec`` (images, ``[B, 3, H, W]`` batches), a
``ClipSpec`` (clips in their unit's bucket, ``[B, F, 3, H, W]`` batches; an
image is a one-frame clip), an ``AudioSpec`` (audio files trimmed to their
unit's duration bucket: the batch's ``audio``, and no pixels), a ``PromptSpec``
(captions only: nothing decoded, no pixels) or a ``SceneSpec`` (posed scenes, each its frames
``[N, 3, H, W]`` and cameras: ``[B, N, 3, H, W]`` batches of scenes of one shape, the ``PreparedScene``s in
``Batch.scenes``; with ``scenes.frames`` unset scenes differ in N, so a batch holds the consecutive scenes of one
frame count and size, down to one).
"""

from __future__ import annotations

import queue
import threading
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from diffprep import contract
from diffprep.errors import DiffprepError, RejectError
from diffprep.run.failpoints import failpoint
from diffprep.media.images import ImageSpec, PreparedImage, prepare_image
from diffprep.run.long_videos import prepare_clip_window, read_clips
from diffprep.media.audio import AudioSpec, PreparedAudio
from diffprep.media.clip_inputs import prepare_with_inputs
from diffprep.media.buckets import parse_bucket
from diffprep.media.scene_frames import PreparedScene, SceneSpec
from diffprep.media.video import ClipSpec, PreparedClip
from diffprep.writer.plan import Plan, UnitPlan
from diffprep.writer.shards import Reject
from diffprep.sources import Source, SourceSample
from diffprep.sources.base import read_planned
from diffprep.sources.labels import LabeledSample


@dataclass
class Batch:
    keys: list[str]
    source_ids: list[str]
    captions: list[str]
    pixels: torch.Tensor  # uint8 [B, 3, H, W] (clips: [B, F, 3, H, W]; audio only: [B, 0])
    metas: list[dict]
    audio: list[Any] | None = None  # each clip's ClipAudio, when the ClipSpec reads audio (LTX-2)
    references: torch.Tensor | None = None  # IC-LoRA reference clips, uint8 [B, F, 3, H', W'] (LTX-2)
    # LTX-2's other inputs per clip (ClipSpec.inputs): reference sound (ClipAudio), masks (media/clip_inputs.py).
    reference_audio: list[Any] | None = None
    video_masks: list[torch.Tensor] | None = None
    audio_masks: list[torch.Tensor] | None = None
    depths: list[torch.Tensor] | None = None  # Wan: each clip's depth clip, uint8 [F, 3, H, W] (media/depth_video.py)
    scenes: list[PreparedScene] | None = None  # a scene batch's cameras, depth and meta per scene (SceneSpec)


@dataclass(frozen=True)
class PromptSpec:
    """A captions-only run (``diffprep.encodings.prompts``): a sample needs its caption; its media is not decoded."""


@dataclass(frozen=True)
class PreparedPrompt:
    pixels: torch.Tensor  # uint8 [0]: nothing is decoded
    meta: dict


Spec = ImageSpec | ClipSpec | AudioSpec | PromptSpec | SceneSpec
Prepared = PreparedImage | PreparedClip | PreparedAudio | PreparedPrompt | PreparedScene


def _prepare(sample: SourceSample, spec: Spec, bucket: str | None = None) -> Prepared:
    if sample.reject is not None:
        raise sample.reject
    if isinstance(spec, SceneSpec):
        if sample.scene is None:
            raise RejectError("missing_scene", "a scenes run needs a posed scene for every sample (--source-type "
                              "scenes)", phase="read")
        failpoint("decode")
        return spec.prepare(sample.scene)
    if sample.scene is not None:
        raise RejectError("unexpected_scene", "a posed scene in a run that does not store scenes", phase="read")
    if isinstance(spec, PromptSpec):
        if sample.caption is None:
            raise RejectError("missing_caption", "the source gave no caption for this sample", phase="read")
        return PreparedPrompt(torch.zeros(0, dtype=torch.uint8), {})
    if sample.media is None:
        raise RejectError("missing_image", "the source gave no image for this sample", phase="read")
    if sample.caption is None:
        raise RejectError("missing_caption", "the source gave no caption for this sample", phase="read")
    failpoint("decode")
    if isinstance(spec, AudioSpec):
        if sample.audio is None:
            raise RejectError("missing_audio", "an audio-only run needs an audio file for every sample", phase="read")
        return prepare_with_inputs(spec, sample.audio, sample.extras,
                                   bucket=float(bucket.removesuffix("s")) if bucket else None)
    if isinstance(spec, ClipSpec) and spec.scenes is not None:
        return prepare_clip_window(spec, sample, bucket)
    if isinstance(spec, ClipSpec):
        return prepare_with_inputs(spec, sample.media, sample.extras, video=sample.video is not None,
                                   bucket=parse_bucket(bucket) if bucket else None, reference=sample.reference)
    if sample.image is None:
        raise RejectError("unexpected_video", "a clip in an image run: encode it with a video model family (or "
                          "store clips with `diffprep raw --resolution-buckets`)", phase="read")
    return prepare_image(sample.image, spec)


def iter_prepared(
    source: Source, unit: UnitPlan, spec: Spec, *, workers: int = 2, depth: int = 16
) -> Iterator[tuple[int, SourceSample, Prepared | RejectError]]:
    """Yield ``(index, sample, prepared-or-reject)`` in unit order, decoding ``depth`` images ahead."""
    pending: deque[tuple[int, SourceSample, Future]] = deque()
    with ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="diffprep-decode") as pool:
        def resolve(item):
            index, sample, future = item
            try:
                return index, sample, future.result()
            except RejectError as exc:
                return index, sample, exc
            except Exception as exc:  # noqa: BLE001 - a sample PIL chokes on is a reject, not a crash
                kind = ("scene" if sample.scene is not None else "video" if sample.video is not None
                        else "audio" if sample.audio is not None else "image")
                return index, sample, RejectError(f"{kind}_decode_error", f"{type(exc).__name__}: {exc}")

        count = 0
        scenes = isinstance(spec, ClipSpec) and spec.scenes is not None
        # A unit planned with its samples' locators reads them there (getattr: plans written before them have none).
        samples = (read_clips(source, unit.source_ids, spec.scenes) if scenes
                   else read_planned(source, unit.source_ids, getattr(unit, "positions", None)))
        for index, sample in enumerate(samples):
            count += 1
            if sample.source_id != unit.source_ids[index]:
                raise DiffprepError(
                    f"the source returned {sample.source_id!r} where unit {unit.unit} planned "
                    f"{unit.source_ids[index]!r}; the source must read ids in the order given"
                )
            pending.append((index, sample, pool.submit(_prepare, sample, spec, unit.bucket)))
            while len(pending) > depth:
                yield resolve(pending.popleft())
        while pending:
            yield resolve(pending.popleft())
    if count != len(unit.source_ids):
        raise DiffprepError(f"the source returned {count} samples for unit {unit.unit}, planned {len(unit.source_ids)}")


def _meta(sample: SourceSample, image: Prepared, spec: Spec) -> dict:
    """The sample's meta: its source id, what preparing it recorded and its score columns' numbers (top level)."""
    if isinstance(image, (PreparedClip, PreparedAudio, PreparedPrompt, PreparedScene)):
        return {"source_id": sample.source_id, **image.meta, **sample.scores}
    size = [int(image.pixels.shape[2]), int(image.pixels.shape[1])]
    meta = {
        "source_id": sample.source_id,
        "original_size": list(image.original_size),
        "crop_box": list(image.crop_box),
        "size": size,
        "notes": list(image.notes),
    }
    if spec.buckets:  # aspect-ratio buckets: the bucket is the output size
        meta["bucket"] = size
    if isinstance(sample, LabeledSample):  # a class-conditional source: the label training code conditions on
        meta["label"] = sample.label
        meta["class_name"] = sample.class_name
    return meta | dict(sample.scores)


def iter_batches(
    source: Source,
    unit: UnitPlan,
    spec: Spec,
    batch_size: int,
    rejects: list[Reject],
    *,
    workers: int = 2,
) -> Iterator[Batch]:
    """Batches of consecutive samples of the same size; rejects are appended to ``rejects`` as they come."""
    items: list[tuple[int, SourceSample, Prepared]] = []

    def flush() -> Batch:
        batch = Batch(
            keys=[contract.sample_key(unit.unit, i) for i, _, _ in items],
            source_ids=[s.source_id for _, s, _ in items],
            captions=[s.caption for _, s, _ in items],
            pixels=torch.stack([img.pixels for _, _, img in items]),
            metas=[_meta(s, img, spec) for _, s, img in items],
            audio=[img.audio for _, _, img in items] if getattr(spec, "audio", False) else None,
            references=(torch.stack([img.reference.pixels for _, _, img in items])
                        if getattr(spec, "reference_scale", None) else None),
            **{name: [getattr(img, attr) for _, _, img in items] for name, attr, role in _INPUTS
               if role in getattr(spec, "inputs", ())},
            scenes=[img for _, _, img in items] if isinstance(spec, SceneSpec) else None,
        )
        items.clear()
        return batch

    for index, sample, result in iter_prepared(source, unit, spec, workers=workers, depth=2 * batch_size):
        if isinstance(result, RejectError):
            rejects.append(Reject(sample.source_id, result.reason, result.detail, result.phase))
            continue
        if items and (len(items) == batch_size or items[0][2].pixels.shape != result.pixels.shape
                      or _reference_shape(items[0][2]) != _reference_shape(result)):
            yield flush()
        items.append((index, sample, result))
    if items:
        yield flush()


_INPUTS = (("reference_audio", "reference_audio", "reference_audio"), ("video_masks", "video_mask", "video_mask"),
           ("audio_masks", "audio_mask", "audio_mask"), ("depths", "depth", "depth"))  # Batch field, PreparedClip field, ClipSpec.inputs role


def _reference_shape(prepared: Prepared) -> tuple[int, ...] | None:
    reference = getattr(prepared, "reference", None)
    return None if reference is None else tuple(reference.pixels.shape)


def prefetch(batches: Iterator[Batch], depth: int = 2) -> Iterator[Batch]:
    """Run ``batches`` in a background thread, ``depth`` batches ahead; errors surface in the caller."""
    done = object()
    ready: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def produce() -> None:
        try:
            for batch in batches:
                while not stop.is_set():
                    try:
                        ready.put(batch, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if stop.is_set():
                    return
            ready.put(done)
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer
            ready.put(exc)

    thread = threading.Thread(target=produce, name="diffprep-reader", daemon=True)
    thread.start()
    try:
        while True:
            item = ready.get()
            if item is done:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
        while thread.is_alive():
            try:
                ready.get_nowait()
            except queue.Empty:
                thread.join(timeout=0.1)


def first_batch(plan: Plan, source: Source, spec: Spec, batch_size: int, *,
                units: list[UnitPlan] | None = None) -> Batch:
    """The first batch that decodes, from the first ``units`` (default: the plan's): at most a few are read."""
    rejects: list[Reject] = []
    for unit in units if units is not None else plan.units:
        batch = next(iter_batches(source, unit, spec, batch_size, rejects), None)
        if batch is not None:
            return batch
    raise DiffprepError(
        "sanity: no sample of the source could be decoded; rejects: "
        + "; ".join(f"{r.source_id}: {r.reason} {r.detail}" for r in rejects[:5])
    )
