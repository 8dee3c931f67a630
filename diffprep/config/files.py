"""A YAML config file as diffprep reads it: variables expanded, then Primus's spellings taken.

Variables. Every string value in the file (in mappings and lists; keys are left
alone) has each ``${VAR}`` replaced by the environment variable VAR, and each
``${VAR:default}`` by VAR when it is set (even to the empty string), else by
``default`` -- the rule of Primus's YAML loader, so that its configs'
``${PRIMUS_DATA_ROOT:/workspace/Primus/data}/...`` work unchanged. An unset
VAR without a default is an error that names it and the key it is in. A value
that a replacement changed and that then reads as a whole as ``true``/``false``
(any case), an integer or a float becomes that bool or number, as there; a
value without a variable keeps its YAML type. Replacement is one pass: a
default that itself holds ``${...}`` is not expanded again (the settings then
refuse the ``${`` left in a path).

Primus's spellings (AMD-AGI/Primus ``data diffusion-encoded`` configs), each
mapped onto the diffprep setting it means:

- ``data_format.image_key`` / ``data_format.caption_key`` -> ``source.image_key`` / ``source.caption_key``.
- ``data_format.image_keys`` / ``data_format.caption_keys`` (fallback lists) win over the single key, as in
  Primus. diffprep reads one field per dataset, so a list must name one field (repeats are fine); a list of
  several is refused with the fix (name the one the dataset has, or leave it unset for detection).
- ``model.vae_latent_mode``: ``presampled`` -> ``model.latent_mode: sample``, ``resample`` -> ``posterior``.

A Primus name next to its diffprep name with another value is refused, naming both. A Primus
``data diffusion-ingest`` file (sections ``datasets``, ``empty_encodings``, ``pipeline``) is not an encode config:
it is refused with the command that runs it, ``diffprep ingest --config``, which reads it with
``read_ingest_file`` (its keys: ``INGEST_ALIASES``).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationInfo

from diffprep import contract
from diffprep.errors import ConfigError

# ${NAME} or ${NAME:default}: a name without ':', '{' or '}', a default without '}' (Primus's loader's rule).
VARIABLE = re.compile(r"\$\{(?P<name>[^:{}]+)(?::(?P<default>[^}]*))?\}")
# A plain decimal number: an optional minus, digits with at most one point, an optional exponent (no '+',
# spaces, underscores, inf or nan).
_NUMBER = re.compile(r"-?(?P<mantissa>\d*\.?\d*)(?P<exponent>[eE][+-]?\d+)?")


def _scalar(text: str) -> bool | int | float | str:
    """A replaced value that reads as a bool or a number as a whole becomes one (as Primus's loader does)."""
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    number = _NUMBER.fullmatch(text)
    if number is None or not any(char.isdigit() for char in number["mantissa"]):
        return text
    if "." in number["mantissa"] or number["exponent"]:
        return float(text)
    return int(text)


def expand_variables(value: Any, *, where: str = "", source: str = "config") -> Any:
    """``value`` with ``${VAR}`` / ``${VAR:default}`` replaced in every string it holds (see the module docstring).

    ``where`` is the dotted key of ``value`` and ``source`` the file, for the error of an unset variable.
    """
    if isinstance(value, dict):
        return {key: expand_variables(item, where=f"{where}.{key}" if where else str(key), source=source)
                for key, item in value.items()}
    if isinstance(value, list):
        return [expand_variables(item, where=f"{where}[{i}]", source=source) for i, item in enumerate(value)]
    if not isinstance(value, str):
        return value

    def replace(match: re.Match[str]) -> str:
        name, default = match.group("name"), match.group("default")
        if name in os.environ:
            return os.environ[name]
        if default is None:
            raise ConfigError(f"{source}: {where or 'the file'} uses ${{{name}}}, but the environment variable "
                              f"{name} is not set: set it, or give a default as ${{{name}:default}}")
        return default

    replaced = VARIABLE.sub(replace, value)
    return _scalar(replaced) if replaced != value else value


def load_yaml_file(path: str | os.PathLike) -> Any:
    """The YAML document in ``path`` with its variables expanded; a missing file or bad YAML is a ConfigError."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    return expand_variables(data, source=str(path))


def refuse_unexpanded(value: str | None, info: ValidationInfo) -> str | None:
    """A path setting's validator: ``${`` left in it (an unexpanded variable) would become a folder of that name."""
    if isinstance(value, str) and "${" in value:
        raise ValueError(f"{info.field_name} {value!r} still holds '${{', an unexpanded variable: diffprep expands "
                         "${VAR} and ${VAR:default} in config files; on a command line let the shell expand it "
                         "(double quotes), or write the path out")
    return value


# --- Primus's spellings -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Alias:
    """The diffprep setting a Primus key means."""

    section: str
    key: str

    @property
    def name(self) -> str:
        return f"{self.section}.{self.key}"


LATENT_MODES = {"presampled": "sample", "resample": "posterior"}
# (Primus section, Primus key) -> the diffprep setting. data_format is a section of its own in Primus.
ALIASES: dict[tuple[str, str], Alias] = {
    ("data_format", "image_key"): Alias("source", "image_key"),
    ("data_format", "caption_key"): Alias("source", "caption_key"),
    ("data_format", "image_keys"): Alias("source", "image_key"),
    ("data_format", "caption_keys"): Alias("source", "caption_key"),
    ("model", "vae_latent_mode"): Alias("model", "latent_mode"),  # its values: LATENT_MODES
}
ALIAS_SECTIONS = ("data_format",)
# Fallback lists and the single key they win over.
FALLBACK_LISTS = {"image_keys": "image_key", "caption_keys": "caption_key"}
INGEST_SECTIONS = ("datasets", "empty_encodings", "pipeline")


def alias_note(section: str) -> str:
    """The Primus spellings a section also takes, for the error that lists its valid keys ('' when none)."""
    names = [f"{key} (= {alias.name})" for (where, key), alias in ALIASES.items() if where == section]
    return f"; Primus's spellings: {', '.join(names)}" if names else ""


def _fallback(source: str, section: str, key: str, value: Any) -> str:
    """The one field a Primus fallback list names (empty entries skipped, as Primus never finds them)."""
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise ConfigError(f"{source}: {section}.{key} must be a list of field names, got {value!r}")
    keys = list(dict.fromkeys(item for item in value if item))
    single = FALLBACK_LISTS[key]
    if not keys:
        raise ConfigError(f"{source}: {section}.{key} is empty, so no sample would have a field to read: list the "
                          f"field, or remove {key} (and {single}) to let diffprep detect it")
    if len(keys) > 1:
        raise ConfigError(
            f"{source}: {section}.{key} lists several fallbacks {keys}; diffprep reads one field per dataset: set "
            f"{section}.{single} (diffprep: {ALIASES[(section, key)].name}, --{single.replace('_', '-')}) to the "
            f"one this dataset has, or remove both to let diffprep detect it"
        )
    return keys[0]


def _latent_mode(source: str, value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or value not in LATENT_MODES:
        raise ConfigError(f"{source}: model.vae_latent_mode must be one of {list(LATENT_MODES)} (Primus's names for "
                          f"model.latent_mode {' / '.join(LATENT_MODES.values())}), got {value!r}")
    return LATENT_MODES[value]


def _data_format(source: str, values: Any) -> list[tuple[str, Any]]:
    """(Primus key, value) of each field that ``data_format`` sets; a fallback list wins over its single key."""
    if values is None:
        return []
    if not isinstance(values, dict):
        raise ConfigError(f"{source}: section 'data_format' must be a mapping, got {type(values).__name__}")
    known = [key for (section, key) in ALIASES if section == "data_format"]
    unknown = [key for key in values if key not in known]
    if unknown:
        raise ConfigError(f"{source}: unknown key {unknown[0]!r} in section 'data_format' (Primus's field names); "
                          f"valid keys: {', '.join(known)}")
    given = []
    for many, single in FALLBACK_LISTS.items():
        if values.get(many) is not None:  # Primus reads the single key only when the list is null or absent
            given.append((many, _fallback(source, "data_format", many, values[many])))
        elif single in values:
            given.append((single, values[single] or None))  # '' and null: detected, as Primus reads them
    return given


def take_primus_spellings(data: dict[str, Any], source: str) -> dict[str, Any]:
    """``data`` (a config file's sections) with Primus's spellings replaced by the settings they mean."""
    ingest = [name for name in INGEST_SECTIONS if name in data]
    if ingest:
        raise ConfigError(
            f"{source} is a Primus `data diffusion-ingest` config (sections {', '.join(ingest)}): it converts "
            f"datasets that are already encoded, it does not encode. Run it with `diffprep ingest --config {source}`"
        )
    result = {name: dict(values) if isinstance(values, dict) else values
              for name, values in data.items() if name not in ALIAS_SECTIONS}
    given = [(("data_format", key), value) for key, value in _data_format(source, data.get("data_format"))]
    model = result.get("model")
    if isinstance(model, dict) and "vae_latent_mode" in model:
        given.append((("model", "vae_latent_mode"), _latent_mode(source, model.pop("vae_latent_mode"))))
    for (section, key), value in given:
        if value is None:  # unset: the default, or detection
            continue
        alias = ALIASES[(section, key)]
        if not isinstance(result.get(alias.section), dict):
            result[alias.section] = {}
        native = result[alias.section].get(alias.key)
        if native is not None and native != value:
            raise ConfigError(f"{source}: {section}.{key} (Primus's name for {alias.name}) means {alias.key}: "
                              f"{value!r}, but {alias.name} is {native!r}: keep one of the two")
        result[alias.section][alias.key] = value
    return result


# --- A Primus `data diffusion-ingest` file ----------------------------------------------------------------------------

# (Primus section, key) -> the diffprep ingest setting (``diffprep.tools.ingest_settings.IngestConfig``) it means.
INGEST_ALIASES: dict[tuple[str, str], str] = {
    ("empty_encodings", "manifest_url"): "empty_encodings",
    ("pipeline", "max_workers"): "download_workers",
    ("pipeline", "prefetch_depth"): "prefetch_depth",
    ("pipeline", "max_files"): "max_files",
}
# A datasets entry's keys -> the fields of diffprep.tools.ingest_settings.IngestDataset.
DATASET_KEYS = {"name": "name", "manifest_url": "manifest", "split_name": "split"}


def _mapping(source: str, where: str, value: Any, known: list[str]) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ConfigError(f"{source}: {where} must be a mapping of {', '.join(known)}, got {type(value).__name__}")
    unknown = [key for key in value if key not in known]
    if unknown:
        raise ConfigError(f"{source}: unknown key {unknown[0]!r} in {where}; valid keys: {', '.join(known)}")
    return value


def _datasets(source: str, value: Any) -> list[dict[str, Any]]:
    if not isinstance(value, list):
        raise ConfigError(f"{source}: datasets must be a list of {{{', '.join(DATASET_KEYS)}}}, got "
                          f"{type(value).__name__}")
    result = []
    for i, entry in enumerate(value):
        entry = _mapping(source, f"datasets[{i}]", entry, list(DATASET_KEYS))
        missing = [key for key in DATASET_KEYS if entry.get(key) is None]
        if missing:
            raise ConfigError(f"{source}: datasets[{i}] has no {', '.join(missing)} (each dataset needs "
                              f"{', '.join(DATASET_KEYS)})")
        result.append({DATASET_KEYS[key]: item for key, item in entry.items()})
    return result


def _empty_encodings(source: str, value: Any) -> str | None:
    """The empty encodings' manifest; they go where Primus's trainer finds them, ``<out>/empty_encodings/``."""
    if not value:  # null or {}: none, as Primus skips them
        return None
    keys = [key for section, key in INGEST_ALIASES if section == "empty_encodings"] + ["output_subdir"]
    value = _mapping(source, "section 'empty_encodings'", value, keys)
    subdir = value.get("output_subdir", contract.EMPTY_ENCODINGS_DIR)
    if subdir != contract.EMPTY_ENCODINGS_DIR:
        folder = contract.EMPTY_ENCODINGS_DIR
        raise ConfigError(f"{source}: empty_encodings.output_subdir is {subdir!r}; diffprep writes them into "
                          f"{folder!r}, where Primus's trainer finds them (<data_path>/{folder}) and an overwrite "
                          f"knows them as diffprep's: set it to {folder} or remove it")
    if value.get("manifest_url") is None:
        raise ConfigError(f"{source}: empty_encodings has no manifest_url (remove the section for none)")
    return value["manifest_url"]


def read_ingest_file(path: str | os.PathLike, settings: dict[str, tuple[str, ...]]
                     ) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    """A Primus ``data diffusion-ingest`` file (variables expanded): (its settings sections, each a mapping of the
    keys ``settings`` allows it, and its ingest settings by ``IngestConfig`` field name). Primus's ``datasets``,
    ``empty_encodings`` and ``pipeline`` sections are mapped (``INGEST_ALIASES``, ``DATASET_KEYS``); an unknown
    section or key is refused with the valid ones."""
    data = load_yaml_file(path)
    source = str(path)
    if data is None:
        return {}, {}
    ingest_sections = ("datasets", "empty_encodings", "pipeline")
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a mapping of sections ({', '.join([*ingest_sections, *settings])}), "
                          f"got {type(data).__name__}")
    sections: dict[str, dict[str, Any]] = {}
    ingest: dict[str, Any] = {}
    for section, values in data.items():
        if section == "datasets":
            ingest["datasets"] = _datasets(source, values)
        elif section == "empty_encodings":
            if (manifest := _empty_encodings(source, values)) is not None:
                ingest["empty_encodings"] = manifest
        elif section == "pipeline":
            keys = [key for where, key in INGEST_ALIASES if where == "pipeline"]
            for key, value in _mapping(source, "section 'pipeline'", values or {}, keys).items():
                if value is not None:  # null: the default (max_files: null = every file, as in Primus)
                    ingest[INGEST_ALIASES[("pipeline", key)]] = value
        elif section in settings:
            sections[section] = dict(_mapping(source, f"section {section!r}", values or {}, list(settings[section])))
        else:
            raise ConfigError(f"{source}: unknown section {section!r} in an ingest config; valid sections: "
                              f"{', '.join([*ingest_sections, *settings])}")
    return sections, ingest


# --- The whole file ---------------------------------------------------------------------------------------------------


def read_config(path: str | os.PathLike, sections: dict[str, type[BaseModel]]) -> dict[str, dict[str, Any]]:
    """A config file's sections, variables expanded and Primus's spellings taken; an unknown section or key
    (``sections``: name -> its settings model) is refused with the valid ones."""
    data = load_yaml_file(path)
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of sections ({', '.join(sections)}), got {type(data).__name__}")
    data = take_primus_spellings(data, str(path))
    for section, values in data.items():
        if section not in sections:
            raise ConfigError(f"{path}: unknown section {section!r}; valid sections: {', '.join(sections)}, and "
                              f"Primus's {', '.join(ALIAS_SECTIONS)}")
        if values is None:
            data[section] = {}
            continue
        if not isinstance(values, dict):
            raise ConfigError(f"{path}: section {section!r} must be a mapping, got {type(values).__name__}")
        known = sections[section].model_fields
        for key in values:
            if key not in known:
                raise ConfigError(f"{path}: unknown key {key!r} in section {section!r}; valid keys: "
                                  f"{', '.join(known)}{alias_note(section)}")
    return data


__all__ = ["ALIASES", "ALIAS_SECTIONS", "Alias", "DATASET_KEYS", "INGEST_ALIASES", "expand_variables",
           "load_yaml_file", "read_config", "read_ingest_file", "refuse_unexpanded", "take_primus_spellings"]
