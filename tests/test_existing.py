"""Verify existing: what an output holds, what a run may do with it, clearing and the output lock."""

from __future__ import annotations

import getpass
import json
import os
import socket
import signal
import sys
import subprocess
from pathlib import Path

import pytest

from diffprep import contract
from diffprep.errors import ExistingOutputError, LockedError
from diffprep.phases.existing import CHOICES, decide, inspect_output, next_free_dir
from diffprep.output import Output, OutputLock
from diffprep.validation.ownership import ownership
from diffprep.writer.plan import write_plan


@pytest.fixture
def plan(make_plan):
    return make_plan((4, 4, 2))


def output_with_units(tmp_path: Path, plan, write_unit, units, **kwargs) -> Path:
    out = tmp_path / "out"
    out.mkdir()
    write_plan(out, plan)
    for unit in units:
        write_unit(out, plan, unit, **kwargs)
    return out


# inspect_output + decide, case by case


def test_missing_output_is_fresh(tmp_path: Path, plan) -> None:
    inspection = inspect_output(tmp_path / "absent", plan)
    assert (inspection.exists, inspection.empty) == (False, True)
    assert inspection.units_left == [0, 1, 2]
    assert inspection.units_done == []
    decision = decide(inspection, None)
    assert (decision.action, decision.out_dir) == ("fresh", str(tmp_path / "absent"))


def test_empty_output_is_fresh(tmp_path: Path, plan) -> None:
    inspection = inspect_output(tmp_path, plan)
    assert (inspection.exists, inspection.empty, inspection.bytes_on_disk) == (True, True, 0)
    assert inspection.needs_choice is False
    assert decide(inspection, None).action == "fresh"


def test_output_that_is_a_file_is_refused(tmp_path: Path, plan) -> None:
    path = tmp_path / "out"
    path.write_text("x")
    with pytest.raises(ExistingOutputError, match="exists and is not a directory"):
        inspect_output(path, plan)


def test_foreign_files_need_a_choice(tmp_path: Path, plan) -> None:
    (tmp_path / "notes.md").write_text("mine")
    (tmp_path / "shard.tar").write_bytes(b"not ours")
    inspection = inspect_output(tmp_path, plan)
    assert (inspection.exists, inspection.empty) == (True, False)
    assert inspection.plan_fingerprint is None
    assert inspection.same_settings is False
    assert inspection.matches is False
    assert inspection.foreign == ["notes.md", "shard.tar"]
    assert inspection.units_left == [0, 1, 2]
    assert inspection.bytes_on_disk == len("mine") + len(b"not ours")

    assert inspection.needs_choice is True
    with pytest.raises(ExistingOutputError) as info:
        decide(inspection, None)
    message = str(info.value)
    for choice in ("new-dir", "overwrite", "abort"):
        assert f"`{choice}`" in message
    assert "--on-existing" in message
    assert "`notes.md`" in message and "`shard.tar`" in message
    assert "holds no diffprep plan" in message
    # No dataset of diffprep's is there: nothing to reuse, nothing to resume, and neither is said to be.
    assert "`reuse`" not in message and "reuse" not in inspection.question().choices
    with pytest.raises(ExistingOutputError, match="cannot reuse .*: it holds no diffprep plan"):
        decide(inspection, "reuse")
    with pytest.raises(ExistingOutputError, match="cannot resume .*: it holds no diffprep plan: diffprep did not "):
        decide(inspection, "resume")


def test_same_settings_partly_done_resumes(tmp_path: Path, plan, write_unit) -> None:
    out = output_with_units(tmp_path, plan, write_unit, [0])
    inspection = inspect_output(out, plan)
    assert inspection.plan_fingerprint == plan.fingerprint
    assert (inspection.same_settings, inspection.matches, inspection.complete) == (True, True, False)
    assert inspection.units_done == [0]
    assert inspection.units_left == [1, 2]
    assert inspection.damaged_units == []
    assert inspection.shape_problem is None
    assert inspection.foreign == []
    assert inspection.needs_choice is False
    for on_existing in (None, "resume"):
        decision = decide(inspection, on_existing)
        assert (decision.action, decision.out_dir) == ("resume", str(out))
        assert decision.inspection["units_left"] == [1, 2]


def test_same_settings_complete_skips(tmp_path: Path, plan, write_unit) -> None:
    out = output_with_units(tmp_path, plan, write_unit, [0, 1, 2])
    inspection = inspect_output(out, plan)
    assert inspection.units_done == [0, 1, 2]
    assert inspection.units_left == []
    assert inspection.complete is True
    assert decide(inspection, None).action == "complete"
    assert decide(inspection, "resume").action == "complete"


def test_same_settings_with_only_a_plan_resumes_everything(tmp_path: Path, plan, write_unit) -> None:
    out = output_with_units(tmp_path, plan, write_unit, [])
    inspection = inspect_output(out, plan)
    assert inspection.units_left == [0, 1, 2]
    assert decide(inspection, None).action == "resume"


def test_other_settings_need_a_choice(tmp_path: Path, make_plan, write_unit) -> None:
    old = make_plan((4, 4, 2), settings={"image_size": 64})
    new = make_plan((4, 4, 2), settings={"image_size": 32})
    out = output_with_units(tmp_path, old, write_unit, [0, 1])
    inspection = inspect_output(out, new)
    assert inspection.plan_fingerprint == old.fingerprint != new.fingerprint
    assert (inspection.same_settings, inspection.matches) == (False, False)
    assert inspection.units_done == []  # nothing of the old run counts for the new one
    assert inspection.units_left == [0, 1, 2]
    with pytest.raises(ExistingOutputError) as info:
        decide(inspection, None)
    assert f"other settings (fingerprint `{old.fingerprint}`)" in str(info.value)
    assert "2 finished shard(s)" not in str(info.value)  # units_done is per the new plan
    with pytest.raises(ExistingOutputError, match="cannot resume .*written with other settings"):
        decide(inspection, "resume")


def test_explicit_choices_on_an_output_that_needs_one(tmp_path: Path, make_plan, write_unit) -> None:
    old = make_plan((2,), settings={"image_size": 64})
    out = output_with_units(tmp_path, old, write_unit, [0])
    inspection = inspect_output(out, make_plan((2,), settings={"image_size": 32}))

    overwrite = decide(inspection, "overwrite")
    assert (overwrite.action, overwrite.out_dir) == ("overwrite", str(out))
    new_dir = decide(inspection, "new-dir")
    assert (new_dir.action, new_dir.out_dir) == ("new-dir", str(tmp_path / "out-v2"))
    with pytest.raises(ExistingOutputError, match=r"aborted \(on_existing=abort\); nothing under .* was changed"):
        decide(inspection, "abort")
    reuse = decide(inspection, "reuse")
    assert (reuse.action, reuse.out_dir) == ("reuse", str(out))
    with pytest.raises(ExistingOutputError) as info:
        decide(inspection, "delete")
    assert str(info.value) == f"on_existing must be one of {', '.join(CHOICES)}, got 'delete'"
    assert (out / "000000.tar").is_file()  # deciding touches nothing


def test_damaged_unit_is_reported_and_re_encoded(tmp_path: Path, plan, write_unit) -> None:
    out = output_with_units(tmp_path, plan, write_unit, [0, 1])
    with open(out / "000001.tar", "ab") as handle:
        handle.write(b"\0" * 512)
    inspection = inspect_output(out, plan)
    assert inspection.units_done == [0]
    assert inspection.damaged_units == [1]
    assert inspection.units_left == [2]
    assert (inspection.matches, inspection.complete) == (True, False)
    assert decide(inspection, None).action == "resume"


def test_manifest_without_its_shard_is_damaged(tmp_path: Path, plan, write_unit) -> None:
    out = output_with_units(tmp_path, plan, write_unit, [0, 1, 2])
    (out / "000002.tar").unlink()
    inspection = inspect_output(out, plan)
    assert (inspection.units_done, inspection.damaged_units, inspection.units_left) == ([0, 1], [2], [])
    assert inspection.complete is False


def test_shard_without_manifest_is_not_done(tmp_path: Path, plan, write_unit) -> None:
    out = output_with_units(tmp_path, plan, write_unit, [0])
    (out / contract.STATE_DIR / contract.UNITS_DIR / "000000.json").unlink()
    inspection = inspect_output(out, plan)
    assert inspection.units_done == []
    assert inspection.units_left == [0, 1, 2]


def test_shape_mismatch_is_detected(tmp_path: Path, plan, write_unit) -> None:
    out = output_with_units(tmp_path, plan, write_unit, [0], shapes={"latents": [16, 8, 8]})
    inspection = inspect_output(out, plan)
    assert inspection.same_settings is True
    assert inspection.shape_problem == (
        "000000.tar:000000_000000: latents.pth has shape [16, 8, 8], this run writes [16, 4, 4]"
    )
    assert inspection.matches is False
    assert inspection.complete is False
    with pytest.raises(ExistingOutputError, match=r"do not match this run's shapes"):
        decide(inspection, None)
    with pytest.raises(ExistingOutputError, match=r"cannot resume .*latents\.pth has shape \[16, 8, 8\]"):
        decide(inspection, "resume")


def test_dtype_mismatch_is_detected(tmp_path: Path, make_plan, write_unit) -> None:
    written = make_plan((2,), expected={**make_plan().expected, "dtype": "bfloat16"})
    out = output_with_units(tmp_path, written, write_unit, [0])
    inspection = inspect_output(out, make_plan((2,)))  # same fingerprint, float32 planned
    assert inspection.shape_problem is not None
    assert "dtype torch.bfloat16, this run writes float32" in inspection.shape_problem
    assert inspection.matches is False


def test_variable_size_plans_accept_any_spatial_size(tmp_path: Path, make_plan, write_unit) -> None:
    variable = make_plan((2,), expected={**make_plan().expected, "latents": [16, None, None]})
    out = output_with_units(tmp_path, variable, write_unit, [0], shapes={"latents": [16, 6, 4]})
    assert inspect_output(out, variable).shape_problem is None


def test_describe_says_what_exists(tmp_path: Path, make_plan, write_unit) -> None:
    old = make_plan((2, 2), settings={"v": 1})
    out = output_with_units(tmp_path, old, write_unit, [0, 1])
    (out / "README.md").write_text("hello")
    text = inspect_output(out, make_plan((2, 2), settings={"v": 2})).describe()
    assert f"**Output:** `{out}`" in text
    assert "was written with other settings" in text and "  - `v: 1 -> 2`" in text  # which setting, old and new
    assert "1 file(s) diffprep did not write, which stay whatever is chosen: `README.md`" in text
    # What overwrite deletes, counted (plan and its two units' lists, two manifests, two shards and their member
    # records), and what it keeps.
    assert "`overwrite`: delete the 9 file(s) diffprep wrote there" in text
    assert "the 1 file(s) above that it did not write stay" in text
    assert "KiB in all" in text

    # Many foreign files: the first ten by name, the rest counted.
    for index in range(12):
        (out / "notes" / f"n{index:02d}.txt").parent.mkdir(exist_ok=True)
        (out / "notes" / f"n{index:02d}.txt").write_text("x")
    text = inspect_output(out, make_plan((2, 2), settings={"v": 2})).describe()
    assert "13 file(s) diffprep did not write" in text and "`notes/n08.txt` and 3 more" in text
    assert "`notes/n09.txt`" not in text


# next_free_dir


def test_next_free_dir_skips_used_versions(tmp_path: Path) -> None:
    out = tmp_path / "data"
    assert next_free_dir(out) == str(tmp_path / "data-v2")
    (tmp_path / "data-v2").mkdir()
    (tmp_path / "data-v2" / "000000.tar").write_bytes(b"x")
    (tmp_path / "data-v3").write_text("a file")
    (tmp_path / "data-v4").mkdir()  # empty: usable
    assert next_free_dir(out) == str(tmp_path / "data-v4")


def test_a_new_dir_already_started_by_the_same_plan_is_taken_again(tmp_path: Path, make_plan) -> None:
    """A run that chose new-dir, then was suspended on a later question, re-runs from the top: same folder."""
    plan = make_plan((4,))
    out = tmp_path / "data"
    (tmp_path / "data-v2").mkdir()
    write_plan(tmp_path / "data-v2", plan)
    assert next_free_dir(out, plan.fingerprint) == str(tmp_path / "data-v2")
    assert next_free_dir(out, "another-fingerprint") == str(tmp_path / "data-v3")
    assert next_free_dir(out) == str(tmp_path / "data-v3")


# clearing an approved overwrite


def test_clear_output_removes_only_diffprep_files(tmp_path: Path, plan, write_unit) -> None:
    out = output_with_units(tmp_path, plan, write_unit, [0, 1])
    (out / "000000.tar.idx").write_bytes(b"idx")
    (out / contract.NV_META).mkdir()
    (out / contract.NV_META / contract.DATASET_YAML).write_text("__module__: x\n")
    (out / contract.STATE_DIR / contract.AUDIT_JSON).write_text("{}")
    lock = out / contract.STATE_DIR / contract.LOCK_FILE
    lock.write_text('{"host": "h", "pid": 1, "user": "u", "run": null}')
    foreign = {
        "README.md": b"my notes",
        "00001.tar": b"five digits: not a shard name",
        "extra/000003.tar": b"a shard name, but below a foreign folder",
        "images.tar.gz": b"\x1f\x8b",
    }
    for name, data in foreign.items():
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_bytes(data)
    lock_before = lock.read_bytes()

    owned = ownership(Output(out))
    Output(out).remove(owned.ours)

    assert set(owned.ours) == {".diffprep/plan.json", ".diffprep/units/000000.json", ".diffprep/units/000001.json",
                               *(f".diffprep/{contract.plan_unit_path(unit.unit)}" for unit in plan.units),
                               ".diffprep/members/000000.json", ".diffprep/members/000001.json",  # the writer's
                               ".diffprep/audit.json", ".nv-meta/dataset.yaml", "000000.tar", "000000.tar.idx",
                               "000001.tar"}
    for name, data in foreign.items():
        assert (out / name).read_bytes() == data
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [contract.STATE_DIR, "README.md", "00001.tar", "extra", "images.tar.gz"]
    )
    assert [p.name for p in (out / contract.STATE_DIR).rglob("*") if p.is_file()] == [contract.LOCK_FILE]
    assert lock.read_bytes() == lock_before


# OutputLock

HOLD_LOCK = """
import sys, time
from diffprep.output import OutputLock
lock = OutputLock(sys.argv[1], run="flow-run-abc")
lock.acquire()
print("locked", flush=True)
time.sleep(120)
"""


@pytest.fixture
def lock_holder(tmp_path: Path):
    """Another process holding the output's lock until killed."""
    process = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    assert process.stdout.readline().strip() == "locked"
    yield process
    process.kill()
    process.wait()


def test_lock_names_its_holder_and_is_released(tmp_path: Path) -> None:
    lock = OutputLock(tmp_path, run="run-123")
    with lock:
        data = json.loads((tmp_path / contract.STATE_DIR / contract.LOCK_FILE).read_text())
        assert data == {"host": socket.gethostname(), "pid": os.getpid(), "user": getpass.getuser(), "run": "run-123"}
        lock.acquire()  # re-entrant within one process (a retried task)
    assert not lock.path.exists()


def test_lock_held_by_another_run_is_refused_naming_it(tmp_path: Path, lock_holder) -> None:
    path = tmp_path / contract.STATE_DIR / contract.LOCK_FILE
    before = path.read_bytes()
    with pytest.raises(LockedError) as info:
        OutputLock(tmp_path).acquire()
    message = str(info.value)
    assert f"host {socket.gethostname()}" in message
    assert f"pid {lock_holder.pid}" in message
    assert f"user {getpass.getuser()}" in message
    assert "flow run flow-run-abc" in message
    assert path.read_bytes() == before


def test_lock_of_a_killed_run_is_taken_over(tmp_path: Path, lock_holder) -> None:
    lock_holder.kill()
    lock_holder.wait()
    path = tmp_path / contract.STATE_DIR / contract.LOCK_FILE
    assert json.loads(path.read_text())["pid"] == lock_holder.pid  # the dead run's file is still there
    lock = OutputLock(tmp_path)
    lock.acquire()
    holder = lock.holder()
    assert (holder.host, holder.pid) == (socket.gethostname(), os.getpid())
    lock.release()
    assert not lock.path.exists()


HOLD_LOCK_AND_FORK = """
import os, sys, time
from diffprep.output import OutputLock
OutputLock(sys.argv[1], run="flow-run-abc").acquire()
child = os.fork()
if child == 0:
    time.sleep(120)
    os._exit(0)
print(child, flush=True)
time.sleep(120)
"""


def test_a_forked_child_outliving_a_killed_run_does_not_hold_its_lock(tmp_path: Path) -> None:
    """Energon's indexing pool and data loader workers are forked; one that outlives a killed run must not
    keep the output locked (seen in CI: a re-run refused while an orphaned worker lived)."""
    run = subprocess.Popen([sys.executable, "-c", HOLD_LOCK_AND_FORK, str(tmp_path)], stdout=subprocess.PIPE,
                           text=True)
    child = int(run.stdout.readline())
    try:
        run.kill()
        run.wait()
        os.kill(child, 0)  # the orphan still lives
        with OutputLock(tmp_path) as lock:
            assert lock.holder().pid == os.getpid()
    finally:
        os.kill(child, signal.SIGKILL)


def test_a_lock_file_nobody_holds_is_free(tmp_path: Path) -> None:
    path = tmp_path / contract.STATE_DIR / contract.LOCK_FILE
    path.parent.mkdir(parents=True)
    path.write_text('{"host": "other-machine", "pid": 1, "user": "u", "run": null}')
    with OutputLock(tmp_path) as lock:
        assert lock.holder().pid == os.getpid()


def test_release_without_acquire_touches_nothing(tmp_path: Path, lock_holder) -> None:
    path = tmp_path / contract.STATE_DIR / contract.LOCK_FILE
    before = path.read_bytes()
    OutputLock(tmp_path).release()
    assert path.read_bytes() == before
