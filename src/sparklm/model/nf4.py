"""A frozen base held in 4 bits under LoRA (``lora.base_dtype = nf4``, QLoRA): the blocks' linear weights as
torchao's NF4 tensors, the rest (embeddings, head, norms) in bfloat16, LoRA's adapters on top in float32.

Why torchao: its ``NF4Tensor`` is pure PyTorch — quantize, dequantize, ``F.linear`` and its backward, and FSDP2's
all-gather hooks (train.parallel shard) — so it runs wherever torch runs, CPU and CUDA alike; it is the NF4 that
torchtune's QLoRA uses. bitsandbytes' 4-bit layers need its native library, whose CPU kernels cover fewer machines.

Why a loader of our own: transformers quantizes while loading only through a quantization config, and neither its
bitsandbytes nor its torchao config offers torchao's NF4; loading in bfloat16 and quantizing after would hold the
whole base in 16 bits first. Here the model is built on the meta device and filled tensor by tensor from its
safetensors files, each block weight quantized as it is read: at most one 16-bit tensor exists beside the 4-bit
model.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..config import StorageConfig
from ..infra.errors import SparklmError

BLOCK, SCALER_BLOCK = 64, 256  # QLoRA's: a scale per 64 weights, the scales quantized in blocks of 256


def scaler_block(numel: int) -> int:
    """The scales' block for a weight of ``numel`` elements: QLoRA's 256 where the weight's blocks of 64 divide into
    it, else the largest power of two (at least 16) that divides them (a hidden size of 960: 64); and where that
    leaves a number of scale groups that 8 does not divide, a smaller block whose groups it does, so that sharding
    over 2, 4 or 8 ranks splits every part of the tensor evenly (train.parallel shard). 0: no block fits (the weight
    stays in bfloat16)."""
    if numel % BLOCK:
        return 0
    blocks = numel // BLOCK
    sizes = [s for s in (256, 128, 64, 32, 16) if blocks % s == 0]
    even = [s for s in sizes if (blocks // s) % 8 == 0]
    return (even or sizes or [0])[0]


def quantize(t: torch.Tensor) -> torch.Tensor:
    """``t`` as an NF4 tensor (bfloat16 when dequantized)."""
    from torchao.quantization import NF4Tensor

    return NF4Tensor.from_tensor(t.to(torch.bfloat16).contiguous(), BLOCK, scaler_block(t.numel()))


def is_nf4(t: torch.Tensor) -> bool:
    from torchao.quantization import NF4Tensor

    return isinstance(t, NF4Tensor)


def quantizable(model: torch.nn.Module) -> set[str]:
    """The weights held in 4 bits: every linear layer's inside the model's blocks (what LoRA's all-linear adapts;
    not the embeddings or the LM head), whose sizes the NF4 blocks divide."""
    from .build import blocks

    names = {id(m): n for n, m in model.named_modules()}
    out = set()
    for block in blocks(model):
        for m in block.modules():
            if isinstance(m, torch.nn.Linear) and scaler_block(m.weight.numel()):
                out.add(f"{names[id(m)]}.weight")
    return out


def weight_files(path: Path) -> list[Path]:
    """The model's safetensors files, in the order its index lists them (or its one file)."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / n for n in names]
    return sorted(path.glob("*.safetensors"))


def load(directory: str, storage: StorageConfig | None = None) -> torch.nn.Module:
    """The causal LM ``directory`` names (an HF directory or a run's model/) with its blocks' linear weights in NF4,
    read one tensor at a time. An adapter directory or a .gguf file is loaded in bfloat16 and then quantized."""
    from accelerate import init_empty_weights
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    from .build import ADAPTER_CONFIG, check_causal, check_model_dir, load_model, model_source, verify_checksums

    path = model_source(directory, storage)
    if (path / ADAPTER_CONFIG).is_file() or str(directory).lower().endswith(".gguf"):
        return quantized(load_model(directory, dtype=torch.bfloat16, storage=storage))
    check_causal(check_model_dir(path, directory), directory)
    verify_checksums(path)
    try:
        config = AutoConfig.from_pretrained(str(path), local_files_only=True, trust_remote_code=False)
        with init_empty_weights(include_buffers=False):  # buffers (rotary frequencies) are computed, not read
            model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    except Exception as e:
        raise SparklmError(f"cannot load the model in {directory}: {' '.join(str(e).split())[:200]}") from None
    targets = quantizable(model)
    params = dict(model.named_parameters())
    for file in weight_files(path):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                if key in params:
                    t = f.get_tensor(key)
                    _set(model, key, quantize(t) if key in targets else t.to(torch.bfloat16))
    model.tie_weights()
    missing = [n for n, p in model.named_parameters() if p.is_meta]
    if missing:
        raise SparklmError(f"{directory} does not hold every weight of its model (missing {', '.join(missing[:3])})",
                           hint="pass a complete model directory written by save_pretrained")
    return model.eval()


def quantized(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with its blocks' linear weights replaced by NF4 tensors, in place."""
    for key in quantizable(model):
        _set(model, key, quantize(model.get_parameter(key).detach()))
    return model


def _set(model: torch.nn.Module, key: str, value: torch.Tensor) -> None:
    owner, _, leaf = key.rpartition(".")
    module = model.get_submodule(owner) if owner else model
    module._parameters[leaf] = torch.nn.Parameter(value, requires_grad=False)
