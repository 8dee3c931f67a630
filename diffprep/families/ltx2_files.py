"""The LTX-2 checkpoint: where its files are, the config in its metadata, the video VAE's compression and the
JSON-able identity of an encoder set (the run's fingerprint), without loading any weights.

Split from :mod:`diffprep.families.ltx2` (which re-exports every name here): the encoders' loading and use
stay there.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from diffprep.errors import ConfigError
from diffprep.families.imports import family_imports
from diffprep.families.ltx2_gemma import TEXT_MAX_LENGTH, create_feature_extractor_kind

FAMILY = "ltx2"

# --------------------------------------------------------------------------- checkpoint


def read_checkpoint_config(checkpoint: str | Path) -> dict[str, Any]:
    """The JSON config stored in an LTX-2 checkpoint's safetensors metadata (ltx-core's own reader)."""
    with family_imports(FAMILY):
        from ltx_core.loader import SafetensorsModelStateDictLoader

    path = Path(checkpoint)
    if not path.is_file():
        raise ConfigError(
            f"LTX-2 checkpoint {path} does not exist; pass the .safetensors file (e.g. ltx-2-19b-dev.safetensors)"
        )
    config = SafetensorsModelStateDictLoader().metadata(str(path))
    if not config:
        raise ConfigError(
            f"{path} has no 'config' entry in its safetensors metadata; it is not an LTX-2 checkpoint "
            "(a diffusers-format or ComfyUI-split file will not do: pass the single-file release)"
        )
    return config


@dataclass(frozen=True)
class Ltx2Parts:
    """Where a run's LTX-2 files are: the single-file checkpoint and the Gemma 3 folder."""

    checkpoint: Path
    gemma: Path


def resolve_ltx2(model_path: str | Path, text_encoder_path: str | Path | None = None) -> Ltx2Parts:
    """The checkpoint and Gemma folder of a model path (as ``diffprep.families`` detects it).

    ``model_path`` is the ``.safetensors`` checkpoint, or a folder holding it at
    its top (what ``diffprep tiny-model --family ltx2`` writes: the checkpoint
    beside a Gemma folder). The Gemma folder is ``text_encoder_path`` when given
    (the trainer's ``--text-encoder-path``), else the one subfolder of the model
    folder whose ``config.json`` is a Gemma 3 model's (``model_type: gemma3``).
    """
    from diffprep.families import ltx2_checkpoint

    checkpoint = ltx2_checkpoint(model_path)
    if checkpoint is None:
        raise ConfigError(f"{model_path} is not an LTX-2 checkpoint nor a folder holding one (a .safetensors file "
                          "whose metadata has the config with 'vae' and 'audio_vae'); pass the single-file release, "
                          "e.g. ltx-2-19b-dev.safetensors")
    if text_encoder_path is not None:
        gemma = Path(text_encoder_path).expanduser()
        if not (gemma / "config.json").is_file():
            raise ConfigError(f"--text-encoder-path {gemma} has no config.json; pass the Gemma 3 folder as downloaded")
        return Ltx2Parts(checkpoint, gemma)
    folder = Path(model_path).expanduser()
    found = [p.parent for p in sorted(folder.glob("*/config.json")) if folder.is_dir() and _is_gemma3(p)]
    if len(found) != 1:
        what = ("no Gemma 3 folder" if not found
                else f"{len(found)} Gemma 3 folders ({', '.join(p.name for p in found)})")
        raise ConfigError(f"{folder} holds {what} beside the checkpoint; pass the Gemma 3 text encoder folder "
                          "with --text-encoder-path")
    return Ltx2Parts(checkpoint, found[0])


def _is_gemma3(config_file: Path) -> bool:
    import json

    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and config.get("model_type") == "gemma3"


@dataclass(frozen=True)
class VideoScaleFactors:
    """How much the video VAE compresses: latent frames = 1 + (frames - 1) / time, height / space, width / space."""

    time: int
    space: int


def video_scale_factors(config: Mapping[str, Any]) -> VideoScaleFactors:
    """The video VAE's compression, read from the checkpoint config's ``vae`` section.

    The patchify step divides H and W by ``patch_size``; each encoder block named
    ``compress_time*``, ``compress_space*`` or ``compress_all*`` halves the axes it names
    (ltx-core's ``_make_encoder_block``).
    """
    vae = config.get("vae", {})
    time, space = 1, int(vae.get("patch_size", 4))
    for name, _ in vae.get("encoder_blocks", []):
        if name.startswith("compress_time"):
            time *= 2
        elif name.startswith("compress_space"):
            space *= 2
        elif name.startswith("compress_all"):
            time *= 2
            space *= 2
    return VideoScaleFactors(time=time, space=space)


def describe_ltx2(
    checkpoint: str | Path,
    text_encoder_path: str | Path | None = None,
    *,
    dtype: torch.dtype = torch.bfloat16,
    audio_dtype: torch.dtype = torch.float32,
    video: bool = True,
    audio: bool = True,
    text: bool = True,
    text_encoder_8bit: bool = False,
) -> dict[str, Any]:
    """JSON-able identity of an LTX-2 encoder set, for the config fingerprint, without loading any weights.

    It reads the checkpoint's config and builds ltx-core's modules on the meta
    device for the settings they derive from it (mel parameters, which feature
    extractor), so the fetch phase can fingerprint a run cheaply;
    ``Ltx2Encoders.describe()`` returns the same. Files are identified by name
    and size (hashing a 40 GB checkpoint per run is not worth it).
    """
    from importlib.metadata import version

    with family_imports(FAMILY):  # torchaudio checked first: ltx-core's audio side imports it
        from ltx_core.model.audio_vae import AudioEncoderConfigurator

    checkpoint = Path(checkpoint)
    config = read_checkpoint_config(checkpoint)
    scale = video_scale_factors(config)
    identity: dict[str, Any] = {
        "family": FAMILY,
        "ltx_core": version("ltx-core"),
        "checkpoint": _file_identity(checkpoint),
        "dtype": str(dtype).removeprefix("torch."),
        "audio_dtype": str(audio_dtype).removeprefix("torch."),
        "components": [name for name, wanted in (("video", video), ("audio", audio), ("text", text)) if wanted],
    }
    if video:
        identity["video"] = {
            "scale_time": scale.time,
            "scale_space": scale.space,
            "latent_channels": int(config.get("vae", {}).get("latent_channels", 128)),
        }
    if audio:
        with torch.device("meta"):
            encoder = AudioEncoderConfigurator.from_config(config)
        identity["audio"] = {
            "sample_rate": encoder.sample_rate,
            "mel_bins": encoder.mel_bins,
            "hop_length": encoder.mel_hop_length,
            "n_fft": encoder.n_fft,
        }
    if text:
        if text_encoder_path is None:
            raise ConfigError("text encoding needs the Gemma folder; pass text_encoder_path (--text-encoder-path)")
        identity["text"] = {
            "gemma": _folder_identity(Path(text_encoder_path)),
            "feature_extractor": type(create_feature_extractor_kind(config.get("transformer", {}))).__name__,
            "max_length": TEXT_MAX_LENGTH,
            "load_in_8bit": text_encoder_8bit,
        }
    return identity


def _file_identity(path: Path) -> dict[str, Any]:
    stat = path.stat()
    # The path too, as Flux and Wan record their local folders: decoding a dataset finds its checkpoint again.
    return {"name": path.name, "bytes": stat.st_size, "path": str(path.resolve())}


def _folder_identity(path: Path | None) -> dict[str, Any] | None:
    if path is None:
        return None
    files = sorted(p for p in path.rglob("*") if p.is_file())
    return {"name": path.name, "files": {str(p.relative_to(path)): p.stat().st_size for p in files}}
