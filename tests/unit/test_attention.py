"""sparklm's causal attention for short sequences on the CPU (model/attention.py, ``train.attention = "matmul"``): its
output and gradients are SDPA's, inside transformers' models too; every call it does not take is SDPA's own; the
configs a run saves still name SDPA; and auto picks it only where it was measured faster."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sparklm.config import from_dict
from sparklm.model import attention
from sparklm.train import memory, resolve


def _qkv(n: int, t: int, d: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, t, d, generator=g).to(dtype).requires_grad_() for _ in range(3)]


def _both(q, k, v, grad):
    """(output, dq, dk, dv) of this kernel and of SDPA, for the same inputs."""
    runs = []
    for fn in (lambda: attention.causal_attention(q, k, v, q.shape[-1] ** -0.5)[0],
               lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)):
        for x in (q, k, v):
            x.grad = None
        out = fn()
        out.backward(grad)
        runs.append([out.detach(), q.grad, k.grad, v.grad])
    return runs


@pytest.mark.parametrize("n,t,d", [(3, 17, 8), (20, 256, 8), (2, 1, 4)])
def test_the_kernel_is_sdpa_in_float32(n, t, d):
    """(20, 256, 8): 8 heads at a time in float32, so three chunks, the last one short."""
    q, k, v = _qkv(n, t, d, torch.float32)
    grad = torch.randn(n, t, d, generator=torch.Generator().manual_seed(1))
    mine, sdpa = _both(q, k, v, grad)
    for name, a, b in zip(("output", "dq", "dk", "dv"), mine, sdpa):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=name)
    _, probs = attention.causal_attention(q, k, v, d ** -0.5)
    assert torch.equal(probs.triu(1), torch.zeros_like(probs))  # nothing from the future
    torch.testing.assert_close(probs.sum(-1), torch.ones(n, t))


def test_in_bfloat16_it_is_as_close_to_float32_as_eager_attention_and_sdpa_are():
    """Its probabilities are rounded to bf16 as transformers' eager attention rounds them (SDPA's kernel keeps them
    in float32): the output is as close to float32's as eager attention's; the gradients within 3x SDPA's error
    (in a whole model's gradients the difference disappears among the other bf16 matmuls' rounding: below)."""
    q, k, v = _qkv(32, 128, 32, torch.bfloat16)
    grad = torch.randn(32, 128, 32, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    exact = _both(*[x.detach().float().requires_grad_() for x in (q, k, v)], grad.float())[1]
    mine, sdpa = _both(q, k, v, grad)
    future = torch.ones(128, 128, dtype=torch.bool).triu(1)
    with torch.no_grad():  # transformers' eager attention: bf16 scores, a float32 softmax rounded to bf16
        scores = (q @ k.transpose(1, 2)) * 32 ** -0.5
        eager = torch.softmax(scores.masked_fill(future, float("-inf")).float(), -1).to(torch.bfloat16) @ v

    def err(x, want):
        return ((x.float() - want).norm() / want.norm()).item()

    assert err(mine[0], exact[0]) < 0.01 and err(mine[0], exact[0]) <= 1.1 * err(eager, exact[0])
    for name, a, b, want in zip(("dq", "dk", "dv"), mine[1:], sdpa[1:], exact[1:]):
        assert err(a, want) < 0.01 and err(a, want) < 3 * err(b, want), (name, err(a, want), err(b, want))


def _llama(**over):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, vocab_size=64, max_position_embeddings=64, attn_implementation="sdpa")
    return LlamaForCausalLM(LlamaConfig(**{**cfg, **over}))


def _logits_and_grads(model, impl: str, ids, mask=None):
    model.config._attn_implementation = impl
    model.zero_grad()
    out = model(input_ids=ids, attention_mask=mask, labels=ids)
    out.loss.backward()
    return out.logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_a_transformers_model_trains_through_it_as_through_sdpa(tmp_path):
    """A Llama with grouped-query attention (4 query heads over 2 key/value heads): the same logits and gradients.
    A batch with padding is SDPA's own call, bit for bit. A saved model's config still names SDPA."""
    model, name = _llama(), attention.register()
    ids = torch.randint(0, 64, (3, 24), generator=torch.Generator().manual_seed(2))
    (logits, grads), (ref, ref_grads) = (_logits_and_grads(model, x, ids) for x in (name, "sdpa"))
    torch.testing.assert_close(logits, ref, rtol=1e-5, atol=1e-5)
    for n, g in grads.items():
        torch.testing.assert_close(g, ref_grads[n], rtol=1e-4, atol=1e-6, msg=n)
    mask = torch.ones_like(ids)
    mask[0, :5] = 0  # left padding: a mask SDPA must see
    padded, padded_ref = (_logits_and_grads(model, x, ids, mask)[0] for x in (name, "sdpa"))
    assert torch.equal(padded, padded_ref)
    model.config._attn_implementation = name
    model.save_pretrained(tmp_path)
    assert name not in (tmp_path / "config.json").read_text()


def test_a_models_bf16_gradients_are_as_close_to_float32_as_through_sdpa():
    model, name = _llama(hidden_size=64, num_attention_heads=4, num_key_value_heads=4), attention.register()
    ids = torch.randint(0, 64, (4, 64), generator=torch.Generator().manual_seed(3))
    exact = _logits_and_grads(model, "sdpa", ids)[1]
    errors = {}
    for impl in (name, "sdpa"):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            grads = _logits_and_grads(model, impl, ids)[1]
        errors[impl] = sum(((grads[n] - g).norm() / g.norm()).item() for n, g in exact.items()) / len(exact)
    assert errors[name] < 0.05 and errors[name] <= 1.2 * errors["sdpa"], errors


def test_it_takes_only_plain_causal_attention_over_short_sequences():
    class Module(torch.nn.Module):
        is_causal = True

    m = Module().train()
    q = torch.zeros(1, 2, 16, 8)
    assert attention.takes(q, q, None, 0.0, {}, m)
    assert not attention.takes(torch.zeros(1, 2, attention.MAX_LEN + 1, 8), torch.zeros(1, 2, attention.MAX_LEN + 1, 8),
                               None, 0.0, {}, m)  # long: its probabilities would not fit a cache, nor memory
    assert not attention.takes(q[:, :, :1], q, None, 0.0, {}, m)  # decoding with a cache
    assert not attention.takes(q, q, torch.ones(1, 1, 16, 16), 0.0, {}, m)  # a mask (padding)
    assert not attention.takes(q, q, None, 0.1, {}, m)  # dropout while training
    assert attention.takes(q, q, None, 0.1, {}, m.eval())
    assert not attention.takes(q, q, None, 0.0, {"sliding_window": 4}, m)
    assert not attention.takes(q, q, None, 0.0, {"is_causal": False}, m)
    m.is_causal = False  # an encoder
    assert not attention.takes(q, q, None, 0.0, {}, m)


@pytest.mark.slow
def test_it_compiles_whole():
    """train.compile on: the kernel is one opaque op to torch.compile (no graph break), its gradients the eager ones."""
    q, k, v = _qkv(4, 32, 8, torch.float32)

    def fn(q, k, v):
        return attention.causal_attention(q, k, v, 0.3)[0].square().sum()

    compiled = torch.compile(fn, fullgraph=True)
    eager_grads = torch.autograd.grad(fn(q, k, v), (q, k, v))
    torch.testing.assert_close(torch.autograd.grad(compiled(q, k, v), (q, k, v)), eager_grads)


def test_auto_picks_matmul_only_where_it_was_measured_faster():
    def settled(context=256, **over):
        raw = {"train": {"device": "cpu", "dtype": "bfloat16", **over.pop("train", {})}, **over}
        return resolve.settings(from_dict(raw), 2, context).train.attention

    assert settled() == "matmul"
    assert settled(context=attention.MAX_LEN + 1) == "sdpa"
    assert settled(context=0) == "sdpa"  # not known
    assert settled(train={"dtype": "float32"}) == "sdpa"  # measured: SDPA's float32 kernel is as fast
    assert settled(train={"device": "cuda"}) == "sdpa"
    assert settled(model={"task": "classify"}) == "sdpa"
    assert settled(train={"attention": "sdpa"}) == "sdpa"
    assert settled(train={"attention": "matmul", "dtype": "float32"}) == "matmul"  # a setting is kept


def test_the_memory_plan_counts_the_probabilities_it_keeps():
    shapes = memory.Shapes(layers=4, hidden=64, intermediate=256, vocab=1000, params=10**6, weight_bytes=4 * 10**6,
                           trainable=10**6, head_trains=True, heads=4)
    sdpa = memory.footprint(shapes, seq_len=128)
    kept = memory.footprint(shapes, seq_len=128, score_bytes=2)
    assert kept.per_sequence - sdpa.per_sequence == 4 * 4 * 128 * 128 * 2  # layers x heads x T x T x bf16
    assert kept.per_sequence_checkpointed - sdpa.per_sequence_checkpointed == 4 * 128 * 128 * 2  # one block's
    model = from_dict({}).model
    assert memory.scratch_shapes(model, 4096, 256).heads == model.n_head
