"""GGUF export: a tiny Llama/Qwen2/Qwen3 written by sparklm and read back by transformers' own GGUF reader (through
sparklm's import) gives the same logits and the same tokens; quantized files keep their blocks; what llama.cpp
would read differently is refused with one line."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from sparklm.infer import gguf_export  # noqa: E402
from sparklm.infra.errors import SparklmError  # noqa: E402
from sparklm.model import gguf as gguf_import  # noqa: E402

TEXTS = ["The quick brown fox jumps over the lazy dog.", "Spark splits the data; 1234 executors train!",
         "  leading spaces, café, and 3.14159", "It's what you'll see: x=y+1 ...?"]
SPECIALS = ["<|endoftext|>", "<|pad|>"]


def _tokenizer(pre=None):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre or pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(TEXTS * 8, trainer)
    return tok


def _model_dir(path, *, arch="llama", tied=False, pre=None, rows=None):
    """An HF model directory: a random model (every weight random, norms included) and a BPE tokenizer whose
    vocabulary is smaller than the embedding (rows padded to a multiple of 64, as sparklm builds them)."""
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    tok = _tokenizer(pre)
    rows = rows or -(-tok.get_vocab_size() // 64) * 64
    torch.manual_seed(0)
    common = dict(vocab_size=rows, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5, rope_theta=20000.0,
                  tie_word_embeddings=tied, bos_token_id=0, eos_token_id=0, pad_token_id=1)
    model = (Qwen3ForCausalLM(Qwen3Config(head_dim=16, **common)) if arch == "qwen3"
             else LlamaForCausalLM(LlamaConfig(**common))).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    model.save_pretrained(str(path))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|endoftext|>",
                                   pad_token="<|pad|>")
    fast.save_pretrained(str(path))
    return model, tok


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


def _read(path) -> dict:
    reader = gguf.GGUFReader(str(path / gguf_export.GGUF_FILE))
    return {t.name: t.tensor_type.name for t in reader.tensors}


def _logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


@pytest.mark.parametrize("tied", [False, True])
def test_f32_round_trip_through_transformers(tmp_path, tied):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    arch = "llama"
    original, tok = _model_dir(tmp_path / "m", tied=tied)
    info = gguf_export.export_gguf(str(tmp_path / "m"), str(tmp_path / "out"))
    assert info["arch"] == arch and info["quantize"] == "f32" and info["pre_tokenizer"] == "gpt-2"
    assert info["bytes"] == (tmp_path / "out" / gguf_export.GGUF_FILE).stat().st_size
    types = _read(tmp_path / "out")
    assert set(types.values()) == {"F32"} and ("output.weight" in types) is not tied

    back = tmp_path / "back"  # transformers' GGUF reader, as `sparklm import` uses it
    gguf_import.convert(str(tmp_path / "out" / gguf_export.GGUF_FILE), str(back))
    model = AutoModelForCausalLM.from_pretrained(str(back), local_files_only=True).eval()
    assert type(model).__name__ == type(original).__name__
    assert model.config.vocab_size == original.config.vocab_size
    ids = tok.encode(TEXTS[1]).ids
    assert torch.allclose(_logits(model, ids), _logits(original, ids), atol=1e-5)
    hf_tok = AutoTokenizer.from_pretrained(str(back), local_files_only=True)
    for text in TEXTS:
        assert hf_tok(text, add_special_tokens=False)["input_ids"] == tok.encode(text).ids
    assert hf_tok.convert_tokens_to_ids("<|pad|>") == 1


def test_a_qwen3_of_any_head_width_imports_back(tmp_path):
    """transformers' GGUF reader leaves a Qwen3 file's head width out and builds heads of 128: every model sparklm
    trains from scratch (Llama-style with QK norm, saved as Qwen3) failed to import back from its own export, and
    `generate model.gguf` with it. The import reads the width from the file."""
    from transformers import AutoModelForCausalLM

    original, tok = _model_dir(tmp_path / "m", arch="qwen3")
    gguf_export.export_gguf(str(tmp_path / "m"), str(tmp_path / "out"))
    gguf_import.convert(str(tmp_path / "out" / gguf_export.GGUF_FILE), str(tmp_path / "back"))
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "back"), local_files_only=True).eval()
    assert type(model).__name__ == "Qwen3ForCausalLM" and model.config.head_dim == 16
    ids = tok.encode(TEXTS[1]).ids
    assert torch.allclose(_logits(model, ids), _logits(original, ids), atol=1e-5)


def test_qwen3_tensors_as_llama_cpp_names_them(tmp_path):
    """transformers' GGUF reader does not read a Qwen3 head width (it assumes 128): the file is checked directly —
    the per-head norms present, queries and keys in transformers' order (Qwen3 rotates halves in llama.cpp too)."""
    original, _ = _model_dir(tmp_path / "m", arch="qwen3")
    gguf_export.export_gguf(str(tmp_path / "m"), str(tmp_path / "out"))
    reader = gguf.GGUFReader(str(tmp_path / "out" / gguf_export.GGUF_FILE))
    assert reader.fields["general.architecture"].contents() == "qwen3"
    assert reader.fields["qwen3.attention.key_length"].contents() == 16
    tensors = {t.name: np.array(t.data).reshape([int(d) for d in reversed(t.shape)]) for t in reader.tensors}
    state = original.state_dict()
    for hf, ours in (("model.layers.1.self_attn.q_proj.weight", "blk.1.attn_q.weight"),
                     ("model.layers.0.self_attn.k_norm.weight", "blk.0.attn_k_norm.weight"),
                     ("model.layers.0.mlp.down_proj.weight", "blk.0.ffn_down.weight"),
                     ("lm_head.weight", "output.weight")):
        assert np.array_equal(tensors[ours], state[hf].numpy()), ours


def test_quantized_blocks_and_accuracy(tmp_path):
    """Each matrix packed in the asked blocks (the embedding at 8 bits at least, vectors f32): read back, the logits are
    exactly those of the original model with each matrix rounded through the same blocks, so nothing was moved."""
    import copy

    from transformers import AutoModelForCausalLM

    original, tok = _model_dir(tmp_path / "m")
    ids = tok.encode(TEXTS[0]).ids
    want = _logits(original, ids)
    sizes = {}
    kinds = gguf.GGMLQuantizationType
    for quant, matrix, embed in (("f16", "F16", "F16"), ("bf16", "BF16", "BF16"), ("q8_0", "Q8_0", "Q8_0"),
                                 ("q4_1", "Q4_1", "Q8_0")):
        out = tmp_path / quant
        sizes[quant] = gguf_export.export_gguf(str(tmp_path / "m"), str(out), quantize=quant)["bytes"]
        types = _read(out)
        # ffn_down's rows are 96 long: whole blocks of 32, so quantized too
        assert {types[n] for n in types if n != "token_embd.weight" and "norm" not in n} == {matrix}
        assert types["token_embd.weight"] == embed and types["blk.1.attn_norm.weight"] == "F32"
        rounded = copy.deepcopy(original)
        with torch.no_grad():
            for name, p in rounded.named_parameters():
                if p.dim() == 2:
                    kind = kinds[embed if "embed" in name else matrix]
                    a = p.numpy().astype(np.float16 if kind == kinds.F16 else np.float32)
                    back = a if kind == kinds.F16 else gguf.quants.dequantize(gguf.quants.quantize(a, kind), kind)
                    p.copy_(torch.from_numpy(np.asarray(back, np.float32)))
        gguf_import.convert(str(out / gguf_export.GGUF_FILE), str(tmp_path / f"{quant}-back"))
        back_model = AutoModelForCausalLM.from_pretrained(str(tmp_path / f"{quant}-back"), local_files_only=True)
        got = _logits(back_model.eval(), ids)
        assert torch.allclose(got, _logits(rounded, ids), atol=1e-4), quant
        assert not torch.allclose(got, want, atol=1e-4)  # and the rounding is real
    assert sizes["q4_1"] < sizes["q8_0"] < sizes["f16"] == sizes["bf16"]


def test_interleave_rope_is_the_inverse_of_transformers_reader():
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    w = np.arange(8 * 3 * 5, dtype=np.float32).reshape(8 * 3, 5)  # 3 heads of 8 rows
    mixed = gguf_export.interleave_rope(w, 3)
    assert mixed[:, 0].tolist()[:8] == [0, 20, 5, 25, 10, 30, 15, 35]  # rows 0, 4, 1, 5, ... of head 0
    assert np.array_equal(LlamaTensorProcessor()._reverse_permute_weights(mixed, 3, 3), w)


def test_smollm_pre_tokenizer_is_named():
    from tokenizers import pre_tokenizers as pt

    backend = _tokenizer(pt.Sequence([pt.Digits(individual_digits=True), pt.ByteLevel(add_prefix_space=False)]))
    assert gguf_export.pre_tokenizer_name(backend) == "smollm"
    assert gguf_export.pre_tokenizer_name(_tokenizer()) == "gpt-2"


# The regexes Llama 3's and Qwen2's tokenizer.json split text with before their byte-level BPE (Qwen2 takes digits
# one at a time, Llama 3 up to three); both then map bytes without a regex of their own.
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                r"\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_SPLIT = LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")


def _split_then_bytes(pattern: str):
    from tokenizers import Regex
    from tokenizers import pre_tokenizers as pt

    return pt.Sequence([pt.Split(Regex(pattern), behavior="isolated"),
                        pt.ByteLevel(add_prefix_space=False, use_regex=False)])


def _qwen2_dir(path):
    """A tiny random Qwen2 (its query, key and value biases random too) with a Qwen2-style tokenizer: NFC, its split,
    byte-level BPE."""
    from tokenizers import normalizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    tok = _tokenizer(_split_then_bytes(QWEN2_SPLIT))
    tok.normalizer = normalizers.NFC()
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(
        vocab_size=-(-tok.get_vocab_size() // 64) * 64, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6,
        rope_theta=50000.0, tie_word_embeddings=True, bos_token_id=0, eos_token_id=0, pad_token_id=1)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    model.save_pretrained(str(path))
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|pad|>").save_pretrained(
        str(path))
    return model, tok


def test_llama3_and_qwen2_pre_tokenizers_are_named():
    assert gguf_export.pre_tokenizer_name(_tokenizer(_split_then_bytes(LLAMA3_SPLIT))) == "llama-bpe"
    assert gguf_export.pre_tokenizer_name(_tokenizer(_split_then_bytes(QWEN2_SPLIT))) == "qwen2"


def test_a_qwen2_runs_in_llama_cpp_and_imports_back_as_torch_computes_it(tmp_path):
    """A fine-tuned Qwen2 / Qwen2.5 (or a Qwen3 on Qwen's tokenizer: NFC, its own split) exports to GGUF: llama.cpp
    reads it with the same tokens and logits as torch, and transformers' GGUF reader imports it back."""
    pytest.importorskip("llama_cpp")
    from transformers import AutoModelForCausalLM

    from sparklm.infer.llamacpp import LlamaCppModel

    original, tok = _qwen2_dir(tmp_path / "m")
    info = gguf_export.export_gguf(str(tmp_path / "m"), str(tmp_path / "out"))
    assert info["arch"] == "qwen2" and info["pre_tokenizer"] == "qwen2"
    path = tmp_path / "out" / gguf_export.GGUF_FILE
    assert "blk.0.attn_q.bias" in _read(tmp_path / "out") and "output.weight" not in _read(tmp_path / "out")

    llama = LlamaCppModel(path, context=64, threads=1, max_batch=1)
    api, vocab = llama.api, llama.api.llama_model_get_vocab(llama.res["model"])
    for text in TEXTS:
        raw = text.encode()
        out = (api.llama_token * 256)()
        n = api.llama_tokenize(vocab, raw, len(raw), out, 256, False, False)
        assert list(out[:n]) == tok.encode(text).ids, text
    ids = np.array([tok.encode(TEXTS[1]).ids])
    got = llama.start(ids, np.ones_like(ids), 1)[0]
    want = _logits(original, ids[0].tolist())[-1].numpy()
    assert np.abs(got - want).max() <= 1e-3 * np.abs(want).max()

    gguf_import.convert(str(path), str(tmp_path / "back"))
    back = AutoModelForCausalLM.from_pretrained(str(tmp_path / "back"), local_files_only=True).eval()
    assert type(back).__name__ == "Qwen2ForCausalLM"
    assert torch.allclose(_logits(back, ids[0].tolist()), _logits(original, ids[0].tolist()), atol=1e-5)


def _one_line(e: pytest.ExceptionInfo) -> str:
    line = e.value.one_line()
    assert "\n" not in line and "Traceback" not in line
    return line


def test_refuses_what_llama_cpp_reads_otherwise(tmp_path):
    from tokenizers import pre_tokenizers as pt
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

    _model_dir(tmp_path / "split", pre=pt.Sequence([pt.WhitespaceSplit(), pt.ByteLevel(use_regex=False)]))
    with pytest.raises(SparklmError) as e:
        gguf_export.export_gguf(str(tmp_path / "split"), str(tmp_path / "o1"))
    assert "llama.cpp has no name for" in _one_line(e)

    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=320)).save_pretrained(tmp_path / "gpt2")
    PreTrainedTokenizerFast(tokenizer_object=_tokenizer()).save_pretrained(tmp_path / "gpt2")
    with pytest.raises(SparklmError) as e:
        gguf_export.export_gguf(str(tmp_path / "gpt2"), str(tmp_path / "o2"))
    assert "Llama, Qwen2 and Qwen3" in _one_line(e) and "GPT2LMHeadModel" in _one_line(e)

    _model_dir(tmp_path / "m")
    with pytest.raises(SparklmError) as e:
        gguf_export.export_gguf(str(tmp_path / "m"), str(tmp_path / "o3"), quantize="q2_k")
    assert "f32, f16, bf16, q8_0, q4_0, q4_1" in _one_line(e)
    assert not (tmp_path / "o1").exists() and not (tmp_path / "o2").exists() and not (tmp_path / "o3").exists()

    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    with pytest.raises(SparklmError) as e:
        gguf_export.export_gguf(str(tmp_path / "m"), str(mine), overwrite=True)
    assert "refusing to --overwrite" in _one_line(e) and (mine / "notes.txt").read_text() == "keep"
    first = gguf_export.export_gguf(str(tmp_path / "m"), str(tmp_path / "o4"))
    again = gguf_export.export_gguf(str(tmp_path / "m"), str(tmp_path / "o4"), overwrite=True, quantize="q8_0")
    assert again["bytes"] < first["bytes"]
    assert json.loads((tmp_path / "o4" / gguf_export.MARKER).read_text())["quantize"] == "q8_0"
