"""The audit: every planned sample is written or rejected with a reason, and tars match manifests."""

from __future__ import annotations

import json
import shutil
import tarfile
from pathlib import Path

import pytest

from diffprep import contract
from diffprep.phases.audit import audit
from diffprep.writer.plan import write_plan
from diffprep.writer.shards import ShardWriter, UnitManifest, manifest_path, read_manifest, write_manifest


@pytest.fixture
def out(tmp_path: Path) -> Path:
    path = tmp_path / "out"
    path.mkdir()
    return path


def test_complete_output_passes(out: Path, make_plan, write_unit) -> None:
    plan = make_plan((4, 2))
    write_plan(out, plan)
    write_unit(out, plan, 0)
    write_unit(out, plan, 1)
    report = audit(out, plan)
    assert report.problems == []
    assert report.ok is True
    assert (report.units, report.inputs, report.written, report.rejected) == (2, 6, 6, 0)
    assert report.by_reason == {}
    assert report.rejected_fraction == 0.0
    saved = json.loads((out / contract.STATE_DIR / contract.AUDIT_JSON).read_text())
    assert saved["ok"] is True
    assert (saved["inputs"], saved["written"], saved["rejected"]) == (6, 6, 0)


def test_rejects_are_counted_by_reason(out: Path, make_plan, write_unit) -> None:
    plan = make_plan((4, 4))
    write_plan(out, plan)
    write_unit(out, plan, 0, rejects={"img0001.png": "image_truncated", "img0003.png": "missing_caption"})
    write_unit(out, plan, 1, rejects={"img0005.png": "image_truncated"})
    report = audit(out, plan)
    assert report.ok is True, report.problems
    assert (report.inputs, report.written, report.rejected) == (8, 5, 3)
    assert report.by_reason == {"image_truncated": 2, "missing_caption": 1}
    assert report.rejected_fraction == pytest.approx(3 / 8)
    assert [r["source_id"] for r in report.rejected_ids] == ["img0001.png", "img0003.png", "img0005.png"]
    assert report.rejected_ids[1] == {"source_id": "img0003.png", "reason": "missing_caption",
                                      "detail": "test reject of img0003.png"}
    saved = json.loads((out / contract.STATE_DIR / contract.AUDIT_JSON).read_text())
    assert saved["by_reason"] == {"image_truncated": 2, "missing_caption": 1}
    assert saved["rejected"] == 3
    assert "| `image_truncated` | 2 |" in report.to_markdown()


def test_notes_are_summed(out: Path, make_plan, write_unit) -> None:
    plan = make_plan((2, 2))
    write_plan(out, plan)
    for unit, notes in ((0, {"empty_caption": 1}), (1, {"empty_caption": 2, "caption_truncated": 1})):
        manifest = write_unit(out, plan, unit)
        manifest.notes = notes
        write_manifest(out, manifest)
    report = audit(out, plan)
    assert report.notes == {"caption_truncated": 1, "empty_caption": 3}
    assert report.ok is True


def test_missing_manifest_is_a_problem(out: Path, make_plan, write_unit) -> None:
    plan = make_plan((2, 2))
    write_plan(out, plan)
    write_unit(out, plan, 0)
    report = audit(out, plan)
    assert report.problems == ["unit 000001 has no manifest (not encoded): re-run the encode"]
    assert report.ok is False
    assert (report.inputs, report.written) == (4, 2)
    assert json.loads((out / contract.STATE_DIR / contract.AUDIT_JSON).read_text())["ok"] is False


def test_units_argument_limits_the_audit(out: Path, make_plan, write_unit) -> None:
    plan = make_plan((2, 2))
    write_plan(out, plan)
    write_unit(out, plan, 0)
    report = audit(out, plan, units=[0])
    assert report.ok is True
    assert (report.units, report.inputs) == (1, 2)


def test_planned_id_neither_written_nor_rejected(out: Path, make_plan, write_unit) -> None:
    plan = make_plan((3,))
    write_plan(out, plan)
    manifest = write_unit(out, plan, 0)
    # The manifest forgets one sample: it is neither in the shard's list nor in the rejects.
    manifest.source_ids.remove("img0001.png")
    write_manifest(out, manifest)
    report = audit(out, plan)
    assert report.ok is False
    assert len(report.problems) == 1
    assert report.problems[0] == (
        "unit 000000: 3 planned, 3 written + 0 rejected; unaccounted ['img0001.png'], unplanned []"
    )


def test_manifest_keys_missing_from_the_tar(out: Path, make_plan, write_unit) -> None:
    plan = make_plan((3,))
    write_plan(out, plan)
    manifest = write_unit(out, plan, 0)
    # Rewrite the shard without its last sample after the commit; the manifest still lists three keys (and the
    # committed size and digest: audit trusts a shard only while they are its own, then reads its headers).
    with tarfile.open(out / manifest.shard) as tar:
        members = [(m, tar.extractfile(m).read()) for m in tar.getmembers()]
    with ShardWriter(out, 0) as writer:
        for key in manifest.keys[:2]:
            fields = {m.name.partition(".")[2]: data for m, data in members if m.name.partition(".")[0] == key}
            writer.write(key, fields)
        info = writer.commit()
    assert info.bytes != manifest.bytes

    report = audit(out, plan)
    assert report.problems == [
        f"unit 000000: shard 000000.tar is {info.bytes} bytes, its manifest records {manifest.bytes}: the shard "
        "changed after it was committed; re-encode that unit",
        "unit 000000: 000000.tar holds 2 samples, the manifest lists 3",
    ]


def test_sample_with_missing_fields(out: Path, make_plan) -> None:
    plan = make_plan((1,))
    write_plan(out, plan)
    with ShardWriter(out, 0) as writer:
        writer.write("000000_000000", {contract.CAPTION: "no tensors", contract.META: {}})
        info = writer.commit()
    # Committed with another digest (the tar was replaced after its commit): audit reads its headers. (A shard
    # whose bytes are the committed ones is trusted; validation's field check reads every shard's headers.)
    write_manifest(out, UnitManifest(0, info.name, plan.fingerprint, ["000000_000000"], ["img0000.png"],
                                     info.count, info.bytes, "0" * 64))
    report = audit(out, plan)
    assert report.problems[1:] == ["unit 000000: samples with missing fields: ['000000_000000']"]
    assert "has sha256" in report.problems[0] and "changed after it was committed" in report.problems[0]


def test_missing_shard_and_foreign_fingerprint(out: Path, make_plan, write_unit) -> None:
    plan = make_plan((2, 2))
    write_plan(out, plan)
    write_unit(out, plan, 0)
    (out / "000000.tar").unlink()
    other = write_unit(out, make_plan((2, 2), settings={"other": True}), 1)
    report = audit(out, plan)
    assert report.problems == [
        "unit 000000: shard 000000.tar is missing",
        f"unit 000001 was written with other settings (fingerprint {other.fingerprint})",
    ]


def test_count_that_disagrees_with_keys(out: Path, make_plan, write_unit) -> None:
    plan = make_plan((2,))
    write_plan(out, plan)
    manifest = write_unit(out, plan, 0)
    manifest.count = 3
    write_manifest(out, manifest)
    assert read_manifest(out, 0).count == 3
    report = audit(out, plan)
    assert "unit 000000: manifest count 3 != 2 keys" in report.problems


def test_missing_from_source_is_carried(out: Path, make_plan, write_unit) -> None:
    plan = make_plan((2,))
    plan.missing, plan.missing_count = ["gone.png"], 1
    write_plan(out, plan)
    write_unit(out, plan, 0)
    report = audit(out, plan)
    assert report.missing_from_source == 1
    assert report.ok is True
    assert manifest_path(out, 0).is_file()


def test_output_without_state_folder_reports_every_unit(out: Path, make_plan) -> None:
    plan = make_plan((2, 2))
    report = audit(out, plan)
    assert report.problems == [
        "unit 000000 has no manifest (not encoded): re-run the encode",
        "unit 000001 has no manifest (not encoded): re-run the encode",
    ]
    assert json.loads((out / contract.STATE_DIR / contract.AUDIT_JSON).read_text())["ok"] is False


def test_a_retried_reject_is_counted_once_with_its_latest_outcome(out: Path, make_plan, write_unit) -> None:
    from diffprep.writer.plan import UnitPlan

    plan = make_plan((4, 4))
    write_unit(out, plan, 0, rejects={"img0001.png": "missing_caption", "img0002.png": "image_truncated"})
    write_unit(out, plan, 1)
    # A later run retried img0001.png (its caption appeared) in unit 2, where it was written.
    plan.units.append(UnitPlan(2, ["img0001.png"]))
    plan.retried = {"img0001.png": 2}
    write_plan(out, plan)
    write_unit(out, plan, 2)
    report = audit(out, plan)
    assert report.ok, report.problems
    assert (report.inputs, report.written, report.rejected, report.superseded) == (8, 7, 1, 1)
    assert report.inputs == report.written + report.rejected
    assert [r["source_id"] for r in report.rejected_ids] == ["img0002.png"]


def test_an_answer_holds_for_the_same_rejects_only(out: Path, make_plan, write_unit) -> None:
    from diffprep.phases.audit import answered_before, record_answer
    from diffprep.output import as_output

    plan = make_plan((4,))
    write_plan(out, plan)
    write_unit(out, plan, 0, rejects={"img0001.png": "missing_caption"})
    report = audit(out, plan)
    assert answered_before(as_output(out), report) is None
    record_answer(as_output(out), report, "accept")
    assert (out / contract.STATE_DIR / contract.REJECTS_ANSWER_JSON).is_file()
    assert answered_before(as_output(out), audit(out, plan))["rejected"] == 1
    write_unit(out, plan, 0, rejects={"img0002.png": "missing_caption"})  # other rejects: asked again
    assert answered_before(as_output(out), audit(out, plan)) is None


def test_rejects_named_retried_once_fixed_and_an_answer_kept(tmp_path: Path, demo_data: Path, tiny_model: Path,
                                                             settings_for) -> None:
    from PIL import Image

    from diffprep.phases.pipeline import run

    caption = next(iter(sorted((demo_data / "captions").iterdir())))
    text = caption.read_bytes()
    caption.unlink()  # a missing caption, fixed below
    (demo_data / "images/photo.heic").write_bytes(b"ftypheic")  # a format nothing here reads
    Image.new("RGB", (1, 1), (200, 0, 0)).save(demo_data / "images/tiny.png")  # upscaled to 32x32: a note
    (demo_data / "captions/tiny.txt").write_text("a red dot")
    settings = settings_for(tmp_path / "out", demo_data, tiny_model, finalize={"enabled": False})
    asked = []

    def accept(question, preset=None, *, release=False):
        asked.append(question.key)
        return "accept"

    first = run(settings, "preencoded", ask=accept)
    assert first.rejects_by_reason == {"missing_caption": 1, "unsupported_format": 1}
    assert first.notes.get("image_upscaled") == 1 and asked == ["rejected-samples"]
    # The same rejects: the recorded answer holds (a cron job without a terminal would have exited here).
    again = run(settings, "preencoded", ask=lambda *a, **k: pytest.fail("asked again about the same rejects"))
    assert again.encoded_units == 0 and again.retried is None

    caption.write_bytes(text)  # the fix: the re-run retries that sample alone, in a new unit
    fixed = run(settings, "preencoded", ask=accept)
    assert fixed.retried == 1 and fixed.encoded_units == 1 and fixed.units == first.units + 1
    assert fixed.rejects_by_reason == {"unsupported_format": 1} and asked == ["rejected-samples"] * 2
    assert fixed.samples == first.samples + 1
    saved = json.loads((tmp_path / "out" / contract.STATE_DIR / contract.AUDIT_JSON).read_text())
    assert saved["inputs"] == saved["written"] + saved["rejected"] == 14 and saved["superseded"] == 1


@pytest.mark.slow
def test_a_metadata_row_fixed_in_the_file_or_on_disk_is_retried(tmp_path: Path, demo_data: Path, tiny_model: Path,
                                                                settings_for) -> None:
    """The metadata source stamps a rejected row (its values and its files): a caption added to the metadata file
    and an image that appeared are retried on the next run, in new units; an unchanged reject is not."""
    from diffprep.phases.pipeline import run

    images = sorted((demo_data / "images").iterdir())
    rows = [{"image": f"images/{p.name}", "caption": f"picture {i}"} for i, p in enumerate(images[:4])]
    del rows[1]["caption"]  # no caption: filled in the file below
    rows.append({"image": "images/later.png", "caption": "not there yet"})  # appears below
    rows.append({"image": "images/never.png", "caption": "never there"})  # stays rejected
    listing = demo_data / "rows.json"
    listing.write_text(json.dumps(rows))
    settings = settings_for(tmp_path / "out", demo_data, tiny_model, finalize={"enabled": False},
                            source={"type": "metadata", "metadata_file": str(listing), "input_dir": None},
                            output={"accept_rejects": 0.5})
    first = run(settings, "preencoded", ask=lambda *a, **k: pytest.fail("asked"))
    assert first.samples == 3 and sum(first.rejects_by_reason.values()) == 3

    again = run(settings, "preencoded", ask=lambda *a, **k: pytest.fail("asked"))
    assert again.encoded_units == 0 and again.retried is None  # nothing changed: nothing retried

    rows[1]["caption"] = "picture 1, captioned now"
    listing.write_text(json.dumps(rows))
    shutil.copy(images[5], demo_data / "images" / "later.png")
    fixed = run(settings, "preencoded", ask=lambda *a, **k: pytest.fail("asked"))
    assert fixed.retried == 2 and fixed.samples == 5 and sum(fixed.rejects_by_reason.values()) == 1


def test_a_tampered_shard_of_the_same_size_is_found_in_one_process_and_in_two(out: Path, make_plan,
                                                                              write_unit) -> None:
    plan = make_plan((2, 2, 2))
    write_plan(out, plan)
    for unit in range(3):
        write_unit(out, plan, unit)
    assert audit(out, plan).problems == []  # every shard trusted: its size and digest are its manifest's
    shard = out / contract.shard_name(1)
    data = bytearray(shard.read_bytes())
    data[data.index(b"caption of ") + 3] ^= 0x01  # the same size, the same members, other bytes
    shard.write_bytes(bytes(data))

    one, two = audit(out, plan), audit(out, plan, workers=2)
    assert len(one.problems) == 1, one.problems
    assert one.problems[0].startswith("unit 000001: shard 000001.tar has sha256 ")
    assert "(same size): the shard changed after it was committed; re-encode that unit" in one.problems[0]
    assert two.to_json() == one.to_json()  # read by two threads: the same report
