"""The arithmetic of a round, as pure functions: weighted averaging of deltas and the outer step.

A worker's *delta* is ``global − local``: how far its inner steps moved it, with the sign of a
gradient (DiLoCo's "outer gradient"). The outer optimizer is SGD on that pseudo-gradient:

- plain averaging (``average``, DL4J's parameter averaging): lr 1, no momentum — the new global
  weights are exactly the workers' average;
- DiLoCo (``diloco``, Douillard et al. 2023): Nesterov momentum, lr 0.7, momentum 0.9.

The update follows ``torch.optim.SGD(nesterov=True)`` (tested against it): ``buf ← μ·buf + Δ``,
``θ ← θ − lr·(Δ + μ·buf)``; with no buffer yet, ``buf = Δ``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

Tensors = Mapping[str, torch.Tensor]


def weighted_sum(parts: Sequence[tuple[Tensors, float]]) -> dict[str, torch.Tensor]:
    """Σ wᵢ·Δᵢ, name by name (the associative half of the average: what the tree aggregation adds up).
    Works on torch tensors and numpy arrays alike."""
    if not parts:
        raise ValueError("nothing to sum")
    names = parts[0][0].keys()
    for delta, _ in parts[1:]:
        if delta.keys() != names:
            raise ValueError("deltas name different parameters")
    return {n: sum((w * delta[n] for delta, w in parts[1:]), parts[0][1] * parts[0][0][n]) for n in names}


def outer_step(params: Tensors, delta: Tensors, momentum: Tensors | None, *, lr: float, mu: float
               ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor] | None]:
    """New global weights (and momentum buffer) after one outer SGD step; the inputs are left untouched.

    ``mu == 0`` is plain SGD and keeps no buffer; ``mu > 0`` is Nesterov momentum.
    """
    if mu == 0:
        return {n: params[n] - lr * delta[n] for n in params}, None
    buf = {n: (delta[n].clone() if momentum is None else mu * momentum[n] + delta[n]) for n in params}
    return {n: params[n] - lr * (delta[n] + mu * buf[n]) for n in params}, buf


def norm(tensors: Tensors) -> float:
    """The global L2 norm of a set of tensors."""
    return float(torch.sqrt(sum((t.double() ** 2).sum() for t in tensors.values())))
