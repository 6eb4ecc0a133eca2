"""Checkpoints: named safetensors files (weights, optimizer state, RNG) plus ``state.json``, on any
filesystem the run directory is on (``fs``).

Nothing loaded back is unpickled: tensors come from safetensors, everything else from JSON. A
checkpoint directory appears whole (a local rename, or ``state.json`` written last on an object
store, and only directories with it count); the newest ``keep`` are kept.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from ..config import StorageConfig
from ..infra.errors import SparklmError
from ..infra.fs import (
    delete,
    exists,
    file_sha256,
    join,
    list_names,
    local_path,
    read_bytes,
    read_text,
    remove_stale,
    sha256,
    staged_dir,
)

if TYPE_CHECKING:
    import torch

STATE = "state.json"
# torch and safetensors are imported where tensors are touched: the DDP driver lists and reads checkpoint
# states without importing torch (1.5 s of every command's start).


def step_name(step: int) -> str:
    return f"step-{step:07d}"


def save(directory: str, step: int, *, files: dict[str, dict[str, torch.Tensor]], state: dict[str, Any], keep: int,
         storage: StorageConfig | None = None, adopt: dict[str, str] | None = None) -> str:
    """Write ``directory/step-NNNNNNN`` as a whole and prune older checkpoints; return its URI.

    ``files``: name → tensors, saved as ``NAME.safetensors``. ``adopt``: name → a directory whose files
    are taken into the checkpoint as ``NAME/`` (the workers' inner optimizer states) and then removed.
    """
    from safetensors.torch import save_file

    final = join(directory, step_name(step))
    remove_stale(final, storage, before=time.time() - 1)  # a killed earlier save of the same step
    digests = {}  # SHA-256 of every file, checked on load: a damaged checkpoint is found, never trained from
    with staged_dir(final, storage, marker=STATE) as tmp:
        def put(name: str, data: bytes) -> None:
            (tmp / name).parent.mkdir(parents=True, exist_ok=True)
            (tmp / name).write_bytes(data)
            digests[name] = sha256(data)

        for name, tensors in files.items():
            # straight to the file: safetensors' save() would hold the whole file in memory twice (a full
            # model's optimizer state is twice the weights: 2 GB at 135M parameters)
            path = tmp / f"{name}.safetensors"
            save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(path))
            digests[path.name] = file_sha256(path)
        for name, src in (adopt or {}).items():
            (tmp / name).mkdir()
            here = local_path(src)
            for f in list_names(src, storage):
                if here is not None:  # moved, not read: a sharded checkpoint's files are a model's states
                    shutil.move(here / f, tmp / name / f)
                    digests[f"{name}/{f}"] = file_sha256(tmp / name / f)
                else:
                    put(f"{name}/{f}", read_bytes(join(src, f), storage))
        (tmp / STATE).write_text(json.dumps({**state, "step": step, "sha256": digests}, indent=2))
    for src in (adopt or {}).values():
        delete(src, storage)
    done = completed(directory, storage)
    for old in done[:-keep]:
        delete(old, storage)
    return final


def completed(directory: str, storage: StorageConfig | None = None) -> list[str]:
    """Finished checkpoints (those with a state.json), oldest first."""
    names = [n for n in list_names(directory, storage) if n.startswith("step-")]
    return [join(directory, n) for n in names if exists(join(directory, n, STATE), storage)]


def read_state(path: str, storage: StorageConfig | None = None) -> dict[str, Any]:
    try:
        state = json.loads(read_text(join(path, STATE), storage))
        if not isinstance(state, dict) or not isinstance(state.get("step"), int):
            raise ValueError(f"{STATE} is not a checkpoint state")
        return state
    except (OSError, ValueError, UnicodeDecodeError) as e:
        raise unreadable(path, e) from None


def read_file(path: str, name: str, state: dict[str, Any], storage: StorageConfig | None = None) -> bytes | None:
    """The bytes of file ``name`` of a checkpoint, checked against the SHA-256 its state recorded (None if absent)."""
    uri = join(path, name)
    try:
        if not exists(uri, storage):
            if name in state.get("sha256", {}):
                raise OSError(f"{name} is missing")
            return None
        data = read_bytes(uri, storage)
    except OSError as e:
        raise unreadable(path, e) from None
    want = state.get("sha256", {}).get(name)
    if want is not None and sha256(data) != want:
        raise unreadable(path, ValueError(f"{name} does not match its SHA-256 (damaged or truncated)"))
    return data


def read_tensors(path: str, name: str, storage: StorageConfig | None = None,
                 state: dict[str, Any] | None = None) -> dict[str, torch.Tensor]:
    """``NAME.safetensors`` of a checkpoint, verified against ``state``'s checksums ({} when it has none)."""
    from safetensors.torch import load as load_bytes

    data = read_file(path, f"{name}.safetensors", state if state is not None else read_state(path, storage), storage)
    if data is None:
        return {}
    try:
        return load_bytes(data)
    except Exception as e:  # safetensors' SafetensorError is neither OSError nor ValueError
        raise unreadable(path, e) from None


class Unreadable(SparklmError):
    """A checkpoint that cannot be read back (missing or damaged files, a garbled state)."""


def unreadable(path: str, e: BaseException) -> Unreadable:
    why = " ".join(str(e).split())[:200]
    return Unreadable(f"checkpoint {path} is unreadable: {why}", hint="delete it to resume from an older one")


def newest_readable(directory: str, load, storage: StorageConfig | None = None, warn=None):
    """``load(path)`` of the newest checkpoint that loads; an unreadable one is skipped with ``warn(message)``.
    None when there is no checkpoint; the last error when none loads."""
    done = completed(directory, storage)
    error = None
    for i, path in reversed(list(enumerate(done))):
        try:
            return load(path)
        except Unreadable as e:
            error = e
            if warn is not None and i > 0:  # the last error, when no older one is left, is raised instead
                warn(f"{e.message}; resuming from the checkpoint before it")
    if error is not None:
        raise error
    return None



# -- a run's checkpoint, for every strategy ---------------------------------------------------------


@dataclass(frozen=True)
class RunState:
    """What a run's checkpoint records beside its tensors, the same for every strategy; ``extra`` holds what only
    one strategy needs (DDP: the optimizer's param groups; rounds: the round, steps per round)."""

    strategy: str
    world: int  # workers: a run resumes with as many
    step: int
    tokens_seen: int
    position: int  # global rows consumed: where the data resumes
    elapsed: float  # seconds trained so far
    best: dict = field(default_factory=dict)  # the best evaluation's tracker (recorder.Best.to_state)
    extra: dict = field(default_factory=dict)


def save_run(directory: str, run: RunState, files: dict[str, dict[str, torch.Tensor]], *, keep: int,
             storage: StorageConfig | None = None, adopt: dict[str, str] | None = None) -> str:
    """A run's checkpoint of step ``run.step`` (see :func:`save`)."""
    state = {k: v for k, v in asdict(run).items() if k not in ("step", "extra")}
    return save(directory, run.step, files=files, state={**state, **run.extra}, keep=keep, storage=storage,
                adopt=adopt)


def restore_run(directory: str, *, world: int | None, names: tuple[str, ...], storage: StorageConfig | None = None,
                warn=None, verify: str = "") -> tuple[str, RunState, dict[str, dict[str, torch.Tensor]]] | None:
    """The newest readable checkpoint of a run: (its path, its state, its tensor files ``names``, {} where absent),
    or None when there is none. One written by another number of workers is refused (``world`` None: an elastic
    run, which takes any: its global batch is checked by the plan); files whose names start with
    ``verify`` are checked against their SHA-256 too (the rounds workers' inner states, read later by them)."""
    own = set(RunState.__dataclass_fields__) - {"extra"}

    def load(path: str):
        raw = read_state(path, storage)
        if world is not None and raw.get("world") != world:
            raise SparklmError(f"checkpoint {path} was written by {raw.get('world')} workers, not {world}",
                               hint="resume with the same --workers")
        if verify:
            for name in raw.get("sha256", {}):
                if name.startswith(verify):
                    read_file(path, name, raw, storage)
        try:
            run = RunState(**{k: raw[k] for k in own if k in raw}, extra={k: v for k, v in raw.items() if k not in own and k != "sha256"})
        except TypeError as e:  # a state.json without a field every checkpoint has
            raise unreadable(path, e) from None
        return path, run, {n: read_tensors(path, n, storage, raw) for n in names}

    return newest_readable(directory, load, storage, warn)


def model_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's weights for a checkpoint: safetensors refuses shared storage, so tied weights keep one name
    (the first, e.g. the embedding)."""
    weights = {k: v.detach() for k, v in model.state_dict().items()}
    seen: dict[int, str] = {}
    out = {}
    for k, v in weights.items():
        key = v.untyped_storage().data_ptr()
        if key in seen and v.data_ptr() == weights[seen[key]].data_ptr():
            continue
        seen[key] = k
        out[k] = v
    return out


def load_model_tensors(model: torch.nn.Module, weights: dict[str, torch.Tensor], path: str) -> None:
    missing, unexpected = model.load_state_dict(weights, strict=False)
    tied = {k for k in missing if k.endswith("lm_head.weight")}  # tied to the embedding
    if set(missing) - tied or unexpected:
        raise SparklmError(f"checkpoint {path} does not fit the model (missing {sorted(missing)[:3]}, "
                           f"unexpected {sorted(unexpected)[:3]})", hint="resume with the same model config")


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], list[dict]]:
    """An optimizer's state as flat tensors (``PARAM.NAME``) plus its JSON-able param groups. The tensors are
    views of the live state, not copies (a full model's AdamW state is twice its weights): serialise them
    before the optimizer steps again."""
    import torch

    sd = optimizer.state_dict()
    tensors = {}
    for pid, st in sd["state"].items():
        for name, value in st.items():
            t = value if torch.is_tensor(value) else torch.tensor(value)
            tensors[f"{pid}.{name}"] = t.detach().contiguous().cpu()  # serialised at once: no copy
    return tensors, sd["param_groups"]


def load_optimizer(optimizer: torch.optim.Optimizer, tensors: dict[str, torch.Tensor], groups: list[dict]) -> None:
    state: dict[int, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        pid, name = key.split(".", 1)
        state.setdefault(int(pid), {})[name] = value
    optimizer.load_state_dict({"state": state, "param_groups": groups})
