"""Reproducible tar shards with a commit point, and the per-unit manifest.

(Over 400 lines on purpose: the shard writer, the manifest it commits and the readers that check both
are one on-disk format, read together.)

A shard is written under ``<out>/.diffprep/tmp/``, flushed, fsynced and
renamed into place; then its manifest is written the same way. The manifest
is the commit point: a unit without one is not done, whatever files exist.
Tar members carry fixed metadata (mtime 0, uid/gid 0, no user names), and
samples are written in key order with their fields sorted, so the same
samples always give the same bytes.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import queue
import socket
import tarfile
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Mapping, Protocol

import numpy as np
import torch

from diffprep import contract
from diffprep.writer.links import no_link_below
# Re-exported: a shard read back (its keys, size and sha256) lives in shard_reading.py.
from diffprep.writer.shard_reading import ShardDigest, file_sha256, shard_digest, tar_keys  # noqa: F401

MEMBER_MODE = 0o444


def tensor_bytes(tensor: torch.Tensor) -> bytes:
    """``torch.save`` of one sample's tensor.

    The tensor is cloned first: a slice of a batch is a view, and saving a
    view writes the whole batch's storage.
    """
    return torch_bytes(tensor.detach().to("cpu").contiguous().clone())


def torch_bytes(obj: Any) -> bytes:
    """``torch.save`` to bytes (tensors, or dicts and lists of them: loadable with weights_only=True)."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def json_bytes(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


def field_bytes(value: Any) -> bytes:
    """Bytes of one sample field, chosen by the value's type."""
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode("utf-8")
    if isinstance(value, torch.Tensor):
        return tensor_bytes(value)
    if isinstance(value, tuple):  # a tuple of tensors (FastGen's Flux condition), each cloned out of its batch
        if not all(isinstance(item, torch.Tensor) for item in value):
            raise TypeError(f"a tuple field must hold tensors only, got {[type(item).__name__ for item in value]}")
        return torch_bytes(tuple(item.detach().to("cpu").contiguous().clone() for item in value))
    if isinstance(value, (dict, list)):
        return json_bytes(value)
    raise TypeError(f"cannot store a {type(value).__name__} in a shard; use bytes, str, dict, a tensor or a tuple "
                    "of tensors")


def npy_bytes(tensor: torch.Tensor) -> bytes:
    """A tensor as a float32 ``.npy`` file (numpy's own format: the header keeps shape and dtype; no pickle)."""
    buffer = io.BytesIO()
    np.save(buffer, tensor.detach().to("cpu", torch.float32).numpy(), allow_pickle=False)
    return buffer.getvalue()


TEMP_SUFFIX = ".tmp"


def temp_name(name: str) -> str:
    """``<name>.<host>.<pid>.tmp``: whose temporary file this is, so a later run can tell a dead writer's leftovers."""
    return f"{name}.{socket.gethostname()}.{os.getpid()}{TEMP_SUFFIX}"


def temp_pid(name: str, host: str) -> int | None:
    """The pid in a temporary file name made by :func:`temp_name` on ``host``; None for any other name."""
    if not name.endswith(TEMP_SUFFIX):
        return None
    rest, _, pid = name[: -len(TEMP_SUFFIX)].rpartition(".")
    return int(pid) if pid.isdigit() and rest.endswith("." + host) else None


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file, fsync and rename."""
    path = Path(path)
    tmp = path.with_name("." + temp_name(path.name))
    with open(tmp, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def json_file_bytes(value: Any) -> bytes:
    """A state file's JSON: indented, keys sorted, UTF-8, a final newline."""
    return (json.dumps(value, indent=1, sort_keys=True, ensure_ascii=False) + "\n").encode("utf-8")


def atomic_write_json(path: Path, value: Any) -> None:
    atomic_write_bytes(path, json_file_bytes(value))


class ShardSink(Protocol):
    """Where a shard's bytes also go as they are written (a bucket output's upload: diffprep.output.upload)."""

    def write(self, data: bytes) -> None: ...

    def abort(self) -> None: ...


class _HashingFile(io.RawIOBase):
    """A write-only file that counts and hashes what passes through it, and hands it to a sink."""

    def __init__(self, handle, sink: ShardSink | None = None) -> None:
        self._handle = handle
        self._sink = sink
        self.sha256 = hashlib.sha256()
        self.size = 0

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        self._handle.write(data)
        if self._sink is not None:
            self._sink.write(bytes(data))
        self.sha256.update(data)
        self.size += len(data)
        return len(data)


@dataclass(frozen=True)
class ShardInfo:
    name: str
    count: int
    bytes: int
    sha256: str
    files: dict[str, int] | None = None  # a unit written as files (the LTX layout): path -> size


class ShardWriter:
    """Writes one unit's shard; ``commit()`` makes it visible, anything else leaves no trace.

    Use as a context manager: leaving the block without ``commit()`` (an
    exception, a KeyboardInterrupt) removes the temporary file. A ``sink``
    gets every byte as it is written too (and its ``abort()`` on an abort).
    """

    def __init__(self, out_dir: str | os.PathLike, unit: int, sink: ShardSink | None = None) -> None:
        self.out_dir = Path(out_dir)
        self.unit = unit
        self._sink = sink
        self.name = contract.shard_name(unit)
        tmp_dir = no_link_below(self.out_dir, self.out_dir / contract.STATE_DIR / contract.TMP_DIR)
        no_link_below(self.out_dir, self.out_dir / self.name)  # refused before a byte is encoded, not at the rename
        tmp_dir.mkdir(parents=True, exist_ok=True)
        self._tmp = tmp_dir / temp_name(self.name)
        self._handle = open(self._tmp, "wb")
        self._hashing = _HashingFile(self._handle, sink)
        # Plain USTAR-compatible headers; GNU format keeps long names if a caller ever needs them.
        self._tar = tarfile.open(fileobj=self._hashing, mode="w|", format=tarfile.GNU_FORMAT)
        self._keys: list[str] = []
        # (name, header offset, data offset, size) of every member, for finalize's Energon index (write_members).
        self._members: list[tuple[str, int, int, int]] = []
        self._done = False

    @property
    def keys(self) -> list[str]:
        return list(self._keys)

    def write(self, key: str, fields: Mapping[str, Any]) -> None:
        """Add one sample: ``fields`` maps extension (``latents.pth``...) to its value."""
        if "." in key or "/" in key or not key:
            raise ValueError(f"sample key {key!r} must be non-empty and contain no dots or slashes")
        if self._keys and key <= self._keys[-1]:
            raise ValueError(f"sample keys must be written in increasing order: {key!r} after {self._keys[-1]!r}")
        start = self._tar.offset
        for ext in sorted(fields):
            data = field_bytes(fields[ext])
            info = tarfile.TarInfo(f"{key}.{ext}")
            info.size = len(data)
            info.mtime = 0
            info.mode = MEMBER_MODE
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            self._tar.addfile(info, io.BytesIO(data))
            # The stream's offset is now past the member's data and its padding: where the data started follows.
            end = self._tar.offset
            data_at = end - -(-info.size // tarfile.BLOCKSIZE) * tarfile.BLOCKSIZE
            self._members.append((info.name, start, data_at, info.size))
            start = end
        self._keys.append(key)

    def commit(self) -> ShardInfo:
        """Close the tar, fsync it and rename it into ``<out>/``. A unit whose every sample was rejected writes no
        tar (``ShardInfo`` named ''): a loader that lists every ``.tar`` (FastGen) must never find an empty one."""
        if not self._keys:
            self.abort()
            return ShardInfo("", 0, 0, hashlib.sha256().hexdigest())
        end = self._tar.offset  # past the last member, before the end-of-archive blocks
        self._tar.close()
        self._handle.flush()
        os.fsync(self._handle.fileno())
        self._handle.close()
        final = no_link_below(self.out_dir, self.out_dir / self.name)
        os.replace(self._tmp, final)
        fsync_dir(self.out_dir)
        self._done = True
        info = ShardInfo(self.name, len(self._keys), self._hashing.size, self._hashing.sha256.hexdigest())
        write_members(self.out_dir, ShardMembers(info.name, info.bytes, info.sha256, end, self._members))
        return info

    def abort(self) -> None:
        if self._done:
            return
        self._done = True
        try:
            # Close the tar stream first: left open, it flushes into the closed file when collected.
            with contextlib.suppress(Exception):
                self._tar.close()
            self._handle.close()
        finally:
            self._tmp.unlink(missing_ok=True)
            if self._sink is not None:
                self._sink.abort()

    def __enter__(self) -> "ShardWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if not self._done:
            self.abort()


class BackgroundShardWriter(ShardWriter):
    """A ShardWriter whose ``write`` returns at once: one thread serializes the samples, in order.

    The encoders then work on the next batch while the previous one is cloned,
    saved, tarred and hashed (14.9 ms per sample at FLUX.1-dev sizes on a CPU
    host: benchmarks/README.md). First in, first out, so the bytes are the
    same as ShardWriter's. At most ``depth`` samples wait; an error in the
    thread is raised by the next ``write`` or by ``commit``.
    """

    def __init__(self, out_dir: str | os.PathLike, unit: int, sink: ShardSink | None = None,
                 depth: int = 64) -> None:
        super().__init__(out_dir, unit, sink)
        self._pending: queue.Queue = queue.Queue(maxsize=depth)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._drain, name=f"diffprep-writer-{unit}", daemon=True)
        self._thread.start()

    def _drain(self) -> None:
        while (item := self._pending.get()) is not None:
            if self._error is None:
                try:
                    ShardWriter.write(self, *item)
                except BaseException as exc:  # noqa: BLE001 - raised in the caller's thread
                    self._error = exc

    def _raise_error(self) -> None:
        if self._error is not None:
            raise self._error

    def _stop(self) -> None:
        if self._thread.is_alive():
            self._pending.put(None)
            self._thread.join()

    def write(self, key: str, fields: Mapping[str, Any]) -> None:
        self._raise_error()
        self._pending.put((key, dict(fields)))

    def commit(self) -> ShardInfo:
        self._stop()
        self._raise_error()
        return super().commit()

    def abort(self) -> None:
        self._stop()
        super().abort()


MEMBERS_VERSION = 1


@dataclass
class ShardMembers:
    """A shard's tar members as its writer wrote them (``.diffprep/members/NNNNNN.json``).

    The writer knows every member's offsets as it writes them; finalize turns them into Energon's index
    (``diffprep.run.energon_index``) instead of reading every tar's headers again. ``sha256`` and ``bytes`` tie the
    record to one write of the shard: a record whose digest is not the manifest's is ignored (that tar is read).
    """

    shard: str
    bytes: int
    sha256: str
    end: int  # the offset past the last member (where the end-of-archive blocks start)
    members: list[tuple[str, int, int, int]]  # (name, header offset, data offset, size), in tar order

    def to_json(self) -> dict:
        return {"version": MEMBERS_VERSION, "shard": self.shard, "bytes": self.bytes, "sha256": self.sha256,
                "end": self.end, "members": [list(member) for member in self.members]}

    @classmethod
    def from_json(cls, data: dict) -> "ShardMembers":
        return cls(data["shard"], data["bytes"], data["sha256"], data["end"],
                   [(name, int(at), int(data_at), int(size)) for name, at, data_at, size in data["members"]])


def members_path(out_dir: str | os.PathLike, shard: str) -> Path:
    return Path(out_dir) / contract.STATE_DIR / contract.MEMBERS_DIR / (shard.removesuffix(contract.SHARD_SUFFIX)
                                                                         + ".json")


def write_members(out_dir: str | os.PathLike, record: ShardMembers) -> None:
    path = no_link_below(Path(out_dir), members_path(out_dir, record.shard))
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(path, json.dumps(record.to_json(), separators=(",", ":")).encode("utf-8"))


def read_members(out_dir: str | os.PathLike, shard: str) -> ShardMembers | None:
    """The writer's record of a shard, or None when there is none (written before records existed) or it does not
    parse (a partial copy): the caller then reads the tar."""
    path = members_path(out_dir, shard)
    try:
        data = json.loads(path.read_bytes())
        if data.get("version") != MEMBERS_VERSION:
            return None
        return ShardMembers.from_json(data)
    except (OSError, ValueError, KeyError, TypeError):
        return None


@dataclass
class Reject:
    """One input sample that did not make it into a shard, and why."""

    source_id: str
    reason: str
    detail: str = ""
    phase: str = "decode"
    # The sample's input files when it was rejected (size and mtime, or ETag; the source's ``stamps``): a later
    # run retries the sample when they differ. None: the source cannot tell (never retried).
    stamp: str | None = None


@dataclass
class UnitManifest:
    """The commit record of a finished unit (``.diffprep/units/<unit>.json``)."""

    unit: int
    shard: str
    fingerprint: str
    keys: list[str]
    source_ids: list[str]
    count: int
    bytes: int
    sha256: str
    rejects: list[Reject] = field(default_factory=list)
    notes: dict[str, int] = field(default_factory=dict)  # counted but kept: empty captions, truncated captions...
    version: int = contract.CONTRACT_VERSION
    # A unit written as files instead of a shard (--layout ltx): every file, relative to the output, and its size.
    files: dict[str, int] | None = None
    # The written samples' input files when they were read (the source's ``stamps``), kept by runs whose clips have
    # other inputs (masks, sound files, reference audio): a later run encodes the unit again when one changed.
    stamps: dict[str, str] | None = None

    @property
    def inputs(self) -> int:
        return self.count + len(self.rejects)

    @property
    def has_shard(self) -> bool:
        """Whether the unit wrote a shard (not when every sample was rejected, nor a unit written as files)."""
        return bool(self.shard)

    def to_json(self) -> dict:
        data = asdict(self)
        for name in ("files", "stamps"):  # a shard's manifest exactly as before they existed
            if data[name] is None:
                del data[name]
        for reject in data["rejects"]:
            if reject["stamp"] is None:
                del reject["stamp"]
        return data

    @classmethod
    def from_json(cls, data: dict) -> "UnitManifest":
        data = dict(data)
        data["rejects"] = [Reject(**r) for r in data.get("rejects", [])]
        return cls(**data)


@dataclass
class StoredSample:
    """One sample as it is in its shard: the raw bytes of every field."""

    key: str
    shard: str
    fields: dict[str, bytes]

    @property
    def meta(self) -> dict[str, Any]:
        data = self.fields.get(contract.META, self.fields.get(contract.RAW_VIDEO_META))
        return json.loads(data) if data else {}

    @property
    def caption(self) -> str:
        data = self.fields.get(contract.CAPTION, self.fields.get(contract.RAW_CAPTION, b""))
        return data.decode("utf-8", errors="replace")


def manifest_path(out_dir: str | os.PathLike, unit: int) -> Path:
    return Path(out_dir) / contract.STATE_DIR / contract.UNITS_DIR / contract.unit_manifest_name(unit)


def write_manifest(out_dir: str | os.PathLike, manifest: UnitManifest) -> Path:
    path = no_link_below(Path(out_dir), manifest_path(out_dir, manifest.unit))
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(path, manifest.to_json())
    return path


def read_manifest(out_dir: str | os.PathLike, unit: int) -> UnitManifest | None:
    path = manifest_path(out_dir, unit)
    if not path.is_file():
        return None
    return UnitManifest.from_json(json.loads(path.read_text(encoding="utf-8")))


def read_manifests(out_dir: str | os.PathLike) -> dict[int, UnitManifest]:
    folder = Path(out_dir) / contract.STATE_DIR / contract.UNITS_DIR
    manifests = {}
    if folder.is_dir():
        for path in sorted(folder.glob("*.json")):
            manifest = UnitManifest.from_json(json.loads(path.read_text(encoding="utf-8")))
            manifests[manifest.unit] = manifest
    return manifests


# --- reading tensors back ------------------------------------------------------------------------


class SampleLoadError(ValueError):
    """A field of a sample cannot be decoded; the message names the sample key and the field."""


def _load_failure_reason(error: Exception) -> str:
    """The specific line of a torch.load error.

    weights_only refusals open with generic advice to retry with
    weights_only=False, which is exactly what must not be done with a file
    from a shard; keep only what was refused.
    """
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    if lines and lines[0].startswith("Weights only load failed"):
        lines = [
            line.split("WeightsUnpickler error:", 1)[-1].strip()
            for line in lines[1:]
            if not line.startswith("Check the documentation")
        ]
        lines = [line for line in lines if line]
    reason = " ".join(lines) or type(error).__name__
    return reason if len(reason) <= 300 else reason[:300] + "…"


def _load_weights(data: bytes, key: str, field: str) -> Any:
    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as error:
        raise SampleLoadError(
            f"sample {key!r} field {field!r} is not a plain tensor file: torch.load(weights_only=True) refused it "
            f"({_load_failure_reason(error)}); never load it with weights_only=False, it may run code"
        ) from error


def load_tensor(data: bytes, *, key: str = "?", field: str = "?") -> torch.Tensor:
    """Decode a ``torch.save``d tensor without unpickling arbitrary objects."""
    value = _load_weights(data, key, field)
    if not isinstance(value, torch.Tensor):
        raise SampleLoadError(f"sample {key!r} field {field!r} holds a {type(value).__name__}, expected a tensor")
    return value


def load_tensor_tuple(data: bytes, count: int, *, key: str = "?", field: str = "?") -> tuple[torch.Tensor, ...]:
    """Decode a ``torch.save``d tuple of ``count`` tensors (weights only)."""
    value = _load_weights(data, key, field)
    if not (isinstance(value, tuple) and len(value) == count and all(isinstance(v, torch.Tensor) for v in value)):
        kinds = [type(v).__name__ for v in value] if isinstance(value, (tuple, list)) else type(value).__name__
        raise SampleLoadError(f"sample {key!r} field {field!r} holds {kinds}, expected a tuple of {count} tensors")
    return value
