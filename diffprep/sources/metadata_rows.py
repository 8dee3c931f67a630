"""A metadata file's records as a stream, each with the byte offset it starts at (``sources/metadata.py``).

Why a module of its own: a file of millions of rows must be listed once, in
one streamed pass that holds no row, and a work unit must then read its own
rows straight from their offsets instead of parsing the whole file again.
JSONL and CSV are read line by line from the bytes (a record's offset is that
of its first line; a CSV record may span lines inside quotes); lines end in
``\\n`` or ``\\r\\n``. A JSON list cannot be streamed: it is parsed whole and
its records have no offset.

Every error names the file and the line, as a ``SourceError``; the offsets
are only ever trusted after the record found there is checked against the id
planned for it (``MetadataSource.read``).
"""

from __future__ import annotations

import csv
import json
import zlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any, BinaryIO, NamedTuple

from diffprep.errors import SourceError

_UTF8_BOM = b"\xef\xbb\xbf"


class Record(NamedTuple):  # a tuple: made once per row of a listing
    offset: int | None  # the byte offset of the record's first line (JSONL, CSV); None in a JSON list
    number: int  # 1-based position among the records
    line: int | None  # the line the record starts on (JSONL) or ends on (CSV); None in a JSON list
    values: dict
    crc: int | None = None  # CRC-32 of the record's bytes (its lines without their ends): a changed row is not it

    def position(self) -> list[int] | None:
        """Where the record is, as a unit's plan keeps it: ``[offset, number, line, crc]`` (a JSON list: None)."""
        return None if self.offset is None else [self.offset, self.number, self.line, self.crc]


Opener = Callable[[], BinaryIO]  # a fresh binary stream of the whole file, at its start


def _decode_line(data: bytes, where: str, line: int, offset: int) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SourceError(f"{where}: line {line}: invalid UTF-8 at byte offset {offset + exc.start} ({exc.reason}); "
                          f"a metadata file must be UTF-8") from None


def _lines(stream: BinaryIO, where: str, start: int, first_line: int) -> Iterator[tuple[int, int, str, bytes]]:
    """``(offset, line number, text, bytes)`` of each line from ``start`` (a BOM at the file's start skipped)."""
    offset, number = start, first_line
    for data in stream:  # lines end at b"\n" only
        if offset == 0 and data.startswith(_UTF8_BOM):
            data, offset = data[len(_UTF8_BOM):], len(_UTF8_BOM)
        yield offset, number, _decode_line(data, where, number, offset), data
        offset += len(data)
        number += 1


# --- JSONL ------------------------------------------------------------------------------------------------------------


def _jsonl_record(text: str, where: str, number: int) -> dict:
    try:
        record = json.loads(text)
    except json.JSONDecodeError as exc:
        raise SourceError(f"{where}: line {number} column {exc.colno}: not valid JSON ({exc.msg})") from None
    if not isinstance(record, dict):
        raise SourceError(f"{where}: line {number} is a {type(record).__name__}, not an object with columns")
    return record


def jsonl_records(open_file: Opener, where: str) -> Iterator[Record]:
    # Lines split on newlines only, never at U+2028 and the others that JSON strings may hold; blank lines skipped.
    count = 0
    with open_file() as stream:
        for offset, line, text, data in _lines(stream, where, 0, 1):
            if text.strip():
                count += 1
                yield Record(offset, count, line, _jsonl_record(text, where, line), _crc(data))


# --- CSV --------------------------------------------------------------------------------------------------------------


def _crc(data: bytes, crc: int = 0) -> int:
    return zlib.crc32(data.rstrip(b"\r\n"), crc)


class _CsvLines:
    """Lines fed to ``csv.reader``, remembering the offset of the next line it has not taken yet and the CRC of
    the lines taken since ``crc`` was last set to 0."""

    def __init__(self, stream: BinaryIO, where: str, start: int, first_line: int) -> None:
        self._lines = _lines(stream, where, start, first_line)
        self.next_offset = start
        self.crc = 0

    def __iter__(self) -> Iterator[str]:
        for offset, _, text, data in self._lines:
            self.next_offset = offset + len(data)
            self.crc = _crc(data, self.crc)
            yield text


def _csv_next(reader: Any, where: str) -> list[str] | None:
    try:
        return next(reader)
    except StopIteration:
        return None
    except csv.Error as exc:
        raise SourceError(f"{where}: line {reader.line_num}: not valid CSV ({exc})") from None


def _csv_values(cells: list[str], header: list[str], where: str, line: int) -> dict:
    """A record's cells by column (``csv.DictReader``'s rule: a short record lacks its last columns)."""
    if len(cells) > len(header):
        raise SourceError(f"{where}: line {line} has {len(cells)} cells, the header {len(header)} ({header})")
    return dict(zip(header, cells))


def csv_header(open_file: Opener, where: str) -> list[str]:
    """The column names of the CSV file's first line; an empty file is a ``SourceError``."""
    with open_file() as stream:
        lines = _CsvLines(stream, where, 0, 1)
        header = _csv_next(csv.reader(lines), where)
    if not header:
        raise SourceError(f"{where}: the CSV file is empty; its first line must name the columns "
                          f"(e.g. video,caption)")
    return header


def csv_records(open_file: Opener, where: str) -> Iterator[Record]:
    with open_file() as stream:
        lines = _CsvLines(stream, where, 0, 1)
        reader = csv.reader(lines)
        header = _csv_next(reader, where)
        if not header:
            return
        count = 0
        while True:
            start, lines.crc = lines.next_offset, 0
            cells = _csv_next(reader, where)
            if cells is None:
                return
            if cells == []:  # a blank line, as csv.DictReader skips it
                continue
            count += 1
            yield Record(start, count, reader.line_num, _csv_values(cells, header, where, reader.line_num), lines.crc)


# --- JSON list --------------------------------------------------------------------------------------------------------


def json_records(open_file: Opener, where: str) -> Iterator[Record]:
    with open_file() as stream:
        data = stream.read()
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = data[:exc.start].count(b"\n") + 1
        raise SourceError(f"{where}: line {line}: invalid UTF-8 at byte offset {exc.start} ({exc.reason}); "
                          f"a metadata file must be UTF-8") from None
    del data
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise SourceError(f"{where}: line {exc.lineno} column {exc.colno}: not valid JSON ({exc.msg})") from None
    if not isinstance(value, list):
        raise SourceError(f"{where}: expected a JSON list of objects (one per sample), got a {type(value).__name__}; "
                          f"a file of one object per line must end in .jsonl")
    for index, record in enumerate(value):
        if not isinstance(record, dict):
            raise SourceError(f"{where}: element {index + 1} of the list is a {type(record).__name__}, not an "
                              f"object with columns")
        yield Record(None, index + 1, None, record)


def records(fmt: str, open_file: Opener, where: str) -> Iterator[Record]:
    """Every record of the file in order, streamed (a JSON list: parsed whole first)."""
    if fmt == ".csv":
        return csv_records(open_file, where)
    if fmt == ".jsonl":
        return jsonl_records(open_file, where)
    return json_records(open_file, where)


def scan_columns(fmt: str, open_file: Opener, where: str) -> tuple[list[str], bool]:
    """``(columns, whether there is any record)``, every record checked: a CSV file's header, else every key any
    record has (in first-seen order). One streamed pass holding no record."""
    if fmt == ".csv":
        header = csv_header(open_file, where)
        return header, sum(1 for _ in csv_records(open_file, where)) > 0  # every record checked
    columns: dict[str, None] = {}
    found = False
    for record in records(fmt, open_file, where):
        found = True
        columns.update(dict.fromkeys(record.values))
    return list(columns), found


# Columns of the metadata files checked in this process, by (path, format, size, mtime): opening the same file
# again (the plan phase opens it more than once) does not read it again.
_LAYOUTS: dict[tuple, tuple[list[str], bool]] = {}
_LAYOUTS_KEPT = 8


def file_columns(identity: tuple | None, fmt: str, open_file: Opener, where: str) -> tuple[list[str], bool, bool]:
    """``scan_columns`` once per file ``identity`` in this process: ``(columns, any record, whether it read it)``."""
    if identity is not None and identity in _LAYOUTS:
        columns, has_records = _LAYOUTS[identity]
        return list(columns), has_records, False
    columns, has_records = scan_columns(fmt, open_file, where)
    if identity is not None:
        while len(_LAYOUTS) >= _LAYOUTS_KEPT:
            _LAYOUTS.pop(next(iter(_LAYOUTS)))
        _LAYOUTS[identity] = (list(columns), has_records)
    return columns, has_records, True


def planned_columns(planned: Mapping[str, Any] | None, metadata_file: str, fmt: str) -> tuple[list[str], bool] | None:
    """The columns a plan recorded for this file (its ``describe()["columns"]``); None when it describes another
    file, recorded none (a plan written before), or the file is a JSON list (parsed whole on opening anyway)."""
    if not planned or planned.get("metadata_file") != metadata_file or fmt == ".json":
        return None
    columns = planned.get("columns")
    if not isinstance(columns, list) or not all(isinstance(name, str) for name in columns):
        return None
    return list(columns), bool(columns)


def record_at(fmt: str, stream: BinaryIO, where: str, at: Any, header: list[str]) -> Record | None:
    """The record listed at ``at`` (``Record.position``), or None where it is not there any more, byte for byte
    (the file changed: the caller looks the id up the slow way, as without positions)."""
    try:
        offset, number, line, crc = (int(value) for value in at)
    except (TypeError, ValueError):
        return None
    if fmt not in (".csv", ".jsonl") or offset < 0:
        return None
    stream.seek(offset)
    try:
        if fmt == ".jsonl":
            data = stream.readline()
            if offset == 0 and data.startswith(_UTF8_BOM):
                data = data[len(_UTF8_BOM):]
            if _crc(data) != crc:
                return None
            text = _decode_line(data, where, line, offset)
            return Record(offset, number, line, _jsonl_record(text, where, line), crc)
        lines = _CsvLines(stream, where, offset, line)
        cells = _csv_next(csv.reader(lines), where)
        if not cells or lines.crc != crc:
            return None
        return Record(offset, number, line, _csv_values(cells, header, where, line), crc)
    except SourceError:
        return None
