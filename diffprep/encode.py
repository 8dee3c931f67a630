"""Phases 3 and 4: the one-batch sanity check and the encoding of one work unit.

A unit is read and decoded in a background thread (images decoded by a small
thread pool, a bounded queue of ready batches in between) while the encoders
work on the previous batch. Every input sample ends in the unit's shard or in
its manifest's rejects, with a reason.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import math
import queue
import resource
import shutil
import statistics
import threading
import time
from collections import Counter, deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Sequence

import torch

from diffprep import contract
from diffprep.decode import CONTACT_SHEET, Preview, write_contact_sheet
from diffprep.errors import DiffprepError, RejectError
from diffprep.failpoints import failpoint
from diffprep.images import ImageSpec, PreparedImage, prepare_image, to_uint8
from diffprep.plan import Plan, UnitPlan
from diffprep.shards import (
    BackgroundShardWriter,
    Reject,
    ShardSink,
    ShardWriter,
    UnitManifest,
    atomic_write_bytes,
    atomic_write_json,
    file_sha256,
    read_manifest,
    tensor_bytes,
    torch_bytes,
    write_manifest,
)
from diffprep.sources import Source, SourceSample

log = logging.getLogger("diffprep.encode")

Progress = Callable[[dict], None]
TAR_MEMBER_OVERHEAD = 1024
# Shards are written in a thread of their own while the encoders work on the next batch.
UnitWriter = BackgroundShardWriter  # header block + padding, on average, per member


class DiskSpaceError(DiffprepError):
    """The projected dataset does not fit on the output's file system."""


@dataclass
class Batch:
    keys: list[str]
    source_ids: list[str]
    captions: list[str]
    pixels: torch.Tensor  # uint8 [B, 3, H, W]
    metas: list[dict]


def _prepare(sample: SourceSample, spec: ImageSpec) -> PreparedImage:
    if sample.reject is not None:
        raise sample.reject
    if sample.image is None:
        raise RejectError("missing_image", "the source gave no image for this sample", phase="read")
    if sample.caption is None:
        raise RejectError("missing_caption", "the source gave no caption for this sample", phase="read")
    failpoint("decode")
    return prepare_image(sample.image, spec)


def iter_prepared(
    source: Source, unit: UnitPlan, spec: ImageSpec, *, workers: int = 2, depth: int = 16
) -> Iterator[tuple[int, SourceSample, PreparedImage | RejectError]]:
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
                return index, sample, RejectError("image_decode_error", f"{type(exc).__name__}: {exc}")

        count = 0
        for index, sample in enumerate(source.read(unit.source_ids)):
            count += 1
            if sample.source_id != unit.source_ids[index]:
                raise DiffprepError(
                    f"the source returned {sample.source_id!r} where unit {unit.unit} planned "
                    f"{unit.source_ids[index]!r}; the source must read ids in the order given"
                )
            pending.append((index, sample, pool.submit(_prepare, sample, spec)))
            while len(pending) > depth:
                yield resolve(pending.popleft())
        while pending:
            yield resolve(pending.popleft())
    if count != len(unit.source_ids):
        raise DiffprepError(f"the source returned {count} samples for unit {unit.unit}, planned {len(unit.source_ids)}")


def _meta(sample: SourceSample, image: PreparedImage) -> dict:
    return {
        "source_id": sample.source_id,
        "original_size": list(image.original_size),
        "crop_box": list(image.crop_box),
        "size": [int(image.pixels.shape[2]), int(image.pixels.shape[1])],
        "notes": list(image.notes),
    }


def iter_batches(
    source: Source,
    unit: UnitPlan,
    spec: ImageSpec,
    batch_size: int,
    rejects: list[Reject],
    *,
    workers: int = 2,
) -> Iterator[Batch]:
    """Batches of consecutive samples of the same size; rejects are appended to ``rejects`` as they come."""
    items: list[tuple[int, SourceSample, PreparedImage]] = []

    def flush() -> Batch:
        batch = Batch(
            keys=[contract.sample_key(unit.unit, i) for i, _, _ in items],
            source_ids=[s.source_id for _, s, _ in items],
            captions=[s.caption for _, s, _ in items],
            pixels=torch.stack([img.pixels for _, _, img in items]),
            metas=[_meta(s, img) for _, s, img in items],
        )
        items.clear()
        return batch

    for index, sample, result in iter_prepared(source, unit, spec, workers=workers, depth=2 * batch_size):
        if isinstance(result, RejectError):
            rejects.append(Reject(sample.source_id, result.reason, result.detail, result.phase))
            continue
        if items and (len(items) == batch_size or items[0][2].pixels.shape != result.pixels.shape):
            yield flush()
        items.append((index, sample, result))
    if items:
        yield flush()


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


def unit_is_done(out_dir: str | Path, plan: Plan, unit: int, *, check_hash: bool = False) -> UnitManifest | None:
    """The unit's manifest when the unit is committed for this plan and its shard is intact."""
    manifest = read_manifest(out_dir, unit)
    if manifest is None or manifest.fingerprint != plan.fingerprint:
        return None
    shard = Path(out_dir) / manifest.shard
    if not shard.is_file() or shard.stat().st_size != manifest.bytes:
        return None
    if check_hash and file_sha256(shard)[1] != manifest.sha256:
        return None
    return manifest


@dataclass
class UnitResult:
    unit: int
    count: int
    rejected: int
    seconds: float
    skipped: bool  # already done before this call

    @property
    def samples_per_second(self) -> float:
        return (self.count + self.rejected) / self.seconds if self.seconds > 0 else 0.0


def encode_unit(
    out_dir: str | Path,
    plan: Plan,
    unit_index: int,
    encoders,
    source: Source,
    spec: ImageSpec,
    *,
    batch_size: int,
    decode_workers: int = 2,
    progress: Progress | None = None,
    sample_fields: SampleFields | None = None,
    sink: ShardSink | None = None,
) -> UnitResult:
    """Encode one unit into its shard and manifest. Idempotent: a committed unit is left as it is.

    ``sink`` also gets the shard's bytes as they are written (a bucket output uploads them meanwhile).

    ``sample_fields`` turns a batch into its samples' fields; by default
    ``preencoded_fields(encoders)`` (the raw pipeline passes its image writer
    and no encoders).
    """
    start = time.perf_counter()
    done = unit_is_done(out_dir, plan, unit_index)
    if done is not None:
        return UnitResult(unit_index, done.count, len(done.rejects), 0.0, skipped=True)
    unit = plan.unit(unit_index)
    rejects: list[Reject] = []
    notes: Counter[str] = Counter()
    keys: list[str] = []
    source_ids: list[str] = []
    batches = prefetch(iter_batches(source, unit, spec, batch_size, rejects, workers=decode_workers))
    # closing(): an encoder error must also stop the reader thread and its decode pool at once.
    try:
        with contextlib.closing(batches), UnitWriter(out_dir, unit_index, sink) as writer:
            info = _write_unit(writer, batches, sample_fields or preencoded_fields(encoders), unit, rejects, notes,
                               keys, source_ids, progress)
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            raise DiskSpaceError(disk_full_message(out_dir, unit_index)) from exc
        raise
    failpoint("before-manifest")
    # Rejects in source order, whatever phase found them.
    order = {sid: i for i, sid in enumerate(unit.source_ids)}
    rejects.sort(key=lambda r: order[r.source_id])
    manifest = UnitManifest(
        unit=unit_index,
        shard=info.name,
        fingerprint=plan.fingerprint,
        keys=keys,
        source_ids=source_ids,
        count=info.count,
        bytes=info.bytes,
        sha256=info.sha256,
        rejects=rejects,
        notes=dict(sorted(notes.items())),
    )
    write_manifest(out_dir, manifest)
    seconds = time.perf_counter() - start
    result = UnitResult(unit_index, info.count, len(rejects), seconds, skipped=False)
    log.info("unit %06d: %d written, %d rejected in %.1f s (%.1f samples/s)",
             unit_index, info.count, len(rejects), seconds, result.samples_per_second)
    return result


# How a batch becomes the fields of its samples (one dict, or a Reject, per sample); counts kept-but-noted
# samples (e.g. truncated captions) in the Counter.
SampleFields = Callable[[Batch, Counter], list[dict | Reject]]


def preencoded_fields(encoders) -> SampleFields:
    """The pre-encoded pipeline's fields: latents and text embeddings from ``encoders``, caption, meta."""

    def fields(batch: Batch, notes: Counter) -> list[dict | Reject]:
        latents = encoders.encode_images(batch.pixels, batch.keys)
        text = encoders.encode_text(batch.captions)
        samples: list[dict | Reject] = []
        for i in range(len(batch.keys)):
            if not torch.isfinite(latents[i]).all():
                samples.append(Reject(batch.source_ids[i], "non_finite_latents",
                                      "the VAE produced NaN or inf for this image", phase="encode"))
                continue
            if text.t5_truncated[i]:
                notes["caption_truncated"] += 1
            samples.append({
                contract.LATENTS: latents[i],
                contract.PROMPT_EMBEDS: text.prompt_embeds[i],
                contract.POOLED_PROMPT_EMBEDS: text.pooled_prompt_embeds[i],
                contract.CAPTION: batch.captions[i],
                contract.META: batch.metas[i],
            })
        return samples

    return fields


def _write_unit(writer: ShardWriter, batches: Iterator[Batch], sample_fields: SampleFields, unit: UnitPlan,
                rejects: list[Reject], notes: Counter, keys: list[str], source_ids: list[str],
                progress: Progress | None):
    """Turn the unit's batches into samples in ``writer`` and commit it; returns the shard's info."""
    for batch in batches:
        failpoint("encode")
        for i, fields in enumerate(sample_fields(batch, notes)):
            if isinstance(fields, Reject):
                rejects.append(fields)
                continue
            if not batch.captions[i].strip():
                notes["empty_caption"] += 1
            writer.write(batch.keys[i], fields)
            failpoint("shard-write")
            keys.append(batch.keys[i])
            source_ids.append(batch.source_ids[i])
        if progress:
            progress({"unit": unit.unit, "samples": len(keys) + len(rejects), "total": len(unit.source_ids)})
    return writer.commit()


def write_empty_prompt(out_dir: str | Path, encoders) -> Path:
    """The empty caption's embeddings, once per dataset, for classifier-free guidance dropout."""
    path = Path(out_dir) / contract.STATE_DIR / contract.EMPTY_PROMPT
    text = encoders.encode_text([""])
    payload = {
        "prompt_embeds": text.prompt_embeds[0].clone(),
        "pooled_prompt_embeds": text.pooled_prompt_embeds[0].clone(),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(path, torch_bytes(payload))
    return path


# --- sanity ------------------------------------------------------------------------------------


@dataclass
class SanityReport:
    ok: bool
    samples: int
    shapes: dict[str, list[int]]
    dtypes: dict[str, str]
    finite: bool
    psnr_db: list[float | None]  # round trip per image; None: identical (a lossless raw format)
    seconds_per_batch: float
    peak_memory_bytes: int
    bytes_per_sample: int
    projected_bytes: int
    projected_seconds: float
    free_bytes: int
    problems: list[str] = field(default_factory=list)
    min_psnr: float = 0.0  # the median of psnr_db must reach this; 0: not checked
    contact_sheet: str | None = None  # the batch's images next to their round trip
    local_bytes: int | None = None  # needed on this disk when less than projected_bytes (a bucket output)

    def to_json(self) -> dict:
        return asdict(self)


def sanity_markdown(report: dict) -> str:
    """A sanity report (``SanityReport.to_json()``) as Markdown, for the run's artifact."""
    gib = 1024**3
    psnrs = ", ".join("identical" if v is None else f"{v:.1f}" for v in report["psnr_db"])
    lines = [
        f"# Sanity check {'passed' if report['ok'] else 'FAILED'}",
        "",
        "| | |",
        "|---|---|",
        *(f"| {name} | {shape} {report['dtypes'][name]} |" for name, shape in report["shapes"].items()),
        f"| round-trip PSNR (dB) | {psnrs} (median must reach {report['min_psnr']}) |",
        f"| seconds per batch of {report['samples']} | {report['seconds_per_batch']} |",
        f"| peak memory | {report['peak_memory_bytes'] / gib:.2f} GiB |",
        f"| bytes per sample | {report['bytes_per_sample']} |",
        f"| projected | {report['projected_bytes'] / gib:.2f} GiB, {report['projected_seconds']} s; "
        f"{report['free_bytes'] / gib:.2f} GiB free |",
    ]
    if report["problems"]:
        lines += ["", "**Problems:**", *(f"- {problem}" for problem in report["problems"])]
    return "\n".join(lines) + "\n"


def _peak_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def first_batch(plan: Plan, source: Source, spec: ImageSpec, batch_size: int) -> Batch:
    """The first batch that decodes, from the first units: at most a few units are read."""
    rejects: list[Reject] = []
    for unit in plan.units:
        batch = next(iter_batches(source, unit, spec, batch_size, rejects), None)
        if batch is not None:
            return batch
    raise DiffprepError(
        "sanity: no sample of the source could be decoded; rejects: "
        + "; ".join(f"{r.source_id}: {r.reason} {r.detail}" for r in rejects[:5])
    )


def check_round_trip(sanity_dir: Path, batch: Batch, decoded: torch.Tensor,
                     min_psnr: float) -> tuple[list[float | None], Path, str | None]:
    """PSNR of each image against its round trip, the contact sheet, and the problem when the median is too low."""
    previews = [Preview(key, sid, caption, decoded[i], batch.pixels[i])
                for i, (key, sid, caption) in enumerate(zip(batch.keys, batch.source_ids, batch.captions))]
    sheet = write_contact_sheet(sanity_dir / CONTACT_SHEET, previews)
    values = [p.psnr_db for p in previews]
    median = statistics.median(values)
    problem = None
    if median < min_psnr:
        problem = (
            f"round-trip PSNR: median {median:.1f} dB over {len(values)} images is under model.min_psnr "
            f"{min_psnr} dB, so the VAE does not reconstruct these images: a wrong VAE, wrong scaling/shift "
            f"factors in its config, or a precision it overflows in. Look at {sheet}. (A random-weight test model "
            "cannot reconstruct: run it with --min-psnr 0.)"
        )
    return [None if math.isinf(v) else round(v, 2) for v in values], sheet, problem


def project_run(out_dir: str | Path, plan: Plan, units_left: Sequence[int] | None, seconds: float,
                batch_size: int, workers: int) -> tuple[int, float, int]:
    """Samples left to write, the seconds they take at ``seconds`` per batch, and the free bytes of the output."""
    remaining_units = set(units_left) if units_left is not None else {u.unit for u in plan.units}
    remaining = sum(len(u.source_ids) for u in plan.units if u.unit in remaining_units)
    projected_seconds = seconds * math.ceil(remaining / batch_size) / max(1, workers)
    return remaining, projected_seconds, shutil.disk_usage(out_dir).free


def finish_sanity(out_dir: str | Path, report: SanityReport, remaining: int) -> SanityReport:
    """Write ``sanity/report.json``; raise DiskSpaceError when the projection does not fit, or the problems."""
    atomic_write_json(Path(out_dir) / contract.STATE_DIR / contract.SANITY_DIR / "report.json", report.to_json())
    needed = report.projected_bytes if report.local_bytes is None else report.local_bytes
    if needed > report.free_bytes:
        samples = remaining if report.local_bytes is None else needed // max(1, report.bytes_per_sample)
        raise DiskSpaceError(disk_summary(out_dir, needed, report.free_bytes, samples, report.bytes_per_sample))
    if report.problems:
        raise DiffprepError("sanity check failed:\n  " + "\n  ".join(report.problems))
    return report


def sanity_check(
    out_dir: str | Path,
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
    sanity_dir = Path(out_dir) / contract.STATE_DIR / contract.SANITY_DIR
    sanity_dir.mkdir(parents=True, exist_ok=True)
    batch = first_batch(plan, source, spec, batch_size)
    device = getattr(encoders, "device", torch.device("cpu"))
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    latents = encoders.encode_images(batch.pixels, batch.keys)
    text = encoders.encode_text(batch.captions)
    seconds = time.perf_counter() - start

    tensors = {
        contract.LATENTS: latents,
        contract.PROMPT_EMBEDS: text.prompt_embeds,
        contract.POOLED_PROMPT_EMBEDS: text.pooled_prompt_embeds,
    }
    problems = []
    for name, tensor in tensors.items():
        want = plan.expected.get(contract.field_stem(name))
        have = list(tensor.shape[1:])
        if want is not None and (len(want) != len(have) or any(w is not None and w != h for w, h in zip(want, have))):
            problems.append(f"{name}: shape {have}, planned {want}")
        if str(tensor.dtype).removeprefix("torch.") != plan.expected.get("dtype"):
            problems.append(f"{name}: dtype {tensor.dtype}, planned {plan.expected.get('dtype')}")
    finite = all(bool(torch.isfinite(t).all()) for t in tensors.values())
    if not finite:
        problems.append("non-finite values in the encoded batch (wrong precision for this VAE?)")
        psnrs: list[float | None] = []
        sheet = None
    else:
        decoded = to_uint8(encoders.decode_latents(latents))
        psnrs, sheet, problem = check_round_trip(sanity_dir, batch, decoded, min_psnr)
        if problem:
            problems.append(problem)

    sample_fields = {name: tensor[0] for name, tensor in tensors.items()}
    per_sample = sum(len(tensor_bytes(t)) for t in sample_fields.values())
    per_sample += len(batch.captions[0].encode()) + 256 + TAR_MEMBER_OVERHEAD * len(contract.PREENCODED_FIELDS)
    remaining, projected_seconds, free = project_run(out_dir, plan, units_left, seconds, batch_size, workers)
    report = SanityReport(
        ok=not problems,
        samples=len(batch.keys),
        shapes={name: list(t.shape[1:]) for name, t in tensors.items()},
        dtypes={name: str(t.dtype).removeprefix("torch.") for name, t in tensors.items()},
        finite=finite,
        psnr_db=psnrs,
        seconds_per_batch=round(seconds, 4),
        peak_memory_bytes=_peak_memory(device),
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
    atomic_write_bytes(sanity_dir / "sample.pth", torch_bytes(torch_payload))
    return finish_sanity(out_dir, report, remaining)


def disk_full_message(out_dir: str | Path, unit: int) -> str:
    """What a user needs when the disk filled up under a unit: where, how much is free, what the dataset uses."""
    usage = shutil.disk_usage(out_dir)
    used_here = sum(p.stat().st_size for p in Path(out_dir).glob("*.tar"))
    gib = 1024**3
    return (
        f"the disk filled up while writing unit {unit:06d} to {out_dir}; that unit left nothing behind and the "
        f"units finished before it are intact:\n"
        f"  shards so far  {used_here / gib:10.2f} GiB  ({out_dir})\n"
        f"  free           {usage.free / gib:10.2f} GiB of {usage.total / gib:.2f} GiB\n"
        "Free space (or move the output) and re-run the same command: it resumes at this unit."
    )


def disk_summary(out_dir: str | Path, needed: int, free: int, samples: int, per_sample: int) -> str:
    usage = shutil.disk_usage(out_dir)
    gib = 1024**3
    return (
        f"not enough disk space for {out_dir}:\n"
        f"  needed  {needed / gib:10.2f} GiB  ({samples} samples x {per_sample / 1024:.1f} KiB)\n"
        f"  free    {free / gib:10.2f} GiB\n"
        f"  total   {usage.total / gib:10.2f} GiB, used {usage.used / gib:.2f} GiB\n"
        "Free space or choose another --output-dir; lower --t5-max-length or --image-size to shrink samples."
    )
