"""Strategies: how a run is spread over Spark tasks (base.py is the interface).

``ddp``: synchronous data parallelism on barrier tasks; ``average`` and ``diloco``: rounds of plain
tasks with an outer step. Adding one means adding a file and a line to ``REGISTRY``: its keys are the
names ``train.strategy`` accepts (config.py reads them from here), so the names live in one place. The
registry names modules rather than importing them, so reading the names costs nothing.
"""

from __future__ import annotations

import importlib

# name → (module, class, the arguments it is made with)
REGISTRY: dict[str, tuple[str, str, tuple]] = {
    "ddp": ("ddp", "DDP", ()),
    "average": ("rounds", "Rounds", ("average",)),
    "diloco": ("rounds", "Rounds", ("diloco",)),
}
NAMES: tuple[str, ...] = tuple(REGISTRY)


def get(name: str):
    """The strategy (base.Strategy) called ``name``, one of :data:`NAMES`. Imported here only by name: config.py
    reads :data:`NAMES`, and base.py imports config."""
    module, cls, args = REGISTRY[name]
    return getattr(importlib.import_module(f"{__name__}.{module}"), cls)(*args)


def __getattr__(name: str):
    """The interface's types, imported when first asked for (``from sparklm.strategies import Job``)."""
    if name in ("Job", "RoundSpec", "RunResult", "Strategy", "WorkerResult"):
        return getattr(importlib.import_module(f"{__name__}.base"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["Job", "NAMES", "REGISTRY", "RoundSpec", "RunResult", "Strategy", "WorkerResult", "get"]
