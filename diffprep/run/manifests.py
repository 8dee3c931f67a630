"""The committed units' manifests, read one at a time, and what a committed shard's bytes say about it.

At 100M samples the manifests hold every sample's key and source id (~100k files of ~1000 of each): audit,
finalize and validation used to load all of them into one dict before looking at the first. ``Manifests``
is a read-only mapping unit -> manifest over the state folder that holds only the unit numbers (from the
file names) and reads a manifest when it is asked for, so a pass over it holds one manifest at a time.

``output_shard_facts`` is what audit needs of a committed shard (``diffprep.run.shard_facts``), for a folder or
a bucket prefix.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from diffprep.output import Output
from diffprep.run.shard_facts import ShardFacts, sha256_of, shard_facts
from diffprep.writer.shards import UnitManifest, read_manifest


class Manifests(Mapping[int, UnitManifest]):
    """Unit -> manifest, read from the state folder on demand (iteration in unit order, one manifest at a time).

    The units are listed once when it is made (a bucket's manifests synced then); a manifest that cannot be
    read raises as ``read_manifest`` does (ValueError, OSError) when it is reached.
    """

    def __init__(self, output: Output) -> None:
        self._output = output
        self._units = sorted(output.state.manifest_units())
        self._known = set(self._units)

    def __getitem__(self, unit: int) -> UnitManifest:
        manifest = read_manifest(self._output.local, unit) if unit in self._known else None
        if manifest is None:
            raise KeyError(unit)
        return manifest

    def __contains__(self, unit: object) -> bool:
        return unit in self._known

    def __iter__(self) -> Iterator[int]:
        return iter(self._units)

    def __len__(self) -> int:
        return len(self._units)


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


__all__ = ["Manifests", "output_shard_facts"]
