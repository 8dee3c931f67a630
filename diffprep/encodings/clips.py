"""What every clip encoding (pre-encoded Wan, raw video) shares: buckets, the plan's probe, the sanity
bucket and the per-bucket projection, the short-clip advice.

A clip run puts every sample in a ``WxHxF`` bucket (``--resolution-buckets``)
and cuts units of one bucket each. Its sanity batch runs at the **largest**
planned bucket (most pixels: the time and memory peak) and the run is
projected bucket by bucket from that one measurement:

- time: seconds per sample scaled by the bucket's pixel volume ``F * H * W``;
- disk: the encoding's own bytes per sample of that bucket;
- memory: an upper bound, ``baseline + (peak - baseline) * r``, where the
  baseline is what was resident before the batch (the models), the peak what
  the batch reached, and ``r`` the larger of the bucket's volume ratio and its
  frame-area ratio ``H * W`` to the sanity bucket, times its batch size over the
  sanity batch's. A video VAE encodes a clip a few frames at a time, so part of
  its activations grows with the frame area and part (the clip, the latents)
  with the volume; if the increase is a sum of such parts, the larger ratio
  bounds it. A bucket of larger frames but fewer pixels than the sanity bucket
  (1024x1024x1 beside 832x480x81) can need more memory than was measured: its
  bound says so.
"""

from __future__ import annotations

import re
import shutil
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from diffprep import contract
from diffprep.config import Settings, VideoConfig
from diffprep.encodings.base import Encoding, probe_in_parallel
from diffprep.media.buckets import Bucket, parse_bucket, parse_buckets
from diffprep.media.video import ClipSpec
from diffprep.media.windows import SceneSettings, read_scene_captions
from diffprep.output import Output
from diffprep.report.pictures import frame_strip
from diffprep.writer.plan import Plan, UnitPlan, dtype_name
from diffprep.run.reader import Batch, first_batch
from diffprep.run.sanity import MemoryWatch, SanityReport, finish_sanity
from diffprep.writer.shards import torch_bytes
from diffprep.sources import Source, SourceSample

_CLIP_FRAMES = re.compile(r"a clip of (\d+) frames")


def clip_spec(video: VideoConfig, buckets: str, spatial: int, temporal: int, *, why: str | None = None) -> ClipSpec:
    """The ``ClipSpec`` of a run: ``buckets`` (``WxHxF;...``) checked against the factors (``why``: what sets them)."""
    scenes = None
    if video.split_scenes is not None:
        scenes = SceneSettings(video.split_scenes, video.min_scene_seconds, video.clip_mode, video.clip_stride,
                               video.clips_per_scene, read_scene_captions(video.scene_captions),
                               threshold=video.scene_threshold)
    return ClipSpec(tuple(parse_buckets(buckets, spatial, temporal, why=why)), target_fps=video.target_fps,
                    frame_sampling=video.frame_sampling, scenes=scenes)


def video_settings(spec: ClipSpec) -> dict[str, Any]:
    """The ``video`` section of a clip plan's byte settings."""
    settings = {"buckets": [str(b) for b in spec.buckets], "target_fps": spec.target_fps,
                "frame_sampling": spec.frame_sampling, "max_pixels": spec.max_pixels}
    if spec.scenes is not None:  # only then: one-clip-per-file runs keep their fingerprints
        settings["scenes"] = spec.scenes.to_json()
    return settings


def planned_spec(plan_settings: dict[str, Any]) -> ClipSpec:
    """The ``ClipSpec`` a plan's byte settings record (LTX-2: with the audio track, the reference clips' scale)."""
    video = plan_settings["video"]
    return ClipSpec(tuple(parse_bucket(b) for b in video["buckets"]), target_fps=video["target_fps"],
                    frame_sampling=video["frame_sampling"], max_pixels=video["max_pixels"],
                    audio=video.get("audio", False), reference_scale=video.get("reference_scale"),
                    inputs=tuple(video.get("inputs", ())), scenes=SceneSettings.from_json(video.get("scenes")))


def probe_clip_buckets(settings: Settings, source: Source, ids: Sequence[str], plan_settings: dict[str, Any]
                       ) -> dict[str, str | None]:
    """Each id's bucket name from its container's index (None: unreadable or too short; encode names why)."""
    spec = planned_spec(plan_settings)

    def bucket_of(sample: SourceSample) -> str | None:
        if sample.reject is not None or sample.media is None or sample.caption is None:
            return None
        try:
            return str(spec.bucket_of(sample.media, video=sample.video is not None))
        except Exception:  # noqa: BLE001 - a reject or whatever the decoder says: the encode phase records it
            return None

    return probe_in_parallel(source, ids, bucket_of, settings.image.decode_workers)


def strips(batch: torch.Tensor) -> torch.Tensor:
    """uint8 clips ``[B, F, 3, H, W]`` -> each clip's frames side by side, ``[B, 3, H, F * W]`` (contact sheets)."""
    return torch.stack([frame_strip(clip) for clip in batch])


class ClipEncoding(Encoding):
    """An encoding of clips: its samples prepared as its plan's ``ClipSpec`` says, each probed into a bucket."""

    def media_spec(self, settings: Settings | None, plan: Plan | None = None) -> ClipSpec:
        """The plan's buckets (the ones its units were cut for), frame rate and sampling."""
        return planned_spec(plan.settings)

    def bucketed(self, plan_settings: dict[str, Any]) -> bool:
        return True

    def probe_buckets(self, settings: Settings, source: Source, ids: Sequence[str], plan_settings: dict[str, Any]
                      ) -> dict[str, str | None]:
        return probe_clip_buckets(settings, source, ids, plan_settings)


def voxels(bucket: Bucket) -> int:
    return bucket.width * bucket.height * bucket.frames


def sanity_units(plan: Plan, units_left: Sequence[int] | None) -> tuple[set[int], list[UnitPlan] | None]:
    """(the units left, those of the largest bucket among them: where the sanity batch is read; None: no bucket)."""
    left = set(units_left) if units_left is not None else {u.unit for u in plan.units}
    bucketed = [u for u in plan.units if u.bucket and u.unit in left] or [u for u in plan.units if u.bucket]
    if not bucketed:
        return left, None
    largest = max((parse_bucket(u.bucket) for u in bucketed), key=voxels)
    return left, [u for u in bucketed if parse_bucket(u.bucket) == largest]


def sanity_batch(plan: Plan, source: Source, spec: ClipSpec, batch_size: int, units_left: Sequence[int] | None
                 ) -> tuple[set[int], Batch, float]:
    """(the units left, the sanity batch: the first that decodes at the largest bucket among them, its decode
    seconds)."""
    left, units = sanity_units(plan, units_left)
    start = time.perf_counter()
    batch = first_batch(plan, source, spec, batch_size, units=units)
    return left, batch, time.perf_counter() - start


def sanity_report(output: Output, tensors: dict[str, torch.Tensor], buckets: dict[str, dict], *,
                  bucket: Bucket | str, problems: list[str], finite: bool, psnrs: list, sheet: Any, seconds: float,
                  memory: MemoryWatch, per_sample: int, min_psnr: float, staged_samples: int | None,
                  saved: dict[str, torch.Tensor] | None = None,
                  audio_mel_l1: list[float] | None = None) -> SanityReport:
    """A clip run's sanity report: the batch's ``tensors`` (stacked per field), the run projected per bucket
    (``project_buckets``), the batch's first sample saved (``saved``: its own tensors, else ``tensors``' first
    row), the disk checked; with sound (LTX-2), its round trip's log-mel L1 per sample."""
    remaining = sum(e["samples"] for e in buckets.values())
    report = SanityReport(
        ok=not problems,
        samples=next(iter(tensors.values())).shape[0],
        shapes={name: list(t.shape[1:]) for name, t in tensors.items()},
        dtypes={name: dtype_name(t.dtype) for name, t in tensors.items()},
        finite=finite,
        psnr_db=psnrs,
        seconds_per_batch=round(seconds, 4),
        peak_memory_bytes=memory.peak,
        bytes_per_sample=per_sample,
        projected_bytes=sum(e["bytes"] for e in buckets.values()),
        projected_seconds=round(sum(e["seconds"] for e in buckets.values()), 1),
        free_bytes=shutil.disk_usage(output.local).free,
        problems=problems,
        min_psnr=min_psnr,
        contact_sheet=str(sheet) if sheet else None,
        local_bytes=None if staged_samples is None else per_sample * min(remaining, staged_samples),
        buckets=buckets,
        bucket=str(bucket),
        baseline_memory_bytes=memory.baseline,
        audio_mel_l1=audio_mel_l1,
    )
    if saved is None:
        saved = {name: t[0].clone() for name, t in tensors.items()}
    if saved:
        output.state.write_bytes(f"{contract.SANITY_DIR}/{contract.SANITY_SAMPLE}", torch_bytes(saved))
    return finish_sanity(output, report, remaining)


def _clip_size(bucket: Bucket) -> tuple[int, int]:
    return voxels(bucket), bucket.area


def project_buckets(plan: Plan, left: set[int], *, measured: Any, samples: int, seconds_per_sample: float,
                    bytes_of: Callable[[Any], int], memory: tuple[int, int], batch_size: int, workers: int,
                    parse: Callable[[str], Any] = parse_bucket,
                    size: Callable[[Any], tuple[float, float]] = _clip_size) -> dict[str, dict]:
    """Per bucket of the units ``left``: samples, projected seconds, bytes and peak memory (module docstring).

    ``measured``: the sanity batch's bucket, ``samples`` its size; ``memory``:
    (baseline, peak) bytes around it. ``parse`` makes a bucket of a unit's
    bucket name (``bytes_of`` takes it) and ``size`` its (volume, area): a clip's
    ``F * H * W`` and ``H * W``; an audio-only run's duration buckets are seconds.
    """
    baseline, peak = memory
    buckets: dict[str, dict] = {}
    largest_unit: dict[str, int] = {}
    for unit in plan.units:
        if unit.unit not in left:
            continue
        name = unit.bucket or "unbucketed"
        entry = buckets.setdefault(name, {"samples": 0, "seconds": 0.0, "bytes": 0})
        n = unit.count
        entry["samples"] += n
        largest_unit[name] = max(largest_unit.get(name, 0), n)
        if unit.bucket:
            bucket = parse(unit.bucket)
            entry["bytes"] += n * bytes_of(bucket)
            entry["seconds"] += n * seconds_per_sample * size(bucket)[0] / size(measured)[0]
    for name, entry in buckets.items():
        entry["seconds"] = round(entry["seconds"] / max(1, workers), 1)
        if name == "unbucketed":
            continue
        (volume, area), (measured_volume, measured_area) = size(parse(name)), size(measured)
        ratio = max(volume / measured_volume, area / measured_area)
        batch = min(batch_size, largest_unit[name])
        entry["peak_memory_bytes"] = int(baseline + max(0, peak - baseline) * ratio * batch / max(1, samples))
    return buckets


def short_clip_advice(report: Any, plan: Plan, temporal: int) -> str:
    """Clips too short for every bucket (``too_few_frames``): the exact --resolution-buckets that would keep them."""
    counts = [int(m.group(1)) for r in report.rejected_ids if r.get("reason") == "too_few_frames"
              for m in [_CLIP_FRAMES.search(r.get("detail", ""))] if m]
    if not counts:
        return ""
    frames = 1 + (min(counts) - 1) // temporal * temporal
    buckets = list(plan.settings["video"]["buckets"])
    sizes = dict.fromkeys(name.rsplit("x", 1)[0] for name in buckets)
    added = [f"{size}x{frames}" for size in sizes if f"{size}x{frames}" not in buckets]
    spec = ";".join(buckets + added)
    short = report.by_reason.get("too_few_frames", len(counts))
    return (f"`add a shorter bucket`: {short} clips are shorter than every bucket (the shortest has "
            f"{min(counts)} frames). To keep them, re-run with `--resolution-buckets \"{spec}\"` and "
            "`--on-existing overwrite` (other settings: a new fingerprint), or accept and train without them.")


__all__ = ["ClipEncoding", "clip_spec", "planned_spec", "probe_clip_buckets", "project_buckets", "sanity_batch",
           "sanity_report", "sanity_units", "short_clip_advice", "strips", "video_settings", "voxels"]
