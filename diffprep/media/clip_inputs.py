"""A clip's other inputs (LTX-2, the metadata file's extra columns), prepared beside its frames.

- ``audio``: the clip's sound as a file of its own, read instead of the clip's track, under the same rule
  (trimmed or zero-padded to ``F / fps`` seconds); a file without sound is ``no_audio_stream``, one that does not
  decode ``audio_decode_error`` (the audio gate counts both), the detail naming the file.
- ``reference_audio`` (A2A / AV2AV IC-LoRA): decoded as the clip's sound, the same duration (audio only: the
  target's duration bucket, zero-padded where shorter); its rejects are ``reference_audio_<reason>``.
- ``video_mask``: a mask clip (the clip's own frames taken from it: the same source frame indices) or a still
  image (every frame), resized and cropped exactly as the clip was (its crop box scaled to the mask's size): a
  float ``[F, H, W]`` in [0, 1], the mean of its channels. The trainer stretches the mask to the bucket instead, so
  a mask of another aspect ratio than its bucket would land off its clip. A mask clip with fewer frames than its
  clip is ``video_mask_too_short``; one that does not decode ``video_mask_decode_error``.
- ``audio_mask``: a ``.pt`` tensor (or a dict of one, ``mask`` first; loaded weights only) taken whole, or a sound
  file whose amplitude envelope (the mean of the channels' absolute values) is the mask, fitted to the kept
  seconds as the sound is; ``audio_mask_decode_error`` when it does not load.

- ``depth`` (Wan, ``--depth-column``): the clip's depth clip, read frame for frame with it
  (``diffprep.media.depth_video``).

The latent-grid masks are made at encoding (``diffprep.encodings.ltx2_masks``), where the latents' shapes are known.
"""

from __future__ import annotations

import io
import posixpath
from dataclasses import replace
from typing import Any, Mapping

import torch

from diffprep.errors import RejectError
from diffprep.media import video
from diffprep.media.audio import fit_duration, load_clip_audio
from diffprep.media.depth_video import DEPTH, depth_frames

SOUND = "audio"
REFERENCE_AUDIO = "reference_audio"
VIDEO_MASK = "video_mask"
AUDIO_MASK = "audio_mask"
ROLES = (SOUND, REFERENCE_AUDIO, VIDEO_MASK, AUDIO_MASK)


def prepare_with_inputs(spec: Any, data: bytes, extras: Mapping[str, tuple[str, bytes]], **how: Any) -> Any:
    """``spec.prepare(data, **how)`` (a ``ClipSpec``), with the inputs of ``spec.inputs`` prepared from ``extras``
    (role -> (path as written, bytes))."""
    clip = spec.prepare(data, **how)
    if not spec.inputs:
        return clip
    return prepare_inputs(clip, extras, spec.inputs, max_pixels=getattr(spec, "max_pixels", 0))


def prepare_inputs(clip: Any, extras: Mapping[str, tuple[str, bytes]], roles: tuple[str, ...], *,
                   max_pixels: int) -> Any:
    """``clip`` (a ``PreparedClip``, or an audio-only sample's ``PreparedAudio``: its duration bucket is the seconds
    kept) with the inputs of ``roles`` prepared from ``extras`` (role -> (path, bytes))."""
    missing = [role for role in roles if role not in extras]
    if missing:
        raise RejectError(f"missing_{missing[0]}", f"this run reads a {missing[0]} for every clip (the metadata "
                          f"file's {missing[0]!r} column)")
    if hasattr(clip, "seconds"):  # audio only
        seconds = clip.seconds
    else:
        seconds = clip.bucket.frames / clip.meta["fps"] if clip.meta.get("fps") else None
    changes: dict[str, Any] = {}
    meta = dict(clip.meta)
    if SOUND in roles or REFERENCE_AUDIO in roles or AUDIO_MASK in roles:
        if not seconds:
            raise RejectError("audio_decode_error", "the clip has no frame rate, so the audio to keep is unknown")
    if SOUND in roles:
        name, data = extras[SOUND]
        track = load_clip_audio(io.BytesIO(data), duration=seconds, key=name)
        changes["audio"] = track
        meta["audio"] = {"sample_rate": track.sample_rate, "source_channels": track.source_channels,
                         "duration": track.duration, "file": name}
    if REFERENCE_AUDIO in roles:
        name, data = extras[REFERENCE_AUDIO]
        try:
            track = load_clip_audio(io.BytesIO(data), duration=seconds, key=name)
        except RejectError as error:
            raise RejectError(f"reference_audio_{error.reason}", f"the reference audio: {error.detail}") from None
        changes["reference_audio"] = track
        meta["reference_audio"] = {"file": name, "sample_rate": track.sample_rate, "duration": track.duration}
    if VIDEO_MASK in roles:
        name, data = extras[VIDEO_MASK]
        changes["video_mask"] = video_mask_pixels(clip, name, data, max_pixels=max_pixels)
        meta["video_mask"] = name
    if DEPTH in roles:  # Wan: the depth clip, frame for frame (media/depth_video.py)
        name, data = extras[DEPTH]
        changes["depth"] = depth_frames(clip, name, data, max_pixels=max_pixels)
        meta["depth"] = name
    if AUDIO_MASK in roles:
        name, data = extras[AUDIO_MASK]
        changes["audio_mask"] = audio_mask_envelope(name, data, seconds)
        meta["audio_mask"] = name
    return replace(clip, meta=meta, **changes)


def video_mask_pixels(clip: Any, name: str, data: bytes, *, max_pixels: int) -> torch.Tensor:
    """The mask in the clip's bucket, cropped and resized as the clip: float ``[F, H, W]`` in [0, 1]."""
    from diffprep.sources.base import is_image_name

    bucket, (x0, y0, x1, y1) = clip.bucket, clip.meta["crop_box"]
    width, height = clip.meta["original_size"]

    def scaled(mask_width: int, mask_height: int) -> tuple[float, float, float, float]:
        sx, sy = mask_width / width, mask_height / height
        return (x0 * sx, y0 * sy, x1 * sx, y1 * sy)

    try:
        if is_image_name(name):
            from diffprep.media import images

            spec = images.ImageSpec(max_pixels=max_pixels)
            with images._open(data, spec) as img:
                images._load(img, [])
                images._exif_transpose(img, [])
                rgb = images._to_rgb(img, spec.background, [])
                frame = torch.from_numpy(video._resize(rgb, bucket, scaled(*rgb.size)).copy()).permute(2, 0, 1)
            frames = frame[None].expand(bucket.frames, -1, -1, -1)
        else:
            with video._open(data) as container:
                info = video._index(container, max_pixels=max_pixels)
                source_frames = clip.info.frames if clip.info is not None else 1
                if info.frames < source_frames:
                    raise RejectError("video_mask_too_short", f"the mask clip {name} has {info.frames} frames, its "
                                      f"clip {source_frames}: a mask clip needs a frame for every frame of its clip")
                frames = video._decode_frames(container, info, list(clip.meta["frame_indices"]), bucket,
                                              scaled(info.width, info.height))
    except RejectError as error:
        if error.reason == "video_mask_too_short":
            raise
        raise RejectError("video_mask_decode_error", f"the mask {name}: {error.detail}") from None
    except Exception as error:  # noqa: BLE001 - any mask that does not decode is this sample's reject
        raise RejectError("video_mask_decode_error", f"the mask {name}: {type(error).__name__}: {error}") from None
    return frames.float().mean(dim=1) / 255.0


def audio_mask_envelope(name: str, data: bytes, seconds: float) -> torch.Tensor:
    """The audio mask as a 1-D float signal: a ``.pt`` tensor as stored, or a sound file's amplitude envelope
    fitted to ``seconds`` as the clip's sound is."""
    if posixpath.splitext(name)[1].lower() == ".pt":
        try:
            value = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        except Exception as error:  # noqa: BLE001 - an unloadable mask is this sample's reject
            raise RejectError("audio_mask_decode_error", f"the mask {name} does not load with torch.load "
                              f"(weights only): {type(error).__name__}: {error}") from None
        if isinstance(value, dict) and value:
            value = value.get("mask", next(iter(value.values())))
        if not isinstance(value, torch.Tensor) or value.numel() == 0:
            raise RejectError("audio_mask_decode_error", f"the mask {name} holds a {type(value).__name__}, not a "
                              "tensor (or a dict whose 'mask' is one)")
        return value.float().flatten()
    try:
        track = load_clip_audio(io.BytesIO(data), key=name)
    except RejectError as error:
        raise RejectError("audio_mask_decode_error", f"the mask: {error.detail}") from None
    return fit_duration(track.waveform, track.sample_rate, seconds).abs().mean(dim=0)
