"""Phase 2, verify existing: what the output already holds, and what this run may do with it.

Empty: go on. Same fingerprint: resume (or skip when complete). Anything else
(other settings, other shapes, files that are not ours) needs an explicit
choice: ``resume`` (same settings only), ``new-dir``, ``overwrite`` or
``abort``. Nothing is deleted here without that choice.
"""

from __future__ import annotations

import fcntl
import getpass
import json
import os
import shutil
import socket
import tarfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from diffprep import contract
from diffprep.approvals import ABORT, Question
from diffprep.errors import ExistingOutputError, LockedError
from diffprep.outputs import Output, clear_staged_state, is_ours, open_output
from diffprep.plan import Plan, read_plan
from diffprep.shards import load_tensor, read_manifests, temp_pid

CHOICES = ("resume", "new-dir", "overwrite", "reuse", "abort")
CHECK_THREADS = 16  # concurrent shard checks against a bucket


@dataclass
class Inspection:
    """What an output directory holds, compared with the plan of this run."""

    out_dir: str
    exists: bool
    empty: bool
    plan_fingerprint: str | None  # fingerprint of the plan found there
    same_settings: bool
    units_done: list[int] = field(default_factory=list)
    units_left: list[int] = field(default_factory=list)
    damaged_units: list[int] = field(default_factory=list)  # manifest present, shard missing or of another size
    foreign: list[str] = field(default_factory=list)  # top-level entries that diffprep did not write
    unmanaged: list[str] = field(default_factory=list)  # shard-named files without a manifest: a run rewrites them
    shape_problem: str | None = None
    bytes_on_disk: int = 0

    @property
    def matches(self) -> bool:
        """Same settings and shapes: safe to resume without asking."""
        return self.same_settings and self.shape_problem is None

    @property
    def complete(self) -> bool:
        return self.matches and not self.units_left and not self.damaged_units

    def describe(self) -> str:
        """Markdown: what exists, what would be lost, the choices."""
        lines = [f"**Output:** `{self.out_dir}`", ""]
        if self.plan_fingerprint is None:
            lines.append("- holds no diffprep plan")
        elif not self.same_settings:
            lines.append(f"- was written with other settings (fingerprint `{self.plan_fingerprint}`)")
        if self.shape_problem:
            lines.append(f"- its samples do not match this run's shapes: {self.shape_problem}")
        if self.units_done:
            lines.append(f"- {len(self.units_done)} finished shard(s)")
        if self.foreign:
            shown = ", ".join(f"`{name}`" for name in self.foreign[:10])
            more = f" and {len(self.foreign) - 10} more" if len(self.foreign) > 10 else ""
            lines.append(f"- {len(self.foreign)} file(s) diffprep did not write: {shown}{more}")
        if self.unmanaged:
            shown = ", ".join(f"`{name}`" for name in self.unmanaged[:10])
            more = f" and {len(self.unmanaged) - 10} more" if len(self.unmanaged) > 10 else ""
            lines.append(f"- {len(self.unmanaged)} shard-named file(s) with no diffprep manifest, which "
                         f"`overwrite` deletes and encoding rewrites: {shown}{more}")
        lines.append(f"- {_human_bytes(self.bytes_on_disk)} in all")
        lines += [
            "",
            "**Choices** (`--on-existing` / `on_existing`):",
            "- `new-dir`: leave it untouched and write to the next free `<out>-v2`, `-v3`...",
            "- `overwrite`: delete diffprep's shards, metadata and state there, then encode anew"
            + (" (files diffprep did not write stay)" if self.foreign else ""),
            "- `reuse`: keep it as it is and encode nothing",
            "- `abort`: change nothing",
        ]
        return "\n".join(lines)

    @property
    def needs_choice(self) -> bool:
        """Holds data this run cannot simply resume: someone must choose what happens to it."""
        return not self.empty and not self.matches

    def question(self) -> Question:
        return Question(
            key="existing-output",
            title=f"The output {self.out_dir} already holds data this run would change",
            description=self.describe(),
            choices=("new-dir", "overwrite", "reuse", ABORT),
            preset_hint="--on-existing new-dir|overwrite|reuse|abort (flow parameter output.on_existing)",
        )


def _human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def _state_is_empty(state: Path) -> bool:
    """A state folder without a plan or any manifest (e.g. only a lock or temp files) holds no data."""
    return not (state / contract.PLAN_JSON).exists() and not any((state / contract.UNITS_DIR).glob("*.json"))


def _check_shapes(output: Output, plan: Plan, manifests) -> str | None:
    """Load the first sample of one finished shard (weights only) and compare its shapes with the plan."""
    for manifest in manifests.values():
        if not manifest.keys:
            continue
        key = manifest.keys[0]
        wanted = {f"{key}.{field}": field for field in contract.TENSOR_FIELDS}
        try:
            with output.open(manifest.shard) as stream, tarfile.open(fileobj=stream, mode="r|") as tar:
                for member in tar:
                    if not member.name.startswith(key + "."):
                        break  # the first sample is over: read no further (a bucket streams the rest otherwise)
                    field_name = wanted.get(member.name)
                    if field_name is None:
                        continue
                    tensor = load_tensor(tar.extractfile(member).read(), key=key, field=field_name)
                    problem = _compare_shape(field_name, tensor, plan.expected)
                    if problem:
                        return f"{manifest.shard}:{key}: {problem}"
        except Exception as exc:  # noqa: BLE001 - any unreadable sample is a mismatch to report, not a crash
            return f"{manifest.shard}:{key} cannot be read ({type(exc).__name__}: {exc})"
        return None
    return None


def _compare_shape(field_name: str, tensor, expected: dict) -> str | None:
    if not isinstance(tensor, torch.Tensor):
        return f"{field_name} holds a {type(tensor).__name__}, not a tensor"
    want = expected.get(contract.field_stem(field_name))
    if want is None:
        return None
    have = list(tensor.shape)
    if len(have) != len(want) or any(w is not None and w != h for w, h in zip(want, have)):
        return f"{field_name} has shape {have}, this run writes {want}"
    dtype = expected.get("dtype")
    if dtype and str(tensor.dtype).removeprefix("torch.") != dtype:
        return f"{field_name} has dtype {tensor.dtype}, this run writes {dtype}"
    return None


def inspect_output(out_dir: str | os.PathLike | Output, plan: Plan) -> Inspection:
    """What the output holds against ``plan``; a bucket prefix's state is pulled into its staging folder first."""
    output = open_output(out_dir)
    if not output.remote:
        if not output.local.exists():
            return Inspection(output.uri, exists=False, empty=True, plan_fingerprint=None, same_settings=True,
                              units_left=[u.unit for u in plan.units])
        if not output.local.is_dir():
            raise ExistingOutputError(f"output {output.uri} exists and is not a directory")
    output.pull_state()
    out = output.local
    entries = output.entries()
    if not entries or (entries == [contract.STATE_DIR] and _state_is_empty(out / contract.STATE_DIR)):
        return Inspection(output.uri, exists=output.exists(), empty=True, plan_fingerprint=None, same_settings=True,
                          units_left=[u.unit for u in plan.units])
    old = read_plan(out)
    manifests = read_manifests(out)
    same = old is not None and old.fingerprint == plan.fingerprint
    candidates = [manifests[u.unit] for u in plan.units
                  if u.unit in manifests and manifests[u.unit].fingerprint == plan.fingerprint]
    # A bucket answers each check in a round trip or two: many at once.
    with ThreadPoolExecutor(CHECK_THREADS if output.remote else 1) as pool:
        committed = list(pool.map(output.committed, candidates))
    done = [m.unit for m, ok in zip(candidates, committed) if ok]
    damaged = [m.unit for m, ok in zip(candidates, committed) if not ok]
    left = [u.unit for u in plan.units if u.unit not in done and u.unit not in damaged]
    inspection = Inspection(
        output.uri,
        exists=True,
        empty=False,
        plan_fingerprint=old.fingerprint if old else None,
        same_settings=same,
        units_done=done if same else [],
        units_left=left if same else [u.unit for u in plan.units],
        damaged_units=damaged if same else [],
        foreign=[name for name in entries if not is_ours(name)],
        unmanaged=sorted(name for name in entries if contract.unit_of_shard(name) is not None
                         and contract.unit_of_shard(name) not in manifests),
        bytes_on_disk=output.total_bytes(),
    )
    if same:
        inspection.shape_problem = _check_shapes(output, plan, {u: manifests[u] for u in done})
    return inspection


@dataclass
class Decision:
    action: str  # fresh | resume | complete | new-dir | overwrite | reuse
    out_dir: str
    inspection: dict

    def to_json(self) -> dict:
        return asdict(self)


def next_free_dir(out_dir: str | os.PathLike | Output) -> str:
    """``<out>-v2``, ``-v3``...: the first that does not exist or is empty (a path, or an s3:// URL)."""
    return open_output(out_dir).next_free().uri


def decide(inspection: Inspection, on_existing: str | None, output: Output | None = None) -> Decision:
    """Turn an inspection and the user's explicit choice (or none) into an action.

    Raises ExistingOutputError when the output needs a choice that was not given,
    or when the choice is ``abort`` or cannot apply.
    """
    if on_existing is not None and on_existing not in CHOICES:
        raise ExistingOutputError(f"on_existing must be one of {', '.join(CHOICES)}, got {on_existing!r}")
    summary = asdict(inspection)
    if inspection.empty:
        return Decision("fresh", inspection.out_dir, summary)
    if inspection.matches:
        # Same settings: nothing would be lost, so nothing is asked and no preset answer applies
        # (a nightly run with on_existing=overwrite must append, not re-encode everything).
        return Decision("complete" if inspection.complete else "resume", inspection.out_dir, summary)
    if on_existing is None:
        raise ExistingOutputError(
            "the output directory already holds data that this run would change:\n"
            + inspection.describe()
            + "\n\nRe-run with --on-existing new-dir|overwrite|reuse|abort to say what to do."
        )
    if on_existing == "abort":
        raise ExistingOutputError(f"aborted (on_existing=abort); nothing under {inspection.out_dir} was changed")
    if on_existing == "resume":
        reason = inspection.shape_problem or "it was written with other settings"
        raise ExistingOutputError(
            f"cannot resume {inspection.out_dir}: {reason}. Resume needs the same settings; "
            "choose --on-existing new-dir or overwrite, or run with the settings in its .diffprep/plan.json."
        )
    if on_existing == "new-dir":
        return Decision("new-dir", next_free_dir(output or inspection.out_dir), summary)
    if on_existing == "reuse":
        return Decision("reuse", inspection.out_dir, summary)
    return Decision("overwrite", inspection.out_dir, summary)


def clear_output(out_dir: str | os.PathLike | Output) -> list[str]:
    """Delete what diffprep wrote under ``out_dir`` (only after an approved overwrite).

    Files diffprep did not write are left where they are. Returns what was removed.
    """
    output = open_output(out_dir)
    if output.remote:
        removed = output.delete_ours()
        clear_staged_state(output)
        return removed
    out = output.local
    removed = []
    for name in sorted(os.listdir(out)):
        if not is_ours(name):
            continue
        path = out / name
        if name == contract.STATE_DIR:
            # Keep the lock of the run doing the overwrite.
            for child in sorted(path.iterdir()):
                if child.name == contract.LOCK_FILE:
                    continue
                shutil.rmtree(child) if child.is_dir() else child.unlink()
        elif path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
        removed.append(name)
    return removed


def clear_dead_temp_files(out_dir: str | os.PathLike) -> list[str]:
    """Remove temporary files that writers on this host left when they died: never committed, never data.

    Looks under ``<out>/.diffprep`` (temporary shards and state files); files
    of live processes and of other hosts are left alone.
    """
    state = Path(out_dir) / contract.STATE_DIR
    host = socket.gethostname()
    removed = []
    for root, _dirs, files in os.walk(state):
        for name in sorted(files):
            pid = temp_pid(name, host)
            if pid is None or _pid_alive(pid):
                continue
            path = Path(root) / name
            path.unlink(missing_ok=True)
            removed.append(str(path.relative_to(out_dir)))
    return sorted(removed)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# --- one run at a time per output -------------------------------------------------------------


@dataclass
class LockHolder:
    host: str
    pid: int
    user: str
    run: str | None = None


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
    """One run at a time per output: ``.diffprep/lock.json``, held with ``flock`` and naming its holder.

    The kernel releases the lock when its process dies, so a crashed run never
    leaves a lock behind that blocks the next one; the file's content only
    tells the next run who holds it. Taking the lock checks that the locked
    file is still the one at the path (another run may have just released and
    removed it).
    """

    def __init__(self, out_dir: str | os.PathLike, run: str | None = None, *, shard: int | None = None) -> None:
        """``shard``: the lock of one manual shard (``--shard-index``); shard runs exclude a plain run, not each other."""
        name = contract.LOCK_FILE if shard is None else f"lock-shard-{shard:04d}.json"
        self.path = Path(out_dir) / contract.STATE_DIR / name
        self.me = LockHolder(socket.gethostname(), os.getpid(), getpass.getuser(), run)
        self._fd: int | None = None
        self._shard = shard

    def acquire(self) -> None:
        if self._fd is not None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                holder = self.holder()
                who = (f"host {holder.host}, pid {holder.pid}, user {holder.user}"
                       + (f", flow run {holder.run}" if holder.run else "")) if holder else "holder unknown"
                raise LockedError(
                    f"{self.path.parent.parent} is being written by another run ({who}). "
                    "Wait for it to finish, or stop it; its lock goes away with its process."
                ) from None
            try:
                same_file = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same_file = False
            if not same_file:  # released and removed between our open and our flock: try again
                os.close(fd)
                continue
            os.ftruncate(fd, 0)
            os.write(fd, json.dumps(asdict(self.me)).encode())
            os.fsync(fd)
            self._fd = fd
            conflict = self._conflicting_holder()
            if conflict is not None:
                self.release()
                raise LockedError(conflict)
            return

    def _conflicting_holder(self) -> str | None:
        """A plain run excludes every shard run and the other way round; the message names the holder."""
        state = self.path.parent
        others = [state / contract.LOCK_FILE] if self._shard is not None else sorted(state.glob("lock-shard-*.json"))
        for path in others:
            if path.is_file() and _held(path):
                try:
                    holder = LockHolder(**json.loads(path.read_text()))
                    who = f"host {holder.host}, pid {holder.pid}, user {holder.user}"
                except (OSError, ValueError, TypeError):
                    who = "holder unknown"
                kind = "a plain run" if self._shard is not None else "a --shard-index run"
                return f"{state.parent} is being written by {kind} ({who}, {path.name}); wait for it to finish."
        return None

    def holder(self) -> LockHolder | None:
        try:
            return LockHolder(**json.loads(self.path.read_text()))
        except (OSError, ValueError, TypeError):
            return None

    def release(self) -> None:
        if self._fd is None:
            return
        self.path.unlink(missing_ok=True)  # before unlocking: a waiting run then sees a fresh file
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None

    def __enter__(self) -> "OutputLock":
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


__all__ = ["Inspection", "Decision", "inspect_output", "decide", "clear_output", "next_free_dir", "OutputLock"]
