"""GGUF import: a tiny Llama written as llama.cpp's convert_hf_to_gguf.py writes it comes back exactly."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from sparklm.infra.errors import SparklmError  # noqa: E402
from sparklm.infra.fs import staged_once  # noqa: E402
from sparklm.model import gguf as gguf_import  # noqa: E402
from sparklm.model.build import load_model  # noqa: E402

SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Spark splits the data; every executor trains on its own part.",
    "Once upon a time there was a tiny language model, 1234 tokens long!",
    "GGUF files carry the weights and the tokenizer together.",
] * 4
SPECIALS = ["<|endoftext|>", "<|pad|>"]  # ids 0 and 1
N_HEAD, N_KV = 4, 2


def _tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)  # GPT-2's split, as llama.cpp's "gpt2"
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(SENTENCES, trainer)
    return tok


def _model(vocab: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=N_HEAD, num_key_value_heads=N_KV, max_position_embeddings=128,
                         rms_norm_eps=1e-5, rope_theta=50000.0, tie_word_embeddings=False,
                         bos_token_id=0, eos_token_id=0, pad_token_id=1)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # norms start at 1: randomize every tensor so a mix-up cannot go unseen
        for p in model.parameters():
            p.normal_(0.0, 0.5)
    return model


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    # llama.cpp's LlamaModel.permute: HF's rotate-half layout of q/k rows to GGML's interleaved one
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_NAMES = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
          "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
          "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def _write_gguf(path: Path, model, tok) -> None:
    cfg = model.config
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny-llama")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_rope_dimension_count(cfg.hidden_size // N_HEAD)
    w.add_head_count(N_HEAD)
    w.add_head_count_kv(N_KV)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(50000.0)
    w.add_vocab_size(cfg.vocab_size)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    vocab = tok.get_vocab()
    tokens = sorted(vocab, key=vocab.get)
    merges = json.loads(tok.to_str())["model"]["merges"]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL if t in SPECIALS else gguf.TokenType.NORMAL for t in tokens])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    w.add_bos_token_id(0)
    w.add_eos_token_id(0)
    w.add_pad_token_id(1)
    w.add_add_bos_token(False)
    w.add_chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    for name, t in model.state_dict().items():
        a = t.numpy().astype(np.float32)
        if name == "model.embed_tokens.weight":
            out = "token_embd.weight"
        elif name == "model.norm.weight":
            out = "output_norm.weight"
        elif name == "lm_head.weight":
            out = "output.weight"
        else:
            _, _, i, rest = name.split(".", 3)
            part = rest.rsplit(".", 1)[0]
            out = f"blk.{i}.{_NAMES[part]}.weight"
            if part == "self_attn.q_proj":
                a = _permute(a, N_HEAD)
            elif part == "self_attn.k_proj":
                a = _permute(a, N_KV)
        w.add_tensor(out, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gguf")
    tok = _tokenizer()
    model = _model(tok.get_vocab_size())
    path = folder / "tiny.gguf"
    _write_gguf(path, model, tok)
    return path, model, tok


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


def test_round_trip_is_exact(tiny, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path, original, tok = tiny
    out = tmp_path / "hf"
    info = gguf_import.convert(str(path), str(out))
    assert info["architecture"] == "llama" and info["path"] == str(out)
    assert info["params"] == sum(p.numel() for p in original.parameters())
    assert info["gguf_types"] == ["F32"]
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
            gguf_import.MARKER, "sparklm_checksums.json"} <= names
    marker = json.loads((out / gguf_import.MARKER).read_text())
    assert marker["size"] == path.stat().st_size and marker["sha256"] == gguf_import.digest(str(path))

    model = AutoModelForCausalLM.from_pretrained(str(out), local_files_only=True)
    assert model.dtype == torch.float32 and model.config.tie_word_embeddings is False
    rope = getattr(model.config, "rope_parameters", None) or {"rope_theta": model.config.rope_theta}  # 5.x, 4.x
    assert rope["rope_theta"] == 50000.0
    assert (model.config.bos_token_id, model.config.eos_token_id, model.config.pad_token_id) == (0, 0, 1)
    want = original.state_dict()
    got = model.state_dict()
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name
    ids = torch.tensor([[5, 17, 42, 99, 3, 250]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, original(ids).logits)
    assert type(load_model(str(out))).__name__ == "LlamaForCausalLM"  # sparklm's loader, checksums verified

    hf_tok = AutoTokenizer.from_pretrained(str(out), local_files_only=True)
    for text in ["Once upon a time, the quick fox!", " leading space and 5678 digits"]:
        assert hf_tok(text)["input_ids"] == tok.encode(text).ids
    assert hf_tok.decode(tok.encode(SENTENCES[1]).ids) == SENTENCES[1]
    assert hf_tok.encode("<|endoftext|>", add_special_tokens=False) == [0]
    assert (hf_tok.bos_token, hf_tok.eos_token, hf_tok.pad_token) == ("<|endoftext|>", "<|endoftext|>", "<|pad|>")
    assert hf_tok.chat_template


def test_cached_converts_once_by_content(tiny, tmp_path):
    path = tiny[0]
    first = Path(gguf_import.cached(str(path)))
    stamp = (first / gguf_import.MARKER).stat().st_mtime_ns
    assert gguf_import.cached(str(path)) == str(first)
    assert (first / gguf_import.MARKER).stat().st_mtime_ns == stamp  # not converted again
    copy = tmp_path / "renamed.gguf"
    copy.write_bytes(path.read_bytes())
    assert gguf_import.cached(str(copy)) == str(first)  # same content, same conversion
    assert first.parent.name == "models"
    assert (first / "model.safetensors").stat().st_mode == (first / "config.json").stat().st_mode

    # A process that loses the race to publish drops its copy and leaves the winner's directory alone.
    with staged_once(first, marker=gguf_import.MARKER) as stage:
        (stage / "late.txt").write_text("loser")
    assert not (first / "late.txt").exists() and (first / gguf_import.MARKER).stat().st_mtime_ns == stamp
    assert not [p for p in first.parent.iterdir() if p.name.startswith(".")]  # no staging left behind


def test_is_gguf(tiny, tmp_path):
    renamed = tmp_path / "weights.bin"
    renamed.write_bytes(tiny[0].read_bytes()[:64])
    assert gguf_import.is_gguf(str(tiny[0])) and gguf_import.is_gguf(str(renamed))
    assert gguf_import.is_gguf("s3://bucket/Model.Q4_K_M.GGUF")
    assert not gguf_import.is_gguf(str(tmp_path)) and not gguf_import.is_gguf(str(tmp_path / "missing"))


def _one_line(e: pytest.ExceptionInfo) -> str:
    line = e.value.one_line()
    assert "\n" not in line and "Traceback" not in line
    return line


def test_bad_inputs_are_one_line_errors(tiny, tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"PK\x03\x04 not a gguf")
    with pytest.raises(SparklmError) as e:
        gguf_import.convert(str(bad), str(tmp_path / "out"))
    assert "not a GGUF file" in _one_line(e)
    with pytest.raises(SparklmError) as e:
        gguf_import.cached(str(tmp_path / "missing.gguf"))
    assert "not found" in _one_line(e)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(tiny[0].read_bytes()[:-4096])
    with pytest.raises(SparklmError) as e:
        gguf_import.convert(str(cut), str(tmp_path / "out"))
    assert "truncated" in _one_line(e)
    assert not (tmp_path / "out").exists()


def test_unsupported_architecture_is_named(tmp_path):
    path = tmp_path / "odd.gguf"
    w = gguf.GGUFWriter(str(path), "rwkv7")
    w.add_tensor("token_embd.weight", np.zeros((4, 4), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(SparklmError) as e:
        gguf_import.convert(str(path), str(tmp_path / "out"))
    line = _one_line(e)
    assert "'rwkv7'" in line and "llama" in line


def test_output_is_replaced_only_when_asked_and_only_an_import(tiny, tmp_path):
    path = tiny[0]
    out = tmp_path / "hf"
    gguf_import.convert(str(path), str(out))
    with pytest.raises(SparklmError) as e:
        gguf_import.convert(str(path), str(out))
    assert "already exists" in _one_line(e)
    gguf_import.convert(str(path), str(out), overwrite=True)
    assert (out / gguf_import.MARKER).is_file()

    precious = tmp_path / "mine"
    precious.mkdir()
    (precious / "notes.txt").write_text("keep me")
    with pytest.raises(SparklmError) as e:
        gguf_import.convert(str(path), str(precious), overwrite=True)
    assert "neither a sparklm import" in _one_line(e)
    assert (precious / "notes.txt").read_text() == "keep me"
    (out / "notes.txt").write_text("added to an import by its user")  # an import of ours, and a file of theirs
    with pytest.raises(SparklmError) as e:
        gguf_import.convert(str(path), str(out), overwrite=True)
    assert "holds notes.txt, which sparklm did not write" in _one_line(e)
    empty = tmp_path / "empty"
    empty.mkdir()
    assert gguf_import.convert(str(path), str(empty))["path"] == str(empty)


# -- every file transformers loads, sparklm imports ------------------------------------------------------------
# Files written with gguf's own writer, named by gguf's tensor-name maps (as llama.cpp's converter names them),
# quantized with gguf's own quantizers; transformers' loader on the same file is the reference.

def _quantizable() -> list[str]:
    """The tensor types gguf's writer can produce from float weights (its quantizers; F16 and BF16 by cast)."""
    names = []
    for qtype in gguf.GGMLQuantizationType:
        if qtype.name == "F32" or qtype not in gguf.GGML_QUANT_SIZES:
            continue
        block = gguf.GGML_QUANT_SIZES[qtype][0]
        try:
            gguf.quants.quantize(np.ones((1, 256 * block), np.float32), qtype)
        except (NotImplementedError, ValueError, TypeError, KeyError, AssertionError):
            continue
        names.append(qtype.name)
    return names


QUANTIZABLE = _quantizable()
# llama.cpp's Q4_K_M mixes these; gguf can only read K-quants, so their blocks are crafted (every byte below 0x3C
# keeps each block's float16 scales finite and under 1).
Q4_K_M = ["Q4_K", "Q5_0", "Q6_K", "Q8_0"]
DIMS = dict(hidden=256, inter=512, layers=2, heads=2, kv=1, context=1024)  # rows of 256: every block fits; heads of
# 128 and a context of 1024, which transformers assumes for Qwen3 and GPT-2 GGUF files


def _arch_model(arch: str, vocab: int):
    import transformers as tf

    torch.manual_seed(1)
    d = DIMS
    if arch == "gpt2":
        config = tf.GPT2Config(vocab_size=vocab, n_embd=d["hidden"], n_layer=d["layers"], n_head=d["heads"],
                               n_positions=d["context"], bos_token_id=0, eos_token_id=0)
        return tf.GPT2LMHeadModel(config).eval()
    cls = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3"}[arch]
    extra = {"head_dim": d["hidden"] // d["heads"]} if arch == "qwen3" else {}
    config = getattr(tf, f"{cls}Config")(vocab_size=vocab, hidden_size=d["hidden"], intermediate_size=d["inter"],
                                         num_hidden_layers=d["layers"], num_attention_heads=d["heads"],
                                         num_key_value_heads=d["kv"], max_position_embeddings=d["context"],
                                         rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=0,
                                         eos_token_id=0, pad_token_id=1, **extra)
    model = getattr(tf, f"{cls}ForCausalLM")(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.05)
    return model


def _blocks(qtype, a: np.ndarray, rng) -> tuple[np.ndarray, object]:
    """``a`` in ``qtype``: gguf's quantizer where it has one, crafted blocks where gguf only reads the type."""
    qtype = gguf.GGMLQuantizationType[qtype]
    if qtype == gguf.GGMLQuantizationType.F16:
        return a.astype(np.float16), None
    if qtype.name in QUANTIZABLE:
        return gguf.quants.quantize(a, qtype), qtype
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    return rng.integers(0, 0x3C, (a.shape[0], a.shape[1] // block * size), dtype=np.uint8), qtype


def _write_arch(path: Path, model, tok, arch: str, types: list[str]) -> None:
    """``model`` as a GGUF file of ``arch``; 2-D weights take ``types`` in turn (1-D ones stay F32)."""
    cfg, d = model.config, DIMS
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(d["context"])
    w.add_embedding_length(d["hidden"])
    w.add_block_count(d["layers"])
    w.add_head_count(d["heads"])
    if arch == "gpt2":
        w.add_feed_forward_length(4 * d["hidden"])
        w.add_layer_norm_eps(cfg.layer_norm_epsilon)
    else:
        w.add_feed_forward_length(d["inter"])
        w.add_head_count_kv(d["kv"])
        w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
        w.add_rope_freq_base(10000.0)
        w.add_key_length(d["hidden"] // d["heads"])
        w.add_value_length(d["hidden"] // d["heads"])
    w.add_vocab_size(cfg.vocab_size)
    vocab = tok.get_vocab()
    tokens = sorted(vocab, key=vocab.get)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL if t in SPECIALS else gguf.TokenType.NORMAL for t in tokens])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in json.loads(tok.to_str())["model"]["merges"]])
    w.add_bos_token_id(0)
    w.add_eos_token_id(0)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], d["layers"])
    rng, turn = np.random.default_rng(0), 0
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue  # tied: the loader ties it back
        base, suffix = name.rsplit(".", 1)
        a = t.numpy().astype(np.float32)
        if arch == "llama" and base.endswith(("q_proj", "k_proj")):
            a = _permute(a, d["heads"] if base.endswith("q_proj") else d["kv"])
        if arch == "gpt2" and base.endswith(("c_attn", "c_proj", "c_fc")) and suffix == "weight":
            a = np.ascontiguousarray(a.T)  # HF's Conv1D stores (in, out); GGUF holds (out, in)
        out = f"{names.get_name(base)}.{suffix}"
        if a.ndim == 2:
            data, qtype = _blocks(types[turn % len(types)], a, rng)
            turn += 1
            if qtype is not None:
                w.add_tensor(out, data, raw_shape=data.shape, raw_dtype=qtype)
                continue
            a = data
        w.add_tensor(out, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _transformers_load(path: Path):
    """What transformers' own GGUF loader makes of the file, dequantized as sparklm asks for it."""
    from transformers import AutoModelForCausalLM

    kwargs = {}
    try:
        from transformers import GgufConfig

        kwargs["quantization_config"] = GgufConfig(dequantize=True)
    except ImportError:
        pass
    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True,
                                                dtype=torch.float32, **kwargs)


def _imports_as_transformers_loads(path: Path, out: Path):
    """sparklm imports ``path`` exactly when transformers loads it, into the same weights."""
    try:
        reference = _transformers_load(path)
    except Exception as e:  # the loader refuses: sparklm says so in one line, and never calls the file damaged
        with pytest.raises(SparklmError) as err:
            gguf_import.convert(str(path), str(out))
        assert "damaged" not in _one_line(err) and "transformers cannot load" in _one_line(err), e
        return None
    info = gguf_import.convert(str(path), str(out))
    got, want = load_model(str(out)).state_dict(), reference.state_dict()
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name
    return info


@pytest.fixture(scope="module")
def bpe():
    return _tokenizer()


@pytest.mark.parametrize("qtype", QUANTIZABLE)
def test_every_type_gguf_writes_imports_as_transformers_loads_it(qtype, bpe, tmp_path):
    model = _arch_model("llama", bpe.get_vocab_size())
    path = tmp_path / f"tiny-{qtype}.gguf"
    _write_arch(path, model, bpe, "llama", [qtype])
    info = _imports_as_transformers_loads(path, tmp_path / "hf")
    assert {"Q4_0", "Q5_0", "Q8_0", "F16", "BF16"} <= set(QUANTIZABLE)  # gguf's quantizers did run
    if info is not None:
        assert info["gguf_types"] == sorted({"F32", qtype})
        if qtype in ("F16", "BF16", "Q8_0"):  # fine enough to keep the model's outputs
            ids = torch.tensor([[5, 17, 42, 99, 3, 250]])
            with torch.no_grad():
                got, want = load_model(str(tmp_path / "hf"))(ids).logits, model(ids).logits
            assert torch.allclose(got, want, atol=0.05 * float(want.abs().max())), (got - want).abs().max()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gpt2"])
def test_a_q4_k_m_mix_imports_for_several_architectures(arch, bpe, tmp_path):
    model = _arch_model(arch, bpe.get_vocab_size())
    path = tmp_path / f"tiny-{arch}.Q4_K_M.gguf"
    _write_arch(path, model, bpe, arch, Q4_K_M)
    info = _imports_as_transformers_loads(path, tmp_path / "hf")
    assert info is not None and info["architecture"] == arch
    assert info["gguf_types"] == sorted({"F32", *Q4_K_M})


def test_sparklm_import_takes_a_q4_k_m_file(bpe, tmp_path):
    import subprocess
    import sys

    path = tmp_path / "tiny.Q4_K_M.gguf"
    _write_arch(path, _arch_model("llama", bpe.get_vocab_size()), bpe, "llama", Q4_K_M)
    r = subprocess.run([sys.executable, "-m", "sparklm", "import", str(path), "--output", str(tmp_path / "hf")],
                       capture_output=True, text=True, timeout=300, env={**__import__("os").environ,
                                                                          "XDG_CACHE_HOME": str(tmp_path / "c")})
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert (tmp_path / "hf" / "model.safetensors").is_file()


def test_a_header_cut_short_is_left_to_the_loader(tiny, tmp_path):
    head = tmp_path / "head.gguf"
    head.write_bytes(tiny[0].read_bytes()[:300])  # inside the metadata: nothing can be sized
    with pytest.raises(SparklmError) as e:
        gguf_import.convert(str(head), str(tmp_path / "out"))
    line = _one_line(e)
    assert "transformers cannot load" in line and "may be damaged" in line and not (tmp_path / "out").exists()
