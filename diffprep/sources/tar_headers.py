"""A tar's regular members (name, header offset, data offset, size), read fast and exactly as ``tarfile`` reads them.

Why it exists: checking a written dataset and listing a WebDataset source both walk every member header of every
tar, and Python's ``tarfile`` spends 18-25 µs per header building a full ``TarInfo`` (``frombuf``, ``nti``, ``nts``,
``calc_chksums``). Measured on main at 1M samples: ``validate`` 50 s, 11.9 of 12.6 s of it (at 100k) in that
parsing; the webdataset plan's listing 54 s, its threads GIL-bound: 1.3-1.5 h each at 100M samples.
``benchmarks/tar_headers.py`` gives the ratio.

How: the tar is read in large blocks (a file: seek past member data; a stream: read once, forward only) and each
header is checked and cut with slices inside the block. What this handles is only the plain case: ustar/v7/GNU
headers of the types 0-7 and NUL, numbers that ``tarfile.nti`` itself decodes (cached per field's bytes, so
base-256 is its own answer), the checksum as ``tarfile`` accepts it (unsigned, else signed), the ustar prefix,
a zero block as the end. At anything else -- a pax header ('x'/'g'), a GNU long name or link ('L'/'K'), sparse,
an unknown type, a bad checksum or number, a header cut short, no end block, a compressed file -- it hands the tar
to ``tarfile`` from that header on: the members before it are the same, a header is read the same from any
offset, and ``tarfile`` gives the rest (or its own error). A member whose data runs past the end raises the
``tarfile.ReadError`` that ``tarfile`` raises there. ``tests/test_tar_headers.py`` compares both on every format.
"""

from __future__ import annotations

import os
import tarfile
import zlib
from collections.abc import Callable, Iterator
from typing import IO, NamedTuple

BLOCK = tarfile.BLOCKSIZE
_MIN_READ = 64 << 10
_MAX_READ = 4 << 20
# Types whose header this reads itself: regular ('0', NUL, contiguous '7') and those with no data to skip.
_REGULAR = frozenset(b"07\0")
_NO_DATA = frozenset(b"123456")
# First bytes of compressed data that ``tarfile`` mode "*" detects (gz, bz2, xz, lzma, zstd): handed over.
_COMPRESSED = (b"\x1f\x8b", b"BZh", b"\x5d\x00\x00", b"\xfd7zXZ", b"\x28\xb5\x2f\xfd")
_SEEK_SPAN = 16 << 10
_CACHE_LIMIT = 1 << 16
# The number fields read only to check them, as runs checked at once (start, end, field width):
# mode+uid+gid, mtime, devmajor+devminor.
_CHECKED = ((100, 124, 8), (136, 148, 12), (329, 345, 8))
_ENCODING = tarfile.ENCODING  # what TarFile decodes names with (its errors: surrogateescape)


class TarMember(NamedTuple):
    """A regular member as ``tarfile.TarInfo`` gives it: ``.name``, ``.offset``, ``.offset_data``, ``.size``."""

    name: str
    offset: int  # its first header (a pax or GNU long-name header before it included)
    offset_data: int
    size: int


def file_members(path: str | os.PathLike, mode: str = "r:") -> Iterator[TarMember]:
    """Regular members of the tar file at ``path``; ``mode`` is the ``tarfile.open`` mode it equals ("r:", "r:*")."""
    try:
        handle = open(path, "rb")
    except OSError:
        yield from _tarfile_members(lambda: tarfile.open(path, mode))  # tarfile's own error
        return
    with handle:
        window = _FileWindow(handle)
        at = yield from _walk(window, "*" in mode)
        if at == 0:
            yield from _tarfile_members(lambda: tarfile.open(path, mode))
        elif at is not None:
            handle.seek(at)
            yield from _tarfile_members(lambda: tarfile.TarFile(fileobj=handle, mode="r"))


def stream_members(stream: IO[bytes], mode: str = "r|") -> Iterator[TarMember]:
    """Regular members of a forward-only stream, each byte read once (``mode``: "r|" or "r|*"). Where the headers
    end, the stream stands somewhere past the end-of-archive block: its caller reads on to its end."""
    window = _StreamWindow(stream.read)
    at = yield from _walk(window, "*" in mode)
    if at == 0:
        yield from _tarfile_members(lambda: tarfile.open(fileobj=window.resume(0), mode=mode))
    elif at is not None:
        yield from _tarfile_members(lambda: tarfile.TarFile(fileobj=window.resume(at), mode="r"))


def _tarfile_members(opener: Callable[[], tarfile.TarFile]) -> Iterator[TarMember]:
    """``tarfile``'s own walk (forgetting members as it goes: a TarFile keeps every one otherwise)."""
    with opener() as tar:
        for member in tar:  # (not tar.next(): after a header that ends the tar, next() would read it again)
            tar.members = []
            if member.isreg():
                yield TarMember(member.name, member.offset, member.offset_data, member.size)


def _walk(window: _FileWindow | _StreamWindow, may_be_compressed: bool) -> Iterator[TarMember]:
    """Yield the members of the plain headers; return None at the end-of-archive block, else the offset of the first
    header this does not read itself (``tarfile`` reads on from there)."""
    numbers: dict[bytes, int] = {}  # a number field's bytes -> tarfile.nti of them (fields repeat across members)
    valid: set[bytes] = set()  # the bytes of number fields seen to decode (mode, uid and gid together...)
    at = 0
    while True:
        if len(valid) >= _CACHE_LIMIT:
            valid.clear()
        buf, i = window.at(at)
        if len(buf) - i < BLOCK:
            if i > len(buf):  # the last member's data (or padding) runs past the end: tarfile's error there
                window.past_end(at)
                raise tarfile.ReadError("unexpected end of data")
            return at  # an empty or cut header: tarfile decides (an end, or an error at offset 0)
        if at == 0 and may_be_compressed and buf.startswith(_COMPRESSED, i):
            return 0
        # Byte sum of the header in two halves: adler32's low word is 1 + the sum mod 65521, exact under 256 bytes.
        total = (zlib.adler32(buf[i:i + 256]) & 0xFFFF) + (zlib.adler32(buf[i + 256:i + BLOCK]) & 0xFFFF) - 2
        if total == 0:
            return None  # a zero block: the end of the archive
        kind = buf[i + 156]
        if kind not in _REGULAR and kind not in _NO_DATA:
            return at
        try:
            size = numbers.get(buf[i + 124:i + 136])
            if size is None:
                size = _number(numbers, buf[i + 124:i + 136])
            chksum_field = buf[i + 148:i + 156]
            chksum = numbers.get(chksum_field)
            if chksum is None:
                chksum = _number(numbers, chksum_field)
            if chksum != total - sum(chksum_field) + 8 * 32:  # the checksum counts its own field as spaces
                if chksum not in tarfile.calc_chksums(buf[i:i + BLOCK]):  # tarfile also takes a signed-byte sum
                    return at
            # The other number fields are not kept, but tarfile refuses the header when one does not decode.
            for start, end, width in _CHECKED:
                if buf[i + start:i + end] not in valid:
                    for field in range(i + start, i + end, width):
                        tarfile.nti(buf[field:field + width])
                    valid.add(buf[i + start:i + end])
        except tarfile.InvalidHeaderError:
            return at
        if size < 0:
            return at
        end = buf.find(b"\0", i, i + 100)
        name = buf[i:end if end >= 0 else i + 100].decode(_ENCODING, "surrogateescape")
        regular = kind in _REGULAR and not (kind == 0 and name.endswith("/"))  # v7: a trailing slash is a folder
        if buf[i + 345]:  # the ustar prefix (tarfile reads it in every format)
            end = buf.find(b"\0", i + 345, i + 500)
            name = buf[i + 345:end if end >= 0 else i + 500].decode(_ENCODING, "surrogateescape") + "/" + name
        if regular:
            yield TarMember(name, at, at + BLOCK, size)
            at += BLOCK + -(-size // BLOCK) * BLOCK
        else:
            at += BLOCK  # tarfile skips no data after a link, folder or device, whatever its size field says


def _number(cache: dict[bytes, int], field: bytes) -> int:
    """``tarfile.nti`` of a header field (its InvalidHeaderError included), remembered by the field's bytes."""
    value = cache.get(field)
    if value is None:
        if len(cache) >= _CACHE_LIMIT:
            cache.clear()
        value = cache[field] = tarfile.nti(field)
    return value


class _FileWindow:
    """A seekable file read in blocks: a header outside the block held reads a new one from it (~128 members at the
    mean member span so far, 64 KiB-4 MiB; only the header where members are large); member data is skipped by
    seeking."""

    def __init__(self, handle: IO[bytes]) -> None:
        self._handle = handle
        self._size = os.fstat(handle.fileno()).st_size
        self._buf = b""
        self._start = 0
        self._headers = 0

    def at(self, offset: int) -> tuple[bytes, int]:
        """``(buffer, index)`` with the header at ``offset`` at ``buffer[index:]`` (short at the end of the file,
        index past the buffer when ``offset`` is past it)."""
        self._headers += 1
        i = offset - self._start
        if 0 <= i and i + BLOCK <= len(self._buf):
            return self._buf, i
        if offset > self._size:
            self._buf, self._start = b"", self._size
            return self._buf, offset - self._size
        span = offset // self._headers  # the mean member span so far
        # A read costs a few µs plus ~1 µs per 5 KiB copied: past _SEEK_SPAN a member, one header per read is cheaper.
        want = BLOCK if span > _SEEK_SPAN else min(_MAX_READ, max(_MIN_READ, 128 * span))
        self._handle.seek(offset)
        self._buf, self._start = self._handle.read(want), offset
        return self._buf, 0

    def past_end(self, offset: int) -> None:
        """tarfile's own check of a next header past the end (its error, where the seek fails, included)."""
        self._handle.seek(offset - 1)
        self._handle.read(1)


class _StreamWindow:
    """A forward-only stream read once in 4 MiB blocks; a block is dropped once the headers are past it."""

    def __init__(self, read: Callable[[int], bytes]) -> None:
        self._read = read
        self._buf = b""
        self._start = 0  # offset of _buf[0] in the stream

    def at(self, offset: int) -> tuple[bytes, int]:
        while offset + BLOCK > self._start + len(self._buf):
            chunk = self._read(_MAX_READ)
            if not chunk:
                break  # the end: the header is short (or ``offset`` lies past the end)
            end = self._start + len(self._buf)
            if offset < end:  # the header began in the block held: keep it from there on
                self._buf, self._start = self._buf[offset - self._start:] + chunk, offset
            else:  # the block held is all before the header: dropped (the new one is kept whole, not copied)
                self._buf, self._start = chunk, end
        return self._buf, offset - self._start

    def past_end(self, offset: int) -> None:
        """Nothing to do: tarfile's stream reads on to the end (where a damaged size asks past 2**63 bytes, for
        ever), then says "unexpected end of data"."""

    def resume(self, offset: int) -> _Resumed:
        """The stream from ``offset`` (held in the block) on, for ``tarfile`` to read on."""
        return _Resumed(self._buf[offset - self._start:], offset, self._read)


class _Resumed:
    """A file-like object from a held block and the rest of a stream, its positions the stream's own: ``tarfile``
    reads it (``read`` full unless at the end, ``tell``, ``seek`` forward)."""

    def __init__(self, head: bytes, position: int, read: Callable[[int], bytes]) -> None:
        self._head = head
        self._position = position
        self._read = read

    def read(self, size: int = -1) -> bytes:
        pieces = []
        want = size if size >= 0 else 1 << 62
        if self._head:
            pieces.append(self._head[:want])
            self._head = self._head[want:]
            want -= len(pieces[0])
        while want > 0 and (chunk := self._read(min(want, _MAX_READ))):
            pieces.append(chunk)
            want -= len(chunk)
        data = b"".join(pieces)
        self._position += len(data)
        return data

    def tell(self) -> int:
        return self._position

    def seek(self, offset: int, whence: int = 0) -> int:
        if whence != 0 or offset < self._position:
            raise tarfile.StreamError("seeking backwards is not allowed")  # as tarfile's own stream says
        while self._position < offset and self.read(min(offset - self._position, _MAX_READ)):
            pass
        return self._position
