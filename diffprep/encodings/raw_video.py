"""The raw video pipeline: bucketed clips stored as H.264 mp4 with their captions, for encoding at training time.

``diffprep raw --resolution-buckets "WxHxF;..."`` chooses it (without buckets
``diffprep raw`` stores images). Everything before the stored file is the Wan
pipeline's: the same sources, the plan probing every clip into its bucket (one
bucket per unit), ``--target-fps`` resampling, ``--frame-sampling``, cover
resize and centre crop (``diffprep.media.video``), the named rejects
(``too_few_frames``...), and images as one-frame clips where an ``F = 1``
bucket exists. No VAE sets the bucket sizes: W and H must be even (H.264 4:2:0)
and F at least 1. A sample (Energon subflavor ``encoding: raw_video``) holds

- ``mp4``: the clip's F frames at its bucket size, H.264 (``diffprep.media.mp4``:
  every encoder setting pinned, one x264 thread), at ``fps`` = the target fps
  (or the source's; lower under ``uniform`` sampling, so the clip keeps its speed);
- ``txt``: the caption, UTF-8;
- ``json``: source id, size, fps, frame indices and times, bucket, crop box, ``fps``.

With ``--keep-audio`` the mp4 also holds the clip's own audio track, stereo AAC
(``diffprep.media.mp4.AAC``) trimmed to the kept frames (``F / fps`` seconds from
the clip's start, padded with silence where the track is shorter), and ``json``
its ``audio`` (rate, source channels, seconds); a clip without an audio stream,
or an image, is the reject ``no_audio_stream``.

This is the layout FastGen's ``VideoWDSLoader`` (``key_map={"real": "mp4",
"condition": "txt"}``), its ``VideoAudioLoaderConfig`` (with ``--keep-audio``: the
waveform decoded from the same mp4) and other webdataset video loaders read. The same
frames and settings give the same bytes, whatever the machine or worker count.
"""

from __future__ import annotations

import io
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, Sequence

import av
import torch

from diffprep import contract
from diffprep.report.checks import Check, Findings
from diffprep.config import Settings
from diffprep.encodings import clips
from diffprep.encodings.base import with_caption_settings
from diffprep.encodings.base import SampleFields
from diffprep.errors import ConfigError, DatasetValidationError
from diffprep.media.buckets import Bucket
from diffprep.media.mp4 import AAC, X264, mp4_bytes, mp4_frames
from diffprep.media.video import ClipSpec
from diffprep.output import Output
from diffprep.writer.plan import Plan
from diffprep.run.reader import Batch
from diffprep.run.sanity import (TAR_MEMBER_OVERHEAD, MemoryWatch, SanityReport, check_round_trip)
from diffprep.writer.shards import Reject
from diffprep.sources import Source

BATCH_SIZE = 4  # clips prepared per batch; only groups the work, any value gives the same bytes
DEFAULT_FPS = 16.0  # the rate of a one-frame clip (an image) or of a source that states none, without --target-fps
WHY_EVEN = "H.264 stores 4:2:0 chroma: sides must be even"


def raw_video_fields() -> list[str]:
    """The fields every sample of a raw video dataset has (plan.json's ``expected["fields"]``)."""
    return sorted(contract.RAW_VIDEO_FIELDS)


@dataclass(frozen=True)
class RawClipWriter:
    """The raw video pipeline's stand-in for the encoders: a batch of prepared clips -> mp4, caption, metadata."""

    crf: int
    default_fps: float = DEFAULT_FPS

    def sample_fields(self, batch: Batch, notes: Counter) -> list[dict | Reject]:
        """``SampleFields`` for ``encode_unit``: one dict of fields per clip of ``batch``."""
        samples: list[dict | Reject] = []
        for i in range(len(batch.keys)):
            meta = dict(batch.metas[i])
            meta["fps"] = meta.get("fps") or self.default_fps
            audio = batch.audio[i] if batch.audio is not None else None
            samples.append({
                contract.RAW_VIDEO: mp4_bytes(batch.pixels[i], meta["fps"], crf=self.crf, audio=audio),
                contract.RAW_CAPTION: batch.captions[i],
                contract.RAW_VIDEO_META: meta,
            })
        return samples


def stored_clip(key: str, fields: Mapping[str, bytes]) -> torch.Tensor:
    """The mp4 of a raw video sample as uint8 RGB ``[F, 3, H, W]`` (decoded as stored)."""
    if contract.RAW_VIDEO not in fields:
        raise DatasetValidationError(f"sample {key} has no {contract.RAW_VIDEO!r} field, it has {sorted(fields)}")
    return mp4_frames(fields[contract.RAW_VIDEO])


class RawVideo(clips.ClipEncoding):
    """Bucketed clips stored as mp4 files with their captions; nothing is encoded."""

    name = contract.ENCODING_RAW_VIDEO

    def plan_settings(self, settings: Settings, token: str | None) -> tuple[dict[str, Any], dict[str, Any]]:
        video = settings.video
        if not video.resolution_buckets:
            raise ConfigError("a raw video run needs --resolution-buckets \"WxHxF;...\" (W and H even): the sizes "
                              "the clips are stored at")
        if video.vae_tiling:
            raise ConfigError("--vae-tiling applies to a VAE; a raw run encodes nothing: remove it")
        spec = clips.clip_spec(video, video.resolution_buckets, 2, 1, why=WHY_EVEN)
        keep_audio = settings.raw.keep_audio
        if keep_audio:
            spec = replace(spec, audio=True)  # ClipSpec refuses it with --split-scenes (frames only, so far)
        raw = {"video": dict(X264, crf=settings.raw.video_crf)}
        video_bytes = clips.video_settings(spec)
        if keep_audio:  # only then: a run without audio keeps its fingerprint
            raw["audio"] = dict(AAC)
            video_bytes["audio"] = True
        byte = {
            "contract": contract.CONTRACT_VERSION,
            "encoding": self.name,
            "shard_size": settings.output.shard_size,
            "video": video_bytes,
            "raw": raw,
        }
        byte = with_caption_settings(byte, settings)  # the txt member is the caption
        expected = {"fields": raw_video_fields(),
                    "buckets": {str(b): [b.frames, 3, b.height, b.width] for b in spec.buckets}}
        if keep_audio:
            expected["audio"] = {"codec": AAC["codec"], "channels": 2}
        return byte, expected

    def required_fields(self, expected: dict[str, Any]) -> tuple[str, ...]:
        return tuple(expected["fields"])

    def field_problem(self, fields: Sequence[str], expected: dict[str, Any] | None) -> str:
        problem = super().field_problem(fields, expected)
        missing = [f for f in contract.RAW_VIDEO_FIELDS if f not in fields]
        return problem or (f"missing {missing}" if missing else "")

    def load(self, settings: Settings, token: str | None) -> RawClipWriter:
        return RawClipWriter(settings.raw.video_crf, settings.video.target_fps or DEFAULT_FPS)

    def sample_fields(self, settings: Settings, loaded: RawClipWriter) -> SampleFields:
        return loaded.sample_fields

    def batch_size(self, settings: Settings) -> int:
        return BATCH_SIZE

    def sanity(self, output: Output, plan: Plan, loaded: RawClipWriter, source: Source, spec: ClipSpec, *,
               settings: Settings, batch_size: int, units_left: Sequence[int] | None, workers: int,
               staged_samples: int | None) -> SanityReport:
        """One batch at the largest planned bucket written into memory and decoded again; projected per bucket."""
        left, batch, decode_seconds = clips.sanity_batch(plan, source, spec, BATCH_SIZE, units_left)
        with MemoryWatch(torch.device("cpu")) as memory:
            start = time.perf_counter()
            samples = loaded.sample_fields(batch, Counter())
            seconds = time.perf_counter() - start
        bucket = Bucket(*batch.metas[0]["bucket"])
        problems = []
        stored = []
        for key, sample, pixels in zip(batch.keys, samples, batch.pixels):
            frames = mp4_frames(sample[contract.RAW_VIDEO])
            if frames.shape != pixels.shape:
                problems.append(f"{key}: the stored mp4 decodes to {list(frames.shape)}, the clip is "
                                f"{list(pixels.shape)} (bucket {bucket})")
                frames = pixels
            stored.append(frames)
        psnrs, sheet, _ = check_round_trip(output, replace(batch, pixels=clips.strips(batch.pixels)),
                                           clips.strips(torch.stack(stored)), min_psnr=0.0)
        measured = [len(s[contract.RAW_VIDEO]) for s in samples]
        overhead = TAR_MEMBER_OVERHEAD * len(contract.RAW_VIDEO_FIELDS) + 1024  # the caption and json, about

        def bytes_of(b: Bucket) -> int:  # the measured mp4 size, scaled by pixel volume
            return round(sum(measured) / len(measured) * clips.voxels(b) / clips.voxels(bucket)) + overhead

        per_sample_seconds = (seconds + decode_seconds) / len(batch.keys)
        buckets = clips.project_buckets(plan, left, measured=bucket, samples=len(batch.keys),
                                        seconds_per_sample=per_sample_seconds, bytes_of=bytes_of,
                                        memory=(memory.baseline, memory.peak), batch_size=BATCH_SIZE, workers=1)
        return clips.sanity_report(output, {contract.RAW_VIDEO: batch.pixels}, buckets, bucket=bucket,
                                   problems=problems, finite=True, psnrs=psnrs, sheet=sheet, seconds=seconds,
                                   memory=memory, per_sample=bytes_of(bucket), min_psnr=0.0,
                                   staged_samples=staged_samples, saved={})

    def rejects_advice(self, report: Any, plan: Plan) -> str:
        return clips.short_clip_advice(report, plan, 1)

    def oom_advice(self, settings: Settings, loaded: RawClipWriter) -> str:
        return f"use smaller or shorter --resolution-buckets (now {settings.video.resolution_buckets})"

    def holds(self, fields: Mapping[str, bytes]) -> bool:
        return contract.RAW_VIDEO in fields

    def decode_stored(self, stored: Sequence[Any], plan: Plan | None, **options: Any
                      ) -> tuple[list[torch.Tensor], str | None]:
        """The stored mp4 files as they decode (no model)."""
        return [stored_clip(sample.key, sample.fields) for sample in stored], None

    def task_encoder(self) -> Any:
        from diffprep.writer.cooker import RawVideoTaskEncoder  # Energon: finalize and validation only

        return RawVideoTaskEncoder()

    def inspector(self, expected: dict[str, Any] | None) -> RawVideoInspector:
        return RawVideoInspector(expected)


class RawVideoInspector:
    """Validation of loaded raw clips: every mp4 opens, holds one H.264 stream of its bucket's size and frame
    count (from the container's index, no frame decoded), and its bucket is a planned one; counts per bucket.
    A plan that keeps audio: every mp4 has its stereo AAC track, as long as the clip (within a frame)."""

    def __init__(self, expected: dict[str, Any] | None) -> None:
        self.planned = (expected or {}).get("buckets")
        self.audio = (expected or {}).get("audio")
        self.clips = Findings("clips")
        self.buckets: dict[str, int] = {}

    def inspect(self, sample: Any) -> None:
        key, bucket = sample.__key__, sample.bucket
        self.buckets[bucket] = self.buckets.get(bucket, 0) + 1
        if self.planned is not None and bucket not in self.planned:
            self.clips.add(f"{key} is in bucket {bucket}, which the plan does not list")
            return
        try:
            with av.open(io.BytesIO(sample.video), mode="r") as container:
                stream = container.streams.video[0]
                frames = sum(1 for packet in container.demux(stream) if packet.size)
                found = (stream.codec_context.name, stream.codec_context.width, stream.codec_context.height, frames)
                sound = self._sound(container, stream, frames) if self.audio else ""
        except Exception as error:  # noqa: BLE001 - any unreadable clip is a finding
            self.clips.add(f"{key} {contract.RAW_VIDEO} does not open: {type(error).__name__}: {error}")
            return
        width, height, count = (int(v) for v in bucket.split("x"))
        if found != ("h264", width, height, count):
            self.clips.add(f"{key} holds {found[0]} {found[1]}x{found[2]}, {found[3]} frames; its bucket is {bucket}")
        if sound:
            self.clips.add(f"{key} {contract.RAW_VIDEO}: {sound}")

    def _sound(self, container: Any, video: Any, frames: int) -> str:
        """What is wrong with the clip's audio track ('' when it is the planned one, as long as the frames)."""
        if not container.streams.audio:
            return "has no audio track; the plan keeps every clip's audio (--keep-audio)"
        stream = container.streams.audio[0]
        if (stream.codec_context.name, stream.codec_context.channels) != (self.audio["codec"], self.audio["channels"]):
            return (f"its audio is {stream.codec_context.name} with {stream.codec_context.channels} channels, planned "
                    f"{self.audio['codec']} with {self.audio['channels']}")
        seconds = frames / float(video.average_rate or video.guessed_rate or 1)
        heard = float(stream.duration * stream.time_base) if stream.duration else 0.0
        frame = 1 / float(video.average_rate or 1)
        if abs(heard - seconds) > frame + 1024 / stream.codec_context.sample_rate:  # an AAC frame of slack
            return f"its audio lasts {heard:.3f} s, the frames {seconds:.3f} s"
        return ""

    def checks(self) -> list[Check]:
        return [self.clips.check("every clip opens as H.264 of its bucket's size and frame count")]

    def summary(self) -> dict[str, Any]:
        return {"samples_per_bucket": dict(sorted(self.buckets.items()))}

    def passed(self) -> tuple[list[Check], dict[str, Any], dict[str, bytes]]:
        return [], {}, {}


__all__ = ["RawClipWriter", "RawVideo", "RawVideoInspector", "raw_video_fields", "stored_clip"]
