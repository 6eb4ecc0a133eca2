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


def scaler_block(numel: int, shards: int = 1) -> int:
    """The scales' block for a weight of ``numel`` elements: QLoRA's 256 where the weight's blocks of 64 divide into
    it, else the largest power of two (at least 16) that divides them (a hidden size of 960: 64), such that the scale
    groups split evenly over ``shards`` ranks (train.parallel shard splits every part of the tensor by rows). 0: no
    block fits (the weight stays in bfloat16)."""
    if numel % BLOCK:
        return 0
    blocks = numel // BLOCK
    sizes = [s for s in (256, 128, 64, 32, 16) if blocks % s == 0 and (blocks // s) % shards == 0]
    return sizes[0] if sizes else 0


def quantize(t: torch.Tensor, shards: int = 1) -> torch.Tensor:
    """``t`` as an NF4 tensor (bfloat16 when dequantized), its parts splitting evenly over ``shards`` ranks."""
    from torchao.quantization import NF4Tensor

    return NF4Tensor.from_tensor(t.to(torch.bfloat16).contiguous(), BLOCK, scaler_block(t.numel(), shards))


def is_nf4(t: torch.Tensor) -> bool:
    from torchao.quantization import NF4Tensor

    return isinstance(t, NF4Tensor)


def quantizable(model: torch.nn.Module, shards: int = 1) -> set[str]:
    """The weights held in 4 bits: every linear layer's inside the model's blocks (what LoRA's all-linear adapts;
    not the embeddings or the LM head) whose size NF4's blocks divide, into rows that split over ``shards`` ranks."""
    from .build import blocks

    names = {id(m): n for n, m in model.named_modules()}
    out = set()
    for block in blocks(model):
        for m in block.modules():
            if isinstance(m, torch.nn.Linear) and scaler_block(m.weight.numel(), shards) and \
                    m.weight.shape[0] % shards == 0:
                out.add(f"{names[id(m)]}.weight")
    return out


def weight_files(path: Path) -> list[Path]:
    """The model's safetensors files, in the order its index lists them (or its one file)."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / n for n in names]
    return sorted(path.glob("*.safetensors"))


class Weights:
    """A safetensors file read with plain reads, one tensor (or a range of its rows) at a time, into memory of its own.

    safetensors' ``safe_open`` maps the whole file: every page a read touches counts in the process's resident memory
    until the file is closed (measured: a peak of 4.3 GB loading the 1.7B shape in 4 bits, whose weights take
    0.96 GB), and a tensor it returns may be a view of that map. The format is an 8-byte header length, a JSON
    header of each tensor's dtype, shape and byte offsets, then the bytes."""

    DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64,
              "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
              "BOOL": torch.bool}

    def __init__(self, path: Path):
        self.path = path
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(n))
        header.pop("__metadata__", None)
        self.header, self.base = header, 8 + n

    def keys(self) -> list[str]:
        return list(self.header)

    def shape(self, key: str) -> list[int]:
        return self.header[key]["shape"]

    def get(self, key: str, start: int | None = None, stop: int | None = None) -> torch.Tensor:
        """Tensor ``key``, or its rows ``start:stop`` (dim 0), read from the file."""
        info = self.header[key]
        dtype, shape = self.DTYPES[info["dtype"]], list(info["shape"])
        begin, end = info["data_offsets"]
        if start is not None and shape:
            row = (end - begin) // max(1, shape[0])
            stop = shape[0] if stop is None else stop
            begin, end, shape[0] = begin + start * row, begin + stop * row, stop - start
        out = torch.empty(shape, dtype=dtype)
        view = out.reshape(-1).view(torch.uint8).numpy() if out.numel() else None
        if view is not None:
            with open(self.path, "rb") as f:
                f.seek(self.base + begin)
                f.readinto(memoryview(view)[: end - begin])
        return out


def load(directory: str, storage: StorageConfig | None = None, shards: int = 1) -> torch.nn.Module:
    """The causal LM ``directory`` names (an HF directory or a run's model/) with its blocks' linear weights in NF4,
    read one tensor at a time (``shards``: the ranks a sharded run splits each over). An adapter directory or a
    .gguf file is loaded in bfloat16 and then quantized."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    from .build import ADAPTER_CONFIG, check_causal, check_model_dir, load_model, model_source, verify_checksums

    path = model_source(directory, storage)
    if (path / ADAPTER_CONFIG).is_file() or str(directory).lower().endswith(".gguf"):
        return quantized(load_model(directory, dtype=torch.bfloat16, storage=storage), shards)
    check_causal(check_model_dir(path, directory), directory)
    verify_checksums(path)
    try:
        config = AutoConfig.from_pretrained(str(path), local_files_only=True, trust_remote_code=False)
        with init_empty_weights(include_buffers=False):  # buffers (rotary frequencies) are computed, not read
            model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    except Exception as e:
        raise SparklmError(f"cannot load the model in {directory}: {' '.join(str(e).split())[:200]}") from None
    targets = quantizable(model, shards)
    params = dict(model.named_parameters())
    for file in weight_files(path):
        f = Weights(file)
        for key in f.keys():
            if key in params:
                t = f.get(key)
                _set(model, key, quantize(t, shards) if key in targets else t.to(torch.bfloat16))
                del t
                if key in targets:
                    _hand_back()
    model.tie_weights()
    missing = [n for n, p in model.named_parameters() if p.is_meta]
    if missing:
        raise SparklmError(f"{directory} does not hold every weight of its model (missing {', '.join(missing[:3])})",
                           hint="pass a complete model directory written by save_pretrained")
    return model.eval()


def quantized(model: torch.nn.Module, shards: int = 1) -> torch.nn.Module:
    """``model`` with its blocks' linear weights replaced by NF4 tensors, in place."""
    for key in quantizable(model, shards):
        _set(model, key, quantize(model.get_parameter(key).detach(), shards))
    return model


def _hand_back() -> None:
    """Return the heap's free pages to the OS (glibc's malloc_trim): quantizing a weight makes temporaries of several
    times its size, which glibc would otherwise keep (measured on the 1.7B shape: 3.1 GB resident after loading,
    1.4 GB with this)."""
    import ctypes
    import platform

    if platform.system() == "Linux" and platform.libc_ver()[0] == "glibc":
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except OSError:
            pass


def _set(model: torch.nn.Module, key: str, value: torch.Tensor) -> None:
    owner, _, leaf = key.rpartition(".")
    module = model.get_submodule(owner) if owner else model
    module._parameters[leaf] = torch.nn.Parameter(value, requires_grad=False)
