"""``sparklm export``: an ONNX graph (input ids, attention mask → logits), optionally quantized.

A causal LM's graph gives next-token logits; an encoder's (BERT, RoBERTa, MiniLM, ...) gives its classifier's
logits when it has a sequence-classification head, else its last hidden states (embeddings are pooled from them).

int8: onnxruntime's dynamic quantization of the MatMul weights (activations quantized on the fly);
int4: onnxruntime's block-wise 4-bit weight-only MatMulNBits. The graph has no KV-cache inputs:
``generate --backend onnx`` recomputes the (context-bounded) sequence each step.
"""

from __future__ import annotations

import contextlib
import json
import logging
import warnings
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

from ..config import StorageConfig
from ..infra import redact
from ..infra.errors import SparklmError
from ..infra.fs import listing, staged_dir

ONNX_FILE = "model.onnx"


class LogitsGraph(torch.nn.Module):
    """input_ids, attention_mask → logits; positions come from the mask, so left padding works."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        positions = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        return self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions,
                          use_cache=False).logits


def export(model: str, output: str, *, quantize: str = "none", overwrite: bool = False, merge: bool = False,
           storage: StorageConfig | None = None) -> dict:
    """Write ``output``/model.onnx (+ tokenizer and config files); returns what was written. A LoRA adapter is
    merged into its base first; with ``merge`` the merged model is also written as an HF model directory
    (model.safetensors beside the graph), loadable without peft."""
    from .generate import load

    if quantize not in ("none", "int8", "int4"):
        raise SparklmError(f"--quantize {quantize}: use none, int8 or int4")
    _onnx_modules()
    out = export_dir(output, overwrite)
    architectures = _architectures(model, storage)
    if architectures and not any(str(a).endswith(("ForCausalLM", "LMHeadModel")) for a in architectures):
        return _export_encoder(model, out, architectures, quantize=quantize, storage=storage)
    lm = load(model, storage=storage, device="cpu")  # the graph is traced on the CPU
    with staged_dir(str(out), marker=MARKER) as tmp:
        _write_graph(LogitsGraph(lm.model).eval(), tmp, "logits", lm.context, quantize)
        lm.tokenizer.save_pretrained(str(tmp))
        if merge:
            lm.model.config.use_cache = True
            merged_in_base_dtype(lm.model, model, storage).save_pretrained(str(tmp), safe_serialization=True)
        else:
            lm.model.config.save_pretrained(str(tmp))
        info = {"format": "onnx", "quantize": quantize, "source": lm.path, "context": lm.context, "merged_hf": merge,
                "add_bos": lm.add_bos, "inputs": ["input_ids", "attention_mask"], "outputs": ["logits"]}
        (tmp / MARKER).write_text(json.dumps(redact.mapping({**info, "files": listing(tmp)}), indent=2))
    return {**info, "path": str(out), "bytes": (out / ONNX_FILE).stat().st_size}


def _traceable_experts(model: torch.nn.Module) -> None:
    """A mixture of experts (Mixtral, Qwen-MoE, ...) with its experts as batched matrix products: transformers'
    default kernel (grouped_mm) has no ONNX form; the batched one gives the same logits and exports."""
    setter = getattr(model, "set_experts_implementation", None)  # transformers 5; a dense model only notes it
    if callable(setter):
        setter("batched_mm")


MARKER = "sparklm_export.json"  # what an export of ours holds: --overwrite replaces nothing else


def _write_graph(graph: torch.nn.Module, tmp: Path, output: str, context: int, quantize: str) -> None:
    """``graph`` (input_ids, attention_mask → ``output``) as tmp/model.onnx, batch and length dynamic, quantized
    as asked."""
    onnx, _ = _onnx_modules()
    ids = torch.ones((2, 8), dtype=torch.long)
    mask = torch.ones((2, 8), dtype=torch.long)
    fp32 = tmp / ("model-fp32.onnx" if quantize != "none" else ONNX_FILE)
    batch, seq = torch.export.Dim("batch", min=1), torch.export.Dim("sequence", min=1, max=context)
    _traceable_experts(getattr(graph, "model", graph))
    with torch.no_grad(), _quiet_toolchain():
        torch.onnx.export(graph, (ids, mask), str(fp32), input_names=["input_ids", "attention_mask"],
                          output_names=[output], dynamo=True, external_data=False,
                          dynamic_shapes={"input_ids": {0: batch, 1: seq}, "attention_mask": {0: batch, 1: seq}})
    if quantize == "int8":
        from onnxruntime.quantization import QuantType, quantize_dynamic

        with _quiet_toolchain():
            quantize_dynamic(str(fp32), str(tmp / ONNX_FILE), weight_type=QuantType.QInt8, per_channel=True)
    elif quantize == "int4":
        from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

        q = MatMulNBitsQuantizer(onnx.load(str(fp32)), block_size=32, is_symmetric=True)
        with _quiet_toolchain():
            q.process()
        q.model.save_model_to_file(str(tmp / ONNX_FILE), use_external_data_format=False)
    if fp32.name != ONNX_FILE:
        fp32.unlink()


def _architectures(model: str, storage: StorageConfig | None) -> list:
    """The architectures ``model``'s config.json names ([] for a LoRA adapter or a .gguf file: causal LMs)."""
    from ..infra.fs import exists, join, read_config_json
    from .generate import model_uri

    path = model_uri(model, storage)
    if not exists(join(path, "config.json"), storage):
        return []
    return read_config_json(path, storage).get("architectures") or []


class EncoderGraph(torch.nn.Module):
    """input_ids, attention_mask → a classifier's logits, or an encoder's last hidden states."""

    def __init__(self, model: torch.nn.Module, output: str):
        super().__init__()
        self.model, self.output = model, output

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return getattr(self.model(input_ids=input_ids, attention_mask=attention_mask), self.output)


def _export_encoder(model: str, out: Path, architectures: list, *, quantize: str, storage: StorageConfig | None
                    ) -> dict:
    from .encode import load_encoder

    head = any(str(a).endswith("ForSequenceClassification") for a in architectures)
    enc = load_encoder(model, classify=head, storage=storage, device="cpu")
    output = "logits" if head else "last_hidden_state"
    with staged_dir(str(out), marker=MARKER) as tmp:
        _write_graph(EncoderGraph(enc.model, output).eval(), tmp, output, enc.max_length, quantize)
        enc.tokenizer.save_pretrained(str(tmp))
        enc.model.config.save_pretrained(str(tmp))
        info = {"format": "onnx", "quantize": quantize, "task": "text-classification" if head else
                "feature-extraction", "context": enc.max_length, "labels": enc.labels,
                "inputs": ["input_ids", "attention_mask"], "outputs": [output]}
        (tmp / MARKER).write_text(json.dumps(redact.mapping({**info, "files": listing(tmp)}), indent=2))
    return {**info, "path": str(out), "bytes": (out / ONNX_FILE).stat().st_size}



def export_dir(output: str, overwrite: bool) -> Path:
    """The export directory: new, empty, or (with ``overwrite``) an earlier export of ours."""
    from ..infra.fs import check_replaceable

    out = Path(output)
    check_replaceable(out, overwrite, marker=MARKER, kind="a sparklm export")
    return out


def merged_in_base_dtype(merged, model: str, storage: StorageConfig | None):
    """A LoRA adapter merged into its base, in the dtype the base was published in (its config.json's: bfloat16 for
    most open models, which the run held in bfloat16 or 4 bits), else as loaded (float32). Any other model as it is."""
    import torch

    from ..model import lora
    from ..model.build import ADAPTER_CONFIG, model_source
    from .generate import model_dir

    source = model_dir(model, storage)
    if not (source / ADAPTER_CONFIG).is_file():
        return merged
    try:
        base = json.loads((model_source(lora.base_of(source), storage) / "config.json").read_text())
    except (OSError, ValueError):
        return merged
    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(base.get("dtype") or base.get("torch_dtype"))
    return merged.to(dtype) if dtype is not None else merged


def export_hub(model: str, output: str, *, overwrite: bool = False, merge: bool = False,
               storage: StorageConfig | None = None) -> dict:
    """Write ``output`` as a Hugging Face Hub repository's files, ready for ``huggingface_hub.upload_folder``: the
    model directory (weights, config, generation config, tokenizer, model card) checked against its checksums, and
    without sparklm's own bookkeeping. With ``merge``, a LoRA adapter is merged into its base and written as a
    plain model (the Hub cannot resolve a base named by a local path)."""
    import shutil

    from ..infra.fs import CHECKSUMS, verify_checksums
    from ..model.build import ADAPTER_CONFIG
    from .generate import load, model_dir

    out = export_dir(output, overwrite)
    source = model_dir(model, storage)
    verify_checksums(source)
    adapter = (source / ADAPTER_CONFIG).is_file()
    with staged_dir(str(out), marker=MARKER) as tmp:
        if adapter and merge:
            lm = load(model, storage=storage, device="cpu")  # merged into its base
            lm.model.config.use_cache = True
            merged_in_base_dtype(lm.model, model, storage).save_pretrained(str(tmp), safe_serialization=True)
        for f in sorted(source.iterdir()):
            skip = f.name == CHECKSUMS or (adapter and merge and (f.name == ADAPTER_CONFIG or f.name.startswith(
                "adapter_model")))
            if f.is_file() and not skip:
                shutil.copy2(f, tmp / f.name)
        if adapter and merge and (tmp / "README.md").is_file():  # the card described the adapter
            card = (tmp / "README.md").read_text(encoding="utf-8")
            (tmp / "README.md").write_text(card.replace("library_name: peft", "library_name: transformers", 1),
                                           encoding="utf-8")
        info = {"format": "hub", "source": str(source), "adapter": adapter and not merge, "merged": adapter and merge,
                "files": sorted(f.name for f in tmp.iterdir())}
        (tmp / MARKER).write_text(json.dumps(redact.mapping({**info, "files": listing(tmp)}), indent=2))
    return {**info, "path": str(out)}


@contextlib.contextmanager
def _quiet_toolchain() -> Iterator[None]:
    """Keep the exporters' notes about their own internals off the user's console: torch.onnx logs every
    torchvision op it skips and warns about its own pytree use and axis names, onnxruntime's quantizer suggests a
    pre-processing step through the root logger. None of them is about what sparklm asked for; errors still raise."""
    loggers = [logging.getLogger(name) for name in ("torch.onnx", "torch.export", "")]
    levels = [lg.level for lg in loggers]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for lg in loggers:
            lg.setLevel(logging.ERROR)
        try:
            yield
        finally:
            for lg, level in zip(loggers, levels):
                lg.setLevel(level)


class OnnxModel:
    """Runs an exported graph with onnxruntime: called as a causal LM is, and as generation's Decoder. The graph has
    no KV cache, so every step runs the whole (context-bounded) sequence again."""

    def __init__(self, path: Path, threads: int = 0):
        _, ort = _onnx_modules()
        options = ort.SessionOptions()
        if threads:
            options.intra_op_num_threads = threads
        self.session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])

    def __call__(self, *, input_ids: torch.Tensor, attention_mask: torch.Tensor, **_ignored) -> SimpleNamespace:
        (logits,) = self.session.run(["logits"], {"input_ids": input_ids.numpy().astype("int64"),
                                                  "attention_mask": attention_mask.numpy().astype("int64")})
        return SimpleNamespace(logits=torch.from_numpy(logits))

    def start(self, ids: np.ndarray, mask: np.ndarray, new_tokens: int = 0) -> np.ndarray:
        self.ids, self.mask = ids.astype(np.int64), mask.astype(np.int64)
        return self._last()

    def extend(self, chosen: np.ndarray) -> np.ndarray:
        self.ids = np.concatenate([self.ids, chosen.astype(np.int64)[:, None]], axis=1)
        self.mask = np.concatenate([self.mask, np.ones((len(chosen), 1), dtype=np.int64)], axis=1)
        return self._last()

    def _last(self) -> np.ndarray:
        (logits,) = self.session.run(["logits"], {"input_ids": self.ids, "attention_mask": self.mask})
        return logits[:, -1, :]


def load_onnx(path: str, *, threads: int = 0):
    """A LoadedModel over an exported directory (``sparklm export``)."""
    from transformers import AutoTokenizer

    from .generate import LoadedModel

    directory = Path(path)
    info_file = directory / MARKER
    if not (directory / ONNX_FILE).is_file() or not info_file.is_file():
        raise SparklmError(f"{path} is not an ONNX export (no {ONNX_FILE} / sparklm_export.json)",
                           hint="make one with `sparklm export MODEL --format onnx --output DIR`")
    info = json.loads(info_file.read_text())
    if info.get("task", "text-generation") != "text-generation":
        raise SparklmError(f"{path} is an export of an encoder ({info['task']}), which does not generate text",
                           hint="run it with onnxruntime: its inputs are input_ids and attention_mask")
    tok = AutoTokenizer.from_pretrained(str(directory), local_files_only=True, trust_remote_code=False)
    return LoadedModel(OnnxModel(directory / ONNX_FILE, threads), tok, str(directory), int(info["context"]),
                       bool(info["add_bos"]))


def _onnx_modules():
    try:
        import onnx
        import onnxruntime
    except ImportError:
        raise SparklmError("ONNX export needs the onnx, onnxscript and onnxruntime packages",
                           hint="pip install 'sparklm[export]'") from None
    return onnx, onnxruntime
