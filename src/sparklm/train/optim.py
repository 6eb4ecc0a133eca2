"""The optimizer: AdamW, or Muon for the hidden weight matrices with AdamW for the rest.

torch has both (``torch.optim.Muon`` since 2.9) but no way to step two optimizers as one, which the
core (per-group learning rates), checkpoints and rounds' inner state need: :class:`Chained` is that,
numbering the parameters across its optimizers as one optimizer would, so a checkpoint is a plain
optimizer state dict. :class:`Muon` is torch's, its orthogonalization batched (its docstring says why).
"""

from __future__ import annotations

import math

import torch

from . import shard
from .plan import OptimizerPlan


def build(params: list[torch.nn.Parameter], plan: OptimizerPlan, *, decays: set[int], matrices: set[int]
          ) -> torch.optim.Optimizer | Chained:
    """The optimizer ``plan`` says (the run plan's optimizer section) over ``params``: weight decay on those in
    ``decays``; with Muon, the ``matrices`` go to it."""
    if plan.name == "muon":
        hidden = [p for p in params if id(p) in matrices]
        rest = [p for p in params if id(p) not in matrices]
        # match_rms_adamw scales each matrix's update to AdamW's RMS, so one lr and weight decay serve both
        muon = Muon(hidden, lr=plan.lr, weight_decay=plan.weight_decay, adjust_lr_fn="match_rms_adamw")
        return Chained(muon, adamw(rest, decays, plan.weight_decay, plan.lr, plan.betas))
    return adamw(params, decays, plan.weight_decay, plan.lr, plan.betas)


def adamw(params: list[torch.nn.Parameter], decays: set[int], weight_decay: float, lr: float,
          betas: tuple[float, float]) -> torch.optim.AdamW:
    groups = [{"params": [p for p in params if id(p) in decays], "weight_decay": weight_decay},
              {"params": [p for p in params if id(p) not in decays], "weight_decay": 0.0}]
    # The fused kernel: one pass over all parameters (on CPU 5x faster than foreach: 10 vs 51 ms per
    # step at 11M parameters here).
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=lr, betas=betas, fused=True)


def parts(optimizer) -> tuple[torch.optim.Optimizer, ...]:
    """The torch optimizers ``optimizer`` steps (a gradient scaler unscales and steps each)."""
    return optimizer.optimizers if isinstance(optimizer, Chained) else (optimizer,)


class Muon(torch.optim.Muon):
    """``torch.optim.Muon`` with the Newton-Schulz iterations of matrices of one shape run together, as batched
    matrix products: the same update, the same hyperparameters and state dict (a ``momentum_buffer`` per matrix).

    torch orthogonalizes one matrix at a time. A small model's matrices are small (256 x 256 in the main job's),
    and a CPU runs products that small below its peak, worse on several threads: the main job's 28 matrices
    (~21 GFLOP in bfloat16, a fifth of its step) took 70.4 ms a step one by one and 58.9 ms stacked by shape on 2
    threads (1.20x), 116.0 against 114.3 ms on 1 (benchmarks/muon_step.py).
    """

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params, grads, bufs = [], [], []
            self._init_group(group, params, grads, bufs)
            momentum = group["momentum"]
            updates = []
            for grad, buf in zip(grads, bufs, strict=True):
                buf.lerp_(grad, 1 - momentum)
                updates.append(grad.lerp(buf, momentum) if group["nesterov"] else buf)
            lr, decay = float(group["lr"]), group["weight_decay"]
            # a sharded matrix (train.parallel shard) is orthogonalized whole: gathered, and each rank keeps its rows
            wholes = [shard.whole(u) for u in updates]
            for p, update in zip(params, orthogonalized(wholes, group["ns_coefficients"], group["ns_steps"],
                                                        group["eps"]), strict=True):
                if shard.is_sharded(p):
                    update = shard.like(update, p)
                p.mul_(1 - lr * decay)
                p.add_(update, alpha=-lr * lr_ratio(group["adjust_lr_fn"], p.shape))
        return loss


def lr_ratio(rule: str | None, shape: torch.Size) -> float:
    """Muon's learning-rate scale for a matrix of ``shape`` (torch's ``adjust_lr_fn``): match_rms_adamw gives its
    update AdamW's RMS (0.2 sqrt(max dim)); the original rule sqrt(max(1, rows / cols))."""
    rows, cols = shape[:2]
    if rule == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    return math.sqrt(max(1.0, rows / cols)) if rule in (None, "original") else 1.0


def orthogonalized(updates: list[torch.Tensor], coefficients: tuple[float, float, float], steps: int,
                   eps: float) -> list[torch.Tensor]:
    """Each matrix of ``updates`` brought near the nearest semi-orthogonal matrix by ``steps`` quintic Newton-Schulz
    iterations in bfloat16 (Muon's), each scaled by its own norm first; matrices of one shape in one batch."""
    a, b, c = coefficients
    tall = [u.shape[0] > u.shape[1] for u in updates]  # turned wide, so that the Gram matrix X X^T is the smaller
    by_shape: dict[tuple[int, ...], list[int]] = {}
    for i, u in enumerate(updates):
        by_shape.setdefault(tuple(u.shape[::-1] if tall[i] else u.shape), []).append(i)
    out: list[torch.Tensor | None] = [None] * len(updates)
    for index in by_shape.values():  # one shape's bfloat16 copies at a time
        x = torch.stack([updates[i].bfloat16().mT if tall[i] else updates[i].bfloat16() for i in index])
        x = x / x.norm(dim=(1, 2), keepdim=True).clamp(min=eps)
        for _ in range(steps):
            gram = x @ x.mT
            x = torch.baddbmm(x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
        for i, y in zip(index, x, strict=True):
            out[i] = y.mT if tall[i] else y
    return out


class Chained:
    """Optimizers stepped as one: ``param_groups``, ``step``, ``zero_grad`` and a single state dict."""

    def __init__(self, *optimizers: torch.optim.Optimizer):
        self.optimizers = optimizers

    @property
    def param_groups(self) -> list[dict]:
        return [g for o in self.optimizers for g in o.param_groups]

    def step(self) -> None:
        for o in self.optimizers:
            o.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.optimizers:
            o.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        state, groups, offset = {}, [], 0
        for o in self.optimizers:
            sd = o.state_dict()
            state.update({pid + offset: st for pid, st in sd["state"].items()})
            groups += [{**g, "params": [pid + offset for pid in g["params"]]} for g in sd["param_groups"]]
            offset += sum(len(g["params"]) for g in o.param_groups)
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, sd: dict) -> None:
        groups, offset = list(sd["param_groups"]), 0
        for o in self.optimizers:
            mine, groups = groups[:len(o.param_groups)], groups[len(o.param_groups):]
            n = sum(len(g["params"]) for g in mine)
            o.load_state_dict({"state": {pid - offset: st for pid, st in sd["state"].items()
                                         if offset <= pid < offset + n},
                               "param_groups": [{**g, "params": [pid - offset for pid in g["params"]]} for g in mine]})
            offset += n
