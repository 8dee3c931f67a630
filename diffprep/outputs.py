"""Where an output lives: a local folder, or an ``s3://bucket/prefix`` worked through a local staging folder.

Every phase works in ``output.local``. For a local output that is the output
itself. For a bucket prefix it is a staging folder (``$DIFFPREP_STAGING_DIR``,
default ``~/.cache/diffprep/staging``, then ``<bucket>/<prefix>``) that mirrors
the prefix's state (``.diffprep/`` and ``.nv-meta/``) and holds a shard only
from its writing until its upload. The bucket stays the truth:

- a shard goes up while it is written (``ObjectUpload``: a multipart upload,
  a part per ``MULTIPART_CHUNK``), so the upload overlaps the encoding;
- a unit is committed when its shard object is complete and checked (size,
  ETag) and then its manifest object is written, carrying the shard's ETag in
  its metadata; a shard object without a manifest object that vouches for
  exactly that object is not done, whatever it holds;
- ``pull_state`` makes the staged state equal to the bucket's before a phase
  reads it; ``push`` uploads what a phase wrote there;
- one run at a time per prefix: ``S3Lock``, a lock object created with a
  conditional PUT (``If-None-Match: *``) and kept alive by a heartbeat;
- Energon reads the prefix through a Multi-Storage Client profile that
  ``energon_access`` writes (``msc_config.yaml``: endpoint and region, no secret).

Shards, indexes and metadata are read back from the bucket (``open``), never
from a staged copy.
"""

from __future__ import annotations

import contextlib
import getpass
import hashlib
import json
import logging
import os
import re
import shutil
import socket
import tempfile
import threading
import uuid
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from email.utils import parsedate_to_datetime
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from diffprep import contract
from diffprep.errors import LockedError, SourceError
from diffprep.storage import (
    S3_SCHEME,
    ObjectChangedError,
    ObjectInfo,
    S3Url,
    has_glob_magic,
    is_s3_url,
    list_objects,
    open_object,
    parse_s3_url,
    read_object,
    s3_client,
    storage_error,
)

if TYPE_CHECKING:
    from diffprep.shards import ShardDigest, UnitManifest

log = logging.getLogger(__name__)

STAGING_ENV = "DIFFPREP_STAGING_DIR"
MULTIPART_CHUNK = 64 << 20  # part size, and the size from which uploads are multipart
UPLOAD_CONCURRENCY = 4
SHARD_ETAG_METADATA = "shard-etag"  # metadata of a manifest object: the ETag its shard object got
MSC_CONFIG_FILE = "msc_config.yaml"
LOCK_LEASE_S = 300.0  # a lock not refreshed for this long belongs to a dead run and may be taken over
_PULLED_STATE = (contract.PLAN_JSON, contract.SPLITS_JSON, contract.AUDIT_JSON, contract.VALIDATION_JSON)


def staging_root() -> Path:
    configured = os.environ.get(STAGING_ENV)
    if configured:
        return Path(configured).expanduser().resolve()
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "diffprep" / "staging"


def is_ours(name: str) -> bool:
    """Whether a top-level entry of an output is one diffprep writes (state, Energon metadata, shards, indexes)."""
    if name in (contract.NV_META, contract.STATE_DIR):
        return True
    if name.endswith(contract.INDEX_SUFFIX):
        name = name[: -len(".idx")]
    return contract.unit_of_shard(name) is not None


class Output:
    """A local output folder (see the module docstring for bucket prefixes)."""

    remote = False

    def __init__(self, path: str | os.PathLike) -> None:
        self.local = Path(path).expanduser().resolve()
        self.uri = str(self.local)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.uri!r})"

    # -- reading --------------------------------------------------------------------------------------------------
    def exists(self) -> bool:
        return self.local.exists()

    def entries(self) -> list[str]:
        """Top-level names: files and folders, ours and foreign."""
        return sorted(os.listdir(self.local)) if self.local.is_dir() else []

    def size(self, name: str) -> int | None:
        """Size of the top-level file ``name``; None when there is none."""
        path = self.local / name
        return path.stat().st_size if path.is_file() else None

    def open(self, name: str) -> IO[bytes]:
        """A forward-only binary stream of the file ``name`` (a shard, an index)."""
        return open(self.local / name, "rb")

    def committed(self, manifest: UnitManifest) -> bool:
        """Whether the shard a manifest records is there as written (size; the hash is checked by validate)."""
        return self.size(manifest.shard) == manifest.bytes

    def shard_keys(self, name: str) -> dict[str, list[str]]:
        """Sample keys of the shard ``name`` and the fields of each (tar headers)."""
        from diffprep.shards import tar_keys

        return tar_keys(self.local / name)

    def shard_digest(self, name: str) -> ShardDigest:
        """Size, sha256 and sample keys (with their fields) of the shard ``name``, in one read."""
        from diffprep.shards import shard_digest

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

    # -- keeping the bucket and the staging folder in step (no-ops here) ------------------------------------------
    def pull_state(self) -> None:
        """Make the staged ``.diffprep`` and ``.nv-meta`` equal to the output's."""

    def push(self, *relative: str) -> None:
        """Upload the staged files (or folders) ``relative`` to the output."""

    def shard_upload(self, unit: int) -> None:
        """A sink that uploads the shard as it is written; None: a folder needs none."""
        return None

    def publish_unit(self, unit: int, upload: Any = None) -> None:
        """Upload a unit committed in staging: shard, check, then manifest (the commit point)."""

    def abort_stale_uploads(self) -> list[str]:
        """Uploads left unfinished by runs that died; a folder has none."""
        return []

    def committed_unit(self, unit: int, fingerprint: str) -> UnitManifest | None:
        """A bucket's committed unit (a local unit is checked by ``encode_unit`` itself): None here."""
        return None

    def delete_ours(self) -> list[str]:
        """Delete what diffprep wrote in the bucket (after an approved overwrite); the staged state is cleared apart."""
        return []

    def next_free(self) -> Output:
        """``<out>-v2``, ``-v3``...: the first that does not exist or is empty."""
        version = 2
        while True:
            candidate = self.local.with_name(f"{self.local.name}-v{version}")
            if not candidate.exists() or (candidate.is_dir() and not any(candidate.iterdir())):
                return Output(candidate)
            version += 1

    @contextlib.contextmanager
    def energon_access(self) -> Iterator[Any]:
        """The path Energon opens the dataset by, valid inside the block."""
        yield self.local

    def lock(self, run: str | None, shard: int | None = None) -> contextlib.AbstractContextManager:
        """One run at a time per output (``diffprep.existing.OutputLock``, naming its holder)."""
        from diffprep.existing import OutputLock

        return OutputLock(self.local, run, shard=shard)


class S3Output(Output):
    """An output under ``s3://bucket/prefix``, staged in a local folder (module docstring)."""

    remote = True

    def __init__(self, url: S3Url, *, endpoint_url: str | None = None, profile: str | None = None) -> None:
        key = url.key.strip("/")
        if not key:
            raise SourceError(
                f"output {S3_SCHEME}{url.bucket} has no prefix: write the dataset under one, e.g. "
                f"{S3_SCHEME}{url.bucket}/datasets/name (an overwrite then never touches the rest of the bucket)"
            )
        if any(part in ("", ".", "..") for part in key.split("/")) or has_glob_magic(key):
            raise SourceError(f"output {S3_SCHEME}{url.bucket}/{key}: a prefix of plain names is needed "
                              "(no '.', '..', empty parts or wildcards)")
        self.url = S3Url(url.bucket, key)
        self.uri = f"{S3_SCHEME}{url.bucket}/{key}"
        self.local = staging_root() / url.bucket / key
        self.endpoint_url = endpoint_url
        self.profile = profile
        self.client = s3_client(endpoint_url, profile, section="output")
        self._objects: dict[str, ObjectInfo] | None = None

    def _url(self, relative: str) -> S3Url:
        return S3Url(self.url.bucket, f"{self.url.key}/{relative}")

    def _call(self, operation: str, relative: str, **request: Any) -> Any:
        return _request(self.client, self._url(relative), operation, **request)

    def objects(self, refresh: bool = False) -> dict[str, ObjectInfo]:
        """Every object under the prefix, by path relative to it (one listing, kept until ``refresh``)."""
        if self._objects is None or refresh:
            start = len(self.url.key) + 1
            self._objects = {info.key[start:]: info
                             for info in list_objects(self.client, S3Url(self.url.bucket, self.url.key + "/"))}
        return self._objects

    # -- reading --------------------------------------------------------------------------------------------------
    def exists(self) -> bool:
        return bool(self.objects(refresh=True))

    def entries(self) -> list[str]:
        return sorted({name.split("/", 1)[0] for name in self.objects(refresh=True)})

    def size(self, name: str) -> int | None:
        info = self.objects().get(name)
        return None if info is None else info.size

    def open(self, name: str) -> IO[bytes]:
        return open_object(self.client, self._url(name))

    def shard_keys(self, name: str) -> dict[str, list[str]]:
        from diffprep.shards import tar_keys

        with self.open(name) as stream:
            return tar_keys(stream)

    def _head(self, relative: str) -> dict | None:
        try:
            return self._call("HeadObject", relative)
        except FileNotFoundError:
            return None

    def committed(self, manifest: UnitManifest, recorded_etag: str | None = None) -> bool:
        """Whether the shard object is the one the manifest object vouches for: its size, and the ETag the
        upload got, recorded in the manifest object's metadata (``recorded_etag`` when already read)."""
        if recorded_etag is None:
            head = self._head(self._manifest_rel(manifest.unit))
            recorded_etag = (head or {}).get("Metadata", {}).get(SHARD_ETAG_METADATA)
        shard = self._head(manifest.shard)
        return (shard is not None and recorded_etag is not None and int(shard.get("ContentLength", -1)) == manifest.bytes
                and _etag(shard) == recorded_etag)

    def committed_unit(self, unit: int, fingerprint: str) -> UnitManifest | None:
        """The unit's manifest object when the unit is committed in the bucket for this fingerprint."""
        from diffprep.shards import UnitManifest

        try:
            response = self._call("GetObject", self._manifest_rel(unit))
        except FileNotFoundError:
            return None
        manifest = UnitManifest.from_json(json.loads(response["Body"].read()))
        recorded = response.get("Metadata", {}).get(SHARD_ETAG_METADATA)
        if manifest.fingerprint != fingerprint or not self.committed(manifest, recorded or ""):
            return None
        return manifest

    @staticmethod
    def _manifest_rel(unit: int) -> str:
        return f"{contract.STATE_DIR}/{contract.UNITS_DIR}/{contract.unit_manifest_name(unit)}"

    def total_bytes(self) -> int:
        return sum(info.size for info in self.objects().values())

    def link(self) -> str:
        return self.uri

    # -- staging --------------------------------------------------------------------------------------------------
    def pull_state(self) -> None:
        objects = self.objects(refresh=True)
        state = self.local / contract.STATE_DIR
        units = state / contract.UNITS_DIR
        meta = self.local / contract.NV_META
        wanted = [name for name in objects
                  if name in {f"{contract.STATE_DIR}/{n}" for n in _PULLED_STATE}
                  or (name.startswith(f"{contract.STATE_DIR}/{contract.UNITS_DIR}/") and name.endswith(".json"))
                  or (name.startswith(f"{contract.NV_META}/") and name.count("/") == 1)]
        # Staged copies the bucket no longer holds go first: the bucket is the truth.
        stale = [units / p.name for p in (units.glob("*.json") if units.is_dir() else ())]
        stale += [state / n for n in _PULLED_STATE] + ([p for p in meta.iterdir() if p.is_file()] if meta.is_dir() else [])
        for path in stale:
            if str(path.relative_to(self.local)) not in objects:
                path.unlink(missing_ok=True)
        for name in wanted:
            target = self.local / name
            # A single-part object's ETag is its MD5: a staged copy with the same one is already up to date.
            if target.is_file() and hashlib.md5(target.read_bytes(), usedforsecurity=False).hexdigest() == objects[name].etag:
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            data = read_object(self.client, self._url(name))
            tmp = target.with_name(f".{target.name}.pull-{os.getpid()}")
            tmp.write_bytes(data)
            os.replace(tmp, target)

    def push(self, *relative: str) -> None:
        for rel in relative:
            path = self.local / rel
            files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
            for file in files:
                self._put_file(file, str(file.relative_to(self.local)))
        self._objects = None

    def _put_file(self, path: Path, relative: str, metadata: dict[str, str] | None = None) -> str:
        """Upload a staged file (multipart when large); its ETag."""
        upload = ObjectUpload(self, relative, metadata)
        with open(path, "rb") as handle:
            while chunk := handle.read(MULTIPART_CHUNK):
                upload.write(chunk)
        return upload.finish()

    def shard_upload(self, unit: int) -> ObjectUpload:
        """A sink for ``ShardWriter``: the shard goes up part by part while it is written."""
        return ObjectUpload(self, contract.shard_name(unit))

    def publish_unit(self, unit: int, upload: ObjectUpload | None = None) -> None:
        """Commit a unit committed in staging to the bucket: the shard object, checked, then its manifest object.

        ``upload`` is the sink the shard was written through; when it did not
        see this shard whole (the unit was committed by an earlier try), the
        staged file is sent instead.
        """
        from diffprep.shards import read_manifest

        manifest = read_manifest(self.local, unit)
        if manifest is None:
            raise FileNotFoundError(f"unit {unit} has no staged manifest under {self.local}; encode it first")
        manifest_rel = self._manifest_rel(unit)
        shard = self.local / manifest.shard
        # An older manifest object would vouch for the shard being replaced: remove it before the shard changes.
        self._call("DeleteObject", manifest_rel)
        if upload is not None and (upload.size, upload.sha256) == (manifest.bytes, manifest.sha256):
            etag = upload.finish()
        else:
            if upload is not None:
                upload.abort()
            etag = self._put_file(shard, manifest.shard)
        head = self._head(manifest.shard) or {}
        stored = (int(head.get("ContentLength", -1)), _etag(head))
        if stored != (manifest.bytes, etag):
            raise OSError(f"{self._url(manifest.shard)} reads back as {stored[0]} bytes, ETag {stored[1]}; the "
                          f"upload sent {manifest.bytes} bytes, ETag {etag}: it did not land whole")
        self._put_file(self.local / manifest_rel, manifest_rel, {SHARD_ETAG_METADATA: etag})
        shard.unlink()
        self._objects = None

    def abort_stale_uploads(self) -> list[str]:
        """Abort multipart uploads under the prefix left by runs that died (call with the run's lock held)."""
        aborted = []
        try:
            pages = self.client.get_paginator("list_multipart_uploads").paginate(
                Bucket=self.url.bucket, Prefix=self.url.key + "/")
            for page in pages:
                for upload in page.get("Uploads", ()):
                    self.client.abort_multipart_upload(Bucket=self.url.bucket, Key=upload["Key"],
                                                       UploadId=upload["UploadId"])
                    aborted.append(upload["Key"][len(self.url.key) + 1:])
        except Exception as exc:  # noqa: BLE001
            raise storage_error(exc, self.url, "ListMultipartUploads", self.client) from None
        return sorted(aborted)

    def delete_ours(self) -> list[str]:
        locks = re.compile(rf"{re.escape(contract.STATE_DIR)}/lock(-shard-\d+)?\.json")  # the runs' own: kept
        doomed = sorted(name for name in self.objects(refresh=True)
                        if is_ours(name.split("/", 1)[0]) and not locks.fullmatch(name))
        for start in range(0, len(doomed), 1000):
            batch = doomed[start:start + 1000]
            try:
                response = self.client.delete_objects(Bucket=self.url.bucket, Delete={
                    "Objects": [{"Key": f"{self.url.key}/{name}"} for name in batch], "Quiet": True})
            except Exception as exc:  # noqa: BLE001
                raise storage_error(exc, self.url, "DeleteObjects", self.client) from None
            if response.get("Errors"):
                first = response["Errors"][0]
                raise OSError(f"{self.uri}: DeleteObjects refused {len(response['Errors'])} object(s), e.g. "
                              f"{first.get('Key')}: {first.get('Code')} {first.get('Message', '')}")
        self._objects = None
        return sorted({name.split("/", 1)[0] for name in doomed})

    def next_free(self) -> S3Output:
        version = 2
        while True:
            candidate = S3Output(S3Url(self.url.bucket, f"{self.url.key}-v{version}"),
                                 endpoint_url=self.endpoint_url, profile=self.profile)
            if not candidate.exists():
                return candidate
            version += 1

    # -- Energon --------------------------------------------------------------------------------------------------
    @property
    def msc_profile(self) -> str:
        return f"diffprep-{self.url.bucket}"

    def msc_config(self) -> dict[str, Any]:
        """A Multi-Storage Client profile for the bucket: endpoint, region, AWS profile; credentials from the chain."""
        options: dict[str, Any] = {"base_path": self.url.bucket}
        if self.client.meta.region_name:
            options["region_name"] = self.client.meta.region_name
        if self.endpoint_url:
            options["endpoint_url"] = self.endpoint_url
        elif self.client.meta.endpoint_url and "amazonaws.com" not in self.client.meta.endpoint_url:
            options["endpoint_url"] = self.client.meta.endpoint_url  # from AWS_ENDPOINT_URL
        if self.profile:
            options["profile_name"] = self.profile
        return {"profiles": {self.msc_profile: {"storage_provider": {"type": "s3", "options": options}}}}

    @contextlib.contextmanager
    def energon_access(self) -> Iterator[Any]:
        """The dataset as an Energon ``EPath`` on a profile of its own (valid inside the block).

        The profile, ``msc_config.yaml``, is also kept with the dataset for
        training jobs. Each access gets a fresh storage client under a profile
        name of its own: Energon's prepare forks its workers with the parent's
        client, and a client that already holds open connections would then be
        shared by several processes, their requests and answers mixed on one
        socket.
        """
        import yaml
        from megatron.energon.epathlib import EPath

        config = self.local / contract.STATE_DIR / MSC_CONFIG_FILE
        config.parent.mkdir(parents=True, exist_ok=True)
        config.write_text(yaml.safe_dump(self.msc_config(), sort_keys=False), encoding="utf-8")
        # Kept with the dataset, for training jobs elsewhere (endpoint and region only: no secret in it).
        self.push(f"{contract.STATE_DIR}/{MSC_CONFIG_FILE}")

        profile = f"{self.msc_profile}-{uuid.uuid4().hex[:12]}"
        private = self.msc_config()["profiles"][self.msc_profile]
        with tempfile.TemporaryDirectory(prefix="diffprep-msc-") as folder:
            own = Path(folder) / MSC_CONFIG_FILE
            own.write_text(yaml.safe_dump({"profiles": {profile: private}}), encoding="utf-8")
            previous = os.environ.get("MSC_CONFIG")
            os.environ["MSC_CONFIG"] = str(own)
            try:
                yield EPath(f"msc://{profile}/{self.url.key}")
            finally:
                if previous is None:
                    os.environ.pop("MSC_CONFIG", None)
                else:
                    os.environ["MSC_CONFIG"] = previous
                _forget_msc_client(profile)

    def lock(self, run: str | None, shard: int | None = None) -> contextlib.AbstractContextManager:
        return S3Lock(self, run, shard=shard)


def _request(client: Any, url: S3Url, operation: str, **request: Any) -> Any:
    """One request on the object ``url`` (``operation`` as S3 names it); failures sorted as in diffprep.storage."""
    method = getattr(client, re.sub(r"(?<!^)(?=[A-Z])", "_", operation).lower())
    try:
        return method(Bucket=url.bucket, Key=url.key, **request)
    except Exception as exc:  # noqa: BLE001 - sorted into the error to raise
        raise storage_error(exc, url, operation, client) from None


def _etag(response: dict) -> str | None:
    etag = response.get("ETag")
    return etag.strip('"') if etag else None


class ObjectUpload:
    """One object sent as its bytes come: a multipart upload with a part per ``MULTIPART_CHUNK``, sent in
    ``UPLOAD_CONCURRENCY`` threads while the writer goes on, or one PUT when the object stays smaller.

    Used as a ``ShardWriter`` sink, a shard is in the bucket moments after
    its last sample; nothing is visible there before ``finish()`` completes
    the upload, and ``abort()`` (the writer's, on any failure) discards the
    parts. A retried part is re-sent from memory, so at most
    ``UPLOAD_CONCURRENCY + 1`` chunks are held.
    """

    def __init__(self, output: S3Output, relative: str, metadata: dict[str, str] | None = None) -> None:
        self.output = output
        self.relative = relative
        self.metadata = metadata or {}
        self._url = output._url(relative)
        self._slots = threading.Semaphore(UPLOAD_CONCURRENCY)
        self._pool: Any = None
        self._reset()

    def _reset(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False)
        self._pool = None
        self._buffer = bytearray()
        self._upload_id: str | None = None
        self._parts: list[Any] = []  # futures of (part number, ETag)
        self._digest = hashlib.sha256()
        self.size = 0

    @property
    def sha256(self) -> str:
        return self._digest.hexdigest()

    def _request(self, operation: str, **request: Any) -> Any:
        return _request(self.output.client, self._url, operation, **request)

    def write(self, data: bytes) -> None:
        self._buffer += data
        self._digest.update(data)
        self.size += len(data)
        while len(self._buffer) >= MULTIPART_CHUNK:
            part = bytes(self._buffer[:MULTIPART_CHUNK])
            del self._buffer[:MULTIPART_CHUNK]
            self._send(part)

    def _send(self, body: bytes) -> None:
        from concurrent.futures import ThreadPoolExecutor

        if self._upload_id is None:
            self._upload_id = self._request("CreateMultipartUpload", Metadata=self.metadata)["UploadId"]
            self._pool = ThreadPoolExecutor(UPLOAD_CONCURRENCY, thread_name_prefix="diffprep-upload")
        number = len(self._parts) + 1
        for done in [f for f in self._parts if f.done()]:
            done.result()  # a failed part stops the writer at once
        self._slots.acquire()  # at most UPLOAD_CONCURRENCY parts in flight

        def send() -> tuple[int, str]:
            try:
                response = self._request("UploadPart", UploadId=self._upload_id, PartNumber=number, Body=body)
                return number, response["ETag"]
            finally:
                self._slots.release()

        self._parts.append(self._pool.submit(send))

    def finish(self) -> str:
        """Send what is left and make the object visible; its ETag."""
        try:
            if self._upload_id is None:
                response = self._request("PutObject", Body=bytes(self._buffer), Metadata=self.metadata)
            else:
                if self._buffer or not self._parts:
                    self._send(bytes(self._buffer))
                parts = [future.result() for future in self._parts]
                response = self._request("CompleteMultipartUpload", UploadId=self._upload_id, MultipartUpload={
                    "Parts": [{"PartNumber": number, "ETag": etag} for number, etag in parts]})
        except BaseException:
            self.abort()
            raise
        etag = _etag(response) or ""
        self._reset()
        return etag

    def abort(self) -> None:
        """Discard what was sent (no object appears); the upload can start again from its first byte."""
        for future in self._parts:
            future.cancel()
        for future in self._parts:
            with contextlib.suppress(BaseException):
                future.result()
        if self._upload_id is not None:
            with contextlib.suppress(Exception):
                self._request("AbortMultipartUpload", UploadId=self._upload_id)
        self._reset()


def _forget_msc_client(profile: str) -> None:
    """Drop the Multi-Storage Client's cached client of a finished access (best effort: a private cache)."""
    try:
        from multistorageclient import shortcuts

        shortcuts._STORAGE_CLIENT_CACHE.pop(profile, None)
    except (ImportError, AttributeError):
        pass


def open_output(out_dir: str | os.PathLike | Output, *, endpoint_url: str | None = None,
                profile: str | None = None) -> Output:
    """The ``Output`` for a local path or an ``s3://bucket/prefix`` URL."""
    if isinstance(out_dir, Output):
        return out_dir
    if is_s3_url(str(out_dir)):
        return S3Output(parse_s3_url(str(out_dir), "output.output_dir"), endpoint_url=endpoint_url, profile=profile)
    return Output(out_dir)


# --- one run at a time per prefix ---------------------------------------------------------------------------------


@dataclass
class LockRecord:
    host: str
    pid: int
    user: str
    run: str | None = None
    lease_s: float = LOCK_LEASE_S


class S3Lock:
    """One run at a time per bucket prefix: ``.diffprep/lock.json`` created with ``If-None-Match: *``.

    A bucket has no process to notice a holder that died, so the lock is a
    lease: the holder rewrites it (``If-Match`` its last ETag) every third of
    ``lease_s``, and a lock object the store last modified more than
    ``lease_s`` ago (by the store's own clock: no skew between machines), or
    one whose holder's process on this machine is gone, is taken over with a
    conditional PUT, so two runs cannot both take it. A
    ``--shard-index`` run holds ``lock-shard-NNNN.json``; a plain run and shard
    runs exclude each other. The staging folder is also ``flock``-ed, for runs
    on one machine.
    """

    def __init__(self, output: S3Output, run: str | None, *, shard: int | None = None,
                 lease_s: float | None = None) -> None:
        from diffprep.existing import OutputLock

        self.output = output
        self.shard = shard
        name = contract.LOCK_FILE if shard is None else f"lock-shard-{shard:04d}.json"
        self.relative = f"{contract.STATE_DIR}/{name}"
        lease = float(os.environ.get("DIFFPREP_S3_LOCK_LEASE", lease_s or LOCK_LEASE_S))
        self.me = LockRecord(socket.gethostname(), os.getpid(), getpass.getuser(), run, lease)
        self._local = OutputLock(output.local, run, shard=shard)
        self._etag: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.lost = False

    def _put(self, **condition: str) -> str:
        body = json.dumps(asdict(self.me)).encode()
        return self.output._call("PutObject", self.relative, Body=body, ContentType="application/json",
                                 **condition)["ETag"]

    def _read(self, relative: str) -> tuple[LockRecord | None, str | None, float]:
        """(holder, ETag, seconds since the store last wrote it); (None, None, 0) when there is no lock object."""
        try:
            response = self.output._call("GetObject", relative)
        except FileNotFoundError:
            return None, None, 0.0
        body = response["Body"].read()
        headers = response.get("ResponseMetadata", {}).get("HTTPHeaders", {})
        age = 0.0
        if headers.get("date") and response.get("LastModified"):
            age = (parsedate_to_datetime(headers["date"]) - response["LastModified"]).total_seconds()
        try:
            record = LockRecord(**json.loads(body))
        except (ValueError, TypeError):
            record = LockRecord("unknown", 0, "unknown")
        return record, response.get("ETag"), age

    def _refused(self, holder: LockRecord | None, what: str = "another run") -> LockedError:
        who = (f"host {holder.host}, pid {holder.pid}, user {holder.user}"
               + (f", flow run {holder.run}" if holder.run else "")) if holder else "holder unknown"
        return LockedError(
            f"{self.output.uri} is being written by {what} ({who}). Wait for it to finish, or stop it; a lock "
            f"left by a run that died expires {holder.lease_s if holder else LOCK_LEASE_S:.0f} s after its last "
            f"heartbeat"
        )

    def acquire(self) -> None:
        self._local.acquire()
        try:
            self._acquire_remote()
        except BaseException:
            self._local.release()
            raise

    def _acquire_remote(self) -> None:
        try:
            self._etag = self._put(IfNoneMatch="*")
        except ObjectChangedError:
            holder, etag, age = self._read(self.relative)
            if holder is not None and age < holder.lease_s and not _dead_here(holder):
                raise self._refused(holder) from None
            # Expired (or gone meanwhile): take it over, conditionally, so only one contender wins.
            try:
                self._etag = self._put(IfMatch=etag) if etag else self._put(IfNoneMatch="*")
            except ObjectChangedError:
                raise self._refused(self._read(self.relative)[0]) from None
            log.warning("took over the lock of %s left by %s (no heartbeat for %.0f s)", self.output.uri,
                        holder, age)
        conflict = self._conflict()
        if conflict is not None:
            self._release_remote()
            raise conflict
        self._thread = threading.Thread(target=self._heartbeat, name="diffprep-s3-lock", daemon=True)
        self._thread.start()

    def _conflict(self) -> LockedError | None:
        """A plain run excludes every live shard run and the other way round."""
        prefix = f"{contract.STATE_DIR}/"
        for name in self.output.objects(refresh=True):
            if not name.startswith(prefix) or name == self.relative:
                continue
            rest = name[len(prefix):]
            plain = rest == contract.LOCK_FILE
            shard_lock = re.fullmatch(r"lock-shard-\d+\.json", rest) is not None
            if (self.shard is None and shard_lock) or (self.shard is not None and plain):
                holder, _, age = self._read(name)
                if holder is not None and age < holder.lease_s and not _dead_here(holder):
                    return self._refused(holder, "a --shard-index run" if shard_lock else "a plain run")
        return None

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.me.lease_s / 3):
            try:
                self._etag = self._put(IfMatch=self._etag)
            except OSError as error:
                self.lost = True
                log.error("lost the lock of %s (%s): another run may write there now", self.output.uri, error)
                return

    def _release_remote(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._etag is not None and not self.lost:
            _, etag, _ = self._read(self.relative)
            if etag == self._etag:
                self.output._call("DeleteObject", self.relative)
        self._etag = None

    def release(self) -> None:
        try:
            self._release_remote()
        finally:
            self._local.release()

    def __enter__(self) -> S3Lock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _dead_here(holder: LockRecord) -> bool:
    """A holder on this machine whose process is gone: its lock need not wait out the lease."""
    from diffprep.existing import _pid_alive

    return holder.host == socket.gethostname() and holder.pid > 0 and not _pid_alive(holder.pid)


def clear_staged_state(output: Output) -> None:
    """After an approved overwrite of a bucket prefix: forget its staged state (the lock file stays)."""
    for rel in (contract.STATE_DIR, contract.NV_META):
        folder = output.local / rel
        if not folder.is_dir():
            continue
        for child in folder.iterdir():
            if child.name.startswith("lock"):
                continue
            shutil.rmtree(child) if child.is_dir() else child.unlink()


__all__ = ["Output", "S3Output", "S3Lock", "open_output", "staging_root", "is_ours", "STAGING_ENV"]
