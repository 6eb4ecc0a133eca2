"""Model: the tasks (tasks.py: names and figures, torch-free; task.py: the causal LM), building an HF causal LM from
config or a directory (build.py), FLOPs and parameter counts. The package imports nothing at first, so the driver
can read tasks.py without importing torch; ``from sparklm.model import build_model`` still works."""

import importlib

_BUILD = ("build_model", "flops_per_token", "load_model", "param_count")


def __getattr__(name: str):
    if name in _BUILD:
        return getattr(importlib.import_module(f"{__name__}.build"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = list(_BUILD)
