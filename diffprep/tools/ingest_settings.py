"""The settings of ``diffprep ingest`` (what to ingest, how to download it), apart from the encode settings.

Kept out of ``diffprep.config``: an ingest shares only the ``output`` and
``finalize`` sections with an encode; these are its own, as CLI flags
(``--manifest`` ...) or, from a Primus ``data diffusion-ingest`` config
(``--config``), its ``datasets``, ``empty_encodings`` and ``pipeline`` sections
(``diffprep.config.files.read_ingest_file`` reads them; ``load_ingest`` merges
them with the environment and the flags). Importing this module is cheap (the
CLI builds its parser from it).
"""

from __future__ import annotations

import argparse
import os
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from diffprep.errors import ConfigError

if TYPE_CHECKING:
    from diffprep.config import Settings


class IngestDataset(BaseModel):
    """One manifest of several ingested into one dataset, all its files in one split (Primus's ``datasets:``)."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$",
                      description="Names the dataset: its files' source ids are <name>/<file>.")
    manifest: str = Field(description="Its MLPerf manifest (<name>.uri / <name>.md5 / <name>).")
    split: Literal["train", "val", "test"] = Field(description="The Energon split every shard of it goes to.")


class IngestConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    manifest: str | None = Field(
        None, description="The MLPerf manifest: <name>.uri (base URL) next to <name>.md5 (md5 and file name per "
                          "line); give either file or <name>. http(s)://, file:// or a path.")
    datasets: list[IngestDataset] | None = Field(
        None, description="Several manifests into one dataset, each into its split (a config's datasets:); instead "
                          "of --manifest.")
    empty_encodings: str | None = Field(
        None, description="A manifest of the empty caption's encodings (t5_empty.npy, clip_empty.npy), downloaded "
                          "into <out>/empty_encodings/ as Primus reads them.")
    download_dir: str | None = Field(
        None, description="Where files wait for their unit (default <out>/.diffprep/downloads); each is removed once "
                          "its unit is committed.")
    prefetch_depth: int = Field(4, ge=1, le=256, description="Files on disk (or downloading) at most, ahead of the "
                                                             "unit being written.")
    download_workers: int = Field(2, ge=1, le=64, description="Downloads at a time.")
    retries: int = Field(5, ge=0, le=50, description="Retries of a failed download (network errors, HTTP 429/5xx, "
                                                     "an md5 mismatch), with exponential backoff.")
    backoff_s: float = Field(1.0, ge=0, le=600, description="First retry delay in seconds; doubles each retry.")
    timeout_s: float = Field(300.0, gt=0, le=86400, description="Seconds without data before a download fails.")
    max_files: int | None = Field(None, ge=1, description="Ingest only the first N files of the manifest (a test); "
                                                          "with datasets, of each dataset's manifest.")

    @model_validator(mode="after")
    def _one_listing(self) -> "IngestConfig":
        if self.manifest is not None and self.datasets is not None:
            raise ValueError("give --manifest or a config's datasets, not both: the datasets name their manifests")
        if self.manifest is None and self.datasets is None:
            raise ValueError("nothing to ingest: pass --manifest, or --config with a datasets list")
        if self.datasets is not None:
            if not self.datasets:
                raise ValueError("datasets lists no dataset")
            names = [d.name for d in self.datasets]
            twice = sorted({n for n in names if names.count(n) > 1})
            if twice:
                raise ValueError(f"dataset names must be unique: {twice} given twice")
        return self


# flag -> IngestConfig field
INGEST_FLAGS = {
    "--manifest": "manifest",
    "--empty-encodings": "empty_encodings",
    "--download-dir": "download_dir",
    "--prefetch-depth": "prefetch_depth",
    "--download-workers": "download_workers",
    "--retries": "retries",
    "--backoff-s": "backoff_s",
    "--timeout-s": "timeout_s",
    "--max-files": "max_files",
}
SECTION = "ingest"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ingest flags, stored under ``ingest.<field>`` (``overrides_from`` puts them in their own section)."""
    for flag, key in INGEST_FLAGS.items():
        info = IngestConfig.model_fields[key]
        parser.add_argument(flag, dest=f"{SECTION}.{key}", default=argparse.SUPPRESS,
                            help=(info.description or "").replace("%", "%%"))


def ingest_config(values: dict[str, Any]) -> IngestConfig:
    try:
        return IngestConfig(**values)
    except ValidationError as error:
        lines = [f"{'.'.join(map(str, e['loc'])) or 'ingest'}: {e['msg']} (got {e.get('input')!r})"
                 for e in error.errors()]
        raise ConfigError("invalid ingest settings:\n  " + "\n  ".join(lines)) from None


# The settings an ingest config file may hold besides the ingest's own sections (the ones `diffprep ingest` uses).
FILE_SETTINGS: dict[str, tuple[str, ...]] = {
    "output": ("output_dir", "s3_endpoint_url", "s3_profile", "on_existing", "accept_rejects", "approval_timeout"),
    "finalize": ("enabled", "train_split", "shuffle_seed", "workers", "on_split_change"),
}


def load_ingest(path: str | os.PathLike | None, overrides: dict[str, dict[str, Any]],
                flags: dict[str, Any]) -> tuple[Settings, IngestConfig]:
    """The settings and the ingest of a run: defaults < the config file at ``path`` < ``DIFFPREP_*`` variables <
    ``overrides`` (the flags' settings), and the file's ingest sections < ``flags`` (the ingest flags)."""
    from diffprep.config import load_settings
    from diffprep.config.files import read_ingest_file

    sections, from_file = read_ingest_file(path, FILE_SETTINGS) if path else ({}, {})
    if "datasets" in from_file and "manifest" in flags:
        raise ConfigError(f"{path} lists the datasets to ingest, and --manifest names another: remove --manifest, "
                          "or run without --config")
    config = ingest_config(from_file | flags)
    # A value of the file's is taken only where neither a DIFFPREP_* variable nor a flag set it.
    given = load_settings(None, overrides)
    merged = {name: {key: value for key, value in values.items()
                     if key not in getattr(given, name).model_fields_set} | overrides.get(name, {})
              for name, values in sections.items()}
    settings = load_settings(None, {**overrides, **merged}) if sections else given
    return settings, config


__all__ = ["FILE_SETTINGS", "INGEST_FLAGS", "IngestConfig", "IngestDataset", "add_arguments", "ingest_config",
           "load_ingest"]
