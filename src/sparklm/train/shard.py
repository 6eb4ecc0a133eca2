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
    files in ``path``: each rank reads only the rows of each weight that it keeps (a row range is one byte range of
    the file), so no rank ever holds a whole weight, let alone the model. Its buffers stay as they were built
    (computed ones, such as rotary frequencies, are in no file). Returns the weights no file held (none: complete)."""
    from ..model.nf4 import Weights, weight_files

    built = {n: b.detach().clone() for n, b in model.named_buffers()}
    model.to_empty(device=device)
    params = dict(model.named_parameters())
    filled = set()
    with torch.no_grad():
        for n, b in model.named_buffers():
            b.copy_(built[n])
        for file in weight_files(path):
            f = Weights(file)  # plain reads of this rank's rows only (a memory map would count every page touched)
            for key in f.keys():
                p = params.get(key)
                if p is None or key in filled:
                    continue
                start, stop = rows(p)
                if stop > start:
                    local(p).copy_(f.get(key, start, stop) if p.dim() else f.get(key))
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


MAX_FILE = 5 * 10**9  # bytes of weights a file holds, as save_pretrained splits them (then an index names each one's)
_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64",
           torch.int64: "I64", torch.int32: "I32", torch.uint8: "U8", torch.int8: "I8", torch.bool: "BOOL"}


def exported(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """What a model's safetensors hold: each parameter once (a tied weight under its first name, as save_pretrained
    drops the tied LM head) and the persistent buffers, in the model's order."""
    out = list(model.named_parameters())
    transient = {f"{n}.{b}" if n else b for n, m in model.named_modules() for b in m._non_persistent_buffers_set}
    return out + [(n, b) for n, b in model.named_buffers() if n not in transient]


def save_streamed(directory: Path | None, model: torch.nn.Module, *, max_file: int = MAX_FILE) -> None:
    """The weights of sharded ``model`` as Hugging Face safetensors files in ``directory`` (``model.safetensors``, or
    ``model-0000i-of-0000n.safetensors`` of at most ``max_file`` bytes each with ``model.safetensors.index.json``),
    gathered one tensor at a time and written as it arrives: every rank takes part in each gather, and the rank
    given ``directory`` (None: another) writes. Why by hand: safetensors' writer takes a whole file's tensors at
    once; its format (an 8-byte header length, a JSON header of every tensor's dtype, shape and offsets, then the
    bytes in order) lets the header, known from the shapes, go first and each tensor follow."""
    import json

    tensors = exported(model)
    files: list[list[tuple[str, torch.Tensor]]] = [[]]
    size = 0
    for name, t in tensors:
        n = t.numel() * t.element_size()
        if files[-1] and size + n > max_file:
            files.append([])
            size = 0
        files[-1].append((name, t))
        size += n
    names = (["model.safetensors"] if len(files) == 1 else
             [f"model-{i + 1:05d}-of-{len(files):05d}.safetensors" for i in range(len(files))])
    weight_map, total = {}, 0
    for fname, group in zip(names, files, strict=True):
        out = None
        if directory is not None:
            header, offset = {}, 0
            for name, t in group:
                n = t.numel() * t.element_size()
                header[name] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
                offset += n
                weight_map[name] = fname
            total += offset
            raw = json.dumps({"__metadata__": {"format": "pt"}, **header}, separators=(",", ":")).encode()
            raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
            out = open(directory / fname, "wb")  # noqa: SIM115 (closed below, after every tensor of the file)
            out.write(len(raw).to_bytes(8, "little") + raw)
        try:
            for _, t in group:
                full = whole(t.detach())
                if out is not None:
                    out.write(full.contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes())
                del full
        finally:
            if out is not None:
                out.close()
    if directory is not None and len(files) > 1:
        (directory / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))


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
