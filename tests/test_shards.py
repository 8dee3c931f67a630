"""The shard writer: reproducible tars with a commit point, read back by webdataset and tarfile."""

from __future__ import annotations

import gc
import io
import json
import sys
import tarfile
from pathlib import Path

import pytest
import torch
import webdataset as wds

from diffprep import contract
from diffprep.writer.shards import (
    MEMBER_MODE,
    Reject,
    ShardWriter,
    UnitManifest,
    field_bytes,
    file_sha256,
    manifest_path,
    read_manifest,
    read_manifests,
    tar_keys,
    tensor_bytes,
    write_manifest,
)


def sample_fields(i: int) -> dict:
    generator = torch.Generator().manual_seed(i)
    return {
        contract.LATENTS: torch.randn(16, 4, 4, generator=generator),
        contract.PROMPT_EMBEDS: torch.randn(16, 32, generator=generator),
        contract.POOLED_PROMPT_EMBEDS: torch.randn(32, generator=generator),
        contract.CAPTION: f"caption {i} — ünïcode",
        contract.META: {"source_id": f"img/{i}.png", "original_size": [96, 64], "crop_box": [16, 0, 80, 64]},
    }


def write_shard(out_dir: Path, unit: int = 0, indices=(0, 1, 2)):
    with ShardWriter(out_dir, unit) as writer:
        for i in indices:
            writer.write(contract.sample_key(unit, i), sample_fields(i))
        return writer.commit()


def tmp_files(out_dir: Path) -> list[Path]:
    return sorted(p for p in (out_dir / contract.STATE_DIR / contract.TMP_DIR).iterdir())


def test_shard_reads_back_through_webdataset(tmp_path: Path) -> None:
    info = write_shard(tmp_path)
    samples = list(wds.WebDataset(str(tmp_path / "000000.tar"), shardshuffle=False, empty_check=False))

    assert [s["__key__"] for s in samples] == ["000000_000000", "000000_000001", "000000_000002"]
    assert info.count == 3
    for i, sample in enumerate(samples):
        want = sample_fields(i)
        assert set(sample) - {"__key__", "__url__", "__local_path__"} == set(contract.PREENCODED_FIELDS)
        for name in contract.TENSOR_FIELDS:
            tensor = torch.load(io.BytesIO(sample[name]), weights_only=True)
            assert torch.equal(tensor, want[name])
        assert sample[contract.CAPTION].decode("utf-8") == want[contract.CAPTION]
        assert json.loads(sample[contract.META]) == want[contract.META]


def test_tar_members_have_fixed_metadata_and_sorted_order(tmp_path: Path) -> None:
    write_shard(tmp_path)
    with tarfile.open(tmp_path / "000000.tar") as tar:
        members = tar.getmembers()
    fields = sorted(contract.PREENCODED_FIELDS)
    expected_names = [f"{contract.sample_key(0, i)}.{ext}" for i in range(3) for ext in fields]
    assert [m.name for m in members] == expected_names
    for member in members:
        assert member.isfile()
        assert (member.mtime, member.uid, member.gid, member.mode) == (0, 0, 0, MEMBER_MODE)
        assert MEMBER_MODE == 0o444
        assert (member.uname, member.gname) == ("", "")


def test_same_samples_give_identical_bytes(tmp_path: Path) -> None:
    a = write_shard(tmp_path / "a")
    b = write_shard(tmp_path / "b")
    assert (tmp_path / "a" / "000000.tar").read_bytes() == (tmp_path / "b" / "000000.tar").read_bytes()
    assert a.sha256 == b.sha256
    assert (a.bytes, a.count) == (b.bytes, b.count)


def test_commit_reports_the_size_and_hash_of_the_file(tmp_path: Path) -> None:
    info = write_shard(tmp_path, unit=7)
    path = tmp_path / "000007.tar"
    assert info.name == "000007.tar"
    assert (info.bytes, info.sha256) == file_sha256(path)
    assert info.bytes == path.stat().st_size
    assert tmp_files(tmp_path) == []  # the temporary file was renamed, not copied


def test_keys_must_increase(tmp_path: Path) -> None:
    with ShardWriter(tmp_path, 0) as writer:
        writer.write("000000_000002", {contract.CAPTION: "b"})
        with pytest.raises(ValueError, match=r"increasing order: '000000_000001' after '000000_000002'"):
            writer.write("000000_000001", {contract.CAPTION: "a"})
        with pytest.raises(ValueError, match="increasing order"):
            writer.write("000000_000002", {contract.CAPTION: "again"})
        assert writer.keys == ["000000_000002"]


@pytest.mark.parametrize("key", ["000000_000001.x", "a/b", ""])
def test_keys_with_dots_or_slashes_are_refused(tmp_path: Path, key: str) -> None:
    with ShardWriter(tmp_path, 0) as writer:
        with pytest.raises(ValueError, match="no dots or slashes"):
            writer.write(key, {contract.CAPTION: "x"})


def test_leaving_without_commit_leaves_no_file(tmp_path: Path) -> None:
    with ShardWriter(tmp_path, 3) as writer:
        writer.write("000003_000000", sample_fields(0))
        assert len(tmp_files(tmp_path)) == 1  # written to a temporary name meanwhile
    assert not (tmp_path / "000003.tar").exists()
    assert tmp_files(tmp_path) == []


def test_an_exception_inside_the_writer_leaves_no_file(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="encoder failed"):
        with ShardWriter(tmp_path, 0) as writer:
            writer.write("000000_000000", sample_fields(0))
            raise RuntimeError("encoder failed")
    assert list(tmp_path.glob("*.tar")) == []
    assert tmp_files(tmp_path) == []


def test_a_new_writer_replaces_an_uncommitted_attempt(tmp_path: Path) -> None:
    # An interrupted attempt (no commit) followed by a retry of the same unit.
    with ShardWriter(tmp_path, 0) as writer:
        writer.write("000000_000000", {contract.CAPTION: "first attempt"})
    info = write_shard(tmp_path, indices=(0,))
    assert tar_keys(tmp_path / "000000.tar") == {"000000_000000": sorted(contract.PREENCODED_FIELDS)}
    assert info.count == 1


def test_tensor_bytes_of_a_slice_hold_only_the_slice() -> None:
    small = torch.arange(16 * 8 * 8, dtype=torch.float32).reshape(1, 16, 8, 8)
    big = torch.arange(64 * 16 * 8 * 8, dtype=torch.float32).reshape(64, 16, 8, 8)
    one = len(tensor_bytes(small[0]))
    sliced = len(tensor_bytes(big[5]))
    assert sliced == one  # independent of the batch size
    assert sliced < 16 * 8 * 8 * 4 * 2  # the sample's 4 KiB plus a small header, not 64x that
    assert torch.equal(torch.load(io.BytesIO(tensor_bytes(big[5])), weights_only=True), big[5])
    assert field_bytes(big[5]) == tensor_bytes(big[5])


def test_field_bytes_by_type() -> None:
    assert field_bytes(b"\x00raw") == b"\x00raw"
    assert field_bytes("ünï") == "ünï".encode("utf-8")
    assert field_bytes({"b": 1, "a": [1, 2]}) == b'{"a":[1,2],"b":1}'
    with pytest.raises(TypeError, match="cannot store a float"):
        field_bytes(1.5)


def test_tar_keys_lists_fields_per_key(tmp_path: Path) -> None:
    with ShardWriter(tmp_path, 1) as writer:
        writer.write("000001_000000", {contract.CAPTION: "a", contract.META: {}})
        writer.write("000001_000005", {contract.CAPTION: "b"})
        writer.commit()
    assert tar_keys(tmp_path / "000001.tar") == {
        "000001_000000": [contract.CAPTION, contract.META],
        "000001_000005": [contract.CAPTION],
    }


def test_a_unit_without_samples_writes_no_shard(tmp_path: Path) -> None:
    # FastGen lists every .tar and its deterministic resume spins on a zero count: never an empty shard.
    with ShardWriter(tmp_path, 0) as writer:
        info = writer.commit()
    assert (info.name, info.count, info.bytes) == ("", 0, 0)
    assert not list(tmp_path.glob("*.tar")) and not list((tmp_path / contract.STATE_DIR).rglob("*.tar*"))


def test_manifest_round_trip(tmp_path: Path) -> None:
    info = write_shard(tmp_path, unit=2)
    manifest = UnitManifest(
        unit=2,
        shard=info.name,
        fingerprint="0123456789abcdef",
        keys=[contract.sample_key(2, i) for i in range(3)],
        source_ids=["a.png", "b.png", "c.png"],
        count=info.count,
        bytes=info.bytes,
        sha256=info.sha256,
        rejects=[Reject("d.png", "image_truncated", "cut at byte 100", "decode")],
        notes={"empty_caption": 1},
    )
    path = write_manifest(tmp_path, manifest)
    assert path == tmp_path / contract.STATE_DIR / contract.UNITS_DIR / "000002.json" == manifest_path(tmp_path, 2)
    loaded = read_manifest(tmp_path, 2)
    assert loaded == manifest
    assert isinstance(loaded.rejects[0], Reject)
    assert loaded.inputs == 4
    assert read_manifest(tmp_path, 3) is None
    assert read_manifests(tmp_path) == {2: manifest}
    assert read_manifests(tmp_path / "nothing-here") == {}


def test_abort_leaves_nothing_to_flush_at_garbage_collection(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    unraisable: list = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    with ShardWriter(tmp_path, 0) as writer:
        writer.write("000000_000000", {contract.CAPTION: "never committed"})
    del writer
    gc.collect()
    assert [str(u.exc_value) for u in unraisable] == []
