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
        from .redact import text as redact_text

        line = f"error: {self.message}"
        if self.hint:
            line += f" (hint: {self.hint})"
        return redact_text(" ".join(line.split()))

    @classmethod
    def from_line(cls, line: str) -> SparklmError:
        """The error a :meth:`one_line` text describes: a child process's stderr line back into an error."""
        what, sep, hint = line.removeprefix("error: ").strip().partition(" (hint: ")
        return cls(what, hint=hint[:-1] if sep and hint.endswith(")") else None)

    def __str__(self) -> str:
        # Inside a Spark task the text is marked, so that it survives the trip through the task's failure (the
        # driver finds it again: from_spark); everywhere else it reads as the one line, message and hint.
        if in_spark_task():
            return f"{_MARK}{self.message}|{self.hint or ''}{_END}"
        return self.message + (f" (hint: {self.hint})" if self.hint else "")


def in_spark_task() -> bool:
    """Whether this code runs inside a Spark task (a Python worker's TaskContext is set)."""
    import sys

    if "pyspark" not in sys.modules:
        return False
    from pyspark import TaskContext

    return TaskContext.get() is not None


_PLAIN = re.compile(r"(?:^|\n)\S*SparklmError: ([^\n]*)")


def from_spark(exc: BaseException) -> SparklmError | None:
    """Recover a :class:`SparklmError` raised in a worker from the driver-side exception: a Spark task's marked
    text, the error itself among the exception's causes (an in-process runner), or its one line in a traceback's
    text (a worker process that is not a Spark task: a Beam SDK harness)."""
    match = re.search(re.escape(_MARK) + r"(.*?)\|(.*?)" + re.escape(_END), str(exc), re.S)
    if match:
        return SparklmError(match.group(1), hint=match.group(2) or None)
    seen, cause = set(), exc
    while cause is not None and id(cause) not in seen:
        if isinstance(cause, SparklmError):
            return SparklmError(cause.message, hint=cause.hint, exit_code=cause.exit_code)
        seen.add(id(cause))
        cause = cause.__cause__ or cause.__context__
    plain = _PLAIN.findall(str(exc))
    return SparklmError.from_line(plain[-1]) if plain else None


# Failures that are not sparklm's fault but are foreseeable, recognised in an exception's or a log's text.
_CAUSES = [
    # an object store's failures as pyarrow (AWS SDK) and boto report them, before the peer pattern's "timeout"
    (re.compile(r"AWS Error NETWORK_CONNECTION|curlCode: (?:6|7),", re.I),
     "cannot reach the object store",
     "check --endpoint-url (AWS_ENDPOINT_URL, storage.endpoint_url), that its server is up and that this host reaches "
     "it"),
    (re.compile(r"AWS Error (?:ACCESS_DENIED|INVALID_ACCESS_KEY_ID|SIGNATURE_DOES_NOT_MATCH|MISSING_AUTHENTICATION_TOKEN"
                r"|INVALID_CLIENT_TOKEN_ID)|AWS Error \w+ \(HTTP status 403\)|\b(?:AccessDenied|InvalidAccessKeyId|"
                r"SignatureDoesNotMatch)\b", re.I),
     "the object store refused access",
     "check the credentials (AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, AWS_PROFILE) and the bucket's permissions"),
    (re.compile(r'Cannot run program "[^"]*python[^"]*"', re.I),
     "the executors cannot start the Python that runs sparklm (it is not installed on their hosts)",
     "set spark.ship_env = 'on' (--set spark.ship_env=\"on\") to send this environment with the job, or "
     "install the same packages on every host and set PYSPARK_PYTHON to that interpreter"),
    (re.compile(r"No space left on device|ENOSPC|errno 28\b", re.I),
     "no space left on device", "free disk space (or point the output and spark.local.dir elsewhere) and run again"),
    (re.compile(r"java\.lang\.OutOfMemoryError|Java heap space", re.I),
     "the Spark driver's JVM ran out of memory (Java heap space)",
     "raise spark.driver.memory (e.g. --conf spark.driver.memory=12g; in local mode the tasks' results and "
     "broadcasts share that heap), or train fewer weights (LoRA)"),
    (re.compile(r"\bMemoryError\b|Cannot allocate memory|std::bad_alloc|DefaultCPUAllocator: can't allocate", re.I),
     "out of memory", "lower train.batch_size or the model size, or give the executors more memory"),
    (re.compile(r"Connection closed by peer|Connection reset by peer|Timed out|timeout.*gloo|gloo.*timeout", re.I),
     "a peer rank stopped answering (it died or is stuck)", "see the other ranks' logs; the run can continue "
     "with --resume from its last checkpoint"),
]


_KILLED = re.compile(r"Python worker exited unexpectedly|Container killed by YARN for exceeding|OOMKilled|"
                     r"exit code 137", re.I)


def killed_note(text: str) -> str | None:
    """For a Spark task whose process was killed (``text``: the failure), what most often did it, else None. Not a
    :func:`known_cause`: the strategies decide what a lost process means (DDP restarts, a round goes on without it)."""
    if _KILLED.search(text):
        return ("a killed process, most often for going over its memory limit: --memory-limit SIZE plans each "
                "rank's micro-batch to it, or give the executors more memory (spark.executor.pyspark.memory, "
                "spark.executor.memoryOverhead)")
    return None


def known_cause(text: str) -> tuple[str, str] | None:
    """(what happened, how to fix it) for a foreseeable failure named in ``text``, else None."""
    for pattern, what, hint in _CAUSES:
        if pattern.search(text):
            return what, hint
    return None


class spark_errors:
    """``with spark_errors(): rdd.collect()`` — a :class:`SparklmError` raised inside a Spark task comes
    back as itself (one line) instead of a Java stack trace; any other failure passes through. ``what`` names the
    tasks of another engine (a Beam pipeline's workers, whose errors carry the same marker), and ``translate`` turns
    that engine's own foreseeable failures into an error (or None)."""

    def __init__(self, what: str = "a Spark task", translate=None):
        self.what, self.translate = what, translate

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc is None or isinstance(exc, SparklmError):
            return False
        found = from_spark(exc) or (self.translate(exc) if self.translate else None)
        if found is not None:
            raise found from None
        cause = known_cause(str(exc))
        if cause is not None:
            raise SparklmError(f"{self.what} failed: {cause[0]}", hint=cause[1]) from None
        return False
