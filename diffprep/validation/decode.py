"""Decode a dataset's samples back to pictures and compare them with their sources.

``diffprep decode OUT --samples N --to DIR`` and the previews of the sanity
and validate phases share these pieces:

- :func:`read_samples`: N samples spread evenly over the committed units, read
  straight from their tars (tensors with ``weights_only=True``).
- each encoding's ``decode_stored``: stored samples back to pixels (the
  pre-encoded latents through the dataset's own VAE, ``diffprep.families.flux_vae``;
  raw image files as stored);
- :func:`source_media`: the source images re-read through the plan's source
  and prepared with the plan's image settings: exactly the pixels that were
  encoded, so the PSNR measures the VAE round trip (or the jpg/webp loss of a
  raw dataset) and nothing else; a clip's audio track (an audio-only sample's
  file) as it was fitted for encoding, likewise.
- each encoding's ``sound`` (LTX-2): audio latents back to a waveform (audio
  VAE decoder + vocoder), written as the mp4's AAC track (audio only: a WAV
  file, and its log-mel spectrogram as the picture), with the log-mel L1
  against the source's audio (``encodings/ltx2_sound.Ltx2Sound``).
- the contact sheet of source next to decoded (``diffprep.report.pictures``).
"""

from __future__ import annotations

import math
import os
import tarfile
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Sequence

import torch

from diffprep import contract
from diffprep.config import SourceConfig
from diffprep.encodings import encoding_of_sample, get_encoding
from diffprep.run.energon import read_subflavors
from diffprep.errors import ConfigError, DatasetValidationError, DiffprepError, RejectError, SourceError
from diffprep.media.images import ImageSpec, prepare_image
from diffprep.writer.layouts import Layout
from diffprep.run.long_videos import prepare_clip_window, read_clips
from diffprep.media.audio import AudioSpec, ClipAudio, wav_bytes
from diffprep.media.buckets import Bucket
from diffprep.media.clip_inputs import prepare_with_inputs
from diffprep.media.mp4 import mp4_bytes
from diffprep.media.video import ClipSpec
from diffprep.report.pictures import CONTACT_SHEET, Preview, frame_grid, frame_strip, png_bytes, write_contact_sheet
from diffprep.writer.plan import Plan, read_plan
from diffprep.writer.shards import StoredSample, atomic_write_bytes, load_tensor
from diffprep.output import as_output
from diffprep.run.manifests import Manifests
from diffprep.sources import SOURCE_TYPES, open_source


@dataclass
class DecodeReport:
    encoding: str
    previews: list[Preview]
    contact_sheet: str | None = None
    vae: str | None = None  # the VAE folder used (pre-encoded datasets)
    images: list[str] = field(default_factory=list)  # PNGs written

    def psnr_values(self) -> list[float]:
        return [p.psnr_db for p in self.previews if p.psnr_db is not None]

    def to_json(self) -> dict[str, Any]:
        return {
            "encoding": self.encoding,
            "samples": [p.to_json() for p in self.previews],
            "contact_sheet": self.contact_sheet,
            "vae": self.vae,
            "images": self.images,
        }

    def lines(self) -> list[str]:
        """One line per sample, for the terminal."""
        lines = []
        for preview in self.previews:
            value = preview.psnr_db
            shown = "n/a" if value is None else ("inf" if math.isinf(value) else f"{value:.2f} dB")
            note = f"  ({preview.note})" if preview.note else ""
            audio = "" if preview.audio_mel_l1 is None else f"  audio log-mel L1 {preview.audio_mel_l1:.3f}"
            lines.append(f"{preview.key}  PSNR {shown:>9}{audio}  {preview.source_id or ''}{note}")
        return lines


# --- reading stored samples ------------------------------------------------------------------------


def read_samples(out_dir: str | os.PathLike, count: int) -> list[StoredSample]:
    """``count`` committed samples spread evenly over the dataset (the first one included), in key order."""
    if count < 1:
        raise ConfigError(f"the number of samples to decode must be >= 1, got {count}")
    out = Path(out_dir)
    plan = read_plan(out)
    from diffprep.encodings import unit_files_layout

    files_layout = unit_files_layout(plan)
    if files_layout is not None:  # the LTX trainer's records, GAE's scene folders
        return [StoredSample(*found) for found in files_layout.stored_samples(out, plan, count)]
    # Two passes over the manifests, one at a time: their sizes, then the keys of the few that hold a pick.
    manifests = Manifests(as_output(out))
    sizes = [(unit, len(m.keys)) for unit, m in manifests.items() if m.keys]
    total = sum(size for _, size in sizes)
    if not total:
        raise DatasetValidationError(f"{out} has no committed samples (no unit manifest lists any); encode first")
    count = min(count, total)
    positions = [i * total // count for i in range(count)]
    wanted: dict[str, dict[str, dict[str, bytes]]] = {}  # shard -> key -> fields
    picked: list[tuple[str, str]] = []
    start = 0
    for unit, size in sizes:
        inside = [position - start for position in positions if start <= position < start + size]
        if inside:
            manifest = manifests[unit]
            for index in inside:
                key = manifest.keys[index]
                wanted.setdefault(manifest.shard, {})[key] = {}
                picked.append((manifest.shard, key))
        start += size
    for shard, samples in wanted.items():
        with tarfile.open(out / shard, mode="r:") as tar:
            for member in tar:
                key, _, ext = member.name.partition(".")
                if key in samples and member.isfile():
                    samples[key][ext] = tar.extractfile(member).read()
                elif samples and all(samples.values()) and key not in samples:
                    break  # members of a sample are consecutive: every wanted sample is complete
    missing = [key for shard, key in picked if not wanted[shard][key]]
    if missing:
        raise DatasetValidationError(f"samples {missing[:5]} are listed in the unit manifests but not in their shards")
    return [StoredSample(key, shard, wanted[shard][key]) for shard, key in picked]


# --- the VAE ---------------------------------------------------------------------------------------


# --- the sources -----------------------------------------------------------------------------------


# Source.describe() of the huggingface source names some settings without their hf_ prefix.
_HF_DESCRIBED = {"dataset": "hf_dataset", "split": "hf_split", "data_files": "hf_data_files",
                 "revision": "hf_revision", "streaming": "hf_streaming"}


def source_config(description: dict[str, Any]) -> SourceConfig:
    """The source settings that reopen the source a plan describes (``Source.describe()``)."""
    kind = description.get("type")
    if kind not in SOURCE_TYPES:
        raise SourceError(f"plan.json describes a source of type {kind!r}, which cannot be reopened here")
    renames = _HF_DESCRIBED if kind == "huggingface" else {}
    values = {renames.get(name, name): value for name, value in description.items()}
    # Descriptive entries (shard counts, base folders) are not settings.
    return SourceConfig(**{name: value for name, value in values.items() if name in SourceConfig.model_fields})


@dataclass(frozen=True)
class SourceMedia:
    """A re-read source sample as it was prepared for encoding: its pixels (None: audio only) and audio (or None)."""

    pixels: torch.Tensor | None
    audio: ClipAudio | None = None


def source_media(plan: Plan, samples: Sequence[StoredSample], *, token: str | None = None,
                 local_only: bool = False) -> dict[str, SourceMedia | str]:
    """Key -> the prepared source media of that sample, or a note saying why they are not available.

    A source whose image no longer gives the recorded original size and crop
    box changed since encoding: it is reported, not compared. ``local_only``
    leaves a hub dataset alone (opening one can download all of it).
    """
    hub = plan.source.get("type") == "huggingface" and not Path(str(plan.source.get("dataset"))).exists()
    if local_only and hub:
        return {s.key: f"source not re-read: hub dataset {plan.source['dataset']} (`diffprep decode` reads it)"
                for s in samples}
    try:
        spec = get_encoding(plan.encoding).media_spec(None, plan)
        source = open_source(source_config(plan.source), token=token,
                             **get_encoding(plan.encoding).source_options(plan.settings))
    except (DiffprepError, KeyError, TypeError, OSError) as error:
        return {s.key: f"source not reachable: {error}" for s in samples}
    result: dict[str, SourceMedia | str] = {}
    for sample in samples:
        meta = sample.meta
        source_id = meta.get("source_id")
        if not source_id:
            result[sample.key] = "no source_id in meta.json"
            continue
        try:
            # A long video's clip id names its source file and window (diffprep/run/long_videos.py).
            scenes = isinstance(spec, ClipSpec) and spec.scenes is not None
            read = next(iter(read_clips(source, [source_id], spec.scenes) if scenes else source.read([source_id])))
            if read.reject is not None:
                raise read.reject
            if read.media is None and getattr(read, "scene", None) is None:
                raise RejectError("missing_image", "the source gave no image")
            prepared = _prepare(read, spec, meta)
        except RejectError as error:
            result[sample.key] = f"source {error.reason}: {error.detail}"
            continue
        except (DiffprepError, OSError, StopIteration) as error:
            result[sample.key] = f"source not readable: {type(error).__name__}: {error}"
            continue
        media, original_size, crop_box = prepared
        recorded = (meta.get("original_size"), meta.get("crop_box"))
        if recorded != (None, None) and recorded != (original_size, crop_box):
            result[sample.key] = (f"the source changed since encoding (original size {original_size}, "
                                  f"recorded {recorded[0]})")
            continue
        result[sample.key] = media
    return result


def _prepare(read: Any, spec: ImageSpec | ClipSpec | AudioSpec, meta: dict
             ) -> tuple[SourceMedia, list[int] | None, list[int] | None]:
    """A re-read source sample prepared as it was encoded: (its media, original size, crop box).

    A clip is prepared in the bucket its meta.json records, an audio file in its duration bucket, a posed scene
    by the plan's ``SceneSpec`` (its chunk included).
    """
    if getattr(read, "scene", None) is not None:
        scene = spec.prepare(read.scene)
        return SourceMedia(scene.pixels), scene.meta.get("original_size"), scene.meta.get("crop_box")
    if isinstance(spec, AudioSpec):
        if read.audio is None:
            raise RejectError("missing_audio", "the source gave no audio file")
        bucket = meta.get("bucket")
        prepared = spec.prepare(read.audio, bucket=float(bucket.removesuffix("s")) if bucket else None)
        return SourceMedia(None, prepared.audio), None, None
    if isinstance(spec, ClipSpec) and spec.scenes is not None:
        clip = prepare_clip_window(spec, read, "x".join(map(str, meta["bucket"])) if meta.get("bucket") else None)
        return SourceMedia(clip.pixels, clip.audio), clip.meta["original_size"], clip.meta["crop_box"]
    if isinstance(spec, ClipSpec):
        bucket = Bucket(*meta["bucket"]) if meta.get("bucket") else None
        clip = prepare_with_inputs(spec, read.media, read.extras, video=read.video is not None, bucket=bucket,
                                   reference=read.reference)  # the sound from its own file where it has one
        return SourceMedia(clip.pixels, clip.audio), clip.meta["original_size"], clip.meta["crop_box"]
    if read.image is None:
        raise RejectError("missing_image", "the source gave no image")
    prepared = prepare_image(read.image, spec)
    return SourceMedia(prepared.pixels), list(prepared.original_size), list(prepared.crop_box)


# --- putting it together ---------------------------------------------------------------------------


def decode_dataset(
    out_dir: str | os.PathLike,
    samples: int,
    *,
    to_dir: str | os.PathLike | None = None,
    sheet: str | os.PathLike | None = None,
    model_path: str | None = None,
    device: str = "auto",
    token: str | None = None,
    decoder: Any = None,
    local_only: bool = False,
) -> DecodeReport:
    """Decode ``samples`` samples of ``out_dir`` and compare them with their sources.

    Writes ``<key>.png`` (decoded) and ``<key>.source.png`` into ``to_dir``
    when given (a clip: its frames side by side in the PNGs, and ``<key>.mp4``,
    with its decoded sound as an AAC track where the dataset has audio; audio
    only: the log-mel spectrograms as the PNGs, and ``<key>.wav``), and the contact sheet to ``sheet`` (default
    ``<to_dir>/contact_sheet.png``; none without either). Pre-encoded datasets
    need their VAE (from plan.json, ``model_path`` or an already loaded
    ``decoder``; with ``local_only`` a hub VAE must be cached already, and a
    hub dataset source is not re-read); raises ConfigError when the VAE cannot
    be loaded.
    """
    out = Path(out_dir)
    plan = read_plan(out)
    # Under the fields' own names, whatever layout wrote them (the plan's, else dataset.yaml's).
    layout = Layout.of_plan(plan.settings) if plan is not None else Layout.of_subflavors(read_subflavors(out))
    stored = [replace(s, fields=layout.read(s.fields, s.key)) for s in read_samples(out, samples)]
    encoding = get_encoding(plan.encoding) if plan is not None else encoding_of_sample(stored[0].fields)
    decoded, vae = encoding.decode_stored(stored, plan, model_path=model_path, device=device, token=token,
                                          local_only=local_only, decoder=decoder, where=str(out))
    sound = encoding.sound(plan, stored, model_path=model_path, device=device, where=str(out))
    sounds: list[ClipAudio | None] = [sound.decode(s) for s in stored] if sound else [None] * len(stored)
    sources = source_media(plan, stored, token=token, local_only=local_only) if plan is not None else {}
    previews = []
    clips: dict[str, tuple[torch.Tensor, float]] = {}  # key -> decoded frames and their rate
    for sample, image, audio in zip(stored, decoded, sounds):
        media = sources.get(sample.key, "plan.json is missing: the source is unknown")
        found = media.pixels if isinstance(media, SourceMedia) else media
        source_audio = media.audio if isinstance(media, SourceMedia) else None
        mel_l1 = sound.mel_l1(audio, source_audio) if audio is not None and source_audio is not None else None
        if image is None and audio is not None:  # audio only: the sound's log-mel spectrogram is the picture
            image = sound.picture(audio)
            if source_audio is not None:  # both cut to their common frames, as the figure compares them
                found = sound.picture(source_audio)
                frames = min(found.shape[2], image.shape[2])
                image, found = image[:, :, :frames].contiguous(), found[:, :, :frames].contiguous()
        if isinstance(found, torch.Tensor) and found.shape != image.shape:
            found = f"decoded {list(image.shape)} but the source prepares to {list(found.shape)}"
        if image.ndim == 4:  # a clip [F, 3, H, W]: its frames side by side, the PSNR over all of them
            clips[sample.key] = (image, sample.meta.get("fps") or 16.0)
            image = frame_strip(image)
            found = frame_strip(found) if isinstance(found, torch.Tensor) else found
        previews.append(Preview(
            key=sample.key, source_id=sample.meta.get("source_id"), caption=sample.caption, decoded=image,
            source=found if isinstance(found, torch.Tensor) else None,
            note="" if isinstance(found, torch.Tensor) else found, audio_mel_l1=mel_l1,
        ))
    report = DecodeReport(encoding=encoding.name, previews=previews, vae=vae)
    if to_dir is not None:
        folder = Path(to_dir)
        folder.mkdir(parents=True, exist_ok=True)
        for sample, preview, audio in zip(stored, previews, sounds):
            path = folder / f"{preview.key}.png"
            atomic_write_bytes(path, png_bytes(preview.decoded))
            report.images.append(str(path))
            if preview.key in clips:  # with its decoded sound where the dataset has audio
                frames, fps = clips[preview.key]
                atomic_write_bytes(folder / f"{preview.key}.mp4", mp4_bytes(frames, fps, audio=audio))
                if contract.VIDEO_MASK in sample.fields:  # inpainting: the mask tinted on the decoded frames
                    from diffprep.encodings.ltx2_masks import overlay

                    mask = load_tensor(sample.fields[contract.VIDEO_MASK], key=sample.key, field=contract.VIDEO_MASK)
                    atomic_write_bytes(folder / f"{preview.key}.mask.png", png_bytes(frame_strip(overlay(frames,
                                                                                                         mask))))
            if sound is not None and contract.REFERENCE_AUDIO_LATENTS in sample.fields:  # beside the target's sound
                atomic_write_bytes(folder / f"{preview.key}.reference.wav",
                                   wav_bytes(sound.decode(sample, contract.REFERENCE_AUDIO_LATENTS)))
            elif audio is not None:
                atomic_write_bytes(folder / f"{preview.key}.wav", wav_bytes(audio))
            if preview.source is not None:
                atomic_write_bytes(folder / f"{preview.key}.source.png", png_bytes(preview.source))
            cameras = getattr(encoding, "cameras", None)  # posed scenes: the path and frustums beside the frames
            if cameras is not None:
                frames = clips[preview.key][0] if preview.key in clips else preview.decoded.unsqueeze(0)
                atomic_write_bytes(folder / f"{preview.key}.cameras.png", png_bytes(camera_picture(
                    frames, *cameras(sample), sample.meta)))
        sheet = sheet or folder / CONTACT_SHEET
    if sheet is not None:
        report.contact_sheet = str(write_contact_sheet(sheet, previews))
    return report



# --- pictures --------------------------------------------------------------------------------------


def camera_picture(frames: torch.Tensor, c2w: Any, intrinsics: Any, meta: dict) -> torch.Tensor:
    """A scene's decoded frames ``[F, 3, H, W]`` in a grid that fits ``diffprep.report.pictures.GRID_SIDE`` (side by side,
    a 256-frame scene was some 100,000 px wide), its cameras' top and side views above them."""
    from diffprep.report.camera_pictures import PANEL, camera_views, with_frames

    width = int(meta.get("width") or frames.shape[3])
    height = int(meta.get("height") or frames.shape[2])
    return with_frames(camera_views(c2w, intrinsics, width, height), frame_grid(frames, min_width=2 * PANEL))
