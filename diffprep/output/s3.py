"""An output under ``s3://bucket/prefix``, worked through a local staging folder; the bucket is the truth.

The staging folder (``$DIFFPREP_STAGING_DIR``, default
``~/.cache/diffprep/staging``, then ``<bucket>/<prefix>``) mirrors the
prefix's state (``.diffprep/`` and ``.nv-meta/``) and holds a shard only from
its writing until its upload:

- a shard goes up while it is written (``ObjectUpload``: a multipart upload,
  a part per ``MULTIPART_CHUNK``), so the upload overlaps the encoding;
- a unit is committed when its shard object is complete and checked (size,
  ETag) and then its manifest object is written, carrying the shard's ETag in
  its metadata; a shard object without a manifest object that vouches for
  exactly that object is not done, whatever it holds;
- state files are uploaded as they are written (``StateStore``), and
  ``sync_state`` makes the staged state equal to the bucket's;
- one run at a time per prefix: ``S3Lock`` (``diffprep.output.locks``);
- Energon reads the prefix through a Multi-Storage Client profile
  (``diffprep.output.msc``).

Shards, indexes and metadata are read back from the bucket (``open``), never
from a staged copy.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import IO, Any

from diffprep import contract
from diffprep.errors import SourceError
from diffprep.output.base import Output
from diffprep.output.locks import S3Lock
from diffprep.output.msc import energon_path
from diffprep.output.upload import MULTIPART_CHUNK, ObjectUpload, etag_of, request
from diffprep.writer.links import no_link_below
from diffprep.writer.shards import ShardSink, UnitManifest, json_file_bytes, members_path, tar_keys
from diffprep.sources.storage import (
    S3_SCHEME,
    ObjectInfo,
    S3Url,
    has_glob_magic,
    list_objects,
    open_object,
    read_object,
    s3_client,
    storage_error,
)

STAGING_ENV = "DIFFPREP_STAGING_DIR"
SHARD_ETAG_METADATA = "shard-etag"  # metadata of a manifest object: the ETag its shard object got
CHECK_THREADS = 16  # concurrent unit checks against the bucket
_PULLED_STATE = (contract.PLAN_JSON, contract.SPLITS_JSON, contract.AUDIT_JSON, contract.VALIDATION_JSON)


def staging_root() -> Path:
    configured = os.environ.get(STAGING_ENV)
    if configured:
        return Path(configured).expanduser().resolve()
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "diffprep" / "staging"


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
        super().__init__(staging_root() / url.bucket / key)
        self.url = S3Url(url.bucket, key)
        self.uri = f"{S3_SCHEME}{url.bucket}/{key}"
        self.endpoint_url = endpoint_url
        self.profile = profile
        self.client = s3_client(endpoint_url, profile, section="output")
        self._objects: dict[str, ObjectInfo] | None = None

    def url_of(self, relative: str) -> S3Url:
        return S3Url(self.url.bucket, f"{self.url.key}/{relative}")

    def request(self, operation: str, relative: str, **params: Any) -> Any:
        """One request on the object ``relative`` to the prefix (``operation`` as S3 names it)."""
        return request(self.client, self.url_of(relative), operation, **params)

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

    def files(self) -> list[str]:
        return sorted(self.objects(refresh=True))

    def listing(self) -> tuple[list[str], list[str]]:
        return self.files(), super().listing()[1]  # the bucket's objects; links only in the staging folder

    def size(self, name: str) -> int | None:
        info = self.objects().get(name)
        return None if info is None else info.size

    def open(self, name: str) -> IO[bytes]:
        return open_object(self.client, self.url_of(name))

    def shard_keys(self, name: str) -> dict[str, list[str]]:
        with self.open(name) as stream:
            return tar_keys(stream)

    def total_bytes(self) -> int:
        return sum(info.size for info in self.objects().values())

    def link(self) -> str:
        return self.uri

    def _head(self, relative: str) -> dict | None:
        try:
            return self.request("HeadObject", relative)
        except FileNotFoundError:
            return None

    # -- units ----------------------------------------------------------------------------------------------------
    def shard_intact(self, manifest: UnitManifest, recorded_etag: str | None = None) -> bool:
        """Whether the shard object is the one the manifest object vouches for: its size, and the ETag the
        upload got, recorded in the manifest object's metadata (``recorded_etag`` when already read)."""
        if recorded_etag is None:
            head = self._head(contract.unit_manifest_path(manifest.unit))
            recorded_etag = (head or {}).get("Metadata", {}).get(SHARD_ETAG_METADATA)
        if not manifest.has_shard:  # every sample rejected: no shard object
            return manifest.count == 0
        shard = self._head(manifest.shard)
        return (shard is not None and recorded_etag is not None
                and int(shard.get("ContentLength", -1)) == manifest.bytes and etag_of(shard) == recorded_etag)

    def _check_shards(self, manifests: list[UnitManifest]) -> list[bool]:
        # A bucket answers each check in a round trip or two: many at once.
        with ThreadPoolExecutor(CHECK_THREADS) as pool:
            return list(pool.map(self.shard_intact, manifests))

    def committed_unit(self, unit: int, fingerprint: str) -> UnitManifest | None:
        """The unit's manifest object when the unit is committed in the bucket for this fingerprint."""
        try:
            response = self.request("GetObject", contract.unit_manifest_path(unit))
        except FileNotFoundError:
            return None
        manifest = UnitManifest.from_json(json.loads(response["Body"].read()))
        recorded = response.get("Metadata", {}).get(SHARD_ETAG_METADATA)
        if manifest.fingerprint != fingerprint or not self.shard_intact(manifest, recorded or ""):
            return None
        return manifest

    def shard_sink(self, unit: int) -> ObjectUpload:
        """A sink for ``ShardWriter``: the shard goes up part by part while it is written."""
        return ObjectUpload(self, contract.shard_name(unit))

    def commit_unit(self, manifest: UnitManifest, sink: ShardSink | None = None) -> None:
        """Commit a unit whose shard is staged: the shard object, checked, then its manifest object.

        ``sink`` is the upload the shard was written through; when it did not
        see this shard whole (the unit was committed by an earlier try), the
        staged file is sent instead.
        """
        manifest_rel = contract.unit_manifest_path(manifest.unit)
        shard = self.local / manifest.shard
        # An older manifest object would vouch for the shard being replaced: remove it before the shard changes.
        self.request("DeleteObject", manifest_rel)
        if not manifest.has_shard:  # every sample rejected: the manifest alone (its writer aborted the upload)
            if sink is not None:
                sink.abort()
            self._put_bytes(json_file_bytes(manifest.to_json()), manifest_rel, {})
            super().commit_unit(manifest)
            self._objects = None
            return
        if isinstance(sink, ObjectUpload) and (sink.size, sink.sha256) == (manifest.bytes, manifest.sha256):
            etag = sink.finish()
        else:
            if sink is not None:
                sink.abort()
            etag = self._put_file(shard, manifest.shard)
        head = self._head(manifest.shard) or {}
        stored = (int(head.get("ContentLength", -1)), etag_of(head))
        if stored != (manifest.bytes, etag):
            raise OSError(f"{self.url_of(manifest.shard)} reads back as {stored[0]} bytes, ETag {stored[1]}; the "
                          f"upload sent {manifest.bytes} bytes, ETag {etag}: it did not land whole")
        # The writer's record of the shard's members, before the manifest that commits it: finalize builds Energon's
        # index from it instead of reading every shard back from the bucket (diffprep.run.energon_index).
        record = members_path(self.local, manifest.shard)
        if record.is_file():
            self._put_file(record, str(record.relative_to(self.local)))
        self._put_bytes(json_file_bytes(manifest.to_json()), manifest_rel, {SHARD_ETAG_METADATA: etag})
        # The staged copy (this machine's record of the unit) only once the bucket holds the object: another
        # process sharing this staging folder that syncs meanwhile would remove a copy the bucket lacks.
        super().commit_unit(manifest)
        shard.unlink()
        self._objects = None

    # -- staging --------------------------------------------------------------------------------------------------
    def sync_state(self) -> None:
        """The staged plan, splits, audit, validation and ``.nv-meta`` made equal to the bucket's; the unit manifests
        are ``sync_manifests``' (every listing of them looks at the bucket), so a unit task's first read costs one
        listing and no manifest download."""
        objects = self.objects(refresh=True)
        state, meta = self.local / contract.STATE_DIR, self.local / contract.NV_META
        wanted = [name for name in objects
                  if name in {f"{contract.STATE_DIR}/{n}" for n in _PULLED_STATE}
                  or name.startswith(f"{contract.NV_META}/") and name.count("/") == 1]
        # Staged copies the bucket no longer holds go first: the bucket is the truth.
        stale = ([state / n for n in _PULLED_STATE]
                 + ([p for p in meta.iterdir() if p.is_file()] if meta.is_dir() else []))
        self._pull(objects, wanted, stale)

    def sync_manifests(self) -> None:
        objects = self.objects(refresh=True)
        folder = f"{contract.STATE_DIR}/{contract.UNITS_DIR}/"
        self._pull(objects, [n for n in objects if n.startswith(folder) and n.endswith(".json")],
                   self._staged_manifests())

    def pull_file(self, relative: str) -> None:
        """One HEAD (no listing: a unit task reads its own list), a download when the staged copy differs."""
        head = self._head(relative)
        if head is not None:
            info = ObjectInfo(relative, head["ContentLength"], head.get("ETag", "").strip('"'))
            self._pull({relative: info}, [relative], [])

    def _staged_manifests(self) -> list[Path]:
        units = self.local / contract.STATE_DIR / contract.UNITS_DIR
        return list(units.glob("*.json")) if units.is_dir() else []

    def _pull(self, objects: dict[str, ObjectInfo], wanted: list[str], staged: list[Path]) -> None:
        for path in staged:
            if str(path.relative_to(self.local)) not in objects:
                no_link_below(self.local, path).unlink(missing_ok=True)
        for name in wanted:
            target = self.writable(name)
            # A single-part object's ETag is its MD5: a staged copy with the same one is already up to date.
            if (target.is_file()
                    and hashlib.md5(target.read_bytes(), usedforsecurity=False).hexdigest() == objects[name].etag):
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            data = read_object(self.client, self.url_of(name))
            tmp = target.with_name(f".{target.name}.pull-{os.getpid()}")
            tmp.write_bytes(data)
            os.replace(tmp, target)

    def publish_file(self, relative: str) -> None:
        self._put_file(self.local / relative, relative)
        self._objects = None

    def put_bytes(self, relative: str, data: bytes) -> None:
        """An object of the prefix from memory, nothing staged (a shard's ``.tar.idx``)."""
        self._put_bytes(data, relative)
        self._objects = None

    def _put_bytes(self, data: bytes, relative: str, metadata: dict[str, str] | None = None) -> str:
        """Upload a small object from memory; its ETag."""
        upload = ObjectUpload(self, relative, metadata)
        upload.write(data)
        return upload.finish()

    def _put_file(self, path: Path, relative: str, metadata: dict[str, str] | None = None) -> str:
        """Upload a staged file (multipart when large); its ETag."""
        upload = ObjectUpload(self, relative, metadata)
        with open(path, "rb") as handle:
            while chunk := handle.read(MULTIPART_CHUNK):
                upload.write(chunk)
        return upload.finish()

    # -- changing what exists ---------------------------------------------------------------------------------------
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

    def remove(self, paths: list[str] | tuple[str, ...]) -> None:
        """Delete exactly the objects ``paths`` (call with the run's lock held), and their staged copies."""
        doomed = sorted(paths)
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
        super().remove(doomed)

    def next_free(self, fingerprint: str | None = None) -> S3Output:
        version = 2
        while True:
            candidate = S3Output(S3Url(self.url.bucket, f"{self.url.key}-v{version}"),
                                 endpoint_url=self.endpoint_url, profile=self.profile)
            if candidate.free_for(fingerprint):
                candidate.credentials_block = self.credentials_block
                return candidate
            version += 1

    @contextlib.contextmanager
    def energon_access(self) -> Iterator[Any]:
        with energon_path(self) as path:
            yield path
        self.sync_state()  # Energon may have written .nv-meta in the bucket: the staged copy follows

    def lock(self, run: str | None, shard: int | None = None) -> contextlib.AbstractContextManager:
        return S3Lock(self, run, shard=shard)


__all__ = ["S3Output", "STAGING_ENV", "staging_root"]
