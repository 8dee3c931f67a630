"""The pre-encoded encoding (Flux): VAE latents and T5 + CLIP embeddings per sample, plus caption and meta.

(Over 400 lines on purpose: the Flux encoding whole -- its plan and shapes, the fields it writes, its sanity
check, its decoding and its validation inspector -- as Wan's and LTX-2's are each in one module.)

Per sample: ``latents.pth`` [16, H/8, W/8], ``prompt_embeds.pth``
[t5_max_length, 4096], ``pooled_prompt_embeds.pth`` [768], ``caption.txt``,
``meta.json``. The encoders are loaded once per process (on the device the
worker claimed, if any); the empty caption's embeddings are kept in the state
folder for classifier-free guidance dropout.
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from collections.abc import Mapping
from typing import Any, Sequence

import torch

from diffprep import contract
from diffprep.report.checks import Check, Findings, shape_str
from diffprep.config import Settings
from diffprep.families.base import DTYPES
from diffprep.families.flux import FluxEncoders, describe_flux, resolve_encoders
from diffprep.families.flux_vae import VaeDecoder
from diffprep.encodings.base import Encoding, SampleFields, encoded_samples
from diffprep.errors import ConfigError
from diffprep.media.images import ImageSpec, bucket_name, image_buckets, to_uint8
from diffprep.report.latent_stats import LatentStats
from diffprep.writer.layouts import Layout, LayoutPreset
from diffprep.output import Output, as_output
from diffprep.writer.plan import Plan, dtype_name, shape_matches
from diffprep.run.reader import Batch, first_batch
from diffprep.run.sanity import (
    TAR_MEMBER_OVERHEAD,
    SanityReport,
    check_round_trip,
    finish_sanity,
    peak_memory,
    project_run,
)
from diffprep.writer.shards import Reject, load_tensor, npy_bytes, tensor_bytes, torch_bytes
from diffprep.sources import Source
from diffprep.run.workers import claimed_device

_LOADED: dict[str, FluxEncoders] = {}
_LOCK = threading.Lock()


def expected_shapes(settings: Settings, parts) -> dict[str, Any]:
    """Shapes and dtype of every sample, from the encoders' configs (None: varies per sample)."""

    def config(name: str) -> dict:
        return json.loads((parts[name].path / "config.json").read_text(encoding="utf-8"))

    vae = config("vae")
    factor = 2 ** (len(vae["block_out_channels"]) - 1)
    buckets = image_buckets(settings.image)
    if settings.image.variable_size or buckets:
        spatial: list[int | None] = [None, None]
    else:
        spatial = [settings.image.image_size // factor] * 2
    expected = {
        contract.field_stem(contract.LATENTS): [vae["latent_channels"], *spatial],
        contract.field_stem(contract.PROMPT_EMBEDS): [settings.model.t5_max_length, config("t5_text")["d_model"]],
        contract.field_stem(contract.POOLED_PROMPT_EMBEDS): [config("clip_text")["hidden_size"]],
        "dtype": str(DTYPES[settings.model.precision]).removeprefix("torch."),
    }
    if buckets:
        expected["buckets"] = {bucket_name(b.width, b.height): [vae["latent_channels"], b.height // factor,
                                                               b.width // factor] for b in buckets}
    if settings.model.latent_mode == "posterior":
        for name in contract.POSTERIOR_FIELDS:
            expected[contract.field_stem(name)] = [vae["latent_channels"], *spatial]
    return expected



def load_encoders(settings: Settings, token: str | None = None) -> FluxEncoders:
    """The encoders for ``settings``, loaded once per process, on the device this worker claimed (if any)."""
    model = settings.model
    if claimed_device() is not None:
        model = model.model_copy(update={"device": claimed_device()})
    key = json.dumps(model.model_dump(mode="json"), sort_keys=True)
    with _LOCK:
        if key not in _LOADED:
            _LOADED.clear()  # one encoder set per process: free the previous one first
            _LOADED[key] = FluxEncoders.load(model, token=token)
        return _LOADED[key]


def preencoded_fields(encoders) -> SampleFields:
    """The pre-encoded samples' fields: latents and text embeddings from ``encoders``, caption, meta."""

    posterior = getattr(encoders, "latent_mode", None) == "posterior"

    def fields(batch: Batch, notes: Counter) -> list[dict | Reject]:
        if posterior:
            latents, mean, logvar = encoders.encode_posterior(batch.pixels, batch.keys)
        else:
            latents, mean, logvar = encoders.encode_images(batch.pixels, batch.keys), None, None
        text = encoders.encode_text(batch.captions)

        def sample(i: int) -> dict[str, Any]:
            tensors = {contract.LATENTS: latents[i], contract.PROMPT_EMBEDS: text.prompt_embeds[i],
                       contract.POOLED_PROMPT_EMBEDS: text.pooled_prompt_embeds[i]}
            return tensors | ({contract.MEAN: mean[i], contract.LOGVAR: logvar[i]} if posterior else {})

        return encoded_samples(batch, latents, text.t5_truncated, notes, "image", sample)

    return fields


def write_empty_prompt(output: Output | str, encoders) -> None:
    """The empty caption's embeddings, once per dataset, for classifier-free guidance dropout.

    Kept twice: ``.diffprep/empty_prompt.pth`` (tensors in the dataset's
    precision) and ``empty_encodings/{t5_empty,clip_empty}.npy`` (float32 with
    a batch dimension: what Primus reads from its ``empty_encodings_path``).
    """
    output = as_output(output)
    text = encoders.encode_text([""])
    payload = {
        "prompt_embeds": text.prompt_embeds[0].clone(),
        "pooled_prompt_embeds": text.pooled_prompt_embeds[0].clone(),
    }
    output.state.write_bytes(contract.EMPTY_PROMPT, torch_bytes(payload))
    for name, tensor in ((contract.T5_EMPTY, text.prompt_embeds[:1]),
                         (contract.CLIP_EMPTY, text.pooled_prompt_embeds[:1])):
        output.write_file(f"{contract.EMPTY_ENCODINGS_DIR}/{name}", npy_bytes(tensor))


def sanity_check(
    output: Output | str,
    plan: Plan,
    encoders,
    source: Source,
    spec: ImageSpec,
    *,
    batch_size: int,
    units_left: Sequence[int] | None = None,
    workers: int = 1,
    min_psnr: float = 0.0,
    staged_samples: int | None = None,
) -> SanityReport:
    """Encode one full batch into ``.diffprep/sanity/`` and project the whole run from it.

    The batch is decoded again: its contact sheet is written next to the
    report, and a median round-trip PSNR under ``min_psnr`` fails the check.
    Raises DiskSpaceError before any shard is written when the projection does not fit:
    the whole dataset, or with ``staged_samples`` (a bucket output, whose
    shards leave the disk once uploaded) that many samples at once.
    """
    output = as_output(output)
    decode_start = time.perf_counter()
    batch = first_batch(plan, source, spec, batch_size)
    decode_seconds = time.perf_counter() - decode_start
    device = getattr(encoders, "device", torch.device("cpu"))
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    posterior = getattr(encoders, "latent_mode", None) == "posterior"
    if posterior:
        latents, mean, logvar = encoders.encode_posterior(batch.pixels, batch.keys)
    else:
        latents = encoders.encode_images(batch.pixels, batch.keys)
    text = encoders.encode_text(batch.captions)
    seconds = time.perf_counter() - start

    tensors = {
        contract.LATENTS: latents,
        contract.PROMPT_EMBEDS: text.prompt_embeds,
        contract.POOLED_PROMPT_EMBEDS: text.pooled_prompt_embeds,
    }
    if posterior:
        tensors |= {contract.MEAN: mean, contract.LOGVAR: logvar}
    problems = []
    for name, tensor in tensors.items():
        want, have = plan.expected.get(contract.field_stem(name)), list(tensor.shape[1:])
        if not shape_matches(have, want):
            problems.append(f"{name}: shape {have}, planned {want}")
        if dtype_name(tensor.dtype) != plan.expected.get("dtype"):
            problems.append(f"{name}: dtype {tensor.dtype}, planned {plan.expected.get('dtype')}")
    finite = all(bool(torch.isfinite(t).all()) for t in tensors.values())
    if not finite:
        problems.append("non-finite values in the encoded batch (wrong precision for this VAE?)")
        psnrs: list[float | None] = []
        sheet = None
    else:
        decoded = to_uint8(encoders.decode_latents(latents))
        psnrs, sheet, problem = check_round_trip(output, batch, decoded, min_psnr)
        if problem:
            problems.append(problem)

    sample_fields = {name: tensor[0] for name, tensor in tensors.items()}
    per_sample = sum(len(tensor_bytes(t)) for t in sample_fields.values())
    per_sample += len(batch.captions[0].encode()) + 256 + TAR_MEMBER_OVERHEAD * (len(contract.PREENCODED_FIELDS)
                                                                               + len(tensors) - 3)
    # On a CPU the units decode and write on the encoders' cores: the pace is the sum (benchmarks/README.md, D).
    paced = seconds + decode_seconds if device.type == "cpu" else seconds
    remaining, projected_seconds, free = project_run(output, plan, units_left, paced, batch_size, workers)
    report = SanityReport(
        ok=not problems,
        samples=len(batch.keys),
        shapes={name: list(t.shape[1:]) for name, t in tensors.items()},
        dtypes={name: str(t.dtype).removeprefix("torch.") for name, t in tensors.items()},
        finite=finite,
        psnr_db=psnrs,
        seconds_per_batch=round(seconds, 4),
        peak_memory_bytes=peak_memory(device),
        bytes_per_sample=per_sample,
        projected_bytes=per_sample * remaining,
        projected_seconds=round(projected_seconds, 1),
        free_bytes=free,
        problems=problems,
        min_psnr=min_psnr,
        contact_sheet=str(sheet) if sheet else None,
        local_bytes=None if staged_samples is None else per_sample * min(remaining, staged_samples),
    )
    torch_payload = {name: t[0].clone() for name, t in tensors.items()}
    output.state.write_bytes(f"{contract.SANITY_DIR}/{contract.SANITY_SAMPLE}", torch_bytes(torch_payload))
    return finish_sanity(output, report, remaining)


class Preencoded(Encoding):
    """Flux: latents through the VAE, captions through T5 and CLIP."""

    name = contract.ENCODING_PREENCODED
    # FastGen's Flux network unpacks its condition as (pooled, t5); an .npy holds one array, so the negative
    # prompt's two embeddings are two files.
    layout_presets = {contract.LAYOUT_FASTGEN: LayoutPreset(
        members={contract.FASTGEN_LATENT: (contract.LATENTS,),
                 contract.FASTGEN_TXT_EMB: (contract.POOLED_PROMPT_EMBEDS, contract.PROMPT_EMBEDS)},
        negative={contract.NEG_PROMPT_EMB: contract.PROMPT_EMBEDS,
                  contract.NEG_POOLED_PROMPT_EMB: contract.POOLED_PROMPT_EMBEDS},
        shard_counts=True,
    )}

    def plan_settings(self, settings: Settings, token: str | None) -> tuple[dict[str, Any], dict[str, Any]]:
        parts = resolve_encoders(settings.model, token=token)
        identity = describe_flux(parts, dtype=DTYPES[settings.model.precision],
                                 t5_max_length=settings.model.t5_max_length, latent_mode=settings.model.latent_mode)
        return self.byte_settings(settings, {"encoders": identity}), expected_shapes(settings, parts)

    def required_fields(self, expected: dict[str, Any]) -> tuple[str, ...]:
        posterior = contract.POSTERIOR_FIELDS if contract.field_stem(contract.MEAN) in (expected or {}) else ()
        return contract.PREENCODED_FIELDS + posterior

    def field_problem(self, fields: Sequence[str], expected: dict[str, Any] | None) -> str:
        problem = super().field_problem(fields, expected)
        missing = [f for f in self.required_fields(expected or {}) if f not in fields]
        return problem or (f"missing {missing}" if missing else "")

    def load(self, settings: Settings, token: str | None) -> FluxEncoders:
        return load_encoders(settings, token)

    def sample_fields(self, settings: Settings, loaded: FluxEncoders) -> SampleFields:
        return preencoded_fields(loaded)

    def batch_size(self, settings: Settings) -> int:
        return settings.model.batch_size

    def sanity(self, output: Output, plan: Plan, loaded: FluxEncoders, source: Source, spec: ImageSpec, *,
               settings: Settings, batch_size: int, units_left: Sequence[int] | None, workers: int,
               staged_samples: int | None) -> SanityReport:
        write_empty_prompt(output, loaded)
        layout = Layout.of_plan(plan.settings)
        if layout.negative:  # fastgen: the negative prompt's T5 sequence and CLIP pooled vector, one .npy each
            text = loaded.encode_text([layout.negative_prompt])
            layout.write_negative(output, {contract.PROMPT_EMBEDS: text.prompt_embeds[0],
                                           contract.POOLED_PROMPT_EMBEDS: text.pooled_prompt_embeds[0]})
        return sanity_check(output, plan, loaded, source, spec, batch_size=batch_size, units_left=units_left,
                            workers=workers, min_psnr=settings.model.min_psnr, staged_samples=staged_samples)

    def oom_advice(self, settings: Settings, loaded: FluxEncoders) -> str:
        """What to change when even a batch of one does not fit."""
        return (f"lower --image-size (now {settings.image.image_size}) or --t5-max-length (now "
                f"{settings.model.t5_max_length}), use --precision bf16 (now {settings.model.precision}), "
                f"or free memory on {loaded.device}")

    def holds(self, fields: Mapping[str, bytes]) -> bool:
        return contract.LATENTS in fields and contract.POOLED_PROMPT_EMBEDS in fields

    def decode_stored(self, stored: Sequence[Any], plan: Plan | None, *, model_path: str | None = None,
                      device: str = "auto", token: str | None = None, local_only: bool = False,
                      decoder: VaeDecoder | None = None, where: str = "the dataset",
                      ) -> tuple[list[torch.Tensor], str | None]:
        """The latents through the dataset's VAE (plan.json's, ``model_path``, or ``decoder`` already loaded)."""
        if decoder is None:
            if plan is None and not model_path:
                raise ConfigError(f"{where} has no plan.json naming its VAE; pass the VAE with --model-path")
            decoder = VaeDecoder.for_plan(plan or Plan("", {}, {}, {}, []), model_path=model_path, device=device,
                                          token=token, local_only=local_only)
        images = [decoder.decode_one(load_tensor(s.fields[contract.LATENTS], key=s.key, field=contract.LATENTS))
                  for s in stored]
        return images, str(decoder.folder) if decoder.folder else None

    def task_encoder(self) -> Any:
        from diffprep.writer.cooker import FluxPreencodedTaskEncoder  # Energon: finalize and validation only

        return FluxPreencodedTaskEncoder()

    def inspector(self, expected: dict[str, Any] | None) -> PreencodedInspector:
        return PreencodedInspector(expected)


__all__ = ["Preencoded", "expected_shapes", "load_encoders", "preencoded_fields", "sanity_check",
           "write_empty_prompt"]


MAX_SHAPES_KEPT = 20


class PreencodedInspector:
    """Validation of loaded pre-encoded samples: shapes and dtypes against ``expected``, finite values, stats."""

    def __init__(self, expected: dict[str, Any] | None) -> None:
        self.expected = expected
        self.shapes = Findings("shapes and dtypes")
        self.finite = Findings("finite values")
        self.fields: dict[str, dict[str, dict[str, int]]] = {}
        self.buckets: dict[str, int] = {}  # bucket -> samples, for a bucketed dataset
        self.stats = LatentStats()

    def inspect(self, sample: Any) -> None:
        names = [contract.field_stem(name) for name in contract.TENSOR_FIELDS + contract.POSTERIOR_FIELDS]
        tensors = {name: getattr(sample, name) for name in names if getattr(sample, name, None) is not None}
        if self.expected is None:
            self.expected = {
                # Height and width stay free: without a plan, a variable-size dataset is as valid as a fixed one.
                "latents": [tensors["latents"].shape[0] if tensors["latents"].ndim == 3 else None, None, None],
                "prompt_embeds": list(tensors["prompt_embeds"].shape),
                "pooled_prompt_embeds": list(tensors["pooled_prompt_embeds"].shape),
                "dtype": dtype_name(tensors["latents"].dtype),
                "source": f"first sample {sample.__key__}",
            }
        for name, tensor in tensors.items():
            shape, dtype = tuple(tensor.shape), dtype_name(tensor.dtype)
            seen = self.fields.setdefault(name, {"shapes": {}, "dtypes": {}})
            shape_key = shape_str(shape)
            if shape_key in seen["shapes"] or len(seen["shapes"]) < MAX_SHAPES_KEPT:
                seen["shapes"][shape_key] = seen["shapes"].get(shape_key, 0) + 1
            seen["dtypes"][dtype] = seen["dtypes"].get(dtype, 0) + 1
            want = self.expected.get(name)
            if not shape_matches(shape, want):
                self.shapes.add(f"{sample.__key__} {name} has shape {shape_str(shape)}, expected {shape_str(want)}")
            if self.expected.get("dtype") and dtype != self.expected["dtype"]:
                self.shapes.add(f"{sample.__key__} {name} has dtype {dtype}, expected {self.expected['dtype']}")
            if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
                bad = int((~torch.isfinite(tensor)).sum())
                self.finite.add(f"{sample.__key__} {name} has {bad} NaN/Inf values")
        planned = self.expected.get("buckets")
        if planned:  # a bucketed dataset: each sample's latents as its bucket plans, counted per bucket
            bucket = getattr(sample, "bucket", None) or _bucket_of(sample.meta)
            self.buckets[bucket] = self.buckets.get(bucket, 0) + 1
            want = planned.get(bucket)
            if want is None:
                self.shapes.add(f"{sample.__key__} is in bucket {bucket}, which the plan does not list")
            elif list(tensors["latents"].shape) != want:
                self.shapes.add(f"{sample.__key__} latents have shape {shape_str(tensors['latents'].shape)}, "
                                f"bucket {bucket} plans {shape_str(want)}")
        latents = tensors["latents"]  # [C, H, W], or a clip's [C, F, H, W]
        if latents.ndim >= 3 and (self.stats.mean is None or self.stats.mean.shape[0] == latents.shape[0]):
            self.stats.add(latents)

    def checks(self) -> list[Check]:
        return [
            self.shapes.check(f"as expected ({self.expected.get('source')})" if self.expected else "no samples loaded"),
            self.finite.check("no NaN or Inf"),
        ]

    def summary(self) -> dict[str, Any]:
        buckets = {"samples_per_bucket": dict(sorted(self.buckets.items()))} if self.buckets else {}
        return {"fields": self.fields} | buckets | ({"expected": self.expected} if self.expected else {})

    def passed(self) -> tuple[list[Check], dict[str, Any], dict[str, bytes]]:
        """Once every check passed: (checks, summary, state files): the per-channel latent statistics for training."""
        if not self.stats.samples:
            return [], {}, {}
        stats = self.stats.result()
        summary = {"latent_stats": {"mean": [float(v) for v in stats["mean"]], "std": [float(v) for v in stats["std"]],
                                    "count": self.stats.count, "samples": self.stats.samples}}
        check = Check("latent stats", True, f"per-channel mean/std over {self.stats.samples} samples saved to "
                                            f"{contract.STATE_DIR}/{contract.LATENT_STATS}")
        return [check], summary, {contract.LATENT_STATS: torch_bytes(stats)}


def _bucket_of(meta: dict) -> str:
    """A sample's bucket name (``WxH``, a clip's ``WxHxF``) from its meta.json."""
    return "x".join(str(v) for v in meta.get("bucket") or ["?"])
