"""torch's dynamic int8 for CPU inference, made one Linear layer at a time so that the float weights leave memory as
their int8 copies arrive.

A model loaded from safetensors holds its float weights as pages of the file's mapping: they count in the process's
RSS once read, and stay until the last tensor of the file is freed. ``quantize_dynamic`` reads every weight before
any is dropped, so the int8 model peaked above the float one (SmolLM2-135M: 1.3 GB against fp32's 1.0). Here each
layer's float weight, once quantized, gives its pages back with ``madvise(MADV_DONTNEED)``: torch has no call that
drops part of a mapped storage, and the pages are clean file pages, so dropping them loses nothing (they are read
from the file again if anything touched them).
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import warnings

import torch

_MADV_DONTNEED = 4  # Linux; the same value on every architecture torch ships for


def quantize(model: torch.nn.Module) -> torch.nn.Module:
    """Replace every ``nn.Linear`` of ``model`` in place with torch's dynamic int8 Linear (int8 weights, activations
    quantized per batch): the same layers and numbers as ``torch.ao.quantization.quantize_dynamic(model,
    {nn.Linear}, dtype=torch.qint8)``. The float tensors that stay (embeddings, norms) are copied out of the file's
    mapping, so the mapping closes."""
    from torch.ao.nn.quantized.dynamic import Linear as DynamicLinear
    from torch.ao.quantization import default_dynamic_qconfig

    # every module's own tensors, a tied one under each module that holds it (the embedding and the head)
    owned = [(m, t) for m in model.modules() for t in [*m.parameters(recurse=False), *m.buffers(recurse=False)]]
    mapped = file_mappings()
    with warnings.catch_warnings():  # torch.ao.quantization announces its move to torchao
        warnings.simplefilter("ignore")
        for parent in list(model.modules()):
            for name, child in list(parent.named_children()):
                if type(child) is not torch.nn.Linear:
                    continue
                child.qconfig = default_dynamic_qconfig
                setattr(parent, name, DynamicLinear.from_float(child))
                weight = child.weight
                others = [t for m, t in owned if m is not child]
                if weight.is_contiguous() and in_mappings(weight, mapped) and not shares_bytes(weight, others):
                    release(weight)
    _own_memory(model)
    return model


def file_mappings() -> list[tuple[int, int]]:
    """The address ranges of this process's mappings of files (from /proc/self/maps); empty where there is none."""
    ranges = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                fields = line.split(maxsplit=5)
                if len(fields) == 6 and fields[5].startswith("/"):
                    start, end = fields[0].split("-")
                    ranges.append((int(start, 16), int(end, 16)))
    except OSError:  # not Linux: nothing is released, the result is the same
        return []
    return ranges


def in_mappings(t: torch.Tensor, ranges: list[tuple[int, int]]) -> bool:
    """Whether ``t``'s bytes lie inside one of ``ranges`` (a mapped file, so its pages can be dropped safely)."""
    start, end = _span(t)
    return any(a <= start and end <= b for a, b in ranges)


def _span(t: torch.Tensor) -> tuple[int, int]:
    return t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()


def shares_bytes(t: torch.Tensor, others: list[torch.Tensor]) -> bool:
    """Whether any of ``others`` overlaps ``t``'s bytes (a head tied to its embedding shares them)."""
    start, end = _span(t)
    for other in others:
        a, b = _span(other)
        if other.numel() and a < end and start < b:
            return True
    return False


def release(t: torch.Tensor) -> None:
    """Drop from this process the whole pages that lie inside ``t``'s bytes (the pages at its ends may hold a
    neighbour's bytes too, and stay). Only for a contiguous tensor in a file mapping that nothing uses any more."""
    page = mmap.PAGESIZE
    first, last = _span(t)
    start, end = -(-first // page) * page, last // page * page
    if end > start:
        _libc().madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), _MADV_DONTNEED)


@functools.cache
def _libc():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc


def _own_memory(model: torch.nn.Module) -> None:
    """Copy the tensors that stay float (embedding, norms) out of the file's mapping, so that it closes once the
    loader lets go (a tensor still pointing into it keeps every page read so far resident)."""
    copies: dict[int, torch.Tensor] = {}  # tensors that share storage (tied weights) stay shared
    for t in [*model.parameters(), *model.buffers()]:
        if t.data_ptr() not in copies:
            copies[t.data_ptr()] = t.data.clone()
        t.data = copies[t.data_ptr()]
