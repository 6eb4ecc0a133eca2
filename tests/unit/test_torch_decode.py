"""torch_decode.LlamaDecoder's step against transformers' own forward (TorchDecoder): the same logits, bit for bit
in float32, for each family it takes (grouped-query attention, Qwen3's head norms, Qwen2's biases, left-padded
batches), with int4 weights and with float layers packed for oneDNN; the models it leaves to transformers."""

import numpy as np
import pytest
import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from sparklm.infer.generate import decoder
from sparklm.infer.quantize import quantize
from sparklm.infer.torch_decode import LlamaDecoder, TorchDecoder, supports

COMMON = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64)


def tiny(arch: str, **sizes) -> torch.nn.Module:
    torch.manual_seed(0)
    common = {**COMMON, **sizes}
    model = {
        "llama": lambda: LlamaForCausalLM(LlamaConfig(**common, tie_word_embeddings=True)),
        "qwen3": lambda: Qwen3ForCausalLM(Qwen3Config(**common, head_dim=common["hidden_size"] // 4)),
        "qwen2": lambda: Qwen2ForCausalLM(Qwen2Config(**common)),  # biases on q, k and v
        "mistral": lambda: MistralForCausalLM(MistralConfig(**common, sliding_window=None)),
    }[arch]()
    for p in model.parameters():  # random weights big enough that the logits differ from token to token
        torch.nn.init.normal_(p, std=0.2)
    return model.eval()


def decode(dec, ids: np.ndarray, mask: np.ndarray, steps: int) -> list[np.ndarray]:
    """The logits after the prompts and after each of ``steps`` tokens (fixed ones, the same for every decoder)."""
    out = [np.array(dec.start(ids, mask, steps))]
    for s in range(steps):
        out.append(np.array(dec.extend(np.array([(7 * s + r) % 90 + 1 for r in range(len(ids))]))))
    return out


PROMPTS = (np.array([[3, 14, 15, 92, 65]]), np.ones((1, 5), dtype=np.int64))
PADDED = (np.array([[0, 0, 0, 5, 9], [1, 2, 3, 4, 5], [0, 8, 8, 2, 7]]),
          np.array([[0, 0, 0, 1, 1], [1, 1, 1, 1, 1], [0, 1, 1, 1, 1]]))


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen2", "mistral"])
def test_the_step_gives_transformers_logits(arch):
    model = tiny(arch)
    assert supports(model) and isinstance(decoder(model), LlamaDecoder)
    for ids, mask in (PROMPTS, PADDED):
        ours, theirs = decode(LlamaDecoder(model), ids, mask, 6), decode(TorchDecoder(model), ids, mask, 6)
        for a, b in zip(ours, theirs):
            if mask.all():
                assert np.array_equal(a, b)  # the same modules on the same numbers
            else:  # left padding: masked attention, summed in the kernel's own order
                np.testing.assert_allclose(a, b, rtol=0, atol=1e-5 * np.abs(b).max())
        assert ours[-1].shape == (len(ids), 96)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_the_step_with_int4_weights_runs_them_joined(arch):
    from sparklm.infer.quantize import pack_block

    # keys and values of 64 outputs, MLP of 128: whole blocks of the packing where it works in 64 rows or fewer
    model = quantize(tiny(arch, hidden_size=128, intermediate_size=128), "int4")
    dec = LlamaDecoder(model)
    assert all((qkv is not None and gate_up is not None) == (pack_block() <= 64) for qkv, gate_up in dec.joined)
    ids, mask = PROMPTS
    for a, b in zip(decode(dec, ids, mask, 5), decode(TorchDecoder(model), ids, mask, 5)):
        assert np.array_equal(a, b)  # joined products: the layers' own numbers


def test_other_models_stay_with_transformers():
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=96, n_embd=32, n_layer=1, n_head=2, n_positions=32)).eval()
    windowed = MistralForCausalLM(MistralConfig(**COMMON, sliding_window=16)).eval()
    qwen2 = Qwen2ForCausalLM(Qwen2Config(**COMMON, use_sliding_window=True, sliding_window=16)).eval()
    for model in (gpt2, windowed, qwen2):
        assert not supports(model) and isinstance(decoder(model), TorchDecoder)


def test_a_step_past_the_cache_is_refused():
    dec = LlamaDecoder(tiny("llama"))
    dec.start(*PROMPTS, 1)
    dec.extend(np.array([4]))
    with pytest.raises(RuntimeError, match="cache is full"):
        dec.extend(np.array([4]))


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_int4_layers_packed_when_loaded_are_joined_once(arch):
    """``quantize.pack`` with ``projection_groups`` (as ``generate.load`` packs for inference) joins each layer's int4
    q/k/v and gate/up where their packs stack: the separate packs are freed (each weight held once), and the step
    and transformers' forward both run the joined products with the separate layers' numbers."""
    import gc
    import weakref

    from sparklm.infer.quantize import Int4Linear, SharedProduct, pack, pack_block
    from sparklm.infer.torch_decode import projection_groups

    if not 0 < pack_block() <= 64:
        pytest.skip("int4 packs of 64 rows do not stack on this CPU")
    sizes = dict(hidden_size=128, intermediate_size=128)
    plain, model = (quantize(tiny(arch, **sizes), "int4") for _ in range(2))
    layer = model.model.layers[0]
    gone = [weakref.ref(m.packed) for m in (layer.self_attn.q_proj, layer.self_attn.v_proj, layer.mlp.up_proj)]
    pack(model, projection_groups(model))
    del layer
    gc.collect()
    assert all(ref() is None for ref in gone)
    dec = LlamaDecoder(model)
    assert all(isinstance(p, SharedProduct) and type(p.product) is Int4Linear for pair in dec.joined for p in pair)
    ids, mask = PROMPTS
    want = decode(TorchDecoder(plain), ids, mask, 5)
    for ours, theirs, separate in zip(decode(dec, ids, mask, 5), decode(TorchDecoder(model), ids, mask, 5), want):
        assert np.array_equal(ours, separate) and np.array_equal(theirs, separate)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_the_step_on_packed_layers_runs_their_joined_products(arch):
    """Float layers packed for oneDNN with each layer's q/k/v and gate/up joined (as ``generate.load`` packs them
    on the CPU): the step calls the joined products and gives transformers' logits on the same layers, float32 bit
    for bit; in bfloat16 its attention reads a float32 cache, so it agrees to bfloat16's rounding."""
    from sparklm.infer.quantize import SharedProduct, pack, packable_dtypes, to_bf16
    from sparklm.infer.torch_decode import projection_groups

    if torch.float32 not in packable_dtypes():
        pytest.skip("this torch has no oneDNN to pack with")
    model = tiny(arch)
    pack(model, projection_groups(model))
    dec = LlamaDecoder(model)
    assert all(isinstance(qkv, SharedProduct) and isinstance(gate_up, SharedProduct) for qkv, gate_up in dec.joined)
    for ids, mask in (PROMPTS, PADDED):
        for a, b in zip(decode(dec, ids, mask, 5), decode(TorchDecoder(model), ids, mask, 5)):
            if mask.all():
                assert np.array_equal(a, b)
            else:
                np.testing.assert_allclose(a, b, rtol=0, atol=1e-5 * np.abs(b).max())
    if torch.bfloat16 in packable_dtypes():
        model = to_bf16(tiny(arch))
        pack(model, projection_groups(model))
        ids, mask = PROMPTS
        ours, theirs = decode(LlamaDecoder(model), ids, mask, 5), decode(TorchDecoder(model), ids, mask, 5)
        for a, b in zip(ours, theirs):
            np.testing.assert_allclose(a, b, rtol=0, atol=0.03 * np.abs(b).max())
