"""The committed units' manifests read one at a time (``diffprep.run.manifests``)."""

from __future__ import annotations

import weakref
from pathlib import Path

import pytest

from diffprep.output import as_output
from diffprep.run.manifests import Manifests
from diffprep.writer.plan import write_plan
from diffprep.writer.shards import manifest_path


def test_manifests_are_read_when_reached_and_not_kept(tmp_path: Path, make_plan, write_unit) -> None:
    out = tmp_path / "out"
    out.mkdir()
    plan = make_plan((2, 2, 2, 2))
    write_plan(out, plan)
    for unit in range(4):
        write_unit(out, plan, unit)
    manifests = Manifests(as_output(out))
    assert list(manifests) == [0, 1, 2, 3] and len(manifests) == 4 and 2 in manifests and 7 not in manifests
    # Nothing is read when it is made: a manifest damaged afterwards fails only when it is reached.
    manifest_path(out, 3).write_text("{not json")

    alive = []
    seen = []
    values = iter(manifests.values())
    for _ in range(3):
        manifest = next(values)
        seen.append(manifest.unit)
        alive.append(weakref.ref(manifest))
        del manifest
        assert sum(ref() is not None for ref in alive) == 0  # the mapping holds none of those it gave
    assert seen == [0, 1, 2]
    with pytest.raises(ValueError):
        next(values)
    assert manifests.get(9) is None and manifests[1].keys == ["000001_000000", "000001_000001"]
