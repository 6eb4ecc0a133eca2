"""Strategies: how a run is spread over Spark tasks (base.py is the interface).

``ddp``: synchronous data parallelism on barrier tasks; ``average`` and ``diloco``: rounds of plain
tasks with an outer step. Adding one means adding a file and a line to registry.STRATEGIES: its keys are
the names ``train.strategy`` accepts, so the names live in one place, at the bottom of the layers.
"""

from __future__ import annotations

import importlib

from ..registry import strategy as get


def __getattr__(name: str):
    """The interface's types, imported when first asked for (``from sparklm.strategies import Job``)."""
    if name in ("Job", "RoundSpec", "RunResult", "Strategy", "WorkerResult"):
        return getattr(importlib.import_module(f"{__name__}.base"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["Job", "RoundSpec", "RunResult", "Strategy", "WorkerResult", "get"]
