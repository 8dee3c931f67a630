"""An MLPerf-style manifest of already-encoded files: reading it, downloading its files safely, reading their rows.

A manifest is two small text files next to each other: ``<name>.uri`` holds
the base URL of the files, ``<name>.md5`` one ``<md5>  <file name>`` line per
file (MLCommons' storage convention, which Primus's ``data diffusion-ingest``
reads). The base URL may be ``http(s)://``, ``file://`` or a plain path, and
so may the manifest itself.

A file name comes from someone else's manifest: it must be one plain name
(no folder, no ``..``, not absolute, no control characters), or the manifest
is refused before anything is downloaded. A download goes to ``<name>.part``,
is checked against its md5 while it streams, and is renamed only when it
matches; network errors, HTTP 429/5xx and md5 mismatches are retried with
exponential backoff, other HTTP errors are not. ``Prefetcher`` keeps at most
``depth`` files on disk ahead of the unit that reads them.

Several manifests (Primus's ``datasets:`` list, each with a name) are read as
one ``ManifestSet``: a file's id is then ``<dataset>/<file>``, so two datasets
may list the same file name; with one unnamed manifest the id is the file name.
"""

from __future__ import annotations

import hashlib
import logging
import os
import random
import re
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

from diffprep import contract
from diffprep.errors import SourceError

log = logging.getLogger("diffprep.sources.mlperf")

_MD5_RE = re.compile(r"^[0-9a-fA-F]{32}$")
_CHUNK = 1 << 20
_USER_AGENT = "diffprep-ingest"


@dataclass(frozen=True)
class ManifestEntry:
    md5: str
    name: str


@dataclass(frozen=True)
class Manifest:
    location: str  # what was given (the .uri or .md5 file, or their common stem)
    base_url: str
    entries: tuple[ManifestEntry, ...]

    def describe(self) -> dict:
        return {"type": "mlperf", "manifest": self.location, "base_url": self.base_url, "files": len(self.entries)}

    def entry(self, name: str) -> ManifestEntry:
        for entry in self.entries:
            if entry.name == name:
                return entry
        raise SourceError(f"{name} is planned but no longer listed in {self.location}")

    def locate(self, name: str) -> tuple[str, str]:
        """(URL, md5) of the listed file ``name``."""
        return file_url(self.base_url, name), self.entry(name).md5


@dataclass(frozen=True)
class ManifestSet:
    """The manifests of one ingest, in order: ``(None, manifest)`` alone (file ids are the file names), or named
    datasets (file ids ``<dataset>/<file>``)."""

    manifests: tuple[tuple[str | None, Manifest], ...]

    def __post_init__(self) -> None:
        names = [name for name, _ in self.manifests]
        if not names or (None in names and len(names) > 1) or len(set(names)) != len(names):
            raise ValueError(f"a ManifestSet is one unnamed manifest or datasets of distinct names, got {names}")
        for name in names:
            if name is not None:
                safe_file_name(name, "the dataset name")  # a folder of downloads, the prefix of every source id

    def ids(self, dataset: str | None) -> list[str]:
        """The file ids of ``dataset``'s manifest, in name order."""
        manifest = dict(self.manifests)[dataset]
        return [self.file_id(dataset, entry.name) for entry in manifest.entries]

    @staticmethod
    def file_id(dataset: str | None, name: str) -> str:
        return name if dataset is None else f"{dataset}/{name}"

    def dataset_of(self, file_id: str) -> str | None:
        if self.manifests[0][0] is None:
            return None
        dataset, _, _ = file_id.partition("/")
        return dataset

    def locate(self, file_id: str) -> tuple[str, str]:
        """(URL, md5) of a file by its id."""
        dataset = self.dataset_of(file_id)
        manifests = dict(self.manifests)
        if dataset not in manifests:
            raise SourceError(f"{file_id} is planned but no dataset of this ingest is named {dataset!r}")
        name = file_id if dataset is None else file_id.removeprefix(f"{dataset}/")
        return manifests[dataset].locate(name)

    def describe(self) -> dict:
        if self.manifests[0][0] is None:
            return self.manifests[0][1].describe()
        return {"type": "mlperf", "datasets": [{"name": name, **manifest.describe()}
                                               for name, manifest in self.manifests]}


def safe_file_name(name: str, where: str = "the manifest") -> str:
    """``name`` when it is one plain file name that stays inside the folder it is written to; else a SourceError."""
    bad = (not name or name in (".", "..") or "/" in name or "\\" in name or name.startswith("~")
           or any(ord(c) < 32 or ord(c) == 127 for c in name) or re.match(r"^[A-Za-z]:", name) is not None)
    if bad:
        raise SourceError(f"{where} names the file {name!r}, which is not one plain file name (a folder, '..', an "
                          "absolute path or a control character could write outside the download folder): "
                          "refused; fix the manifest")
    return name


def manifest_locations(location: str) -> tuple[str, str]:
    """The ``.uri`` and ``.md5`` files of a manifest given as either of them or as their common stem."""
    for suffix in (contract.MANIFEST_URI_SUFFIX, contract.MANIFEST_MD5_SUFFIX):
        if location.endswith(suffix):
            location = location[: -len(suffix)]
            break
    return location + contract.MANIFEST_URI_SUFFIX, location + contract.MANIFEST_MD5_SUFFIX


def parse_md5_lines(text: str, where: str) -> tuple[ManifestEntry, ...]:
    """The entries of an ``.md5`` file, sorted by name; a malformed line, a bad md5 or name, or a name twice is
    refused with its line number."""
    entries: dict[str, ManifestEntry] = {}
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        parts = line.strip().split(None, 1)
        if len(parts) != 2 or not _MD5_RE.match(parts[0]):
            raise SourceError(f"{where} line {number}: expected '<32 hex digits>  <file name>', got {line!r}")
        md5, name = parts[0].lower(), parts[1].strip().removeprefix("*")  # md5sum's binary-mode marker
        safe_file_name(name, f"{where} line {number}")
        if name in entries:
            raise SourceError(f"{where} line {number}: {name} is listed twice")
        entries[name] = ManifestEntry(md5, name)
    if not entries:
        raise SourceError(f"{where} lists no files")
    return tuple(entries[name] for name in sorted(entries))


def read_manifest(location: str, *, retries: int = 5, backoff_s: float = 1.0, timeout_s: float = 60.0) -> Manifest:
    """The manifest at ``location`` (``<name>.uri`` / ``<name>.md5`` / ``<name>``), each file fetched with retries."""
    uri, md5 = manifest_locations(location)
    base = fetch_text(uri, retries=retries, backoff_s=backoff_s, timeout_s=timeout_s).strip()
    if not base or len(base.splitlines()) != 1:
        raise SourceError(f"{uri} must hold one line, the base URL of the files; it holds {base[:200]!r}")
    entries = parse_md5_lines(fetch_text(md5, retries=retries, backoff_s=backoff_s, timeout_s=timeout_s), md5)
    return Manifest(location, base, entries)


def file_url(base_url: str, name: str) -> str:
    """The URL (or path) of a manifest's file: the base URL joined with the quoted plain name."""
    safe_file_name(name)
    if _scheme(base_url) in ("http", "https", "file"):
        return base_url.rstrip("/") + "/" + urllib.parse.quote(name)
    return os.path.join(base_url, name)


def _scheme(location: str) -> str:
    return urllib.parse.urlsplit(location).scheme.lower() if "://" in location else ""


def _open(location: str, timeout_s: float):
    scheme = _scheme(location)
    if scheme in ("http", "https"):
        request = urllib.request.Request(location, headers={"User-Agent": _USER_AGENT})
        return urllib.request.urlopen(request, timeout=timeout_s)  # noqa: S310 - http(s) only, checked above
    if scheme == "file":
        return open(urllib.request.url2pathname(urllib.parse.urlsplit(location).path), "rb")
    if scheme:
        raise SourceError(f"{location}: only http://, https://, file:// and plain paths can be read")
    return open(os.path.expanduser(location), "rb")


def _retryable(error: BaseException) -> bool:
    if isinstance(error, urllib.error.HTTPError):
        return error.code == 429 or 500 <= error.code < 600
    if isinstance(error, (FileNotFoundError, PermissionError, IsADirectoryError)):
        return False
    return isinstance(error, (urllib.error.URLError, TimeoutError, ConnectionError, OSError, Md5Mismatch))


class Md5Mismatch(Exception):
    """A download whose bytes do not have the manifest's md5."""


def _with_retries(what: str, attempt, *, retries: int, backoff_s: float):
    """``attempt()``, retried ``retries`` times with exponential backoff (and jitter) on transient errors."""
    for n in range(retries + 1):
        try:
            return attempt()
        except Exception as error:  # noqa: BLE001 - sorted by _retryable; the last one is raised as a SourceError
            if not _retryable(error) or n == retries:
                tries = f"after {n + 1} attempt{'s' if n else ''}"
                raise SourceError(f"{what} failed {tries}: {type(error).__name__}: {error}") from error
            delay = min(backoff_s * 2**n, 60.0) * (1 + random.random() / 4)
            log.warning("%s: %s: %s; retry %d of %d in %.1f s", what, type(error).__name__, error, n + 1, retries,
                        delay)
            time.sleep(delay)
    raise AssertionError("unreachable")


def fetch_text(location: str, *, retries: int = 5, backoff_s: float = 1.0, timeout_s: float = 60.0) -> str:
    def attempt() -> str:
        with _open(location, timeout_s) as stream:
            return stream.read().decode("utf-8")

    return _with_retries(f"reading {location}", attempt, retries=retries, backoff_s=backoff_s)


def download(url: str, dest: Path, md5: str, *, retries: int = 5, backoff_s: float = 1.0,
             timeout_s: float = 300.0) -> Path:
    """``url`` into ``dest`` once its md5 matches (through ``dest.part``, fsynced, renamed); a file already at
    ``dest`` with that md5 is kept (a download a killed run finished)."""
    dest = Path(dest)
    if dest.is_file() and file_md5(dest) == md5:
        return dest
    part = dest.with_name(dest.name + contract.DOWNLOAD_PART_SUFFIX)

    def attempt() -> Path:
        digest = hashlib.md5(usedforsecurity=False)
        dest.parent.mkdir(parents=True, exist_ok=True)
        try:
            with _open(url, timeout_s) as stream, open(part, "wb") as handle:
                while chunk := stream.read(_CHUNK):
                    digest.update(chunk)
                    handle.write(chunk)
                handle.flush()
                os.fsync(handle.fileno())
            if digest.hexdigest() != md5:
                raise Md5Mismatch(f"{dest.name} has md5 {digest.hexdigest()}, the manifest lists {md5}")
        except BaseException:
            part.unlink(missing_ok=True)
            raise
        os.replace(part, dest)
        return dest

    return _with_retries(f"downloading {url}", attempt, retries=retries, backoff_s=backoff_s)


def file_md5(path: Path) -> str:
    digest = hashlib.md5(usedforsecurity=False)
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def local_path(folder: Path, file_id: str) -> Path:
    """Where the file ``file_id`` (``<file>`` or ``<dataset>/<file>``, each part one plain name) is downloaded."""
    return Path(folder).joinpath(*(safe_file_name(part) for part in file_id.split("/")))


class Prefetcher:
    """The files of ``names`` downloaded in order into ``folder`` on ``workers`` threads, at most ``depth`` on disk
    (or downloading) ahead of the reader: ``get(name)`` waits for one, ``release(name)`` removes it and makes room.
    ``close()`` stops the downloads that have not started; a ``.part`` file is never left behind. ``manifest``
    (a ``Manifest`` or a ``ManifestSet``) locates each name: ``locate(name) -> (url, md5)``."""

    def __init__(self, manifest: Manifest | ManifestSet, names: Sequence[str], folder: Path, *, depth: int = 4,
                 workers: int = 2, retries: int = 5, backoff_s: float = 1.0, timeout_s: float = 300.0) -> None:
        self.manifest, self.folder = manifest, Path(folder)
        self.options = {"retries": retries, "backoff_s": backoff_s, "timeout_s": timeout_s}
        self._slots = threading.Semaphore(max(1, depth))
        self._futures: dict[str, Future] = {}
        self._lock = threading.Condition()
        self._closed = threading.Event()
        self._pool = ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="diffprep-download")
        self._names = list(names)
        self._feeder = threading.Thread(target=self._feed, name="diffprep-prefetch", daemon=True)
        self._feeder.start()

    def path(self, name: str) -> Path:
        return local_path(self.folder, name)

    def _feed(self) -> None:
        for name in self._names:
            while not self._slots.acquire(timeout=0.2):
                if self._closed.is_set():
                    return
            if self._closed.is_set():
                return
            try:
                url, md5 = self.manifest.locate(name)
                future = self._pool.submit(download, url, self.path(name), md5, **self.options)
            except Exception as error:  # noqa: BLE001 - a name the manifest lost, a pool shut down: get() raises it
                future = Future()
                future.set_exception(error)
            with self._lock:
                self._futures[name] = future
                self._lock.notify_all()

    def get(self, name: str) -> Path:
        """The downloaded, md5-checked file ``name`` (waits for it); its download's error, if it failed."""
        if name not in self._names:
            raise SourceError(f"{name} is not one of the files this prefetcher downloads")
        with self._lock:
            while name not in self._futures:
                if self._closed.is_set():
                    raise SourceError(f"the downloads stopped before {name}")
                self._lock.wait(timeout=0.2)
            future = self._futures[name]
        return future.result()

    def release(self, name: str) -> None:
        """``name`` is no longer needed: removed from disk, and its slot goes to the next download."""
        with self._lock:
            future = self._futures.pop(name, None)
        if future is not None:
            if future.done() and future.exception() is None:
                self.path(name).unlink(missing_ok=True)
            self._slots.release()

    def close(self) -> None:
        self._closed.set()
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._feeder.join()

    def __enter__(self) -> "Prefetcher":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def clear_partial_downloads(folder: Path, keep: Sequence[str] = ()) -> list[str]:
    """Remove what killed runs left in the download folder: every ``.part`` file, and files whose id (their path
    under ``folder``: ``<file>`` or ``<dataset>/<file>``) is not in ``keep``; then the dataset folders left empty."""
    removed = []
    if folder.is_dir():
        for path in sorted(folder.rglob("*")):
            relative = path.relative_to(folder).as_posix()
            if path.is_file() and (path.name.endswith(contract.DOWNLOAD_PART_SUFFIX) or relative not in keep):
                path.unlink()
                removed.append(relative)
        for path in sorted((p for p in folder.rglob("*") if p.is_dir()), reverse=True):
            if not any(path.iterdir()):
                path.rmdir()
    return removed


def arrow_rows(path: Path) -> Iterator[dict[str, bytes | str | None]]:
    """The rows of an Arrow IPC stream file, one record batch in memory at a time: each a dict of its columns
    (``contract.MLPERF_COLUMNS`` and ``__key__`` where the file has them) as Python bytes/str/None."""
    import pyarrow as pa
    import pyarrow.ipc

    wanted = (*contract.MLPERF_COLUMNS, contract.MLPERF_KEY_COLUMN)
    try:
        with pa.memory_map(str(path), "r") as source:
            reader = pyarrow.ipc.open_stream(source)
            names = [n for n in reader.schema.names if n in wanted]
            for batch in reader:
                columns = {n: batch.column(n).to_pylist() for n in names}
                for row in range(batch.num_rows):
                    yield {n: columns[n][row] for n in names}
    except pa.ArrowInvalid as error:
        raise SourceError(f"{path.name} is not an Arrow IPC stream file: {error}") from None


__all__ = ["Manifest", "ManifestEntry", "ManifestSet", "Md5Mismatch", "Prefetcher", "arrow_rows",
           "clear_partial_downloads", "download", "file_md5", "file_url", "local_path", "manifest_locations",
           "parse_md5_lines", "read_manifest", "safe_file_name"]
