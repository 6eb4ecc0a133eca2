"""Strategies: how a run is spread over Spark tasks (base.py is the interface).

``ddp``: synchronous data parallelism on barrier tasks; ``average`` and ``diloco``: rounds of plain
tasks with an outer step. Adding one means adding a file and a line here.
"""

from __future__ import annotations

from .base import Job, RoundSpec, RunResult, Strategy, WorkerResult
from .ddp import DDP
from .rounds import Rounds

STRATEGIES: dict[str, Strategy] = {"ddp": DDP(), "average": Rounds("average"), "diloco": Rounds("diloco")}


def get(name: str) -> Strategy:
    return STRATEGIES[name]


__all__ = ["Job", "RoundSpec", "RunResult", "Strategy", "WorkerResult", "STRATEGIES", "get"]
