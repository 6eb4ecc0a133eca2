"""GGUF export: a Llama-family causal LM (sparklm's own, an HF directory, a merged LoRA run) as one llama.cpp file.

GGUF is what llama.cpp, ollama and llama-cpp-python load; decoding on a CPU is their strength. The ``gguf``
package (llama.cpp's own Python writer) lays out the file and packs its blocks (Q8_0, Q4_0, Q4_1); this module
says what goes in it: the architecture's hyperparameters under llama.cpp's key names, the tensors under its names
and layout, and the tokenizer. Only what llama.cpp reads the same way is written: a model or tokenizer it would
read differently (another architecture, RoPE scaling, biases, an unknown pre-tokenizer) is refused with one line.

Layout: llama.cpp applies RoPE to interleaved pairs of a head's dimensions, transformers to its two halves, so
each head's rows of the query and key projections are reordered (Qwen3 rotates halves in both: no reorder).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from ..config import StorageConfig
from ..infra import redact
from ..infra.errors import SparklmError
from ..infra.fs import listing, staged_dir

GGUF_FILE = "model.gguf"
MARKER = "sparklm_export.json"  # the same marker as the ONNX export: --overwrite replaces only our own exports
# each --quantize: the GGML type of its matrices and the file type the file declares (names in the gguf package)
_TYPES = {"f32": ("F32", "ALL_F32"), "f16": ("F16", "MOSTLY_F16"), "bf16": ("BF16", "MOSTLY_BF16"),
          "q8_0": ("Q8_0", "MOSTLY_Q8_0"),
          "q4_0": ("Q4_0", "MOSTLY_Q4_0"), "q4_1": ("Q4_1", "MOSTLY_Q4_1")}
QUANTS = tuple(_TYPES)
ARCHS = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}
_BIASED = {"qwen2": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")}  # the biases each arch reads
# A probe that tells pre-tokenizers apart: contractions, digits, runs of spaces, punctuation, letters beyond ASCII.
_PROBE = "Hello world!  It's 2026: 3.14159 apples,\n\n  don't   you'll café Ωmega\t123456 x=y+1 ...?"


def export_gguf(model: str, output: str, *, quantize: str = "f32", overwrite: bool = False,
                storage: StorageConfig | None = None) -> dict:
    """Write ``output``/model.gguf (and a marker listing it); returns what was written. ``quantize``: f32, f16,
    bf16, q8_0, q4_0 or q4_1 for the matrices (vectors stay f32; the embedding stays at 8 bits or more, as it is also the
    output layer when tied). A LoRA adapter is merged into its base first."""
    from .export import export_dir
    from .generate import load

    quantize = checked_quant(quantize, "--format gguf")
    out = export_dir(output, overwrite)
    lm = load(model, storage=storage, device="cpu")
    with staged_dir(str(out), marker=MARKER) as tmp:
        info = write_gguf(lm, tmp, quantize)
        (tmp / MARKER).write_text(json.dumps(redact.mapping({**info, "files": listing(tmp)}), indent=2))
    return {**info, "path": str(out), "bytes": (out / GGUF_FILE).stat().st_size}


def checked_quant(quantize: str, where: str) -> str:
    """``quantize`` as one of :data:`QUANTS` ("none" is f32), or one line naming ``where`` it was given."""
    quant = "f32" if quantize == "none" else quantize
    if quant not in QUANTS:
        raise SparklmError(f"--quantize {quantize} for {where}: use one of {', '.join(QUANTS)}")
    return quant


def write_gguf(lm, directory: Path, quantize: str) -> dict:
    """``lm`` (a :class:`~sparklm.infer.generate.LoadedModel` on the CPU) as ``directory``/model.gguf; returns what
    was written."""
    import gguf

    cfg = lm.model.config
    arch = checked_arch(cfg)
    tensors = gguf_tensors({n: t.detach().float().numpy() for n, t in lm.model.state_dict().items()}, cfg, arch)
    tokens = vocabulary(lm.tokenizer, cfg.vocab_size)
    w = gguf.GGUFWriter(str(directory / GGUF_FILE), arch)
    w.add_name(Path(lm.path).name)
    _hyperparameters(w, cfg, arch, lm.context, quantize)
    _tokenizer(w, lm, tokens)
    for name, array in tensors.items():
        data, kind = encode(name, array, quantize)
        # f32/f16 are typed by their numpy dtype; bf16 and packed blocks carry their type (the shape follows from it)
        w.add_tensor(name, data, raw_dtype=None if kind in (0, 1) else gguf.GGMLQuantizationType(kind))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return {"format": "gguf", "quantize": quantize, "source": lm.path, "arch": arch, "context": lm.context,
            "add_bos": lm.add_bos, "pre_tokenizer": tokens["pre"]}


def checked_arch(cfg) -> str:
    """llama.cpp's name for the model's architecture (``cfg``: its transformers config), the config checked for what
    llama.cpp would read otherwise."""
    names = [a for a in (cfg.architectures or []) if a in ARCHS]
    if not names:
        raise SparklmError(f"--format gguf writes Llama, Qwen2 and Qwen3 models; this one is {cfg.architectures}",
                           hint="export it with --format onnx (any model); llama.cpp reads models trained with "
                           "model.arch = \"llama\" (the default) or fine-tuned from a Llama or Qwen")
    rope = getattr(cfg, "rope_scaling", None) or {}
    kind = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else "default"
    if kind not in ("default", None):
        raise SparklmError(f"--format gguf: RoPE scaling {kind!r} is not exported",
                           hint="export with --format onnx, or a model without rope_scaling")
    if getattr(cfg, "attention_bias", False) or getattr(cfg, "mlp_bias", False):
        raise SparklmError("--format gguf: attention or MLP biases are not exported", hint="export with --format onnx")
    if getattr(cfg, "use_sliding_window", False):
        raise SparklmError("--format gguf: a sliding attention window is not exported", hint="export with --format onnx")
    return ARCHS[names[0]]


def rope_theta(cfg) -> float:
    """RoPE's base: transformers 5 keeps it in ``rope_parameters``, earlier versions on the config."""
    params = getattr(cfg, "rope_parameters", None)
    if isinstance(params, dict) and "rope_theta" in params:
        return float(params["rope_theta"])
    return float(getattr(cfg, "rope_theta", 10000.0))


def head_dim(cfg) -> int:
    return int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)


def gguf_tensors(state: dict[str, np.ndarray], cfg, arch: str) -> dict[str, np.ndarray]:
    """An HF state dict (float32) as llama.cpp's tensors: its names, the query and key rows reordered for its RoPE
    (llama), the output layer only where it is not the embedding, the biases the arch has (Qwen2's query, key and
    value). Pure."""
    heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads or cfg.num_attention_heads
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    layer = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
             "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate",
             "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    tied = bool(getattr(cfg, "tie_word_embeddings", False))
    out = {}
    for name, array in state.items():
        if name == "lm_head.weight" and tied:
            continue
        if name in names:
            out[names[name]] = array
            continue
        parts = name.split(".")  # model.layers.N.<module>.<...>.weight
        module = ".".join(parts[3:-1])
        kind = parts[-1]
        if parts[:2] != ["model", "layers"] or module not in layer or (
                kind != "weight" and not (kind == "bias" and module in _BIASED.get(arch, ()))):
            raise SparklmError(f"--format gguf: no llama.cpp tensor for {name}", hint="export with --format onnx")
        if arch == "llama" and module in ("self_attn.q_proj", "self_attn.k_proj"):
            array = interleave_rope(array, heads if module == "self_attn.q_proj" else kv)
        out[f"blk.{parts[2]}.{layer[module]}.{kind}"] = array
    return out


def interleave_rope(w: np.ndarray, heads: int) -> np.ndarray:
    """Each head's rows in RoPE's pair order: transformers rotates dimension i with i + d/2, llama.cpp with i + 1, so
    rows (0, d/2, 1, d/2 + 1, ...) of a head become its rows (0, 1, 2, 3, ...)."""
    rows = w.shape[0] // heads
    return w.reshape(heads, 2, rows // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def encode(name: str, array: np.ndarray, quantize: str) -> tuple[np.ndarray, int]:
    """The tensor's bytes and GGML type: vectors in f32; matrices as asked where their rows fill whole blocks (else
    f16); the embedding at 8 bits at least."""
    import gguf

    kinds = gguf.GGMLQuantizationType
    if array.ndim < 2 or quantize == "f32":
        return np.ascontiguousarray(array, np.float32), kinds.F32
    want = kinds[_TYPES[quantize][0]]
    if name == "token_embd.weight" and want in (kinds.Q4_0, kinds.Q4_1):
        want = kinds.Q8_0
    block = gguf.GGML_QUANT_SIZES[want][0]
    if want == kinds.F16 or array.shape[-1] % block:
        return np.ascontiguousarray(array, np.float16), kinds.F16
    return gguf.quants.quantize(np.ascontiguousarray(array, np.float32), want), want


def _hyperparameters(w, cfg, arch: str, context: int, quantize: str) -> None:
    import gguf

    w.add_context_length(int(context))
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads or cfg.num_attention_heads)
    w.add_layer_norm_rms_eps(float(cfg.rms_norm_eps))
    w.add_rope_freq_base(rope_theta(cfg))
    w.add_rope_dimension_count(head_dim(cfg))
    if head_dim(cfg) * cfg.num_attention_heads != cfg.hidden_size or arch == "qwen3":
        w.add_key_length(head_dim(cfg))
        w.add_value_length(head_dim(cfg))
    w.add_vocab_size(cfg.vocab_size)
    w.add_file_type(gguf.LlamaFileType[_TYPES[quantize][1]])
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)


def vocabulary(tokenizer, rows: int) -> dict:
    """The tokenizer as GGUF's ``gpt2`` (byte-level BPE) model: tokens by id padded to the embedding's ``rows``, their
    types, the merges and llama.cpp's name of the pre-tokenizer. One line where llama.cpp would split text otherwise."""
    import gguf

    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    model = spec.get("model") or {}
    if model.get("type") != "BPE" or (spec.get("decoder") or {}).get("type") != "ByteLevel":
        raise SparklmError("--format gguf exports byte-level BPE tokenizers; this one is "
                           f"{model.get('type')} with a {(spec.get('decoder') or {}).get('type')} decoder",
                           hint="export with --format onnx")
    # NFC (Qwen's) is let through, as llama.cpp's own converter does: llama.cpp does not normalize, which changes
    # nothing for text already composed (nearly all text)
    if spec.get("normalizer") and spec["normalizer"].get("type") != "NFC":
        raise SparklmError(f"--format gguf: the tokenizer's normalizer ({spec['normalizer'].get('type')}) has no "
                           "llama.cpp counterpart", hint="export with --format onnx")
    pre = pre_tokenizer_name(tokenizer.backend_tokenizer)
    vocab = dict(model["vocab"])
    added = {t["id"]: t for t in spec.get("added_tokens") or []}
    size = max([rows, *(i + 1 for i in vocab.values()), *(i + 1 for i in added)])
    if size > rows:
        raise SparklmError(f"--format gguf: the tokenizer has ids up to {size - 1} but the model only {rows} rows",
                           hint="the model and tokenizer do not belong together")
    kinds = gguf.TokenType
    tokens = [f"[PAD{i}]" for i in range(rows)]
    types = [kinds.UNUSED] * rows
    for text, i in vocab.items():
        tokens[i], types[i] = text, kinds.NORMAL
    for i, t in added.items():
        tokens[i], types[i] = t["content"], kinds.CONTROL if t.get("special") else kinds.USER_DEFINED
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges") or []]
    return {"tokens": tokens, "types": [int(t) for t in types], "merges": merges, "pre": pre}


def pre_tokenizer_name(backend) -> str:
    """llama.cpp's name for the way ``backend`` (a ``tokenizers.Tokenizer``) splits text before BPE, found by
    splitting a probe as each candidate does (llama.cpp knows pre-tokenizers by name, not by definition)."""
    from tokenizers import pre_tokenizers as pt

    candidates = {
        "gpt-2": pt.ByteLevel(add_prefix_space=False, use_regex=True),  # sparklm's own tokenizers
        "smollm": pt.Sequence([pt.Digits(individual_digits=True), pt.ByteLevel(add_prefix_space=False)]),
        "llama-bpe": _split_then_bytes(_LLAMA3_SPLIT),  # Llama 3's
        "qwen2": _split_then_bytes(_LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")),  # Qwen2's, Qwen2.5's, Qwen3's
    }
    ours = backend.pre_tokenizer
    if ours is None:
        raise SparklmError("--format gguf: the tokenizer has no pre-tokenizer", hint="export with --format onnx")
    mine = [s for s, _ in ours.pre_tokenize_str(_PROBE)]
    for name, candidate in candidates.items():
        if [s for s, _ in candidate.pre_tokenize_str(_PROBE)] == mine:
            return name
    raise SparklmError("--format gguf: the tokenizer splits text in a way llama.cpp has no name for "
                       f"(known: {', '.join(candidates)})", hint="export with --format onnx")


# Llama 3's split before its byte-level BPE, as its tokenizer.json has it (Qwen's takes digits one at a time)
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                 r"\s*[\r\n]+|\s+(?!\S)|\s+")


def _split_then_bytes(pattern: str):
    from tokenizers import Regex
    from tokenizers import pre_tokenizers as pt

    return pt.Sequence([pt.Split(Regex(pattern), behavior="isolated"),
                        pt.ByteLevel(add_prefix_space=False, use_regex=False)])


def _tokenizer(w, lm, tokens: dict) -> None:
    tok = lm.tokenizer
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(tokens["pre"])
    w.add_token_list(tokens["tokens"])
    w.add_token_types(tokens["types"])
    w.add_token_merges(tokens["merges"])
    for setter, value in ((w.add_bos_token_id, tok.bos_token_id), (w.add_eos_token_id, tok.eos_token_id),
                          (w.add_pad_token_id, tok.pad_token_id), (w.add_unk_token_id, tok.unk_token_id)):
        if value is not None:
            setter(int(value))
    w.add_add_bos_token(bool(lm.add_bos))
    w.add_add_eos_token(False)
    if getattr(tok, "chat_template", None):
        w.add_chat_template(tok.chat_template)
