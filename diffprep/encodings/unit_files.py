"""A unit written as a trainer's own files instead of a shard (the LTX trainer's records, GAE's scene folders).

``UnitFilesWriter`` writes each file atomically under the output's root, remembers what it wrote, and commits
the list (with sizes and one digest over names and contents) as the unit's ``ShardInfo`` for its manifest, the
commit point. A unit that does not commit removes its files: without a manifest none of them is data.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from diffprep.shards import ShardInfo, atomic_write_bytes


class UnitFilesWriter:
    """The files of one unit; subclasses say which files a sample becomes (``write``) and which they refuse."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.files: dict[str, int] = {}
        self._digest = hashlib.sha256()
        self._count = 0
        self._done = False

    def put(self, relative: str, data: bytes) -> None:
        """Write ``data`` to ``<root>/<relative>`` atomically and list it."""
        path = self.root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(path, data)
        self.files[relative] = len(data)
        self._digest.update(f"{relative}\0{hashlib.sha256(data).hexdigest()}\n".encode())

    def sample_done(self) -> None:
        self._count += 1

    def commit(self) -> ShardInfo:
        self._done = True
        return ShardInfo(name="", count=self._count, bytes=sum(self.files.values()),
                         sha256=self._digest.hexdigest(), files=dict(sorted(self.files.items())))

    def abort(self) -> None:
        """Remove what this unit wrote: without its manifest, none of it is data."""
        self._done = True
        for relative in self.files:
            (self.root / relative).unlink(missing_ok=True)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if not self._done:
            self.abort()
