"""Fitting a fresh model to a time budget (``model.fit_budget``): a short budget trains a smaller model.

A budget of seconds trains on as many tokens as the machine computes in that time. Too few tokens for the
parameters and a smaller model ends lower: on Tiny Shakespeare, 2 layers × 128 beat 4 × 256 at 26 s and at
95 s of training, in bf16 and in fp32 (BENCHMARKS.md, time to quality). The rule: of the configured shape,
half its width, then half its layers too, the first that the budget trains on at least
``TOKENS_PER_PARAM`` tokens per non-embedding parameter, else the smallest. The tokens are estimated before Spark
starts from the host's measured matmul peak (peak.py), the model's FLOPs per token and whether it compiles, so it
applies in local mode, where the driver's host is the ranks'; on a cluster the model is as configured. The choice
is written to the run's config.json (with fit_budget off), so a resumed run builds the same model.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from ..config import Config, ModelConfig, embedding_rows
from .memory import scratch_shapes
from .peak import matmul_peak

# Share of the matmul peak (peak.py) a training step reaches, measured here for these shapes: bf16 autocast
# 25-36% (its square-matmul peak is far above what small layers get), float32 54-65%.
ASSUMED_MFU = {"bfloat16": 0.33, "float32": 0.6}
# A compiled run (train.compile) is faster than ASSUMED_MFU: the main job's 4 x 256 ran 1.13x the tokens/s compiled
# (BENCHMARKS.md), and uncounted its fit sat on the rule's edge (0.44-0.46), where a peak measured 4% low chose
# 4 x 128, 0.009 bits/byte worse. Measured on the CPU; a GPU's larger gain is not counted.
COMPILED_SPEEDUP = 1.13
# Calibrated on measured runs (BENCHMARKS.md), in estimated tokens: 4 × 128 at ~0.34 tokens per parameter (fp32,
# 26 s of Tiny Shakespeare) ended above 2 × 128 at ~1.0; the main job's 4 × 256 at ~0.54 (bf16, 360 s) ended
# level with 4 × 128 (~1.5) and below 2 × 256 (~0.9); with BPE 8192, its 4 × 256 at 0.44 ended 0.01 bits/byte
# above 4 × 128.
TOKENS_PER_PARAM = 0.45
MIN_WIDTH = 64


@dataclass(frozen=True)
class Fit:
    model: ModelConfig
    tokens: float  # the estimated tokens the budget trains on with this model
    per_param: float  # ... per non-embedding parameter


def flops_per_token(cfg: ModelConfig, vocab: int, context: int) -> float:
    """Training FLOPs per token of a fresh model (build.flops_per_token's estimate, from the shapes alone)."""
    s = scratch_shapes(cfg, vocab, context)
    untied_head = 0 if cfg.tie_embeddings else s.vocab * s.hidden
    return 6.0 * (s.params - untied_head) + 12.0 * s.layers * s.hidden * context  # the head counts once, tied or not


def non_embedding(cfg: ModelConfig, vocab: int, context: int) -> int:
    """Parameters outside the token (and position) embeddings and the LM head."""
    s = scratch_shapes(cfg, vocab, context)
    embeddings = s.vocab * s.hidden * (1 if cfg.tie_embeddings else 2) + (context * s.hidden if cfg.arch == "gpt2"
                                                                           else 0)
    return s.params - embeddings


def shapes(cfg: ModelConfig) -> list[ModelConfig]:
    """The shapes tried, in order: the configured one, half its width, then half its layers too. Depth is kept
    longest: on the main job 4 × 128 matched 4 × 256 where 2 × 256 fell 0.03 bits/byte behind."""
    out = [cfg]
    half = cfg.n_embd // 2
    if half >= MIN_WIDTH and half % cfg.n_head == 0:
        out.append(replace(cfg, n_embd=half, intermediate=cfg.intermediate // 2))
    if cfg.n_layer > 1:
        out.append(replace(out[-1], n_layer=cfg.n_layer // 2))
    return out


def estimates(cfg: ModelConfig, *, vocab: int, context: int, tokens_for: Callable[[float], float]) -> list[Fit]:
    """Each of :func:`shapes` with its estimated tokens; ``tokens_for(flops_per_token)`` estimates them."""
    fits = []
    for c in shapes(cfg):
        tokens = tokens_for(flops_per_token(c, vocab, context))
        fits.append(Fit(c, tokens, tokens / max(non_embedding(c, vocab, context), 1)))
    return fits


def choose(fits: list[Fit]) -> Fit:
    """The first of ``fits`` that trains on at least ``TOKENS_PER_PARAM`` tokens per non-embedding parameter, else
    the last (the smallest)."""
    return next((f for f in fits if f.per_param >= TOKENS_PER_PARAM), fits[-1])


def apply(config: Config, *, vocab: int, context: int, train_tokens: int, master: str) -> tuple[Config, str | None]:
    """``config`` (its dtype and threads decided: resolve.settings) with the model fitted to its time budget, and a
    line saying what changed (None: nothing)."""
    tc, mc = config.train, config.model
    if not (mc.fit_budget and tc.time_budget and not mc.init_from and master.startswith("local")):
        return config, None
    mfu = ASSUMED_MFU[tc.dtype] * (COMPILED_SPEEDUP if tc.compile == "on" else 1.0)
    speed = mfu * matmul_peak(tc.threads, tc.dtype) * tc.workers  # FLOP/s of all the ranks
    per_step = tc.batch_size * tc.grad_accum * tc.workers * context
    limits = [tc.max_steps * per_step, tc.max_tokens, tc.epochs * train_tokens]  # 0: unset

    def tokens_for(flops: float) -> float:
        return min([speed * tc.time_budget / flops, *(x for x in limits if x > 0)])

    vocab = embedding_rows(vocab)
    fits = estimates(mc, vocab=vocab, context=context, tokens_for=tokens_for)
    chosen = choose(fits)
    fitted = config.replace(model=replace(chosen.model, fit_budget=False))
    if chosen.model == mc:
        return fitted, None
    full = fits[0].per_param
    return fitted, (f"model: {chosen.model.n_layer} layers × {chosen.model.n_embd} for the {tc.time_budget:g} s budget "
                    f"(~{chosen.tokens / 1e6:.2f} M tokens at this machine's measured speed; "
                    f"{mc.n_layer} × {mc.n_embd} would train on {full:.2f} tokens per parameter); "
                    "model.fit_budget = false keeps the configured size")
