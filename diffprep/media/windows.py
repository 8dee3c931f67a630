"""Training windows inside the shots of a long video: which frames each clip takes, and which frames none takes.

A long source is cut at its shot boundaries (:mod:`diffprep.media.scenes`, found once in the plan phase) and
each shot gives windows of consecutive frames, never across a cut. Frames are counted on the run's timeline:
the source's frames after ``--target-fps`` resampling (by decoded timestamps, as
:func:`diffprep.media.video.prepare_clip` resamples), so a window's length is exactly the frame count of the
bucket it goes to.

A window's bucket follows the clip path's rule (:func:`~diffprep.media.buckets.choose_bucket`: nearest aspect,
then the most frames not above the shot's frame count, then area), so a shot's windows have that bucket's ``F``
frames (a chain's tail: its own bucket's). ``--clip-mode`` says where the windows lie in a shot of ``n`` frames:

- ``head``: the first ``F`` frames;
- ``chain``: back-to-back windows ``[0, F), [F, 2F), ...``, then the tail (the last ``n mod F`` frames) filled the
  same way with the bucket the same rule gives the tail (the longest that fits it), and so on until no bucket fits
  what is left: a tail of 40 frames with buckets of 81, 49 and 17 frames gives two 17-frame windows. The frames
  left, fewer than the shortest bucket's, are the chain's tail;
- ``slide``: a window every ``--clip-stride`` frames, overlapping when the stride is below ``F``;
- ``uniform``: ``--clips-per-scene`` windows whose starts are spread evenly from ``0`` to ``n - F``.

Frames in no window are counted by why: ``short_shot`` (a shot shorter than every bucket), ``chain_tail``,
``not_sampled`` (outside the windows of ``head``, ``slide`` and ``uniform``).

A clip's id is ``<source>#<shot>:<first>-<last>`` (the shot's number from 0, the window's first and last frame
on the timeline, inclusive).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from diffprep.config.scenes import CLIP_MODES, DETECTORS, scene_threshold
from diffprep.errors import ConfigError, RejectError
from diffprep.media.buckets import Bucket, choose_bucket

__all__ = ["SceneSettings", "Window",
           "chain_windows", "clip_id", "parse_clip_id", "read_scene_captions", "shot_spans", "shot_windows",
           "source_windows"]

_SHOT_KEY = re.compile(r"^.+#\d+$")
_CLIP_ID = re.compile(r"^(?P<source>.+)#(?P<shot>\d+):(?P<first>\d+)-(?P<last>\d+)$")


@dataclass(frozen=True)
class SceneSettings:
    """How a run cuts long sources: the shot detector, its shortest shot, and the windows taken in each shot."""

    detector: str = "adaptive"
    min_scene_seconds: float = 0.0
    clip_mode: str = "chain"
    clip_stride: int | None = None  # slide: frames between window starts (default: the window's own length)
    clips_per_scene: int = 1  # uniform: windows per shot
    # --scene-captions: (key, caption) pairs, a key "<source>#<shot>" or a clip id; in the plan's byte settings
    # (the fingerprint covers them), so a re-run, a resume and decode caption every clip the same.
    captions: tuple[tuple[str, str], ...] = ()
    # --scene-threshold, in the detector's own units (config.scenes.THRESHOLD_RANGES); None: PySceneDetect's
    # default, to which a value equal to it is normalized (the same cuts, the same fingerprint).
    threshold: float | None = None

    def __post_init__(self) -> None:
        if self.detector not in DETECTORS:
            raise ValueError(f"split_scenes must be one of {', '.join(DETECTORS)}, got {self.detector!r}")
        object.__setattr__(self, "threshold", scene_threshold(self.detector, self.threshold))
        if self.clip_mode not in CLIP_MODES:
            raise ValueError(f"clip_mode must be one of {', '.join(CLIP_MODES)}, got {self.clip_mode!r}")
        if self.clip_stride is not None and self.clip_stride < 1:
            raise ValueError(f"clip_stride must be >= 1 frame, got {self.clip_stride}")
        if self.clips_per_scene < 1:
            raise ValueError(f"clips_per_scene must be >= 1, got {self.clips_per_scene}")
        if self.min_scene_seconds < 0:
            raise ValueError(f"min_scene_seconds must be >= 0, got {self.min_scene_seconds}")
        object.__setattr__(self, "captions", tuple((str(k), str(v)) for k, v in self.captions))

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        if data["threshold"] is None:  # runs without --scene-threshold keep their fingerprints
            del data["threshold"]
        if not data["captions"]:  # runs without --scene-captions keep their fingerprints
            del data["captions"]
        else:
            data["captions"] = [list(pair) for pair in data["captions"]]
        return data

    def caption_of(self, clip: str) -> str | None:
        """The --scene-captions caption of clip id ``clip``: its own key, else its shot's; None: its source's."""
        if not self.captions:
            return None
        captions = dict(self.captions)
        if clip in captions:
            return captions[clip]
        return captions.get(clip.rsplit(":", 1)[0]) if parse_clip_id(clip) else None

    @classmethod
    def from_json(cls, data: dict[str, Any] | None) -> SceneSettings | None:
        return None if data is None else cls(**data)


@dataclass(frozen=True)
class Window:
    """``frames`` consecutive frames ``[first, last]`` of the timeline inside shot ``shot``, for ``bucket``."""

    shot: int
    first: int
    last: int
    bucket: Bucket

    @property
    def frames(self) -> int:
        return self.last - self.first + 1


def clip_id(source_id: str, window: Window) -> str:
    return f"{source_id}#{window.shot}:{window.first}-{window.last}"


def parse_clip_id(value: str) -> tuple[str, int, int, int] | None:
    """``<source>#<shot>:<first>-<last>`` -> (source, shot, first, last); None for a plain source id."""
    match = _CLIP_ID.match(value)
    if match is None:
        return None
    return match["source"], int(match["shot"]), int(match["first"]), int(match["last"])


def read_scene_captions(path: str | None) -> tuple[tuple[str, str], ...]:
    """``--scene-captions``: a JSON object of captions by ``<source>#<shot>`` or clip id, sorted by key; a file that
    does not read as one is a ConfigError naming what is wrong."""
    if path is None:
        return ()
    try:
        with open(path, encoding="utf-8-sig") as file:
            data = json.load(file)
    except (OSError, ValueError) as error:
        raise ConfigError(f"--scene-captions {path}: {error}") from None
    if not isinstance(data, dict) or not all(isinstance(v, str) for v in data.values()):
        raise ConfigError(f"--scene-captions {path}: expected a JSON object of captions (strings) by "
                          "\"<source id>#<shot>\" or clip id, e.g. {\"talk.mp4#0\": \"a man at a lectern\"}")
    bad = [key for key in data if not (_SHOT_KEY.match(key) or _CLIP_ID.match(key))]
    if bad:
        raise ConfigError(f"--scene-captions {path}: keys must be <source id>#<shot> or <source id>#<shot>:<first>-"
                          f"<last>; not {', '.join(repr(k) for k in bad[:5])}")
    return tuple(sorted(data.items()))


def shot_spans(shots: Sequence[Sequence[int]], timeline: Sequence[int]) -> list[tuple[int, int]]:
    """Each shot's ``[start, end)`` on the timeline: the timeline frames whose source frame lies in the shot.

    ``shots``: ``[first, last]`` source frame indices, in order, inclusive; ``timeline``: the source frame of
    every timeline frame (non-decreasing). A shot no timeline frame falls in gets an empty span.
    """
    spans: list[tuple[int, int]] = []
    position = 0
    for first, last in shots:
        while position < len(timeline) and timeline[position] < first:
            position += 1
        start = position
        while position < len(timeline) and timeline[position] <= last:
            position += 1
        spans.append((start, position))
    return spans


def shot_windows(length: int, frames: int, scene: SceneSettings) -> tuple[list[int], int]:
    """Window starts (offsets in a shot of ``length`` frames) for windows of ``frames`` frames, and how many
    of the shot's frames no window takes (``chain``: of one length; :func:`chain_windows` fills its tail)."""
    if not 1 <= frames <= length:
        raise ValueError(f"a window of {frames} frames does not fit a shot of {length}")
    if scene.clip_mode == "head":
        starts = [0]
    elif scene.clip_mode == "chain":
        starts = list(range(0, length - frames + 1, frames))
    elif scene.clip_mode == "slide":
        starts = list(range(0, length - frames + 1, scene.clip_stride or frames))
    else:  # uniform: exact integer rounding, half up; fewer windows when the shot has fewer starts than asked
        count, span = scene.clips_per_scene, length - frames
        if count == 1:
            starts = [0]
        else:
            starts = sorted({(2 * j * span + count - 1) // (2 * (count - 1)) for j in range(count)})
    covered = set()
    for start in starts:
        covered.update(range(start, start + frames))
    return starts, length - len(covered)


def chain_windows(width: int, height: int, length: int,
                  buckets: Sequence[Bucket]) -> tuple[list[tuple[int, Bucket]], int]:
    """``--clip-mode chain`` in a shot of ``length`` frames: (offset, bucket) of each window, back to back, and the
    frames left at its end. The shot's bucket is chained first; what its chain leaves goes to the bucket the same
    rule gives that many frames (the longest that fits), chained again, until no bucket fits what is left. A tail
    is never thrown away while a bucket the user gave would take it."""
    placed: list[tuple[int, Bucket]] = []
    offset = 0
    while True:
        try:
            bucket = choose_bucket(width, height, length - offset, buckets)
        except RejectError:  # too_few_frames: what is left is shorter than every bucket
            return placed, length - offset
        count = (length - offset) // bucket.frames  # >= 1: the bucket fits
        placed += [(offset + k * bucket.frames, bucket) for k in range(count)]
        offset += count * bucket.frames


def source_windows(width: int, height: int, spans: Sequence[tuple[int, int]], buckets: Sequence[Bucket],
                   scene: SceneSettings) -> tuple[list[Window], dict[str, int]]:
    """Every window of a ``width`` x ``height`` source whose shots lie at ``spans`` on its timeline, and the
    frames discarded by reason (module docstring)."""
    windows: list[Window] = []
    discarded = {"short_shot": 0, "chain_tail": 0, "not_sampled": 0}
    for shot, (start, end) in enumerate(spans):
        length = end - start
        if length == 0:
            continue
        try:
            bucket = choose_bucket(width, height, length, buckets)
        except RejectError:  # too_few_frames: the whole shot is shorter than every bucket
            discarded["short_shot"] += length
            continue
        if scene.clip_mode == "chain":
            placed, left = chain_windows(width, height, length, buckets)
            discarded["chain_tail"] += left
        else:
            starts, left = shot_windows(length, bucket.frames, scene)
            placed = [(s, bucket) for s in starts]
            discarded["not_sampled"] += left
        windows += [Window(shot, start + s, start + s + b.frames - 1, b) for s, b in placed]
    return windows, {reason: count for reason, count in discarded.items() if count}
