"""Which frames of a posed scene are kept, and how a long scene is cut into chunks: GAE's rules, as plain functions
of frame counts and camera centres, so the source (its chunk ids at plan time) and the preparation agree.

Order of operations (what a sample is): a scene's frames, in the format's order, are first *sampled*
(``scenes.frames`` with ``--frame-sampling``: head | uniform | progressive; unset: every frame), then the kept
frames are *chunked* (``scenes.chunk_frames``): GAE cuts its packed videos, which hold the kept frames, the same
way. So a ScanNet++ scan sampled to 256 frames is one sample, and an every-frame RealEstate10K clip of 650 frames
is two (400 + 250). Both steps depend only on the camera files, which the source reads when it lists scenes, so
the ids (``<scene>/chunk_000``...) are known at plan time.

- ``uniform`` (GAE's ScanNet++ rule): every frame when there are no more than asked; ``[total // 2]`` for one
  frame; else ``round(i * (total - 1) / (keep - 1))`` (Python's ``round``: ties go to the even integer).
- ``head``: the first ``keep``.
- ``progressive`` (GAE's pose-aware rule, translation only): see :func:`progressive_indices`. The walk stops once
  it has ``keep`` frames, so a long scan is covered only from its start (at most about ``keep * max_skip``
  source frames).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

SAMPLINGS = ("head", "uniform", "progressive")
# GAE's progressive walk: (min_t, max_t, max_skip); the fallback pass relaxes them to (0.3 min, 1.5 max, 2 skip)
# when the first keeps fewer than 80% of the frames asked.
PROGRESSIVE = (0.005, 0.20, 8)
FALLBACK_SHARE = 0.8


def uniform_indices(total: int, keep: int) -> list[int]:
    if total <= keep:
        return list(range(total))
    if keep == 1:
        return [total // 2]
    return [round(i * (total - 1) / (keep - 1)) for i in range(keep)]


def _greedy(tn: np.ndarray, keep: int, min_t: float, max_t: float, max_skip: int) -> list[int]:
    """GAE's walk: accept a frame once the camera moved between ``min_t`` and ``max_t`` (normalized) since the last
    accepted one; a jump over ``max_t`` only after ``max_skip`` skipped frames, and a standstill after ``max_skip``."""
    accepted, last, skipped = [0], tn[0], 0
    for i in range(1, len(tn)):
        if len(accepted) == keep:
            break
        d = float(np.linalg.norm(tn[i] - last))
        if min_t <= d <= max_t:
            take = True
        elif d > max_t:
            take = skipped >= max_skip
            if not take:
                skipped += 1
        else:
            skipped += 1
            take = skipped >= max_skip
        if take:
            accepted.append(i)
            last, skipped = tn[i], 0
    return accepted


def progressive_indices(centres: np.ndarray, keep: int) -> list[int]:
    """GAE's progressive sampling of ``keep`` frames from camera centres [total, 3].

    Centres are divided by ``|max - min| + 1e-8`` (the per-axis extent's norm). The walk :func:`_greedy` runs with
    (0.005, 0.20, 8); if it keeps fewer than ``0.8 * keep`` it runs again with (0.0015, 0.30, 16). If still fewer
    than ``keep``, rounds of midpoints fill in: each round adds ``(a + b) // 2`` between every two consecutive kept
    indices more than one apart, until there are ``keep`` or a round adds none. The first ``keep`` (sorted) are
    kept. (GAE's code was not at hand when this was written; this is its described rule, the fill read as
    "rounds until enough or no change".)
    """
    centres = np.asarray(centres, dtype=np.float64)
    total = len(centres)
    if total <= keep:
        return list(range(total))
    scale = float(np.linalg.norm(centres.max(axis=0) - centres.min(axis=0))) + 1e-8
    tn = centres / scale
    min_t, max_t, max_skip = PROGRESSIVE
    kept = _greedy(tn, keep, min_t, max_t, max_skip)
    if len(kept) < FALLBACK_SHARE * keep:
        kept = _greedy(tn, keep, 0.3 * min_t, 1.5 * max_t, 2 * max_skip)
    while len(kept) < keep:
        middles = [(a + b) // 2 for a, b in zip(kept, kept[1:]) if b - a > 1]
        if not middles:
            break
        kept = sorted(set(kept) | set(middles))
    return sorted(kept[:keep])


def kept_indices(c2w: Sequence[np.ndarray] | np.ndarray, keep: int | None, sampling: str) -> list[int]:
    """The indices of the frames kept from a scene whose cameras are ``c2w`` [total, 4, 4]; ``keep`` None: all."""
    total = len(c2w)
    if keep is None or total <= keep:
        return list(range(total))
    if sampling == "head":
        return list(range(keep))
    if sampling == "uniform":
        return uniform_indices(total, keep)
    if sampling == "progressive":
        return progressive_indices(np.asarray([pose[:3, 3] for pose in c2w]), keep)
    raise ValueError(f"frame sampling must be one of {', '.join(SAMPLINGS)}, got {sampling!r}")


def chunk_ranges(total: int, size: int | None, min_tail: int | None = None) -> list[tuple[int, int]]:
    """GAE's ``chunk_ranges``: ``[(start, end)]`` cutting ``total`` frames into runs of ``size``; a tail shorter than
    ``min_tail`` (default ``size // 2``) joins the last run. One run when ``total <= size`` or ``size`` is None."""
    if size is None or total <= size:
        return [(0, total)]
    min_tail = size // 2 if min_tail is None else min_tail
    ranges, start = [], 0
    while start < total:
        end = min(start + size, total)
        if 0 < total - end < min_tail:
            end = total
        ranges.append((start, end))
        start = end
    return ranges


def chunk_name(index: int) -> str:
    """A chunk's folder and id suffix: ``chunk_000``."""
    return f"chunk_{index:03d}"
