"""One window of a long video decoded: seek to the window's first frame, decode to its last, nothing else.

A unit of a long-video run holds windows of the sources (:mod:`diffprep.media.windows`); a 2-hour source cut
into 500 clips must not decode 500 times its head. The container is indexed (demuxed, no frame decoded, as
:func:`~diffprep.media.video.probe` does), resampled to the run's timeline exactly as the plan did, and the
decoder seeks to the key frame at or before the window's first source frame; frames are matched to the
index by their timestamps, so a seek that lands anywhere still gives the planned frames.

Rejects (phase ``decode``) besides the clip path's: ``window_out_of_range`` (the planned window is not on the
timeline the file gives now: the file changed since it was planned), ``window_frames_mismatch`` (the window
has another frame count than its bucket's).
"""

from __future__ import annotations

from fractions import Fraction
from typing import Any

import av
import torch

from diffprep.errors import RejectError
from diffprep.media import video
from diffprep.media.buckets import Bucket, cover_box

__all__ = ["decode_window", "timeline"]


def timeline(info: video.ClipInfo, target_fps: float | None, decoded_frames: int | None = None) -> list[int]:
    """The source frame of every frame of the run's timeline (``target_fps`` resampling by timestamp), up to
    the last frame that decodes (``decoded_frames``: the plan's count; None: the index's)."""
    frames = video._resample(info, target_fps)
    limit = info.frames if decoded_frames is None else min(decoded_frames, info.frames)
    return [index for index in frames if index < limit]


def decode_window(data: bytes, bucket: Bucket, first: int, last: int, *, target_fps: float | None,
                  max_pixels: int = video.DEFAULT_MAX_PIXELS, work: dict[str, int] | None = None
                  ) -> tuple[torch.Tensor, dict[str, Any]]:
    """Frames ``first..last`` of the timeline of the clip ``data``, covered and centre-cropped to ``bucket``:
    uint8 ``[F, 3, H, W]`` and the window's meta (source size and fps, frame indices and times, crop box).

    ``work`` (a dict, optional) gets ``decoded``: the frames the decoder returned, the window's cost."""
    with video._open(data) as container:
        info = video._index(container, max_pixels=max_pixels)
        frames = video._resample(info, target_fps)
        if not 0 <= first <= last < len(frames):
            raise RejectError("window_out_of_range", f"frames {first}-{last} are planned, the clip's timeline has "
                              f"{len(frames)} frames now; the file changed since it was planned")
        chosen = frames[first:last + 1]
        if len(chosen) != bucket.frames:
            raise RejectError("window_frames_mismatch", f"the window has {len(chosen)} frames, its bucket {bucket} "
                              f"{bucket.frames}")
        box = cover_box(info.width, info.height, bucket)
        pixels, decoded = _decode_from(container, info, chosen, bucket, box)
    if work is not None:
        work["decoded"] = decoded
    fps = target_fps or info.fps or None
    meta = video.clip_meta(info, chosen, bucket, box) | {
        "target_fps": target_fps,
        "fps": round(fps, 6) if fps else None,
        "window": [first, last],
    }
    return pixels, meta


def _decode_from(container: av.container.InputContainer, info: video.ClipInfo, chosen: list[int], bucket: Bucket,
                 box: tuple[int, int, int, int]) -> tuple[torch.Tensor, int]:
    stream = container.streams.video[0]
    time_base = stream.time_base or Fraction(1, 1)
    index_of = {info.start_pts + time / time_base: i for i, time in enumerate(info.frame_times)}
    slots: dict[int, list[int]] = {}
    for slot, index in enumerate(chosen):
        slots.setdefault(index, []).append(slot)
    start, last = min(chosen), max(chosen)
    pixels = torch.empty((len(chosen), 3, bucket.height, bucket.width), dtype=torch.uint8)
    out = pixels.numpy()
    done: set[int] = set()
    decoded = 0
    try:
        # backward: the key frame at or before the first frame needed (the decoder needs it to reconstruct).
        container.seek(int(info.start_pts + info.frame_times[start] / time_base), stream=stream, backward=True)
        for frame in container.decode(stream):
            decoded += 1
            position = index_of.get(frame.pts)
            if position is None:
                raise RejectError("video_decode_error", f"a decoded frame has timestamp {frame.pts}, which the "
                                  "container's index does not list; the file is damaged")
            if position in slots:
                image = frame.to_image()
                if info.rotation:
                    image = image.transpose(video._ROTATIONS[info.rotation // 90])
                rgb = video._resize(image, bucket, box).transpose(2, 0, 1)
                for slot in slots[position]:
                    out[slot] = rgb
                done.add(position)
            if position >= last:
                break
    except (av.FFmpegError, ValueError) as exc:
        raise RejectError("video_decode_error", f"the window does not decode: {video._message(exc)}") from None
    if set(slots) - done:
        raise RejectError("video_truncated", f"frames {sorted(set(slots) - done)[:5]} of the window do not decode")
    return pixels, decoded
