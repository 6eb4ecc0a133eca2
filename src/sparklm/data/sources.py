"""Read inputs of every format into documents, on the executors.

The driver only lists files and plans *read units* (a whole file, or a byte range of a large plain
text / JSONL file); each Spark task opens its units through pyarrow (local or s3://) and yields
documents. Byte ranges follow Hadoop's rule: a range owns the records that *start* inside it and
reads the last one to its end, so every record is read exactly once whatever the chunk size.
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import lzma
import re
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from functools import partial

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from ..config import DataConfig, StorageConfig
from ..infra.errors import SparklmError
from ..infra.fs import expand, resolve, storage_hint, uri_like
from . import clean, instruct, labelled

# pyarrow's codecs, and xz (Arrow has none for LZMA) through the standard library's lzma
_COMPRESSIONS = {".gz": "gzip", ".bz2": "bz2", ".zst": "zstd", ".lz4": "lz4", ".xz": "xz"}
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
                labels = labelled.labels_of(data).labelled
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
    infos = _without_datasets(uri, expand(uri, storage), storage)
    if not infos:
        raise SparklmError(f"no files match {uri}", hint="check the path or glob")
    return [(uri_like(uri, info.path), info) for info in infos]


def _without_datasets(uri: str, infos: list[pa.fs.FileInfo], storage: StorageConfig) -> list[pa.fs.FileInfo]:
    """A directory's files less those of the prepared datasets inside it (``prepare data/ -o data/prepared`` run
    twice must not read its own token ids as text)."""
    from ..infra import progress
    from .manifest import MANIFEST, load_prepared

    datasets = []
    for info in infos:
        if info.base_name == MANIFEST:
            directory = info.path.rsplit("/", 1)[0]
            try:
                load_prepared(uri_like(uri, directory), storage)
            except SparklmError:  # a JSON file of the user's that happens to share the name: input like any other
                continue
            datasets.append(directory + "/")
    left = [i for i in infos if not any(i.path.startswith(root) for root in datasets)]
    if datasets and not left:
        raise SparklmError(f"{uri} is a prepared dataset (token ids, not text)",
                           hint=f"train on it: sparklm train --data {uri}; prepare reads text files")
    for root in datasets:
        progress.warn(f"{uri}: skipped the prepared dataset {uri_like(uri, root.rstrip('/'))} inside it")
    return left


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
    """Where the record read at ``pos`` of ``unit`` is, for a message: ``FILE line N``, ``FILE row N`` or, in a JSON
    array, ``FILE record N``."""
    if unit.fmt != "jsonl":
        return _where(None, "", unit, pos, by_line=True)
    fs, path = resolve(unit.uri, storage)
    head, encoding = _sniff(fs, path, unit, "utf-8")
    if starts_array(head, encoding):
        return f"{unit.uri} record {pos + 1}"
    return _where(fs, path, unit, pos, by_line=_by_line(unit, encoding))


def malformed(uri: str, pos: int, data: DataConfig, storage: StorageConfig) -> str:
    """Where the record counted malformed at ``pos`` of ``uri`` is and why, read again on the driver for one
    message: ``FILE line 3 has no field 'text' (its fields: body)``; the file alone where that fails."""
    try:
        return _malformed(uri, pos, data, storage)
    except Exception:  # noqa: BLE001 - a message must not fail the run: the file may have changed since it was read
        return uri


def _malformed(uri: str, pos: int, data: DataConfig, storage: StorageConfig) -> str:
    if uri.startswith(f"{DATAFRAME}:"):
        return f"{uri} row {pos + 1}: column '{data.text_field}' does not hold strings"
    fmt, compression = detect_format(uri)
    unit = ReadUnit(uri, fmt, compression)
    fs, path = resolve(uri, storage)
    if fmt == "parquet":
        with fs.open_input_file(path) as raw:
            schema, kind = pq.ParquetFile(raw).schema_arrow, None
            for part in [data.text_field] if data.text_field in schema.names else data.text_field.split("."):
                schema = kind = schema.field(part).type  # a struct type's fields are found as a schema's are
        return f"{uri} row {pos + 1}: column '{data.text_field}' holds {kind}, not strings"
    head, encoding = _sniff(fs, path, unit, data.encoding)
    if fmt == "jsonl" and not starts_array(head, encoding) and not _by_line(unit, encoding):
        with fs.open_input_file(path) as f:  # pos: the line's byte offset
            f.seek(pos)
            line = io.BufferedReader(f).readline().decode(encoding, errors="replace")
    else:
        with open_stream(fs, path, compression) as raw:
            text = io.TextIOWrapper(io.BufferedReader(raw, 1 << 20), encoding=encoding, errors="replace", newline="")
            if fmt in ("csv", "tsv"):
                rows = csv.reader(text, delimiter=_delimiter(unit, data))
                header = next(rows)
                row = next(r for number, r in enumerate(rows, start=1) if number == pos)
                return f"{uri} row {pos} has {len(row)} field{'s' * (len(row) != 1)}, the header {len(header)}"
            if starts_array(head, encoding):
                return f"{uri} record {pos + 1}{_why(next(v for i, v in json_array(text) if i == pos), data)}"
            line = next(line for number, line in enumerate(text) if number == pos)
    place = _where(fs, path, unit, pos, by_line=_by_line(unit, encoding))
    try:
        return place + _why(json.loads(line), data)
    except json.JSONDecodeError as e:
        return f"{place} is not JSON ({e.msg} at column {e.colno})"


def _why(value, data: DataConfig) -> str:
    """Why a JSON value is not a record with a text field (the end of :func:`malformed`'s sentence)."""
    if not isinstance(value, dict):
        return f" is a JSON {_json_kind(value)}, not an object of fields"
    field = data.text_field
    if reads_records(data):
        return " is not a record of the fields asked for"
    found, inside = field_value(value, field)
    if not found:
        return f" has no field '{field}' (its fields: {', '.join(list(value)[:20]) or 'none'})"
    return f": field '{field}' holds a JSON {_json_kind(inside)}, not a string"


def _json_kind(value) -> str:
    kinds = ((bool, "boolean"), (int, "number"), (float, "number"), (str, "string"), (list, "array"), (dict, "object"))
    return next((name for kind, name in kinds if isinstance(value, kind)), "null")


def is_json_array(uri: str, storage: StorageConfig | None = None) -> bool:
    """Whether a JSON file holds one array of records rather than a record a line."""
    fs, path = resolve(uri, storage)
    return starts_array(*_sniff(fs, path, ReadUnit(uri, *detect_format(uri)), "utf-8"))


def _sniff(fs, path: str, unit: ReadUnit, default: str) -> tuple[bytes, str]:
    """A file's first bytes (decompressed) and its encoding: a byte-order mark's, else ``default``."""
    with open_stream(fs, path, unit.compression) as s:
        head = s.read(clean.BINARY_SNIFF_BYTES)
    return head, clean.sniff_encoding(head, default)


def _by_line(unit: ReadUnit, encoding: str) -> bool:
    """Whether a unit is read as one decoded stream (compressed, or UTF-16/32), its positions line numbers, rather
    than by byte offsets."""
    return bool(unit.compression) or clean.wide(encoding)


@contextlib.contextmanager
def open_stream(fs, path: str, compression: str):
    """A file's bytes as a stream, decompressed (``compression``: :func:`detect_format`'s)."""
    with fs.open_input_stream(path, compression=compression if compression not in ("", "xz") else None) as raw:
        if compression == "xz":
            with lzma.LZMAFile(raw) as xz:
                yield xz
        else:
            yield raw


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


def field_value(record: dict, name: str) -> tuple[bool, object]:
    """(found, value) of a record's field ``name``. A dotted name walks into nested objects, as Spark's
    ``col("meta.body")`` does, unless the record has a field of that very name; a null on the way is a null."""
    if name in record or "." not in name:
        return name in record, record.get(name)
    value = record
    for part in name.split("."):
        if value is None:
            return True, None
        if not isinstance(value, dict) or part not in value:
            return False, None
        value = value[part]
    return True, value


def _projected(values: dict, names: list[str]) -> dict:
    """A record's values with its dotted fields among ``names`` found and set under those names."""
    nested = {n: field_value(values, n) for n in names if n not in values and "." in n}
    return {**values, **{n: v for n, (found, v) in nested.items() if found}} if nested else values


def _record(values: dict, data: DataConfig, where) -> instruct.Record | labelled.Record:
    """An instruction, chat or labelled record from a row's values; ``where()`` names the row for an error."""
    values = _projected(values, record_fields(data))
    labels = labelled.labels_of(data)
    if labels.labelled:  # a missing text or label is dropped and counted, not an error
        return labelled.record(values, data.text_field, data.pair_field, data.label_field, labels)
    try:
        if data.format == "chat":
            return instruct.chat_record(values, data.messages_field)
        return instruct.instruction_record(values, data.prompt_field, data.response_field)
    except instruct.RecordError as e:
        raise SparklmError(f"{where()} {e}", hint=_fields_hint(data)) from None


def _fields_hint(data: DataConfig) -> str:
    if labelled.labels_of(data).labelled:
        return "name the columns with --text-field, --label-field (and --pair-field)"
    if data.format == "chat":
        return ("name the messages field with --messages-field (--format instruction reads prompt/response records), "
                "or fix the record")
    return ("name the fields with --prompt-field and --response-field (--format chat reads records of messages), "
            "or fix the record")


def reads_records(data: DataConfig) -> bool:
    """Whether a row is read as a record of several fields (instruction, chat, labelled) rather than one text."""
    return data.format != "text" or labelled.labels_of(data).labelled


def record_fields(data: DataConfig) -> list[str]:
    """The columns a record format needs: the text, the prompt and response, the messages, or a labelled
    record's text (pair) and label."""
    if labelled.labels_of(data).labelled:
        return labelled.fields(data)
    return {"text": [data.text_field], "instruction": [*instruct.prompt_fields(data.prompt_field), data.response_field],
            "chat": [data.messages_field]}[data.format]


def _read_unit(unit: ReadUnit, data: DataConfig, storage: StorageConfig) -> Iterator[tuple[int, str, str | None, int]]:
    """Yield (position, status, raw text, invalid bytes) for each record of one unit."""
    fs, path = resolve(unit.uri, storage)
    try:
        if unit.fmt == "parquet":
            yield from _read_parquet(fs, path, unit, data)
            return
        head, encoding = _sniff(fs, path, unit, data.encoding)
        if clean.looks_binary(head, encoding):
            if unit.start == 0:
                yield 0, BINARY, None, 0
            return
        if unit.fmt in ("csv", "tsv"):
            yield from _read_csv(fs, path, unit, data, encoding)
            return
        array = unit.fmt == "jsonl" and starts_array(head, encoding)
        if unit.start > 0 and (array or _by_line(unit, encoding)):
            return  # read whole, by the file's first range: a JSON array, or UTF-16/32 (no byte offset of a line)
        if array:
            yield from _read_json_array(fs, path, unit, data, encoding)
            return
        tally = _Tally()
        lines = tally.feed(_lines(fs, path, unit, encoding, data.doc_mode))
        stop = unit.end if unit.end >= 0 and not _by_line(unit, encoding) else None
        if unit.fmt == "jsonl" and reads_records(data):
            by_line = _by_line(unit, encoding)
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
    if _by_line(unit, encoding):
        with open_stream(fs, path, unit.compression) as raw:
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
    return _field_text(record, field)


def _field_text(record, field: str) -> tuple[str, str | None]:
    """(status, text) of a JSON record's text field: a string, null (empty), or anything else (malformed)."""
    if not isinstance(record, dict):
        return MALFORMED, None
    value = record.get(field)  # the usual case first: a flat field, one lookup (this runs once per record)
    if isinstance(value, str):
        return OK, value
    found, value = (True, value) if field in record else field_value(record, field)
    if isinstance(value, str):
        return OK, value
    return (EMPTY, None) if found and value is None else (MALFORMED, None)


def starts_array(head: bytes, encoding: str) -> bool:
    """Whether a JSON file holds one array (of records), not a record a line: its first character is ``[``."""
    return head.decode(encoding, errors="ignore").lstrip("\ufeff \t\r\n").startswith("[")


def _read_json_array(fs, path: str, unit: ReadUnit, data: DataConfig, encoding: str) -> Iterator[tuple]:
    """(index, status, text or record, invalid bytes) of each element of a file's JSON array (the layout of
    ``json.dump(records)`` and of pandas' ``to_json(orient="records")``, which HF ``datasets`` reads too)."""
    with open_stream(fs, path, unit.compression) as raw:
        text = io.TextIOWrapper(io.BufferedReader(raw, 1 << 20), encoding=encoding, errors="sparklm-count")
        before = clean.invalid_total()
        for index, value in json_array(text):
            now = clean.invalid_total()
            if not reads_records(data):
                yield (index, *_field_text(value, data.text_field), now - before)
            elif isinstance(value, dict):
                yield index, OK, _record(value, data, partial(_nth_record, unit.uri, index)), now - before
            else:
                yield index, MALFORMED, None, now - before
            before = now


def _nth_record(uri: str, index: int) -> str:
    return f"{uri} record {index + 1}"


_JSON_BLOCK = 1 << 20  # characters read at a time
_JSON_SPACE = re.compile(r"[ \t\r\n]*")


def json_array(text: io.TextIOBase) -> Iterator[tuple[int, object]]:
    """(index, element) of the JSON array a text stream holds, decoded one element at a time.

    Memory holds an element and a block, not the file (``json.load``, as pandas and ``datasets`` read one, holds all
    of it). A break in the array is a ``ValueError`` naming its line and column; an element that never parses is
    known as such only at the end of the file, which the buffer then holds.
    """
    r = _JsonBuffer(text)
    r.space()
    r.i += 1  # the "[" that made this an array
    index = 0
    if r.space() == "]":
        r.i += 1
    else:
        while True:
            yield index, r.value()
            index += 1
            after = r.space()
            r.i += 1
            if after == "]":
                break
            if after != ",":
                raise r.broken(r.i - 1, "expected ',' or ']' after an element" if after else
                               "the file ends inside the array")
            r.space()
    if r.space():
        raise r.broken(r.i, "more after the array's end")


class _JsonBuffer:
    """A text stream's characters from the position ``i`` on, read a block at a time as the decoding needs them."""

    def __init__(self, text: io.TextIOBase) -> None:
        self.text, self.buf, self.i, self.eof = text, "", 0, False
        self.lines_before = self.column_before = 0  # of the text already dropped from the buffer
        self.decoder = json.JSONDecoder()

    def more(self) -> bool:
        """Read a block (as long as what the buffer holds, so a long element costs linear time) and drop what was
        decoded; False at the end of the stream."""
        block = "" if self.eof else self.text.read(max(_JSON_BLOCK, len(self.buf) - self.i))
        if not block:
            self.eof = True
            return False
        gone = self.buf[:self.i]
        newline = gone.rfind("\n")
        self.lines_before += gone.count("\n")
        self.column_before = len(gone) - newline - 1 if newline >= 0 else self.column_before + len(gone)
        self.buf, self.i = self.buf[self.i:] + block, 0
        return True

    def space(self) -> str:
        """Skip white space; the next character ("" at the end)."""
        while True:
            self.i = _JSON_SPACE.match(self.buf, self.i).end()
            if self.i < len(self.buf) or not self.more():
                return self.buf[self.i:self.i + 1]

    def value(self):
        """Decode the value at ``i`` once the buffer holds the whole of it."""
        while True:
            try:
                value, end = self.decoder.raw_decode(self.buf, self.i)
            except json.JSONDecodeError as e:
                if not self.more():
                    raise self.broken(e.pos, e.msg) from None
                continue
            if end < len(self.buf) or not self.more():  # a number at the buffer's end may go on
                self.i = end
                return value

    def broken(self, at: int, why: str) -> ValueError:
        line = self.lines_before + self.buf.count("\n", 0, at)
        newline = self.buf.rfind("\n", 0, at)
        column = at - newline if newline >= 0 else self.column_before + at + 1
        return ValueError(f"the JSON array breaks at line {line + 1} column {column}: {why}")


def _read_csv(fs, path: str, unit: ReadUnit, data: DataConfig, encoding: str) -> Iterator[tuple[int, str, str | None, int]]:
    csv.field_size_limit(sys.maxsize)
    with open_stream(fs, path, unit.compression) as raw:
        text = io.TextIOWrapper(io.BufferedReader(raw, 1 << 20), encoding=encoding,
                                errors="sparklm-count", newline="")
        reader = csv.reader(text, delimiter=_delimiter(unit, data))
        header = next(reader, None)
        if header is None:
            return
        header = [h.lstrip("\ufeff").strip() for h in header]
        _check_columns(unit.uri, header, data, _delimiter(unit, data))
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


def _delimiter(unit: ReadUnit, data: DataConfig) -> str:
    return data.csv_delimiter or ("\t" if unit.fmt == "tsv" else ",")


def column_paths(schema: pa.Schema) -> list[str]:
    """A schema's columns and, dotted, the fields inside its struct columns (``meta``, ``meta.body``)."""
    out = []

    def walk(prefix: str, fields) -> None:
        for f in fields:
            out.append(prefix + f.name)
            if pa.types.is_struct(f.type):
                walk(f"{prefix}{f.name}.", [f.type.field(i) for i in range(f.type.num_fields)])

    walk("", schema)
    return out


def _check_columns(uri: str, names: list[str], data: DataConfig, delimiter: str = "") -> None:
    """A CSV or Parquet file must have the columns its format reads (one line naming the file and what it has); a
    CSV header read as one column names the delimiter it seems to hold."""
    for name in record_fields(data):
        if name not in names:
            hint = _fields_hint(data) if reads_records(data) else "name the text column with --text-field or data.text_field"
            seen = [c for c in ";|\t," if len(names) == 1 and c != delimiter and c in names[0]]
            if seen:
                hint = f"the header reads as one column: pass --csv-delimiter {seen[0]!r} (data.csv_delimiter)"
            raise SparklmError(f"{uri} has no column '{name}' (columns: {', '.join(names[:20])})", hint=hint)


def _read_parquet(fs, path: str, unit: ReadUnit, data: DataConfig) -> Iterator[tuple[int, str, object, int]]:
    with fs.open_input_file(path) as raw:
        pf = pq.ParquetFile(raw)
        _check_columns(path, column_paths(pf.schema_arrow), data)
        if reads_records(data):
            yield from _parquet_records(pf, unit, data)
            return
        number = 0
        field = data.text_field
        for batch in pf.iter_batches(columns=[field], batch_size=4096):
            column = batch.column(0)
            if field not in pf.schema_arrow.names:  # a field inside a struct: pyarrow gives the struct around it
                for part in field.split(".")[1:]:
                    column = pc.struct_field(column, part)
            for value in column.to_pylist():
                yield (number, *_value(value, data))
                number += 1


def _parquet_records(pf: pq.ParquetFile, unit: ReadUnit, data: DataConfig) -> Iterator[tuple[int, str, object, int]]:
    number = 0
    for batch in pf.iter_batches(columns=record_fields(data), batch_size=1024):
        for values in batch.to_pylist():
            yield number, OK, _record(values, data, partial(_where, None, "", unit, number, by_line=True)), 0
            number += 1
