"""``train.compile``: torch.compile the model's repeated blocks (its transformer layers), each in place.

Compiling block by block, as torchtitan does, rather than the whole model:

* the chunked LM-head loss (model/lm_head.py) stays: it hooks the head, which stays eager, so the whole micro-batch's
  logits are never made. Compiled whole, the model computed them (67 MB in float32 at 16 x 256 x 4096). Each chunk's
  log-softmax, top-1 hits and gradient are one compiled function (``lm_head.chunk_terms``);
* the blocks share one forward, so Dynamo traces and Inductor compiles one block's graph and every layer reuses it:
  seconds of compiling where the whole model took ~30 s on the CPU;
* the attention mask is made by the eager model, as in eager mode. Profiled compiled whole on the main job's
  batches, the layers ran SDPA's kernel, not sparklm's CPU attention (model/attention.py), which takes only calls
  without a mask.

The core (train/core.py) compiles from a fresh run's second step, so that the first comes soon, and runs
evaluation and samples eager (:func:`eager`).

Inductor fuses what eager mode runs as separate passes over the activations: RMSNorm in float32, the rotary
embedding, SwiGLU's product and autocast's casts. Measured on the CPU in bf16 (BENCHMARKS.md, 16 x 256 rows): the
step 1.21x (main shape) and 1.11x (~10M) the eager one, 1.34-1.51x and 1.20-1.37x (three runs) a plain PyTorch loop,
at 65-70% and 65-71% MFU.
"""

from __future__ import annotations

import contextlib
import shutil

import torch

from ..infra.errors import SparklmError
from ..model.task import loss_chunk, set_loss_chunks


def blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The members of ``model``'s longest ``ModuleList`` whose members are all of one class: an HF model's layers
    (``model.layers``, ``transformer.h``, ``encoder.layer``), also under a LoRA wrapper; [] when it has none."""
    best: list[torch.nn.Module] = []
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) > len(best):
            members = list(module)
            if len({type(m) for m in members}) == 1:
                best = members
    return best


def compile_model(net: torch.nn.Module, model: torch.nn.Module) -> torch.nn.Module:
    """The network the steps run, compiled: ``model``'s blocks each compiled in place (``net`` wraps ``model``, or is
    it), or, for a model without repeated blocks, ``net`` compiled whole, with the model's own loss (the chunked
    loss's hook on the head does not survive a compiled whole)."""
    needs_compiler(next(model.parameters()).device.type)
    found = blocks(model)
    if found:
        for block in found:
            # static shapes: evaluation's batches (and a last short one) get graphs of their own. With torch's
            # default, the first new shape recompiled the block with symbolic shapes, and the training steps ran
            # that slower graph from then on (155 -> 190 ms a step in the main job)
            block.compile(dynamic=False)
        chunk = loss_chunk(model)
        if chunk is not None:  # the head stays eager; each chunk's loss terms compiled (lm_head.py)
            set_loss_chunks(model, chunk, fused=True)
        return net
    set_loss_chunks(model, None)
    return torch.compile(net)


def eager() -> contextlib.AbstractContextManager:
    """Compiled blocks run eager inside: evaluation and samples. Their batches are of other shapes (and without
    gradients), and each would compile the blocks again (a sample's every new length too, up to Dynamo's limit of
    recompiles): ~15 s of compiling at the main job's first evaluation, for 20 forward passes."""
    return torch.compiler.set_stance("force_eager")


def needs_compiler(device: str) -> None:
    """Inductor writes C++ for the CPU and builds it with a C++ compiler (its ``cpp.cxx`` setting: ``$CXX``, else g++;
    on macOS clang++): without one, one line before any compiling, not a traceback at the second step."""
    from torch._inductor import config as inductor

    if device != "cpu":
        return
    wanted = inductor.cpp.cxx if isinstance(inductor.cpp.cxx, (list, tuple)) else (inductor.cpp.cxx,)
    names = [name for name in wanted if name]
    if not any(shutil.which(name) for name in names):
        raise SparklmError(f"train.compile is on, but this worker has no C++ compiler ({' or '.join(names)}), which "
                           "torch.compile needs on the CPU", hint="install one (e.g. apt install g++) on every "
                           "worker, or set train.compile=off")
