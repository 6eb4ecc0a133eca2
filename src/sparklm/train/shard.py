"""Sharded data parallelism (``train.parallel = shard``): PyTorch's FSDP2 over the DDP ranks.

Each rank holds 1/N of every weight, gradient and optimizer state (``fully_shard`` per decoder block and at the
root); a block's weights are all-gathered while it computes and its gradients reduce-scattered after its backward.
torch does the sharding, the collectives (gloo on CPUs, NCCL on GPUs) and the resharding of a checkpoint onto
another world size (``torch.distributed.checkpoint``); this module says which modules are the units, gathers the
weights a run exports one tensor at a time, and writes and reads a sharded checkpoint where the run directory is
(local disk, or an object store through a local staging copy).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from ..model.build import blocks

DCP = "dcp"  # a sharded checkpoint's directory of torch.distributed.checkpoint files


def shard(model: torch.nn.Module, dtype: torch.dtype | None) -> torch.nn.Module:
    """``model`` sharded in place over the default process group: each block, then the root (embeddings, head, final
    norm). ``dtype``: the compute dtype the weights are gathered in (bfloat16/float16; gradients are reduced in
    float32), None: float32 throughout."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32) if dtype is not None else \
        MixedPrecisionPolicy()
    for block in blocks(model):
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model


def rows(t: torch.Tensor) -> tuple[int, int]:
    """The rows of sharded ``t`` this rank keeps: FSDP2 shards dim 0 as torch.chunk does (ceil(rows / N) a rank, the
    last ranks fewer or none); a plain tensor, all of them."""
    if not is_sharded(t):
        return 0, t.shape[0]
    n, me = t.device_mesh.size(), t.device_mesh.get_local_rank()
    size = -(-t.shape[0] // n)
    start = min(me * size, t.shape[0])
    return start, min(start + size, t.shape[0])


def materialize(model: torch.nn.Module, path: Path, device: str) -> list[str]:
    """Sharded ``model``, built on the meta device, given its storage on ``device`` and filled from the safetensors
    files in ``path``: each rank reads only the rows of each weight that it keeps (safetensors reads a slice without
    the rest), so no rank ever holds a whole weight, let alone the model. Its buffers stay as they were built
    (computed ones, such as rotary frequencies, are in no file). Returns the weights no file held (none: complete)."""
    from safetensors import safe_open

    from ..model.nf4 import weight_files

    built = {n: b.detach().clone() for n, b in model.named_buffers()}
    model.to_empty(device=device)
    params = dict(model.named_parameters())
    filled = set()
    with torch.no_grad():
        for n, b in model.named_buffers():
            b.copy_(built[n])
        for file in weight_files(path):
            with safe_open(str(file), framework="pt") as f:
                for key in f.keys():
                    p = params.get(key)
                    if p is None or key in filled:
                        continue
                    start, stop = rows(p)
                    if stop > start:
                        local(p).copy_(f.get_slice(key)[start:stop])
                    filled.add(key)
    return sorted(set(params) - filled)


def is_sharded(t: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def whole(t: torch.Tensor) -> torch.Tensor:
    """A sharded tensor gathered whole on every rank (a collective); any other tensor as it is."""
    return t.full_tensor() if is_sharded(t) else t


def like(full: torch.Tensor, sharded: torch.Tensor) -> torch.Tensor:
    """Whole tensor ``full`` (the same on every rank) sharded as ``sharded`` is: each rank takes its part, no
    collective."""
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(full.to(sharded.dtype), sharded.device_mesh, sharded.placements, src_data_rank=None)


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of ``t`` (a plain tensor: itself)."""
    return t.to_local() if is_sharded(t) else t


def gathered(tensors: dict[str, torch.Tensor], keep: bool) -> Iterator[tuple[str, torch.Tensor]]:
    """Each tensor of ``tensors`` gathered whole, one at a time, in order (every rank takes part); ``keep``: this rank
    receives them (on the CPU), the others get nothing: no rank ever holds more than one whole tensor beyond what it
    keeps."""
    for name, t in tensors.items():
        full = whole(t.detach())
        if keep:
            yield name, full.cpu()
        del full


def model_state(model: torch.nn.Module) -> dict:
    """The model's sharded state dict (DTensors: each rank its shards)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(model)


def optimizer_state(model: torch.nn.Module, optimizers: tuple) -> dict:
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    return get_optimizer_state_dict(model, list(optimizers))


def load_states(model: torch.nn.Module, optimizers: tuple, model_sd: dict, optim_sd: dict) -> None:
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    set_model_state_dict(model, model_sd)
    set_optimizer_state_dict(model, list(optimizers), optim_sd)


@contextmanager
def staged(uri_dir: str | None) -> Iterator[str]:
    """A local directory for this rank's checkpoint files: ``uri_dir`` itself on local disk, else a temporary one
    (uploaded by the caller)."""
    if uri_dir is not None:
        os.makedirs(uri_dir, exist_ok=True)
        yield uri_dir
        return
    tmp = tempfile.mkdtemp(prefix="sparklm-dcp-")
    try:
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def save(state: dict, directory: str) -> None:
    """``state`` (sharded tensors and plain ones) written by every rank into local ``directory``: each rank its own
    shards' file, rank 0 the metadata that maps them (torch.distributed.checkpoint)."""
    import torch.distributed.checkpoint as dcp

    dcp.save(state, storage_writer=dcp.FileSystemWriter(directory, single_file_per_rank=True))


def load(state: dict, directory: str) -> None:
    """``state`` filled in place from the checkpoint in local ``directory``, resharded to this world's shards."""
    import torch.distributed.checkpoint as dcp

    dcp.load(state, storage_reader=dcp.FileSystemReader(directory))
