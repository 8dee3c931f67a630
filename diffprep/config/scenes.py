"""Long videos (``--split-scenes``): the shot detectors and clip modes, and each detector's threshold in its own
units, checked where the settings are read and where ``diffprep.media.windows`` cuts the windows."""

from __future__ import annotations

from diffprep.errors import ConfigError

CLIP_MODES: tuple[str, ...] = ("head", "chain", "slide", "uniform")
DETECTORS: tuple[str, ...] = ("content", "adaptive", "threshold", "histogram")
# --scene-threshold: PySceneDetect's own default of each detector (what an unset threshold means, so a run that
# does not set it keeps its fingerprint), and the values that mean something in the detector's own units.
DEFAULT_THRESHOLDS: dict[str, float] = {"content": 27.0, "adaptive": 3.0, "threshold": 12.0, "histogram": 0.2}
THRESHOLD_RANGES: dict[str, tuple[float, float, str]] = {
    "content": (0.0, 255.0, "the mean HSV change between two frames that makes a cut; lower finds more cuts"),
    "adaptive": (0.0, 255.0, "how many times its neighbours' mean HSV change a frame's must be to make a cut (and "
                 "at least 15); lower finds more cuts"),
    "threshold": (0.0, 255.0, "the mean brightness under which a frame is black (a fade's end)"),
    "histogram": (-1.0, 1.0, "the correlation of two frames' luma histograms at or below which they are cut "
                  "apart; higher finds more cuts"),
}


def scene_threshold(detector: str, threshold: float | None) -> float | None:
    """``--scene-threshold`` checked against its detector's range (``ConfigError`` naming the range and the
    default); None for PySceneDetect's own default, which a value equal to it means (the same cuts, the same
    fingerprint)."""
    if threshold is None:
        return None
    low, high, meaning = THRESHOLD_RANGES[detector]
    if not low <= threshold <= high:
        raise ConfigError(f"--scene-threshold {threshold:g} is outside {low:g}..{high:g}, the range of the {detector} "
                          f"detector's threshold ({meaning}; default {DEFAULT_THRESHOLDS[detector]:g}): give a value "
                          "in that range or unset it")
    return None if float(threshold) == DEFAULT_THRESHOLDS[detector] else threshold


__all__ = ["CLIP_MODES", "DEFAULT_THRESHOLDS", "DETECTORS", "THRESHOLD_RANGES", "scene_threshold"]
