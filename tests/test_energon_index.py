"""Finalize's Energon index from the shard writer's records: the same files Energon's prepare writes."""

from __future__ import annotations

import contextlib
import json
import shutil
import sqlite3
import tarfile
from pathlib import Path

import pytest
from megatron.energon.flavors.webdataset.base_webdataset import BaseWebdatasetFactory
from test_energon import write_unit

from diffprep import contract
from diffprep.errors import DatasetValidationError
from diffprep.run.energon import _run_prepare, finalize, read_split_yaml
from diffprep.run.energon_index import record_rows
from diffprep.writer.shards import (
    ShardMembers,
    ShardWriter,
    UnitManifest,
    members_path,
    read_members,
    write_manifest,
)

LONG_FIELD = "a" * 120 + ".txt"  # a member name over tar's 100 bytes: a GNU long-name header before it


def exact_names_pattern(names: list[str]) -> str:
    """A split pattern matching exactly these shard names after Energon's brace expansion (which strips
    backslashes, hence ``[.]``): what finalize gave prepare before it wrote split.yaml itself."""
    return "^(?:" + "|".join(name.removesuffix(".tar") for name in names) + ")[.]tar$"


def rows(index: Path) -> dict[str, list[tuple]]:
    with contextlib.closing(sqlite3.connect(f"file:{index}?mode=ro", uri=True)) as db:
        return {table: sorted(db.execute(f"SELECT * FROM {table}").fetchall()) for table in ("samples", "sample_parts")}


def write_long_named_unit(out: Path, unit: int) -> None:
    with ShardWriter(out, unit) as writer:
        for index in range(3):
            writer.write(contract.sample_key(unit, index), {"txt": f"caption {index}", LONG_FIELD: "x" * (index * 700)})
        keys = writer.keys
        info = writer.commit()
    write_manifest(out, UnitManifest(unit=unit, shard=info.name, fingerprint="test", keys=keys, source_ids=keys,
                                     count=info.count, bytes=info.bytes, sha256=info.sha256))


def test_index_from_records_is_what_energon_prepare_writes(tmp_path: Path) -> None:
    out = tmp_path / "out"
    for unit in range(5):
        write_unit(out, unit, samples=unit % 3 + 1)
    write_long_named_unit(out, 5)
    record = read_members(out, "000002.tar")
    assert record is not None and record.end < record.bytes and len(record.members) == 3 * 5
    members_path(out, "000003.tar").unlink()  # a shard written before records existed: its tar is read
    stale = json.loads(members_path(out, "000004.tar").read_text())
    members_path(out, "000004.tar").write_text(json.dumps(stale | {"sha256": "0" * 64}))  # another write's record
    reference, bucket_way = tmp_path / "reference", tmp_path / "bucket-way"
    shutil.copytree(out, reference)
    shutil.copytree(out, bucket_way)

    result = finalize(out, encoding=contract.ENCODING_PREENCODED, train_split=0.5)

    names = sorted(name for shards in result.splits.values() for name in shards)
    BaseWebdatasetFactory.prepare_dataset(
        reference, names, split_parts_patterns=[(s, exact_names_pattern(n)) for s, n in result.splits.items()],
        split_config=contract.SPLIT_YAML, shuffle_seed=None, workers=1,
    )
    for name in names:
        idx = contract.index_name(name)
        assert (out / idx).read_bytes() == (reference / idx).read_bytes(), idx
    meta, expected = out / contract.NV_META, reference / contract.NV_META
    assert rows(meta / contract.INDEX_SQLITE) == rows(expected / contract.INDEX_SQLITE)
    assert (meta / contract.INFO_JSON).read_text() == (expected / contract.INFO_JSON).read_text()
    assert (meta / contract.SPLIT_YAML).read_text() == (expected / contract.SPLIT_YAML).read_text()
    assert read_split_yaml(out) == {s: split for split, shards in result.splits.items() for s in shards}
    # A bucket's finalize: Energon's prepare with patterns that match nothing, then diffprep's split.yaml.
    assert _run_prepare(bucket_way, result.splits, 1, None) == set(result.parts)
    for name in (contract.INFO_JSON, contract.SPLIT_YAML):
        assert (bucket_way / contract.NV_META / name).read_text() == (expected / name).read_text(), name
    assert (meta / contract.INDEX_UUID).is_file()
    assert LONG_FIELD in result.parts and contract.LATENTS in result.parts


def test_a_tar_rewritten_at_the_same_size_is_refused(tmp_path: Path) -> None:
    out = tmp_path / "out"
    for unit in range(3):
        write_unit(out, unit)
    record = read_members(out, "000001.tar")
    assert record is not None
    name, at, _, _ = record.members[-1]
    with open(out / "000001.tar", "r+b") as handle:  # the last member renamed, its header checksum made right
        handle.seek(at)
        header = tarfile.TarInfo.frombuf(handle.read(tarfile.BLOCKSIZE), "utf-8", "surrogateescape")
        header.name = name.replace("000001_", "000007_")
        handle.seek(at)
        handle.write(header.tobuf(tarfile.GNU_FORMAT))
    with pytest.raises(DatasetValidationError, match="000001.tar does not hold what its writer recorded .* changed "
                                                     "after it was committed; re-encode unit 1"):
        finalize(out, encoding=contract.ENCODING_PREENCODED, train_split=1.0)
    assert not (out / contract.NV_META / contract.INDEX_SQLITE).exists()


def test_an_unreadable_tar_without_a_record_is_refused(tmp_path: Path) -> None:
    out = tmp_path / "out"
    for unit in range(2):
        write_unit(out, unit)
    members_path(out, "000001.tar").unlink()
    size = (out / "000001.tar").stat().st_size
    (out / "000001.tar").write_bytes(b"\1" * size)  # same size: committed_shards cannot tell
    with pytest.raises(DatasetValidationError, match="could not index shard .*000001.tar .* re-encode unit 1"):
        finalize(out, encoding=contract.ENCODING_PREENCODED, train_split=1.0)


def test_a_sample_key_in_two_shards_is_refused(tmp_path: Path) -> None:
    out = tmp_path / "out"
    for unit in range(2):
        with ShardWriter(out, unit) as writer:
            writer.write("000000_000000", {"txt": f"copied into unit {unit}"})
            info = writer.commit()
        write_manifest(out, UnitManifest(unit=unit, shard=info.name, fingerprint="test", keys=["000000_000000"],
                                         source_ids=["a"], count=1, bytes=info.bytes, sha256=info.sha256))
    with pytest.raises(DatasetValidationError, match="two shards hold the sample key '000000_000000' .*000001.tar"):
        finalize(out, encoding=contract.ENCODING_PREENCODED, train_split=1.0)
    assert not (out / contract.NV_META / contract.INDEX_SQLITE).exists()


@pytest.mark.parametrize("name", ["000001_000002.latents.pth", "k.", ".hidden", "nodot", "a.b.c", "x/y.z", "x.y/z",
                                  "a/.b", "a\n.b\n", "dir/sub/k.txt", "__meta__.txt", "k.__x__/y"])
def test_record_rows_split_names_as_energon_does(name: str) -> None:
    from megatron.energon.flavors.webdataset.config import skip_meta_re, split_name_re

    samples, parts, _, _ = record_rows(ShardMembers("000000.tar", 2048, "0" * 64, 1536, [(name, 0, 512, 7)]), 0)
    match = None if skip_meta_re.match(name) else split_name_re.match(name)
    assert [(s.sample_key, p.part_name) for s, p in zip(samples, parts)] == (
        [(match.group(1), match.group(2))] if match else [])


def test_member_records_are_diffprep_s_files(tmp_path: Path) -> None:
    from diffprep.output import Output
    from diffprep.validation.ownership import ownership

    out = tmp_path / "out"
    write_unit(out, 0)
    owned = ownership(Output(out))
    assert ".diffprep/members/000000.json" in owned.ours and owned.foreign == ()
