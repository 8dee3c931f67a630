"""The committed units' manifests, read one at a time, and what a committed shard's bytes say about it.

At 100M samples the manifests hold every sample's key and source id (~100k files of ~1000 of each): audit,
finalize and validation used to load all of them into one dict before looking at the first. ``Manifests`` (kept
in ``diffprep.output.state``, which ``output.state.manifests()`` returns, and named here for its readers) is a
read-only mapping unit -> manifest over the state folder that holds only the unit numbers (from the file names)
and reads a manifest when it is asked for, so a pass over it holds one manifest at a time.

``output_shard_facts`` is what audit needs of a committed shard: its size (a stat), and where the size is right
its sha256 (one read, hashed outside the GIL, no Python per member). A shard whose size and digest are its
manifest's holds exactly the bytes the writer committed, and so exactly the manifest's keys and fields: its tar
headers are parsed only where they are not (to say what changed).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from diffprep.output import Output
from diffprep.output.state import Manifests
from diffprep.writer.shards import UnitManifest, tar_keys


@dataclass(frozen=True)
class ShardFacts:
    """A committed shard as audit finds it: its size, and its sha256 and tar keys where they were needed."""

    size: int | None  # None: the file is missing
    sha256: str | None = None  # read only when the size is the manifest's
    keys: dict[str, list[str]] | None = None  # tar headers, parsed only when size or digest differ
    error: str | None = None  # why the headers could not be read

    def trusted(self, manifest: UnitManifest) -> bool:
        """The bytes the writer committed with this manifest (so its keys and fields are the manifest's)."""
        return self.size == manifest.bytes and self.sha256 == manifest.sha256


def sha256_of(stream: IO[bytes]) -> str:
    """The sha256 of a binary stream, read in large blocks (hashlib works outside the GIL on them)."""
    digest = hashlib.sha256()
    while block := stream.read(1 << 22):
        digest.update(block)
    return digest.hexdigest()


def shard_facts(path: str, size: int, sha256: str) -> ShardFacts:
    """Size and digest of the shard at ``path`` against its manifest's ``size`` and ``sha256``; the tar keys only
    where they differ. A local file (a bucket's shards go through ``Output``: see ``output_shard_facts``)."""
    file = Path(path)
    if not file.is_file():
        return ShardFacts(None)
    found = file.stat().st_size
    digest = None
    if found == size:
        with open(file, "rb") as stream:
            digest = sha256_of(stream)
        if digest == sha256:
            return ShardFacts(found, digest)
    try:
        keys = tar_keys(file)
    except Exception as exc:  # noqa: BLE001 - a damaged tar is a finding
        return ShardFacts(found, digest, None, f"{type(exc).__name__}: {exc}")
    return ShardFacts(found, digest, keys)



def output_shard_facts(output: Output, name: str, size: int, sha256: str) -> ShardFacts:
    """``shard_facts`` for a shard of any output (a bucket's read back from the bucket)."""
    if not output.remote:
        return shard_facts(str(output.local / name), size, sha256)
    found = output.size(name)
    if found is None:
        return ShardFacts(None)
    digest = None
    if found == size:
        with output.open(name) as stream:
            digest = sha256_of(stream)
        if digest == sha256:
            return ShardFacts(found, digest)
    try:
        keys = output.shard_keys(name)
    except Exception as exc:  # noqa: BLE001 - a damaged tar is a finding
        return ShardFacts(found, digest, None, f"{type(exc).__name__}: {exc}")
    return ShardFacts(found, digest, keys)


__all__ = ["Manifests", "ShardFacts", "output_shard_facts", "sha256_of", "shard_facts"]
