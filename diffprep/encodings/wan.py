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
import threading
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import replace
from typing import Any, Sequence

import torch

from diffprep import contract
from diffprep.config import Settings
from diffprep.families.base import DTYPES
from diffprep.encodings import clips
from diffprep.encodings.base import SampleFields, encoded_samples, with_caption_settings
from diffprep.encodings.preencoded import PreencodedInspector
from diffprep.encodings.wan_depth import depth_inputs, encode_clips, plans_depth
from diffprep.errors import ConfigError
from diffprep.families.wan import VaeTiling, WanEncoders, decode_normalized, describe_wan, load_wan_vae, resolve_wan
from diffprep.media.images import to_uint8
from diffprep.writer.layouts import Layout, LayoutPreset
from diffprep.media.buckets import Bucket
from diffprep.media.video import ClipSpec
from diffprep.output import Output
from diffprep.writer.plan import Plan, dtype_name, shape_matches
from diffprep.run.reader import Batch
from diffprep.run.sanity import TAR_MEMBER_OVERHEAD, MemoryWatch, SanityReport, check_round_trip
from diffprep.writer.shards import Reject, load_tensor, npy_bytes, tensor_bytes, torch_bytes
from diffprep.sources import Source
from diffprep.run.workers import claimed_device

log = logging.getLogger(__name__)

_LOADED: dict[str, WanEncoders] = {}
_LOCK = threading.Lock()


# The Wan 2.1 buckets (480p, 81 frames at 16 fps, both orientations) when --resolution-buckets is not given.
DEFAULT_BUCKETS = "832x480x81;480x832x81"


def clip_spec(settings: Settings, spatial: int, temporal: int) -> ClipSpec:
    return clips.clip_spec(settings.video, settings.video.resolution_buckets or DEFAULT_BUCKETS, spatial, temporal)


class Wan(clips.ClipEncoding):
    """Wan 2.x: clips (and images as one-frame clips) through AutoencoderKLWan, captions through umT5."""

    name = contract.ENCODING_WAN
    reads_depth = True  # --depth-column: depth_latent.pth (encodings/wan_depth.py)
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
            "video": clips.video_settings(spec),
        }
        inputs = depth_inputs(settings)
        if inputs:  # only then: runs without depth keep their fingerprints
            byte["video"]["inputs"] = inputs
        byte = with_caption_settings(byte, settings)
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
        if inputs:  # depth_latent.pth: shaped as the latents (encodings/wan_depth.py)
            expected[contract.field_stem(contract.DEPTH_LATENT)] = latents
        return byte, expected

    def required_fields(self, expected: dict[str, Any]) -> tuple[str, ...]:
        return contract.VIDEO_FIELDS + ((contract.DEPTH_LATENT,) if plans_depth(expected) else ())

    def field_problem(self, fields: Sequence[str], expected: dict[str, Any] | None) -> str:
        problem = super().field_problem(fields, expected)
        missing = [f for f in self.required_fields(expected or {}) if f not in fields]
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
                    revision=model.revision, token=token, text_cache_mib=model.text_cache_mib,
                )
            return _LOADED[key]

    def sample_fields(self, settings: Settings, loaded: WanEncoders) -> SampleFields:
        def fields(batch: Batch, notes: Counter) -> list[dict | Reject]:
            latents, depth = encode_clips(loaded, batch)  # and its depth clips (--depth-column)
            text = loaded.encode_text(batch.captions)
            return encoded_samples(batch, latents, text.truncated, notes, "clip",
                                   lambda i: {contract.LATENTS: latents[i],
                                              contract.PROMPT_EMBEDS: text.prompt_embeds[i],
                                              **({contract.DEPTH_LATENT: depth[i]} if depth is not None else {})})

        return fields

    def batch_size(self, settings: Settings) -> int:
        return settings.model.batch_size

    def sanity(self, output: Output, plan: Plan, loaded: WanEncoders, source: Source, spec: Any, *,
               settings: Settings, batch_size: int, units_left: Sequence[int] | None, workers: int,
               staged_samples: int | None) -> SanityReport:
        """One batch at the largest planned bucket, decoded again (clip PSNR), and the run projected per bucket."""
        empty = loaded.empty_prompt_embeds()
        output.state.write_bytes(contract.EMPTY_PROMPT, torch_bytes({"prompt_embeds": empty.clone()}))
        output.write_file(f"{contract.EMPTY_ENCODINGS_DIR}/{contract.PROMPT_EMBEDS_EMPTY}", npy_bytes(empty[None]))
        layout = Layout.of_plan(plan.settings)
        if layout.negative:  # fastgen: the negative prompt's umT5 sequence
            layout.write_negative(output, {contract.PROMPT_EMBEDS:
                                           loaded.encode_text([layout.negative_prompt]).prompt_embeds[0]})

        left, batch, decode_seconds = clips.sanity_batch(plan, source, spec, batch_size, units_left)
        device = loaded.device
        with MemoryWatch(device) as memory:
            start = time.perf_counter()
            latents, depth = encode_clips(loaded, batch)  # and its depth clips (--depth-column)
            text = loaded.encode_text(batch.captions)
            seconds = time.perf_counter() - start
        bucket = Bucket(*batch.metas[0]["bucket"])

        tensors = {contract.LATENTS: latents, contract.PROMPT_EMBEDS: text.prompt_embeds}
        wanted = {contract.LATENTS: plan.expected.get("buckets", {}).get(str(bucket)),
                  contract.PROMPT_EMBEDS: plan.expected.get(contract.field_stem(contract.PROMPT_EMBEDS))}
        if depth is not None:
            tensors[contract.DEPTH_LATENT], wanted[contract.DEPTH_LATENT] = depth, wanted[contract.LATENTS]
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
            psnrs, sheet, problem = check_round_trip(output, replace(batch, pixels=clips.strips(batch.pixels)),
                                                     clips.strips(decoded), settings.model.min_psnr)
            if problem:
                problems.append(problem)

        # On a CPU the units decode and write on the encoders' cores: the pace is the sum (benchmarks/README.md, D).
        paced = seconds + decode_seconds if device.type == "cpu" else seconds
        per_sample_seconds = paced / len(batch.keys)
        text_bytes = len(tensor_bytes(text.prompt_embeds[0]))
        item = latents.element_size()

        def bytes_of(b: Bucket) -> int:
            shape = plan.expected["buckets"][str(b)]
            return (item * shape[0] * shape[1] * shape[2] * shape[3] + text_bytes + 256
                    + TAR_MEMBER_OVERHEAD * len(contract.VIDEO_FIELDS))

        buckets = clips.project_buckets(plan, left, measured=bucket, samples=len(batch.keys),
                                        seconds_per_sample=per_sample_seconds, bytes_of=bytes_of,
                                        memory=(memory.baseline, memory.peak), batch_size=batch_size, workers=workers)
        per_sample = len(tensor_bytes(latents[0])) + text_bytes + 256 + TAR_MEMBER_OVERHEAD * len(contract.VIDEO_FIELDS)
        return clips.sanity_report(output, tensors, buckets, bucket=bucket, problems=problems, finite=finite,
                                   psnrs=psnrs, sheet=sheet, seconds=seconds, memory=memory, per_sample=per_sample,
                                   min_psnr=settings.model.min_psnr, staged_samples=staged_samples)

    def rejects_advice(self, report: Any, plan: Plan) -> str:
        """Clips too short for every bucket: the exact --resolution-buckets that would keep them."""
        return clips.short_clip_advice(report, plan, plan.settings["encoders"]["temporal_factor"])

    def oom_advice(self, settings: Settings, loaded: WanEncoders) -> str:
        buckets = settings.video.resolution_buckets or DEFAULT_BUCKETS
        return (f"use smaller or shorter --resolution-buckets (now {buckets}), "
                f"--vae-tiling, --precision bf16 (now {settings.model.precision}), or free memory on {loaded.device}")

    # --- reading a dataset back -------------------------------------------------------------------------------

    def holds(self, fields: Mapping[str, bytes]) -> bool:
        return contract.LATENTS in fields and contract.POOLED_PROMPT_EMBEDS not in fields

    def decode_stored(self, stored: Sequence[Any], plan: Plan | None, *, model_path: str | None = None,
                      device: str = "auto", token: str | None = None, local_only: bool = False,
                      decoder: Any = None, where: str = "the dataset") -> tuple[list[torch.Tensor], str | None]:
        """The latents through the dataset's Wan VAE: uint8 frames ``[F, 3, H, W]`` per sample."""
        from diffprep.families.flux_vae import planned_vae_folder

        if plan is None and not model_path:
            raise ConfigError(f"{where} has no plan.json naming its VAE; pass the Wan model with --model-path")
        folder = planned_vae_folder(plan or Plan("", {}, {}, {}, []), model_path=model_path, token=token,
                                    local_only=local_only)
        dtype = getattr(torch, plan.settings["encoders"]["dtype"]) if plan else torch.float32
        vae = decoder or load_wan_vae(folder, device=device, dtype=dtype)
        parameter = next(vae.parameters())
        decoded = []
        for sample in stored:
            latents = load_tensor(sample.fields[contract.LATENTS], key=sample.key, field=contract.LATENTS)
            frames = decode_normalized(vae, latents[None].to(parameter.device, parameter.dtype))[0]
            decoded.append(to_uint8(frames))
        return decoded, str(folder)

    def task_encoder(self) -> Any:
        """Sample by sample (validation); training batches one bucket at a time with ``VideoPreencodedTaskEncoder``."""
        from diffprep.writer.cooker import VideoSampleTaskEncoder  # Energon: finalize and validation only

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
        depth = getattr(sample, "depth_latent", None)
        if depth is None and plans_depth(self.expected):
            self.shapes.add(f"{sample.__key__} has no {contract.DEPTH_LATENT} (the plan reads --depth-column)")
        elif depth is not None and (depth.shape != sample.latents.shape or depth.dtype != sample.latents.dtype):
            self.shapes.add(f"{sample.__key__} {contract.DEPTH_LATENT} is {list(depth.shape)} {depth.dtype}, its "
                            f"latents {list(sample.latents.shape)} {sample.latents.dtype}")
        elif depth is not None and not bool(torch.isfinite(depth).all()):
            self.finite.add(f"{sample.__key__} {contract.DEPTH_LATENT} has NaN/Inf values")
