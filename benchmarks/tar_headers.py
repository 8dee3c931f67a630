"""Tar member headers per second: ``sources/tar_headers.py`` against ``tarfile``, the same tars, in one run (issue #37).

Three tars: a captions-only shard as the writer writes it (``ShardWriter``: txt + json per sample, 1000 samples),
a WebDataset input tar as ``benchmarks/scale.py`` writes it (png + txt, 20k samples: what the plan lists), and a
shard of 64 KiB members (latents-sized: the file form seeks over them). Each is walked from its path and as a
stream, by ``tarfile`` (``r:`` / ``r|``, regular members only, as the callers did) and by ``tar_headers``; the
members found are compared, and each time is the best of ``--rounds``.

    python benchmarks/tar_headers.py
"""

from __future__ import annotations

import argparse
import io
import tarfile
import tempfile
from pathlib import Path

import _env  # noqa: F401  first: offline environment
from _common import fastest_of

from diffprep import contract
from diffprep.sources.tar_headers import file_members, stream_members
from diffprep.writer.shards import ShardWriter

PNG = bytes.fromhex("89504e470d0a1a0a0000000d4948445200000001000000010800000000"
                    "3a7e9b550000000a49444154789c636800000082008177cd72b60000000049454e44ae426082")


def captions_shard(folder: Path) -> Path:
    with ShardWriter(folder, 0) as writer:
        for index in range(1000):
            writer.write(contract.sample_key(0, index), {contract.RAW_CAPTION: f"a caption of row {index}",
                                                         contract.RAW_VIDEO_META: {"source_id": f"row{index:09d}"}})
        info = writer.commit()
    return folder / info.name


def plain_tar(path: Path, samples: int, members: list[tuple[str, bytes]]) -> Path:
    with tarfile.open(path, "w") as tar:
        for index in range(samples):
            for ext, data in members:
                info = tarfile.TarInfo(f"s{index:09d}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return path


def tarfile_walk(path: Path, stream: bool) -> list[tuple]:
    with open(path, "rb") as handle, (tarfile.open(fileobj=handle, mode="r|") if stream
                                      else tarfile.open(path, "r:")) as tar:
        return [(m.name, m.offset, m.offset_data, m.size) for m in tar if m.isreg()]


def fast_walk(path: Path, stream: bool) -> list[tuple]:
    if stream:
        with open(path, "rb") as handle:
            return [tuple(m) for m in stream_members(handle, "r|")]
    return [tuple(m) for m in file_members(path, "r:")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    ratios = []
    with tempfile.TemporaryDirectory(prefix="tar-headers-") as scratch:
        folder = Path(scratch)
        tars = {
            "captions shard (writer)": captions_shard(folder),
            "webdataset input (png+txt)": plain_tar(folder / "input.tar", 20_000, [("png", PNG), ("txt", b"caption")]),
            "64 KiB members": plain_tar(folder / "big.tar", 500, [("latents.pth", bytes(64 << 10))]),
        }
        print("| tar | form | headers | tarfile headers/s | tar_headers headers/s | ratio |")
        print("|---|---|---:|---:|---:|---:|")
        for label, path in tars.items():
            for stream in (False, True):
                expected = tarfile_walk(path, stream)
                assert fast_walk(path, stream) == expected, f"{label}: members differ from tarfile's"
                old = fastest_of(args.rounds, lambda: tarfile_walk(path, stream))
                new = fastest_of(args.rounds, lambda: fast_walk(path, stream))
                ratios.append(old / new)
                count = len(expected)
                print(f"| {label} | {'stream' if stream else 'file'} | {count:,} | {count / old:,.0f} | "
                      f"{count / new:,.0f} | {old / new:.1f}× |", flush=True)
    print(f"SUMMARY tar_headers: {min(ratios):.1f}-{max(ratios):.1f}x the headers per second of tarfile, same members")


if __name__ == "__main__":
    main()
