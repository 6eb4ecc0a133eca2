"""Read inputs of every format into documents, on the executors.

The driver only lists files and plans *read units* (a whole file, or a byte range of a large plain
text / JSONL file); each Spark task opens its units through pyarrow (local or s3://) and yields
documents. Byte ranges follow Hadoop's rule: a range owns the records that *start* inside it and
reads the last one to its end, so every record is read exactly once whatever the chunk size.
"""

from __future__ import annotations

import csv
import io
import json
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from functools import partial

import pyarrow as pa
import pyarrow.parquet as pq

from ..config import DataConfig, StorageConfig
from ..infra.errors import SparklmError
from ..infra.fs import expand, resolve, storage_hint, uri_like
from . import clean, instruct, labelled

_COMPRESSIONS = {".gz": "gzip", ".bz2": "bz2", ".zst": "zstd", ".lz4": "lz4"}
_FORMATS = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "jsonl", ".csv": "csv", ".tsv": "tsv",
            ".parquet": "parquet", ".pq": "parquet"}

# Document statuses: "ok" or the reason a document (or a whole file) was dropped.
OK, EMPTY, TOO_SHORT, MALFORMED, BINARY, DUPLICATE = "ok", "empty", "too_short", "malformed", "binary_file", "duplicate"
DATAFRAME = "dataframe"  # the format of a read unit that is a DataFrame partition's rows



@dataclass(frozen=True)
class ReadUnit:
    uri: str
    fmt: str  # text | jsonl | csv | tsv | parquet | dataframe
    compression: str  # "" or a pyarrow codec name
    start: int = 0
    end: int = -1  # -1: to the end of the file
    group: str = "auto"  # auto (split by hash) | train | validation (explicit inputs)
    size: int = 0  # bytes of the file (of the range, when end >= 0)

    @property
    def nbytes(self) -> int:
        return self.end - self.start if self.end >= 0 else self.size


def detect_format(name: str) -> tuple[str, str]:
    """(format, compression) from a file name; unknown extensions are read as plain text."""
    lower = name.lower()
    compression = ""
    for ext, codec in _COMPRESSIONS.items():
        if lower.endswith(ext):
            compression, lower = codec, lower[: -len(ext)]
            break
    for ext, fmt in _FORMATS.items():
        if lower.endswith(ext):
            return fmt, compression
    return "text", compression


def plan_units(inputs: list[str], *, group: str, data: DataConfig, storage: StorageConfig) -> list[ReadUnit]:
    """List the files behind ``inputs`` and cut large splittable ones into byte ranges (driver side)."""
    units = []
    chunk = data.split_mb * 1024 * 1024
    for uri in inputs:
        for file_uri, info in _files(uri, storage):
            fmt, compression = detect_format(info.path)
            if reads_records(data) and fmt == "text":
                labels = labelled.labels_of(data) is not None
                what = f"--task {data.task} reads labelled records" if labels else \
                    f"--format {data.format} reads records"
                raise SparklmError(f"{file_uri} is plain text, and {what}",
                                   hint="pass .jsonl, .csv or .parquet files of records" +
                                        ("" if labels else ", or use --format text"))
            splittable = not compression and (fmt == "jsonl" or (fmt == "text" and data.doc_mode != "file"))
            if splittable and info.size > chunk:
                units += [ReadUnit(file_uri, fmt, "", s, min(s + chunk, info.size), group, info.size)
                          for s in range(0, info.size, chunk)]
            else:
                units.append(ReadUnit(file_uri, fmt, compression, 0, -1, group, info.size))
    return units


def _files(uri: str, storage: StorageConfig) -> list[tuple[str, pa.fs.FileInfo]]:
    """(file URI, its info) for each file behind one input: a file, a directory's files, a glob's matches, or the
    Parquet files of a Delta table's current version."""
    from . import delta_lake as delta

    if delta.is_table(uri, storage):
        from ..infra import progress

        version, uris = delta.current_files(uri, storage)
        progress.info(f"{uri}: Delta table, version {version} ({len(uris)} files)")
        out = []
        for file_uri in uris:
            fs, path = resolve(file_uri, storage)
            out.append((file_uri, fs.get_file_info(path)))
        if not out:
            raise SparklmError(f"the Delta table {uri} holds no files in its current version {version}")
        return out
    infos = expand(uri, storage)
    if not infos:
        raise SparklmError(f"no files match {uri}", hint="check the path or glob")
    return [(uri_like(uri, info.path), info) for info in infos]


# -- executor side ---------------------------------------------------------------------------


def documents(units: list[ReadUnit], data: DataConfig, storage: StorageConfig) -> Iterator[tuple]:
    """Read and clean units in order: ``(unit, pos, status, document or None, invalid bytes, digest or None)``.

    A document is a ``str`` (``data.format`` text) or an :class:`~sparklm.data.instruct.Record`
    (instruction and chat records: every content cleaned; one without assistant content is empty).
    """
    for unit in units:
        yield from _cleaned(((unit, *raw) for raw in _read_unit(unit, data, storage)), data)


def frame_documents(rows: Iterator[tuple[str, dict]], partition: int, data: DataConfig) -> Iterator[tuple]:
    """:func:`documents` for one partition of a DataFrame's rows ``(group, {column: value})``, in order: each row is a
    document (or a record), read as a Parquet file's row is; the unit is the partition's rows of one group."""
    units = {g: ReadUnit(f"dataframe:{g}:part-{partition:05d}", DATAFRAME, "", group=g) for g in ("auto", "train", "validation")}
    counters = {g: 0 for g in units}

    def raw() -> Iterator[tuple[ReadUnit, int, str, object, int]]:
        for group, values in rows:
            unit, pos = units[group], counters[group]
            counters[group] += 1
            if reads_records(data):
                yield unit, pos, OK, _record(values, data, partial(_where, None, "", unit, pos, by_line=True)), 0
            else:
                yield (unit, pos, *_value(values[data.text_field], data))

    yield from _cleaned(raw(), data)


def _value(value, data: DataConfig) -> tuple[str, str | None, int]:
    """(status, text, invalid bytes) of one text cell of a Parquet file or a DataFrame."""
    if value is None:
        return EMPTY, None, 0
    if isinstance(value, bytes):
        text, invalid = clean.decode(value, data.encoding)
        return OK, text, invalid
    if isinstance(value, str):
        return OK, value, 0
    return MALFORMED, None, 0


def _cleaned(raw: Iterable[tuple], data: DataConfig) -> Iterator[tuple]:
    """Clean raw ``(unit, pos, status, text or record, invalid bytes)`` into :func:`documents`' tuples."""
    for unit, pos, status, doc, invalid in raw:
        if status == OK:
            if isinstance(doc, (instruct.Record, labelled.Record)):
                doc = doc.map(lambda text: clean.clean_text(text, data.normalize))
                status = EMPTY if not doc.trains else TOO_SHORT if len(text_of(doc)) < data.min_chars else OK
                if status == OK and isinstance(doc, labelled.Record) and doc.label is None:
                    status = labelled.NO_LABEL
            else:
                doc = clean.clean_text(doc, data.normalize)
                status = EMPTY if not doc else TOO_SHORT if len(doc) < data.min_chars else OK
        ok = status == OK
        digest = clean.digest(doc if isinstance(doc, str) else doc.key()) if ok else None
        yield unit, pos, status, doc if ok else None, invalid, digest


def text_of(doc: str | instruct.Record | labelled.Record) -> str:
    """A document's text: itself, or a record's contents (for byte counts and the tokenizer sample)."""
    if isinstance(doc, labelled.Record):
        return doc.content
    return doc if isinstance(doc, str) else doc.text


def where(unit: ReadUnit, pos: int, storage: StorageConfig) -> str:
    """Where the record read at ``pos`` of ``unit`` is, for a message: ``FILE line N`` or ``FILE row N``."""
    if unit.fmt != "jsonl":
        return _where(None, "", unit, pos, by_line=True)
    fs, path = resolve(unit.uri, storage)
    with fs.open_input_stream(path, compression=unit.compression or None) as s:
        encoding = clean.sniff_encoding(s.read(clean.BINARY_SNIFF_BYTES), "utf-8")
    return _where(fs, path, unit, pos, by_line=bool(unit.compression) or encoding in ("utf-16", "utf-32"))


def _where(fs, path: str, unit: ReadUnit, pos: int, *, by_line: bool) -> str:
    """``pos`` is a line number (from 0) when ``by_line`` (compressed or UTF-16/32 JSONL), a CSV row number
    (from 1) or a Parquet row index (from 0); else a byte offset, turned into a line number by counting."""
    if unit.fmt in ("csv", "tsv"):
        return f"{unit.uri} row {pos}"
    if unit.fmt in ("parquet", DATAFRAME):
        return f"{unit.uri} row {pos + 1}"
    if by_line:
        return f"{unit.uri} line {pos + 1}"
    with fs.open_input_file(path) as f:  # only on the way to an error: read the file up to the record
        newlines, left = 0, pos
        while left > 0 and (block := f.read(min(left, 1 << 20))):
            newlines += block.count(b"\n")
            left -= len(block)
    return f"{unit.uri} line {newlines + 1}"


def _record(values: dict, data: DataConfig, where) -> instruct.Record | labelled.Record:
    """An instruction, chat or labelled record from a row's values; ``where()`` names the row for an error."""
    labels = labelled.labels_of(data)
    if labels is not None:  # a missing text or label is dropped and counted, not an error
        return labelled.record(values, data.text_field, data.pair_field, data.label_field, labels == "value")
    try:
        if data.format == "chat":
            return instruct.chat_record(values, data.messages_field)
        return instruct.instruction_record(values, data.prompt_field, data.response_field)
    except instruct.RecordError as e:
        raise SparklmError(f"{where()} {e}", hint=_fields_hint(data)) from None


def _fields_hint(data: DataConfig) -> str:
    if labelled.labels_of(data) is not None:
        return "name the columns with --text-field, --label-field (and --pair-field)"
    if data.format == "chat":
        return ("name the messages field with --messages-field (--format instruction reads prompt/response records), "
                "or fix the record")
    return ("name the fields with --prompt-field and --response-field (--format chat reads records of messages), "
            "or fix the record")


def reads_records(data: DataConfig) -> bool:
    """Whether a row is read as a record of several fields (instruction, chat, labelled) rather than one text."""
    return data.format != "text" or labelled.labels_of(data) is not None


def record_fields(data: DataConfig) -> list[str]:
    """The columns a record format needs: the text, the prompt and response, the messages, or a labelled
    record's text (pair) and label."""
    if labelled.labels_of(data) is not None:
        return labelled.fields(data)
    return {"text": [data.text_field], "instruction": [data.prompt_field, data.response_field],
            "chat": [data.messages_field]}[data.format]


def _read_unit(unit: ReadUnit, data: DataConfig, storage: StorageConfig) -> Iterator[tuple[int, str, str | None, int]]:
    """Yield (position, status, raw text, invalid bytes) for each record of one unit."""
    fs, path = resolve(unit.uri, storage)
    try:
        if unit.fmt == "parquet":
            yield from _read_parquet(fs, path, unit, data)
            return
        with fs.open_input_stream(path, compression=unit.compression or None) as s:
            head = s.read(clean.BINARY_SNIFF_BYTES)
        encoding = clean.sniff_encoding(head, data.encoding)
        if clean.looks_binary(head, encoding):
            if unit.start == 0:
                yield 0, BINARY, None, 0
            return
        if unit.fmt in ("csv", "tsv"):
            yield from _read_csv(fs, path, unit, data, encoding)
            return
        tally = _Tally()
        lines = tally.feed(_lines(fs, path, unit, encoding, data.doc_mode))
        stop = unit.end if unit.end >= 0 else None
        if unit.fmt == "jsonl" and reads_records(data):
            by_line = bool(unit.compression) or encoding in ("utf-16", "utf-32")
            for pos, line in clean.group_documents(lines, "line", stop=stop):
                status, values = _json_object(line)
                record = None
                if status == OK:
                    record = _record(values, data, partial(_where, fs, path, unit, pos, by_line=by_line))
                yield pos, status, record, tally.take()
        elif unit.fmt == "jsonl":
            for pos, line in clean.group_documents(lines, "line", stop=stop):
                yield (pos, *_json_text(line, data.text_field), tally.take())
        else:
            for pos, text in clean.group_documents(lines, data.doc_mode, stop=stop):
                yield pos, OK, text, tally.take()
    except SparklmError:
        raise
    except (OSError, EOFError, ValueError, UnicodeError, csv.Error, pa.ArrowException) as e:
        raise SparklmError(f"cannot read {unit.uri}: {' '.join(str(e).split())[:300]}",
                           hint=f"fix or remove the file; {storage_hint(unit.uri)}") from None


class _Tally:
    """Counts invalid bytes of the lines that pass through, attributed to the next document taken."""

    def __init__(self) -> None:
        self.n = 0

    def feed(self, lines: Iterator[tuple[int, str, int]]) -> Iterator[tuple[int, str]]:
        for offset, line, invalid in lines:
            self.n += invalid
            yield offset, line

    def take(self) -> int:
        n, self.n = self.n, 0
        return n


def _lines(fs, path: str, unit: ReadUnit, encoding: str, mode: str) -> Iterator[tuple[int, str, int]]:
    """(offset, line with its ending, invalid bytes) of the lines a unit owns.

    Byte-oriented, uncompressed files are read by byte offset (so ranges work); compressed and
    UTF-16/32 files are decoded as one stream and positions are line numbers.
    """
    if unit.compression or encoding in ("utf-16", "utf-32"):
        with fs.open_input_stream(path, compression=unit.compression or None) as raw:
            text = io.TextIOWrapper(io.BufferedReader(raw, 1 << 20), encoding=encoding,
                                    errors="sparklm-count", newline="")
            before = clean.invalid_total()
            for number, line in enumerate(text):
                now = clean.invalid_total()
                yield number, line, now - before
                before = now
        return
    encoding = "utf-8" if encoding == "utf-8-sig" else encoding  # clean_text strips the BOM
    with fs.open_input_file(path) as raw:
        f = io.BufferedReader(raw, 1 << 20)
        pos = unit.start
        if pos > 0:
            f.seek(pos - 1)
            if f.read(1) != b"\n":  # mid-line: that line belongs to the previous range
                pos += len(f.readline())
            if mode == "paragraph" and not _previous_line_blank(f, pos):
                # A paragraph that started in the previous range runs on here: it is not ours.
                f.seek(pos)
                while (line := f.readline()) and not clean.is_blank(line):
                    pos += len(line)
            f.seek(pos)
        while line := f.readline():
            text, invalid = clean.decode(line, encoding)
            yield pos, text, invalid
            pos += len(line)


def _previous_line_blank(f: io.BufferedReader, pos: int) -> bool:
    """Whether the line ending just before ``pos`` (a line start) holds only white space."""
    end = pos - 1  # the newline that ends the previous line
    while end > 0:
        start = max(0, end - 65536)
        f.seek(start)
        block = f.read(end - start)
        for byte in reversed(block):
            if byte == 0x0A:
                return True
            if byte not in b" \t\r\f\v":
                return False
        end = start
    return True


def _json_object(line: str) -> tuple[str, dict | None]:
    try:
        record = json.loads(line)
    except json.JSONDecodeError:
        return MALFORMED, None
    return (OK, record) if isinstance(record, dict) else (MALFORMED, None)


def _json_text(line: str, field: str) -> tuple[str, str | None]:
    try:
        record = json.loads(line)
    except json.JSONDecodeError:
        return MALFORMED, None
    value = record.get(field) if isinstance(record, dict) else None
    if isinstance(value, str):
        return OK, value
    if isinstance(record, dict) and field in record and value is None:
        return EMPTY, None
    return MALFORMED, None


def _read_csv(fs, path: str, unit: ReadUnit, data: DataConfig, encoding: str) -> Iterator[tuple[int, str, str | None, int]]:
    csv.field_size_limit(sys.maxsize)
    with fs.open_input_stream(path, compression=unit.compression or None) as raw:
        text = io.TextIOWrapper(io.BufferedReader(raw, 1 << 20), encoding=encoding,
                                errors="sparklm-count", newline="")
        reader = csv.reader(text, delimiter="\t" if unit.fmt == "tsv" else ",")
        header = next(reader, None)
        if header is None:
            return
        header = [h.lstrip("\ufeff").strip() for h in header]
        _check_columns(unit.uri, header, data)
        col = max(map(header.index, record_fields(data)))
        before = clean.invalid_total()
        for number, row in enumerate(reader, start=1):
            now = clean.invalid_total()
            if col >= len(row):
                yield number, MALFORMED, None, now - before
            elif not reads_records(data):
                yield number, OK, row[header.index(data.text_field)], now - before
            else:
                where = partial(_where, None, path, unit, number, by_line=True)
                yield number, OK, _record(dict(zip(header, row)), data, where), now - before
            before = now


def _check_columns(uri: str, names: list[str], data: DataConfig) -> None:
    """A CSV or Parquet file must have the columns its format reads (one line naming the file and what it has)."""
    for name in record_fields(data):
        if name not in names:
            hint = _fields_hint(data) if reads_records(data) else "name the text column with --text-field or data.text_field"
            raise SparklmError(f"{uri} has no column '{name}' (columns: {', '.join(names[:20])})", hint=hint)


def _read_parquet(fs, path: str, unit: ReadUnit, data: DataConfig) -> Iterator[tuple[int, str, object, int]]:
    with fs.open_input_file(path) as raw:
        pf = pq.ParquetFile(raw)
        names = pf.schema_arrow.names
        _check_columns(path, names, data)
        if reads_records(data):
            yield from _parquet_records(pf, unit, data)
            return
        number = 0
        for batch in pf.iter_batches(columns=[data.text_field], batch_size=4096):
            for value in batch.column(0).to_pylist():
                yield (number, *_value(value, data))
                number += 1


def _parquet_records(pf: pq.ParquetFile, unit: ReadUnit, data: DataConfig) -> Iterator[tuple[int, str, object, int]]:
    number = 0
    for batch in pf.iter_batches(columns=record_fields(data), batch_size=1024):
        for values in batch.to_pylist():
            yield number, OK, _record(values, data, partial(_where, None, "", unit, number, by_line=True)), 0
            number += 1
