"""Energon's index of a bucket prefix built from the shard writer's records, as for a folder.

Energon's ``prepare_dataset`` over a bucket reads every shard back whole through the Multi-Storage Client: at
100M samples that is every byte of the dataset downloaded again, to learn the member offsets the writer knew as
it wrote them. A bucket output's commit uploads each shard's record (``.diffprep/members/``) before the manifest
that commits it (``diffprep.output.s3.S3Output.commit_unit``), so finalize indexes a bucket as it indexes a folder
(``diffprep.run.energon_index.build_index``): per shard its record (a HEAD, and a GET where this machine's staged
copy differs) and one 512-byte ranged GET of its last member's header, and its ``.tar.idx`` uploaded; the
``.nv-meta`` files are written in the staging folder, then uploaded. The requests run ``THREADS`` at a time, the
shards indexed in order.

A shard without a record matching its manifest (committed by an earlier diffprep) makes the whole index
Energon's prepare, as before (``NoRecord``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from itertools import islice
from typing import Any

from diffprep import contract
from diffprep.run.energon_index import NoRecord, tar_index_bytes
from diffprep.sources.storage import open_ranged
from diffprep.writer.shards import ShardMembers, members_path, read_members

THREADS = 16  # requests in flight: a bucket answers each in a round trip


def records_complete(output: Any, names: list[str]) -> bool:
    """Whether the bucket holds a writer's record for every shard in ``names`` (one listing, already made)."""
    objects = output.objects()
    return all(str(members_path("", name)) in objects for name in names)


class BucketShards:
    """The shards of a bucket prefix as ``build_index`` reads and indexes them (see the module docstring)."""

    reads_tars = False  # a shard without a record: NoRecord, and the caller runs Energon's prepare

    def __init__(self, output: Any) -> None:
        self.output = output
        self._pool = ThreadPoolExecutor(THREADS, thread_name_prefix="diffprep-index")
        self._uploads: list[Future] = []

    def __enter__(self) -> BucketShards:
        return self

    def __exit__(self, *exc: object) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    def where(self, name: str) -> str:
        return f"{self.output.uri}/{name}"

    def _fetch(self, name: str) -> tuple[ShardMembers | None, bytes | None]:
        relative = str(members_path("", name))
        self.output.pull_file(relative)
        record = read_members(self.output.local, name)
        if record is None or not record.members:
            return record, None
        with open_ranged(self.output.client, self.output.url_of(name), buffer=512) as stream:
            stream.seek(record.members[-1][1])
            return record, stream.read(512)

    def fetched(self, names: list[str]) -> Iterator[tuple[ShardMembers | None, bytes | None]]:
        """Each shard's record and its last member's header, fetched ``THREADS`` ahead, in the order of ``names``."""
        upcoming = iter(names)
        pending = deque(self._pool.submit(self._fetch, name) for name in islice(upcoming, 2 * THREADS))
        while pending:
            yield pending.popleft().result()
            if (name := next(upcoming, None)) is not None:
                pending.append(self._pool.submit(self._fetch, name))

    def write_index(self, name: str, offsets: list[int]) -> None:
        """The shard's ``.tar.idx`` (Energon's bytes: native uint64 offsets) uploaded beside it, in the background."""
        self._uploads.append(self._pool.submit(self.output.put_bytes, contract.index_name(name),
                                               tar_index_bytes(offsets)))
        if len(self._uploads) >= 4 * THREADS:
            self._drain(THREADS)

    def _drain(self, keep: int = 0) -> None:
        while len(self._uploads) > keep:
            self._uploads.pop(0).result()  # an upload that failed raises here

    def close(self) -> None:
        """Every ``.tar.idx`` uploaded (the first failure raised)."""
        self._drain()


def publish_metadata(output: Any) -> None:
    """The ``.nv-meta`` files ``build_index`` wrote in the staging folder, uploaded (``dataset.yaml`` went up when it
    was written)."""
    meta = output.local / contract.NV_META
    for name in (contract.INDEX_SQLITE, contract.INDEX_UUID, contract.INFO_JSON, contract.INFO_YAML,
                 contract.SPLIT_YAML):
        if (meta / name).is_file():
            output.publish_file(f"{contract.NV_META}/{name}")


__all__ = ["BucketShards", "NoRecord", "THREADS", "publish_metadata", "records_complete"]
