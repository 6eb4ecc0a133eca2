"""Atomic checkpoints in safetensors (weights, optimizer state, RNG) plus a JSON state file.

Nothing loaded back is unpickled: tensors come from safetensors, everything else from JSON.
A checkpoint directory is written under a temporary name and renamed when complete; the
newest ``keep`` are kept.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from ..errors import SparklmError

_STATE = "state.json"


def save(directory: Path, step: int, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
         state: dict[str, Any], rng: dict[str, torch.Tensor], keep: int) -> Path:
    """Write ``directory/step-NNNNNNN`` atomically and prune older checkpoints."""
    weights = {k: v.detach().contiguous().cpu().clone() for k, v in model.state_dict().items()}
    tensors, groups = _optimizer_tensors(optimizer)
    return save_files(directory, step, files={"model": _untie(weights), "optimizer": tensors,
                                              "rng": {k: v.contiguous() for k, v in rng.items()}},
                      state={**state, "param_groups": groups}, keep=keep)


def save_files(directory: Path, step: int, *, files: dict[str, dict[str, torch.Tensor]], state: dict[str, Any],
               keep: int, adopt: dict[str, Path] | None = None) -> Path:
    """A checkpoint of named safetensors files (``NAME.safetensors``) and ``state.json``, written under a
    temporary name and renamed when complete. ``adopt`` moves finished directories in (name → path)."""
    directory.mkdir(parents=True, exist_ok=True)
    final = directory / f"step-{step:07d}"
    tmp = directory / f".tmp-step-{step:07d}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    for name, tensors in files.items():
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp / f"{name}.safetensors"))
    for name, path in (adopt or {}).items():
        if path.is_dir():
            path.rename(tmp / name)
    (tmp / _STATE).write_text(json.dumps({**state, "step": step}, indent=2))
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)
    for old in sorted(directory.glob("step-*"))[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def load_files(path: Path, names: list[str]) -> tuple[dict[str, Any], dict[str, dict[str, torch.Tensor]]]:
    """``state.json`` and the named safetensors files of a checkpoint (a missing file loads as empty)."""
    try:
        state = json.loads((path / _STATE).read_text())
        files = {n: load_file(str(path / f"{n}.safetensors")) if (path / f"{n}.safetensors").is_file() else {}
                 for n in names}
    except (OSError, ValueError) as e:
        raise SparklmError(f"checkpoint {path} is unreadable: {e}", hint="delete it to resume from an older one") from None
    return state, files


def latest(directory: Path) -> Path | None:
    done = sorted(p for p in directory.glob("step-*") if (p / _STATE).is_file())
    return done[-1] if done else None


def load(path: Path, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer
         ) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Restore weights and optimizer state in place; return the JSON state and the RNG tensors."""
    try:
        state = json.loads((path / _STATE).read_text())
        weights = load_file(str(path / "model.safetensors"))
        opt = load_file(str(path / "optimizer.safetensors"))
        rng = load_file(str(path / "rng.safetensors"))
    except (OSError, ValueError) as e:
        raise SparklmError(f"checkpoint {path} is unreadable: {e}", hint="delete it to resume from an older one") from None
    missing, unexpected = model.load_state_dict(weights, strict=False)
    tied = {k for k in missing if k.endswith("lm_head.weight")}  # tied to the embedding
    if set(missing) - tied or unexpected:
        raise SparklmError(f"checkpoint {path} does not fit the model (missing {sorted(missing)[:3]}, "
                           f"unexpected {sorted(unexpected)[:3]})", hint="resume with the same model config")
    optimizer.load_state_dict(_optimizer_state(opt, state["param_groups"]))
    return state, rng


def _untie(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """safetensors refuses shared storage: keep one name for tied weights (the embedding)."""
    seen: dict[int, str] = {}
    out = {}
    for k, v in weights.items():
        key = v.untyped_storage().data_ptr()
        if key in seen and v.data_ptr() == weights[seen[key]].data_ptr():
            continue
        seen[key] = k
        out[k] = v
    return out


def _optimizer_tensors(optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], list[dict]]:
    sd = optimizer.state_dict()
    tensors = {}
    for pid, st in sd["state"].items():
        for name, value in st.items():
            t = value if torch.is_tensor(value) else torch.tensor(value)
            tensors[f"{pid}.{name}"] = t.detach().contiguous().cpu().clone()
    return tensors, sd["param_groups"]


def _optimizer_state(tensors: dict[str, torch.Tensor], groups: list[dict]) -> dict:
    state: dict[int, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        pid, name = key.split(".", 1)
        state.setdefault(int(pid), {})[name] = value
    return {"state": state, "param_groups": groups}
