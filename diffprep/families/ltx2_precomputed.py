"""The LTX-2 trainer's ``.precomputed/`` layout: one ``torch.save``d dict per sample and folder, named after its media.

What each record holds, in which dtype, and where it goes, as the trainer's
``PrecomputedDataset`` reads it (reference/consumer-formats.md A1/A2), built
from what ``diffprep.families.ltx2`` encodes.
"""

from __future__ import annotations

import io
import os
from pathlib import Path, PurePosixPath
from typing import Any

import torch

from diffprep import contract
from diffprep.media.windows import parse_clip_id
from diffprep.sources.base import unescape_id
from diffprep.writer.layouts import Layout
from diffprep.writer.plan import Plan
from diffprep.families.ltx2 import (
    AUDIO_LATENTS_DTYPE,
    CONDITIONS_DTYPE,
    MASK_DTYPE,
    VIDEO_LATENTS_DTYPE,
    AudioLatents,
    TextConditions,
)

# The trainer's folder and record names are in diffprep.contract (PRECOMPUTED_DIR, LATENTS_DIR, ...).
VIDEO_LATENTS_KEYS = contract.VIDEO_RECORD_KEYS
AUDIO_LATENTS_KEYS = contract.AUDIO_RECORD_KEYS
CONDITIONS_KEYS = contract.CONDITIONS_RECORD_KEYS
_NAMES: dict[str, dict[str, PurePosixPath | str]] = {}  # plan fingerprint -> source id -> name (or first owner)


# --------------------------------------------------------------------------- .precomputed records


def video_latents_record(latents: torch.Tensor, *, fps: float) -> dict[str, Any]:
    """``latents/`` and ``reference_latents/`` record: ``[C, F', H', W']`` bf16 plus the latent sizes and fps.

    ``num_frames``/``height``/``width`` are the latent grid's sizes (the
    trainer's ``encode_video`` takes them from the latents' shape); ``fps`` is the
    frame rate of the encoded frames.
    """
    if latents.ndim != 4:
        raise ValueError(f"latents must be [C, F', H', W'] (one clip), got shape {list(latents.shape)}")
    _, frames, height, width = latents.shape
    return {
        "latents": latents.detach().to("cpu", VIDEO_LATENTS_DTYPE).clone().contiguous(),
        "num_frames": int(frames),
        "height": int(height),
        "width": int(width),
        "fps": float(fps),
    }


def audio_latents_record(audio: AudioLatents) -> dict[str, Any]:
    """``audio_latents/`` and ``reference_audio_latents/`` record: ``[C, T, F]`` float32, T, F and seconds."""
    latents = audio.latents
    if latents.ndim != 3:
        raise ValueError(f"audio latents must be [C, T, F] (one clip), got shape {list(latents.shape)}")
    return {
        "latents": latents.detach().to("cpu", AUDIO_LATENTS_DTYPE).clone().contiguous(),
        "num_time_steps": int(latents.shape[1]),
        "frequency_bins": int(latents.shape[2]),
        "duration": float(audio.duration),
    }


def conditions_record(conditions: TextConditions) -> dict[str, Any]:
    """``conditions/`` record: video and audio features ``[1024, D]`` bf16 and the left-padded mask ``[1024]`` int64.

    A video-only checkpoint has no audio features; the record then has no
    ``audio_prompt_embeds`` key, as the trainer writes it.
    """
    record = {
        "video_prompt_embeds": conditions.video_prompt_embeds.detach().to("cpu", CONDITIONS_DTYPE).clone().contiguous(),
        "prompt_attention_mask": conditions.prompt_attention_mask.detach().to("cpu", MASK_DTYPE).clone().contiguous(),
    }
    if conditions.audio_prompt_embeds is not None:
        record["audio_prompt_embeds"] = (
            conditions.audio_prompt_embeds.detach().to("cpu", CONDITIONS_DTYPE).clone().contiguous()
        )
    return record


def apply_lora_trigger(caption: str, trigger: str | None) -> str:
    """``--lora-trigger T``: the trainer prepends ``"T "`` (the trigger stripped, one space) to each caption."""
    return f"{trigger.strip()} {caption}" if trigger else caption


def precomputed_relative_path(media: str, metadata_dir: str | Path) -> PurePosixPath:
    """Where a sample's records go under each ``.precomputed/<kind>/`` folder (A1 "Naming").

    ``media`` is the metadata file's main media value (``video``, else
    ``audio``, else ``caption`` column), resolved against the metadata file's
    folder; the result is that path relative to the folder with the suffix
    ``.pt``, subfolders kept. A path outside the folder (absolute, or climbing
    out with ``..``) is mirrored from the filesystem root, without the root.
    """
    if not media or not media.strip():
        raise ValueError("the media path is empty; every sample needs a video, audio or caption value")
    base = Path(os.path.normpath(Path(metadata_dir).absolute()))
    target = Path(os.path.normpath(base / media.strip()))
    try:
        relative = target.relative_to(base)
    except ValueError:
        relative = Path(*target.parts[1:])
    if not relative.parts or relative.name in ("", "."):
        raise ValueError(f"the media path {media!r} names the metadata folder itself, not a file")
    return PurePosixPath(relative.with_suffix(contract.PRECOMPUTED_SUFFIX).as_posix())


def window_relative_path(relative: PurePosixPath, shot: int, first: int, last: int) -> PurePosixPath:
    """A long video's clip (``--split-scenes``, id ``<source>#<shot>:<first>-<last>``) under each
    ``.precomputed/<kind>/`` folder: its source's name (:func:`precomputed_relative_path`) with the shot and the
    window's first and last frame on the timeline, ``talk.pt`` -> ``talk-shot1-30-49.pt``. The trainer pairs a
    sample's records by their relative path alone; the id's ``#`` and ``:`` stay out of file names (``:`` is not
    allowed on Windows file systems, ``#`` starts a URL's fragment)."""
    return relative.with_name(f"{relative.stem}-shot{shot}-{first}-{last}{relative.suffix}")


def precomputed_path(output_root: str | Path, kind: str, relative: PurePosixPath) -> Path:
    """``<output_root>/<kind>/<relative>``; ``output_root`` is the ``.precomputed`` folder the trainer is pointed at."""
    kinds = contract.PRECOMPUTED_DIRS
    if kind not in kinds:
        raise ValueError(f"kind must be one of {', '.join(kinds)}, got {kind!r}")
    return Path(output_root) / kind / Path(relative)


# --------------------------------------------------------------------------- a plan's records


def is_ltx(plan: Plan | None) -> bool:
    return plan is not None and Layout.of_plan(plan.settings).name == contract.LAYOUT_LTX


def sample_names(plan: Plan) -> dict[str, PurePosixPath | str]:
    """Source id -> its ``.pt`` name, or (a later sample giving a name already taken) the id that owns it."""
    if plan.fingerprint + str(plan.total_samples) in _NAMES:
        return _NAMES[plan.fingerprint + str(plan.total_samples)]
    folder = os.path.dirname(plan.source["metadata_file"])
    names: dict[str, PurePosixPath | str] = {}
    owners: dict[PurePosixPath, str] = {}
    for unit in plan.units:
        for source_id in unit.source_ids:
            window = parse_clip_id(source_id)  # a long video's clip: <source>#<shot>:<first>-<last>
            media = unescape_id((window[0] if window else source_id).split("#", 1)[0].replace("%23", "#"))
            if not media:
                names[source_id] = source_id  # no path: the read phase rejects it (missing_media)
                continue
            name = precomputed_relative_path(media, folder)
            if window is not None:
                name = window_relative_path(name, *window[1:])
            owner = owners.setdefault(name, source_id)
            names[source_id] = name if owner == source_id else owner
    _NAMES.clear()
    _NAMES[plan.fingerprint + str(plan.total_samples)] = names
    return names


def load_record(path: Path) -> Any:
    """A record as the trainer loads it: ``torch.load(map_location="cpu", weights_only=True)``."""
    return torch.load(io.BytesIO(path.read_bytes()), map_location="cpu", weights_only=True)
