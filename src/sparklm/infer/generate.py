"""Text generation with a KV cache: one process, any local HF causal LM or a sparklm run directory.

Prompts are left-padded into batches, those of like length together; every output row draws from its own seeded
generator, so a prompt's text depends on (seed, prompt key, sample index) only, not on batching or on the machine
that runs it (which is what makes batch generation on Spark equal one-by-one generation).

The loop itself works on numpy arrays; a backend is a ``Decoder`` (a prompt's logits, then one token's at a time).
torch is imported only by the torch backend, so llama.cpp starts without it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import numpy as np

from ..config import StorageConfig
from ..data.clean import surrogate
from ..infra import progress
from ..infra.errors import SparklmError
from ..infra.fs import exists, is_remote, join, list_names, local_copy
from ..spark.resources import check_threads
from .sampling import Sampling, next_tokens, row_generator, softmax

if TYPE_CHECKING:
    import torch


@dataclass
class Generation:
    key: int  # the prompt's key (its index, or its id in batch generation)
    sample: int
    prompt: str
    text: str  # the continuation only
    token_ids: list[int]
    prompt_tokens: int
    truncated: bool = False  # the prompt was cut from the left to fit the context
    top: list[list[tuple[str, float]]] = field(default_factory=list)  # --show-top: per position

    def record(self) -> dict:
        """One output row (the schema of batch.OUTPUT_SCHEMA and of ``--output`` files)."""
        return {"id": self.key, "sample": self.sample, "prompt": self.prompt, "text": self.text,
                "prompt_tokens": self.prompt_tokens, "new_tokens": len(self.token_ids), "truncated": self.truncated}


@dataclass
class LoadedModel:
    model: torch.nn.Module
    tokenizer: object
    path: str
    context: int
    add_bos: bool  # prompts start with BOS (as the training documents did)


def model_uri(path: str, storage: StorageConfig | None = None) -> str:
    """The model directory named by ``path`` (a sparklm run directory's ``model/``, an HF model directory itself,
    or a LoRA adapter directory), local or on an object store; one line when there is none."""
    from ..model.build import ADAPTER_CONFIG, model_source

    remote = is_remote(path)
    base = path.rstrip("/") if remote else str(Path(path).expanduser().resolve())
    if not remote and Path(base).is_file() and base.lower().endswith(".gguf"):
        return str(model_source(base))  # converted once into sparklm's cache
    for candidate in (join(base, "model"), base):
        if any(exists(join(candidate, name), storage) for name in ("config.json", ADAPTER_CONFIG)):
            return candidate
    if not (list_names(base, storage) if remote else Path(base).exists()):  # an object store has no empty directories
        raise SparklmError(f"model {path} not found", hint="pass a sparklm run directory or an HF model directory")
    raise SparklmError(f"{path} is neither a sparklm run directory nor an HF model directory (no config.json)",
                       hint="pass the --output of `sparklm train`/`run`, or a directory written by save_pretrained")


def model_dir(path: str, storage: StorageConfig | None = None) -> Path:
    """The model named by ``path`` as a local directory (an object store's copied once into the cache)."""
    return local_copy(model_uri(path, storage), storage)


def load(path: str, *, threads: int = 0, quantize: str = "none", storage: StorageConfig | None = None,
         device: str = "auto", pack: bool = False) -> LoadedModel:
    """Load a model and its tokenizer (safetensors only: nothing is unpickled); ``path`` may be on an object store.
    ``device``: "cpu", "cuda" (or "cuda:N"), or auto: CUDA where torch sees a GPU.

    ``quantize``: "int8", torch's dynamic int8 quantization of every Linear layer (weights int8, activations
    quantized per batch) — on a trained 27M model 1.8x faster scoring at +0.4% perplexity here (BENCHMARKS.md); or
    "int4", 4-bit weights in groups of 32 on torch's packed int4 CPU kernel (``quantize.py``). Both CPU only. Or
    "bf16": the weights in bfloat16 (half fp32's bytes to read per token; on a CPU with AVX512-BF16 or AMX, or a GPU,
    ~2x fp32's decoding speed), logits sampled in float32 as for every backend.

    ``pack``: on the CPU, the float Linear layers that stay get their weights in oneDNN's packed layout
    (``quantize.PackedLinear``), a Llama-family layer's projections of one input as one product
    (``torch_decode.projection_groups``); SmolLM2-135M decodes 1.4-1.5x faster at batch 1 here. For a model that
    only runs inference here: it is then no longer one transformers can save or move.
    """
    import torch

    from ..model import load_model
    from ..model.build import context_length

    check_quantize(quantize)
    check_threads(threads)
    if threads:
        torch.set_num_threads(threads)
    directory = model_dir(path, storage)
    packed = quantize in ("int8", "int4")  # CPU kernels; bf16 runs anywhere
    where = inference_device(device, cpu_only=packed)
    model = load_model(str(directory), storage=storage).eval()
    if packed:
        from .quantize import quantize as quantized

        quantized(model, quantize)
    elif quantize == "bf16":
        from .quantize import to_bf16

        to_bf16(model)
    if pack and where == "cpu":
        from .quantize import pack as packed_layers
        from .torch_decode import projection_groups

        packed_layers(model, projection_groups(model))
    if where != "cpu":
        model = model.to(where)
    tok, add_bos = tokenizer_of(directory)
    context = context_length(model.config) or 2048
    return LoadedModel(model, tok, str(directory), int(context), add_bos)


QUANTIZE = ("none", "bf16", "int8", "int4")  # the torch backend's --quantize


def check_quantize(quantize: str) -> None:
    if quantize not in QUANTIZE:
        raise SparklmError(f"--quantize {quantize} applies to --backend llama.cpp",
                           hint="the torch backend takes none, bf16, int8 or int4")


def tokenizer_of(directory: Path) -> tuple[object, bool]:
    """A model directory's tokenizer, and whether prompts start with BOS: the tokenizer's own convention (sparklm
    saves a tokenizer that adds BOS exactly when training did)."""
    from ..data.tokenizer import hf_tokenizer

    tok = hf_tokenizer(directory)
    bos = tok.bos_token_id
    return tok, bos is not None and bos != tok.eos_token_id and tok("a")["input_ids"][:1] == [bos]


def inference_device(setting: str, *, cpu_only: bool = False) -> str:
    """Where inference runs: ``setting`` ("auto": CUDA where torch sees a GPU, unless ``cpu_only``: the quantized
    layers are CPU kernels), checked."""
    import torch

    if setting == "cpu" or (setting == "auto" and (cpu_only or not torch.cuda.is_available())):
        return "cpu"
    if setting == "auto":
        return "cuda"
    if not setting.startswith("cuda"):
        raise SparklmError(f"device {setting!r}: use cpu, cuda, cuda:N or auto", hint="--device auto")
    if not torch.cuda.is_available():
        raise SparklmError(f"device {setting}: torch sees no CUDA GPU here",
                           hint="install a CUDA build of torch (docs/gpus.md), or --device cpu")
    if cpu_only:
        raise SparklmError("--quantize int8 and int4 run on the CPU only", hint="--device cpu, or --quantize none on a GPU")
    return setting


def token_ids(lm: LoadedModel, text: str) -> list[int]:
    """The ids the model sees for ``text``: its tokenizer's, with BOS first where training put it."""
    ids = lm.tokenizer(text, add_special_tokens=True)["input_ids"]
    bos = lm.tokenizer.bos_token_id
    return [bos, *ids] if lm.add_bos and ids[:1] != [bos] else ids


def encode(lm: LoadedModel, prompt: str, max_new_tokens: int) -> tuple[list[int], bool]:
    """Token ids of a prompt, cut from the left so that prompt + new tokens fit the context."""
    if not prompt.strip():
        raise SparklmError("empty prompt", hint="give --prompt some text (or a non-empty line per prompt in --prompt-file)")
    if (at := surrogate(prompt)) >= 0:
        raise SparklmError(f"the prompt holds half a UTF-16 pair (U+{ord(prompt[at]):04X} at character {at + 1}), "
                           "which no tokenizer takes",
                           hint="fix the prompt's text (bytes that were not UTF-8, or a JSON escape such as \\ud800)")
    if max_new_tokens >= lm.context:
        raise SparklmError(f"--max-new-tokens {max_new_tokens} does not fit the model's context of {lm.context} tokens",
                           hint=f"use at most {lm.context - 1}")
    ids = token_ids(lm, prompt)
    keep = lm.context - max_new_tokens
    return (ids[-keep:], True) if len(ids) > keep else (ids, False)


def generate(lm: LoadedModel, prompts: list[str], *, sampling: Sampling = Sampling(), keys: list[int] | None = None,
             batch_size: int = 8, show_top: int = 0, on_text: Callable[[int, str], None] | None = None,
             warn: bool = True) -> list[Generation]:
    """``sampling.num_samples`` continuations of every prompt; ``on_text(row, piece)`` streams text."""
    sampling = sampling.fitted(lm.context)  # a default fits the model; a value the user chose may not
    keys = list(range(len(prompts))) if keys is None else list(keys)
    rows = []  # (key, sample, prompt, ids, truncated)
    for key, prompt in zip(keys, prompts):
        ids, truncated = encode(lm, prompt, sampling.max_new_tokens)
        if truncated and warn:
            progress.warn(f"prompt {key} is longer than the context: kept its last {len(ids)} tokens")
        rows += [(key, s, prompt, ids, truncated) for s in range(sampling.num_samples)]
    out: list[Generation | None] = [None] * len(rows)
    batch_size = min(batch_size, getattr(lm.model, "max_batch", batch_size))  # llama.cpp: one row at a time
    # Prompts of like length batch together (less left padding to compute); a row's text does not depend on its
    # batch (its own generator, its own mask), and the results come back in the prompts' order.
    order = bucketed(rows, batch_size)
    for start in range(0, len(rows), batch_size):
        picked = order[start:start + batch_size]
        batch = [rows[i] for i in picked]
        gens = [row_generator(sampling.seed, key, s) for key, s, *_ in batch]
        stream = (lambda i, piece, where=picked: on_text(where[i], piece)) if on_text else None
        ids, tops = _generate_batch(lm, [r[3] for r in batch], sampling, gens, show_top, stream)
        for i, (key, s, prompt, prompt_ids, truncated), new, top in zip(picked, batch, ids, tops):
            text = continuation(lm.tokenizer, lead_of(lm.tokenizer, prompt_ids), new)
            out[i] = Generation(key, s, prompt, text, new, len(prompt_ids), truncated, top)
    return out


# prompt tokens decoded with the new ones: enough to give the first new token its joining (a word's space)
_LEAD = 8


def lead_of(tok, prompt_ids: list[int]) -> tuple[list[int], str]:
    """The prompt's last tokens and their text: what a continuation is decoded after (once per prompt)."""
    ids = list(prompt_ids[-_LEAD:])
    return ids, tok.decode(ids, skip_special_tokens=True)


def continuation(tok, lead: tuple[list[int], str], new_ids: list[int]) -> str:
    """The text of ``new_ids`` as it reads on from the prompt: the prompt's last tokens (``lead``) and the new ones
    decoded together, less the prompt's part (HF's text-generation pipeline does the same with the whole prompt).
    Decoded alone, a SentencePiece-style token (Llama 2, Mistral, Gemma) loses its leading space and a WordPiece one
    keeps its "##"."""
    ids, before = lead
    text = tok.decode(ids + list(new_ids), skip_special_tokens=True)
    return text[len(before):] if text.startswith(before) else tok.decode(list(new_ids), skip_special_tokens=True)


def bucketed(rows: list[tuple], batch_size: int) -> list[int]:
    """The order rows are generated in: by prompt length (stable) when there is more than one batch, so that each
    batch pads its prompts to a length near theirs; as given otherwise (one batch pads to its longest either way)."""
    if len(rows) <= batch_size:
        return list(range(len(rows)))
    return sorted(range(len(rows)), key=lambda i: len(rows[i][3]))


class Decoder(Protocol):
    """A backend as generation drives it: every row's next-token logits, as one float32 (B, V) array (which may be a
    view of the backend's own buffer, valid until its next call)."""

    def start(self, ids: np.ndarray, mask: np.ndarray, new_tokens: int) -> np.ndarray:
        """The prompts (B, T), left-padded (``mask`` 0 on padding), before at most ``new_tokens`` more: the logits
        after each row's last token."""

    def extend(self, chosen: np.ndarray) -> np.ndarray:
        """One more token per row (B,): the logits after it."""


def decoder(model) -> Decoder:
    """``model`` as a Decoder: a backend that is one already (llama.cpp, ONNX), a Llama-family model on the CPU
    (``torch_decode.LlamaDecoder``: the same logits with less overhead per step), or any other torch causal LM."""
    if hasattr(model, "extend"):
        return model
    from . import torch_decode  # torch: imported by the torch backend only

    return torch_decode.LlamaDecoder(model) if torch_decode.supports(model) else torch_decode.TorchDecoder(model)


def _generate_batch(lm: LoadedModel, prompts: list[list[int]], sampling: Sampling, gens: list[np.random.Generator],
                    show_top: int, stream) -> tuple[list[list[int]], list[list]]:
    tok = lm.tokenizer
    eos = tok.eos_token_id
    pad = tok.pad_token_id if tok.pad_token_id is not None else (eos if eos is not None else 0)
    vocab = len(tok)
    b, t = len(prompts), max(len(p) for p in prompts)
    ids = np.full((b, t), pad, dtype=np.int64)
    mask = np.zeros((b, t), dtype=np.int64)
    for i, p in enumerate(prompts):  # left padding: every row's last prompt token is at the end
        ids[i, t - len(p):] = p
        mask[i, t - len(p):] = 1
    previous = np.where(mask == 0, -1, ids)  # for the repetition penalty
    dec = decoder(lm.model)
    logits = dec.start(ids, mask, sampling.max_new_tokens)
    new: list[list[int]] = [[] for _ in range(b)]
    tops: list[list] = [[] for _ in range(b)]
    texts = [""] * b
    leads = [lead_of(tok, p) for p in prompts] if stream else []
    done = np.zeros(b, dtype=bool)
    for step in range(sampling.max_new_tokens):
        # a copy: the masks below must not write into a backend's buffer, which its next step overwrites (llama.cpp)
        logits = np.array(logits, dtype=np.float32)
        if logits.shape[-1] > vocab:  # embedding rows beyond the tokenizer (rounded-up tables) are never text
            logits[:, vocab:] = -np.inf
        if step < sampling.min_new_tokens and eos is not None:
            logits[:, eos] = -np.inf
        chosen = next_tokens(logits, sampling, gens, previous)
        if show_top:
            probs = softmax(logits)
            top_ids = np.argsort(-probs, axis=-1, kind="stable")[:, :show_top]
        for i in range(b):
            if done[i]:
                continue
            new[i].append(int(chosen[i]))
            if show_top:
                tops[i].append([(tok.decode([int(j)]), float(probs[i, j])) for j in top_ids[i]])
            if stream:
                text = continuation(tok, leads[i], new[i])
                if len(text) > len(texts[i]) and not text.endswith("\ufffd"):  # whole characters only
                    stream(i, text[len(texts[i]):])
                    texts[i] = text
        if eos is not None:
            done |= chosen == eos
        if bool(done.all()):
            break
        chosen = np.where(done, pad, chosen)  # finished rows only feed padding (as HF generate does)
        previous = np.concatenate([previous, chosen[:, None]], axis=1)
        logits = dec.extend(chosen)
    return new, tops
