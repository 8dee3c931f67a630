"""The settings of ``diffprep ingest`` (what to ingest, how to download it), apart from the encode settings.

Kept out of ``diffprep.config``: an ingest shares only the ``output`` and
``finalize`` sections with an encode; these are its own, as CLI flags
(``--manifest`` ...). Importing this module is cheap (the CLI builds its
parser from it).
"""

from __future__ import annotations

import argparse
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from diffprep.errors import ConfigError


class IngestConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    manifest: str = Field(description="The MLPerf manifest: <name>.uri (base URL) next to <name>.md5 (md5 and file "
                                      "name per line); give either file or <name>. http(s)://, file:// or a path.")
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
    max_files: int | None = Field(None, ge=1, description="Ingest only the first N files of the manifest (a test).")


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
        parser.add_argument(flag, dest=f"{SECTION}.{key}", default=argparse.SUPPRESS, required=flag == "--manifest",
                            help=(info.description or "").replace("%", "%%"))


def ingest_config(values: dict[str, Any]) -> IngestConfig:
    try:
        return IngestConfig(**values)
    except ValidationError as error:
        lines = [f"{'.'.join(map(str, e['loc']))}: {e['msg']} (got {e.get('input')!r})" for e in error.errors()]
        raise ConfigError("invalid ingest settings:\n  " + "\n  ".join(lines)) from None


__all__ = ["INGEST_FLAGS", "IngestConfig", "add_arguments", "ingest_config"]
