"""The optimizer: AdamW, or Muon for the hidden weight matrices with AdamW for the rest.

torch has both (``torch.optim.Muon`` since 2.9) but no way to step two optimizers as one, which the
core (per-group learning rates), checkpoints and rounds' inner state need: :class:`Chained` is that,
numbering the parameters across its optimizers as one optimizer would, so a checkpoint is a plain
optimizer state dict.
"""

from __future__ import annotations

import torch

from ..config import TrainConfig


def build(params: list[torch.nn.Parameter], *, decays: set[int], matrices: set[int], tc: TrainConfig,
          name: str = "adamw") -> torch.optim.Optimizer | Chained:
    """Optimizer ``name`` over ``params``: weight decay on those in ``decays``; with Muon, the ``matrices`` go to it."""
    betas = (tc.beta1, tc.beta2)
    if name == "muon":
        hidden = [p for p in params if id(p) in matrices]
        rest = [p for p in params if id(p) not in matrices]
        # match_rms_adamw scales each matrix's update to AdamW's RMS, so one lr and weight decay serve both
        muon = torch.optim.Muon(hidden, lr=tc.lr, weight_decay=tc.weight_decay, adjust_lr_fn="match_rms_adamw")
        return Chained(muon, adamw(rest, decays, tc.weight_decay, tc.lr, betas))
    return adamw(params, decays, tc.weight_decay, tc.lr, betas)


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
