"""What a committed shard's bytes say about it, with nothing imported but the standard library.

``shard_facts`` is what audit needs of a committed shard: its size (a stat), and where the size is right its
sha256 (one read, no Python per member). A shard whose size and digest are its manifest's holds exactly the
bytes the writer committed, and so exactly the manifest's keys and fields: its tar headers are parsed only
where they are not (to say what changed). A plain function of a path, in a module that imports no torch, so
that a process pool's workers start in a fraction of a second.
"""

from __future__ import annotations

import hashlib
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any


def tar_keys(path: str | Path) -> dict[str, list[str]]:
    """Sample keys of a tar and the fields of each, from its headers (as ``diffprep.writer.shards.tar_keys``)."""
    samples: dict[str, list[str]] = {}
    with tarfile.open(path, mode="r:") as tar:
        for member in tar:
            if member.isfile():
                key, _, ext = member.name.partition(".")
                samples.setdefault(key, []).append(ext)
    return samples


@dataclass(frozen=True)
class ShardFacts:
    """A committed shard as audit finds it: its size, and its sha256 and tar keys where they were needed."""

    size: int | None  # None: the file is missing
    sha256: str | None = None  # read only when the size is the manifest's
    keys: dict[str, list[str]] | None = None  # tar headers, parsed only when size or digest differ
    error: str | None = None  # why the headers could not be read

    def trusted(self, manifest: Any) -> bool:
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



__all__ = ["ShardFacts", "sha256_of", "shard_facts", "tar_keys"]
