"""A re-run over a finished output lists its source only when the source may have changed (issue #37).

The plan records the stamp of the source's input files (``diffprep.sources.stamps``: a metadata file's, each input
tar's); a re-run whose stamp is the same takes the plan's units without listing the source or opening its file, and
finds the output complete. A file appended to, touched, or a tar added: listed again (appends keep working). A plan
written before the stamp existed: listed, as before. The verify phase reads the manifests one at a time.
"""

from __future__ import annotations

import io
import json
import logging
import os
import tarfile
from pathlib import Path

import pytest

from diffprep import contract
from diffprep.config import load_settings
from diffprep.output import as_output
from diffprep.phases import fetch as fetch_phase
from diffprep.phases.pipeline import run
from diffprep.sources import MetadataSource, metadata_rows
from diffprep.sources.stamps import source_stamp
from diffprep.writer.shards import UnitManifest

SKIPPED = "listing of the source skipped: source unchanged since it was planned"


@pytest.fixture
def listings(monkeypatch) -> list[str]:
    """Each listing of a source and each planning pass the fetch phase makes, by name (a spy on the real ones)."""
    calls: list[str] = []
    listing, plan_units = fetch_phase.listing, fetch_phase.plan_units

    def counted_listing(source):
        calls.append("listing")
        return listing(source)

    def counted_plan_units(*args, **kwargs):
        calls.append("plan_units")
        return plan_units(*args, **kwargs)

    monkeypatch.setattr(fetch_phase, "listing", counted_listing)
    monkeypatch.setattr(fetch_phase, "plan_units", counted_plan_units)
    return calls


def write_rows(path: Path, start: int, stop: int, mode: str = "w") -> None:
    """Rows of a prompts run: each names a file that is there (read, never decoded) and its own caption."""
    (path.parent / "img").mkdir(exist_ok=True)
    with open(path, mode, encoding="utf-8") as f:
        for i in range(start, stop):
            (path.parent / f"img/{i:03d}.png").write_bytes(b"")
            f.write(json.dumps({"image": f"img/{i:03d}.png", "caption": f"caption {i}"}) + "\n")


def metadata_settings(tmp_path: Path):
    return load_settings(overrides={
        "source": {"type": "metadata", "metadata_file": str(tmp_path / "d.jsonl")},
        "output": {"output_dir": str(tmp_path / "out"), "shard_size": 4}, "raw": {"prompts_only": True},
        "finalize": {"train_split": 1.0}})


def never(*args, **kwargs):
    pytest.fail(f"asked {args}")


def written_ids(out: Path) -> list[str]:
    return sorted(sid for manifest in as_output(out).state.manifests().values() for sid in manifest.source_ids)


def test_a_metadata_rerun_reads_nothing_of_an_unchanged_file_and_lists_it_again_once_it_grew(
        tmp_path: Path, listings: list[str], caplog):
    write_rows(tmp_path / "d.jsonl", 0, 10)
    settings = metadata_settings(tmp_path)
    first = run(settings, "raw", ask=never)
    assert first.samples == 10 and listings == ["listing", "plan_units"]
    plan = as_output(tmp_path / "out").state.plan()
    assert plan.source_stamp == source_stamp(settings.source, shard_size=4, max_samples=None)
    assert plan.source_stamp["files"] == 1

    # Unchanged: no listing, no planning pass, no column scan on opening (the plan's columns), nothing encoded.
    listings.clear()
    metadata_rows._LAYOUTS.clear()  # this process's cache of the file's columns: a fresh process has none
    scanned, indexed = MetadataSource.scanned, MetadataSource.indexed
    with caplog.at_level(logging.INFO, logger="diffprep.phases.fetch"):
        again = run(settings, "raw", ask=never)
    assert again.action == "complete" and not again.encoded_units
    assert listings == []
    assert (MetadataSource.scanned, MetadataSource.indexed) == (scanned, indexed)
    assert any(SKIPPED in record.getMessage() and "1 input file" in record.getMessage() for record in caplog.records)
    assert as_output(tmp_path / "out").state.plan().source_stamp == plan.source_stamp

    # Touched (same bytes, a new mtime): listed again, nothing new to encode.
    listings.clear()
    os.utime(tmp_path / "d.jsonl", ns=(1, 1))
    touched = run(settings, "raw", ask=never)
    assert touched.action == "complete" and listings == ["listing", "plan_units"]

    # Appended rows: listed again, and the new rows are encoded in new units; the fingerprint stays.
    listings.clear()
    write_rows(tmp_path / "d.jsonl", 10, 14, mode="a")
    grown = run(settings, "raw", ask=never)
    assert listings == ["listing", "plan_units"]
    assert grown.action == "resume" and grown.fingerprint == first.fingerprint and grown.encoded_units == 1
    assert written_ids(tmp_path / "out") == sorted(f"img/{i:03d}.png" for i in range(14))
    assert as_output(tmp_path / "out").state.plan().source_stamp != plan.source_stamp


def test_a_plan_without_a_stamp_lists_the_source_and_records_its_stamp(tmp_path: Path, listings: list[str]):
    write_rows(tmp_path / "d.jsonl", 0, 6)
    settings = metadata_settings(tmp_path)
    run(settings, "raw", ask=never)
    plan_json = tmp_path / "out" / contract.STATE_DIR / contract.PLAN_JSON
    data = json.loads(plan_json.read_text())
    del data["source_stamp"]  # a plan written before stamps were recorded
    plan_json.write_text(json.dumps(data))

    listings.clear()
    assert run(settings, "raw", ask=never).action == "complete"
    assert listings == ["listing", "plan_units"]
    assert json.loads(plan_json.read_text())["source_stamp"] == source_stamp(settings.source, shard_size=4,
                                                                              max_samples=None)
    listings.clear()
    assert run(settings, "raw", ask=never).action == "complete" and listings == []


def write_tar(path: Path, start: int, stop: int) -> None:
    with tarfile.open(path, "w") as tar:
        for i in range(start, stop):
            for ext, data in (("png", b""), ("txt", f"caption {i}".encode())):
                info = tarfile.TarInfo(f"s{i:04d}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))


def test_a_webdataset_source_that_gains_a_tar_is_listed_again(tmp_path: Path, listings: list[str]):
    (tmp_path / "wds").mkdir()
    write_tar(tmp_path / "wds" / "a-000.tar", 0, 5)
    settings = load_settings(overrides={
        "source": {"type": "webdataset", "input_path": str(tmp_path / "wds" / "a-*.tar")},
        "output": {"output_dir": str(tmp_path / "out"), "shard_size": 4}, "raw": {"prompts_only": True},
        "finalize": {"train_split": 1.0}})
    assert run(settings, "raw", ask=never).samples == 5
    listings.clear()
    assert run(settings, "raw", ask=never).action == "complete" and listings == []

    write_tar(tmp_path / "wds" / "a-001.tar", 5, 8)
    grown = run(settings, "raw", ask=never)
    assert listings == ["listing", "plan_units"] and grown.action == "resume"
    assert len(written_ids(tmp_path / "out")) == 8


def test_stamps_cover_the_listing_and_only_sources_with_files(tmp_path: Path):
    write_rows(tmp_path / "d.jsonl", 0, 3)
    settings = metadata_settings(tmp_path)
    stamp = source_stamp(settings.source, shard_size=4, max_samples=None)
    assert stamp == source_stamp(settings.source, shard_size=4, max_samples=None)
    # Settings that decide the listing's plan are part of it: another limit plans other units.
    assert stamp != source_stamp(settings.source, shard_size=4, max_samples=2)
    assert stamp != source_stamp(settings.source.model_copy(update={"caption_key": "text"}), shard_size=4,
                                 max_samples=None)
    # A file rewritten to the same size and mtime still changes it (its ctime, its inode after a rename).
    info = os.stat(tmp_path / "d.jsonl")
    (tmp_path / "copy.jsonl").write_bytes((tmp_path / "d.jsonl").read_bytes())
    os.replace(tmp_path / "copy.jsonl", tmp_path / "d.jsonl")
    os.utime(tmp_path / "d.jsonl", ns=(info.st_atime_ns, info.st_mtime_ns))
    assert source_stamp(settings.source, shard_size=4, max_samples=None) != stamp
    # No cheap stamp: a folder of files, a missing file (opening says what is wrong).
    directory = settings.source.model_copy(update={"type": "directory", "input_dir": str(tmp_path)})
    assert source_stamp(directory, shard_size=4, max_samples=None) is None
    missing = settings.source.model_copy(update={"metadata_file": str(tmp_path / "none.jsonl")})
    assert source_stamp(missing, shard_size=4, max_samples=None) is None


def test_verify_reads_the_manifests_one_at_a_time(tmp_path: Path):
    write_rows(tmp_path / "d.jsonl", 0, 8)
    settings = metadata_settings(tmp_path)
    first = run(settings, "raw", ask=never)
    output = as_output(tmp_path / "out")
    manifests = output.state.manifests()
    assert sorted(manifests) == [0, 1] and not isinstance(manifests, dict)
    committed = output.committed_units(first.fingerprint, manifests)
    assert sorted(committed.done) == [0, 1] and committed.damaged == []
    # The committed units' mapping holds their numbers: a manifest is read when asked for, as it is then.
    path = tmp_path / "out" / contract.unit_manifest_path(1)
    data = json.loads(path.read_text())
    data["notes"] = {"read": 1}
    path.write_text(json.dumps(data))
    assert committed.done[1].notes == {"read": 1} and isinstance(committed.done[0], UnitManifest)
    assert sorted(committed.done.only([1, 5])) == [1]


BUCKET = "stamps"


@pytest.mark.usefixtures("aws_env")
def test_objects_are_stamped_by_their_size_and_etag(admin, proxy, tmp_path: Path):
    admin.put_object(Bucket=BUCKET, Key="m/d.jsonl", Body=b'{"image": "a.png", "caption": "a"}\n')
    for name in ("a-000.tar", "a-001.tar"):
        admin.put_object(Bucket=BUCKET, Key=f"w/{name}", Body=name.encode())
    settings = load_settings(overrides={"source": {"type": "metadata", "metadata_file": f"s3://{BUCKET}/m/d.jsonl",
                                                   "s3_endpoint_url": proxy.url}})
    tars = settings.source.model_copy(update={"type": "webdataset", "input_path": f"s3://{BUCKET}/w/a-*.tar"})
    metadata, shards = source_stamp(settings.source), source_stamp(tars)
    assert metadata["files"] == 1 and shards["files"] == 2 and shards["bytes"] == 18
    assert (source_stamp(settings.source), source_stamp(tars)) == (metadata, shards)

    # Rewritten to the same size: another ETag. A new tar: another set.
    admin.put_object(Bucket=BUCKET, Key="m/d.jsonl", Body=b'{"image": "b.png", "caption": "b"}\n')
    admin.put_object(Bucket=BUCKET, Key="w/a-002.tar", Body=b"a-002.tar")
    assert source_stamp(settings.source) != metadata
    assert source_stamp(tars)["files"] == 3
