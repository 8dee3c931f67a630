"""A unit written as a trainer's own files instead of a shard (the LTX trainer's records, GAE's scene folders).

``UnitFilesWriter`` writes each file atomically under the output's root, remembers what it wrote, and commits
the list (with sizes and one digest over names and contents) as the unit's ``ShardInfo`` for its manifest, the
commit point. A unit that does not commit removes its files: without a manifest none of them is data.
``save_report`` is how such a layout's validation report is kept, as a shard dataset's is.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from typing import Any

from diffprep import contract
from diffprep.writer.links import no_link_below
from diffprep.writer.shards import ShardInfo, atomic_write_bytes


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
        path = no_link_below(self.root, self.root / relative)
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
            no_link_below(self.root, self.root / relative).unlink(missing_ok=True)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if not self._done:
            self.abort()


def save_report(output: Any, checks: list, summary: dict[str, Any], audit: dict[str, Any] | None) -> Any:
    """The validation report of an output written as files (``.diffprep/validation.json``): ``checks``, and the
    ``summary`` with the audit's rejects when there was an audit."""
    from diffprep.report.validation import ValidationReport

    if audit:
        summary["rejects"] = {key: audit[key] for key in ("inputs", "rejected", "by_reason")}
    report = ValidationReport(out_dir=output.uri, ok=all(c.ok for c in checks), checks=checks, summary=summary)
    output.state.write_json(contract.VALIDATION_JSON, report.to_json())
    return report
