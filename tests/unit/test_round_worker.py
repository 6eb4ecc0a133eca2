"""A round worker's weights (strategies/round_worker.global_weights): from the update to the copy this process or
another on its host holds, from the whole weights, or none (the driver then sends them)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from sparklm.strategies import round_worker
from sparklm.strategies.base import RoundSpec
from sparklm.strategies.codec import Codec, encode_forward, forward_without
from sparklm.strategies.round_worker import inner_dir


def _spec(step0: int, base_step: int | None) -> RoundSpec:
    return RoundSpec(round=1, step0=step0, steps=2, total_steps=8, eval=False, persist="", finish=False,
                     time_frac0=None, time_frac_per_step=0.0, shards=((0, 2), (1, 2)), base_step=base_step)


@pytest.fixture
def job(request):
    uid = f"unit-{request.node.name}"
    yield SimpleNamespace(uid=uid)
    import shutil

    shutil.rmtree(inner_dir(uid), ignore_errors=True)


def test_a_worker_without_the_weights_says_so_and_one_on_the_same_host_reads_its_copy(job):
    from safetensors.numpy import save

    g = np.random.default_rng(0)
    w0 = {"x": g.standard_normal((64, 64)).astype(np.float32)}
    own = {"x": torch.zeros(64, 64)}
    # round 0: the whole weights; this process and this host keep them
    got = round_worker.global_weights(job, _spec(0, None), lambda: save(w0), None, hold=True, own=own)
    assert torch.equal(got["x"], torch.from_numpy(w0["x"]))
    mine, other = (Codec("topk", density=0.05).encode({"x": g.standard_normal((64, 64)).astype(np.float32)})
                   for _ in range(2))
    down = forward_without(encode_forward([mine, other], [1.0, 1.0], workers=[0, 1], lr=1.0, senders=True), 0)

    def update() -> bytes:
        return down

    # a process without its own payload, given no whole weights: nothing to build from
    assert round_worker.global_weights(job, _spec(2, 0), None, update, hold=True, own=own) is None
    # with it: the update applied to the copy it holds
    a = round_worker.global_weights(job, _spec(2, 0), None, update, hold=True, own=own, mine=lambda: mine)
    # a new process on the same host (no copy in memory) reads the host's copy of step 0 and gets the same weights
    round_worker._HELD.clear()
    b = round_worker.global_weights(job, _spec(2, 0), None, update, hold=True, own=own, mine=lambda: mine)
    assert torch.equal(a["x"], b["x"]) and not torch.equal(a["x"], got["x"])
    kept = sorted(p.name for p in inner_dir(job.uid).glob("held-*"))
    assert kept == ["held-step0000000.safetensors", "held-step0000002.safetensors"]
