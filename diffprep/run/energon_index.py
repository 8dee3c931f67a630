"""Energon's dataset index, built from what the shard writer recorded instead of reading every tar again.

Energon's ``prepare_dataset`` reads every tar's headers in worker processes, pickles a row object per sample and
per sample part to one aggregator process, and matches every shard name against every split pattern. At 100k
samples (100 shards of 1000, 2 cores) that was 52 s on an idle machine, two thirds of it in the aggregator
(unpickling the rows, sqlite inserts) and the rest in the tar reads: ~14 hours at 100M samples, growing with the
samples whatever the worker count (benchmarks/README.md, section 4). The split patterns, an alternation of every
shard name, grew ~N^2.3 in shards.

Here, in one process and in shard order:

- a shard whose writer left its member record (``diffprep.writer.shards.ShardMembers``, matching the manifest's
  digest) gets its ``.tar.idx`` (``write_tar_index``) and its index rows from that record, reading only one tar header (the last
  sample's: a tar rewritten after its commit is refused);
- any other shard (written before records existed, or a record that does not match) is read by Energon's own
  per-tar reader, ``WebdatasetPreparator._preprocess_tar``, exactly as prepare would;
- the rows go through Energon's ``SqliteIndexWriter``; ``.info.json``, ``index.uuid`` and ``split.yaml`` are
  Energon's ``WebdatasetInfo`` and ``WebdatasetSplits`` written as prepare writes them, the split lists given
  explicitly (brace-collapsed by Energon's ``collapse``, as prepare does) instead of as patterns.

The result is byte-identical (``.tar.idx``) and row-identical (``index.sqlite``) to prepare over the same shards:
tests/test_energon_index.py compares them. Energon is imported inside the functions: it pulls in torch and more.
"""

from __future__ import annotations

import array
import gc
import json
import os
import tarfile
import uuid
from pathlib import Path
from collections.abc import Iterator
from typing import Any, Callable

import yaml

from diffprep import contract
from diffprep.errors import DatasetValidationError
from diffprep.writer.shards import ShardMembers, UnitManifest, read_members

Progress = Callable[[str, int, int], None]

MAX_PARTS = 50  # prepare's cap on the part names it collects


def record_rows(record: ShardMembers, tar_file_id: int) -> tuple[list[Any], list[Any], list[int], set[str]]:
    """(sample rows, part rows, .tar.idx offsets, part names) of one shard from its writer's record.

    The same walk as Energon's ``_preprocess_tar`` over the tar headers, with Energon's own name rules
    (``split_name_re``, ``skip_meta_re``) and row classes.
    """
    from megatron.energon.flavors.webdataset.config import skip_meta_re, split_name_re
    from megatron.energon.flavors.webdataset.prepare import IndexSample, IndexSamplePart

    samples: list[Any] = []
    parts: list[Any] = []
    offsets: list[int] = []
    names: set[str] = set()
    last_base = None
    for name, at, data_at, size in record.members:
        # skip_meta_re matches from the start of the name, "__" first: most names need not be matched against it.
        if "__" in name and skip_meta_re.match(name):
            continue
        if "/" in name:
            if (match := split_name_re.match(name)) is None:
                continue
            base, part = match.group(1), match.group(2)
        else:  # split_name_re's own groups for a name without a slash: around the first dot, not at the start
            dot = name.find(".")  # (the regex backtracks over the whole name: 2 ms against 1 ms per 5000 names)
            if dot < 1:
                continue
            base, part = name[:dot], name[dot + 1:]
        if len(names) < MAX_PARTS:
            names.add(part)
        if base != last_base:
            offsets.append(at)
            if samples:
                samples[-1].byte_size = at - samples[-1].byte_offset
            samples.append(IndexSample(tar_file_id=tar_file_id, sample_key=base, sample_index=len(samples),
                                       byte_offset=at, byte_size=None))
            last_base = base
        parts.append(IndexSamplePart(tar_file_id=tar_file_id, sample_index=len(samples) - 1, part_name=part,
                                     content_byte_offset=data_at, content_byte_size=size))
    offsets.append(record.end)
    if samples:
        samples[-1].byte_size = record.end - samples[-1].byte_offset
    return samples, parts, offsets, names


def _check_recorded_tar(where: str, header_bytes: bytes | None, record: ShardMembers,
                        manifest: UnitManifest) -> None:
    """The tar still is what its writer recorded: its size (``committed_shards`` checked it against the manifest)
    and the header of its last member (``header_bytes``, read at the recorded offset: one 512-byte read per
    shard)."""
    if not record.members:
        return
    name, at, _, size = record.members[-1]
    try:
        if header_bytes is None:
            raise OSError("it could not be read")
        header = tarfile.TarInfo.frombuf(header_bytes, "utf-8", "surrogateescape")
    except (OSError, tarfile.TarError) as error:
        header = None
        reason = str(error) or type(error).__name__
    else:
        reason = f"member {header.name!r} of {header.size} bytes"
    expected = name if len(name.encode("utf-8")) <= tarfile.LENGTH_NAME else "././@LongLink"  # GNU long name
    if header is None or header.name != expected or (expected == name and header.size != size):
        raise DatasetValidationError(
            f"shard {where} does not hold what its writer recorded at byte {at} ({reason}, recorded {name!r} of "
            f"{size} bytes): the tar changed after it was committed; re-encode unit {manifest.unit}"
        )


class FolderShards:
    """The shards of a local dataset as ``build_index`` reads and indexes them: the writer's records and the tars
    in the folder, each ``.tar.idx`` written beside its tar. (A bucket's: ``diffprep.run.energon_bucket``.)"""

    reads_tars = True  # a shard without a record is read by Energon's own per-tar reader

    def __init__(self, root: Path) -> None:
        self.root = root

    def where(self, name: str) -> str:
        return str(self.root / name)

    def fetched(self, names: list[str]) -> Iterator[tuple[ShardMembers | None, bytes | None]]:
        """Each shard's record and the 512 bytes at its last member's header (None: no record, or unreadable)."""
        for name in names:
            record = read_members(self.root, name)
            yield record, (_read_at(self.root / name, record.members[-1][1]) if record and record.members
                           else None)

    def write_index(self, name: str, offsets: list[int]) -> None:
        write_tar_index(self.root / name, offsets)

    def close(self) -> None:
        """Every index written (nothing is pending for a folder)."""


def _read_at(path: Path, at: int) -> bytes | None:
    try:
        with open(path, "rb") as handle:
            handle.seek(at)
            return handle.read(tarfile.BLOCKSIZE)
    except OSError:
        return None


class NoRecord(Exception):
    """A bucket's shard has no writer's record matching its manifest: its index needs Energon's prepare."""


def tar_index_bytes(offsets: list[int]) -> bytes:
    """A ``.tar.idx``'s bytes: every sample's offset and the end offset, each a native uint64 (Energon's
    ``TarIndexWriter``: ``struct.pack("Q", ...)``)."""
    return array.array("Q", offsets).tobytes()


def write_tar_index(tar: Path, offsets: list[int]) -> None:
    """A shard's ``.tar.idx`` as Energon's ``TarIndexWriter`` writes it: every sample's offset and the end offset,
    each a native uint64 (its ``struct.pack("Q", ...)``), written to a temporary name and renamed, the file's mode
    the tar's plus owner read-write. Not through ``TarIndexWriter`` itself: on a local path it goes through the
    Multi-Storage Client (an instrumented call per offset, and a copy and delete for the rename), which was half of
    finalize's time at 10k shards of 10 samples. The bytes are compared with prepare's in the tests."""
    final = tar.with_name(contract.index_name(tar.name))
    temporary = final.with_name(final.name + ".tmp")
    temporary.write_bytes(tar_index_bytes(offsets))
    temporary.chmod(tar.stat().st_mode | 0o600)
    os.replace(temporary, final)


def _shard_items(shards: Any, name: str, index: int, shard_to_idx: dict[str, int], manifest: UnitManifest,
                 record: ShardMembers | None, header: bytes | None) -> tuple[list[Any], list[Any], int, set[str]]:
    """(sample rows, part rows, sample count, part names) of one shard (``record``/``header``: ``shards.fetched``'s);
    writes its ``.tar.idx``."""
    from megatron.energon.epathlib import EPath
    from megatron.energon.flavors.webdataset.prepare import (
        IndexSample,
        IndexSamplePart,
        IndexShardInfo,
        WebdatasetPreparator,
    )

    if record is not None and record.sha256 == manifest.sha256 and record.bytes == manifest.bytes:
        _check_recorded_tar(shards.where(name), header, record, manifest)
        samples, parts, offsets, names = record_rows(record, index)
        shards.write_index(name, offsets)
        return samples, parts, len(samples), names
    if not shards.reads_tars:
        raise NoRecord(name)
    # No record of this write (an earlier diffprep's shard): Energon's own reader, as prepare runs it per tar.
    samples, parts, count, names = [], [], 0, set()
    for item in WebdatasetPreparator._preprocess_tar(name, shard_to_idx, EPath(shards.root), max_parts=MAX_PARTS):
        if isinstance(item, IndexSample):
            samples.append(item)
        elif isinstance(item, IndexSamplePart):
            parts.append(item)
        elif isinstance(item, IndexShardInfo):
            count, names = item.shard_info.count, item.parts
    if count == 0:  # prepare's aggregator asserts the same; Energon logged why the tar did not read
        raise DatasetValidationError(
            f"Energon could not index shard {shards.where(name)} (0 samples in its tar headers); the shard is "
            f"unreadable or truncated: re-encode unit {manifest.unit}"
        )
    return samples, parts, count, names


def build_index(root: Path, splits: dict[str, list[str]], manifests: dict[str, UnitManifest],
                progress: Progress | None = None, shards: Any = None) -> set[str]:
    """Write Energon's metadata for a dataset: every shard's ``.tar.idx``, ``.nv-meta/index.sqlite``,
    ``index.uuid``, ``.info.json`` and ``split.yaml`` (``splits``: split -> shard names) under ``root``. Returns the
    part names found (at most 50, as prepare). Shards are indexed in name order, their ``tar_file_id`` their
    position in it, as prepare numbers the paths it is given. ``shards``: where the shards and their records are
    (default: ``FolderShards(root)``; a bucket's raises ``NoRecord`` for a shard without one)."""
    from megatron.energon.epathlib import EPath
    from megatron.energon.flavors.webdataset.indexing import DuplicateSampleKeyError, SqliteIndexWriter

    shards = FolderShards(root) if shards is None else shards
    names = sorted(name for part in splits.values() for name in part)
    shard_to_idx = {name: index for index, name in enumerate(names)}
    meta = root / contract.NV_META
    meta.mkdir(exist_ok=True)
    counts: dict[str, int] = {}
    found: set[str] = set()
    writer = SqliteIndexWriter(EPath(meta / contract.INDEX_SQLITE))
    collecting = gc.isenabled()
    # Six row objects per sample, freed by reference counting shard by shard: the cyclic collector's passes over
    # them found nothing and were a third of the time (1.2 of 3.2 s at 100 shards of 1000).
    gc.disable()
    try:
        for index, (name, (record, header)) in enumerate(zip(names, shards.fetched(names))):
            samples, parts, counts[name], names_here = _shard_items(shards, name, index, shard_to_idx,
                                                                    manifests[name], record, header)
            if len(found) < MAX_PARTS:
                found.update(names_here)
            try:
                writer.append_samples(samples)
            except DuplicateSampleKeyError as error:
                raise DatasetValidationError(
                    f"two shards hold the sample key {error.sample_key!r} (the second: {name}). diffprep keys are "
                    "<unit>_<index>, so a shard was copied or renamed; remove the duplicate and finalize again"
                ) from None
            writer.append_parts(parts)
            if progress is not None:
                progress("prepare", index + 1, len(names))
        shards.close()
    except BaseException:
        writer.close()
        (meta / contract.INDEX_SQLITE).unlink(missing_ok=True)  # as prepare does: no index of part of the shards
        raise
    finally:
        if collecting:
            gc.enable()
    writer.close()
    (meta / contract.INDEX_UUID).write_text(str(uuid.uuid4()))
    write_info(root, counts)
    write_split_yaml(root, splits)
    return found


def write_info(root: Path, counts: dict[str, int]) -> None:
    """``.info.json`` (and a legacy ``.info.yaml`` when one exists) as prepare writes them."""
    from megatron.energon import __version__
    from megatron.energon.flavors.webdataset.structs import WebdatasetInfo
    from megatron.energon.typed_converter import to_json_object

    info = to_json_object(WebdatasetInfo(energon_version=__version__, shard_counts=counts))
    meta = root / contract.NV_META
    with open(meta / contract.INFO_JSON, "w") as handle:
        json.dump(info, handle, indent=2)
    if (meta / contract.INFO_YAML).is_file():
        with open(meta / contract.INFO_YAML, "w") as handle:
            yaml.dump(info, handle)


def write_split_yaml(root: Any, splits: dict[str, list[str]]) -> None:
    """``split.yaml`` in Energon's ``WebdatasetSplits`` format, each split's shards listed (brace-collapsed with
    Energon's ``collapse``, in the given order) as prepare writes them: linear in the shards. ``root``: a local
    ``Path`` or Energon's ``EPath`` of a bucket."""
    from megatron.energon.bracecollapse import collapse
    from megatron.energon.flavors.webdataset.structs import WebdatasetSplits
    from megatron.energon.typed_converter import to_json_object

    config = WebdatasetSplits(split_parts={split: collapse(names, keep_order=True) for split, names in splits.items()})
    with (root / contract.NV_META / contract.SPLIT_YAML).open("w") as handle:
        yaml.dump(to_json_object(config), handle, sort_keys=False)
