"""sources/tar_headers.py gives what ``tarfile`` gives, member for member and error for error, on every tar.

Each test writes its tars with ``tarfile`` itself (or damages one) and compares the fast reader's members, and
the exception it ends with, against ``tarfile``'s walk of the same bytes, from a path and from a stream.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import random
import tarfile
from pathlib import Path
from typing import Callable, Iterator

import pytest

from diffprep.sources.tar_headers import TarMember, file_members, stream_members
from diffprep.writer.shard_reading import shard_digest, tar_keys

Outcome = tuple[list[tuple], tuple[type, str] | None]


def _outcome(members: Callable[[], Iterator]) -> Outcome:
    """The members as tuples and the error the walk ended with (type and message), or None."""
    found: list[tuple] = []
    try:
        for member in members():
            found.append(tuple(member))
    except Exception as error:  # noqa: BLE001 - tarfile raises ValueError or OverflowError on some damage too
        return found, (type(error), str(error))
    return found, None


def _tarfile(opener: Callable[[], tarfile.TarFile]) -> Iterator[TarMember]:
    with opener() as tar:
        for member in tar:
            if member.isreg():
                yield TarMember(member.name, member.offset, member.offset_data, member.size)


class _Trickle(io.RawIOBase):
    """A stream that hands out at most 700 bytes per read, as a network stream may."""

    def __init__(self, data: bytes) -> None:
        super().__init__()
        self._data = io.BytesIO(data)

    def readable(self) -> bool:
        return True

    def read(self, size: int = -1) -> bytes:
        return self._data.read(min(700, size) if size >= 0 else 700)


class _ReadsOnForEver(Exception):
    pass


class _Ending(io.BytesIO):
    """A stream that stops a reader asking for more after its end a thousand times."""

    def __init__(self, data: bytes) -> None:
        super().__init__(data)
        self._empty = 0

    def read(self, size: int | None = -1) -> bytes:
        data = super().read(size)
        self._empty += not data
        if self._empty > 1000:
            raise _ReadsOnForEver()
        return data


def assert_same(path: Path, compressed: bool = False) -> Outcome:
    """Every form of the fast reader equals tarfile's walk of ``path`` (plain or transparent-compression modes):
    the file form tarfile's file mode, the stream form its stream mode (the same but where a damaged size seeks
    backwards). Returns tarfile's outcome."""
    data = path.read_bytes()
    file_mode, stream_mode = ("r:*", "r|*") if compressed else ("r:", "r|")
    expected = _outcome(lambda: _tarfile(lambda: tarfile.open(path, file_mode)))
    assert _outcome(lambda: file_members(path, file_mode)) == expected
    streamed = _outcome(lambda: _tarfile(lambda: tarfile.open(fileobj=_Ending(data), mode=stream_mode)))
    if streamed[1] is not None and streamed[1][0] is _ReadsOnForEver:
        return expected  # a damaged size far past the end: tarfile's stream reads empty blocks for ever
    assert _outcome(lambda: stream_members(io.BytesIO(data), stream_mode)) == streamed
    assert _outcome(lambda: stream_members(_Trickle(data), stream_mode)) == streamed
    return expected


def _add(tar: tarfile.TarFile, name: str, data: bytes = b"", kind: bytes = tarfile.REGTYPE, **fields) -> None:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.size = len(data) if kind in tarfile.REGULAR_TYPES else 0
    for field, value in fields.items():
        setattr(info, field, value)
    tar.addfile(info, io.BytesIO(data) if info.size else None)


def _mixed_tar(path: Path, fmt: int) -> Path:
    """Files of several sizes, long names, a prefix-field name, a folder, links, a fifo, a non-ASCII name."""
    with tarfile.open(path, "w", format=fmt) as tar:
        _add(tar, "folder", kind=tarfile.DIRTYPE)
        for index in range(40):
            _add(tar, f"{index:06d}.latents.pth", bytes([index]) * (index * 37))
            _add(tar, f"{index:06d}.json", b'{"a": 1}')
        _add(tar, "deep/" * 25 + "sample.txt", b"long name")  # 150 characters: GNU 'L', pax 'x', ustar prefix
        _add(tar, "link", kind=tarfile.SYMTYPE, linkname="000001.json")
        _add(tar, "hard", kind=tarfile.LNKTYPE, linkname="000002.json")
        _add(tar, "pipe", kind=tarfile.FIFOTYPE)
        _add(tar, "café.txt", "é".encode() * 3)
        _add(tar, "big.bin", b"x" * (5 << 20))  # past a 4 MiB read, and past the file window's seek threshold
        for index in range(5):
            _add(tar, f"spread/{index}.bin", b"y" * 40000)
    return path


@pytest.mark.parametrize("fmt", [tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT],
                         ids=["ustar", "gnu", "pax"])
def test_every_format_equals_tarfile(tmp_path: Path, fmt: int) -> None:
    members, error = assert_same(_mixed_tar(tmp_path / "mixed.tar", fmt))
    names = [member[0] for member in members]
    assert error is None and len(names) == 88
    assert "deep/" * 25 + "sample.txt" in names and "café.txt" in names
    assert "folder" not in names and "link" not in names and "pipe" not in names  # isfile() only


def test_ustar_prefix_field_is_read(tmp_path: Path) -> None:
    path = tmp_path / "prefix.tar"
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
        _add(tar, "a" * 90 + "/" + "b" * 90 + ".txt", b"data")
    assert path.read_bytes()[345:346] == b"a"  # the writer put the folder part in the prefix field
    assert assert_same(path)[0][0][0] == "a" * 90 + "/" + "b" * 90 + ".txt"


def test_empty_tars(tmp_path: Path) -> None:
    written = tmp_path / "written.tar"
    tarfile.open(written, "w").close()
    assert assert_same(written) == ([], None)
    nothing = tmp_path / "nothing.tar"
    nothing.write_bytes(b"")
    assert assert_same(nothing)[1] == (tarfile.ReadError, "empty file")


def _two_members(path: Path) -> bytes:
    with tarfile.open(path, "w", format=tarfile.GNU_FORMAT) as tar:
        _add(tar, "a.txt", b"a" * 700)
        _add(tar, "b.txt", b"b" * 10)
    return path.read_bytes()


def test_truncated_tars(tmp_path: Path) -> None:
    data = _two_members(tmp_path / "whole.tar")
    cut = tmp_path / "cut.tar"
    cases = {
        600: (1, (tarfile.ReadError, "unexpected end of data")),  # inside a.txt's data
        1536 + 100: (1, None),  # inside b.txt's header: tarfile ends quietly
        1536 + 512 + 512: (2, None),  # no end-of-archive block
        1536 + 512 + 5: (2, (tarfile.ReadError, "unexpected end of data")),  # b.txt's padding cut
        200: (0, (tarfile.ReadError, "truncated header")),
    }
    for length, (count, error) in cases.items():
        cut.write_bytes(data[:length])
        members, found = assert_same(cut)
        assert (len(members), found) == (count, error), length


def _rechecksum(header: bytearray, signed: bool = False) -> None:
    header[148:156] = b" " * 8
    total = sum(b - 256 if signed and b > 127 else b for b in header)
    header[148:156] = b"%06o\0 " % total


def test_damaged_checksums(tmp_path: Path) -> None:
    data = bytearray(_two_members(tmp_path / "whole.tar"))
    damaged = tmp_path / "damaged.tar"
    first = bytearray(data)
    first[10] ^= 1
    damaged.write_bytes(first)
    assert assert_same(damaged) == ([], (tarfile.ReadError, "bad checksum"))
    second = bytearray(data)
    second[1536 + 10] ^= 1
    damaged.write_bytes(second)
    assert len(assert_same(damaged)[0]) == 1  # tarfile takes a later bad header for the end
    signed = bytearray(data)
    signed[0:5] = "é.tx".encode()  # bytes over 127, and the checksum as a signed-char tar writes it
    header = signed[0:512]
    _rechecksum(header, signed=True)
    signed[0:512] = header
    damaged.write_bytes(signed)
    assert assert_same(damaged)[0][0][0] == "é.tx"


def test_base256_size(tmp_path: Path) -> None:
    data = bytearray(_two_members(tmp_path / "whole.tar"))
    header = data[0:512]
    header[124:136] = b"\x80" + (700).to_bytes(11, "big")  # GNU base-256, as for a member over 8 GiB
    _rechecksum(header)
    data[0:512] = header
    path = tmp_path / "base256.tar"
    path.write_bytes(data)
    assert [member[3] for member in assert_same(path)[0]] == [700, 10]
    header[124:136] = b"\xff" * 12  # negative: handed to tarfile, which reads it its own way
    _rechecksum(header)
    data[0:512] = header
    path.write_bytes(data)
    assert_same(path)


def test_links_and_folders_skip_no_data(tmp_path: Path) -> None:
    """A link or a v7 folder (a regular type whose name ends in '/') with a size: tarfile skips no data after it."""
    path = tmp_path / "odd.tar"
    with tarfile.open(path, "w", format=tarfile.GNU_FORMAT) as tar:
        _add(tar, "old/", kind=tarfile.AREGTYPE)
        _add(tar, "link", kind=tarfile.SYMTYPE, linkname="x")
        _add(tar, "a.txt", b"a")
    data = bytearray(path.read_bytes())
    for at in (0, 512):
        header = data[at:at + 512]
        header[124:136] = b"%011o\0" % 512
        _rechecksum(header)
        data[at:at + 512] = header
    path.write_bytes(data)
    assert assert_same(path)[0] == [("a.txt", 1024, 1536, 1)]


def test_compressed_tar_goes_to_tarfile(tmp_path: Path) -> None:
    plain = _mixed_tar(tmp_path / "mixed.tar", tarfile.GNU_FORMAT)
    packed = tmp_path / "mixed.tar.gz"
    packed.write_bytes(gzip.compress(plain.read_bytes(), compresslevel=1))
    assert len(assert_same(packed, compressed=True)[0]) == 88
    assert assert_same(plain, compressed=True) == assert_same(plain)


def test_damaged_tars_equal_tarfile(tmp_path: Path) -> None:
    """Random damage (a header byte changed, the tar cut) in every format: the same members and the same error."""
    rng = random.Random(37)
    tars = []
    for fmt in (tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT):
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w", format=fmt) as tar:
            for index in range(6):
                _add(tar, f"{index:03d}.x" if index != 3 else "n" * 60 + "/" + "n" * 60 + ".x", bytes(rng.randrange(1, 1500)))
        tars.append(buffer.getvalue())
    path = tmp_path / "damaged.tar"
    for case in range(300):
        data = bytearray(rng.choice(tars))
        header = rng.choice([at for at in range(0, len(data), 512) if data[at:at + 512].strip(b"\0")])
        field = rng.choice([(0, 100), (100, 124), (124, 136), (136, 148), (148, 156), (156, 157), (329, 345),
                            (345, 500), (0, 512)])
        values = [0, 32, 45, 48, 55, 56, 75, 76, 83, 95, 103, 120, 128, 255, rng.randrange(256)]  # K L S g x too
        data[header + rng.randrange(*field)] = rng.choice(values)
        if case % 2 == 0:
            block = data[header:header + 512]
            _rechecksum(block)  # a damaged field under a good checksum
            data[header:header + 512] = block
        if case % 4 == 0:
            data = data[:rng.randrange(len(data))]
        path.write_bytes(data)
        assert_same(path)


def test_shard_digest_hashes_every_byte_and_reads_keys(tmp_path: Path) -> None:
    """The stream form leaves the stream where the hash reads on: the same size and sha256 as the file's, and the
    keys tarfile reads, through a pax header met half way (tarfile then reads on from there)."""
    path = tmp_path / "shard.tar"
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tar:
        _add(tar, "000000_000000.latents.pth", b"1" * 3000)
        _add(tar, "000000_000001.latents.pth", b"2" * 30, pax_headers={"comment": "x"})
        _add(tar, "000000_000001.json", b"{}")
    data = path.read_bytes()
    digest = shard_digest(_Trickle(data))
    assert (digest.size, digest.sha256) == (len(data), hashlib.sha256(data).hexdigest())
    assert digest.keys == {"000000_000000": ["latents.pth"], "000000_000001": ["latents.pth", "json"]}
    assert digest.error is None and tar_keys(path) == tar_keys(io.BytesIO(data)) == digest.keys
    broken = shard_digest(io.BytesIO(data[:2000]))
    assert (broken.size, type(broken.error)) == (2000, tarfile.ReadError)
    assert broken.keys == {"000000_000000": ["latents.pth"]}  # read before the cut, as tarfile reads it
