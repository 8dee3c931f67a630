"""What can be checked on a run's settings alone, before anything starts or is written.

``diffprep encode`` runs these before it starts a Prefect server, loads an
encoder or touches the output (and a flow run does again, first thing), so
an error a user can act on comes at once and leaves nothing behind: a
missing input folder or metadata file, a token file others can read, a
device that is not here. Checks that need the source's listing or the
encoders (an impossible split against the planned shards, the encoders'
folders) are the plan phase's; nothing of a run is written before it
(plan.json is written when the output is prepared, after the plan).
"""

from __future__ import annotations

import os

from diffprep.config import Settings
from diffprep.errors import SourceError
from diffprep.storage import is_s3_url


def preflight(settings: Settings) -> None:
    """Raise the first problem found with ``settings`` that needs neither the source's listing nor a server."""
    _source_location(settings)
    from diffprep.hub import resolve_token

    resolve_token(settings.auth.hf_token_file)  # exists, owner-only, one word
    if settings.model.device != "auto":
        from diffprep.families.base import resolve_device

        resolve_device(settings.model.device)  # CUDA here, that device index


def _source_location(settings: Settings) -> None:
    source = settings.source
    if source.type == "directory" and source.input_dir and not is_s3_url(source.input_dir):
        root = os.path.abspath(os.path.expanduser(source.input_dir))
        if not os.path.isdir(root):
            what = "is a file" if os.path.exists(root) else "does not exist"
            raise SourceError(f"source.input_dir {source.input_dir!r} {what} (resolved to {root}); pass a folder "
                              "with images/ (or videos/) and captions/ (--input-dir)")
    if source.type == "metadata" and source.metadata_file and not is_s3_url(source.metadata_file):
        path = os.path.abspath(os.path.expanduser(source.metadata_file))
        if not os.path.isfile(path):
            what = "is a folder" if os.path.isdir(path) else "does not exist"
            raise SourceError(f"source.metadata_file {source.metadata_file!r} {what} (resolved to {path}); pass "
                              "a JSON, JSONL or CSV file (--metadata-file)")


__all__ = ["preflight"]
