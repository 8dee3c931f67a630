"""One run at a time per output: a local folder's ``flock`` lock and a bucket prefix's lease, one holder record.

Both write the same ``LockRecord`` (host, pid, user, flow run) into
``.diffprep/lock.json`` (``lock-shard-NNNN.json`` for a ``--shard-index``
run), and both refuse with the same message naming the holder. A plain run
excludes every shard run and the other way round; shard runs share an output.

- ``OutputLock`` (a folder): the kernel releases an ``flock`` when its process
  dies, so a crashed run never leaves a lock behind; the file's content only
  names the holder. A forked child (Energon's indexing pool, a data loader's
  workers) closes its copy of the descriptor at once, so a child that outlives
  a killed run cannot keep holding the lock.
- ``S3Lock`` (a bucket prefix): a lock object created with a conditional PUT
  (``If-None-Match: *``) and kept alive by a heartbeat; a holder silent for
  ``lease_s`` (by the store's own clock), or whose process on this machine is
  gone, is taken over with another conditional PUT, so two runs cannot both
  take it. The staging folder is ``flock``-ed too, for runs on one machine.
"""

from __future__ import annotations

import fcntl
import getpass
import json
import logging
import os
import socket
import threading
from dataclasses import asdict, dataclass
from email.utils import parsedate_to_datetime
from pathlib import Path
from typing import Any, Protocol

from diffprep import contract
from diffprep.errors import LockedError
from diffprep.writer.links import no_link_below
from diffprep.sources.storage import ObjectChangedError


class LockedPrefix(Protocol):
    """What an ``S3Lock`` uses of its output (``diffprep.output.s3.S3Output``): its staging folder and URL, its
    objects, one request."""

    local: Path
    uri: str

    def objects(self, refresh: bool = False) -> dict[str, Any]: ...

    def request(self, operation: str, relative: str, **params: Any) -> Any: ...

log = logging.getLogger(__name__)

LOCK_LEASE_S = 300.0  # a bucket lock not refreshed for this long belongs to a dead run and may be taken over
LEASE_ENV = "DIFFPREP_S3_LOCK_LEASE"


@dataclass
class LockRecord:
    """Who holds a lock; ``lease_s`` only for a bucket's lease."""

    host: str
    pid: int
    user: str
    run: str | None = None
    lease_s: float | None = None

    @classmethod
    def mine(cls, run: str | None, lease_s: float | None = None) -> LockRecord:
        return cls(socket.gethostname(), os.getpid(), getpass.getuser(), run, lease_s)

    @classmethod
    def parse(cls, data: bytes | str) -> LockRecord | None:
        try:
            return cls(**json.loads(data))
        except (ValueError, TypeError):
            return None

    def to_bytes(self) -> bytes:
        return json.dumps({k: v for k, v in asdict(self).items() if v is not None or k == "run"}).encode()

    def who(self) -> str:
        return f"host {self.host}, pid {self.pid}, user {self.user}" + (f", flow run {self.run}" if self.run else "")

    def dead_here(self) -> bool:
        """A holder on this machine whose process is gone: its lock need not wait out a lease."""
        return self.host == socket.gethostname() and self.pid > 0 and not pid_alive(self.pid)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def is_shard_lock(name: str) -> bool:
    return contract.is_lock_file(name) and name != contract.LOCK_FILE


def locked_error(where: str, holder: LockRecord | None, *, kind: str = "another run", then: str) -> LockedError:
    """The one refusal message: where, who holds it, what to do."""
    who = holder.who() if holder else "holder unknown"
    return LockedError(f"{where} is being written by {kind} ({who}). Wait for it to finish, or stop it; {then}")


LOCAL_THEN = "its lock goes away with its process."

_HELD_FDS: set[int] = set()  # this process's flock-ed lock descriptors


def _close_in_child() -> None:
    """After ``fork``: drop the child's copies; the lock stays with the parent's descriptor."""
    for fd in _HELD_FDS:
        try:
            os.close(fd)
        except OSError:
            pass
    _HELD_FDS.clear()


os.register_at_fork(after_in_child=_close_in_child)


def _held(path: Path) -> bool:
    """Whether some process holds the flock on ``path`` (tried without waiting, released at once)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


class OutputLock:
    """A folder's lock: ``.diffprep/lock.json`` held with ``flock``, naming its holder.

    Taking the lock checks that the locked file is still the one at the path
    (another run may have just released and removed it).
    """

    def __init__(self, out_dir: str | os.PathLike, run: str | None = None, *, shard: int | None = None,
                 label: str | None = None) -> None:
        """``shard``: the lock of one manual shard (``--shard-index``); ``label``: how messages name the output."""
        self.path = Path(out_dir) / contract.STATE_DIR / contract.lock_file_name(shard)
        self.label = label or str(Path(out_dir))
        self.me = LockRecord.mine(run)
        self._fd: int | None = None
        self._shard = shard

    def acquire(self) -> None:
        if self._fd is not None:
            return
        no_link_below(self.path.parents[1], self.path)  # the lock file of a folder whose .diffprep is a link: not ours
        self.path.parent.mkdir(parents=True, exist_ok=True)
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise locked_error(self.label, self.holder(), then=LOCAL_THEN) from None
            try:
                same_file = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same_file = False
            if not same_file:  # released and removed between our open and our flock: try again
                os.close(fd)
                continue
            os.ftruncate(fd, 0)
            os.write(fd, self.me.to_bytes())
            os.fsync(fd)
            self._fd = fd
            _HELD_FDS.add(fd)
            conflict = self._conflict()
            if conflict is not None:
                self.release()
                raise conflict
            return

    def _conflict(self) -> LockedError | None:
        """A plain run excludes every shard run and the other way round."""
        state = self.path.parent
        others = ([state / contract.LOCK_FILE] if self._shard is not None
                  else sorted(p for p in state.glob("lock-shard-*.json") if is_shard_lock(p.name)))
        for path in others:
            if path.is_file() and _held(path):
                try:
                    holder = LockRecord.parse(path.read_bytes())
                except OSError:
                    holder = None
                kind = "a plain run" if self._shard is not None else "a --shard-index run"
                return locked_error(self.label, holder, kind=kind, then=f"{path.name} goes away with its process.")
        return None

    def holder(self) -> LockRecord | None:
        try:
            return LockRecord.parse(self.path.read_bytes())
        except OSError:
            return None

    def release(self) -> None:
        if self._fd is None:
            return
        self.path.unlink(missing_ok=True)  # before unlocking: a waiting run then sees a fresh file
        _HELD_FDS.discard(self._fd)
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None

    def __enter__(self) -> OutputLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class S3Lock:
    """A bucket prefix's lock: a lease object rewritten (``If-Match`` its ETag) every third of ``lease_s``."""

    def __init__(self, output: LockedPrefix, run: str | None, *, shard: int | None = None,
                 lease_s: float | None = None) -> None:
        self.output = output
        self.shard = shard
        self.relative = f"{contract.STATE_DIR}/{contract.lock_file_name(shard)}"
        lease = float(os.environ.get(LEASE_ENV, lease_s or LOCK_LEASE_S))
        self.me = LockRecord.mine(run, lease)
        self._local = OutputLock(output.local, run, shard=shard, label=output.uri)
        self._etag: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.lost = False

    def _then(self, holder: LockRecord | None) -> str:
        lease = holder.lease_s if holder and holder.lease_s else LOCK_LEASE_S
        return f"a lock left by a run that died expires {lease:.0f} s after its last heartbeat"

    def _put(self, **condition: str) -> str:
        return self.output.request("PutObject", self.relative, Body=self.me.to_bytes(),
                                   ContentType="application/json", **condition)["ETag"]

    def _read(self, relative: str) -> tuple[LockRecord | None, str | None, float]:
        """(holder, ETag, seconds since the store last wrote it); (None, None, 0) when there is no lock object."""
        try:
            response = self.output.request("GetObject", relative)
        except FileNotFoundError:
            return None, None, 0.0
        body = response["Body"].read()
        headers = response.get("ResponseMetadata", {}).get("HTTPHeaders", {})
        age = 0.0
        if headers.get("date") and response.get("LastModified"):
            age = (parsedate_to_datetime(headers["date"]) - response["LastModified"]).total_seconds()
        record = LockRecord.parse(body) or LockRecord("unknown", 0, "unknown")
        return record, response.get("ETag"), age

    def _live(self, holder: LockRecord | None, age: float) -> bool:
        return holder is not None and age < (holder.lease_s or LOCK_LEASE_S) and not holder.dead_here()

    def _refused(self, holder: LockRecord | None, kind: str = "another run") -> LockedError:
        return locked_error(self.output.uri, holder, kind=kind, then=self._then(holder))

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
            if self._live(holder, age):
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
            plain, shard_lock = rest == contract.LOCK_FILE, is_shard_lock(rest)
            if (self.shard is None and shard_lock) or (self.shard is not None and plain):
                holder, _, age = self._read(name)
                if self._live(holder, age):
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
                self.output.request("DeleteObject", self.relative)
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


__all__ = ["LOCK_LEASE_S", "LockRecord", "OutputLock", "S3Lock", "locked_error", "pid_alive"]
