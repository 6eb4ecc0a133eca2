"""``generate --backend llama.cpp``: the model exported to GGUF once (cached by content) and decoded by llama.cpp.

llama.cpp (through ``llama-cpp-python``, the extra ``sparklm[llamacpp]``) is a runtime made for decoding on a CPU:
on SmolLM2-135M it decodes ~6× faster than torch and starts in half a second (BENCHMARKS.md). sparklm keeps what it
owns: the tokenizer (its ids go to llama.cpp as they are, so both sides see the same tokens), the sampling (seeded
per row, the same code as the torch backend) and the outputs. llama.cpp supplies the next-token logits, keeping its
KV cache across the steps of a row; rows run one after another.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import os
import weakref
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

from ..config import StorageConfig
from ..infra.cache import cache_dir
from ..infra.errors import SparklmError
from ..infra.fs import CHECKSUMS, staged_cache

MAX_CONTEXT = 2048
FORMAT = 1  # bump when the export changes what it writes: cached files of older versions are then not reused


class LlamaCppModel:
    """llama.cpp behind the call signature generation uses: the whole sequence in, the last position's logits out.
    A sequence that extends the one before evaluates only its new tokens (llama.cpp's KV cache)."""

    recomputes = True  # called with the whole sequence each step: the prefix it has seen is not run again
    max_batch = 1  # one sequence per llama.cpp context

    def __init__(self, path: Path, context: int, threads: int = 0):
        self._api = _module()
        threads = threads or os.cpu_count() or 1
        self.llm = self._api.Llama(model_path=str(path), n_ctx=context, n_threads=threads, n_threads_batch=threads,
                                   verbose=False)
        self.seen = torch.zeros(0, dtype=torch.long)  # the tokens llama.cpp holds in its KV cache
        # freed before the interpreter tears its modules down: llama-cpp-python's own finaliser, run later, prints a
        # traceback at exit (a weak reference: a model dropped earlier is freed as usual)
        atexit.register(_close, weakref.ref(self.llm))

    def __call__(self, *, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **_ignored
                 ) -> SimpleNamespace:
        row = input_ids[0] if attention_mask is None else input_ids[0][attention_mask[0].bool()]
        n = len(self.seen)
        if len(row) <= n or not torch.equal(row[:n], self.seen):  # another sequence: start again
            self.llm.reset()
            n = 0
        self.seen = row[:0]  # until the evaluation succeeds
        self.llm.eval(row[n:].tolist())
        self.seen = row.clone()
        # the last evaluated position's logits, read from llama.cpp's context (Llama.scores holds them only with
        # logits_all, which would keep every position's)
        last = self._api.llama_get_logits_ith(self.llm.ctx, -1)
        logits = np.ctypeslib.as_array(last, shape=(self.llm.n_vocab(),)).copy()
        return SimpleNamespace(logits=torch.from_numpy(logits)[None, None, :])


def load(path: str, *, threads: int = 0, quantize: str = "none", storage: StorageConfig | None = None):
    """A LoadedModel whose model is llama.cpp running ``path`` (a sparklm run or HF directory) exported to GGUF with
    ``quantize`` (none: f32, f16, q8_0, q4_0 or q4_1), the export made once and kept in sparklm's cache."""
    from ..model.build import context_length
    from .generate import LoadedModel, model_dir, tokenizer_of
    from .gguf_export import checked_quant

    _module()
    quant = checked_quant(quantize, "--backend llama.cpp")
    directory = model_dir(path, storage)
    gguf = cached_export(str(path), directory, quant, storage)
    tok, add_bos = tokenizer_of(directory)
    config = json.loads((directory / "config.json").read_text()) if (directory / "config.json").is_file() else {}
    # llama.cpp allocates its KV cache for the whole context at once: 2,048 tokens at most (SmolLM2's 8,192 would
    # take 380 MB); generation fits prompts to it as to any model's context
    context = min(int(context_length(config) or 2048), MAX_CONTEXT)
    return LoadedModel(LlamaCppModel(gguf, context, threads), tok, str(directory), context, add_bos)


def cached_export(path: str, directory: Path, quant: str, storage: StorageConfig | None) -> Path:
    """``directory`` exported to GGUF in sparklm's cache, keyed by its files' content and ``quant``; exported on
    first use (the torch model loaded once for it)."""
    from .generate import load as load_torch
    from .gguf_export import GGUF_FILE, write_gguf

    target = cache_dir("gguf", f"{content_key(directory)[:24]}-{quant}-v{FORMAT}")
    if not (target / "info.json").is_file():
        from ..infra import progress

        progress.info(f"exporting {path} to GGUF ({quant}) for llama.cpp, once: {target}")
        lm = load_torch(path, storage=storage, device="cpu")
        with staged_cache(target, marker="info.json") as tmp:
            info = write_gguf(lm, tmp, quant)
            (tmp / "info.json").write_text(json.dumps(info, indent=2))
    return target / GGUF_FILE


def content_key(directory: Path) -> str:
    """SHA-256 over a model directory's files (names and contents; an adapter's base directory too): the same model
    copied or renamed finds its export, a changed one does not. Each file's digest is remembered by (path, size,
    mtime), so a large model is read once."""
    from ..model.build import ADAPTER_CONFIG
    from ..model.gguf import digest

    h = hashlib.sha256()
    dirs = [directory]
    adapter = directory / ADAPTER_CONFIG
    if adapter.is_file():
        base = json.loads(adapter.read_text()).get("base_model_name_or_path") or ""
        if Path(base).is_dir():
            dirs.append(Path(base))
    for d in dirs:
        for f in sorted(p for p in d.rglob("*") if p.is_file() and p.name != CHECKSUMS):
            h.update(f"{f.relative_to(d).as_posix()}:{digest(str(f))}\n".encode())
    return h.hexdigest()


def _close(ref: weakref.ref) -> None:
    llm = ref()
    if llm is not None:
        llm.close()


def _module():
    try:
        import llama_cpp
    except ImportError:
        raise SparklmError("--backend llama.cpp needs the llama-cpp-python package",
                           hint="pip install 'sparklm[llamacpp]' (it builds llama.cpp for this CPU: a few minutes)"
                           ) from None
    return llama_cpp
