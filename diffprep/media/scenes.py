"""Shot boundaries of a long video, found once in the plan phase with PySceneDetect.

PySceneDetect (``scenedetect-headless``: its OpenCV without GUI libraries) decodes every frame through its PyAV
backend, the decoder the rest of :mod:`diffprep.media` uses, and its detectors place the cuts:
``content`` (HSV change between frames), ``adaptive`` (that change against its rolling average: fewer false cuts
in fast motion), ``threshold`` (fades through black), ``histogram`` (YUV histogram change).
``min_scene_seconds`` is the detector's own shortest shot: no cut is placed sooner after the previous one;
``threshold`` (``--scene-threshold``) the detector's own threshold, in its units (``diffprep.config.scenes.THRESHOLD_RANGES``;
None: PySceneDetect's default). ``adaptive`` is PySceneDetect's own default detector, and the one that finds
every hard cut of the suite ``tests/test_long_videos.py`` writes with its default threshold: ``content`` scores
a cut between two flat colours of one brightness (blue to green) about 20, under its 27, and each frame of a fast
pan over a texture 21 to 27, so a ``content`` threshold low enough for the first also cuts where such a pan starts
and stops.

The frames are counted by decoding them (the detector's pass), never from the container's stated frame count
or duration × fps; the timeline the windows are cut on (:mod:`diffprep.media.windows`) is the demuxer's
timestamps of the frames that decode. A container that states another count gets the decoded count (both are
recorded); one that decodes no frame is the reject ``video_decode_error``.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Any

from diffprep.errors import RejectError
from diffprep.media.video import ClipInfo, probe

__all__ = ["Shots", "detect_shots"]


@dataclass(frozen=True)
class Shots:
    """A source's shots: ``[first, last]`` source frame indices (inclusive, in order, covering every decoded
    frame), the frames that decoded and the count the container states (None: it states none)."""

    shots: tuple[tuple[int, int], ...]
    decoded_frames: int
    container_frames: int | None

    def to_json(self) -> dict[str, Any]:
        return {"shots": [list(s) for s in self.shots], "decoded_frames": self.decoded_frames,
                "container_frames": self.container_frames}


def _detector(name: str, min_scene_seconds: float, threshold: float | None = None):
    from scenedetect import AdaptiveDetector, ContentDetector, HistogramDetector, ThresholdDetector

    kinds = {"content": ContentDetector, "adaptive": AdaptiveDetector, "threshold": ThresholdDetector,
             "histogram": HistogramDetector}
    if name not in kinds:
        raise ValueError(f"split_scenes must be one of {', '.join(kinds)}, got {name!r}")
    # A float is seconds to PySceneDetect, an int frames: 0 frames lets a cut follow any other.
    options: dict[str, Any] = {"min_scene_len": float(min_scene_seconds) if min_scene_seconds > 0 else 0}
    if threshold is not None:  # AdaptiveDetector names its threshold adaptive_threshold
        options["adaptive_threshold" if name == "adaptive" else "threshold"] = float(threshold)
    return kinds[name](**options)


def detect_shots(data: bytes, detector: str = "adaptive", min_scene_seconds: float = 0.0,
                 info: ClipInfo | None = None, threshold: float | None = None) -> Shots:
    """The shots of the clip ``data`` (its file bytes), with the frames counted by decoding them.

    Raises :class:`~diffprep.errors.RejectError` as :func:`~diffprep.media.video.probe` does, and
    ``video_decode_error`` when PySceneDetect cannot decode it.
    """
    from scenedetect import SceneManager
    from scenedetect.backends.pyav import VideoStreamAv

    info = info or probe(data)
    try:
        video = VideoStreamAv(io.BytesIO(bytes(data)), name="source", suppress_output=True)
        manager = SceneManager()
        manager.add_detector(_detector(detector, min_scene_seconds, threshold))
        decoded = manager.detect_scenes(video=video, show_progress=False)
        cuts = sorted({int(cut.frame_num) for cut in manager.get_cut_list()})
    except RejectError:
        raise
    except Exception as error:  # noqa: BLE001 - whatever the decoder says ends as the clip's reject
        raise RejectError("video_decode_error", f"scene detection: {type(error).__name__}: {error}") from None
    # The demuxer may list frames that do not decode (a damaged tail): only decoded frames are on the timeline.
    decoded = min(int(decoded), info.frames)
    if decoded < 1:
        raise RejectError("video_decode_error", "scene detection decoded no frame")
    starts = [0] + [cut for cut in cuts if 0 < cut < decoded]
    ends = starts[1:] + [decoded]
    return Shots(tuple((a, b - 1) for a, b in zip(starts, ends)), decoded, _stated_frames(data))


def _stated_frames(data: bytes) -> int | None:
    import av

    with av.open(io.BytesIO(bytes(data))) as container:
        stated = container.streams.video[0].frames
    return int(stated) or None
