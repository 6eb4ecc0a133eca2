"""The search-space grammar of `sparklm tune --space` (pure functions)."""

from __future__ import annotations

import pytest

from sparklm.infra.errors import SparklmError
from sparklm.launch.search_space import Dimension, grid, grid_size, nested, parse
from sparklm.launch.tune import direction_of


@pytest.mark.parametrize("text, want", [
    ("train.lr=loguniform(1e-4,1e-2)", Dimension("train.lr", "loguniform", (1e-4, 1e-2))),
    (" train.warmup_frac = uniform(0, 0.2) ", Dimension("train.warmup_frac", "uniform", (0, 0.2))),
    ("model.n_layer=int(2,8)", Dimension("model.n_layer", "int", (2, 8))),
    ("model.n_embd=int(64,256,64)", Dimension("model.n_embd", "int", (64, 256, 64))),
    ("lora.r=logint(4,64)", Dimension("lora.r", "logint", (4, 64))),
    ("model.n_embd=choice(128,256)", Dimension("model.n_embd", "choice", (128, 256))),
    ("train.optimizer=choice(adamw,'muon')", Dimension("train.optimizer", "choice", ("adamw", "muon"))),
    ("train.compile=choice(on, off)", Dimension("train.compile", "choice", ("on", "off"))),
    ("tracking.tensorboard=choice(true,false)", Dimension("tracking.tensorboard", "choice", (True, False))),
])
def test_a_space_as_written(text, want):
    assert parse(text) == want


@pytest.mark.parametrize("text, says", [
    ("train.lr", "is not KEY=DISTRIBUTION"),
    ("train.lr=normal(0,1)", "unknown distribution 'normal'"),
    ("train.lr=loguniform(1e-2,1e-4)", "is not below the upper"),
    ("train.lr=loguniform(0,1)", "log scale needs a lower bound above 0"),
    ("train.lr=uniform(1)", "takes 2 numbers"),
    ("model.n_layer=int(2.5,8)", "whole numbers"),
    ("model.n_layer=int(2,8,0)", "step must be above 0"),
    ("model.n_embd=choice()", "at least one value"),
    ("model.n_embd=choice(1,,2)", "an empty value"),
    ("train.lr=uniform(a,b)", "takes 2 numbers"),
])
def test_a_bad_space_is_one_line(text, says):
    with pytest.raises(SparklmError, match=says) as e:
        parse(text)
    assert "\n" not in e.value.one_line()


def test_nested_grid_and_direction():
    assert nested({"train.lr": 1e-3, "train.rounds.sync_every": 4, "model.n_embd": 64}) == {
        "train": {"lr": 1e-3, "rounds": {"sync_every": 4}}, "model": {"n_embd": 64}}
    dims = [parse("model.n_embd=choice(32,64)"), parse("model.n_layer=int(2,6,2)")]
    assert grid(dims) == {"model.n_embd": [32, 64], "model.n_layer": [2, 4, 6]} and grid_size(dims) == 6
    with pytest.raises(SparklmError, match="continuous"):
        grid([parse("train.lr=uniform(0,1)")])
    assert [direction_of(m) for m in ("val_bpb", "val_loss", "val_acc", "val_macro_f1", "val_r2", "val_rmse")] == [
        "minimize", "minimize", "maximize", "maximize", "maximize", "minimize"]
