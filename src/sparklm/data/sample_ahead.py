"""The tokenizer's sample read, and its BPE trained, while Spark starts.

Without dedup, prepare reads a few units (chosen by hash) for the tokenizer's sample, trains the BPE, then makes its
one pass. On a local master the first two steps run in a child process started before the JVM, so that they take
the seconds the driver would spend waiting for Spark (100 MB: ~10 s of a ~47 s prepare). The child runs the pure
functions the Spark job runs (``sources.documents`` → ``passes.scan_rows`` → ``tokenizer.train``) over the same
units, so the tokenizer is the same (tested). Anything the child cannot do (an unreadable file, a crash) sends
prepare back to the Spark job, whose errors are the usual one-line ones.

A child process and not a thread: pyspark forks the JVM with a ``preexec_fn``, which is unsafe beside a running
thread. The child gets its settings on stdin and answers on stdout (JSON; no file, nothing unpickled); object-store
credentials reach it as they reach Spark's workers, through the environment.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

from ..config import Config, from_dict
from . import allocator, passes, sources
from . import tokenizer as tokenizers_mod

_SAMPLE = passes.SCAN_COLUMNS.index("sample")


def wanted(config: Config, master: str) -> bool:
    """Whether prepare, reading files on Spark, trains its tokenizer on a sample read ahead: in local mode, with a
    tokenizer to train and no full scan first. ``SPARKLM_SAMPLE_AHEAD=0`` turns it off."""
    return (master.startswith("local") and not config.tokenizer.path and not passes.full_scan(config.data)
            and os.environ.get("SPARKLM_SAMPLE_AHEAD", "1") != "0")


def sample_of(units: list[sources.ReadUnit], config: Config) -> list[str]:
    """The tokenizer's sample from ``units``: what the Spark job over the same units collects (the training
    documents whose content hash falls in the sampled fraction)."""
    fraction = passes.sample_fraction(config, passes.planned_bytes([units]))
    rows = passes.scan_rows(sources.documents(units, config.data, config.storage), config.data, fraction)
    return [row[_SAMPLE] for row in rows if row[_SAMPLE] is not None]


class Ahead:
    """The child process at work; :meth:`result` waits for its tokenizer (None: it failed, use Spark)."""

    def __init__(self, proc: subprocess.Popen):
        self.proc = proc

    def result(self) -> tokenizers_mod.TokenizerSpec | None:
        with self.proc.stdout:  # stdin was written and closed at the start
            out = self.proc.stdout.read()
        if self.proc.wait():
            return None
        try:
            return tokenizers_mod.TokenizerSpec(**json.loads(out))
        except (ValueError, TypeError):
            return None

    def cancel(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        if self.proc.stdout and not self.proc.stdout.closed:
            self.proc.stdout.close()


def start(units: list[sources.ReadUnit], config: Config, preload: str | None = None) -> Ahead | None:
    """Start the child on the units chosen for the sample (None where it cannot start), on the malloc ``preload``
    names (:func:`allocator.library`; BPE training 1.3x faster on mimalloc)."""
    chosen = passes.sample_units([units], config.tokenizer.sample_mb)
    # whole, not masked (a pipe to this user's own child: the storage keys and paths it reads with must work)
    payload = json.dumps({"config": config.to_dict(), "units": [dataclasses.asdict(u) for u in chosen]})
    try:
        proc = subprocess.Popen([sys.executable, "-m", __name__], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, text=True, env={**os.environ, **allocator.environment(preload)})
    except OSError:
        return None
    try:  # the child reads all of stdin first: a payload larger than the pipe waits only for its start
        proc.stdin.write(payload)
        proc.stdin.close()
    except OSError:
        proc.kill()
        proc.wait()
        return None
    return Ahead(proc)


def main() -> None:
    payload = json.loads(sys.stdin.read())
    config = from_dict(payload["config"])
    units = [sources.ReadUnit(**u) for u in payload["units"]]
    spec = tokenizers_mod.train(sample_of(units, config), config.tokenizer)
    sys.stdout.write(json.dumps(dataclasses.asdict(spec)))


if __name__ == "__main__":
    main()
