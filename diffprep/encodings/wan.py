"""The Wan encoding (video): clips through the Wan VAE, captions through umT5, one resolution bucket per unit.

Per sample (bucket ``W x H x F``): ``latents.pth`` ``[C, 1 + (F - 1) / t,
H / s, W / s]`` (normalized with the VAE config's ``latents_mean`` /
``latents_std``), ``prompt_embeds.pth`` ``[L, D]`` (``WanPipeline.encode_prompt``),
``caption.txt``, ``meta.json`` (source fps, frame indices and times, bucket,
crop). Images are one-frame clips where an ``F = 1`` bucket exists.

The plan probes every new sample (its container's index, no frame decoded
beyond the first) to put it in its bucket; units hold one bucket each, so
every shard's samples stack into batches. A sample that cannot be read or is
shorter than every bucket goes to units of its own and ends as a named reject
(``too_few_frames`` with its frame count and the shortest bucket). The sanity
batch runs at the largest planned bucket (the memory peak) and the projection
is made per bucket.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import threading
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import replace
from typing import Any, Callable, Sequence

import torch

from diffprep import contract
from diffprep.config import Settings
from diffprep.cooker import VideoSampleTaskEncoder
from diffprep.encoders import DTYPES
from diffprep.encodings.base import Encoding, SampleFields, encoded_samples, probe_in_parallel
from diffprep.encodings.preencoded import PreencodedInspector
from diffprep.errors import ConfigError
from diffprep.families.wan import VaeTiling, WanEncoders, decode_normalized, describe_wan, load_wan_vae, resolve_wan
from diffprep.images import to_uint8
from diffprep.layouts import Layout, LayoutPreset
from diffprep.media.buckets import Bucket, parse_bucket, parse_buckets
from diffprep.media.video import ClipSpec
from diffprep.output import Output
from diffprep.pictures import frame_strip
from diffprep.plan import Plan, dtype_name, shape_matches
from diffprep.reader import Batch, first_batch
from diffprep.sanity import TAR_MEMBER_OVERHEAD, SanityReport, check_round_trip, finish_sanity, peak_memory
from diffprep.shards import Reject, load_tensor, npy_bytes, tensor_bytes, torch_bytes
from diffprep.sources import Source
from diffprep.workers import claimed_device

log = logging.getLogger(__name__)

_LOADED: dict[str, WanEncoders] = {}
_LOCK = threading.Lock()
PROBE_CHUNK = 64
_CLIP_FRAMES = re.compile(r"a clip of (\d+) frames")  # samples read from the source at a time while planning


def clip_spec(settings: Settings, spatial: int, temporal: int) -> ClipSpec:
    video = settings.video
    return ClipSpec(tuple(parse_buckets(video.resolution_buckets, spatial, temporal)), target_fps=video.target_fps,
                    frame_sampling=video.frame_sampling)


def planned_spec(plan_settings: dict[str, Any]) -> ClipSpec:
    """The ``ClipSpec`` a plan's byte settings record."""
    video = plan_settings["video"]
    return ClipSpec(tuple(parse_bucket(b) for b in video["buckets"]), target_fps=video["target_fps"],
                    frame_sampling=video["frame_sampling"], max_pixels=video["max_pixels"],
                    audio=video.get("audio", False), reference_scale=video.get("reference_scale"))


def _voxels(bucket: Bucket) -> int:
    return bucket.width * bucket.height * bucket.frames


def strips(clips: torch.Tensor) -> torch.Tensor:
    """uint8 clips ``[B, F, 3, H, W]`` -> each clip's frames side by side, ``[B, 3, H, F * W]``."""
    return torch.stack([frame_strip(clip) for clip in clips])


def largest_bucket_batch(plan: Plan, source: Source, spec: Any, batch_size: int, units_left: Sequence[int] | None
                         ) -> tuple[set[int], Batch, float]:
    """(the units left, the first batch that decodes at the largest planned bucket: the memory peak, its decode
    seconds)."""
    left = set(units_left) if units_left is not None else {u.unit for u in plan.units}
    bucketed = [u for u in plan.units if u.bucket and u.unit in left] or [u for u in plan.units if u.bucket]
    largest = max((parse_bucket(u.bucket) for u in bucketed), key=_voxels, default=None)
    units = [u for u in bucketed if largest is not None and parse_bucket(u.bucket) == largest]
    decode_start = time.perf_counter()
    batch = first_batch(plan, source, spec, batch_size, units=units or None)
    return left, batch, time.perf_counter() - decode_start


def finish_video_sanity(output: Output, tensors: dict[str, torch.Tensor], buckets: dict[str, dict], *,
                        problems: list[str], finite: bool, psnrs: list, sheet: Any, seconds: float,
                        device: torch.device, per_sample: int, settings: Settings,
                        staged_samples: int | None, audio_mel_l1: list[float] | None = None) -> SanityReport:
    """The sanity report of a video batch (its tensors stacked per field), its first sample saved, the disk checked."""
    remaining = sum(e["samples"] for e in buckets.values())
    report = SanityReport(
        ok=not problems,
        samples=next(iter(tensors.values())).shape[0],
        shapes={name: list(t.shape[1:]) for name, t in tensors.items()},
        dtypes={name: dtype_name(t.dtype) for name, t in tensors.items()},
        finite=finite,
        psnr_db=psnrs,
        seconds_per_batch=round(seconds, 4),
        peak_memory_bytes=peak_memory(device),
        bytes_per_sample=per_sample,
        projected_bytes=sum(e["bytes"] for e in buckets.values()),
        projected_seconds=round(sum(e["seconds"] for e in buckets.values()), 1),
        free_bytes=shutil.disk_usage(output.local).free,
        problems=problems,
        min_psnr=settings.model.min_psnr,
        contact_sheet=str(sheet) if sheet else None,
        local_bytes=None if staged_samples is None else per_sample * min(remaining, staged_samples),
        buckets=buckets,
        audio_mel_l1=audio_mel_l1,
    )
    output.state.write_bytes(f"{contract.SANITY_DIR}/{contract.SANITY_SAMPLE}",
                             torch_bytes({name: t[0].clone() for name, t in tensors.items()}))
    return finish_sanity(output, report, remaining)


def project_buckets(plan: Plan, left: set[int], per_sample_seconds: float, measured: Bucket | str,
                    bytes_of: Callable[[str], int], workers: int,
                    weight: Callable[[str], float] | None = None) -> dict[str, dict]:
    """Per bucket, the samples left, their bytes (``bytes_of(bucket)`` per sample) and seconds: the pace measured
    at ``measured`` scaled by each bucket's ``weight`` (default: its voxels), shared among ``workers``."""
    weight = weight or (lambda name: _voxels(parse_bucket(name)))
    buckets: dict[str, dict] = {}
    for unit in plan.units:
        if unit.unit not in left:
            continue
        entry = buckets.setdefault(unit.bucket or "unbucketed", {"samples": 0, "seconds": 0.0, "bytes": 0})
        n = len(unit.source_ids)
        entry["samples"] += n
        if unit.bucket:
            entry["bytes"] += n * bytes_of(unit.bucket)
            entry["seconds"] += n * per_sample_seconds * weight(unit.bucket) / weight(str(measured))
    for entry in buckets.values():
        entry["seconds"] = round(entry["seconds"] / max(1, workers), 1)
    return buckets


class Wan(Encoding):
    """Wan 2.x: clips (and images as one-frame clips) through AutoencoderKLWan, captions through umT5."""

    name = contract.ENCODING_WAN
    layout_presets = {contract.LAYOUT_FASTGEN: LayoutPreset(
        members={contract.FASTGEN_LATENT: (contract.LATENTS,), contract.FASTGEN_TXT_EMB: (contract.PROMPT_EMBEDS,)},
        negative={contract.NEG_PROMPT_EMB: contract.PROMPT_EMBEDS},
        shard_counts=True,
    )}

    # --- the plan ---------------------------------------------------------------------------------------------

    def plan_settings(self, settings: Settings, token: str | None) -> tuple[dict[str, Any], dict[str, Any]]:
        model = settings.model
        if model.latent_mode == "posterior":
            raise ConfigError("latent_mode posterior is Flux only (Primus's resample mode); use sample or mode for Wan")
        parts = resolve_wan(model.model_path, revision=model.revision, token=token)
        identity = describe_wan(parts, dtype=DTYPES[model.precision], vae_dtype=DTYPES[model.precision],
                                text_max_length=model.t5_max_length, latent_mode=model.latent_mode,
                                tiling=VaeTiling() if settings.video.vae_tiling else None)
        spec = clip_spec(settings, identity["spatial_factor"], identity["temporal_factor"])
        byte = {
            "contract": contract.CONTRACT_VERSION,
            "encoding": self.name,
            "encoders": identity,
            "shard_size": settings.output.shard_size,
            "video": {
                "buckets": [str(b) for b in spec.buckets],
                "target_fps": spec.target_fps,
                "frame_sampling": spec.frame_sampling,
                "max_pixels": spec.max_pixels,
            },
        }
        text_config = json.loads((parts["text_encoder"].path / "config.json").read_text(encoding="utf-8"))
        channels, s, t = identity["latent_channels"], identity["spatial_factor"], identity["temporal_factor"]
        shapes = {str(b): [channels, 1 + (b.frames - 1) // t, b.height // s, b.width // s] for b in spec.buckets}
        latents: list[int | None] = [channels, None, None, None]
        if len(shapes) == 1:
            latents = next(iter(shapes.values()))
        expected = {
            contract.field_stem(contract.LATENTS): latents,
            contract.field_stem(contract.PROMPT_EMBEDS): [model.t5_max_length, text_config["d_model"]],
            "dtype": dtype_name(DTYPES[model.precision]),
            "buckets": shapes,
        }
        return byte, expected

    def media_spec(self, settings: Settings | None, plan: Plan | None = None) -> ClipSpec:
        """The plan's buckets (the ones its units were cut for), frame rate and sampling."""
        return planned_spec(plan.settings)

    def bucketed(self, plan_settings: dict[str, Any]) -> bool:
        return True

    def probe_buckets(self, settings: Settings, source: Source, ids: Sequence[str], plan_settings: dict[str, Any]
                      ) -> dict[str, str | None]:
        """Each id's bucket name from its container's index (None: unreadable or too short; encode names why)."""
        spec = planned_spec(plan_settings)

        def bucket_of(sample) -> str | None:
            if sample.reject is not None or sample.media is None or sample.caption is None:
                return None
            try:
                return str(spec.bucket_of(sample.media, video=sample.video is not None))
            except Exception:  # noqa: BLE001 - a reject or whatever the decoder says: the encode phase records it
                return None

        return probe_in_parallel(source, ids, bucket_of, settings.image.decode_workers)

    def required_fields(self, expected: dict[str, Any]) -> tuple[str, ...]:
        return contract.VIDEO_FIELDS

    def field_problem(self, fields: Sequence[str], expected: dict[str, Any] | None) -> str:
        problem = super().field_problem(fields, expected)
        missing = [f for f in contract.VIDEO_FIELDS if f not in fields]
        return problem or (f"missing {missing}" if missing else "")

    # --- encoding ---------------------------------------------------------------------------------------------

    def load(self, settings: Settings, token: str | None) -> WanEncoders:
        """The encoders, loaded once per process, on the device this worker claimed (if any)."""
        model = settings.model
        device = claimed_device() or model.device
        key = json.dumps([model.model_dump(mode="json"), device, settings.video.vae_tiling], sort_keys=True)
        with _LOCK:
            if key not in _LOADED:
                _LOADED.clear()  # one encoder set per process: free the previous one first
                _LOADED[key] = WanEncoders.load(
                    model.model_path, device=device, dtype=model.precision, latent_mode=model.latent_mode,
                    tiling=VaeTiling() if settings.video.vae_tiling else None, text_max_length=model.t5_max_length,
                    revision=model.revision, token=token,
                )
            return _LOADED[key]

    def sample_fields(self, settings: Settings, loaded: WanEncoders) -> SampleFields:
        def fields(batch: Batch, notes: Counter) -> list[dict | Reject]:
            latents = loaded.encode_video(batch.pixels, batch.keys)
            text = loaded.encode_text(batch.captions)
            return encoded_samples(batch, latents, text.truncated, notes, "clip",
                                   lambda i: {contract.LATENTS: latents[i], contract.PROMPT_EMBEDS: text.prompt_embeds[i]})

        return fields

    def batch_size(self, settings: Settings) -> int:
        return settings.model.batch_size

    def sanity(self, output: Output, plan: Plan, loaded: WanEncoders, source: Source, spec: Any, *,
               settings: Settings, batch_size: int, units_left: Sequence[int] | None, workers: int,
               staged_samples: int | None) -> SanityReport:
        """One batch at the largest planned bucket, decoded again (clip PSNR), and the run projected per bucket."""
        empty = loaded.empty_prompt_embeds()
        output.state.write_bytes(contract.EMPTY_PROMPT, torch_bytes({"prompt_embeds": empty.clone()}))
        output.write_file(f"{contract.EMPTY_ENCODINGS_DIR}/prompt_embeds_empty.npy", npy_bytes(empty[None]))
        layout = Layout.of_plan(plan.settings)
        if layout.negative:  # fastgen: the negative prompt's umT5 sequence
            layout.write_negative(output, {contract.PROMPT_EMBEDS:
                                           loaded.encode_text([layout.negative_prompt]).prompt_embeds[0]})

        left, batch, decode_seconds = largest_bucket_batch(plan, source, spec, batch_size, units_left)
        device = loaded.device
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        start = time.perf_counter()
        latents = loaded.encode_video(batch.pixels, batch.keys)
        text = loaded.encode_text(batch.captions)
        seconds = time.perf_counter() - start
        bucket = Bucket(*batch.metas[0]["bucket"])

        tensors = {contract.LATENTS: latents, contract.PROMPT_EMBEDS: text.prompt_embeds}
        wanted = {contract.LATENTS: plan.expected.get("buckets", {}).get(str(bucket)),
                  contract.PROMPT_EMBEDS: plan.expected.get(contract.field_stem(contract.PROMPT_EMBEDS))}
        problems = []
        for name, tensor in tensors.items():
            have = list(tensor.shape[1:])
            if wanted[name] is None or not shape_matches(have, wanted[name]):
                problems.append(f"{name}: shape {have}, planned {wanted[name]} (bucket {bucket})")
            if dtype_name(tensor.dtype) != plan.expected.get("dtype"):
                problems.append(f"{name}: dtype {tensor.dtype}, planned {plan.expected.get('dtype')}")
        finite = all(bool(torch.isfinite(t).all()) for t in tensors.values())
        psnrs: list[float | None] = []
        sheet = None
        if not finite:
            problems.append("non-finite values in the encoded batch (wrong precision for this VAE?)")
        else:
            decoded = to_uint8(loaded.decode_latents(latents).flatten(0, 1)).view(batch.pixels.shape)
            psnrs, sheet, problem = check_round_trip(output, replace(batch, pixels=strips(batch.pixels)),
                                                     strips(decoded), settings.model.min_psnr)
            if problem:
                problems.append(problem)

        # On a CPU the units decode and write on the encoders' cores: the pace is the sum (benchmarks/README.md, D).
        paced = seconds + decode_seconds if device.type == "cpu" else seconds
        text_bytes = len(tensor_bytes(text.prompt_embeds[0]))
        item = latents.element_size()

        def bytes_of(unit_bucket: str) -> int:
            c, f, h, w = plan.expected["buckets"][unit_bucket]
            return item * c * f * h * w + text_bytes + 256 + TAR_MEMBER_OVERHEAD * len(contract.VIDEO_FIELDS)

        buckets = project_buckets(plan, left, paced / len(batch.keys), bucket, bytes_of, workers)
        per_sample = len(tensor_bytes(latents[0])) + text_bytes + 256 + TAR_MEMBER_OVERHEAD * len(contract.VIDEO_FIELDS)
        return finish_video_sanity(output, tensors, buckets, problems=problems, finite=finite, psnrs=psnrs,
                                   sheet=sheet, seconds=seconds, device=device, per_sample=per_sample,
                                   settings=settings, staged_samples=staged_samples)

    def rejects_advice(self, report: Any, plan: Plan) -> str:
        """Clips too short for every bucket: the exact --resolution-buckets that would keep them."""
        counts = [int(m.group(1)) for r in report.rejected_ids if r.get("reason") == "too_few_frames"
                  for m in [_CLIP_FRAMES.search(r.get("detail", ""))] if m]
        if not counts:
            return ""
        temporal = plan.settings["encoders"]["temporal_factor"]
        frames = 1 + (min(counts) - 1) // temporal * temporal
        buckets = list(plan.settings["video"]["buckets"])
        sizes = dict.fromkeys(name.rsplit("x", 1)[0] for name in buckets)
        added = [f"{size}x{frames}" for size in sizes if f"{size}x{frames}" not in buckets]
        spec = ";".join(buckets + added)
        short = report.by_reason.get("too_few_frames", len(counts))
        return (f"`add a shorter bucket`: {short} clips are shorter than every bucket (the shortest has "
                f"{min(counts)} frames). To keep them, re-run with `--resolution-buckets \"{spec}\"` and "
                "`--on-existing overwrite` (other settings: a new fingerprint), or accept and train without them.")

    def oom_advice(self, settings: Settings, loaded: WanEncoders) -> str:
        return (f"use smaller or shorter --resolution-buckets (now {settings.video.resolution_buckets}), "
                f"--vae-tiling, --precision bf16 (now {settings.model.precision}), or free memory on {loaded.device}")

    # --- reading a dataset back -------------------------------------------------------------------------------

    def holds(self, fields: Mapping[str, bytes]) -> bool:
        return (contract.LATENTS in fields and contract.POOLED_PROMPT_EMBEDS not in fields
                and contract.PROMPT_ATTENTION_MASK not in fields)  # an LTX-2 sample has the mask

    def decode_stored(self, stored: Sequence[Any], plan: Plan | None, *, model_path: str | None = None,
                      device: str = "auto", token: str | None = None, local_only: bool = False,
                      decoder: Any = None, where: str = "the dataset") -> tuple[list[torch.Tensor], str | None]:
        """The latents through the dataset's Wan VAE: uint8 frames ``[F, 3, H, W]`` per sample."""
        from diffprep.encoders.vae import planned_vae_folder

        if plan is None and not model_path:
            raise ConfigError(f"{where} has no plan.json naming its VAE; pass the Wan model with --model-path")
        folder = planned_vae_folder(plan or Plan("", {}, {}, {}, []), model_path=model_path, token=token,
                                    local_only=local_only)
        dtype = getattr(torch, plan.settings["encoders"]["dtype"]) if plan else torch.float32
        vae = decoder or load_wan_vae(folder, device=device, dtype=dtype)
        parameter = next(vae.parameters())
        clips = []
        for sample in stored:
            latents = load_tensor(sample.fields[contract.LATENTS], key=sample.key, field=contract.LATENTS)
            frames = decode_normalized(vae, latents[None].to(parameter.device, parameter.dtype))[0]
            clips.append(to_uint8(frames))
        return clips, str(folder)

    def task_encoder(self) -> VideoSampleTaskEncoder:
        """Sample by sample (validation); training batches one bucket at a time with ``VideoPreencodedTaskEncoder``."""
        return VideoSampleTaskEncoder()

    def inspector(self, expected: dict[str, Any] | None) -> VideoInspector:
        return VideoInspector(expected)


class VideoInspector(PreencodedInspector):
    """Validation of loaded clips: as for images (each sample's latents shaped as its bucket plans, counts per
    bucket), and without a plan the first sample sets what the others must match."""

    def inspect(self, sample: Any) -> None:
        if self.expected is None:
            self.expected = {
                "latents": [sample.latents.shape[0], None, None, None],
                "prompt_embeds": list(sample.prompt_embeds.shape),
                "dtype": dtype_name(sample.latents.dtype),
                "source": f"first sample {sample.__key__}",
            }
        super().inspect(sample)
