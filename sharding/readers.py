"""Readers of local input files (JSON lines, a JSON array, CSV, parquet, plain text; optionally .gz), streamed.

Each yields (raw text value, raw label value) per record and turns what a user may hand in by mistake (a
binary file, a broken gzip, another encoding, a missing column) into a one-line DipacoError; sources.py
finds the files and picks the reader by extension.
"""

from __future__ import annotations

import codecs
import csv
import gzip
import json
import sys
import zlib
from pathlib import Path
from typing import Iterator

from dipaco.errors import DipacoError


# Signatures of binary formats someone may hand us by mistake (checked on a file's first bytes).
_MAGIC = {b"\x1f\x8b": "gzip-compressed data", b"PK\x03\x04": "a zip archive", b"%PDF": "a PDF document",
          b"\x89PNG": "a PNG image", b"\xff\xd8\xff": "a JPEG image", b"GIF8": "a GIF image",
          b"BZh": "bzip2-compressed data", b"\xfd7zXZ\x00": "xz-compressed data", b"\x28\xb5\x2f\xfd": "zstd-compressed data",
          b"PAR1": "a parquet file", b"\xff\xfe": "UTF-16 text", b"\xfe\xff": "UTF-16 text"}
SNIFF_BYTES = 8192
MOSTLY_INVALID_MIN = 3  # a file with at least this many records and more than half of them not UTF-8 is refused


def sniff_binary(head: bytes) -> str | None:
    """What a file's first bytes say it is, if it is not text: a format name, 'NUL bytes', or None."""
    for magic, name in _MAGIC.items():
        if head.startswith(magic):
            return name
    return "NUL bytes" if b"\x00" in head else None


def _binary_error(path: Path, what: str, where: str = "") -> DipacoError:
    if what == "gzip-compressed data" and path.suffix.lower() != ".gz":
        return DipacoError(f"input {path} looks binary ({what}); name it {path.name}.gz to have it decompressed, "
                           f"or give a UTF-8 text/JSON-lines file")
    return DipacoError(f"input {path} looks binary ({what}{where}), not text; give a UTF-8 text/JSON-lines file")


class _Lines:
    """The lines of a (possibly gzipped) file as text, decoded as UTF-8 one line at a time.

    A file that starts like a binary format or holds a NUL byte is an error. A line that is not valid UTF-8 is
    decoded with U+FFFD replacement characters and counted in ``invalid`` (its 1-based number in
    ``last_invalid``); the caller decides what that means for its records.
    """

    def __init__(self, path: Path, start: int = 0, end: int | None = None):
        self.path, self.number, self.invalid, self.last_invalid = path, 0, 0, 0
        self.gz = path.suffix.lower() == ".gz"
        self.start, self.end = start, end  # a byte range of lines (plain files only: sharding.plan cuts it at newlines)

    def _open(self):
        raw = open_binary(self.path)
        return gzip.GzipFile(fileobj=raw, mode="rb") if self.gz else raw

    def read_all(self) -> bytes:
        try:
            with self._open() as fh:
                return fh.read()
        except (OSError, EOFError, zlib.error) as exc:
            raise _read_error(self.path, exc) from None

    def __iter__(self) -> Iterator[str]:
        try:
            with self._open() as fh:
                first, pos = True, self.start
                if self.start:
                    fh.seek(self.start)
                for raw in fh:
                    if self.end is not None and pos >= self.end:
                        return
                    pos += len(raw)
                    self.number += 1
                    if first:
                        raw = raw.removeprefix(codecs.BOM_UTF8)
                        what = sniff_binary(raw[:SNIFF_BYTES])
                        if what:
                            raise _binary_error(self.path, what)
                        first = False
                    if b"\x00" in raw:
                        raise _binary_error(self.path, "NUL bytes", f" on line {self.number}")
                    try:
                        yield raw.decode("utf-8")
                    except UnicodeDecodeError:
                        self.invalid += 1
                        self.last_invalid = self.number
                        yield raw.decode("utf-8", errors="replace")
        except (OSError, EOFError, zlib.error) as exc:
            raise _read_error(self.path, exc) from None


class RemoteFile:
    """An fsspec URL (s3://, gs://, ...) standing where readers take a local Path: its name, suffixes and bytes."""

    def __init__(self, url: str):
        self.url = url
        self.name = url.rstrip("/").rsplit("/", 1)[-1]
        self.suffixes = ["." + s for s in self.name.split(".")[1:]]
        self.suffix = self.suffixes[-1] if self.suffixes else ""

    def __str__(self) -> str:
        return self.url

    def __fspath__(self) -> str:  # pyarrow and others accept any os.PathLike; they get the URL
        return self.url


def open_binary(path):
    """A local file or an fsspec URL, opened for binary reading."""
    if isinstance(path, RemoteFile):
        import fsspec

        return fsspec.open(path.url, "rb").open()
    return open(path, "rb")


def _read_error(path: Path, exc: BaseException) -> DipacoError:
    if path.suffix.lower() == ".gz" and isinstance(exc, (gzip.BadGzipFile, EOFError, zlib.error)):
        return DipacoError(f"cannot decompress {path} ({exc}); it is not a complete gzip file: fix it or drop the .gz suffix")
    reason = getattr(exc, "strerror", None) or str(exc)
    return DipacoError(f"cannot read {path} ({reason}); check the file and its permissions")


class _Utf8Check:
    """Counts a file's records that held invalid UTF-8, and refuses a file where that is most of them."""

    def __init__(self, path: Path, stats: dict | None):
        self.path, self.stats, self.records, self.invalid = path, stats, 0, 0

    def record(self, invalid: bool) -> None:
        self.records += 1
        if invalid:
            self.invalid += 1
            if self.stats is not None:
                self.stats["invalid_utf8"] = self.stats.get("invalid_utf8", 0) + 1
        if self.records >= 1000 and self.records % 1000 == 0:  # fail early on a large file in another encoding
            self.finish()

    def finish(self) -> None:
        if self.invalid >= MOSTLY_INVALID_MIN and 2 * self.invalid > self.records:
            raise DipacoError(f"input {self.path}: {self.invalid} of {self.records} records are not valid UTF-8; "
                              f"the file is in another encoding: convert it to UTF-8 (e.g. iconv -f latin1 -t utf-8)")


def missing_column(where, column: str, columns) -> DipacoError:
    # repr keeps the message on one line whatever the header holds (a newline in a CSV column name)
    names = ", ".join(repr(str(c)) for c in columns)
    return DipacoError(f"{where} has no column {column!r} (columns: {names}); "
                       f"pass --text-column with the right name")


def _rows_json_array(path: Path, column: str, label_column: str, lines: _Lines, check: _Utf8Check):
    raw = lines.read_all()
    try:
        text = raw.decode("utf-8")
        repaired = False
    except UnicodeDecodeError:
        text, repaired = raw.decode("utf-8", errors="replace"), True
    try:
        rows = json.loads(text.removeprefix("\ufeff"))
    except ValueError as exc:
        raise DipacoError(f"cannot read {path} as JSON ({exc}); fix or remove the bad file") from None
    except RecursionError:
        raise DipacoError(f"cannot read {path} as JSON (nested too deeply); fix or remove the bad file") from None
    if not isinstance(rows, list):
        raise DipacoError(f"{path} holds a JSON {type(rows).__name__}, not an array of records; give JSON lines or an array")
    for row in rows:
        if isinstance(row, dict):
            value = row.get(column)
            check.record(repaired and isinstance(value, str) and "\ufffd" in value)
            yield value, row.get(label_column)
    check.finish()


def _rows_json(path: Path, column: str, label_column: str, stats: dict | None = None, start: int = 0,
               end: int | None = None) -> Iterator[tuple[object, object]]:
    """JSON lines (or a JSON array); ``start``/``end``: only the lines that begin in this byte range (line
    numbers in messages then count from the range's first line, which the message names by its byte)."""
    lines, check = _Lines(path, start, end), _Utf8Check(path, stats)
    if start:
        path = f"{path} (the range from byte {start})"
    first = True
    for line in lines:
        number = lines.number
        if not line.strip():
            continue
        if first and not start and line.lstrip().startswith("["):  # a .json file holding one array: read it whole
            yield from _rows_json_array(path, column, label_column, lines, check)
            return
        try:
            row = json.loads(line)
        except ValueError as exc:  # JSONDecodeError, or a number too long to convert
            raise DipacoError(f"cannot read {path} line {number} as JSON ({str(getattr(exc, 'msg', exc))[:200]}); "
                              f"fix or remove the bad line") from None
        except RecursionError:
            raise DipacoError(f"cannot read {path} line {number} as JSON (nested too deeply); fix or remove the bad line") from None
        if not isinstance(row, dict):
            raise DipacoError(f"{path} line {number} is not a JSON object; each line needs one {{\"{column}\": ...}} record")
        if first and column not in row:
            raise missing_column(path, column, row)
        first = False
        check.record(lines.last_invalid == number)
        yield row.get(column), row.get(label_column)
    check.finish()


def _rows_csv(path: Path, column: str, label_column: str, stats: dict | None = None) -> Iterator[tuple[object, object]]:
    csv.field_size_limit(sys.maxsize)
    lines, check = _Lines(path), _Utf8Check(path, stats)
    reader = csv.DictReader(iter(lines))
    try:
        if reader.fieldnames is None or column not in reader.fieldnames:
            raise missing_column(path, column, reader.fieldnames or [])
        seen = lines.invalid
        for row in reader:
            check.record(lines.invalid > seen)  # any line of this record was not UTF-8
            seen = lines.invalid
            yield row.get(column), row.get(label_column)
    except csv.Error as exc:
        raise DipacoError(f"cannot read {path} as CSV near line {reader.line_num} ({exc}); fix or remove the bad file") from None
    check.finish()


def _rows_parquet(path: Path, column: str, label_column: str, stats: dict | None = None,
                  row_groups: list[int] | None = None, batch: int = 1024) -> Iterator[tuple[object, object]]:
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(open_binary(path) if isinstance(path, RemoteFile) else path)
    except Exception as exc:  # pyarrow raises several types for a damaged file
        raise DipacoError(f"cannot read {path} as parquet ({str(exc).splitlines()[0][:200]}); fix or remove the bad file") from None
    names = pf.schema_arrow.names
    if column not in names:
        raise missing_column(path, column, names)
    columns = [column] + ([label_column] if label_column in names and label_column != column else [])
    batches = pf.iter_batches(batch_size=batch, columns=columns, row_groups=row_groups)
    while True:
        try:
            record_batch = next(batches, None)
        except Exception as exc:  # a damaged row group (pyarrow raises several types)
            raise DipacoError(f"cannot read {path} as parquet ({str(exc).splitlines()[0][:200]}); fix or remove the bad file") from None
        if record_batch is None:
            return
        texts = record_batch.column(0).to_pylist()
        labels = record_batch.column(1).to_pylist() if len(columns) > 1 else [None] * len(texts)
        yield from zip(texts, labels)


def _rows_text(path: Path, column: str, label_column: str, stats: dict | None = None) -> Iterator[tuple[object, object]]:
    """A text file is one document. A binary one becomes a document the filter drops as binary (a directory
    of text files may hold a stray binary file); invalid UTF-8 is replaced (U+FFFD) and counted."""
    raw = _Lines(path).read_all()
    if sniff_binary(raw[:SNIFF_BYTES]):
        yield "\x00", None
        return
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        text = raw.decode("utf-8", errors="replace")
        if stats is not None:
            stats["invalid_utf8"] = stats.get("invalid_utf8", 0) + 1
    yield text, None


READERS = {"json": _rows_json, "csv": _rows_csv, "parquet": _rows_parquet, "text": _rows_text}
