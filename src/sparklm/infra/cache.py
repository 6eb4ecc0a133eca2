"""sparklm's per-user cache directory, and objects cached per Python process (a Spark worker reuses them
across tasks: a model loaded once serves every partition and round that process runs)."""

from __future__ import annotations

import os
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")
_OBJECTS: OrderedDict = OrderedDict()


def cache_dir(*parts: str) -> Path:
    """``$XDG_CACHE_HOME/sparklm`` (default ``~/.cache/sparklm``), joined with ``parts``; not created."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache", "sparklm", *parts)


def log_file(kind: str) -> Path:
    """A fresh log file's path under ``logs/`` (created), named by ``kind``, time and process: where a command sends
    the output of the processes it starts (Spark's JVM, Beam's workers)."""
    logs = cache_dir("logs")
    logs.mkdir(parents=True, exist_ok=True)
    return logs / f"{kind}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log"


def process_local(key: Hashable, build: Callable[[], T], *, keep: int = 1) -> T:
    """The object built for ``key`` in this process, built on first use. Only the ``keep`` most recent keys
    are held: a model is large, and a worker that moves to another job should not hold the old one."""
    if key in _OBJECTS:
        _OBJECTS.move_to_end(key)
        return _OBJECTS[key]
    while len(_OBJECTS) >= keep:
        _OBJECTS.popitem(last=False)
    _OBJECTS[key] = value = build()
    return value
