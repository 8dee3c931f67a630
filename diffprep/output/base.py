"""What every output offers, whether a local folder or a bucket prefix (``diffprep.output.s3``).

Every phase works in ``output.local``, the output's working folder: the
output itself for a folder, a staging folder for a bucket prefix. Shards and
indexes are read where they are (``open``, ``size``); the state folder
through ``output.state`` (``diffprep.output.state.StateStore``); a unit is
committed by ``commit_unit`` only; ``committed_units`` is the one answer to
"which units are done".
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator, Mapping
from dataclasses import replace
from pathlib import Path
from typing import IO, Any, NamedTuple

from diffprep.output.locks import OutputLock, pid_alive
from diffprep.output.state import Manifests, StateStore
from diffprep.writer.links import no_link_below
from diffprep.writer.shards import (
    ShardDigest,
    ShardSink,
    UnitManifest,
    atomic_write_bytes,
    shard_digest,
    tar_keys,
    temp_pid,
    write_manifest,
)


CHECKED_AT_ONCE = 1024  # manifests whose shards are checked together (a bucket's in parallel), reduced to their facts


class CommittedUnits(NamedTuple):
    done: Manifests  # unit -> manifest (read when asked, one at a time): committed, shard as written
    damaged: list[int]  # committed once, but the shard is missing or another size now: to be redone


def shard_facts_of(manifest: UnitManifest) -> UnitManifest:
    """The manifest without its per-sample lists (keys, source ids, rejects, stamps): what checking its shard
    needs (unit, shard, size, digest, fingerprint, files), a few hundred bytes however many samples it holds."""
    return replace(manifest, keys=[], source_ids=[], rejects=[], notes={}, stamps=None)


class Output:
    """A local output folder; the base of every output (see the module docstring)."""

    remote = False

    def __init__(self, path: str | os.PathLike) -> None:
        self.local = Path(path).expanduser().resolve()
        self.uri = str(self.local)
        self.state = StateStore(self)
        self.credentials_block: str | None = None  # the S3 credentials block it was opened with (by name)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.uri!r})"

    # -- reading --------------------------------------------------------------------------------------------------
    def exists(self) -> bool:
        return self.local.exists()

    def entries(self) -> list[str]:
        """Top-level names: files and folders, ours and foreign."""
        return sorted(os.listdir(self.local)) if self.local.is_dir() else []

    def files(self) -> list[str]:
        """Every file below the output, ours and foreign, as ``/``-separated paths relative to it (a link is a
        file: it is listed, never followed)."""
        return self.listing()[0]

    def links(self) -> list[str]:
        """Every symbolic link below the output (files and folders), never followed: none is the output's own, and
        nothing is written, renamed or removed through one (``diffprep.validation.ownership``)."""
        return self.listing()[1]

    def listing(self) -> tuple[list[str], list[str]]:
        """``files()`` and ``links()`` in one walk of the working folder (a bucket: its objects, and the links of
        its staging folder)."""
        files: list[str] = []
        links: list[str] = []
        pending = [self.local] if self.local.is_dir() else []
        while pending:
            try:
                scan = os.scandir(pending.pop())
            except OSError:  # a folder that cannot be read is skipped, as os.walk does
                continue
            with scan:
                for entry in scan:
                    relative = Path(entry.path).relative_to(self.local).as_posix()
                    if entry.is_symlink():
                        files.append(relative)
                        links.append(relative)
                    elif entry.is_dir():
                        pending.append(Path(entry.path))
                    else:
                        files.append(relative)
        return sorted(files), sorted(links)

    def writable(self, relative: str) -> Path:
        """Where the file ``relative`` is written, once no folder or file on its way is a symbolic link
        (``LinkInOutputError`` otherwise): every write and removal of the output goes through here."""
        return no_link_below(self.local, self.local / relative)

    def size(self, name: str) -> int | None:
        """Size of the top-level file ``name``; None when there is none."""
        path = self.local / name
        return path.stat().st_size if path.is_file() else None

    def open(self, name: str) -> IO[bytes]:
        """A forward-only binary stream of the file ``name`` (a shard, an index)."""
        return open(self.local / name, "rb")

    def shard_keys(self, name: str) -> dict[str, list[str]]:
        """Sample keys of the shard ``name`` and the fields of each (tar headers)."""
        return tar_keys(self.local / name)

    def shard_digest(self, name: str) -> ShardDigest:
        """Size, sha256 and sample keys (with their fields) of the shard ``name``, in one read."""
        with self.open(name) as stream:
            return shard_digest(stream)

    def total_bytes(self) -> int:
        total = 0
        for root, _dirs, files in os.walk(self.local):
            for name in files:
                with contextlib.suppress(OSError):
                    total += os.lstat(os.path.join(root, name)).st_size
        return total

    def link(self) -> str:
        return self.local.as_uri()

    def working_copy(self) -> Path:
        """The working folder, its state and Energon metadata in step with the output's (``output.state``)."""
        self.state.ensure_current()
        return self.local

    # -- units ----------------------------------------------------------------------------------------------------
    def shard_intact(self, manifest: UnitManifest) -> bool:
        """Whether the shard a manifest records is there as written (size; the hash is checked by validate); a
        unit written as files (the LTX layout): every file at its size."""
        if manifest.files is not None:
            return all(self.size(name) == size for name, size in manifest.files.items())
        if not manifest.has_shard:  # every sample rejected: nothing was written
            return manifest.count == 0
        return self.size(manifest.shard) == manifest.bytes

    def committed_units(self, fingerprint: str, manifests: Mapping[int, UnitManifest] | None = None
                        ) -> CommittedUnits:
        """The one answer to "what is done": the units committed for ``fingerprint`` whose shard is intact, and
        those whose manifest's shard is missing or changed. ``manifests``: the state's (``state.manifests()``),
        when just listed. The manifests are read one at a time and only their shard's facts kept, checked
        ``CHECKED_AT_ONCE`` at a time: memory does not grow with the samples."""
        manifests = self.state.manifests() if manifests is None else manifests
        done: list[int] = []
        damaged: list[int] = []

        def check(batch: list[UnitManifest]) -> None:
            for manifest, ok in zip(batch, self._check_shards(batch)):
                (done if ok else damaged).append(manifest.unit)

        batch: list[UnitManifest] = []
        for manifest in manifests.values():
            if manifest.fingerprint == fingerprint:
                batch.append(shard_facts_of(manifest))
            if len(batch) >= CHECKED_AT_ONCE:
                check(batch)
                batch = []
        check(batch)
        return CommittedUnits(Manifests(self, done), damaged)

    def _check_shards(self, manifests: list[UnitManifest]) -> list[bool]:
        return [self.shard_intact(m) for m in manifests]

    def committed_unit(self, unit: int, fingerprint: str) -> UnitManifest | None:
        """One unit's answer (``committed_units``): its manifest when committed for ``fingerprint``, shard intact."""
        manifest = self.state.manifest(unit)
        if manifest is None or manifest.fingerprint != fingerprint or not self.shard_intact(manifest):
            return None
        return manifest

    def shard_sink(self, unit: int) -> ShardSink | None:
        """Where a shard's bytes also go while it is written (a bucket's upload); a folder needs none."""
        return None

    def commit_unit(self, manifest: UnitManifest, sink: ShardSink | None = None) -> None:
        """Commit a unit whose shard is in place: its manifest, written last, is the commit point."""
        write_manifest(self.local, manifest)

    # -- keeping the working folder in step (a folder is its own) --------------------------------------------------
    def sync_state(self) -> None:
        """Make the working copy of ``.diffprep`` and ``.nv-meta`` equal to the output's."""

    def sync_manifests(self) -> None:
        """Make the working copy of the unit manifests equal to the output's."""

    def pull_file(self, relative: str) -> None:
        """Make the working copy of one file of the output (a unit's sample list) equal to the output's."""

    def publish_file(self, relative: str) -> None:
        """A file just written in the working folder, made part of the output (a bucket uploads it)."""

    def write_file(self, relative: str, data: bytes) -> Path:
        """Write a small file of the output (metadata) atomically in the working folder, and publish it."""
        path = self.writable(relative)
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(path, data)
        self.publish_file(relative)
        return path

    # -- changing what exists (each only after an approval) -------------------------------------------------------
    def abort_stale_uploads(self) -> list[str]:
        """Uploads left unfinished by runs that died; a folder has none."""
        return []

    def remove(self, paths: list[str] | tuple[str, ...]) -> None:
        """Delete exactly the files ``paths`` (only after an approved overwrite: ``diffprep.validation.ownership`` says which
        are diffprep's), then the folders that removing them left empty; every other file stays."""
        folders = set()
        for relative in paths:
            path = self.writable(relative)
            path.unlink(missing_ok=True)
            folders.update(parent for parent in path.parents if parent != self.local and self.local in parent.parents)
        for folder in sorted(folders, key=lambda p: len(p.parts), reverse=True):
            with contextlib.suppress(OSError):  # not empty: a file that stays is in it
                folder.rmdir()
        self.state.reopened()

    def clear_dead_temp_files(self) -> list[str]:
        """Remove temporary files that writers on this host left when they died: never committed, never data.

        Looks under ``.diffprep`` of the working folder (temporary shards and
        state files); files of live processes and of other hosts stay.
        """
        host = socket.gethostname()
        removed = []
        if self.state.root.is_symlink():
            return []  # not ours to clean: the run refuses such an output (``diffprep.validation.ownership``)
        for root, _dirs, files in os.walk(self.state.root):
            for name in sorted(files):
                pid = temp_pid(name, host)
                if pid is None or pid_alive(pid):
                    continue
                path = Path(root) / name
                path.unlink(missing_ok=True)
                removed.append(str(path.relative_to(self.local)))
        return sorted(removed)

    def next_free(self, fingerprint: str | None = None) -> Output:
        """``<out>-v2``, ``-v3``...: the first that does not exist or is empty, or that this run's plan
        (``fingerprint``) already started: a run resumed after a question finds the folder it chose before."""
        version = 2
        while True:
            path = self.local.with_name(f"{self.local.name}-v{version}")
            if not path.is_symlink() and (candidate := Output(path)).free_for(fingerprint):
                return candidate  # a link of that name points at someone else's folder: not free
            version += 1

    def free_for(self, fingerprint: str | None) -> bool:
        """Nothing here, or the plan of ``fingerprint`` (a new-dir choice of this very run)."""
        if not self.exists():
            return True
        if not self.remote and not self.local.is_dir():
            return False  # a file of that name
        if not self.entries():
            return True
        plan = self.state.plan()
        return fingerprint is not None and plan is not None and plan.fingerprint == fingerprint

    @contextlib.contextmanager
    def energon_access(self) -> Iterator[Any]:
        """The path Energon opens the dataset by, valid inside the block; ``.nv-meta`` is in step after it."""
        yield self.local

    def lock(self, run: str | None, shard: int | None = None) -> contextlib.AbstractContextManager:
        """One run at a time per output (``diffprep.output.locks``), naming its holder."""
        return OutputLock(self.local, run, shard=shard)


LocalOutput = Output

__all__ = ["CommittedUnits", "LocalOutput", "Output"]
