"""``generate --backend llama.cpp``: the model exported to GGUF once (cached by content) and decoded by llama.cpp.

llama.cpp (through ``llama-cpp-python``, the extra ``sparklm[llamacpp]``) is a runtime made for decoding on a CPU:
on SmolLM2-135M it decodes ~6× faster than torch and, once exported, starts without importing torch or
transformers (BENCHMARKS.md). sparklm keeps what it owns: the tokenizer (its ids go to llama.cpp as they are, so both
sides see the same tokens), the sampling (seeded per row, the same code as the torch backend) and the outputs.
llama.cpp supplies the next-token logits of a batch of rows, keeping their KV cache.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import weakref
from pathlib import Path

import numpy as np

from ..config import StorageConfig
from ..infra import redact
from ..infra.cache import cache_dir
from ..infra.errors import SparklmError
from ..infra.fs import CHECKSUMS, staged_cache

FORMAT = 2  # bump when the export changes what it writes: cached files of older versions are then not reused


class LlamaCppModel:
    """llama.cpp as generation's Decoder: up to ``max_batch`` rows decoded together, one llama.cpp sequence each.

    Driven through llama-cpp-python's low-level API (its ``Llama`` class holds one sequence): a batch of rows is one
    ``llama_decode`` per step, the rows' tokens side by side, which on 2 cores decodes 8 rows ~3× faster in all
    than one after another. The KV cache is sized to what a batch needs (rows × (prompt + new tokens)), made again
    only when a later batch needs more rows or tokens."""

    def __init__(self, path: Path, context: int, threads: int = 0, max_batch: int = 8):
        api = self.api = _module()
        # llama.cpp's own log off: the binding maps llama.cpp's levels one step off (its warnings arrive as errors,
        # e.g. "special_eos_id is not in special_eog_ids" for any EOS text llama.cpp does not know by name);
        # a failure here is raised as sparklm's own line instead
        logging.getLogger("llama-cpp-python").setLevel(logging.CRITICAL)
        _backend_init(api)
        self.threads = threads or os.cpu_count() or 1
        self.context, self.max_batch, self.cells, self.rows = context, max_batch, 0, 0
        # freed by a finaliser, which also runs at exit before the interpreter tears its modules down
        self.res: dict = {"model": api.llama_model_load_from_file(str(path).encode(), api.llama_model_default_params())}
        weakref.finalize(self, _free, api, self.res)
        if not self.res["model"]:
            raise SparklmError(f"llama.cpp cannot read {path}", hint="delete it to export the model again")
        self.n_vocab = api.llama_vocab_n_tokens(api.llama_model_get_vocab(self.res["model"]))

    def start(self, ids: np.ndarray, mask: np.ndarray, new_tokens: int = 0) -> np.ndarray:
        rows = [row[m.astype(bool)] for row, m in zip(ids, mask)]
        self._fit(len(rows), max(len(r) for r in rows) + new_tokens)
        self.api.llama_memory_clear(self.api.llama_get_memory(self.res["ctx"]), True)
        self.pos = np.array([len(r) for r in rows])
        return self._decode([(int(t), k, s, k == len(r) - 1) for s, r in enumerate(rows) for k, t in enumerate(r)])

    def extend(self, chosen: np.ndarray) -> np.ndarray:
        entries = [(int(t), int(p), s, True) for s, (t, p) in enumerate(zip(chosen, self.pos))]
        self.pos = self.pos + 1
        return self._decode(entries)

    def _fit(self, rows: int, length: int) -> None:
        """A context holding ``rows`` sequences of ``length`` tokens (rounded up to 256, at most the model's context):
        the one there, or a larger one (a one-prompt command holds one sequence's cache, not ``max_batch``'s)."""
        if rows > self.max_batch:
            raise ValueError(f"{rows} rows in one batch: this llama.cpp model decodes at most {self.max_batch}")
        cells = min(-(-length // 256) * 256, -(-self.context // 256) * 256)
        if cells <= self.cells and rows <= self.rows:
            return
        api = self.api
        _free(api, self.res, keep_model=True)
        self.cells, self.rows = max(cells, self.cells), max(rows, self.rows)
        params = api.llama_context_default_params()
        params.n_ctx = params.n_batch = self.cells * self.rows
        params.n_seq_max, params.kv_unified = self.rows, False  # each row its own cells
        params.n_threads = params.n_threads_batch = self.threads
        self.res["ctx"] = api.llama_init_from_model(self.res["model"], params)
        if not self.res["ctx"]:
            self.cells = self.rows = 0  # nothing held: the next batch tries again
            raise SparklmError(f"llama.cpp could not allocate a context of {params.n_ctx} tokens",
                               hint="lower --batch-size or --max-new-tokens")
        self.res["batch"] = api.llama_batch_init(params.n_batch, 0, 1)

    def _decode(self, entries: list[tuple[int, int, int, bool]]) -> np.ndarray:
        """One llama_decode of ``entries`` (token, position, row, wants logits); the logits asked for, in order."""
        batch = self.res["batch"]
        batch.n_tokens = len(entries)
        for j, (token, pos, row, logits) in enumerate(entries):
            batch.token[j], batch.pos[j], batch.logits[j] = token, pos, logits
            batch.n_seq_id[j], batch.seq_id[j][0] = 1, row
        code = self.api.llama_decode(self.res["ctx"], batch)
        if code != 0:  # 1: no room in the KV cache, which _fit sized; <0: llama.cpp failed
            raise SparklmError(f"llama.cpp could not decode a batch of {len(entries)} tokens (llama_decode {code})",
                               hint="lower --batch-size, or use --backend torch")
        n = sum(e[3] for e in entries)
        # a view of llama.cpp's output buffer, one row per token that asked; the generation loop copies it before the
        # next decode overwrites it
        return np.ctypeslib.as_array(self.api.llama_get_logits(self.res["ctx"]), shape=(n, self.n_vocab))


def load(path: str, *, threads: int = 0, quantize: str = "none", storage: StorageConfig | None = None,
         batch_size: int = 8):
    """A LoadedModel whose model is llama.cpp running ``path`` (a sparklm run or HF directory) exported to GGUF with
    ``quantize`` (none: f32, f16, bf16, q8_0, q4_0 or q4_1), the export made once and kept in sparklm's cache;
    ``batch_size``: the most rows it decodes together.

    Once exported, loading imports neither torch nor transformers (~2 s and ~3 s on a small CPU): the export's
    info.json holds the context, and the tokenizer is read with ``tokenizers`` alone where the export found it to
    give transformers' ids and texts."""
    from .generate import LoadedModel, model_dir, tokenizer_of
    from .gguf_export import GGUF_FILE, checked_quant

    _module()
    quant = checked_quant(quantize, "--backend llama.cpp")
    directory = model_dir(path, storage)
    target = cached_export(str(path), directory, quant, storage)
    info = json.loads((target / "info.json").read_text())
    if info.get("plain_tokenizer"):
        tok, add_bos = PlainTokenizer(directory), bool(info["add_bos"])
    else:
        tok, add_bos = tokenizer_of(directory)
    context = int(info["context"])  # the KV cache is sized to each batch's need, not to this
    model = LlamaCppModel(target / GGUF_FILE, context, threads, max_batch=max(1, batch_size))
    return LoadedModel(model, tok, str(directory), context, add_bos)


def cached_export(path: str, directory: Path, quant: str, storage: StorageConfig | None) -> Path:
    """The cache directory holding ``directory`` exported to GGUF, keyed by its files' content and ``quant``; exported
    on first use (the torch model loaded once for it)."""
    from .generate import load as load_torch
    from .gguf_export import checked_arch, write_gguf

    target = cache_dir("gguf", f"{content_key(directory)[:24]}-{quant}-v{FORMAT}")
    if not (target / "info.json").is_file():
        from transformers import AutoConfig

        from ..infra import progress

        try:
            cfg = AutoConfig.from_pretrained(str(directory), local_files_only=True, trust_remote_code=False)
        except Exception as e:
            raise SparklmError(f"cannot load the model in {path}: {' '.join(str(e).split())[:200]}") from None
        try:  # from the config, before the model loads; export's own hint (--format onnx) is not a `generate` user's
            checked_arch(cfg)
        except SparklmError as e:
            raise SparklmError(f"--backend llama.cpp runs the models GGUF export writes: {e.message}",
                               hint="--backend torch runs this model") from None
        progress.info(f"exporting {path} to GGUF ({quant}) for llama.cpp, once: {target}")
        lm = load_torch(path, storage=storage, device="cpu")
        with staged_cache(target, marker="info.json") as tmp:
            info = write_gguf(lm, tmp, quant)
            info["plain_tokenizer"] = plain_tokenizer_agrees(directory, lm.tokenizer)
            (tmp / "info.json").write_text(json.dumps(redact.mapping(info), indent=2))
    return target


# Texts the plain tokenizer must encode and decode as transformers does before it stands in for it: spaces and
# newlines in runs, digits, punctuation, accents, scripts without spaces, emoji, and text that names special tokens.
PROBES = ("Hello, world!", "  two  spaces\n\nand\tTabs ", "Numbers 12345 and 3.14159", "naïve café — «quoted»",
          "東京は日本の首都です。", "Москва, Ελληνικά", "emoji 🙂🚀 end", "don't won't y'all", "a", " ", "\n",
          "<|endoftext|> <s> </s> <|im_start|>user", "spaced , out . words ! ? 's n't 'm 've 're", "x " * 40)


class PlainTokenizer:
    """A model directory's tokenizer.json read by ``tokenizers`` alone (no transformers import), with the part of
    transformers' tokenizer API that generation uses. Used only where the export checked that it gives
    transformers' ids and texts (``plain_tokenizer_agrees``)."""

    def __init__(self, directory: Path):
        from tokenizers import Tokenizer

        self.tok = Tokenizer.from_file(str(directory / "tokenizer.json"))
        special = special_tokens(directory)
        self.bos_token_id, self.eos_token_id, self.pad_token_id = (
            None if special.get(name) is None else self.tok.token_to_id(special[name]) for name in ("bos", "eos", "pad"))

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
        return {"input_ids": self.tok.encode(text, add_special_tokens=add_special_tokens).ids}

    def __len__(self) -> int:
        return self.tok.get_vocab_size(with_added_tokens=True)

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_tokens_to_ids(self, token: str) -> int | None:
        return self.tok.token_to_id(token)


def special_tokens(directory: Path) -> dict[str, str | None]:
    """The bos, eos and pad tokens' texts as transformers finds them: tokenizer_config.json, then
    special_tokens_map.json (a token may be a string or a dict with its ``content``)."""
    found: dict[str, str | None] = {}
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        try:
            config = json.loads((directory / name).read_text())
        except (OSError, ValueError):
            continue
        for key in ("bos", "eos", "pad"):
            value = config.get(f"{key}_token")
            if key not in found and value is not None:
                found[key] = value.get("content") if isinstance(value, dict) else value
    return found


def plain_tokenizer_agrees(directory: Path, hf) -> bool:
    """Whether ``PlainTokenizer(directory)`` gives what transformers' tokenizer ``hf`` gives: the special ids, the
    vocabulary's size, the ids of every probe (special tokens added) and their texts decoded both ways."""
    try:
        plain = PlainTokenizer(directory)
    except Exception:  # no tokenizer.json, or one tokenizers cannot read: transformers' own then
        return False
    if any(getattr(plain, k) != getattr(hf, k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")):
        return False
    if len(plain) != len(hf):
        return False
    for text in PROBES:
        ids = hf(text, add_special_tokens=True)["input_ids"]
        if plain(text)["input_ids"] != ids:
            return False
        if any(plain.decode(ids, skip_special_tokens=skip) != hf.decode(ids, skip_special_tokens=skip)
               for skip in (True, False)):
            return False
    return True


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


def _free(api, res: dict, keep_model: bool = False) -> None:
    """Free what ``res`` holds of llama.cpp's (batch, context, and the model unless ``keep_model``)."""
    if res.get("batch") is not None:
        api.llama_batch_free(res.pop("batch"))
    if res.get("ctx"):
        api.llama_free(res.pop("ctx"))
    if not keep_model and res.get("model"):
        api.llama_model_free(res.pop("model"))


@functools.cache
def _backend_init(api) -> None:
    api.llama_backend_init()  # once per process, as llama-cpp-python's Llama does


def _module():
    try:
        import llama_cpp
    except ImportError:
        raise SparklmError("--backend llama.cpp needs the llama-cpp-python package",
                           hint="pip install 'sparklm[llamacpp]' (it builds llama.cpp for this CPU: a few minutes)"
                           ) from None
    return llama_cpp
