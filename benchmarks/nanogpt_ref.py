"""A minimal plain-PyTorch nanoGPT-style model and training loop: the baseline of the training benchmarks.

It follows karpathy/nanoGPT's model.py and train.py (GPT: LayerNorm, causal SDPA attention, GELU
MLP, tied embeddings, 0.02 init with scaled residual projections; AdamW with decay on matrices,
linear warmup then cosine decay, gradient clipping) without its I/O, DDP or checkpointing, so
that it measures the same math sparklm runs, with nothing in between.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class GPTConfig:
    block_size: int = 256
    vocab_size: int = 4096
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
    bias: bool = True


class CausalSelfAttention(nn.Module):
    def __init__(self, c: GPTConfig):
        super().__init__()
        self.c_attn = nn.Linear(c.n_embd, 3 * c.n_embd, bias=c.bias)
        self.c_proj = nn.Linear(c.n_embd, c.n_embd, bias=c.bias)
        self.n_head, self.dropout = c.n_head, c.dropout

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))  # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class Block(nn.Module):
    def __init__(self, c: GPTConfig):
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(c.n_embd, bias=c.bias), CausalSelfAttention(c)
        self.ln_2 = nn.LayerNorm(c.n_embd, bias=c.bias)
        self.mlp = nn.Sequential(nn.Linear(c.n_embd, 4 * c.n_embd, bias=c.bias), nn.GELU(),
                                 nn.Linear(4 * c.n_embd, c.n_embd, bias=c.bias))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, c: GPTConfig):
        super().__init__()
        self.config = c
        self.wte, self.wpe = nn.Embedding(c.vocab_size, c.n_embd), nn.Embedding(c.block_size, c.n_embd)
        self.h = nn.ModuleList([Block(c) for _ in range(c.n_layer)])
        self.ln_f = nn.LayerNorm(c.n_embd, bias=c.bias)
        self.lm_head = nn.Linear(c.n_embd, c.vocab_size, bias=False)
        self.wte.weight = self.lm_head.weight  # weight tying
        self.apply(self._init)
        for name, p in self.named_parameters():
            if name.endswith("mlp.2.weight") or name.endswith("c_proj.weight"):  # nanoGPT's two c_proj
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * c.n_layer))

    @staticmethod
    def _init(m):
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)

    def forward(self, idx, targets=None):
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        loss = None if targets is None else F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss

    def flops_per_token(self) -> float:
        """nanoGPT's estimate: 6N (non-position params, LM head included) + 12·L·d·T."""
        c = self.config
        n = sum(p.numel() for p in self.parameters()) - self.wpe.weight.numel()
        return 6 * n + 12 * c.n_layer * c.n_embd * c.block_size


def optimizer(model: GPT, lr: float, betas=(0.9, 0.95), weight_decay: float = 0.1):
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}],
                             lr=lr, betas=betas, foreach=True)


def lr_at(it: int, lr: float, min_lr: float, warmup: int, decay_iters: int) -> float:
    if it < warmup:
        return lr * (it + 1) / (warmup + 1)
    if it > decay_iters:
        return min_lr
    ratio = (it - warmup) / (decay_iters - warmup)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (lr - min_lr)


def train_steps(model: GPT, get_batch, *, steps: int, lr: float, dtype=torch.float32, betas=(0.9, 0.95),
                min_lr: float | None = None, warmup: int = 0, decay_iters: int | None = None, clip: float = 1.0,
                on_step=None) -> list[float]:
    """The nanoGPT inner loop; returns seconds per step (the first steps include warm-up)."""
    opt = optimizer(model, lr, betas)
    times = []
    for it in range(steps):
        t0 = time.perf_counter()
        for g in opt.param_groups:
            g["lr"] = lr_at(it, lr, min_lr if min_lr is not None else lr / 10, warmup, decay_iters or steps)
        x, y = get_batch()
        with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
            _, loss = model(x, y)
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
        if on_step:
            on_step(it, loss)
    return times
