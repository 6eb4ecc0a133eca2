"""The LM head's loss in chunks of positions: the logits of a whole batch never exist at once.

With a large vocabulary the logits are a small model's largest tensors: SmolLM2's 49,152 words make
8 × 256 positions × 49,152 × 4 bytes = 400 MB per copy, and log-softmax and its gradient make more.
Here the head's matmul, log-softmax and their gradient run a chunk of positions at a time inside one
autograd function. The loss is a sum, so its gradients with respect to the hidden states and the
head's weight are computed in the forward pass and only scaled in the backward: nothing is kept and
nothing recomputed (the FLOPs of the unchunked loss). Only positions with a target are computed:
on instruction data the prompt tokens cost no head matmul at all.

Written by hand because torch 2.13's own chunked ``F.linear_cross_entropy`` measured 2.4-5.5x slower than the
unchunked loss on CPU with its default chunking, and in bfloat16 returns the summed loss in bfloat16 (1% off
over 2,048 positions); this function is 2-4% faster than the unchunked loss (23% with a frozen head under bf16
autocast), at 2.2-2.8x less peak memory (benchmarks/lm_head_loss.py, BENCHMARKS.md). In a whole training step
it measured 1-3% slower, so training uses it where the memory plan needs it (train/memory.py).

The hidden states come from the model's own forward pass: a forward pre-hook on its output embedding
(the LM head) keeps the head's input and hands the head zero positions of it, so the head computes
nothing and any HF causal LM works unchanged, through DDP and peft wrappers. A model that transforms the logits
after its head (soft-capping, scaling) or whose head is not a plain ``nn.Linear`` (LoRA on the head)
is found by :func:`supports` and keeps the unchunked loss.
"""

from __future__ import annotations

import functools
from contextlib import contextmanager

import torch
import torch.nn.functional as F

from ..config import chunk_size

IGNORE = -100


def head_of(model: torch.nn.Module) -> torch.nn.Module:
    """The LM head (output embedding) of an HF model, under DDP and peft wrappers."""
    inner = getattr(model, "module", model)  # DistributedDataParallel
    return inner.get_output_embeddings()


@contextmanager
def hidden_states(model: torch.nn.Module):
    """Within the block, the model's forward keeps the LM head's input in ``box["hidden"]`` and hands the head
    zero positions of it, so the head computes nothing and the model returns empty logits (B, 0, V)."""
    box: dict[str, torch.Tensor] = {}

    # A pre-hook, not a forward hook: a forward hook runs after the head and would discard logits it had already
    # computed (measured on SmolLM2 LoRA: ~0.5 s of a 10 s step, and 400 MB).
    def hook(module, args):
        box["hidden"] = args[0]
        return (args[0][..., :0, :], *args[1:])

    handle = head_of(model).register_forward_pre_hook(hook)
    try:
        yield box
    finally:
        handle.remove()


# Config fields with which HF models transform the logits after the head (Gemma 2's soft-capping, Cohere's
# and Granite's scaling): such a model keeps the unchunked loss.
LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "softcap")


def supports(model: torch.nn.Module) -> bool:
    """Whether the chunked loss equals the model's own: its head is a plain ``nn.Linear``, its config names no
    transform of the logits, and its logits are that head applied to the head's input (checked on four tokens)."""
    head = head_of(model)
    if type(head) is not torch.nn.Linear:
        return False
    config = getattr(getattr(model, "module", model), "config", None)
    for cfg in (config, getattr(config, "text_config", None)):
        if any(getattr(cfg, name, None) not in (None, 1, 1.0) for name in LOGIT_TRANSFORMS):
            return False
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            ids = torch.arange(4, device=head.weight.device)[None]
            logits = model(input_ids=ids).logits
            with hidden_states(model) as box:
                model(input_ids=ids)
            mine = F.linear(box["hidden"], head.weight, head.bias)
        return logits.shape == mine.shape and torch.allclose(logits.float(), mine.float(), rtol=1e-3, atol=1e-3)
    finally:
        model.train(was_training)


def nll_sum(hidden: torch.Tensor, head: torch.nn.Linear, labels: torch.Tensor, chunk: int,
            tally: torch.Tensor | None = None, *, fused: bool = False) -> torch.Tensor:
    """The summed next-token loss of ``hidden`` (B, T, d), the head's input, for ``labels`` (B, T; IGNORE where
    no loss; position t predicts label t+1), a chunk of positions at a time. ``tally`` ([correct, targets]), when
    given, gets the chunk's top-1 hits added: the training accuracy, from the logits the loss makes anyway.
    ``fused`` (a compiled model's, train/compiling.py): each chunk's log-softmax, hits and gradient in one
    torch.compiled function (:func:`chunk_terms`) instead of eager mode's six passes over the chunk's logits."""
    h = hidden[:, :-1].reshape(-1, hidden.shape[-1])
    t = labels[:, 1:].reshape(-1)
    keep = t != IGNORE
    if not bool(keep.all()):
        h, t = h[keep], t[keep]
    mm_dtype = _mm_dtype(h.device) or head.weight.dtype
    return _ChunkedNLL.apply(h, head.weight, head.bias, t, chunk_size(head.weight.shape[0], chunk), mm_dtype, tally,
                             _fused_terms() if fused else None)


def chunk_terms(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A chunk's summed negative log-likelihood (float64), top-1 hits and the loss's gradient with respect to its
    ``logits`` (n, V), in their dtype: softmax minus the one-hot ``targets`` (n). Pure, so that Inductor fuses its
    passes over the logits (eager mode makes six: the float copy, log-softmax, gather, argmax, exp, the cast)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    nll = -logp.gather(1, targets[:, None]).sum(dtype=torch.float64)
    hits = (logp.argmax(-1) == targets).sum()
    onehot = torch.arange(logits.shape[-1], device=logits.device)[None] == targets[:, None]
    return nll, hits, (logp.exp() - onehot.float()).to(logits.dtype)


@functools.cache
def _fused_terms():
    """:func:`chunk_terms` compiled, once per process: every chunk and step reuses it."""
    return torch.compile(chunk_terms, dynamic=False)


def token_sums(logits: torch.Tensor, targets: torch.Tensor, valid: torch.Tensor,
               byte_lengths: torch.Tensor | None = None) -> torch.Tensor:
    """[nats, tokens, correct, bytes] (float64) of next-token predictions ``logits`` (…, V) for ``targets``
    (…) at the ``valid`` positions: the unchunked sums, for models :func:`supports` rejects."""
    logits = logits.float().reshape(-1, logits.size(-1))
    targets, valid = targets.reshape(-1), valid.reshape(-1).bool()
    nats = F.cross_entropy(logits, targets, reduction="none")[valid]
    hits = logits.argmax(-1)[valid] == targets[valid]
    # the byte-length table may be on the CPU (`sparklm eval`'s) while the targets are on the model's device
    nbytes = byte_lengths.to(targets.device)[targets[valid]].sum() if byte_lengths is not None else 0.0
    return torch.tensor([float(nats.double().sum()), float(valid.sum()), float(hits.sum()), float(nbytes)],
                        dtype=torch.float64, device=logits.device)


@torch.no_grad()
def score(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, valid: torch.Tensor,
          byte_lengths: torch.Tensor | None = None, *, chunk: int = 0, chunked: bool = True) -> torch.Tensor:
    """[nats, tokens, correct, bytes] of ``model``'s next-token predictions over ``input_ids`` (B, T) at the
    ``valid`` target positions (B, T-1): the one masked LM sum of training's evaluation and ``sparklm eval``."""
    if not chunked:
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
        return token_sums(logits[:, :-1], input_ids[:, 1:], valid, byte_lengths)
    with hidden_states(model) as box:
        model(input_ids=input_ids, attention_mask=attention_mask)
    return sums(box["hidden"][:, :-1], head_of(model), input_ids[:, 1:], valid, byte_lengths, chunk)


@torch.no_grad()
def sums(hidden: torch.Tensor, head: torch.nn.Linear, targets: torch.Tensor, valid: torch.Tensor,
         byte_lengths: torch.Tensor | None, chunk: int) -> torch.Tensor:
    """[nats, tokens, correct, bytes] (float64) of next-token predictions from ``hidden`` (…, d) for ``targets``
    (…) at the ``valid`` positions, a chunk of positions at a time (evaluation)."""
    valid = valid.reshape(-1).bool()
    h = hidden.reshape(-1, hidden.shape[-1])[valid]
    t = targets.reshape(-1)[valid]
    mm_dtype = _mm_dtype(h.device) or head.weight.dtype
    w = head.weight.to(mm_dtype)
    b = None if head.bias is None else head.bias.to(mm_dtype)
    # [nats, tokens, correct, bytes] summed where the hidden states are: no host sync per chunk
    out = torch.zeros(4, dtype=torch.float64, device=h.device)
    out[1] = len(t)
    step = chunk_size(w.shape[0], chunk)
    with torch.autocast(h.device.type, enabled=False):
        for s in range(0, len(t), step):
            logp = torch.log_softmax(F.linear(h[s:s + step].to(mm_dtype), w, b).float(), dim=-1)
            tc = t[s:s + step]
            out[0] -= logp.gather(1, tc[:, None]).sum(dtype=torch.float64)
            out[2] += (logp.argmax(-1) == tc).sum()
    if byte_lengths is not None:
        out[3] = byte_lengths.to(t.device)[t].sum()
    return out


def _mm_dtype(device: torch.device) -> torch.dtype | None:
    """The autocast dtype in effect for ``device`` (the head's matmul runs in it, as autocast would), or None."""
    return torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else None


class _ChunkedNLL(torch.autograd.Function):
    """Summed negative log-likelihood of ``targets`` under ``hidden @ weight.T (+ bias)``, chunk by chunk,
    with its gradients computed in the forward pass (see the module docstring)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, chunk, mm_dtype, tally=None, terms=None):
        need_h, need_w = hidden.requires_grad, weight.requires_grad
        need_b = bias is not None and bias.requires_grad
        ctx.dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
        h, w = hidden.detach().to(mm_dtype), weight.detach().to(mm_dtype)
        b = None if bias is None else bias.detach().to(mm_dtype)
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        grad_b = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if need_b else None
        total = torch.zeros((), dtype=torch.float64, device=hidden.device)
        rows = torch.arange(min(chunk, len(targets)), device=hidden.device)
        with torch.autocast(hidden.device.type, enabled=False):
            for s in range(0, h.shape[0], chunk):
                hc, tc = h[s:s + chunk], targets[s:s + chunk]
                if terms is not None and not need_b:  # fused: the gradient comes in the head's matmul dtype
                    nll, hits, g = terms(F.linear(hc, w, b), tc)
                    total += nll
                else:
                    logp = torch.log_softmax(F.linear(hc, w, b).float(), dim=-1)  # one fused kernel over the chunk
                    total -= logp.gather(1, tc[:, None]).sum(dtype=torch.float64)
                    hits = (logp.argmax(-1) == tc).sum() if tally is not None else None
                    if need_h or need_w or need_b:
                        g = logp.exp_()  # softmax, in place
                        g[rows[:len(tc)], tc] -= 1.0  # minus the one-hot target: d(nll)/d(logits)
                        if need_b:
                            grad_b += g.sum(0)
                        g = g.to(mm_dtype)
                if tally is not None:
                    tally[0] += hits
                    tally[1] += len(tc)
                if need_h:
                    grad_h[s:s + chunk] = g @ w
                if need_w:
                    if mm_dtype == torch.float32:
                        grad_w.addmm_(g.t(), hc)
                    else:
                        grad_w += (g.t() @ hc).float()
        ctx.save_for_backward(grad_h, grad_w, grad_b)
        return total.float()

    @staticmethod
    def backward(ctx, grad_out):
        grad_h, grad_w, grad_b = ctx.saved_tensors
        h_dtype, w_dtype, b_dtype = ctx.dtypes
        return (None if grad_h is None else (grad_h * grad_out).to(h_dtype),
                None if grad_w is None else (grad_w * grad_out).to(w_dtype),
                None if grad_b is None else (grad_b * grad_out).to(b_dtype),
                None, None, None, None, None)
