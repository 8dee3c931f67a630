"""S3-compatible object storage through boto3: ``s3://`` URLs, a retrying client, listings, globs, streamed reads.

Credentials come from the standard AWS chain (``AWS_ACCESS_KEY_ID`` /
``AWS_SECRET_ACCESS_KEY`` / ``AWS_SESSION_TOKEN``, ``AWS_PROFILE`` or a named
profile, an instance or container role); nothing here takes a secret as an
argument, and no message or description holds one. An endpoint URL selects a
non-AWS store (MinIO, Ceph, R2); unset, boto3 also honours ``AWS_ENDPOINT_URL``.

Failures are sorted by what helps:

- throttling (``SlowDown``...), 5xx answers and lost connections are retried by
  botocore's ``standard`` mode (exponential backoff with jitter, up to
  ``MAX_ATTEMPTS`` attempts); a body that breaks off mid-read is resumed with a
  ranged GET pinned to the object's ETag. When the retries run out:
  ``StorageUnavailableError``, a ``ConnectionError`` so task retries see it as transient;
- a missing bucket, refused credentials or a bucket policy that denies us
  (``NoSuchBucket``, ``AccessDenied``, 403...): ``SourceError`` at once, naming
  the bucket and the operation; no retry can help;
- a missing object: ``FileNotFoundError``; a failed condition:
  ``ObjectChangedError``; any other refusal for one object: ``OSError``.
"""

from __future__ import annotations

import io
import re
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import TYPE_CHECKING, Any

import braceexpand
from botocore.config import Config
from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    CredentialRetrievalError,
    HTTPClientError,
    IncompleteReadError,
    NoCredentialsError,
    ProfileNotFound,
)
from botocore.exceptions import ConnectionError as BotoConnectionError

from diffprep.errors import SourceError

if TYPE_CHECKING:
    from botocore.client import BaseClient

S3_SCHEME = "s3://"
MAX_ATTEMPTS = 10  # attempts per request, the first included; backoff sleeps rand(0, 1) * min(2 ** n, 20) s
MAX_RESUMES = 5  # ranged re-GETs of one object body whose connection broke off
READ_BUFFER = 1 << 20
CONNECT_TIMEOUT_S = 10
MAX_CONNECTIONS = 32  # per client: concurrent checks and upload parts
READ_TIMEOUT_S = 60

# What botocore itself accepts as a bucket name: AWS's own rules are stricter,
# but MinIO, Ceph and older buckets allow upper case and underscores.
_BUCKET = re.compile(r"^[A-Za-z0-9._-]{1,255}$")
_GLOB_MAGIC = re.compile(r"[*?\[{]")
_MISSING_BUCKET = frozenset({"NoSuchBucket"})
_MISSING_KEY = frozenset({"NoSuchKey", "404", "NotFound"})
_DENIED = frozenset({
    "AccessDenied", "AllAccessDisabled", "AccountProblem", "ExpiredToken", "InvalidAccessKeyId",
    "InvalidToken", "SignatureDoesNotMatch", "TokenRefreshRequired", "403", "Forbidden",
})
CREDENTIALS_HINT = (
    "check the credentials (AWS_PROFILE or s3_profile, AWS_ACCESS_KEY_ID + AWS_SECRET_ACCESS_KEY, "
    "or the instance role) and the bucket policy"
)


class StorageUnavailableError(SourceError, ConnectionError):
    """The store kept throttling, failing (5xx) or dropping the connection after every retry: try again later."""


class ObjectChangedError(OSError):
    """A conditional request (``If-Match`` / ``If-None-Match``) failed: someone else changed the object."""


@dataclass(frozen=True)
class S3Url:
    bucket: str
    key: str = ""

    def __str__(self) -> str:
        return f"{S3_SCHEME}{self.bucket}/{self.key}"

    def join(self, relative: str) -> S3Url:
        """The URL of ``relative`` under this key taken as a folder (a ``/`` is added when missing)."""
        folder = self.key if not self.key or self.key.endswith("/") else self.key + "/"
        return S3Url(self.bucket, folder + relative)


def is_s3_url(value: str) -> bool:
    return value[: len(S3_SCHEME)].lower() == S3_SCHEME


def parse_s3_url(url: str, setting: str = "the URL") -> S3Url:
    """``s3://bucket/key`` -> ``S3Url``; a ``SourceError`` naming ``setting`` when it is not one."""
    if not is_s3_url(url):
        raise SourceError(f"{setting} {url!r} is not an s3:// URL; write s3://bucket/prefix")
    bucket, _, key = url[len(S3_SCHEME):].partition("/")
    if not bucket:
        raise SourceError(f"{setting} {url!r} has no bucket name; write s3://bucket/prefix")
    if not _BUCKET.match(bucket):
        raise SourceError(
            f"{setting} {url!r}: {bucket!r} is not a bucket name (letters, digits, '.', '-', '_'; "
            f"no wildcards: a glob may only follow the bucket, as in s3://bucket/shards/*.tar)"
        )
    return S3Url(bucket, key)


def check_endpoint_url(endpoint_url: str, section: str = "source") -> None:
    """Refuse an endpoint that is not ``http(s)://host[:port]``, or that carries credentials (never echoed)."""
    parts = urllib.parse.urlsplit(endpoint_url)
    if parts.username is not None or parts.password is not None:
        raise SourceError(
            f"{section}.s3_endpoint_url holds credentials (user:password@host): give the bare endpoint, and the "
            "credentials through AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY or a profile"
        )
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise SourceError(
            f"{section}.s3_endpoint_url {endpoint_url!r} is not an http(s)://host[:port] URL, "
            f"e.g. http://minio.local:9000"
        )


def s3_client(endpoint_url: str | None = None, profile: str | None = None, *,
              max_attempts: int = MAX_ATTEMPTS, section: str = "source") -> BaseClient:
    """An S3 client from the standard AWS credential chain, retrying throttling, 5xx and connection errors."""
    import boto3  # here, not at the top: a run without a bucket never loads its session machinery

    if endpoint_url:
        check_endpoint_url(endpoint_url, section)
    try:
        session = boto3.session.Session(profile_name=profile or None)
    except ProfileNotFound:
        raise SourceError(
            f"{section}.s3_profile {profile!r} is not a profile in the AWS config files (~/.aws/config, "
            f"~/.aws/credentials, or AWS_CONFIG_FILE): add it, or unset s3_profile to use the default chain"
        ) from None
    config = Config(
        max_pool_connections=MAX_CONNECTIONS,
        retries={"total_max_attempts": max_attempts, "mode": "standard"},
        connect_timeout=CONNECT_TIMEOUT_S,
        read_timeout=READ_TIMEOUT_S,
    )
    return session.client("s3", endpoint_url=endpoint_url or None, config=config)


def storage_error(exc: Exception, url: S3Url, operation: str, client: BaseClient) -> Exception:
    """The exception to raise for a botocore failure of ``operation`` on ``url`` (see the module docstring).

    Messages are built from the error code and the store's message only: no request headers, no keys.
    """
    endpoint = client.meta.endpoint_url
    bucket = f"{S3_SCHEME}{url.bucket}"
    if isinstance(exc, NoCredentialsError):
        return SourceError(f"{bucket}: {operation}: no AWS credentials found; {CREDENTIALS_HINT}")
    if isinstance(exc, ClientError):
        error = exc.response.get("Error", {})
        code = str(error.get("Code", "")) or "unknown"
        message = str(error.get("Message", "")).strip()
        meta = exc.response.get("ResponseMetadata", {})
        status = meta.get("HTTPStatusCode")
        operation = exc.operation_name or operation
        if code in _MISSING_BUCKET:
            return SourceError(
                f"{bucket}: {operation} failed: the bucket does not exist ({code}) at {endpoint}; check the "
                f"bucket name, and s3_endpoint_url for a non-AWS store"
            )
        if code in _DENIED or status == 403:
            return SourceError(f"{bucket}: {operation} refused ({code}) for {url}: {CREDENTIALS_HINT}")
        if code in _MISSING_KEY or status == 404:
            return FileNotFoundError(f"{url} does not exist (any more): {operation} answered {code}")
        if code == "PreconditionFailed":
            return ObjectChangedError(f"{url}: {operation}: the object changed meanwhile (its ETag no longer "
                                      f"matches, or it was created by someone else)")
        if status is None or status >= 500 or status == 429 or code in ("SlowDown", "RequestTimeout"):
            attempts = int(meta.get("RetryAttempts", 0)) + 1
            return StorageUnavailableError(
                f"{url}: {operation} failed after {attempts} attempt(s) ({code}, HTTP {status}): the store is "
                f"throttling or failing; run again later"
            )
        return OSError(f"{url}: {operation} failed ({code}, HTTP {status}): {message}")
    if isinstance(exc, (BotoConnectionError, HTTPClientError)):
        attempts = client.meta.config.retries.get("total_max_attempts", MAX_ATTEMPTS)
        return StorageUnavailableError(
            f"{url}: {operation}: no answer from {endpoint} after {attempts} attempt(s) "
            f"({type(exc).__name__}); check the network and s3_endpoint_url"
        )
    if isinstance(exc, CredentialRetrievalError):  # its text can quote a credential process's output
        return SourceError(f"{bucket}: {operation}: the AWS credentials could not be loaded; {CREDENTIALS_HINT}")
    if isinstance(exc, BotoCoreError):
        return SourceError(f"{url}: {operation} failed: {exc}")
    return exc


@dataclass(frozen=True)
class ObjectInfo:
    key: str
    size: int
    etag: str = ""


def list_objects(client: BaseClient, url: S3Url, *, start_after: str | None = None) -> Iterator[ObjectInfo]:
    """The objects whose key starts with ``url.key``, in key order, one listing page in memory at a time.

    The order is checked: ids must come out the same on every run, and stores
    without sorted listings (S3 Express directory buckets) would break that.
    """
    paginator = client.get_paginator("list_objects_v2")
    extra: dict[str, Any] = {"StartAfter": start_after} if start_after else {}
    previous: str | None = None
    try:
        for page in paginator.paginate(Bucket=url.bucket, Prefix=url.key, **extra):
            for item in page.get("Contents", ()):
                key = item["Key"]
                if previous is not None and key <= previous:
                    raise SourceError(
                        f"{S3_SCHEME}{url.bucket}: the store listed {key!r} after {previous!r}; diffprep needs "
                        f"listings in key order (S3 general purpose buckets, MinIO, Ceph and R2 give it)"
                    )
                previous = key
                yield ObjectInfo(key, int(item.get("Size", 0)), str(item.get("ETag", "")).strip('"'))
    except (ClientError, BotoCoreError) as exc:
        raise storage_error(exc, url, "ListObjectsV2", client) from None


def has_objects(client: BaseClient, url: S3Url) -> bool:
    """Whether any object's key starts with ``url.key`` (one request; also checks the bucket and access)."""
    try:
        response = client.list_objects_v2(Bucket=url.bucket, Prefix=url.key, MaxKeys=1)
    except (ClientError, BotoCoreError) as exc:
        raise storage_error(exc, url, "ListObjectsV2", client) from None
    return bool(response.get("Contents"))


def object_stamp(client: BaseClient, url: S3Url) -> str:
    """``<size>:<ETag>`` of an object (one HEAD request), ``-`` when there is none."""
    try:
        head = client.head_object(Bucket=url.bucket, Key=url.key)
    except (ClientError, BotoCoreError) as exc:
        error = storage_error(exc, url, "HeadObject", client)
        if isinstance(error, FileNotFoundError):
            return "-"
        raise error from None
    return f"{head.get('ContentLength')}:{head.get('ETag', '').strip(chr(34))}"


def object_exists(client: BaseClient, url: S3Url) -> bool:
    try:
        client.head_object(Bucket=url.bucket, Key=url.key)
    except (ClientError, BotoCoreError) as exc:
        error = storage_error(exc, url, "HeadObject", client)
        if isinstance(error, FileNotFoundError):
            return False
        raise error from None
    return True


# --- globs -----------------------------------------------------------------------------------------


def has_glob_magic(text: str) -> bool:
    return _GLOB_MAGIC.search(text) is not None


def glob_match(pattern: str, key: str) -> bool:
    """Whether ``key`` matches ``pattern`` the way a local ``glob(recursive=True)`` matches a path.

    Wildcards stay within one ``/``-separated part, ``**`` alone spans any
    number of parts, and a wildcard does not match a name starting with a dot.
    Case-sensitive, as keys are.
    """
    return _match_parts(pattern.split("/"), key.split("/"))


def _match_parts(patterns: list[str], parts: list[str]) -> bool:
    if not patterns:
        return not parts
    head = patterns[0]
    if head == "**":
        return any(_match_parts(patterns[1:], parts[i:]) for i in range(len(parts) + 1)
                   if not any(p.startswith(".") for p in parts[:i]))
    if not parts:
        return False
    if has_glob_magic(head) and parts[0].startswith(".") and not head.startswith("."):
        return False
    return fnmatchcase(parts[0], head) and _match_parts(patterns[1:], parts[1:])


def glob_objects(client: BaseClient, pattern: S3Url) -> Iterator[ObjectInfo]:
    """Objects whose key matches ``pattern.key`` (wildcards and brace ranges ``{000..099}``), in key order.

    One listing under the pattern's literal prefix (everything before its
    first wildcard or brace), matched key by key: expanded patterns without
    wildcards are looked up in a set, so a range of many shards costs nothing
    per pattern.
    """
    expanded = list(braceexpand.braceexpand(pattern.key))
    exact = {p for p in expanded if not has_glob_magic(p)}
    wild = [p for p in expanded if has_glob_magic(p)]
    magic = _GLOB_MAGIC.search(pattern.key)
    prefix = pattern.key[: magic.start()] if magic else pattern.key
    for info in list_objects(client, S3Url(pattern.bucket, prefix)):
        if info.key in exact or any(glob_match(p, info.key) for p in wild):
            yield info


# --- reading ---------------------------------------------------------------------------------------


class ObjectReader(io.RawIOBase):
    """One object's bytes, streamed from a GET; a body that breaks off is resumed where it stopped.

    The resume is a ranged GET pinned to the first answer's ETag (``If-Match``),
    so an object replaced meanwhile fails with ``OSError`` instead of splicing
    two versions.
    """

    def __init__(self, client: BaseClient, url: S3Url) -> None:
        super().__init__()
        self.url = url
        self.resumes = 0
        self._client = client
        self._position = 0
        self._etag: str | None = None
        self.size = 0
        self._body: Any = None
        self._body = self._get()

    def _get(self) -> Any:
        request: dict[str, Any] = {"Bucket": self.url.bucket, "Key": self.url.key}
        if self._position:
            request.update(Range=f"bytes={self._position}-", IfMatch=self._etag)
        try:
            response = self._client.get_object(**request)
        except (ClientError, BotoCoreError) as exc:
            raise storage_error(exc, self.url, "GetObject", self._client) from None
        if not self._position:
            self._etag = response.get("ETag")
            self.size = int(response.get("ContentLength", 0))
        return response["Body"]

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        while True:
            if self._position >= self.size:
                return 0
            try:
                count = self._body.readinto(buffer)
            except (HTTPClientError, IncompleteReadError) as exc:  # connection lost or timed out mid-body
                if self.resumes >= MAX_RESUMES or self._etag is None:
                    raise StorageUnavailableError(
                        f"{self.url}: the connection broke off at byte {self._position} of {self.size} "
                        f"{self.resumes + 1} time(s) ({type(exc).__name__}); run again later"
                    ) from None
                self.resumes += 1
                self._body.close()
                self._body = self._get()
                continue
            if count == 0:  # the store ended the body early without an error
                raise StorageUnavailableError(
                    f"{self.url}: the body ended at byte {self._position} of {self.size}; run again later"
                )
            self._position += count
            return count

    def readall(self) -> bytes:
        chunks = []
        while chunk := self.read(READ_BUFFER):
            chunks.append(chunk)
        return b"".join(chunks)

    def close(self) -> None:
        if not self.closed and self._body is not None:
            self._body.close()
        super().close()


class RangedObject(io.RawIOBase):
    """One object, seekable: each read is a ranged GET of what is asked from where the stream is (why: a unit's
    rows of a large metadata file in a bucket, read at their offsets without downloading the rest of it)."""

    def __init__(self, client: BaseClient, url: S3Url) -> None:
        super().__init__()
        self.url = url
        self._client = client
        self._position = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._position

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        if whence == io.SEEK_CUR:
            offset += self._position
        elif whence != io.SEEK_SET:
            raise io.UnsupportedOperation("a ranged object seeks from its start or where it is")
        self._position = max(0, offset)
        return self._position

    def readinto(self, buffer: Any) -> int:
        if not len(buffer):
            return 0
        request = {"Bucket": self.url.bucket, "Key": self.url.key,
                   "Range": f"bytes={self._position}-{self._position + len(buffer) - 1}"}
        try:
            response = self._client.get_object(**request)
            data = response["Body"].read()
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") == "InvalidRange":
                return 0  # at or past the end
            raise storage_error(exc, self.url, "GetObject", self._client) from None
        except IncompleteReadError:  # the body broke off: the store, not the object
            raise StorageUnavailableError(f"{self.url}: a ranged read at byte {self._position} broke off; run "
                                          "again later") from None
        except BotoCoreError as exc:
            raise storage_error(exc, self.url, "GetObject", self._client) from None
        count = min(len(data), len(buffer))
        buffer[:count] = data[:count]
        self._position += count
        return count


def open_ranged(client: BaseClient, url: S3Url, buffer: int = 256 * 1024) -> io.BufferedReader:
    """A seekable stream of the object that reads only where it is read, ``buffer`` bytes a GET."""
    return io.BufferedReader(RangedObject(client, url), buffer)


def open_object(client: BaseClient, url: S3Url) -> io.BufferedReader:
    """A buffered, forward-only stream of the object (``tarfile.open(fileobj=..., mode="r|*")`` reads it)."""
    return io.BufferedReader(ObjectReader(client, url), READ_BUFFER)


def read_object(client: BaseClient, url: S3Url) -> bytes:
    with ObjectReader(client, url) as reader:
        return reader.readall()
