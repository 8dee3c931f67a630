"""Objects sent to a bucket as their bytes come: the multipart upload behind a bucket output's shards and state."""

from __future__ import annotations

import contextlib
import hashlib
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

from diffprep.sources.storage import S3Url, storage_error



class UploadTarget(Protocol):
    """Where an upload goes (``diffprep.output.s3.S3Output``): its client, and an object's URL under its prefix."""

    client: Any

    def url_of(self, relative: str) -> S3Url: ...

MULTIPART_CHUNK = 64 << 20  # part size, and the size from which uploads are multipart
UPLOAD_CONCURRENCY = 4


def request(client: Any, url: S3Url, operation: str, **params: Any) -> Any:
    """One request on the object ``url`` (``operation`` as S3 names it); failures sorted as in diffprep.sources.storage."""
    method = getattr(client, re.sub(r"(?<!^)(?=[A-Z])", "_", operation).lower())
    try:
        return method(Bucket=url.bucket, Key=url.key, **params)
    except Exception as exc:  # noqa: BLE001 - sorted into the error to raise
        raise storage_error(exc, url, operation, client) from None


def etag_of(response: dict) -> str | None:
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

    def __init__(self, output: UploadTarget, relative: str, metadata: dict[str, str] | None = None) -> None:
        self.output = output
        self.relative = relative
        self.metadata = metadata or {}
        self._url = output.url_of(relative)
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

    def _request(self, operation: str, **params: Any) -> Any:
        return request(self.output.client, self._url, operation, **params)

    def write(self, data: bytes) -> None:
        self._buffer += data
        self._digest.update(data)
        self.size += len(data)
        while len(self._buffer) >= MULTIPART_CHUNK:
            part = bytes(self._buffer[:MULTIPART_CHUNK])
            del self._buffer[:MULTIPART_CHUNK]
            self._send(part)

    def _send(self, body: bytes) -> None:
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
        etag = etag_of(response) or ""
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


__all__ = ["MULTIPART_CHUNK", "ObjectUpload", "etag_of", "request"]
