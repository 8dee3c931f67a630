"""Which of a metadata file's extra columns an LTX-2 clip run reads (``media/clip_inputs.py`` roles), the fields
they add and their planned shapes; the columns a run would not read are refused by name, never dropped."""

from __future__ import annotations

from typing import Any

from diffprep import contract
from diffprep.config import Settings
from diffprep.errors import ConfigError

# The clip's other inputs -> the field each one adds (the sound file adds none: it is the audio latents' source).
INPUT_FIELDS = {"reference_audio": contract.REFERENCE_AUDIO_LATENTS, "video_mask": contract.VIDEO_MASK,
                "audio_mask": contract.AUDIO_MASK}


def expected_shapes(inputs: list[str]) -> dict[str, Any]:
    """The planned shapes of the fields ``inputs`` add (the masks' grid follows each sample's latents)."""
    shapes = {"reference_audio": ("reference_audio_latents", [8, None, 16]), "video_mask": ("video_mask",
              [None, None, None]), "audio_mask": ("audio_mask", [None])}
    return dict(shapes[role] for role in inputs if role in shapes)


def read_columns(settings: Settings) -> list[str]:
    """The clip's other inputs this run reads (``media/clip_inputs.py`` roles: the metadata file's ``audio``,
    ``reference_audio``, ``video_mask``, ``audio_mask`` columns); a column it would not read (the trainer's
    reference column without --reference-column; sound columns with --skip-audio) refused, never dropped."""
    source = settings.source
    if source.type != "metadata" or not source.metadata_file:
        return []
    from diffprep.media.clip_inputs import AUDIO_MASK, REFERENCE_AUDIO, ROLES, SOUND
    from diffprep.sources import open_source

    opened = open_source(source)
    if getattr(opened, "audio_only", False):
        raise ConfigError(f"{source.metadata_file} names audio files (column {opened.media_key!r}) and no clips: an "
                          "audio-only (T2A) run needs --audio-durations, e.g. \"2.0;4.0\" (seconds)")
    read = [role for role in ROLES if role in getattr(opened, "extra_columns", [])]
    sound = [role for role in read if role in (REFERENCE_AUDIO, AUDIO_MASK)]
    if sound and settings.video.skip_audio:
        raise ConfigError(f"{source.metadata_file} has a {sound[0]!r} column, which goes with the clips' audio "
                          "latents: remove --skip-audio, or list the clips in a file without that column")
    if settings.video.skip_audio and SOUND in read:
        read.remove(SOUND)  # --skip-audio: no sound, from the clip or from a file of its own
    columns = [] if source.reference_key else getattr(opened, "reference_columns", [])
    if columns:
        raise ConfigError(f"{source.metadata_file} has the IC-LoRA reference column {columns[0]!r}: pass "
                          f"--reference-column {columns[0]} to encode the reference clips (reference_latents), or "
                          "list the clips in a file without it for a plain text-to-video run")
    return read
