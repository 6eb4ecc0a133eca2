"""Fitting a fresh model to a time budget (train.fit): the shapes tried, the rule, the config it writes."""

from __future__ import annotations

import pytest

from sparklm.config import Config, ModelConfig, from_dict
from sparklm.train import budget as fit


def _shape(c: ModelConfig) -> tuple[int, int]:
    return c.n_layer, c.n_embd


def test_the_shapes_tried_are_the_configured_one_then_narrower_then_shallower():
    assert [_shape(c) for c in fit.shapes(ModelConfig())] == [(4, 256), (4, 128), (2, 128)]
    assert [_shape(c) for c in fit.shapes(ModelConfig(n_layer=3, n_embd=96, n_head=4))] == [(3, 96), (1, 96)]  # 48<64
    assert [_shape(c) for c in fit.shapes(ModelConfig(n_layer=1, n_embd=192, n_head=3))] == [(1, 192), (1, 96)]
    halved = fit.shapes(ModelConfig(intermediate=1000))[1]
    assert halved.intermediate == 500 and halved.mlp_hidden == 500


@pytest.mark.parametrize("arch,tied", [("llama", False), ("llama", True), ("gpt2", False)])
def test_flops_and_parameters_match_a_built_model(arch, tied):
    from sparklm.model.build import build_model, flops_per_token, param_count

    cfg = ModelConfig(arch=arch, n_layer=2, n_embd=64, n_head=2, tie_embeddings=tied, qk_norm=arch == "llama")
    model = build_model(cfg, vocab_size=320, context=32, bos_id=0, eos_id=1, pad_id=2)
    assert fit.flops_per_token(cfg, 320, 32) == flops_per_token(model, 32)
    head = 0 if tied else model.get_output_embeddings().weight.numel()
    assert fit.non_embedding(cfg, 320, 32) == param_count(model, non_embedding=True) - head - (
        32 * 64 if arch == "gpt2" else 0)


def test_the_first_shape_with_enough_tokens_per_parameter_else_the_smallest():
    cfg, v, t = ModelConfig(), 4096, 256

    def at(tokens_per_flop):  # the estimate: tokens ∝ 1 / FLOPs per token
        return fit.choose(fit.estimates(cfg, vocab=v, context=t, tokens_for=lambda flops: tokens_per_flop / flops))

    big = fit.non_embedding(cfg, v, t) * fit.flops_per_token(cfg, v, t) * fit.TOKENS_PER_PARAM
    assert _shape(at(big).model) == (4, 256)  # exactly enough for the configured shape
    chosen = at(big * 0.99)
    assert _shape(chosen.model) == (4, 128) and chosen.per_param >= fit.TOKENS_PER_PARAM
    assert _shape(at(1.0).model) == (2, 128)  # nothing has enough: the smallest


def _config(**train) -> Config:
    return from_dict({"train": {"threads": 1, "dtype": "float32", **train}})


def test_apply_fits_only_fresh_models_with_a_time_budget_in_local_mode():
    kw = dict(vocab=4096, context=256, train_tokens=10**6)
    short = _config(time_budget=0.5)
    fitted, note = fit.apply(short, master="local[2]", **kw)
    assert _shape(fitted.model) == (2, 128) and not fitted.model.fit_budget  # written as run: a resume keeps it
    assert note.startswith("model: 2 layers × 128 for the 0.5 s budget") and "fit_budget = false" in note
    for unchanged, master in [(short, "spark://10.0.0.1:7077"), (_config(max_steps=10), "local[2]"),
                              (short.replace(model=ModelConfig(fit_budget=False)), "local[2]")]:
        out, note = fit.apply(unchanged, master=master, **kw)
        assert _shape(out.model) == (4, 256) and note is None
    long = _config(time_budget=10**7)
    assert fit.apply(long, master="local", **kw)[1] is None
    # the other limits bound the estimate: 10 steps of 8 x 256 tokens in a week of budget is still 20k tokens
    capped, _ = fit.apply(_config(time_budget=10**7, max_steps=10), master="local", **kw)
    assert _shape(capped.model) == (2, 128)


def test_a_compiled_run_is_fitted_for_its_faster_steps():
    # a budget that eager steps fall short of for the configured 4 x 256 and compiled ones (COMPILED_SPEEDUP) do not
    cfg, v, t = ModelConfig(), 4096, 256
    speed = fit.ASSUMED_MFU["float32"] * fit.matmul_peak(1, "float32")
    budget = fit.TOKENS_PER_PARAM * fit.non_embedding(cfg, v, t) * fit.flops_per_token(cfg, v, t) / speed
    budget /= fit.COMPILED_SPEEDUP ** 0.5  # halfway between the two
    kw = dict(vocab=v, context=t, train_tokens=10**9, master="local[2]")
    eager, note = fit.apply(_config(time_budget=budget, compile="off"), **kw)
    assert _shape(eager.model) != (4, 256) and note
    compiled, note = fit.apply(_config(time_budget=budget, compile="on"), **kw)
    assert _shape(compiled.model) == (4, 256) and note is None
