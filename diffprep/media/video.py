"""Video bytes -> model-ready frames for one resolution bucket, deterministically.

(Over 400 lines on purpose: probing, decoding, resampling, sampling and cropping a clip are one path
with one set of rejects.)

Decoding uses PyAV (``av``): a maintained FFmpeg binding whose wheels carry
FFmpeg itself, so no system FFmpeg is needed (torchcodec needs one; this
project's machines have none).

``prepare_clip`` is the whole path for one sample:

1. **Open and index** the container and demux the first video stream without
   decoding: every packet's presentation timestamp, sorted, gives the frame
   count and each frame's time exactly (rational arithmetic, no floats), also
   for variable-frame-rate files.
2. **Resample** (optional ``target_fps``): output frame ``k`` is the source
   frame on screen at time ``k / target_fps`` (the last frame whose timestamp
   is ``<=`` it), for every such time before the clip ends. Frames may repeat
   (upsampling) or be skipped (downsampling); a VFR clip becomes constant-rate.
3. **Bucket**: :func:`~diffprep.media.buckets.choose_bucket` on the display size
   (after the container's rotation) and the frames available after step 2.
4. **Sample** ``F`` of them: ``head`` takes the first ``F``, ``uniform``
   spreads ``F`` evenly from the first to the last.
5. **Decode** only up to the last frame needed; each kept frame is rotated as
   the container says (phone videos), its centred box of the bucket's aspect
   ratio is resized with LANCZOS to the bucket size (cover, then centre crop;
   the same filter as :mod:`diffprep.media.images`).

Everything that is not a usable clip ends as a
:class:`~diffprep.errors.RejectError` (phase ``decode``) with a stable reason:
``empty_file``, ``video_decode_error``, ``no_video_stream``,
``video_too_large``, ``video_no_timestamps``, ``video_truncated`` (the
container lists more frames than the decoder returns) and ``too_few_frames``.

With ``audio`` (LTX-2), the clip's audio track is decoded too
(:mod:`diffprep.media.audio`) and fitted to the frames taken: ``F / fps`` seconds
from the start, ``fps`` the frame rate of the frames encoded (``target_fps``, else
the source's); ``no_audio_stream`` and ``audio_decode_error`` are rejects like the
video's.

Not handled yet: non-square pixels (the sample aspect ratio is ignored and
recorded in ``meta``), colour matrices other than FFmpeg's default YUV->RGB
conversion.
"""

from __future__ import annotations

import bisect
import io
import os
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from fractions import Fraction
from pathlib import Path
from typing import Any, Literal

import av
import numpy as np
import torch
from PIL import Image

from diffprep.errors import ConfigError, RejectError
from diffprep.media.audio import ClipAudio, load_clip_audio
from diffprep.media.buckets import Bucket, choose_bucket, cover_box
from diffprep.media.windows import SceneSettings

__all__ = [
    "FRAME_SAMPLINGS",
    "playback_fps",
    "ClipInfo",
    "ClipSpec",
    "PreparedClip",
    "probe",
    "prepare_clip",
    "prepare_image_clip",
    "cover_box",
    "sample_indices",
]

VideoSource = bytes | bytearray | memoryview | str | os.PathLike
FrameSampling = Literal["head", "uniform"]
FRAME_SAMPLINGS: tuple[str, ...] = ("head", "uniform")

# 8K (7680 x 4320) and a little more; a larger coded size is refused before any frame is decoded.
DEFAULT_MAX_PIXELS = 40_000_000

_ROTATIONS = {1: Image.Transpose.ROTATE_90, 2: Image.Transpose.ROTATE_180, 3: Image.Transpose.ROTATE_270}


@dataclass(frozen=True)
class ClipInfo:
    """What the container says about a clip, plus its frame timestamps from the demuxer.

    ``width`` x ``height`` is the display size: the coded size turned by
    ``rotation`` (degrees counter-clockwise, a multiple of 90). ``frame_times``
    are seconds from the first frame, in presentation order; ``end_time`` is
    when the last frame stops being shown. ``fps`` is the container's average
    rate (``frames / duration`` when it states none).
    """

    container: str
    codec: str
    width: int
    height: int
    rotation: int
    sample_aspect_ratio: str | None
    fps: float
    frames: int
    frame_times: tuple[Fraction, ...] = field(repr=False)
    start_pts: int = field(repr=False)  # the first frame's timestamp, in the stream's time base
    end_time: Fraction
    variable_frame_rate: bool
    has_audio: bool
    audio_codec: str | None
    audio_sample_rate: int | None
    audio_channels: int | None

    @property
    def duration(self) -> float:
        return float(self.end_time)


@dataclass(frozen=True)
class PreparedClip:
    """One decoded clip: ``pixels`` uint8 ``[F, 3, H, W]`` RGB for ``bucket``, and JSON-able ``meta``.

    ``info`` is what the container said (None for an image made into a one-frame clip).
    """

    pixels: torch.Tensor
    bucket: Bucket
    info: ClipInfo | None
    meta: dict[str, Any]
    audio: ClipAudio | None = None  # the clip's audio track fitted to the frames (ClipSpec.audio)
    reference: PreparedClip | None = None  # its IC-LoRA reference clip (ClipSpec.reference_scale)
    reference_audio: ClipAudio | None = None  # its reference sound (ClipSpec.inputs, media/clip_inputs.py)
    video_mask: torch.Tensor | None = None  # float [F, H, W] in [0, 1], cropped as the clip (ClipSpec.inputs)
    audio_mask: torch.Tensor | None = None  # the audio mask's 1-D signal (ClipSpec.inputs)
    depth: torch.Tensor | None = None  # uint8 [F, 3, H, W], its depth clip as the clip (media/depth_video.py)


def probe(source: VideoSource) -> ClipInfo:
    """Streams, size, rotation, fps, frame count and timestamps of a clip, decoding at most one frame.

    Raises :class:`~diffprep.errors.RejectError` as :func:`prepare_clip` does.
    """
    with _open(source) as container:
        return _index(container)


def prepare_clip(
    source: VideoSource,
    buckets: Sequence[Bucket],
    *,
    target_fps: float | None = None,
    frame_sampling: FrameSampling = "head",
    max_pixels: int = DEFAULT_MAX_PIXELS,
    audio: bool = False,
) -> PreparedClip:
    """Decode ``source`` (bytes or a path) into the frames of the bucket it belongs to.

    ``meta`` records the source size, fps and frame count, the resampling,
    the source frame index and time of every output frame, the bucket and
    the crop box (display coordinates, after rotation) and, with ``audio``, the
    audio track's rate, channels and the seconds kept (``F / fps``, :func:`playback_fps`).
    """
    if frame_sampling not in FRAME_SAMPLINGS:
        raise ValueError(f"frame_sampling must be one of {', '.join(FRAME_SAMPLINGS)}, got {frame_sampling!r}")
    if target_fps is not None and not target_fps > 0:
        raise ValueError(f"target_fps must be > 0 (or None to keep the source frames), got {target_fps}")
    with _open(source) as container:
        info = _index(container, max_pixels=max_pixels)
        if audio and not info.has_audio:  # before any frame is decoded
            raise RejectError("no_audio_stream", "the clip has no audio stream")
        available = _resample(info, target_fps)
        bucket = choose_bucket(info.width, info.height, len(available), buckets)
        chosen = [available[i] for i in sample_indices(len(available), bucket.frames, frame_sampling)]
        box = cover_box(info.width, info.height, bucket)
        pixels = _decode_frames(container, info, chosen, bucket, box)

    meta = clip_meta(info, chosen, bucket, box) | {
        "sample_aspect_ratio": info.sample_aspect_ratio,
        "source_duration": round(info.duration, 6),
        "has_audio": info.has_audio,
        "target_fps": target_fps,
        "frame_sampling": frame_sampling,
        "fps": playback_fps(info.fps, target_fps, len(available), bucket.frames, frame_sampling),
    }
    track = None
    if audio:
        fps = meta["fps"]
        if not fps:
            raise RejectError("audio_decode_error", "the clip has no frame rate, so the audio to keep is unknown")
        track = load_clip_audio(source if isinstance(source, (str, os.PathLike)) else io.BytesIO(bytes(source)),
                                duration=bucket.frames / fps)
        meta["audio"] = {"sample_rate": track.sample_rate, "source_channels": track.source_channels,
                         "duration": track.duration}
    return PreparedClip(pixels=pixels, bucket=bucket, info=info, meta=meta, audio=track)


def clip_meta(info: ClipInfo, chosen: list[int], bucket: Bucket, box: tuple[int, int, int, int]) -> dict:
    """What every prepared clip's meta.json says of its source and of the frames it kept: the container, the frame
    indices and times, the bucket and the crop box (callers add how the frames were chosen)."""
    return {
        "container": info.container,
        "codec": info.codec,
        "original_size": [info.width, info.height],
        "rotation": info.rotation,
        "source_fps": info.fps,
        "source_frames": info.frames,
        "variable_frame_rate": info.variable_frame_rate,
        "frame_indices": chosen,
        "frame_times": [round(float(info.frame_times[i]), 6) for i in chosen],
        "bucket": [bucket.width, bucket.height, bucket.frames],
        "crop_box": list(box),
    }


def prepare_image_clip(data: bytes, buckets: Sequence[Bucket], *, max_pixels: int = 89_478_485) -> PreparedClip:
    """An image as a one-frame clip: decoded as :mod:`diffprep.media.images` does (EXIF, alpha, modes), then
    covered and centre-cropped into the ``F = 1`` bucket of nearest aspect.

    No ``F = 1`` bucket: :class:`~diffprep.errors.RejectError` ``too_few_frames``.
    """
    from diffprep.media import images

    if not data:
        raise RejectError("empty_file", "the image file is 0 bytes", phase="decode")
    spec = images.ImageSpec(max_pixels=max_pixels)
    notes: list[str] = []
    with images._open(data, spec) as img:
        images._load(img, notes)
        images._exif_transpose(img, notes)
        rgb = images._to_rgb(img, spec.background, notes)
        width, height = rgb.size
        bucket = choose_bucket(width, height, 1, buckets)
        box = cover_box(width, height, bucket)
        out = _resize(rgb, bucket, box)
    pixels = torch.from_numpy(np.ascontiguousarray(out.transpose(2, 0, 1)))[None]
    meta = {
        "original_size": [width, height],
        "bucket": [bucket.width, bucket.height, bucket.frames],
        "crop_box": list(box),
        "frame_indices": [0],
        "notes": notes,
    }
    return PreparedClip(pixels=pixels, bucket=bucket, info=None, meta=meta)


@dataclass(frozen=True)
class ClipSpec:
    """How a video run prepares its samples: the buckets, the frame rate and which frames to keep.

    A clip (``video`` bytes) goes through :func:`prepare_clip`, an image through
    :func:`prepare_image_clip` (a one-frame clip where an ``F = 1`` bucket exists).
    """

    buckets: tuple[Bucket, ...]
    target_fps: float | None = None
    frame_sampling: FrameSampling = "head"
    max_pixels: int = DEFAULT_MAX_PIXELS
    audio: bool = False  # decode each clip's audio track too (LTX-2); an image then has none to give
    reference_scale: int | None = None  # IC-LoRA: each clip's reference clip, in its bucket with W and H / this
    # The clip's other inputs read (media/clip_inputs.py ROLES): its own sound file, reference audio, masks.
    inputs: tuple[str, ...] = ()
    scenes: SceneSettings | None = None  # long videos: many windows per source, cut at its shots (long_videos.py)

    def __post_init__(self) -> None:
        if self.scenes is not None and (self.reference_scale is not None or self.inputs):
            raise ConfigError("--split-scenes cuts a clip's frames and its own audio track, not yet its reference "
                              "clip, a sound file of its own, reference audio or masks (each would need the window "
                              "cut from it too): leave those columns out, or encode such clips one per file")

    def prepare(self, data: bytes, *, video: bool, bucket: Bucket | None = None,
                reference: bytes | None = None) -> PreparedClip:
        """The sample's frames, in ``bucket`` when its unit has one (the plan chose it), else in its own.

        With ``reference_scale``, ``reference`` (the reference clip's bytes) is
        prepared too, in the clip's bucket with its sides divided by the scale;
        its rejects are the clip's, named ``reference_<reason>``.
        """
        buckets = (bucket,) if bucket is not None else self.buckets
        if video:
            # A sound file of its own ("audio" in inputs) replaces the clip's track: media/clip_inputs.py reads it.
            clip = prepare_clip(data, buckets, target_fps=self.target_fps, frame_sampling=self.frame_sampling,
                                max_pixels=self.max_pixels, audio=self.audio and "audio" not in self.inputs)
            if self.reference_scale is None:
                return clip
            if reference is None:
                raise RejectError("missing_reference", "this IC-LoRA run needs a reference clip for every sample "
                                  "(the metadata file's reference_video column)")
            scaled = Bucket(clip.bucket.width // self.reference_scale, clip.bucket.height // self.reference_scale,
                            clip.bucket.frames)
            try:
                ref = prepare_clip(reference, [scaled], target_fps=self.target_fps,
                                   frame_sampling=self.frame_sampling, max_pixels=self.max_pixels)
            except RejectError as error:
                raise RejectError(f"reference_{error.reason}", f"the reference clip: {error.detail}",
                                  error.phase) from None
            return replace(clip, meta={**clip.meta, "reference": ref.meta}, reference=ref)
        if self.audio:
            raise RejectError("no_audio_stream", "an image has no audio track; this run keeps audio with every "
                              "sample (LTX-2: --skip-audio leaves it out; raw clips: without --keep-audio)")
        return prepare_image_clip(data, buckets)

    def bucket_of(self, data: bytes, *, video: bool) -> Bucket:
        """The bucket a sample goes to, from its container's index alone (no frame beyond the first decoded).

        Raises :class:`~diffprep.errors.RejectError` as :meth:`prepare` would (``too_few_frames``...).
        """
        if not video:
            from diffprep.media import images

            if not data:
                raise RejectError("empty_file", "the image file is 0 bytes", phase="decode")
            with images._open(data, images.ImageSpec()) as img:
                width, height = img.size
                if img.getexif().get(0x0112) in (5, 6, 7, 8):  # EXIF orientations that swap the sides
                    width, height = height, width
            return choose_bucket(width, height, 1, self.buckets)
        with _open(data) as container:
            info = _index(container, max_pixels=self.max_pixels)
        return choose_bucket(info.width, info.height, len(_resample(info, self.target_fps)), self.buckets)


def playback_fps(source_fps: float, target_fps: float | None, available: int, frames: int,
                 sampling: FrameSampling) -> float | None:
    """The rate at which the kept frames play at the clip's real speed (None: the source states none).

    ``target_fps`` or the source's; ``uniform`` sampling keeps every ``(available - 1) / (frames - 1)``-th
    frame on average, so the rate drops by that factor.
    """
    rate = target_fps or source_fps
    if not rate:
        return None
    if sampling == "uniform" and frames > 1 and available > frames:
        rate = rate * (frames - 1) / (available - 1)
    return round(rate, 6)


def sample_indices(available: int, frames: int, sampling: FrameSampling) -> list[int]:
    """Which ``frames`` of ``available`` to keep: ``head`` the first ones, ``uniform`` evenly spread
    from the first to the last (exact integer rounding, half up)."""
    if not 1 <= frames <= available:
        raise ValueError(f"cannot take {frames} frames from {available}")
    if sampling == "head" or frames == 1:
        return list(range(frames))
    if sampling == "uniform":
        span, steps = available - 1, frames - 1
        return [(2 * j * span + steps) // (2 * steps) for j in range(frames)]
    raise ValueError(f"frame_sampling must be one of {', '.join(FRAME_SAMPLINGS)}, got {sampling!r}")


# --- opening and indexing ---------------------------------------------------------------------


def _open(source: VideoSource) -> av.container.InputContainer:
    if isinstance(source, (bytes, bytearray, memoryview)):
        if len(source) == 0:
            raise RejectError("empty_file", "the video file is 0 bytes", phase="decode")
        file: Any = io.BytesIO(bytes(source))
    else:
        path = Path(source)
        if path.stat().st_size == 0:  # a missing file is the source's problem: FileNotFoundError
            raise RejectError("empty_file", f"{path.name} is 0 bytes", phase="decode")
        file = str(path)
    try:
        return av.open(file, mode="r")
    except (av.FFmpegError, OSError, ValueError, EOFError) as exc:
        raise RejectError("video_decode_error", f"FFmpeg cannot open it: {_message(exc)}", phase="decode") from None


def _index(container: av.container.InputContainer, *, max_pixels: int = DEFAULT_MAX_PIXELS) -> ClipInfo:
    if not container.streams.video:
        found = ", ".join(f"{s.type} ({_codec_name(s)})" for s in container.streams) or "no streams"
        raise RejectError("no_video_stream", f"the file holds {found}", phase="decode")
    stream = container.streams.video[0]
    coded_w, coded_h = stream.codec_context.width, stream.codec_context.height
    if coded_w < 1 or coded_h < 1:
        raise RejectError("video_decode_error", f"the video stream gives an empty size {coded_w}x{coded_h}")
    if coded_w * coded_h > max_pixels:
        raise RejectError(
            "video_too_large",
            f"{coded_w}x{coded_h} = {coded_w * coded_h} pixels per frame is over max_pixels = {max_pixels}",
        )
    audio = container.streams.audio[0] if container.streams.audio else None

    stamps: list[int] = []
    durations: dict[int, int] = {}
    try:
        for packet in container.demux(stream):
            if packet.size == 0:  # the flush packet at the end
                continue
            if packet.is_discard:  # before an edit list's start: decoded for reference, never shown
                continue
            stamp = packet.pts if packet.pts is not None else packet.dts
            if stamp is None:
                raise RejectError(
                    "video_no_timestamps",
                    "video packets carry no timestamps (a raw stream?); remux it into a container",
                )
            stamps.append(stamp)
            durations[stamp] = packet.duration or 0
    except av.FFmpegError as exc:
        detail = f"demuxing failed after {len(stamps)} frames: {_message(exc)}"
        raise RejectError("video_decode_error", detail) from None
    stamps.sort()
    if len(set(stamps)) != len(stamps):
        raise RejectError("video_decode_error", "two video packets share a timestamp; the file is damaged")
    rotation = _rotation(container, stream) if stamps else 0

    time_base = stream.time_base or Fraction(1, 1)
    times = tuple((stamp - stamps[0]) * time_base for stamp in stamps) if stamps else ()
    intervals = [b - a for a, b in zip(times, times[1:])]
    rate = stream.average_rate or stream.guessed_rate
    if intervals:
        last = durations[stamps[-1]] * time_base or _median(intervals)
    else:
        last = 1 / rate if rate else Fraction(0)
    end_time = times[-1] + last if times else Fraction(0)
    fps = float(rate) if rate else (len(times) / float(end_time) if end_time else 0.0)
    width, height = (coded_h, coded_w) if rotation % 180 else (coded_w, coded_h)
    sar = stream.sample_aspect_ratio
    return ClipInfo(
        container=container.format.name,
        codec=_codec_name(stream),
        width=width,
        height=height,
        rotation=rotation,
        sample_aspect_ratio=None if sar is None or sar == 1 else f"{sar.numerator}:{sar.denominator}",
        fps=round(fps, 6),
        frames=len(times),
        frame_times=times,
        start_pts=stamps[0] if stamps else 0,
        end_time=end_time,
        # Timestamps rounded to the stream's time base jitter by a tick in CFR files; VFR differs by more.
        variable_frame_rate=bool(intervals) and max(intervals) - min(intervals) > 2 * time_base,
        has_audio=audio is not None,
        audio_codec=_codec_name(audio) if audio is not None else None,
        audio_sample_rate=audio.codec_context.sample_rate if audio is not None else None,
        audio_channels=audio.codec_context.channels if audio is not None else None,
    )


def _rotation(container: av.container.InputContainer, stream) -> int:
    """Display rotation (degrees counter-clockwise, a multiple of 90) from the first decoded frame."""
    _rewind(container, stream)
    try:
        frame = next(container.decode(stream), None)
    except av.FFmpegError as exc:
        raise RejectError("video_decode_error", f"the first frame does not decode: {_message(exc)}") from None
    if frame is None:
        return 0
    return int(round(frame.rotation / 90)) % 4 * 90


def _resample(info: ClipInfo, target_fps: float | None) -> list[int]:
    """Source frame index of every available output frame (all frames when ``target_fps`` is None)."""
    if target_fps is None:
        return list(range(info.frames))
    # The fps as a decimal fraction (29.97 -> 2997/100): the same frames on every machine.
    step = 1 / Fraction(str(target_fps))
    chosen: list[int] = []
    when = Fraction(0)
    while when < info.end_time:
        chosen.append(bisect.bisect_right(info.frame_times, when) - 1)
        when += step
    return chosen


def _decode_frames(
    container: av.container.InputContainer,
    info: ClipInfo,
    chosen: list[int],
    bucket: Bucket,
    box: tuple[int, int, int, int],
) -> torch.Tensor:
    """Decode up to the last chosen frame; return the chosen frames (repeats included) as uint8 [F, 3, H, W]."""
    stream = container.streams.video[0]
    _rewind(container, stream)
    slots: dict[int, list[int]] = {}
    for slot, index in enumerate(chosen):
        slots.setdefault(index, []).append(slot)
    last = max(chosen)
    time_base = stream.time_base or Fraction(1, 1)
    # Written frame by frame: no list of frames, no stacked copy.
    pixels = torch.empty((len(chosen), 3, bucket.height, bucket.width), dtype=torch.uint8)
    out = pixels.numpy()  # a view: numpy assignment takes PIL's read-only arrays without a copy or warning
    done: set[int] = set()
    position = -1
    try:
        for position, frame in enumerate(container.decode(stream)):
            if frame.pts is not None and position < info.frames:
                expected = info.start_pts + info.frame_times[position] / time_base
                if frame.pts != expected:
                    raise RejectError(
                        "video_decode_error",
                        f"decoded frame {position} has timestamp {frame.pts}, the container lists {expected}; "
                        "the file is damaged",
                    )
            if position in slots:
                image = frame.to_image()
                if info.rotation:
                    image = image.transpose(_ROTATIONS[info.rotation // 90])
                rgb = _resize(image, bucket, box).transpose(2, 0, 1)
                for slot in slots[position]:
                    out[slot] = rgb
                done.add(position)
            if position >= last:
                break
    except (av.FFmpegError, ValueError) as exc:  # ValueError: a pixel format with no RGB conversion
        raise RejectError("video_decode_error", f"frame {position + 1} does not decode: {_message(exc)}") from None
    if last not in done:
        raise RejectError(
            "video_truncated",
            f"the container lists {info.frames} frames but only {position + 1} decode; frame {last} is needed",
        )
    return pixels


def _rewind(container: av.container.InputContainer, stream) -> None:
    try:
        container.seek(0, stream=stream)
    except av.FFmpegError as exc:
        raise RejectError("video_decode_error", f"cannot seek back to the start: {_message(exc)}") from None


def _resize(image: Image.Image, bucket: Bucket, box: tuple[int, int, int, int]) -> np.ndarray:
    size = (bucket.width, bucket.height)
    if (box[2] - box[0], box[3] - box[1]) == size:
        out = image.crop(box)  # scale 1: an exact crop, no resampling
    else:
        out = image.resize(size, Image.Resampling.LANCZOS, box=box)
    return np.asarray(out.convert("RGB"))


def _median(values: list[Fraction]) -> Fraction:
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


def _codec_name(stream) -> str:
    context = getattr(stream, "codec_context", None)
    return getattr(context, "name", None) or "unknown"


def _message(exc: BaseException) -> str:
    # FFmpegError's str holds the file name PyAV was given (a BytesIO repr with an address): keep the text only.
    strerror = getattr(exc, "strerror", None)
    text = strerror or str(exc)
    return f"{type(exc).__name__}: {text}"
