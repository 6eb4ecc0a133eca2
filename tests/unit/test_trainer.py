"""A worker's Trainer driven directly, without Spark: steps on a dataset written here with pyarrow, an evaluation
with the task's named figures, and a checkpoint that a new Trainer resumes from bit for bit."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from conftest import plan_for
from sparklm.config import TokenizerConfig, from_dict
from sparklm.data import tokenizer
from sparklm.data.manifest import PreparedDataset
from sparklm.model.figures import LM_FIGURES
from sparklm.model.task import loss_chunk
from sparklm.train import compiling
from sparklm.train.core import Trainer

SEQ = 16


def _dataset(tmp_path, spec, text: str) -> PreparedDataset:
    """A prepared dataset as prepare lays it out (Parquet rows of SEQ token ids per split, a manifest), made without
    Spark: the training split from the first 80% of ``text``, the validation split from the rest."""
    ids = np.array(spec.tokenizer().encode(text, add_special_tokens=False).ids, dtype=np.int32)
    rows = ids[:len(ids) // SEQ * SEQ].reshape(-1, SEQ)
    cut = int(len(rows) * 0.8)
    splits = {}
    for split, part in (("train", rows[:cut]), ("validation", rows[cut:])):
        path = tmp_path / "data" / split / "part-0.parquet"
        path.parent.mkdir(parents=True, exist_ok=True)
        table = pa.table({"input_ids": pa.array(list(part), type=pa.list_(pa.int32())),
                          "doc_id": pa.array(np.zeros(len(part), dtype=np.int64))})
        pq.write_table(table, path, row_group_size=8)
        splits[split] = {"sequences": len(part), "tokens": int(part.size),
                         "files": [{"path": f"{split}/part-0.parquet", "rows": len(part), "bytes": path.stat().st_size}]}
    manifest = {"splits": splits, "packing": {"seq_len": SEQ}}
    (tmp_path / "data" / "manifest.json").write_text(json.dumps(manifest))
    return PreparedDataset(uri=str(tmp_path / "data"), manifest=manifest)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from conftest import make_text

    text = make_text(60, seed=3)
    spec = tokenizer.train([text], TokenizerConfig(vocab_size=300))
    data = _dataset(tmp_path_factory.mktemp("trainer"), spec, text)
    # every setting a driver would decide, decided: nothing is measured here
    config = from_dict({"model": {"n_layer": 1, "n_head": 2, "n_embd": 32},
                        "train": {"batch_size": 4, "max_steps": 6, "eval_batches": 2, "dtype": "float32",
                                  "optimizer": "adamw", "lr": 1e-3, "threads": 1, "samples": 0}})
    return config, data, spec


def _steps(trainer: Trainer, n: int) -> list[float]:
    return [loss.item() for loss, *_ in trainer.run_steps(trainer.batches(trainer.state.position), n,
                                                            lambda _: trainer.state.step / 6)]


def test_a_trainer_steps_evaluates_and_resumes_bitwise_without_spark(setup, tmp_path):
    config, data, spec = setup
    torch.set_num_threads(1)
    trainer = Trainer(plan_for(config, data), data, spec)
    first = _steps(trainer, 3)
    assert len(first) == 3 and all(np.isfinite(first)) and trainer.state.step == 3
    assert trainer.state.position == 3 * trainer.steps.rows_per_step == 12
    figures = trainer.evaluate()
    assert set(figures) == set(LM_FIGURES.keys()) and figures["val_tokens"] == 2 * 4 * (SEQ - 1)
    assert figures["val_ppl"] == pytest.approx(np.exp(figures["val_loss"]))
    trainer.save(str(tmp_path))

    rest = _steps(trainer, 3)  # the uninterrupted run
    again = Trainer(plan_for(config, data), data, spec)
    assert again.restore(str(tmp_path)) and again.state.step == 3 and again.state.position == 12
    assert _steps(again, 3) == rest  # the same losses, bit for bit: weights, optimizer state and data position
    for (name, a), b in zip(trainer.model.state_dict().items(), again.model.state_dict().values()):
        assert torch.equal(a, b), name


def test_a_bf16_trainer_on_the_cpu_attention_follows_sdpa_and_resumes_bitwise(setup, tmp_path):
    """train.attention auto in bf16 on the CPU is sparklm's matmul attention (model/attention.py): its losses follow
    SDPA's, and its run resumes bit for bit."""
    from dataclasses import replace

    config, data, spec = setup
    torch.set_num_threads(1)
    bf16 = config.replace(train=replace(config.train, dtype="bfloat16"))
    sdpa = Trainer(plan_for(bf16.replace(train=replace(bf16.train, attention="sdpa")), data), data, spec)
    trainer = Trainer(plan_for(bf16, data), data, spec)
    assert trainer.config.train.attention == "matmul" and trainer.model.config._attn_implementation != "sdpa"
    assert _steps(trainer, 3) == pytest.approx(_steps(sdpa, 3), rel=2e-2)
    trainer.save(str(tmp_path))
    rest = _steps(trainer, 3)
    again = Trainer(plan_for(bf16, data), data, spec)
    assert again.restore(str(tmp_path)) and _steps(again, 3) == rest


@pytest.mark.slow
def test_a_compiled_trainer_learns_as_the_eager_one_and_resumes(setup, tmp_path):
    """train.compile on: after the first step (eager, so that it comes soon) the model's decoder layers are compiled
    in place, its loss stays chunked, its losses follow the eager network's, evaluation runs them eager (no compiling
    for its batches), and its checkpoint is the plain model's, which a new compiled Trainer resumes from, compiled
    from its first step, bit for bit."""
    from dataclasses import replace

    config, data, spec = setup
    torch.set_num_threads(1)
    compiled_config = config.replace(train=replace(config.train, compile="on"))
    eager, compiled = Trainer(plan_for(config, data), data, spec), Trainer(plan_for(compiled_config, data), data, spec)
    for t in (eager, compiled):
        t.wrap()
    layers = compiled.model.model.layers
    first = _steps(compiled, 1) + _steps(eager, 1)
    assert first[0] == first[1] and not any(layer._compiled_call_impl for layer in layers)  # the first step: eager
    assert _steps(compiled, 2) == pytest.approx(_steps(eager, 2), rel=1e-3)
    assert compiling.blocks(compiled.model) == list(layers) and all(layer._compiled_call_impl for layer in layers)
    assert loss_chunk(compiled.model) is not None and not eager.model.model.layers[0]._compiled_call_impl
    torch._dynamo.utils.counters.clear()
    assert compiled.evaluate()["val_loss"] == pytest.approx(eager.evaluate()["val_loss"], rel=1e-3)
    assert not torch._dynamo.utils.counters["frames"]  # evaluation compiled nothing
    compiled.save(str(tmp_path))
    rest = _steps(compiled, 3)
    again = Trainer(plan_for(compiled_config, data), data, spec)
    assert again.restore(str(tmp_path)) and again.state.step == 3
    again.wrap()
    assert all(layer._compiled_call_impl for layer in again.model.model.layers)  # resumed: compiled at once
    assert _steps(again, 3) == rest


def test_lr_reaches_the_optimizer_through_the_plan_alone(setup):
    """``--lr`` reaches torch's optimizer through the run plan's optimizer section, in 8 hops: (1) argparse: ``--lr``
    → ``args["train.lr"]`` (a flag's dest is its config key); (2) cli: → ``Config.train.lr`` (load_raw, from_dict);
    (3) launch/train: ``resolve.settle`` keeps a value that is set (auto only is decided); (4) ``plan.make`` →
    ``OptimizerPlan.of(train)``; (5) the Job carries the plan to the worker (to_json, from_json); (6) ``Trainer``:
    ``new_optimizer()``; (7) ``optim.build(params, plan.optimizer)``; (8) ``adamw(lr=plan.lr)``: ``torch.optim.AdamW``.
    The schedule scales the same section's lr. The settings' own ``train.lr`` is not read on the worker."""
    import dataclasses

    from sparklm.cli import build_parser
    from sparklm.config import load_raw
    from sparklm.train.plan import RunPlan

    config, data, spec = setup
    args = build_parser().parse_args(["train", "--data", "d", "--output", "r", "--lr", "0.0123"])
    set_lr = from_dict(load_raw(None, [], {"train.lr": getattr(args, "train.lr")})).train.lr
    plan = plan_for(config.replace(train=dataclasses.replace(config.train, lr=set_lr, warmup_steps=0)), data)
    shipped = RunPlan.from_dict(json.loads(plan.to_json()))
    trainer = Trainer(shipped, data, spec)
    assert [g["lr"] for g in trainer.optimizer.param_groups] == [0.0123] * len(trainer.optimizer.param_groups)
    # the plan's section is the one the worker reads: a plan whose section says otherwise trains with that
    other = dataclasses.replace(plan, optimizer=dataclasses.replace(plan.optimizer, lr=0.5, warmup_steps=0))
    trainer = Trainer(other, data, spec)
    assert {g["lr"] for g in trainer.optimizer.param_groups} == {0.5} and trainer.config.train.lr == 0.0123
    _steps(trainer, 1)
    assert [g["lr"] for g in trainer.optimizer.param_groups] == pytest.approx([0.5] * len(trainer.optimizer.param_groups))
