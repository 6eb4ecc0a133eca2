"""The arithmetic of a round, as pure functions (train/strategies/outer.py): no Spark."""

from __future__ import annotations

import pytest
import torch

from sparklm.strategies import outer


def average(parts):
    """What the rounds driver does with a round's tree-aggregated sum: divide by the total weight."""
    return {n: t / sum(w for _, w in parts) for n, t in outer.weighted_sum(parts).items()}


def test_the_weighted_sum_weights_by_tokens():
    d1 = {"w": torch.tensor([1.0, 2.0]), "b": torch.tensor([0.0])}
    d2 = {"w": torch.tensor([4.0, 8.0]), "b": torch.tensor([3.0])}
    avg = average([(d1, 1.0), (d2, 1.0)])
    assert torch.equal(avg["w"], torch.tensor([2.5, 5.0])) and torch.equal(avg["b"], torch.tensor([1.5]))
    # a worker that saw 3x the tokens counts 3x
    avg = average([(d1, 1.0), (d2, 3.0)])
    assert torch.allclose(avg["w"], torch.tensor([3.25, 6.5])) and torch.allclose(avg["b"], torch.tensor([2.25]))
    with pytest.raises(ValueError):
        outer.weighted_sum([(d1, 1.0), ({"w": d1["w"]}, 1.0)])
    with pytest.raises(ValueError):
        outer.weighted_sum([])


def test_plain_averaging_gives_the_mean_of_the_workers_weights():
    params = {"w": torch.tensor([1.0, -1.0])}
    locals_ = [torch.tensor([0.5, -0.5]), torch.tensor([0.0, 1.0])]
    avg = average([({"w": params["w"] - x}, 1.0) for x in locals_])
    new, buf = outer.outer_step(params, avg, None, lr=1.0, mu=0.0)
    assert buf is None and torch.allclose(new["w"], torch.tensor([0.25, 0.25]))
    assert torch.equal(params["w"], torch.tensor([1.0, -1.0]))  # inputs untouched


def test_outer_nesterov_by_hand():
    # θ=1, lr=0.7, μ=0.9; deltas 0.1 then 0.2:
    # step 1: buf=0.1, update=0.1+0.9*0.1=0.19, θ=1-0.7*0.19=0.867
    # step 2: buf=0.9*0.1+0.2=0.29, update=0.2+0.9*0.29=0.461, θ=0.867-0.7*0.461=0.5443
    p, buf = {"x": torch.tensor([1.0], dtype=torch.float64)}, None
    p, buf = outer.outer_step(p, {"x": torch.tensor([0.1], dtype=torch.float64)}, buf, lr=0.7, mu=0.9)
    assert p["x"].item() == pytest.approx(0.867) and buf["x"].item() == pytest.approx(0.1)
    p, buf = outer.outer_step(p, {"x": torch.tensor([0.2], dtype=torch.float64)}, buf, lr=0.7, mu=0.9)
    assert p["x"].item() == pytest.approx(0.5443) and buf["x"].item() == pytest.approx(0.29)


def test_outer_step_matches_torch_sgd_nesterov():
    gen = torch.Generator().manual_seed(0)
    start = torch.randn(5, 3, generator=gen)
    deltas = [torch.randn(5, 3, generator=gen) for _ in range(4)]
    ref = torch.nn.Parameter(start.clone())
    sgd = torch.optim.SGD([ref], lr=0.7, momentum=0.9, nesterov=True)
    p, buf = {"w": start.clone()}, None
    for d in deltas:
        ref.grad = d.clone()
        sgd.step()
        p, buf = outer.outer_step(p, {"w": d}, buf, lr=0.7, mu=0.9)
    assert torch.allclose(p["w"], ref.detach(), atol=1e-6)
    assert outer.norm({"a": torch.tensor([3.0]), "b": torch.tensor([4.0])}) == pytest.approx(5.0)
