"""The LTX-2 encoding: clips through ltx-core's video and audio VAEs, captions through Gemma + the feature extractor.

(Over 400 lines: the plan, the encoding, the sanity check and the inspector of one family read together; the
audio-only variant is ``ltx2_audio``, decoding sound back ``ltx2_sound``.)

Per sample (bucket ``W x H x F``, Energon layout): ``latents.pth`` ``[128, 1 + (F - 1) / 8, H / 32, W / 32]``
bf16 (posterior mean, normalized with the checkpoint's statistics), ``audio_latents.pth`` ``[8, T, 16]`` float32
from the clip's own audio track (T about 25 per second; not with ``--skip-audio``), ``prompt_embeds.pth``
``[1024, D]`` bf16 (the feature extractor's video output; ``audio_prompt_embeds.pth`` too where the checkpoint
projects audio separately, LTX-2.3), ``prompt_attention_mask.pth`` ``[1024]`` int64 (left-padded),
``reference_latents.pth`` (IC-LoRA runs: the reference clip at ``(F, H/N, W/N)``), ``caption.txt`` (with the
LoRA trigger, as encoded) and ``meta.json`` (the clip's, plus ``fps`` and the audio seconds). These are exactly
the tensors of the LTX-2 trainer's ``.precomputed/`` records (``--layout ltx`` writes those instead:
``diffprep.encodings.ltx_layout``), in the dtypes it stores, whatever ``--precision`` the encoders ran in.

The clip machinery is Wan's (buckets planned from the container's index, one bucket per unit, the same rejects
and the same "add a shorter bucket" advice); this class adds the audio track (``no_audio_stream`` and
``audio_decode_error`` are rejects; the sanity check first decodes a generated tone), the reference clip and the
trainer's dtypes.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import Counter
from dataclasses import replace
from typing import Any, Mapping, Sequence

import torch

from diffprep import contract
from diffprep.config import Settings
from diffprep.families.base import DTYPES, resolve_device
from diffprep.families.imports import family_imports
from diffprep.encodings.preencoded import PreencodedInspector
from diffprep.encodings import clips
from diffprep.encodings.base import with_caption_settings
from diffprep.encodings.ltx2_inputs import INPUT_FIELDS, expected_shapes, read_columns
from diffprep.encodings.wan import Wan
from diffprep.errors import ConfigError
from diffprep.writer.layouts import LayoutPreset
from diffprep.media.buckets import Bucket, parse_buckets
from diffprep.media.video import ClipSpec
from diffprep.output import Output
from diffprep.writer.plan import Plan, dtype_name, shape_matches
from diffprep.run.reader import Batch
from diffprep.run.sanity import TAR_MEMBER_OVERHEAD, MemoryWatch, SanityReport, check_round_trip
from diffprep.writer.shards import Reject, load_tensor, tensor_bytes
from diffprep.run.workers import claimed_device

log = logging.getLogger(__name__)
_LOADED: dict[str, Any] = {}
_LOCK = threading.Lock()

# The dtypes the trainer stores (reference/consumer-formats.md A1), per field.
STORED_DTYPES = {
    contract.LATENTS: torch.bfloat16,
    contract.REFERENCE_LATENTS: torch.bfloat16,
    contract.AUDIO_LATENTS: torch.float32,
    contract.PROMPT_EMBEDS: torch.bfloat16,
    contract.AUDIO_PROMPT_EMBEDS: torch.bfloat16,
    contract.PROMPT_ATTENTION_MASK: torch.int64,
    contract.REFERENCE_AUDIO_LATENTS: torch.float32,
    contract.VIDEO_MASK: torch.float32,
    contract.AUDIO_MASK: torch.float32,
}


def ltx2_fields(video: Mapping[str, Any]) -> list[str]:
    """The fields every sample of a plan with these ``video`` byte settings has (sorted, as tar members are)."""
    fields = [contract.LATENTS, contract.PROMPT_EMBEDS, contract.PROMPT_ATTENTION_MASK, contract.CAPTION,
              contract.META]
    if video.get("audio"):
        fields.append(contract.AUDIO_LATENTS)
    if video.get("separate_audio_text"):
        fields.append(contract.AUDIO_PROMPT_EMBEDS)
    if video.get("reference_scale"):
        fields.append(contract.REFERENCE_LATENTS)
    fields += [INPUT_FIELDS[role] for role in video.get("inputs", ()) if role in INPUT_FIELDS]
    return sorted(fields)


class Ltx2(Wan):
    """LTX-2 on ltx-core: video + audio latents and Gemma features, as the LTX-2 trainer stores them."""

    name = contract.ENCODING_LTX2
    # ltx: the trainer's .precomputed/ folders (diffprep.encodings.ltx_layout), made from the same fields under
    # their own names; no FastGen names (FastGen reads no LTX-2 data: reference/consumer-formats.md B1).
    layout_presets = {contract.LAYOUT_LTX: LayoutPreset(members={})}
    reads_depth = False
    video = True  # clips: the video VAE (False: the audio-only encoding, ltx2_audio)

    def variant(self, settings: Settings) -> str:
        """--audio-durations makes the audio-only encoding's run (T2A, ``diffprep.encodings.ltx2_audio``)."""
        return contract.ENCODING_LTX2_AUDIO if settings.video.audio_durations else self.name

    # --- the plan ---------------------------------------------------------------------------------------------

    def plan_settings(self, settings: Settings, token: str | None) -> tuple[dict[str, Any], dict[str, Any]]:
        from diffprep.families.ltx2 import describe_ltx2, resolve_ltx2

        model, video, source = settings.model, settings.video, settings.source
        parts = resolve_ltx2(model.model_path, model.text_encoder_path)
        audio = not video.skip_audio
        if audio and video.frame_sampling != "head" and video.split_scenes is None:
            raise ConfigError("LTX-2 with audio takes the first F frames and the audio under them (the trainer's "
                              "rule): use --frame-sampling head, or --skip-audio")
        inputs = read_columns(settings)
        identity = describe_ltx2(parts.checkpoint, parts.gemma, dtype=DTYPES[model.precision], audio=audio,
                                 text_encoder_8bit=model.load_text_encoder_in_8bit)
        space, time_factor = identity["video"]["scale_space"], identity["video"]["scale_time"]
        # Wan's rejects advice reads the temporal factor from here.
        identity["temporal_factor"], identity["spatial_factor"] = time_factor, space
        buckets = parse_buckets(video.resolution_buckets, space, time_factor)
        scale = video.reference_downscale_factor if source.reference_key else None
        if scale is not None:
            _check_reference_buckets(buckets, scale, space)
        separate_audio_text = identity["text"]["feature_extractor"] == "FeatureExtractorV2" and audio
        scenes = clips.clip_spec(video, video.resolution_buckets, space, time_factor).scenes  # --split-scenes
        video_bytes = {
            "buckets": [str(b) for b in buckets],
            "target_fps": video.target_fps,
            "frame_sampling": video.frame_sampling,
            "max_pixels": ClipSpec(tuple(buckets)).max_pixels,
            "audio": audio,
            "reference_scale": scale,
            "separate_audio_text": separate_audio_text,
            **({"inputs": inputs} if inputs else {}),
            **({"scenes": scenes.to_json()} if scenes is not None else {}),
        }
        byte = {
            "contract": contract.CONTRACT_VERSION,
            "encoding": self.name,
            "encoders": identity,
            "shard_size": settings.output.shard_size,
            "video": video_bytes,
            "lora_trigger": model.lora_trigger,
        }
        byte = with_caption_settings(byte, settings)
        channels = identity["video"]["latent_channels"]

        def latent_shape(b: Bucket) -> list[int]:
            return [channels, 1 + (b.frames - 1) // time_factor, b.height // space, b.width // space]

        shapes = {str(b): latent_shape(b) for b in buckets}
        width = _text_width(parts.gemma, parts.checkpoint)
        expected: dict[str, Any] = {
            "latents": next(iter(shapes.values())) if len(shapes) == 1 else [channels, None, None, None],
            "prompt_embeds": [width["video"], width["video_dim"]],
            "prompt_attention_mask": [width["video"]],
            "buckets": shapes,
            "fields": ltx2_fields(video_bytes),
            "dtypes": {contract.field_stem(f): dtype_name(d) for f, d in STORED_DTYPES.items()},
        }
        if audio:
            expected["audio_latents"] = [8, None, 16]
        if separate_audio_text:
            expected["audio_prompt_embeds"] = [width["video"], width["audio_dim"]]
        expected.update(expected_shapes(inputs))
        if scale is not None:
            [bucket] = buckets
            expected["reference_latents"] = latent_shape(Bucket(bucket.width // scale, bucket.height // scale,
                                                                bucket.frames))
        return byte, expected

    def required_fields(self, expected: dict[str, Any]) -> tuple[str, ...]:
        return tuple(expected.get("fields") or ())

    def field_problem(self, fields: Sequence[str], expected: dict[str, Any] | None) -> str:
        return super(Wan, self).field_problem(fields, expected)

    # --- encoding ---------------------------------------------------------------------------------------------

    def load(self, settings: Settings, token: str | None) -> Any:
        """The encoders (video, audio unless --skip-audio, text, and the video decoder), once per process."""
        from diffprep.families.ltx2 import Ltx2Encoders, resolve_ltx2

        model = settings.model
        device = resolve_device(claimed_device() or model.device)
        if model.load_text_encoder_in_8bit and device.type != "cuda":
            log.warning("--load-text-encoder-in-8bit on %s: bitsandbytes 0.50 runs its int8 layers on the CPU too "
                        "(about half Gemma's memory), more slowly than bf16; the memory figure in "
                        "benchmarks/README.md is CUDA's", device)
        key = json.dumps([model.model_dump(mode="json"), str(device), settings.video.skip_audio, self.video],
                         sort_keys=True)
        with _LOCK:
            if key not in _LOADED:
                _LOADED.clear()  # one encoder set per process: free the previous one first
                parts = resolve_ltx2(model.model_path, model.text_encoder_path)
                _LOADED[key] = Ltx2Encoders.load(
                    parts.checkpoint, parts.gemma, device=device, dtype=DTYPES[model.precision], video=self.video,
                    audio=not settings.video.skip_audio, decoders=True,
                    text_encoder_8bit=model.load_text_encoder_in_8bit,
                )
            return _LOADED[key]

    def unit_writer(self, output: Output, plan: Plan):
        """--layout ltx: the trainer's record files under the output (a ``.precomputed`` folder)."""
        from diffprep.encodings.ltx_layout import PrecomputedWriter
        from diffprep.families.ltx2_precomputed import is_ltx

        return (lambda: PrecomputedWriter(output.local, plan)) if is_ltx(plan) else None

    def own_folders(self, plan: Plan | None) -> Any:
        """--layout ltx: the trainer's folders, read as they are (no Energon metadata, no split)."""
        from diffprep.encodings import ltx_layout
        from diffprep.families.ltx2_precomputed import is_ltx

        return ltx_layout if is_ltx(plan) else None

    def sample_fields(self, settings: Settings, loaded: Any):
        trigger = settings.model.lora_trigger

        def fields(batch: Batch, notes: Counter) -> list[dict | Reject]:
            return encode_batch(loaded, batch, trigger, notes)[0]

        return fields

    def sanity(self, output: Output, plan: Plan, loaded: Any, source: Any, spec: Any, *, settings: Settings,
               batch_size: int, units_left: Sequence[int] | None, workers: int,
               staged_samples: int | None) -> SanityReport:
        """The audio backend's test tone, then one batch at the largest planned bucket: shapes and dtypes as planned,
        finite, the clips decoded again (PSNR), and the run projected per bucket."""
        from diffprep.media.audio import check_audio_backend

        problems: list[str] = []
        if plan.settings["video"].get("audio"):
            try:
                check_audio_backend()
            except RuntimeError as error:
                problems.append(f"audio: {error}")
        left, batch, decode_seconds = clips.sanity_batch(plan, source, spec, batch_size, units_left)
        device = loaded.device
        bucket = Bucket(*batch.metas[0]["bucket"])
        tensors, seconds, memory, found, finite, mel_l1 = encode_sanity_batch(
            plan, loaded, batch, latents_shape=plan.expected["buckets"].get(str(bucket)), where=f" (bucket {bucket})")
        problems += found
        psnrs: list[float | None] = []
        sheet = None
        if finite:
            decoded = torch.stack([loaded.decode_video(latents.to(loaded.dtype)).permute(0, 3, 1, 2)
                                   for latents in tensors[contract.LATENTS]])
            psnrs, sheet, problem = check_round_trip(output, replace(batch, pixels=clips.strips(batch.pixels)),
                                                     clips.strips(decoded), settings.model.min_psnr)
            if problem:
                problems.append(problem)

        paced = seconds + decode_seconds if device.type == "cpu" else seconds
        first = {name: len(tensor_bytes(t[0])) for name, t in tensors.items()}
        others = sum(size for name, size in first.items() if name != contract.LATENTS) + 512
        members = TAR_MEMBER_OVERHEAD * len(plan.expected["fields"])
        item = STORED_DTYPES[contract.LATENTS].itemsize

        def bytes_of(b: Bucket) -> int:
            c, f, h, w = plan.expected["buckets"][str(b)]
            return item * c * f * h * w + others + members

        buckets = clips.project_buckets(plan, left, measured=bucket, samples=len(batch.keys),
                                        seconds_per_sample=paced / len(batch.keys), bytes_of=bytes_of,
                                        memory=(memory.baseline, memory.peak), batch_size=batch_size, workers=workers)
        return clips.sanity_report(output, tensors, buckets, bucket=bucket, problems=problems, finite=finite,
                                   psnrs=psnrs, sheet=sheet, seconds=seconds, memory=memory,
                                   per_sample=sum(first.values()) + 512 + members, min_psnr=settings.model.min_psnr,
                                   staged_samples=staged_samples, audio_mel_l1=mel_l1)

    def rejects_advice(self, report: Any, plan: Plan) -> str:
        """Clips too short for every bucket (Wan's advice), and the audio gate: clips of an audio run whose audio is
        missing or does not decode, named, with what each choice means."""
        advice = [super().rejects_advice(report, plan)]
        if plan.settings["video"].get("audio"):
            advice.append(audio_gate_advice(report, "clips", "fix their audio, or encode them in a run of their own "
                                            "with `--skip-audio` (video only)"))
        return "\n\n".join(a for a in advice if a)

    def oom_advice(self, settings: Settings, loaded: Any) -> str:
        return (f"use smaller or shorter --resolution-buckets (now {settings.video.resolution_buckets}), "
                f"--load-text-encoder-in-8bit (Gemma 3 12B in int8), --batch-size 1, or free memory on "
                f"{loaded.device}")

    # --- reading a dataset back -------------------------------------------------------------------------------

    def holds(self, fields: Mapping[str, bytes]) -> bool:
        return contract.PROMPT_ATTENTION_MASK in fields and contract.LATENTS in fields

    def decode_stored(self, stored: Sequence[Any], plan: Plan | None, *, model_path: str | None = None,
                      device: str = "auto", token: str | None = None, local_only: bool = False,
                      decoder: Any = None, where: str = "the dataset") -> tuple[list[torch.Tensor], str | None]:
        """The video latents through the checkpoint's video decoder (ltx-core): uint8 frames ``[F, 3, H, W]``."""
        from diffprep.families.ltx2 import Ltx2Encoders

        if decoder is None:
            recorded = plan.settings["encoders"]["checkpoint"].get("path") if plan else None
            if not (model_path or recorded):
                raise ConfigError(f"{where} has no plan.json naming its checkpoint; pass it with --model-path")
            decoder = Ltx2Encoders.load(_checkpoint_of(model_path or recorded), device=resolve_device(device),
                                        dtype=torch.float32, audio=False, text=False, decoders=True)
        clips = []
        for sample in stored:
            latents = load_tensor(sample.fields[contract.LATENTS], key=sample.key, field=contract.LATENTS)
            clips.append(decoder.decode_video(latents.to(decoder.dtype)).permute(0, 3, 1, 2).contiguous())
        return clips, str(decoder.checkpoint)

    def sound(self, plan: Plan | None, stored: Sequence[Any], *, model_path: str | None = None, device: str = "auto",
              where: str = "the dataset", **_: Any) -> Any:
        """What decodes the stored samples' sound (``ltx2_sound.Ltx2Sound``: audio VAE decoder + vocoder); None
        when they have no audio latents."""
        from diffprep.encodings.ltx2_sound import load_sound

        if not stored or contract.AUDIO_LATENTS not in stored[0].fields:
            return None
        recorded = plan.settings["encoders"]["checkpoint"].get("path") if plan else None
        if not (model_path or recorded):
            raise ConfigError(f"{where} has no plan.json naming its checkpoint; pass it with --model-path")
        return load_sound(_checkpoint_of(model_path or recorded), device)

    def task_encoder(self) -> Any:
        from diffprep.writer.cooker import Ltx2SampleTaskEncoder  # Energon: finalize and validation only

        return Ltx2SampleTaskEncoder()

    def inspector(self, expected: dict[str, Any] | None) -> Ltx2Inspector:
        return Ltx2Inspector(expected)


def encode_sanity_batch(plan: Plan, loaded: Any, batch: Batch, *, latents_shape: list[int] | None = None,
                        where: str = "") -> tuple[dict[str, torch.Tensor], float, MemoryWatch, list[str], bool,
                                                  list[float] | None]:
    """The sanity check's batch encoded: (its tensors per field, the seconds it took, the memory around it, the
    problems: rejects, shapes and dtypes other than planned, non-finite values; whether all is finite; with audio,
    each sample's sound decoded again and its log-mel L1 against the batch's waveform, else None)."""
    from diffprep.encodings.ltx2_sound import Ltx2Sound

    with MemoryWatch(loaded.device) as memory:
        start = time.perf_counter()
        samples, tensors = encode_batch(loaded, batch, plan.settings.get("lora_trigger"), Counter())
        seconds = time.perf_counter() - start
    problems = [f"{r.source_id}: {r.reason} ({r.detail})" for r in samples if isinstance(r, Reject)]
    for name, tensor in tensors.items():
        stem = contract.field_stem(name)
        want = latents_shape if name == contract.LATENTS else plan.expected.get(stem)
        have = list(tensor.shape[1:])
        if want is None or not shape_matches(have, want):
            problems.append(f"{name}: shape {have}, planned {want}{where}")
        if dtype_name(tensor.dtype) != plan.expected["dtypes"][stem]:
            problems.append(f"{name}: dtype {tensor.dtype}, planned {plan.expected['dtypes'][stem]}")
    finite = all(bool(torch.isfinite(t).all()) for t in tensors.values() if t.is_floating_point())
    if not finite:
        problems.append("non-finite values in the encoded batch (wrong precision for this VAE?)")
    mel_l1 = None
    if finite and contract.AUDIO_LATENTS in tensors and loaded.audio_decoder is not None:
        sound = Ltx2Sound(loaded)
        mel_l1 = [round(sound.mel_l1(loaded.decode_audio(latents), track), 4)
                  for latents, track in zip(tensors[contract.AUDIO_LATENTS], batch.audio)]
    return tensors, seconds, memory, problems, finite, mel_l1


def audio_gate_advice(report: Any, items: str, instead: str) -> str:
    """The audio gate's advice: the ``items`` of an audio run with no usable audio, named, and what to do
    ``instead`` to keep them ('' when there are none)."""
    from diffprep.media.audio import REJECT_AUDIO_DECODE_ERROR, REJECT_NO_AUDIO_STREAM

    counts = {r: report.by_reason.get(r, 0) for r in (REJECT_NO_AUDIO_STREAM, REJECT_AUDIO_DECODE_ERROR)}
    if not sum(counts.values()):
        return ""
    names = [r["source_id"] for r in report.rejected_ids if r["reason"] in counts]
    shown = ", ".join(f"`{n}`" for n in names[:20]) + (" ..." if len(names) > 20 else "")
    what = ", ".join(f"`{reason}` {n}" for reason, n in counts.items() if n)
    return (f"**Audio gate:** {sum(counts.values())} {items} of this audio run have no usable audio ({what}): "
            f"{shown}. They are not in the dataset: no sample is ever written without its audio latents. "
            f"`accept`: train on the {report.written} {items} with sound. To keep the others, {instead}. When most "
            f"{items} fail, suspect the audio backend first (`python -c 'import av'`; the sanity check's test tone).")


def encode_batch(loaded: Any, batch: Batch, trigger: str | None, notes: Counter
                 ) -> tuple[list[dict | Reject], dict[str, torch.Tensor]]:
    """A batch's samples' fields (or rejects), and the batch's tensors stacked per field (for the sanity check).
    Without a video encoder (audio only) there are no video latents and no fps."""
    from diffprep.encodings.ltx2_masks import masks_of
    from diffprep.families.ltx2_precomputed import apply_lora_trigger

    captions = [apply_lora_trigger(caption, trigger) for caption in batch.captions]
    tensors: dict[str, torch.Tensor] = {}
    if loaded.video_encoder is not None:
        tensors[contract.LATENTS] = loaded.encode_video(batch.pixels).to(STORED_DTYPES[contract.LATENTS])
    if batch.references is not None:
        tensors[contract.REFERENCE_LATENTS] = loaded.encode_video(batch.references).to(torch.bfloat16)
    audio = [loaded.encode_audio(track) for track in batch.audio] if batch.audio is not None else None
    if audio is not None:
        tensors[contract.AUDIO_LATENTS] = torch.stack([a.latents for a in audio])
    if batch.reference_audio is not None:
        tensors[contract.REFERENCE_AUDIO_LATENTS] = torch.stack([loaded.encode_audio(t).latents
                                                                for t in batch.reference_audio])
    tensors.update(masks_of(batch, tensors.get(contract.LATENTS), tensors.get(contract.AUDIO_LATENTS), notes))
    text = loaded.encode_text(captions)
    tensors[contract.PROMPT_EMBEDS] = torch.stack([t.video_prompt_embeds for t in text]).to(torch.bfloat16)
    tensors[contract.PROMPT_ATTENTION_MASK] = torch.stack([t.prompt_attention_mask for t in text])
    separate = audio is not None and loaded.separate_audio_text
    if separate:
        tensors[contract.AUDIO_PROMPT_EMBEDS] = torch.stack([t.audio_prompt_embeds for t in text]).to(torch.bfloat16)
    samples: list[dict | Reject] = []
    for i, key in enumerate(batch.keys):
        bad = [name for name, t in tensors.items() if t.is_floating_point() and not torch.isfinite(t[i]).all()]
        if bad:
            samples.append(Reject(batch.source_ids[i], "non_finite_latents",
                                  f"{', '.join(bad)}: NaN or inf from the encoders", phase="encode"))
            continue
        if text[i].truncated:
            notes["caption_truncated"] += 1
        meta = dict(batch.metas[i])
        if audio is not None:
            meta["audio_duration"] = audio[i].duration
        if trigger:
            meta["lora_trigger"] = trigger
        samples.append({name: t[i] for name, t in tensors.items()} | {contract.CAPTION: captions[i],
                                                                       contract.META: meta})
    return samples, tensors


def _text_width(gemma, checkpoint) -> dict[str, int]:
    """Sequence length and feature widths of the conditions, from the Gemma config and the checkpoint's projection."""
    from diffprep.families.ltx2_gemma import TEXT_MAX_LENGTH
    with family_imports("ltx2"):
        from safetensors import safe_open

    config = json.loads((gemma / "config.json").read_text(encoding="utf-8"))
    hidden = config.get("text_config", config).get("hidden_size")
    widths = {"video": TEXT_MAX_LENGTH, "video_dim": hidden, "audio_dim": hidden}
    # A V2 (LTX-2.3) projection's width is its output size: the tensor's shape, read from the header.
    with safe_open(str(checkpoint), framework="pt") as handle:
        for kind in ("video", "audio"):
            name = f"text_embedding_projection.{kind}_aggregate_embed.weight"
            if name in handle.keys():
                widths[f"{kind}_dim"] = handle.get_slice(name).get_shape()[0]
    return widths


def _check_reference_buckets(buckets: list[Bucket], scale: int, space: int) -> None:
    if len(buckets) != 1:
        raise ConfigError(f"IC-LoRA reference clips need a single resolution bucket (the trainer infers the "
                          f"downscale factor from one), got {len(buckets)}: {';'.join(map(str, buckets))}")
    [bucket] = buckets
    if (bucket.width % (scale * space)) or (bucket.height % (scale * space)):
        raise ConfigError(f"--reference-downscale-factor {scale}: {bucket.width}x{bucket.height} / {scale} is not a "
                          f"multiple of {space}; use a factor that keeps both sides multiples of {space}")


def _checkpoint_of(path: str):
    from diffprep.families import ltx2_checkpoint

    found = ltx2_checkpoint(path)
    if found is None:
        raise ConfigError(f"{path} is not an LTX-2 checkpoint nor a folder holding one")
    return found


class Ltx2Inspector(PreencodedInspector):
    """Validation of loaded LTX-2 samples: every tensor's shape and its own dtype (bf16 video and text, float32
    audio, int64 mask) as the plan says, latents shaped as their bucket plans, finite values, latent stats."""

    def inspect(self, sample: Any) -> None:
        if self.expected is None:
            self.expected = {"latents": [sample.latents.shape[0], None, None, None],
                             "source": f"first sample {sample.__key__}", "dtypes": {}}
        dtypes = self.expected.get("dtypes") or {}
        for stem in ("audio_latents", "audio_prompt_embeds", "prompt_attention_mask", "reference_latents",
                     "reference_audio_latents", "video_mask", "audio_mask"):
            tensor = getattr(sample, stem, None)
            if tensor is None:
                continue
            want = self.expected.get(stem)
            if want is not None and not shape_matches(tensor.shape, want):
                self.shapes.add(f"{sample.__key__} {stem} has shape {list(tensor.shape)}, expected {want}")
            if dtypes.get(stem) and dtype_name(tensor.dtype) != dtypes[stem]:
                self.shapes.add(f"{sample.__key__} {stem} has dtype {tensor.dtype}, expected {dtypes[stem]}")
            if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
                self.finite.add(f"{sample.__key__} {stem} has NaN/Inf values")
        from diffprep.encodings.ltx2_masks import mask_problems

        for problem in mask_problems(sample.latents, sample.audio_latents, getattr(sample, "video_mask", None),
                                     getattr(sample, "audio_mask", None)):
            self.shapes.add(f"{sample.__key__} {problem}")
        saved = self.expected.get("dtype")
        self.expected["dtype"] = dtypes.get("latents")  # latents and prompt_embeds: bf16, checked by the base
        try:
            super().inspect(sample)
        finally:
            self.expected["dtype"] = saved
