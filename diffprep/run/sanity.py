"""Phase 3, the one-batch sanity check: one full batch written into the state folder, never into the dataset.

Shapes, dtypes, finite values, the decode round trip (PSNR, a contact sheet),
seconds per batch and peak memory; it projects the whole run's time and disk
use, and stops before any shard is written when the projection does not fit.
Each encoding runs it its own way (``diffprep.encodings``); the report, the
projection and the disk check are shared here.
"""

from __future__ import annotations

import math
import resource
import shutil
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Sequence

import torch

from diffprep import contract
from diffprep.report.pictures import CONTACT_SHEET, Preview, write_contact_sheet
from diffprep.errors import DiffprepError
from diffprep.output import Output
from diffprep.writer.plan import Plan
from diffprep.run.reader import Batch
from diffprep.run.units import DiskSpaceError

TAR_MEMBER_OVERHEAD = 1024  # header block + padding, on average, per member


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
    # Clip runs: per bucket, the samples left and their projected seconds, bytes and peak memory (an upper
    # bound: diffprep.encodings.clips); the bucket the batch ran at and the memory resident before it.
    buckets: dict[str, dict] | None = None
    bucket: str | None = None
    baseline_memory_bytes: int | None = None
    audio_mel_l1: list[float] | None = None  # LTX-2 with audio: each sample's sound decoded again, log-mel L1

    def to_json(self) -> dict:
        data = asdict(self)
        for name in ("buckets", "bucket", "baseline_memory_bytes", "audio_mel_l1"):
            if data[name] is None:
                del data[name]
        return data


def round_trip_text(psnr_db: Sequence[float | None], min_psnr: float = 0.0) -> str | None:
    """The sanity batch's round trip in words, or None where nothing was decoded back (an ingested dataset, a
    prompts run, a posterior stored as it came): the log line and the artifact then say nothing about it. A
    lossless raw format's files give the prepared pixels back (None per image), which a list of Nones would hide."""
    if not psnr_db:
        return None
    if all(v is None for v in psnr_db):
        return f"round trip lossless: the {len(psnr_db)} stored images give the prepared pixels back"
    values = ", ".join("identical" if v is None else f"{v:.1f}" for v in psnr_db)
    return f"round-trip PSNR {values} dB" + (f" (the median must reach model.min_psnr, {min_psnr} dB)" if min_psnr else "")


def sanity_markdown(report: dict) -> str:
    """A sanity report (``SanityReport.to_json()``) as Markdown, for the run's artifact."""
    gib = 1024**3
    round_trip = round_trip_text(report["psnr_db"], report["min_psnr"])
    lines = [
        f"# Sanity check {'passed' if report['ok'] else 'FAILED'}",
        "",
        "| | |",
        "|---|---|",
        *(f"| {name} | {shape} {report['dtypes'][name]} |" for name, shape in report["shapes"].items()),
        *([f"| round trip | {round_trip} |"] if round_trip else []),
        *([f"| audio round trip, log-mel L1 | {', '.join(f'{v:.3f}' for v in report['audio_mel_l1'])} |"]
          if report.get("audio_mel_l1") is not None else []),
        f"| seconds per batch of {report['samples']} | {report['seconds_per_batch']} |",
        f"| peak memory | {report['peak_memory_bytes'] / gib:.2f} GiB |",
        f"| bytes per sample | {report['bytes_per_sample']} |",
        f"| projected | {report['projected_bytes'] / gib:.2f} GiB, {report['projected_seconds']} s; "
        f"{report['free_bytes'] / gib:.2f} GiB free |",
    ]
    if report.get("buckets"):
        lines += ["", f"Per bucket (the batch ran at {report.get('bucket')}; memory: an upper bound from its peak):",
                  "", "| bucket | samples | projected s | projected GiB | peak memory GiB |", "|---|---|---|---|---|"]
        for name, entry in report["buckets"].items():
            memory = entry.get("peak_memory_bytes")
            shown = f"{memory / gib:.2f}" if memory is not None else "n/a"
            lines.append(f"| {name} | {entry['samples']} | {entry['seconds']} | {entry['bytes'] / gib:.3f} | {shown} |")
    if report["problems"]:
        lines += ["", "**Problems:**", *(f"- {problem}" for problem in report["problems"])]
    return "\n".join(lines) + "\n"


def peak_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def _proc_status_kib(name: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(name + ":"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


class MemoryWatch:
    """Memory on ``device`` around a block of work: ``baseline`` before it and ``peak`` during it, in bytes.

    CUDA: the allocator's counters. CPU: the resident set, its high-water mark
    reset first (Linux ``/proc/self/clear_refs``, which also restarts what
    ``ru_maxrss`` reports from here); where that is refused, the process's
    lifetime peak (``ru_maxrss``), which may include earlier work.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.baseline = 0
        self.peak = 0
        self._reset = False

    def __enter__(self) -> "MemoryWatch":
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            self.baseline = int(torch.cuda.memory_allocated(self.device))
            return self
        try:
            Path("/proc/self/clear_refs").write_text("5")  # 5: reset the peak resident set size
            self._reset = True
        except OSError:
            self._reset = False
        rss = _proc_status_kib("VmRSS")
        self.baseline = rss * 1024 if rss is not None else 0
        return self

    def __exit__(self, *exc: object) -> None:
        if self.device.type == "cuda":
            self.peak = int(torch.cuda.max_memory_allocated(self.device))
            return
        hwm = _proc_status_kib("VmHWM") if self._reset else None
        peak = hwm * 1024 if hwm is not None else peak_memory(self.device)
        # The kernel's resident-set counters are per-thread caches folded in lazily, so a high-water mark read
        # after a reset can trail the resident set read a moment earlier by a few pages: the peak is never below.
        self.peak = max(peak, self.baseline)


def check_round_trip(output: Output, batch: Batch, decoded: torch.Tensor,
                     min_psnr: float) -> tuple[list[float | None], Path, str | None]:
    """PSNR of each image against its round trip, the contact sheet, and the problem when the median is too low."""
    previews = [Preview(key, sid, caption, decoded[i], batch.pixels[i])
                for i, (key, sid, caption) in enumerate(zip(batch.keys, batch.source_ids, batch.captions))]
    with output.state.writing(f"{contract.SANITY_DIR}/{CONTACT_SHEET}") as path:
        sheet = write_contact_sheet(path, previews)
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


def project_run(output: Output, plan: Plan, units_left: Sequence[int] | None, seconds: float,
                batch_size: int, workers: int) -> tuple[int, float, int]:
    """Samples left to write, the seconds they take at ``seconds`` per batch, and the free bytes of the output."""
    remaining_units = set(units_left) if units_left is not None else {u.unit for u in plan.units}
    remaining = sum(u.count for u in plan.units if u.unit in remaining_units)
    projected_seconds = seconds * math.ceil(remaining / batch_size) / max(1, workers)
    return remaining, projected_seconds, shutil.disk_usage(output.local).free


def finish_sanity(output: Output, report: SanityReport, remaining: int) -> SanityReport:
    """Write ``sanity/report.json``; raise DiskSpaceError when the projection does not fit, or the problems."""
    output.state.write_json(f"{contract.SANITY_DIR}/{contract.SANITY_REPORT}", report.to_json())
    needed = report.projected_bytes if report.local_bytes is None else report.local_bytes
    if needed > report.free_bytes:
        samples = remaining if report.local_bytes is None else needed // max(1, report.bytes_per_sample)
        raise DiskSpaceError(disk_summary(output.local, needed, report.free_bytes, samples, report.bytes_per_sample))
    if report.problems:
        raise DiffprepError("sanity check failed:\n  " + "\n  ".join(report.problems))
    return report


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
