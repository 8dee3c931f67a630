"""Score columns (``--score-column aesthetic_score``): a row's numbers, kept as top-level fields of its meta.

FastGen's ``presets_filter`` ``{"score": {"threshold": t, "score_key": k}}``
reads the sample's ``json`` member and drops it when ``k`` is there and below
``t``; a missing ``k`` keeps the sample, while ``null`` or a string makes the
comparison raise. So a value is written only when it is a finite number: a
JSON number, or a CSV cell that reads as one. A row without one (the column
absent from the record, an empty cell, ``null``, NaN) leaves the field out;
anything else (text, a boolean, a list, an infinity) is the reject
``invalid_score`` naming the column and the value.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from diffprep.errors import RejectError, SourceError

REJECT_INVALID_SCORE = "invalid_score"
# Names a sample's meta already uses (the reader's, a clip's, LTX-2's): a score column may not take them.
META_NAMES = frozenset({
    "source_id", "original_size", "crop_box", "size", "notes", "bucket", "label", "class_name", "container",
    "codec", "rotation", "source_fps", "source_frames", "variable_frame_rate", "frame_indices", "frame_times",
    "sample_aspect_ratio", "source_duration", "has_audio", "target_fps", "frame_sampling", "fps", "audio",
    "audio_duration", "lora_trigger", "reference", "reference_audio", "video_mask", "audio_mask", "depth",
})


def check_score_columns(names: Sequence[str], columns: Sequence[str], where: str) -> None:
    """Refuse a score column the file does not have, or one named as a field the meta already holds."""
    taken = sorted(set(names) & META_NAMES)
    if taken:
        raise SourceError(f"{where}: --score-column {', '.join(taken)}: the sample's meta already has a field of "
                          f"that name; rename the column (meta fields: {', '.join(sorted(META_NAMES))})")
    missing = [name for name in names if name not in columns]
    if missing:
        raise SourceError(f"{where}: --score-column {', '.join(missing)} is not a column; the columns are "
                          f"{list(columns)}")


def score_value(value: Any, column: str, where: str) -> int | float | None:
    """A cell as the number written (None: no value, the field left out); ``invalid_score`` for anything else."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    number: Any = value
    if isinstance(value, str):
        text = value.strip()
        try:
            number = int(text)
        except ValueError:
            try:
                number = float(text)
            except ValueError:
                number = value
    if isinstance(number, bool) or not isinstance(number, (int, float)):
        raise RejectError(REJECT_INVALID_SCORE, f"{where} column {column!r}: {value!r} is not a number")
    if isinstance(number, float) and math.isnan(number):
        return None
    if isinstance(number, float) and math.isinf(number):
        raise RejectError(REJECT_INVALID_SCORE, f"{where} column {column!r}: {value!r} is not a finite number")
    return number


def row_scores(values: Mapping[str, Any], where: str, absent: Any) -> dict[str, int | float]:
    """The numbers of one row's score columns (``values``: column -> cell, ``absent`` where the record lacks it)."""
    found: dict[str, int | float] = {}
    for column, value in values.items():
        number = None if value is absent else score_value(value, column, where)
        if number is not None:
            found[column] = number
    return found


__all__ = ["META_NAMES", "REJECT_INVALID_SCORE", "check_score_columns", "row_scores", "score_value"]
