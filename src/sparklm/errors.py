"""The one user-facing error type.

A :class:`SparklmError` is a foreseeable mistake (bad input, bad config, unreachable storage).
The CLI prints it as one line with a hint and exits non-zero; anything else is a bug and keeps
its traceback. Errors raised inside Spark tasks travel back to the driver inside Java exception
text, so they carry a marker that :func:`from_spark` finds again.
"""

from __future__ import annotations

import re

_MARK = "SPARKLM-ERROR<<"
_END = ">>"


class SparklmError(Exception):
    """A foreseeable problem, reported to the user as one line (what, where, how to fix)."""

    def __init__(self, message: str, *, hint: str | None = None, exit_code: int = 2):
        super().__init__(message)
        self.message = message
        self.hint = hint
        self.exit_code = exit_code

    def one_line(self) -> str:
        text = f"error: {self.message}"
        if self.hint:
            text += f" (hint: {self.hint})"
        return " ".join(text.split())

    def __str__(self) -> str:
        # Marked so the text survives the trip through a Spark task failure.
        return f"{_MARK}{self.message}|{self.hint or ''}{_END}"


def from_spark(exc: BaseException) -> SparklmError | None:
    """Recover a :class:`SparklmError` raised in a Spark task from the driver-side exception."""
    match = re.search(re.escape(_MARK) + r"(.*?)\|(.*?)" + re.escape(_END), str(exc), re.S)
    if not match:
        return None
    return SparklmError(match.group(1), hint=match.group(2) or None)


class spark_errors:
    """``with spark_errors(): rdd.collect()`` — a :class:`SparklmError` raised inside a Spark task comes
    back as itself (one line) instead of a Java stack trace; any other failure passes through."""

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc is None or isinstance(exc, SparklmError):
            return False
        found = from_spark(exc)
        if found is not None:
            raise found from None
        return False
