"""Choosing the next token: repetition penalty, temperature, top-k, top-p (nucleus) and min-p, as pure functions.

The order and meaning follow ``transformers``' logits processors (repetition penalty, then
temperature, top-k, top-p, min-p), so a sparklm sample and an HF ``generate`` sample mean the same thing.

They work on numpy arrays, not torch tensors: every backend's logits end on the CPU as one (B, V) array, and a backend
that needs no torch (llama.cpp) then starts without importing it (~2 s of a first token's time on a small CPU).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import numpy as np

from ..infra.errors import SparklmError


def _option(default, help: str, metavar: str):
    """A sampling setting with the help text and metavar its ``generate`` flag is made from (one place for both)."""
    return field(default=default, metadata={"help": help, "metavar": metavar})


DEFAULT_NEW_TOKENS = 64  # what max_new_tokens 0 means where the context allows


@dataclass(frozen=True, kw_only=True)
class Sampling:
    """How to pick tokens. ``temperature = 0`` is greedy (the filters then do nothing).

    Each field is a ``sparklm generate`` flag (``top_k`` → ``--top-k``), generated from this metadata."""

    # 0: the default, which must fit any model (fitted): 64, or half the context of a model with less than 128
    max_new_tokens: int = _option(0, "tokens to generate; 0: 64, or half a smaller model's context", "N")
    # EOS is masked until this many tokens are generated (as in HF)
    min_new_tokens: int = _option(0, "no end-of-text before N tokens", "N")
    temperature: float = _option(0.8, "0 = greedy", "T")
    top_k: int = _option(50, "0 = off", "K")  # the CLI's and samples.txt's default too: one place
    top_p: float = _option(1.0, "nucleus sampling; 1 = off", "P")
    # 0.0: off (HF's default). 0.1 here: the main job's samples coined a word (absent from its four books) in 5-10
    # of 192 first sentences without it, 3-4 with it (benchmarks/invented_words.py, BENCHMARKS.md).
    min_p: float = _option(0.1, "drop tokens less likely than P × the likeliest; 0 = off", "P")
    repetition_penalty: float = _option(1.0, "1 = off", "R")
    num_samples: int = _option(1, "samples per prompt", "S")
    seed: int = _option(0, "sampling seed", "X")

    def __post_init__(self):
        checks = [
            (self.max_new_tokens >= 0, "max-new-tokens must be >= 1 (0: the default)"),
            (0 <= self.min_new_tokens and (self.min_new_tokens <= self.max_new_tokens or not self.max_new_tokens),
             "min-new-tokens must be between 0 and max-new-tokens"),
            (self.temperature >= 0, "temperature must be >= 0 (0 = greedy)"),
            (self.top_k >= 0, "top-k must be >= 0 (0 = off)"),
            (0 < self.top_p <= 1, "top-p must be in (0, 1] (1 = off)"),
            (0 <= self.min_p <= 1, "min-p must be in [0, 1] (0 = off)"),
            (self.repetition_penalty > 0, "repetition-penalty must be > 0 (1 = off)"),
            (self.num_samples >= 1, "num-samples must be >= 1"),
        ]
        for ok, message in checks:
            if not ok:
                raise SparklmError(f"invalid sampling setting: {message}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def fitted(self, context: int | None) -> Sampling:
        """These settings for a model of ``context`` tokens: the default length (``max_new_tokens`` 0) becomes 64,
        or half a smaller context, so that a default never fails; a length the user chose stays theirs (and is
        refused in one line if it does not fit)."""
        if self.max_new_tokens:
            return self
        n = min(DEFAULT_NEW_TOKENS, max(1, context // 2)) if context else DEFAULT_NEW_TOKENS
        return dataclasses.replace(self, max_new_tokens=max(n, self.min_new_tokens))


def repetition_penalty(logits: np.ndarray, previous: np.ndarray, penalty: float) -> np.ndarray:
    """CTRL's penalty (as HF): for tokens already in ``previous`` (B, T), divide positive logits by
    ``penalty`` and multiply negative ones. ``previous`` may hold -1 for padding (ignored)."""
    if penalty == 1.0 or previous.size == 0:
        return logits
    seen = np.zeros(logits.shape, dtype=bool)
    rows = np.broadcast_to(np.arange(len(logits))[:, None], previous.shape)
    valid = previous >= 0
    seen[rows[valid], previous[valid]] = True
    penalized = np.where(logits < 0, logits * penalty, logits / penalty)
    return np.where(seen, penalized, logits).astype(logits.dtype, copy=False)


def top_k_filter(logits: np.ndarray, k: int) -> np.ndarray:
    """Keep the ``k`` largest logits per row (ties at the threshold stay), the rest become -inf."""
    width = logits.shape[-1]
    if k <= 0 or k >= width:
        return logits
    threshold = np.partition(logits, width - k, axis=-1)[..., width - k:width - k + 1]
    return np.where(logits < threshold, -np.inf, logits).astype(logits.dtype, copy=False)


def softmax(logits: np.ndarray) -> np.ndarray:
    """Probabilities over the last axis (-inf: probability 0)."""
    e = np.exp(logits - logits.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def top_p_filter(logits: np.ndarray, p: float) -> np.ndarray:
    """Nucleus filtering: keep the smallest set of most likely tokens whose probability reaches ``p``
    (always at least the most likely one); the rest become -inf."""
    if p >= 1.0:
        return logits
    order = np.argsort(-logits, axis=-1, kind="stable")
    sorted_probs = softmax(np.take_along_axis(logits, order, axis=-1))
    # Drop a token when the tokens ranked above it already reach p.
    drop_sorted = (sorted_probs.cumsum(-1) - sorted_probs) >= p
    drop_sorted[..., 0] = False
    drop = np.zeros_like(drop_sorted)
    np.put_along_axis(drop, order, drop_sorted, axis=-1)
    return np.where(drop, -np.inf, logits).astype(logits.dtype, copy=False)


def min_p_filter(logits: np.ndarray, p: float) -> np.ndarray:
    """Min-p filtering: drop the tokens less likely than ``p`` times the row's likeliest one. Unlike a fixed
    top-k or top-p it cuts the tail hard where the model is sure (inside a word) and little where it is not."""
    if p <= 0.0:
        return logits
    # p(t) >= p * p(max)  <=>  logit(t) >= logit(max) + log(p): no softmax needed.
    threshold = logits.max(axis=-1, keepdims=True) + math.log(p)
    return np.where(logits < threshold, -np.inf, logits).astype(logits.dtype, copy=False)


def next_tokens(logits: np.ndarray, sampling: Sampling, generators: list[np.random.Generator] | None,
                previous: np.ndarray | None = None) -> np.ndarray:
    """One token id per row of ``logits`` (B, V). Each row draws from its own generator, so a row's
    text does not depend on which other rows share its batch."""
    logits = np.asarray(logits, dtype=np.float32)
    if previous is not None:
        logits = repetition_penalty(logits, previous, sampling.repetition_penalty)
    if sampling.greedy:
        return logits.argmax(-1)
    logits = top_p_filter(top_k_filter(logits / np.float32(sampling.temperature), sampling.top_k), sampling.top_p)
    probs = softmax(min_p_filter(logits, sampling.min_p))
    generators = generators or [np.random.default_rng() for _ in range(len(probs))]
    return np.array([draw(row, g) for row, g in zip(probs, generators)], dtype=np.int64)


def draw(probs: np.ndarray, generator: np.random.Generator) -> int:
    """One index drawn with probability ``probs`` (one uniform number from ``generator``): inverse CDF in float64,
    so a token of probability 0 is never drawn."""
    cdf = np.cumsum(probs, dtype=np.float64)
    i = int(np.searchsorted(cdf, generator.random() * cdf[-1], side="right"))
    return min(i, int(np.flatnonzero(probs)[-1]))  # u * total rounded up to the total: the last kept token


def row_generator(seed: int, *key: int) -> np.random.Generator:
    """A generator for one output row, seeded from (seed, prompt key, sample index)."""
    h = seed
    for k in key:
        h = (h * 1_000_003 + k) % (2**63 - 1)
    return np.random.Generator(np.random.PCG64(h))
