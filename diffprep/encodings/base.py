"""What a pipeline stores per sample, and everything that follows from it: one ``Encoding`` per kind of dataset.

An encoding says which settings change its bytes (the fingerprint) and what
every sample must hold (plan.json's ``expected``), loads what writes its
samples (encoders, or nothing), turns a batch into samples' fields, runs the
one-batch sanity check its way, and tells validation how to load and judge a
sample. The pipeline, audit, finalize and validate ask the plan's encoding;
no other module branches on the kind of dataset.
"""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Mapping
from typing import Any, Callable, Sequence

import torch

from diffprep import contract
from diffprep.config import Settings
from diffprep.media.images import ImageSpec, bucket_name, image_buckets, image_size_of
from diffprep.writer.layouts import LayoutPreset, layout_for
from diffprep.media.buckets import Bucket, choose_bucket
from diffprep.output import Output
from diffprep.writer.plan import Plan, UnitPlan
from diffprep.run.reader import Batch
from diffprep.run.sanity import SanityReport
from diffprep.writer.shards import Reject, StoredSample, UnitManifest
from diffprep.sources import Source, SourceSample
from diffprep.sources.base import caption_settings

log = logging.getLogger("diffprep.encodings")

PROBE_CHUNK = 64  # samples read from the source at a time while planning


def probe_in_parallel(source: Source, ids: Sequence[str], bucket_of: Callable[[SourceSample], str | None],
                      workers: int) -> dict[str, str | None]:
    """``bucket_of`` every sample of ``ids``, read in chunks and probed on ``workers`` threads; logs the counts."""
    found: dict[str, str | None] = {}
    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="diffprep-probe") as pool:
        for first in range(0, len(ids), PROBE_CHUNK):
            chunk = list(ids[first:first + PROBE_CHUNK])
            for sid, bucket in zip(chunk, pool.map(bucket_of, source.read(chunk))):
                found[sid] = bucket
    counts = Counter(b or "(rejected at encode)" for b in found.values())
    log.info("planned %d samples into buckets in %.1f s: %s", len(found), time.perf_counter() - started,
             ", ".join(f"{b}: {n}" for b, n in sorted(counts.items())))
    return found


def with_caption_settings(byte: dict[str, Any], settings: Settings) -> dict[str, Any]:
    """``byte`` with the settings that decide the captions (class-label template, class names) and the meta's score
    fields (``--score-column``), where any is set."""
    captions = caption_settings(settings.source)
    byte = byte | {"captions": captions} if captions else byte
    return byte | {"scores": list(settings.source.score_columns)} if settings.source.score_columns else byte


# A batch -> the fields of each sample (a dict, or a Reject); samples kept but worth counting go in the Counter.
SampleFields = Callable[[Batch, Counter], list[dict | Reject]]


def encoded_samples(batch: Batch, latents: torch.Tensor, truncated: Sequence[bool], notes: Counter, medium: str,
                    fields: Callable[[int], dict[str, Any]]) -> list[dict | Reject]:
    """Each sample of an encoded batch: its ``fields(i)`` with its caption and meta, or a reject when its latents
    are not finite; captions the text encoder truncated are counted in ``notes``."""
    samples: list[dict | Reject] = []
    for i in range(len(batch.keys)):
        if not torch.isfinite(latents[i]).all():
            samples.append(Reject(batch.source_ids[i], "non_finite_latents",
                                  f"the VAE produced NaN or inf for this {medium}", phase="encode"))
            continue
        if truncated[i]:
            notes["caption_truncated"] += 1
        samples.append(fields(i) | {contract.CAPTION: batch.captions[i], contract.META: batch.metas[i]})
    return samples


class Encoding(ABC):
    """One kind of dataset (its Energon subflavor ``encoding: <name>``)."""

    name: str
    #: Named output layouts (``output.layout``) besides energon's own names: a trainer's member names for this
    #: encoding's fields (``diffprep.writer.layouts``). None: the member names are fixed (no layout, no key map).
    layout_presets: Mapping[str, LayoutPreset] | None = {}
    #: Whether --depth-column gives this encoding a field (Wan's depth_latent.pth); refused by name otherwise.
    reads_depth = False

    def variant(self, settings: Settings) -> str:
        """The encoding a run of this family with ``settings`` writes (its own name, or a variant's)."""
        if settings.video.audio_durations:
            from diffprep.errors import ConfigError

            raise ConfigError(f"--audio-durations {settings.video.audio_durations!r} is LTX-2's audio-only mode; "
                              f"the {self.name} encoding has no audio: remove it")
        return self.name

    def planned(self, settings: Settings, token: str | None) -> tuple[dict[str, Any], dict[str, Any]]:
        """``plan_settings``, with the output layout when it is not energon's own names (so an energon plan and
        its fingerprint stay as they always were): what fetch plans and ranks compare."""
        if not self.reads_depth:
            from diffprep.encodings.wan_depth import refuse_depth

            refuse_depth(settings, self.name)
        byte, expected = self.plan_settings(settings, token)
        layout = layout_for(settings.output, settings.model.negative_prompt, self.name, self.layout_presets,
                            self.required_fields(expected), scores=bool(settings.source.score_columns))
        return (byte if layout.is_default else byte | {"layout": layout.to_json()}), expected

    def byte_settings(self, settings: Settings, identity: dict[str, Any]) -> dict[str, Any]:
        """The settings that change the bytes of a shard, and so the fingerprint."""
        image = settings.image
        sizing = {
            "image_size": image.image_size,
            "center_crop": image.center_crop,
            "variable_size": image.variable_size,
            "max_size": image.max_size,
            "max_pixels": image.max_pixels,
            "background": list(image.background),
        }
        if image.buckets:  # only when set: an unbucketed plan (and its fingerprint) stays as it always was
            sizing["buckets"] = [bucket_name(b.width, b.height) for b in image_buckets(image)]
        if image.min_size is not None:  # the same: only a plan that rejects small images records it
            sizing["min_size"] = image.min_size
        if image.crop is not None:  # the same: only a plan cropped as EDM's or ADM's tool does records it
            sizing["crop"] = image.crop
        byte = {
            "contract": contract.CONTRACT_VERSION,
            "encoding": self.name,
            **identity,
            "shard_size": settings.output.shard_size,
            "image": sizing,
        }
        return with_caption_settings(byte, settings)

    @abstractmethod
    def plan_settings(self, settings: Settings, token: str | None) -> tuple[dict[str, Any], dict[str, Any]]:
        """(the fingerprinted byte settings, ``expected``: what every sample holds) for plan.json."""

    def media_spec(self, settings: Settings | None, plan: Plan | None = None) -> Any:
        """How the reader prepares a sample: ``ImageSpec`` (a video encoding: ``ClipSpec``), from the settings,
        or without them from the ``plan`` (re-reading a dataset's sources)."""
        if settings is None:
            return ImageSpec(**plan.settings["image"])
        return ImageSpec.from_config(settings.image)

    def source_options(self, plan_settings: Mapping[str, Any]) -> dict[str, Any]:
        """What opening the source takes besides its settings (``open_source(cfg, **options)``), from a plan's byte
        settings: a scene encoding's ``SceneSpec``, which decides a scenes source's ids (its chunks)."""
        return {}

    def bucketed(self, plan_settings: dict[str, Any]) -> bool:
        """Whether the plan puts each sample in a bucket (``probe_buckets``), one bucket per unit: images with
        ``image.buckets``."""
        return bool(plan_settings.get("image", {}).get("buckets"))

    def probe_buckets(self, settings: Settings, source: Source, ids: Sequence[str], plan_settings: dict[str, Any]
                      ) -> dict[str, str | None]:
        """The bucket name of each new id, from its header (None: unreadable; the encode phase names why)."""
        spec = ImageSpec(**plan_settings["image"])
        buckets = [Bucket(w, h, 1) for w, h in spec.buckets]

        def bucket_of(sample: SourceSample) -> str | None:
            if sample.reject is not None or sample.image is None or sample.caption is None:
                return None
            try:
                bucket = choose_bucket(*image_size_of(sample.image, spec), 1, buckets)
            except Exception:  # noqa: BLE001 - whatever the decoder says, the encode phase records it
                return None
            return bucket_name(bucket.width, bucket.height)

        return probe_in_parallel(source, ids, bucket_of, settings.image.decode_workers)

    def planned_ids(self, unit: UnitPlan, manifest: UnitManifest) -> list[str]:
        """The source ids a unit's committed ``manifest`` must account for (written or rejected): the plan's; an
        encoding whose unit is a container read only when it is written (an ingested file) says from the manifest."""
        return unit.source_ids

    @abstractmethod
    def required_fields(self, expected: dict[str, Any]) -> tuple[str, ...]:
        """The fields (tar member extensions) every sample of a plan with ``expected`` has."""

    def field_problem(self, fields: Sequence[str], expected: dict[str, Any] | None) -> str:
        """Why a sample with these fields is not one of this encoding's ('' when it is)."""
        if len(set(fields)) != len(fields):
            return f"duplicate fields {sorted(fields)}"
        required = (expected or {}).get("fields") or []
        if any(f not in fields for f in required):
            return f"missing {[f for f in required if f not in fields]} (required by the plan)"
        return ""

    @abstractmethod
    def load(self, settings: Settings, token: str | None) -> Any:
        """What writes the samples (encoders on a device), loaded once per process; None when nothing is."""

    def unit_writer(self, output: Output, plan: Plan) -> Callable[[], Any] | None:
        """What makes a unit's writer when it is not a shard (a trainer's own layout); None: the shard writer."""
        return None

    def own_folders(self, plan: Plan | None) -> Any:
        """A trainer's own folders that ``plan`` writes instead of Energon shards: what finalizes
        (``finalize(output, plan)``) and validates (``validate(output, plan)``) them; None: Energon shards."""
        return None

    @abstractmethod
    def sample_fields(self, settings: Settings, loaded: Any) -> SampleFields:
        """The function that turns a batch into its samples' fields."""

    @abstractmethod
    def batch_size(self, settings: Settings) -> int:
        """Samples per batch; only the pre-encoded batch size can be lowered after running out of memory."""

    @abstractmethod
    def sanity(self, output: Output, plan: Plan, loaded: Any, source: Source, spec: ImageSpec, *, settings: Settings,
               batch_size: int, units_left: Sequence[int] | None, workers: int,
               staged_samples: int | None) -> SanityReport:
        """One batch written into the state folder (never the dataset), checked, and the run projected."""

    def rejects_advice(self, report: Any, plan: Plan) -> str:
        """How a re-run could keep some of an ``AuditReport``'s rejected samples, in Markdown; '' if nothing."""
        return ""

    @abstractmethod
    def oom_advice(self, settings: Settings, loaded: Any) -> str:
        """What to change when even a batch of one does not fit in the device's memory."""

    @abstractmethod
    def holds(self, fields: Mapping[str, bytes]) -> bool:
        """Whether a stored sample with these fields is one of this encoding's (a dataset without a plan)."""

    @abstractmethod
    def decode_stored(self, stored: Sequence[StoredSample], plan: Plan | None, **options: Any
                      ) -> tuple[list[torch.Tensor], str | None]:
        """Stored samples back to uint8 pixels [3, H, W] (video: [F, 3, H, W]), and the model folder used if any.

        ``options``: ``model_path``, ``device``, ``token``, ``local_only``, ``decoder`` (one already loaded),
        ``where`` (the dataset, for messages).
        """

    def sound(self, plan: Plan | None, stored: Sequence[StoredSample], **options: Any) -> Any:
        """What decodes the stored samples' sound for ``diffprep decode`` (``decode(sample) -> ClipAudio``,
        ``mel_l1(decoded, source)``, ``picture(audio)``); None: they have none. ``options`` as ``decode_stored``'s."""
        return None

    @abstractmethod
    def task_encoder(self) -> Any:
        """The Energon task encoder that loads this encoding's samples (validation, training)."""

    @abstractmethod
    def inspector(self, expected: dict[str, Any] | None) -> Any:
        """A ``diffprep.validation`` sample inspector: checks every loaded sample, summarizes them."""


__all__ = ["Encoding", "SampleFields", "encoded_samples", "probe_in_parallel"]
