"""The state folder of an output (``.diffprep/``): plan, unit manifests, audit, splits, validation, sanity files.

Every read and write of the state goes through the output's ``StateStore``.
Writes are atomic (temporary file, fsync, rename) in the output's working
folder; for a bucket output they are also uploaded at once (write-through).
Reads keep the staged copy equal to the bucket's by themselves (the bucket is
the truth): the first read after the output is opened (``OutputRef.open``,
once per task) downloads what changed, and every manifest listing looks at
the bucket again, so no caller pulls or pushes by hand. Unit manifests are
the commit points: they are written by ``Output.commit_unit`` only, never
here.
"""

from __future__ import annotations

import contextlib
import json
import shutil
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, Protocol

from diffprep import contract
from diffprep.writer.plan import Plan, read_plan, write_unit_lists
from diffprep.writer.shards import UnitManifest, json_file_bytes, read_manifest


class Manifests(Mapping[int, UnitManifest]):
    """Unit -> manifest, read from the state folder on demand (iteration in unit order, one manifest at a time).

    At 100M samples the manifests hold every sample's key and source id (~100k files of ~1000 of each): a pass
    over this mapping holds one of them at a time, where a dict of them all held every id. The units are listed
    once when it is made (a bucket's manifests synced then); a manifest that cannot be read raises as
    ``read_manifest`` does (ValueError, OSError) when it is reached. ``output``: an ``Output`` (its working folder
    and state store); ``units``: those of its units the mapping holds (``Output.committed_units``'s), by default
    every unit with a manifest.
    """

    def __init__(self, output: Any, units: Iterable[int] | None = None) -> None:
        self._output = output
        self._local = output.local
        self._units = sorted(output.state.manifest_units() if units is None else units)
        self._known = set(self._units)

    def only(self, units: Iterable[int]) -> Manifests:
        """The same mapping over those of ``units`` it holds."""
        return Manifests(self._output, [u for u in units if u in self._known])

    def __getitem__(self, unit: int) -> UnitManifest:
        manifest = read_manifest(self._local, unit) if unit in self._known else None
        if manifest is None:
            raise KeyError(unit)
        return manifest

    def __contains__(self, unit: object) -> bool:
        return unit in self._known

    def __iter__(self) -> Iterator[int]:
        return iter(self._units)

    def __len__(self) -> int:
        return len(self._units)


class StateOwner(Protocol):
    """What a state store uses of the output that owns it (``diffprep.output.base.Output``): its working folder,
    keeping that folder in step, and writing through it."""

    local: Path

    def sync_state(self) -> None: ...

    def sync_manifests(self) -> None: ...

    def pull_file(self, relative: str) -> None: ...

    def writable(self, relative: str) -> Path: ...

    def write_file(self, relative: str, data: bytes) -> Path: ...

    def publish_file(self, relative: str) -> None: ...


class StateStore:
    """``<output>/.diffprep``, read and written through the output that owns it."""

    def __init__(self, output: StateOwner) -> None:
        self.output = output
        self._current = False  # whether the working copy was made equal to the output's since it was (re)opened

    @property
    def root(self) -> Path:
        return self.output.local / contract.STATE_DIR

    def path(self, relative: str) -> Path:
        """Where the working copy of a state file (``plan.json``, ``sanity/report.json``...) is written; to read
        one, ``local_copy``."""
        return self.root / relative

    def local_copy(self, relative: str) -> Path | None:
        """The working copy of a state file, in step with the output's; None when there is none."""
        self.ensure_current()
        path = self.path(relative)
        return path if path.is_file() else None

    def _rel(self, relative: str) -> str:
        return f"{contract.STATE_DIR}/{relative}"

    # -- reading ----------------------------------------------------------------------------------------------------
    def reopened(self) -> None:
        """The output was opened again (another task, another run of this process): the next read looks at the
        output again, since other processes may have written to it meanwhile."""
        self._current = False

    def ensure_current(self) -> None:
        """The working copy, made equal to the output's once since it was opened (a bucket's state downloaded;
        a folder is its own)."""
        if not self._current:
            self.output.sync_state()
            self._current = True

    def exists(self, relative: str) -> bool:
        return self.local_copy(relative) is not None

    def read_bytes(self, relative: str) -> bytes | None:
        path = self.local_copy(relative)
        return None if path is None else path.read_bytes()

    def read_json(self, relative: str) -> Any:
        data = self.read_bytes(relative)
        return None if data is None else json.loads(data)

    def plan(self) -> Plan | None:
        """plan.json; each unit's sample list is read when the unit is first used (a bucket's, downloaded then:
        a worker fetches only its units' lists)."""
        self.ensure_current()
        return read_plan(self.path(contract.PLAN_JSON), pull=self._pull_state_file)

    def _pull_state_file(self, relative: str) -> None:
        self.output.pull_file(self._rel(relative))

    def manifests(self) -> Manifests:
        """Every unit manifest in the state, by unit (committed or not: see ``Output.committed_units``), read one
        at a time as the mapping is used (``Manifests``): a pass over them holds one manifest, never all."""
        return Manifests(self.output)

    def manifest_units(self) -> set[int]:
        """The units that have a manifest, from the file names alone (cheap enough to poll)."""
        self.output.sync_manifests()
        folder = self.root / contract.UNITS_DIR
        names = (p.name.removesuffix(".json") for p in folder.glob("*.json")) if folder.is_dir() else ()
        return {int(name) for name in names if name.isdigit()}

    def manifest(self, unit: int) -> UnitManifest | None:
        """The unit's manifest as last listed (``manifests``, ``manifest_units``)."""
        self.ensure_current()
        return read_manifest(self.output.local, unit)

    def is_empty(self) -> bool:
        """No plan and no manifest (e.g. only a lock or temporary files): the state holds no data."""
        return not self.exists(contract.PLAN_JSON) and not self.manifest_units()

    # -- writing (write-through) --------------------------------------------------------------------------------------
    def write_bytes(self, relative: str, data: bytes) -> Path:
        return self.output.write_file(self._rel(relative), data)

    def write_json(self, relative: str, value: Any) -> Path:
        return self.write_bytes(relative, json_file_bytes(value))

    def write_plan(self, plan: Plan) -> Path:
        """The units' sample lists this state does not hold yet (a resume's and an append's old ones stay as they
        are), then plan.json, which names them."""
        write_unit_lists(plan, self.root, self.write_bytes)
        return self.write_json(contract.PLAN_JSON, plan.to_json())

    @contextlib.contextmanager
    def writing(self, relative: str) -> Iterator[Path]:
        """A path for a writer that takes one (a contact sheet); published when the block ends without error."""
        path = self.output.writable(self._rel(relative))
        path.parent.mkdir(parents=True, exist_ok=True)
        yield path
        if path.is_file():
            self.output.publish_file(self._rel(relative))

    def discard_scratch(self, relative: str) -> None:
        """Remove a folder that lives in the working copy only (``text_cache/...``: never published, never data),
        and the folders above it that it leaves empty."""
        path = self.output.writable(self._rel(relative))
        shutil.rmtree(path, ignore_errors=True)
        for parent in path.parents:
            if parent == self.root:
                break
            try:
                parent.rmdir()  # only when empty: another run's scratch beside it stays
            except OSError:
                break


__all__ = ["Manifests", "StateStore"]
