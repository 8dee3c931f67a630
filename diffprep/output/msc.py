"""How Energon reads a bucket output: a Multi-Storage Client profile diffprep writes (endpoint and region, no secret).

The profile, ``.diffprep/msc_config.yaml``, is kept with the dataset for
training jobs elsewhere. Each access of diffprep's own gets a fresh storage
client under a profile name of its own: Energon's prepare forks its workers
with the parent's client, and a client that already holds open connections
would then be shared by several processes, their requests and answers mixed
on one socket.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

import yaml

from diffprep import contract
from diffprep.sources.storage import S3Url


class BucketOutput(Protocol):
    """What a Multi-Storage Client profile is made of (``diffprep.output.s3.S3Output``): the prefix's URL, its
    client, the endpoint and AWS profile it was opened with, and its state (where the profile file is kept)."""

    url: S3Url
    client: Any
    endpoint_url: str | None
    profile: str | None
    state: Any


def profile_name(output: BucketOutput) -> str:
    return f"diffprep-{output.url.bucket}"


def msc_config(output: BucketOutput) -> dict[str, Any]:
    """A Multi-Storage Client profile for the bucket: endpoint, region, AWS profile; credentials from the chain."""
    client = output.client
    options: dict[str, Any] = {"base_path": output.url.bucket}
    if client.meta.region_name:
        options["region_name"] = client.meta.region_name
    if output.endpoint_url:
        options["endpoint_url"] = output.endpoint_url
    elif client.meta.endpoint_url and "amazonaws.com" not in client.meta.endpoint_url:
        options["endpoint_url"] = client.meta.endpoint_url  # from AWS_ENDPOINT_URL
    if output.profile:
        options["profile_name"] = output.profile
    return {"profiles": {profile_name(output): {"storage_provider": {"type": "s3", "options": options}}}}


@contextlib.contextmanager
def energon_path(output: BucketOutput) -> Iterator[Any]:
    """The dataset as an Energon ``EPath`` on a profile of its own, valid inside the block."""
    from megatron.energon.epathlib import EPath

    config = msc_config(output)
    output.state.write_bytes(contract.MSC_CONFIG, yaml.safe_dump(config, sort_keys=False).encode("utf-8"))
    profile = f"{profile_name(output)}-{uuid.uuid4().hex[:12]}"
    private = config["profiles"][profile_name(output)]
    with tempfile.TemporaryDirectory(prefix="diffprep-msc-") as folder:
        own = Path(folder) / contract.MSC_CONFIG
        own.write_text(yaml.safe_dump({"profiles": {profile: private}}), encoding="utf-8")
        previous = os.environ.get("MSC_CONFIG")
        os.environ["MSC_CONFIG"] = str(own)
        try:
            yield EPath(f"msc://{profile}/{output.url.key}")
        finally:
            if previous is None:
                os.environ.pop("MSC_CONFIG", None)
            else:
                os.environ["MSC_CONFIG"] = previous
            _forget_client(profile)


def _forget_client(profile: str) -> None:
    """Drop the Multi-Storage Client's cached client of a finished access (best effort: a private cache)."""
    try:
        from multistorageclient import shortcuts

        shortcuts._STORAGE_CLIENT_CACHE.pop(profile, None)
    except (ImportError, AttributeError):
        pass


__all__ = ["energon_path", "msc_config", "profile_name"]
