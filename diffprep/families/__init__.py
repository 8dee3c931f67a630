"""Model families, detected from what a model folder (or hub repo) holds: ``model_index.json``'s ``_class_name``,
an LTX-2 checkpoint, or an SD VAE's root ``config.json``.

A family module declares its hub layout and components, loads and runs its
encoders, names its sample fields and their shapes, and writes its tiny
random-weight set. Detection reads the pipeline class diffusers itself would
instantiate, never the model's name or path. LTX-2 has no diffusers layout: its
release is one ``.safetensors`` checkpoint whose metadata ``config`` describes
the components (``vae``, ``audio_vae``, ``transformer``...), plus a Gemma 3
folder; a model path that is such a file, or a folder holding exactly one, is
LTX-2 (:func:`ltx2_checkpoint`; the header is read, no tensor).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from diffprep.errors import ConfigError

__all__ = ["FAMILIES", "Family", "detect_family", "family_for_class", "family_of_model", "get_family",
           "ltx2_checkpoint", "safetensors_config"]

MODEL_INDEX = "model_index.json"


@dataclass(frozen=True)
class Family:
    """One model family: its name (``--family``), the diffusers pipeline classes it serves and its module."""

    name: str
    pipeline_classes: tuple[str, ...]
    module: str  # import path of the module that implements it
    encoding: str  # the diffprep.encodings name of its pre-encoded datasets (Energon subflavor)

    def load_module(self):
        import importlib

        return importlib.import_module(self.module)


FAMILIES: tuple[Family, ...] = (
    Family("flux", ("FluxPipeline",), "diffprep.families.flux", "preencoded"),
    Family("wan", ("WanPipeline",), "diffprep.families.wan", "wan"),
    Family("ltx2", (), "diffprep.families.ltx2", "ltx2"),  # a single-file checkpoint (ltx2_checkpoint), no index
    Family("sd-vae", (), "diffprep.families.sd_vae", "sd_vae"),  # a VAE folder alone: its config.json tells it
)
# The sections of an LTX-2 checkpoint's metadata config that make it one (its video and audio VAEs).
LTX2_CONFIG_SECTIONS = ("vae", "audio_vae")
_HEADER_LIMIT = 100 * 2**20  # a safetensors JSON header larger than this is not one


def safetensors_config(path: str | Path) -> dict[str, Any] | None:
    """The JSON ``config`` entry of a ``.safetensors`` file's metadata (the header alone is read); None if it has
    none or the file is not a safetensors file."""
    try:
        with open(path, "rb") as handle:
            (size,) = struct.unpack("<Q", handle.read(8))
            if not 0 < size <= _HEADER_LIMIT:
                return None
            header = json.loads(handle.read(size))
        config = json.loads((header.get("__metadata__") or {}).get("config") or "null")
    except (OSError, struct.error, ValueError, AttributeError):
        return None
    return config if isinstance(config, dict) else None


def ltx2_checkpoint(model_path: str | Path) -> Path | None:
    """The LTX-2 checkpoint ``model_path`` is, or the one folder ``model_path`` holds at its top; None if neither.

    A checkpoint is a ``.safetensors`` file whose metadata ``config`` has the
    video and audio VAE sections (what ltx-core's loader builds them from).
    Two checkpoints in one folder are refused: say which with the file's path.
    """
    path = Path(model_path).expanduser()
    candidates = [path] if path.is_file() else sorted(path.glob("*.safetensors")) if path.is_dir() else []
    found = [p for p in candidates if all(k in (safetensors_config(p) or {}) for k in LTX2_CONFIG_SECTIONS)]
    if len(found) > 1:
        raise ConfigError(f"{path} holds {len(found)} LTX-2 checkpoints ({', '.join(p.name for p in found)}); "
                          "pass the one to use as --model-path")
    return found[0] if found else None


def get_family(name: str) -> Family:
    """The family called ``name``; unknown names are refused with the list of known ones."""
    for family in FAMILIES:
        if family.name == name:
            return family
    raise ConfigError(f"unknown model family {name!r}; known families: {', '.join(f.name for f in FAMILIES)}")


def family_for_class(class_name: str) -> Family:
    """The family serving the diffusers pipeline class ``class_name`` (``WanPipeline`` -> wan)."""
    for family in FAMILIES:
        if class_name in family.pipeline_classes:
            return family
    known = ", ".join(f"{cls} ({f.name})" for f in FAMILIES for cls in f.pipeline_classes)
    raise ConfigError(
        f"model_index.json names pipeline class {class_name!r}, which diffprep does not support; known: {known}"
    )


def detect_family(model: str | Path | Mapping[str, Any]) -> Family:
    """The family of a model: a local folder holding ``model_index.json``, or that file's parsed content."""
    if isinstance(model, Mapping):
        index = model
    else:
        path = Path(model).expanduser() / MODEL_INDEX
        if not path.is_file():
            raise ConfigError(
                f"{path} does not exist: cannot tell the model family. Point model_path at a diffusers model folder "
                f"or pass --family ({', '.join(f.name for f in FAMILIES)})"
            )
        try:
            index = json.loads(path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{path} is not valid JSON: {exc}") from None
    class_name = index.get("_class_name") if isinstance(index, Mapping) else None
    if not isinstance(class_name, str):
        raise ConfigError(f"{MODEL_INDEX} has no _class_name string; cannot tell the model family")
    return family_for_class(class_name)


def family_of_model(model_path: str, family: str | None = None, *, revision: str | None = None,
                    token: str | None = None) -> Family:
    """The family a run encodes with: ``family`` when given, else what ``model_path`` holds.

    A folder (or hub repo) with ``model_index.json`` is the family of its
    pipeline class; a local LTX-2 checkpoint (the file, or a folder holding
    one) is LTX-2; a folder (or hub repo) whose root ``config.json`` is a
    4-channel ``AutoencoderKL`` is sd-vae (``stabilityai/sd-vae-ft-mse`` has no
    index). A hub repo's two root files are fetched alone (or read from the
    cache) through :mod:`diffprep.families.hub`. Anything else, or a hub repo whose
    files cannot be fetched, is Flux: the layout diffprep read before families
    existed (its own loader then says what is missing, or why the hub refused).
    """
    if family is not None:
        return get_family(family)
    folder = Path(model_path).expanduser()
    if folder.is_dir() and (folder / MODEL_INDEX).is_file():
        return detect_family(folder)
    if (folder.is_dir() or folder.is_file()) and ltx2_checkpoint(folder) is not None:
        return get_family("ltx2")
    from diffprep.families.sd_vae import CONFIG, is_sd_vae_folder

    if is_sd_vae_folder(folder):
        return get_family("sd-vae")
    if folder.exists():
        return get_family("flux")
    try:
        from diffprep.families.hub import hub_root_files

        snapshot = hub_root_files(model_path, [MODEL_INDEX, CONFIG], revision=revision, token=token)
    except Exception:  # noqa: BLE001 - offline, gated or not a repo: the Flux resolver reports the real problem
        return get_family("flux")
    if (snapshot / MODEL_INDEX).is_file():
        return detect_family(snapshot)
    return get_family("sd-vae") if is_sd_vae_folder(snapshot) else get_family("flux")
