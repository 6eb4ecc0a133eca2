"""Model: the building blocks the tasks (sparklm/tasks/) are made of: the task interface and the token-stream batch
(task.py), figures (figures.py), building and loading HF models (build.py), the encoders' loading, LoRA wrapping
and merged export (encoders.py, lora.py), attention kernels, the chunked LM-head loss, masking, GGUF import, FLOPs and
parameter counts. The package imports nothing at first, so the driver reads the torch-free modules without importing
torch; ``from sparklm.model import build_model`` still works."""

import importlib

_BUILD = ("build_model", "flops_per_token", "load_model", "param_count")


def __getattr__(name: str):
    if name in _BUILD:
        return getattr(importlib.import_module(f"{__name__}.build"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = list(_BUILD)
