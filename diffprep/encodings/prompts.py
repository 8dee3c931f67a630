"""Captions only: ``diffprep raw --prompts-only``, the shards FastGen's ``PromptLoaderConfig`` reads.

FastGen's backward-simulation recipes make the student's inputs from its own
trajectories, so their loader reads only prompts: ``txt`` per sample. Any
source with captions gives them (a folder, a metadata file, Hugging Face, tar
shards, class folders); the source reads each sample as always, but nothing is
decoded or stored of its media. A sample (Energon subflavor ``encoding:
prompts``) holds

- ``txt``: the caption, UTF-8, normalized as in every source;
- ``json``: the source id and, with ``--score-column``, the row's scores as
  top-level numbers (FastGen's ``presets_filter`` reads this member).

A sample without a caption is the reject ``missing_caption``; an empty caption
is kept and counted (``empty_caption``), as in the other pipelines.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Mapping
from typing import Any, Sequence

import torch

from diffprep import contract
from diffprep.report.checks import Check, Findings
from diffprep.config import Settings
from diffprep.encodings.base import Encoding, SampleFields, with_caption_settings
from diffprep.errors import ConfigError
from diffprep.writer.layouts import LayoutPreset
from diffprep.output import Output
from diffprep.writer.plan import Plan
from diffprep.run.reader import Batch, PromptSpec, first_batch
from diffprep.run.sanity import TAR_MEMBER_OVERHEAD, SanityReport, finish_sanity, peak_memory, project_run
from diffprep.writer.shards import Reject, field_bytes
from diffprep.sources import Source

BATCH_SIZE = 256  # captions per batch; only groups the work, any value gives the same bytes
PROMPT_FIELDS = (contract.RAW_CAPTION, contract.RAW_VIDEO_META)  # txt, json


class PromptWriter:
    """The prompts pipeline's stand-in for the encoders (one per process; holds nothing)."""

    @staticmethod
    def sample_fields(batch: Batch, notes: Counter) -> list[dict | Reject]:
        """``SampleFields``: each sample's caption and its json (source id, scores)."""
        return [{contract.RAW_CAPTION: caption, contract.RAW_VIDEO_META: meta}  # empty captions: counted by units
                for caption, meta in zip(batch.captions, batch.metas)]


class Prompts(Encoding):
    """Captions stored alone; nothing is decoded or encoded."""

    name = contract.ENCODING_PROMPTS
    # FastGen's prompt loader reads txt under its own name; --layout fastgen adds shard_counts.json.
    layout_presets = {contract.LAYOUT_FASTGEN: LayoutPreset(members={}, shard_counts=True)}

    def plan_settings(self, settings: Settings, token: str | None) -> tuple[dict[str, Any], dict[str, Any]]:
        if settings.video.resolution_buckets or settings.raw.keep_audio:
            raise ConfigError("--prompts-only stores captions alone: remove --resolution-buckets / --keep-audio")
        if settings.output.layout == contract.LAYOUT_EDM_ZIP:
            raise ConfigError("--prompts-only writes txt shards; --layout edm-zip is an image archive: remove one")
        byte = {"contract": contract.CONTRACT_VERSION, "encoding": self.name,
                "shard_size": settings.output.shard_size}
        return with_caption_settings(byte, settings), {"fields": sorted(PROMPT_FIELDS)}

    def media_spec(self, settings: Settings | None, plan: Plan | None = None) -> PromptSpec:
        return PromptSpec()

    def bucketed(self, plan_settings: dict[str, Any]) -> bool:
        return False

    def required_fields(self, expected: dict[str, Any]) -> tuple[str, ...]:
        return tuple(expected["fields"])

    def load(self, settings: Settings, token: str | None) -> PromptWriter:
        return PromptWriter()

    def sample_fields(self, settings: Settings, loaded: PromptWriter) -> SampleFields:
        return loaded.sample_fields

    def batch_size(self, settings: Settings) -> int:
        return BATCH_SIZE

    def sanity(self, output: Output, plan: Plan, loaded: None, source: Source, spec: PromptSpec, *,
               settings: Settings, batch_size: int, units_left: Sequence[int] | None, workers: int,
               staged_samples: int | None) -> SanityReport:
        """One batch of captions read and written into memory; the run's size and time projected."""
        start = time.perf_counter()
        batch = first_batch(plan, source, spec, BATCH_SIZE)
        samples = PromptWriter.sample_fields(batch, Counter())
        seconds = time.perf_counter() - start
        sizes = [sum(len(field_bytes(value)) for value in sample.values()) for sample in samples]
        per_sample = round(sum(sizes) / len(sizes)) + TAR_MEMBER_OVERHEAD * len(PROMPT_FIELDS)
        remaining, projected_seconds, free = project_run(output, plan, units_left, seconds, len(samples), 1)
        report = SanityReport(
            ok=True, samples=len(samples), shapes={}, dtypes={}, finite=True, psnr_db=[],
            seconds_per_batch=round(seconds, 4), peak_memory_bytes=peak_memory(torch.device("cpu")),
            bytes_per_sample=per_sample, projected_bytes=per_sample * remaining,
            projected_seconds=round(projected_seconds, 1), free_bytes=free,
            local_bytes=None if staged_samples is None else per_sample * min(remaining, staged_samples))
        return finish_sanity(output, report, remaining)

    def oom_advice(self, settings: Settings, loaded: None) -> str:
        return "nothing is held but captions: free host memory"

    def holds(self, fields: Mapping[str, bytes]) -> bool:
        return set(fields) == set(PROMPT_FIELDS)

    def decode_stored(self, stored: Sequence[Any], plan: Plan | None, **options: Any):
        raise ConfigError("a prompts dataset stores captions only: there is no picture to decode; read its txt "
                          "members")

    def task_encoder(self) -> Any:
        from diffprep.writer.prompt_cooker import PromptTaskEncoder  # Energon: finalize and validation only

        return PromptTaskEncoder()

    def inspector(self, expected: dict[str, Any] | None) -> PromptInspector:
        return PromptInspector()


class PromptInspector:
    """Validation of loaded captions: the json holds the source id and only finite numbers beside it (what
    FastGen's score filter compares); counts empty captions."""

    def __init__(self) -> None:
        self.meta = Findings("json")
        self.empty = 0
        self.samples = 0

    def inspect(self, sample: Any) -> None:
        self.samples += 1
        self.empty += not sample.caption.strip()
        meta = sample.meta
        if not isinstance(meta, dict) or not isinstance(meta.get("source_id"), str):
            self.meta.add(f"{sample.__key__} json is not an object with its source_id: {meta!r}"[:300])
            return
        bad = [k for k, v in meta.items() if k != "source_id" and (isinstance(v, bool) or not isinstance(v, (int, float))
                                                                   or v != v or v in (float("inf"), float("-inf")))]
        if bad:
            self.meta.add(f"{sample.__key__} json fields {bad} are not finite numbers")

    def checks(self) -> list[Check]:
        return [self.meta.check("every json holds its source id and finite numbers only")]

    def summary(self) -> dict[str, Any]:
        return {"captions": self.samples, "empty_captions": self.empty}

    def passed(self) -> tuple[list[Check], dict[str, Any], dict[str, bytes]]:
        return [], {}, {}


__all__ = ["PROMPT_FIELDS", "PromptInspector", "Prompts", "PromptWriter"]
