"""Causal self-attention for short sequences on the CPU, as a transformers attention implementation ("matmul").

Why by hand: for bfloat16 on the CPU, SDPA runs torch's flash-attention kernel, which is built for long sequences. At
the lengths sparklm trains on a CPU (256-512 tokens, heads of 32-64), its backward pass runs at ~50 GFLOP/s, against
~400 for a batched bf16 matmul of the same sizes (BENCHMARKS.md, issue 53). With sequences this short, a few heads'
whole T x T probabilities fit in the cache. So this computes them whole, with five batched matmuls (oneDNN) around
torch's own softmax and softmax-backward kernels, a few heads at a time, and keeps the probabilities (rounded to the
compute dtype, as transformers' eager attention rounds them) for the backward pass instead of recomputing them. The memory that costs is ``heads x T x T`` per layer: 2 bytes each in bf16, 8 MB a
layer for 16 x 4 heads of 256 tokens. So it is used only up to :data:`MAX_LEN`; beyond that, and for anything that
is not plain causal self-attention over the whole sequence, it hands the call to transformers' SDPA unchanged.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where the attention runs: the driver reads MAX_LEN (train/resolve.py)
    from torch import Tensor

NAME = "sparklm_matmul"  # the name it is registered under with transformers (config._attn_implementation)
MAX_LEN = 512  # longest sequence it takes; measured faster than SDPA up to here, forward and backward
CHUNK_BYTES = 2 << 20  # the scores of this many bytes at a time: a few heads' T x T, kept in the cache (measured)


def _heads_at_once(t: int, itemsize: int) -> int:
    return max(1, CHUNK_BYTES // (t * t * itemsize))


_masks: dict = {}


def _future(t: int, dtype) -> Tensor:
    """-inf where a causal query must not see (above the diagonal), 0 elsewhere: baddbmm adds it to the scores as
    it makes them, where a separate masked_fill_ pass over them cost a quarter of the forward (8.1 against 10.7 ms
    for 128 heads x 256 x 40 in bf16)."""
    import torch

    if (t, dtype) not in _masks:
        _masks[t, dtype] = torch.full((t, t), float("-inf"), dtype=dtype).triu_(1)
    return _masks[t, dtype]


def _forward(q: Tensor, k: Tensor, v: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    import torch

    n, t, _ = q.shape
    probs, out = q.new_empty(n, t, t), torch.empty_like(q)
    future, step = _future(t, q.dtype), _heads_at_once(t, q.element_size())
    for i in range(0, n, step):
        j = slice(i, i + step)
        scores = torch.baddbmm(future, q[j], k[j].transpose(1, 2), alpha=scale)
        torch.softmax(scores, -1, out=probs[j])
        torch.bmm(probs[j], v[j], out=out[j])
    return out, probs


def _backward(grad: Tensor, q: Tensor, k: Tensor, v: Tensor, probs: Tensor, scale: float
              ) -> tuple[Tensor, Tensor, Tensor]:
    import torch

    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    step = _heads_at_once(q.shape[1], q.element_size())
    for i in range(0, q.shape[0], step):
        j = slice(i, i + step)
        p = probs[j]
        torch.bmm(p.transpose(1, 2), grad[j], out=dv[j])
        # softmax's backward, p * (dp - rowsum(dp * p)): zero where p is (the future), so no mask is needed
        ds = torch._softmax_backward_data(torch.bmm(grad[j], v[j].transpose(1, 2)), p, -1, p.dtype)
        torch.baddbmm(dq[j], ds, k[j], beta=0.0, alpha=scale, out=dq[j])
        torch.baddbmm(dk[j], ds.transpose(1, 2), q[j], beta=0.0, alpha=scale, out=dk[j])
    return dq, dk, dv


_op = None  # the custom op, defined once torch is wanted (the driver imports this module for MAX_LEN only)


def _define():
    """Register ``sparklm::causal_attention`` and its backward with torch: one opaque op each for torch.compile."""
    import torch

    forward_op = torch.library.custom_op("sparklm::causal_attention", _forward, mutates_args=(),
                                         schema="(Tensor q, Tensor k, Tensor v, float scale) -> (Tensor, Tensor)")
    backward_op = torch.library.custom_op(
        "sparklm::causal_attention_backward", _backward, mutates_args=(),
        schema="(Tensor grad, Tensor q, Tensor k, Tensor v, Tensor probs, float scale) -> (Tensor, Tensor, Tensor)")
    forward_op.register_fake(lambda q, k, v, scale: (torch.empty_like(q), q.new_empty(q.shape[0], q.shape[1],
                                                                                      q.shape[1])))
    backward_op.register_fake(lambda grad, q, k, v, probs, scale: (torch.empty_like(q), torch.empty_like(k),
                                                                   torch.empty_like(v)))

    def setup(ctx, inputs, output):
        q, k, v, scale = inputs
        ctx.save_for_backward(q, k, v, output[1])
        ctx.scale = scale

    def backward(ctx, grad, _grad_probs):
        q, k, v, probs = ctx.saved_tensors
        return (*backward_op(grad.contiguous(), q, k, v, probs, ctx.scale), None)

    forward_op.register_autograd(backward, setup_context=setup)
    return forward_op


def causal_attention(q: Tensor, k: Tensor, v: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """``softmax(scale * q kᵀ, causal) v`` for ``q, k, v`` of shape ``(heads, T, D)``: the output and the
    probabilities (``(heads, T, T)``, kept for the backward pass), which are rounded to the inputs' dtype, as
    transformers' eager attention rounds them."""
    return _defined()(q, k, v, scale)


def _defined():
    global _op
    if _op is None:
        _op = _define()
    return _op


def takes(query: Tensor, key: Tensor, attention_mask, dropout: float, kwargs: dict, module) -> bool:
    """Whether a call is plain causal self-attention over whole sequences this short on the CPU; else SDPA takes it."""
    t = query.shape[2]
    return (query.device.type == "cpu" and 1 < t <= MAX_LEN and key.shape[2] == t and attention_mask is None
            and not (dropout and module.training) and getattr(module, "is_causal", True)
            and kwargs.get("is_causal", True) is not False
            and not any(kwargs.get(x) for x in ("sliding_window", "softcap", "output_attentions", "position_bias")))


def forward(module, query: Tensor, key: Tensor, value: Tensor, attention_mask, dropout: float = 0.0,
            scaling: float | None = None, **kwargs):
    """transformers' attention-function signature: ``query`` ``(B, H, T, D)``, ``key``/``value`` ``(B, Hkv, T, D)``;
    returns the output as ``(B, T, H, D)`` and no weights, as SDPA's does."""
    import torch
    from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward

    if not takes(query, key, attention_mask, dropout, kwargs, module):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    b, h, t, d = query.shape
    if key.shape[1] != h:  # grouped-query attention: each key/value head serves h / Hkv query heads
        key, value = repeat_kv(key, h // key.shape[1]), repeat_kv(value, h // value.shape[1])
    # under autocast, SDPA computes in the autocast dtype (RoPE may have promoted q and k to float32): so does this
    dtype = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else query.dtype
    query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
    out, _ = causal_attention(query.reshape(b * h, t, d), key.reshape(b * h, t, d), value.reshape(b * h, t, d),
                              d ** -0.5 if scaling is None else float(scaling))
    return out.view(b, h, t, d).transpose(1, 2).contiguous(), None


def register() -> str:
    """Register the implementation (and SDPA's mask, which is None for plain causal batches) with transformers;
    returns its name for ``config._attn_implementation``."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    _defined()  # now, in eager code: torch.compile then traces an op already defined
    AttentionInterface.register(NAME, forward)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    return NAME
