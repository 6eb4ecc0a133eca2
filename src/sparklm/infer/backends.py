"""The backends generation runs on, loaded by one function: torch (a KV-cached HF model, optionally int8 or int4 on
the CPU, or on a GPU), an ONNX export (onnxruntime), or llama.cpp (a GGUF export, on the CPU). Each gives a
``generate.LoadedModel`` whose model generation drives as a ``generate.Decoder``."""

from __future__ import annotations

from ..config import StorageConfig
from ..infra.errors import SparklmError
from . import generate, llamacpp
from .generate import LoadedModel

BACKENDS = ("torch", "onnx", "llama.cpp")


def load(path: str, *, backend: str = "torch", quantize: str = "none", threads: int = 0,
         storage: StorageConfig | None = None, device: str = "auto", batch_size: int = 8) -> LoadedModel:
    """The model generation runs on ``backend``: torch (``quantize`` none, bf16, int8 or int4; int8 and int4 on the
    CPU), an ONNX export (``path`` is its directory; quantized when exported), or llama.cpp (the model exported to GGUF
    once, ``quantize`` none, f16, bf16, q8_0, q4_0 or q4_1, at most ``batch_size`` rows decoded together; on the CPU)."""
    if backend not in BACKENDS:
        raise SparklmError(f"backend {backend!r}: use one of {', '.join(BACKENDS)}")
    check_quantize(backend, quantize)
    if backend == "llama.cpp":
        if device not in ("auto", "cpu"):
            raise SparklmError(f"--backend llama.cpp runs on the CPU, not {device}",
                               hint="--device cpu, or --backend torch")
        return llamacpp.load(path, threads=threads, quantize=quantize, storage=storage, batch_size=batch_size)
    if backend == "onnx":
        if quantize != "none":
            raise SparklmError("an ONNX export is quantized when it is made, not when it runs",
                               hint="`sparklm export MODEL --format onnx --quantize int8`, then drop --quantize")
        from .export import load_onnx  # torch and onnxruntime: imported for this backend only

        return load_onnx(path, threads=threads)
    # generation only runs the model: on the CPU its float Linear layers are packed for oneDNN (faster decoding)
    return generate.load(path, threads=threads, quantize=quantize, storage=storage, device=device, pack=True)


def check_quantize(backend: str, quantize: str) -> None:
    """One line unless ``quantize`` is one that ``backend`` runs: llama.cpp's GGUF blocks, or torch's none/bf16/int8/int4 (an
    ONNX export's own check, that it was quantized when exported, is load's)."""
    if backend == "llama.cpp":
        from .gguf_export import checked_quant

        checked_quant(quantize, "--backend llama.cpp")
    elif backend == "torch":
        generate.check_quantize(quantize)
