"""Pure text functions: decoding, normalisation, document splitting, hashing and the split.

Nothing here touches Spark or files; :mod:`sparklm.data.sources` feeds these functions on the
executors, and the tests call them directly.
"""

from __future__ import annotations

import codecs
import hashlib
import re
import unicodedata
from collections.abc import Iterable, Iterator

# Blank means ASCII white space only, for bytes and str alike, so that a chunk reader looking at
# raw bytes and the grouping below (on decoded text) agree on where paragraphs start.
_BLANK = " \t\r\n\f\v"
BINARY_SNIFF_BYTES = 8000

_invalid_count = 0
_SURROGATE = re.compile("[\ud800-\udfff]")


def _count_and_replace(err: UnicodeError) -> tuple[str, int]:
    global _invalid_count
    if not isinstance(err, UnicodeDecodeError):
        raise err
    _invalid_count += err.end - err.start
    return "\ufffd", err.end


codecs.register_error("sparklm-count", _count_and_replace)


def decode(data: bytes, encoding: str = "utf-8") -> tuple[str, int]:
    """Decode bytes, replacing invalid sequences with U+FFFD; return (text, invalid byte count)."""
    global _invalid_count
    before = _invalid_count
    text = data.decode(encoding, errors="sparklm-count")
    return text, _invalid_count - before


def invalid_total() -> int:
    """Invalid bytes replaced so far in this process (streams decode through the same handler)."""
    return _invalid_count


def sniff_encoding(head: bytes, default: str) -> str:
    """A byte-order mark decides the encoding (UTF-8/16/32); otherwise the configured one."""
    if head.startswith((codecs.BOM_UTF32_LE, codecs.BOM_UTF32_BE)):
        return "utf-32"
    if head.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)):
        return "utf-16"
    if head.startswith(codecs.BOM_UTF8):
        return "utf-8-sig"
    return default


def looks_binary(head: bytes, encoding: str) -> bool:
    """A NUL byte in the first bytes of a text in a byte-oriented encoding means it is not text."""
    return not wide(encoding) and b"\x00" in head[:BINARY_SNIFF_BYTES]


def wide(encoding: str) -> bool:
    """Whether an encoding (any of Python's spellings) is UTF-16 or UTF-32, whose lines a byte reader cannot find."""
    return codecs.lookup(encoding).name.startswith(("utf-16", "utf-32"))


def surrogate(text: str) -> int:
    """The position of the first half of a UTF-16 pair in ``text`` (JSON may escape one; Python decodes bytes that
    are not UTF-8 on the command line to them), or -1: no tokenizer takes such a string."""
    found = _SURROGATE.search(text) if not text.isascii() else None
    return found.start() if found else -1


def clean_text(text: str, normalize: str = "NFC") -> str:
    """Strip BOMs, turn CRLF/CR into LF, replace half UTF-16 pairs, normalise Unicode, trim surrounding white space."""
    text = text.replace("\ufeff", "") if "\ufeff" in text else text
    if "\r" in text:
        text = text.replace("\r\n", "\n").replace("\r", "\n")
    if not text.isascii():
        if _SURROGATE.search(text):  # half a UTF-16 pair, which JSON may escape: no tokenizer takes it
            text = _SURROGATE.sub("\ufffd", text)
        if normalize != "none":
            text = unicodedata.normalize(normalize, text)
    return text.strip()


def is_blank(line: str | bytes) -> bool:
    return not line.strip(_BLANK if isinstance(line, str) else _BLANK.encode())


def group_documents(
    lines: Iterable[tuple[int, str]], mode: str, *, stop: int | None = None
) -> Iterator[tuple[int, str]]:
    """Group ``(offset, line)`` pairs into ``(offset, document)``.

    ``mode`` is ``line`` (each non-blank line), ``paragraph`` (runs of non-blank lines) or ``file``
    (everything). With ``stop``, documents that start at or after that offset belong to the next
    chunk of the file and are not produced; a document that starts before it is read to its end.
    """
    if mode == "file":
        yield 0, "".join(line for _, line in lines)
        return
    if mode == "line":
        for offset, line in lines:
            if stop is not None and offset >= stop:
                return
            if not is_blank(line):
                yield offset, line
        return
    if mode != "paragraph":
        raise ValueError(f"unknown document mode {mode!r}")
    buf: list[str] = []
    start = 0
    for offset, line in lines:
        if is_blank(line):
            if buf:
                yield start, "".join(buf)
                buf = []
            continue
        if not buf:
            if stop is not None and offset >= stop:
                return
            start = offset
        buf.append(line)
    if buf:
        yield start, "".join(buf)


def digest(text: str) -> bytes:
    """A 16-byte content hash of a cleaned document: the key of dedup and of the split."""
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest()


def doc_id(dig: bytes) -> int:
    """A stable signed 64-bit document id from a content hash."""
    return int.from_bytes(dig[:8], "big", signed=True)


def is_validation(dig: bytes, fraction: float) -> bool:
    """Deterministic split by content hash: the same document lands in the same split everywhere."""
    return int.from_bytes(dig[8:16], "big") < fraction * 2**64
