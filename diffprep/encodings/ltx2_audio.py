"""LTX-2 audio only (T2A): audio files through ltx-core's audio VAE, captions through Gemma, no video latents.

The LTX-2 trainer's text-to-audio mode (``process_dataset.py`` with an ``audio`` column and
``--audio-durations``): each file's decoded audio (stereo at its own rate) goes to the longest duration
bucket not longer than it and is trimmed to that; a file shorter than every bucket is ``too_short_audio``
(the trainer drops it with a warning). One duration bucket per unit, so a unit's audio latents stack.

Per sample (Energon layout, ``encoding: ltx2_audio``): ``audio_latents.pth`` ``[8, T, 16]`` float32 (T about
25 per second of the bucket), ``prompt_embeds.pth`` / ``prompt_attention_mask.pth`` (and
``audio_prompt_embeds.pth`` for an LTX-2.3 checkpoint) as for a clip, ``caption.txt``, ``meta.json`` (the
file's rate, channels and seconds, its bucket ``2s``). ``--layout ltx`` writes ``conditions/`` and
``audio_latents/`` only: what the trainer's flexible strategy reads for T2A (``video: null``, ``audio:
{latents_dir: audio_latents}``), with ``conditions/`` as its primary folder since there is no ``latents/``.

Sound decoded back and its error figure: ``diffprep.encodings.ltx2_sound``.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from diffprep import contract
from diffprep.config import Settings
from diffprep.encodings import clips
from diffprep.encodings.base import probe_in_parallel, with_caption_settings
from diffprep.encodings.ltx2_inputs import INPUT_FIELDS, expected_shapes
from diffprep.encodings.ltx2 import (
    STORED_DTYPES,
    Ltx2,
    Ltx2Inspector,
    _text_width,
    audio_gate_advice,
    encode_sanity_batch,
)
from diffprep.errors import ConfigError
from diffprep.families.base import DTYPES
from diffprep.media.audio import AudioSpec, duration_name, parse_durations
from diffprep.output import Output
from diffprep.writer.plan import Plan, dtype_name, shape_matches
from diffprep.run.reader import first_batch
from diffprep.run.sanity import TAR_MEMBER_OVERHEAD, SanityReport
from diffprep.writer.shards import tensor_bytes
from diffprep.sources import Source, SourceSample

_AUDIO_SECONDS = re.compile(r"the audio is ([0-9.]+) s")


def audio_fields(separate_audio_text: bool) -> list[str]:
    """The fields of every sample of an audio-only plan (sorted, as tar members are)."""
    fields = [contract.AUDIO_LATENTS, contract.PROMPT_EMBEDS, contract.PROMPT_ATTENTION_MASK, contract.CAPTION,
              contract.META]
    return sorted(fields + ([contract.AUDIO_PROMPT_EMBEDS] if separate_audio_text else []))


def _seconds(bucket: str) -> float:
    return float(bucket.removesuffix("s"))


class Ltx2Audio(Ltx2):
    """LTX-2 text-to-audio: audio latents and Gemma features, as the LTX-2 trainer stores them for T2A."""

    name = contract.ENCODING_LTX2_AUDIO
    video = False

    def plan_settings(self, settings: Settings, token: str | None) -> tuple[dict[str, Any], dict[str, Any]]:
        from diffprep.families.ltx2 import describe_ltx2, resolve_ltx2
        from diffprep.sources import open_source

        model, video, source = settings.model, settings.video, settings.source
        try:
            durations = parse_durations(video.audio_durations)
        except ValueError as error:
            raise ConfigError(str(error)) from None
        if video.skip_audio:
            raise ConfigError("--audio-durations makes an audio-only (T2A) run and --skip-audio one without audio: "
                              "choose one")
        if video.target_fps is not None:
            raise ConfigError(f"--target-fps {video.target_fps} resamples clips' frames; an audio-only (T2A) run has "
                              "none: remove it")
        if source.reference_key:
            raise ConfigError("an audio-only (T2A) run has no clips to take IC-LoRA references for: remove "
                              f"--reference-column {source.reference_key}")
        opened = open_source(source) if source.type == "metadata" else None
        inputs = [role for role in ("reference_audio", "audio_mask") if role in getattr(opened, "extra_columns", [])]
        if "video_mask" in getattr(opened, "extra_columns", []):
            raise ConfigError(f"{source.metadata_file} has a 'video_mask' column: an audio-only run has no frames "
                              "to mask; list the files without it")
        if not getattr(opened, "audio_only", False):
            raise ConfigError("--audio-durations is for an audio-only (T2A) run: a metadata file with an `audio` "
                              "column (or --audio-column) and no video, media_path or image column; for clips, "
                              "leave it out (their sound is trimmed to the frames kept)")
        parts = resolve_ltx2(model.model_path, model.text_encoder_path)
        identity = describe_ltx2(parts.checkpoint, parts.gemma, dtype=DTYPES[model.precision], video=False,
                                 audio=True, text_encoder_8bit=model.load_text_encoder_in_8bit)
        separate = identity["text"]["feature_extractor"] == "FeatureExtractorV2"
        audio = {"durations": [duration_name(d) for d in durations], "separate_audio_text": separate,
                 **({"inputs": inputs} if inputs else {})}
        byte = {
            "contract": contract.CONTRACT_VERSION,
            "encoding": self.name,
            "encoders": identity,
            "shard_size": settings.output.shard_size,
            "audio": audio,
            "lora_trigger": model.lora_trigger,
        }
        byte = with_caption_settings(byte, settings)
        width = _text_width(parts.gemma, parts.checkpoint)
        expected: dict[str, Any] = {
            "audio_latents": [8, None, 16],
            "prompt_embeds": [width["video"], width["video_dim"]],
            "prompt_attention_mask": [width["video"]],
            "fields": sorted(audio_fields(separate) + [INPUT_FIELDS[role] for role in inputs]),
            "dtypes": {contract.field_stem(f): dtype_name(d) for f, d in STORED_DTYPES.items()
                       if f not in (contract.LATENTS, contract.REFERENCE_LATENTS)},
        }
        if separate:
            expected["audio_prompt_embeds"] = [width["video"], width["audio_dim"]]
        expected.update(expected_shapes(inputs))
        return byte, expected

    def media_spec(self, settings: Settings | None, plan: Plan | None = None) -> AudioSpec:
        audio = plan.settings["audio"]
        return AudioSpec(tuple(_seconds(d) for d in audio["durations"]), inputs=tuple(audio.get("inputs", ())))

    def probe_buckets(self, settings: Settings, source: Source, ids: Sequence[str], plan_settings: dict[str, Any]
                      ) -> dict[str, str | None]:
        """Each id's duration bucket, from its decoded audio (None: unreadable or too short; encode names why)."""
        spec = AudioSpec(tuple(_seconds(d) for d in plan_settings["audio"]["durations"]))

        def bucket_of(sample: SourceSample) -> str | None:
            if sample.reject is not None or sample.audio is None or sample.caption is None:
                return None
            try:
                return duration_name(spec.bucket_of(sample.audio))
            except Exception:  # noqa: BLE001 - a reject or whatever the decoder says: the encode phase records it
                return None

        return probe_in_parallel(source, ids, bucket_of, settings.image.decode_workers)

    def sanity(self, output: Output, plan: Plan, loaded: Any, source: Any, spec: Any, *, settings: Settings,
               batch_size: int, units_left: Sequence[int] | None, workers: int,
               staged_samples: int | None) -> SanityReport:
        """The audio backend's test tone, then one batch of the longest planned duration: shapes and dtypes as
        planned, finite, the audio decoded again (log-mel L1 against the source), the run projected per bucket."""
        from diffprep.media.audio import check_audio_backend

        problems: list[str] = []
        try:
            check_audio_backend()
        except RuntimeError as error:
            problems.append(f"audio: {error}")
        left = set(units_left) if units_left is not None else {u.unit for u in plan.units}
        bucketed = [u for u in plan.units if u.bucket and u.unit in left] or [u for u in plan.units if u.bucket]
        longest = max((_seconds(u.bucket) for u in bucketed), default=None)
        decode_start = time.perf_counter()
        batch = first_batch(plan, source, spec, batch_size,
                            units=[u for u in bucketed if _seconds(u.bucket) == longest] or None)
        decode_seconds = time.perf_counter() - decode_start
        tensors, seconds, memory, found, finite, mel_l1 = encode_sanity_batch(plan, loaded, batch)
        problems += found

        paced = seconds + decode_seconds if loaded.device.type == "cpu" else seconds
        first = {name: len(tensor_bytes(t[0])) for name, t in tensors.items()}
        members = TAR_MEMBER_OVERHEAD * len(plan.expected["fields"])
        others = sum(size for name, size in first.items() if name != contract.AUDIO_LATENTS) + 512 + members
        measured = _seconds(batch.metas[0]["bucket"])

        def bytes_of(seconds: float) -> int:  # audio latents grow with the seconds, the text features do not
            return int(first[contract.AUDIO_LATENTS] * seconds / measured) + others

        buckets = clips.project_buckets(plan, left, measured=measured, samples=len(batch.keys),
                                        seconds_per_sample=paced / len(batch.keys), bytes_of=bytes_of,
                                        memory=(memory.baseline, memory.peak), batch_size=batch_size,
                                        workers=workers, parse=_seconds, size=lambda s: (s, s))
        return clips.sanity_report(output, tensors, buckets, bucket=batch.metas[0]["bucket"], problems=problems,
                                   finite=finite, psnrs=[], sheet=None, seconds=seconds, memory=memory,
                                   per_sample=sum(first.values()) + 512 + members, min_psnr=settings.model.min_psnr,
                                   staged_samples=staged_samples, audio_mel_l1=mel_l1)

    def rejects_advice(self, report: Any, plan: Plan) -> str:
        """Files shorter than every duration bucket (the exact --audio-durations that would keep them), and the
        audio gate: files with no audio stream or whose audio does not decode, named."""
        advice = []
        lengths = [float(m.group(1)) for r in report.rejected_ids if r.get("reason") == "too_short_audio"
                   for m in [_AUDIO_SECONDS.search(r.get("detail", ""))] if m]
        if lengths:
            shortest = math.floor(min(lengths) * 10) / 10
            durations = {_seconds(d) for d in plan.settings["audio"]["durations"]} | ({shortest} if shortest else set())
            spec = ";".join(f"{d:g}" for d in sorted(durations))
            advice.append(
                f"`add a shorter duration bucket`: {report.by_reason.get('too_short_audio', len(lengths))} files "
                f"are shorter than every duration bucket (the shortest is {min(lengths):.3f} s). To keep them, re-run "
                f"with `--audio-durations \"{spec}\"` and `--on-existing overwrite` (other settings: a new "
                "fingerprint), or accept and train without them.")
        advice.append(audio_gate_advice(report, "files", "fix or re-export their audio and encode them again"))
        return "\n\n".join(a for a in advice if a)

    def oom_advice(self, settings: Settings, loaded: Any) -> str:
        return (f"use shorter --audio-durations (now {settings.video.audio_durations}), --load-text-encoder-in-8bit "
                f"(Gemma 3 12B in int8), --batch-size 1, or free memory on {loaded.device}")

    def holds(self, fields: Mapping[str, bytes]) -> bool:
        return contract.PROMPT_ATTENTION_MASK in fields and contract.LATENTS not in fields

    def decode_stored(self, stored: Sequence[Any], plan: Plan | None, **options: Any
                      ) -> tuple[list[torch.Tensor | None], str | None]:
        """No pictures to decode: the sound (``sound``) is the sample, shown as its log-mel spectrogram."""
        checkpoint = plan.settings["encoders"]["checkpoint"].get("path") if plan else options.get("model_path")
        return [None] * len(stored), checkpoint

    def inspector(self, expected: dict[str, Any] | None) -> Ltx2AudioInspector:
        return Ltx2AudioInspector(expected)


class Ltx2AudioInspector(Ltx2Inspector):
    """Validation of loaded T2A samples: every tensor's shape and dtype as planned, finite, the audio latents of
    one duration bucket all of one length, their per-channel statistics."""

    def __init__(self, expected: dict[str, Any] | None) -> None:
        super().__init__(expected)
        self.lengths: dict[str, int] = {}  # duration bucket -> the audio latents' time steps

    def inspect(self, sample: Any) -> None:
        if self.expected is None:
            self.expected = {"audio_latents": [8, None, 16], "source": f"first sample {sample.__key__}", "dtypes": {}}
        dtypes = self.expected.get("dtypes") or {}
        from diffprep.encodings.ltx2_masks import mask_problems

        for problem in mask_problems(None, sample.audio_latents, None, getattr(sample, "audio_mask", None)):
            self.shapes.add(f"{sample.__key__} {problem}")
        for stem in ("audio_latents", "prompt_embeds", "audio_prompt_embeds", "prompt_attention_mask",
                     "reference_audio_latents", "audio_mask"):
            tensor = getattr(sample, stem, None)
            if tensor is None or (stem == "audio_prompt_embeds" and "audio_prompt_embeds" not in self.expected):
                continue
            shape = tuple(tensor.shape)
            seen = self.fields.setdefault(stem, {"shapes": {}, "dtypes": {}})
            seen["shapes"][str(list(shape))] = seen["shapes"].get(str(list(shape)), 0) + 1
            seen["dtypes"][dtype_name(tensor.dtype)] = seen["dtypes"].get(dtype_name(tensor.dtype), 0) + 1
            want = self.expected.get(stem)
            if want is not None and not shape_matches(shape, want):
                self.shapes.add(f"{sample.__key__} {stem} has shape {list(shape)}, expected {want}")
            if dtypes.get(stem) and dtype_name(tensor.dtype) != dtypes[stem]:
                self.shapes.add(f"{sample.__key__} {stem} has dtype {tensor.dtype}, expected {dtypes[stem]}")
            if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
                self.finite.add(f"{sample.__key__} {stem} has NaN/Inf values")
        bucket = sample.bucket
        self.buckets[bucket] = self.buckets.get(bucket, 0) + 1
        steps = int(sample.audio_latents.shape[1])
        if self.lengths.setdefault(bucket, steps) != steps:
            self.shapes.add(f"{sample.__key__} audio_latents have {steps} time steps, other samples of bucket "
                            f"{bucket} {self.lengths[bucket]}")
        if self.stats.mean is None or self.stats.mean.shape[0] == sample.audio_latents.shape[0]:
            self.stats.add(sample.audio_latents)
