"""The training core without Spark: schedule, step plan, stream resume, checkpoints, resume config, LM sums."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from sparklm.config import Config, TrainConfig, diff, from_dict, merge
from sparklm.data.stream import TokenStream, row_groups
from sparklm.infra.errors import SparklmError
from sparklm.launch.train import peak_mb, resume_config
from sparklm.metrics.recorder import Best
from sparklm.model.figures import lm_figures
from sparklm.model.lm_head import token_sums
from sparklm.model.task import IGNORE, make_batch
from sparklm.train import checkpoint
from sparklm.train.core import fraction
from sparklm.train.plan import OptimizerPlan
from sparklm.train.schedule import steps as step_plan

# -- the schedule ---------------------------------------------------------------------------------


def test_lr_warms_up_linearly_then_follows_a_cosine_to_the_floor():
    tc = OptimizerPlan.of(TrainConfig(lr=1e-2, warmup_steps=4, min_lr_ratio=0.1))
    assert [tc.lr_at(s, 0.0) for s in range(4)] == pytest.approx([2.5e-3, 5e-3, 7.5e-3, 1e-2])
    assert tc.lr_at(10, 0.0) == pytest.approx(1e-2)
    assert tc.lr_at(10, 0.5) == pytest.approx(1e-3 + 0.5 * 9e-3)
    assert tc.lr_at(10, 1.0) == pytest.approx(1e-3)
    assert tc.lr_at(10, 3.0) == pytest.approx(1e-3)  # past the end: the floor
    lrs = [tc.lr_at(s, s / 100) for s in range(4, 100)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))


def test_fraction_is_by_steps_or_by_time_whichever_is_further():
    assert fraction(5, 10, 100.0, 0.0) == 0.5
    assert fraction(5, None, 30.0, 60.0) == 0.5
    assert fraction(5, 10, 54.0, 60.0) == pytest.approx(0.9)
    assert fraction(0, None, 0.0, 0.0) == 0.0


# -- the step plan ----------------------------------------------------------------------------------


def test_best_tracks_the_lowest_validation_loss_and_counts_evaluations_since():
    best = Best()
    assert not best.update(5, {}) and best.step is None  # no figures (no validation split): nothing recorded
    losses = {10: 3.0, 20: 2.5, 30: 2.6, 40: 2.5, 50: 2.4, 60: 2.45, 70: 2.41}
    news = [best.update(step, {"val_loss": v, "val_bpb": v / 2}) for step, v in losses.items()]
    assert news == [True, True, False, False, True, False, False]  # equal is not better: the earlier one is kept
    assert best.step == 50 and best.stale == 2 and best.summary() == {"step": 50, "val_loss": 2.4, "val_bpb": 1.2}
    assert best.should_stop(2) and not best.should_stop(3) and not best.should_stop(0)
    again = Best.from_state(best.to_state())  # through a checkpoint's JSON state
    assert again == best and Best.from_state(None) == Best()


def test_plan_takes_the_smallest_limit_and_one_epoch_by_default():
    tc = TrainConfig(batch_size=8, grad_accum=2)
    p = step_plan(tc, train_rows=1000, seq_len=64, workers=2)
    assert p.rows_per_step == 32 and p.tokens_per_step == 32 * 64 and p.total_steps == math.ceil(1000 / 32)
    assert step_plan(TrainConfig(max_steps=7, epochs=5.0), train_rows=1000, seq_len=64, workers=1).total_steps == 7
    assert step_plan(TrainConfig(max_steps=700, epochs=0.5), train_rows=800, seq_len=64, workers=1).total_steps == 50
    assert step_plan(TrainConfig(max_tokens=64 * 8 * 3), train_rows=800, seq_len=64, workers=1).total_steps == 3
    assert step_plan(TrainConfig(time_budget=60), train_rows=800, seq_len=64, workers=1).total_steps is None
    with pytest.raises(SparklmError, match="fewer than one global batch"):
        step_plan(TrainConfig(batch_size=8), train_rows=15, seq_len=64, workers=2)


# -- the data stream resumes exactly ----------------------------------------------------------------


@pytest.fixture
def parquet_rows(tmp_path):
    seq = 4
    files = []
    for f in range(3):
        ids = np.arange(f * 1000, f * 1000 + 37 * seq, dtype=np.int64).reshape(-1, seq)
        table = pa.table({"input_ids": pa.array(list(ids), type=pa.list_(pa.int32()))})
        path = tmp_path / f"part-{f}.parquet"
        pq.write_table(table, path, row_group_size=10)
        files.append(str(path))
    return row_groups(files), seq


def test_arrow_values_convert_as_numpy_would_and_reading_rows_imports_no_pandas(parquet_rows):
    import subprocess
    import sys

    from sparklm.data.stream import to_numpy

    for values in (pa.array(range(-5, 20), pa.int32()).slice(3, 12), pa.array([1, 0, 1], pa.int8()),
                   pa.array([70000, 3], pa.uint32()), pa.array([True, False])):
        got = to_numpy(values, np.int64)
        assert got.dtype == np.int64 and got.flags.writeable
        assert np.array_equal(got, np.asarray(values, dtype=np.int64))
    groups, seq = parquet_rows
    code = ("import sys\n"
            "from sparklm.data.stream import read_rows, row_groups\n"
            f"rows = read_rows(row_groups([{groups[0].path!r}])[0], {seq})\n"
            "print(rows.input_ids.shape, 'pandas' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.stdout.strip() == f"(10, {seq}) False", out.stdout + out.stderr


def test_stream_started_at_a_position_is_the_tail_of_the_stream_from_zero(parquet_rows):
    groups, seq = parquet_rows
    def take(start, n, rank=0, world=1):
        it = iter(TokenStream(groups, seq_len=seq, batch_size=4, rank=rank, world=world, seed=3, window=2,
                              start=start))
        return [next(it)[0].copy() for _ in range(n)]

    whole = take(0, 60)  # past one epoch (111 rows)
    for k in (1, 7, 27, 40):
        tail = take(4 * k, 60 - k)
        assert all(np.array_equal(a, b) for a, b in zip(whole[k:], tail))
    # two ranks together see exactly the rows one rank sees with twice the batch, in the same order
    one = iter(TokenStream(groups, seq_len=seq, batch_size=8, seed=3, window=2))
    r0, r1 = take(0, 10, 0, 2), take(0, 10, 1, 2)
    for i in range(10):
        assert np.array_equal(next(one)[0], np.concatenate([r0[i], r1[i]]))


def test_an_elastic_resize_keeps_the_global_batch_and_each_steps_rows(parquet_rows):
    """DDP resized at a restart (plan.at): every world the run may take is planned on the driver (and recorded:
    config.json keeps the plan), with the same rows per optimizer step, split into micro-batches no larger than the
    plan's, and each step reads the same global rows whatever the world — none repeated, none skipped."""
    from sparklm.infra.errors import SparklmError
    from sparklm.train.plan import RunPlan, elastic_world, make

    def resized(plan, world):
        return plan.at(world) if world in plan.worlds else None

    groups, seq = parquet_rows
    config = from_dict({"train": {"workers": 4, "workers_min": 1, "batch_size": 3, "grad_accum": 1, "max_steps": 9,
                                  "threads": 1, "device": "cpu", "dtype": "float32"}})
    full = make(config, train_rows=111, seq_len=seq)
    assert full.steps.rows_per_step == 12
    shapes = {w: (p.config.train.batch_size, p.config.train.grad_accum) if (p := resized(full, w)) else None
              for w in range(1, 6)}
    assert shapes == {1: (3, 4), 2: (3, 2), 3: (2, 2), 4: (3, 1), 5: None}
    assert all(resized(full, w).steps == full.steps for w in (1, 2, 3, 4))
    assert RunPlan.from_dict(json.loads(full.to_json())).worlds == full.worlds  # as config.json keeps it
    with pytest.raises(SparklmError, match="no world of 5 workers"):
        full.at(5)
    # an evaluation covers the same rows: eval_batches x micro-batch x workers stays 20 x 3 x 4
    assert [(lambda t: t.eval_batches * t.batch_size * t.workers)(resized(full, w).config.train)
            for w in (1, 2, 3, 4)] == [240] * 4
    assert [elastic_world(full, n) for n in (1, 2, 3, 4, 8)] == [1, 2, 3, 4, 4]
    fewest_two = make(config.replace(train=replace(config.train, workers_min=2)), train_rows=111, seq_len=seq)
    assert sorted(fewest_two.worlds) == [2, 3, 4] and elastic_world(fewest_two, 1) is None  # fewer slots than that

    def step_rows(world: int, start_step: int, steps: int) -> list[list[bytes]]:
        b, accum = resized(full, world).config.train.batch_size, resized(full, world).config.train.grad_accum
        streams = [iter(TokenStream(groups, seq_len=seq, batch_size=b, rank=r, world=world, seed=3, window=2,
                                    start=start_step * 12)) for r in range(world)]
        return [sorted(row.tobytes() for it in streams for _ in range(accum) for row in next(it)[0])
                for _ in range(steps)]

    reference = step_rows(4, 0, 14)  # past one epoch (111 rows)
    for world, at in ((1, 0), (2, 5), (3, 9), (1, 11)):
        assert step_rows(world, at, 14 - at) == reference[at:], (world, at)


# -- checkpoints round-trip ---------------------------------------------------------------------------


def test_checkpoint_round_trip_and_pruning(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(5, 4)).sum().backward()
    opt.step()
    ckpts = str(tmp_path / "checkpoints")
    tensors, groups = checkpoint.optimizer_tensors(opt)
    for step in (2, 4, 6):
        checkpoint.save(ckpts, step, files={"model": checkpoint.model_tensors(model), "optimizer": tensors},
                        state={"param_groups": groups, "note": "x"}, keep=2)
    assert [p.rsplit("/", 1)[1] for p in checkpoint.completed(ckpts)] == ["step-0000004", "step-0000006"]
    last = checkpoint.completed(ckpts)[-1]
    state = checkpoint.read_state(last)
    assert state["step"] == 6 and state["note"] == "x"
    other = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    other_opt = torch.optim.AdamW(other.parameters(), lr=1e-3)
    checkpoint.load_model_tensors(other, checkpoint.read_tensors(last, "model"), last)
    checkpoint.load_optimizer(other_opt, checkpoint.read_tensors(last, "optimizer"), state["param_groups"])
    for a, b in zip(model.parameters(), other.parameters()):
        assert torch.equal(a, b)
    assert torch.equal(opt.state_dict()["state"][0]["exp_avg"], other_opt.state_dict()["state"][0]["exp_avg"])
    assert checkpoint.read_tensors(last, "missing") == {}
    (tmp_path / "checkpoints" / "step-0000006" / "state.json").write_text("{garbled")
    with pytest.raises(SparklmError, match="unreadable"):
        checkpoint.read_state(last)
    # the newest unreadable: a warning, and the one before it; both unreadable: the error, and no warning that
    # promises an older checkpoint that is not there
    warned = []
    found = checkpoint.newest_readable(ckpts, lambda p: checkpoint.read_state(p), warn=warned.append)
    assert found["step"] == 4 and len(warned) == 1 and "resuming from the checkpoint before it" in warned[0]
    (tmp_path / "checkpoints" / "step-0000004" / "state.json").write_text("{garbled")
    warned.clear()
    with pytest.raises(SparklmError, match="step-0000004 is unreadable"):
        checkpoint.newest_readable(ckpts, lambda p: checkpoint.read_state(p), warn=warned.append)
    assert len(warned) == 1  # only the newest one's, which had an older one to fall back to


# -- the configuration of a resumed run ---------------------------------------------------------------


def test_resume_keeps_the_saved_config_and_applies_only_what_is_set_now():
    saved = from_dict({"train": {"lr": 1e-3, "batch_size": 16, "seed": 7, "max_steps": 10}})
    cont = resume_config(saved, {"train": {"max_steps": 20}})
    assert (cont.train.lr, cont.train.batch_size, cont.train.seed, cont.train.max_steps) == (1e-3, 16, 7, 20)
    # setting a data-order key to the value it had is no change
    assert resume_config(saved, {"train": {"seed": 7}}).train.seed == 7
    for key, value in (("seed", 1337), ("batch_size", 8), ("grad_accum", 2), ("workers", 2)):
        with pytest.raises(SparklmError, match=f"cannot change train.{key} when resuming"):
            resume_config(saved, {"train": {key: value}})
    # another world size that keeps the global batch (16 rows a step) resumes: 2 workers of 8, or 4 of 4 x 1 ...
    assert resume_config(saved, {"train": {"workers": 2, "batch_size": 8}}).train.workers == 2
    assert resume_config(saved, {"train": {"workers": 4, "batch_size": 2, "grad_accum": 2}}).train.grad_accum == 2
    with pytest.raises(SparklmError, match="global batch would be 32 rows, not 16"):
        resume_config(saved, {"train": {"workers": 2, "batch_size": 16}})


def test_config_diff_and_merge():
    c = from_dict({"train": {"lr": 1e-3, "rounds": {"sync_every": 4}}, "spark": {"conf": {"a": "1"}}})
    d = diff(c)
    assert d == {"train": {"lr": 1e-3, "rounds": {"sync_every": 4}}, "spark": {"conf": {"a": "1"}}}
    assert merge(Config(), d) == c


# -- the LM sums: one function for training's evaluation and `sparklm eval` ---------------------------


def test_token_sums_match_a_direct_computation():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 11, generator=gen)
    targets = torch.randint(0, 11, (2, 5), generator=gen)
    valid = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    byte_lengths = torch.arange(11, dtype=torch.float64)
    nats, tokens, correct, nbytes = token_sums(logits, targets, valid, byte_lengths).tolist()
    mask = valid.bool()
    ref = torch.nn.functional.cross_entropy(logits[mask], targets[mask], reduction="sum")
    assert nats == pytest.approx(float(ref), rel=1e-6) and tokens == 8
    assert correct == float((logits.argmax(-1)[mask] == targets[mask]).sum())
    assert nbytes == float(byte_lengths[targets[mask]].sum())
    f = lm_figures(nats, tokens, correct, nbytes)
    assert f["loss"] == pytest.approx(nats / 8) and f["perplexity"] == pytest.approx(math.exp(nats / 8))
    assert f["bits_per_byte"] == pytest.approx(nats / nbytes / math.log(2))
    assert lm_figures(1e6, 1, 0, 1)["perplexity"] == math.exp(700)  # capped, not an overflow
    from sparklm.tasks.causal_lm import CausalLM

    named = CausalLM().figures([nats, tokens, correct, nbytes])
    assert named["val_loss"] == pytest.approx(f["loss"]) and named["val_bpb"] == f["bits_per_byte"]
    assert named["val_tokens"] == 8 and lm_figures(0, 0, 0, 0) == {} and CausalLM().figures([0.0] * 4) == {}


def test_padded_positions_get_no_loss():
    ids = np.array([[5, 6, 7, 0]], dtype=np.int64)
    b = make_batch(ids, np.array([[1, 1, 1, 0]], dtype=np.int8))
    assert b.labels.tolist() == [[5, 6, 7, IGNORE]] and b.attention_mask.dtype == torch.long
    assert make_batch(ids, None).attention_mask is None


# -- optimizers -----------------------------------------------------------------------------------


@pytest.mark.parametrize("rule", ["match_rms_adamw", "original", None])
def test_muon_batched_by_shape_steps_as_torchs_muon(rule):
    """sparklm's Muon orthogonalizes same-shaped matrices together; the weights it makes are torch's Muon's (to
    bfloat16's rounding, from batched products), tall matrices included, and its state dict loads into torch's."""
    from sparklm.train import optim

    torch.manual_seed(0)
    shapes = [(32, 32), (32, 32), (48, 32), (32, 48), (48, 32), (16, 64)]
    start = [torch.randn(s) for s in shapes]
    grads = [[torch.randn(s) for s in shapes] for _ in range(3)]

    def run(cls):
        params = [torch.nn.Parameter(w.clone()) for w in start]
        opt = cls(params, lr=0.02, weight_decay=0.1, adjust_lr_fn=rule)
        for step in grads:
            for p, g in zip(params, step, strict=True):
                p.grad = g.clone()
            opt.step()
        return params, opt

    ours, opt = run(optim.Muon)
    theirs, _ = run(torch.optim.Muon)
    for a, b, w in zip(ours, theirs, start, strict=True):
        moved = (b - w).abs().max()
        assert moved > 0.01  # the weights moved, by several updates' worth
        assert (a - b).abs().max() <= 0.02 * moved
    torch.optim.Muon([torch.nn.Parameter(w.clone()) for w in start]).load_state_dict(opt.state_dict())


def test_muon_with_adamw_checkpoints_as_one_optimizer():
    from sparklm.config import ModelConfig
    from sparklm.model.build import build_model
    from sparklm.tasks.causal_lm import CausalLM
    from sparklm.train import optim

    task, muon_plan = CausalLM(), OptimizerPlan.of(TrainConfig(lr=1e-2, optimizer="muon"))

    def fresh():
        model = build_model(ModelConfig(n_layer=1, n_head=2, n_embd=32, tie_embeddings=False), vocab_size=64,
                            context=16, bos_id=0, eos_id=1, pad_id=2)
        params = list(task.trainable(model).values())
        return model, optim.build(params, muon_plan, decays=task.decays(model), matrices=task.matrices(model))

    x = torch.randint(0, 64, (2, 16))

    def step(model, opt):
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()

    a, opt_a = fresh()
    muon, adamw = opt_a.optimizers
    assert isinstance(muon, torch.optim.Muon) and isinstance(adamw, torch.optim.AdamW)
    # Muon gets the hidden matrices only: not the embedding, not the (untied) head, not the norms
    in_muon = {id(p) for g in muon.param_groups for p in g["params"]}
    names = {n for n, p in a.named_parameters() if id(p) in in_muon}
    assert names and all(n.endswith("proj.weight") for n in names), names
    assert len(in_muon) + sum(len(g["params"]) for g in adamw.param_groups) == len(list(a.parameters()))
    step(a, opt_a)
    tensors, groups = checkpoint.optimizer_tensors(opt_a)
    from safetensors.torch import load, save

    tensors = load(save(tensors))  # what a checkpoint holds (optimizer_tensors are views of the live state)
    b, opt_b = fresh()
    b.load_state_dict(a.state_dict())
    checkpoint.load_optimizer(opt_b, tensors, groups)
    for model, opt in ((a, opt_a), (b, opt_b)):
        step(model, opt)
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), n


def test_auto_optimizer_is_muon_only_where_bf16_is_fast():
    from sparklm.train import resolve
    from sparklm.train.peak import bf16_fast

    assert resolve.optimizer(TrainConfig(optimizer="adamw"), 1, pretrained=False) == "adamw"
    assert resolve.optimizer(TrainConfig(optimizer="muon"), 1, pretrained=True) == "muon"
    assert resolve.optimizer(TrainConfig(), 1, pretrained=False) == ("muon" if bf16_fast(1) else "adamw")
    assert resolve.optimizer(TrainConfig(), 1, pretrained=True) == "adamw"


def test_a_plan_of_many_epochs_says_so():
    from sparklm.metrics.recorder import MANY_EPOCHS, epochs_note

    assert epochs_note(MANY_EPOCHS, 1000) is None and epochs_note(1.5, 10) is None
    note = epochs_note(13.2, 174_636)
    assert "~13 epochs of the 174,636 training tokens" in note and "model/ keeps the best" in note


def test_peak_lr_follows_what_trains_unless_set():
    from sparklm.config import from_dict
    from sparklm.train.resolve import FINETUNE_LR, LORA_LR, SCRATCH_LR, peak_lr

    assert peak_lr(from_dict({})) == SCRATCH_LR
    assert peak_lr(from_dict({"model": {"init_from": "m"}})) == FINETUNE_LR
    assert peak_lr(from_dict({"model": {"init_from": "m"}, "lora": {"r": 8}})) == LORA_LR
    assert peak_lr(from_dict({"model": {"init_from": "m"}, "train": {"lr": 2e-4}})) == 2e-4
    assert FINETUNE_LR < LORA_LR < SCRATCH_LR


def test_micro_batches_weigh_by_their_targets_and_an_empty_one_is_a_zero():
    """Instruction data: a step's loss is its summed target losses over its targets, however they fall into
    micro-batches; a micro-batch with no target (all prompt) adds nothing, not a NaN."""
    import numpy as np

    from sparklm.config import ModelConfig
    from sparklm.model.build import build_model
    from sparklm.model.task import make_batch
    from sparklm.tasks.causal_lm import CausalLM

    model = build_model(ModelConfig(n_layer=1, n_head=2, n_embd=16), vocab_size=64, context=16, bos_id=1, eos_id=2,
                        pad_id=0)
    task = CausalLM()
    ids = np.random.default_rng(0).integers(3, 64, (3, 8))
    trains = np.zeros((3, 8), np.int8)
    trains[0, 5:] = 1  # 3 targets
    trains[1, 2:] = 1  # 6 targets; row 2 has none
    whole = task.loss(model, make_batch(ids, None, trains)).item()
    parts = [task.loss(model, make_batch(ids[i:i + 1], None, trains[i:i + 1]), 9) for i in range(3)]
    assert sum(p.item() for p in parts) == pytest.approx(whole, rel=1e-5)
    parts[2].backward()
    assert parts[2].item() == 0.0
    assert all(p.grad is not None and not p.grad.isnan().any() for p in model.parameters())


def test_the_tasks_loss_chunked_or_not_is_the_same():
    """train.loss_chunk -1 keeps the model's own logits and loss: the same value and gradients as the chunked
    loss (benchmarks compare the two end to end)."""
    import numpy as np

    from sparklm.config import ModelConfig
    from sparklm.model.build import build_model
    from sparklm.model.task import make_batch, set_loss_chunks
    from sparklm.tasks.causal_lm import CausalLM

    model = build_model(ModelConfig(n_layer=1, n_head=2, n_embd=16), vocab_size=64, context=16, bos_id=1, eos_id=2,
                        pad_id=0)
    batch = make_batch(np.random.default_rng(1).integers(3, 64, (2, 12)), None, None)
    task, grads = CausalLM(), []
    for chunk in (None, 5):
        set_loss_chunks(model, chunk)
        model.zero_grad()
        loss = task.loss(model, batch)
        loss.backward()
        grads.append((loss.item(), [p.grad.clone() for p in model.parameters()]))
    assert grads[0][0] == pytest.approx(grads[1][0], rel=1e-5)
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(grads[0][1], grads[1][1]))


def test_flops_per_token_counts_frozen_weights_at_four_not_six():
    from sparklm.config import ModelConfig
    from sparklm.model import flops_per_token
    from sparklm.model.build import build_model

    model = build_model(ModelConfig(n_layer=1, n_head=2, n_embd=16), vocab_size=64, context=16, bos_id=1, eos_id=2,
                        pad_id=0)
    full = flops_per_token(model, 16)
    frozen = 0
    for name, p in model.named_parameters():
        if "mlp" in name:
            p.requires_grad_(False)
            frozen += p.numel()
    assert frozen and flops_per_token(model, 16) == full - 2 * frozen


def test_ranks_whose_own_bf16_measurements_disagree_train_with_one_dtype_and_one_optimizer(tmp_path):
    """Two hosts: one measures bf16 3x faster than fp32, the other 2x slower. Each left to decide "auto" would train
    its replica differently (bf16 + Muon against fp32 + AdamW); given the driver's decisions, both ranks use them."""
    import json
    import os
    import subprocess
    import sys

    from sparklm.train.peak import cache_key

    for name, ratio in (("fast", 3.0), ("slow", 0.5)):  # the same CPU model and threads, measured differently
        (tmp_path / name / "sparklm").mkdir(parents=True)
        peaks = {cache_key(2, "float32"): 1e11, cache_key(2, "bfloat16"): 1e11 * ratio}
        (tmp_path / name / "sparklm" / "peak.json").write_text(json.dumps(peaks))

    def host(name: str, driver: bool, given: str = "{}") -> list[str]:
        """On host ``name``: what a plan made there decides, [that plan as the driver ships it,] what a rank that
        reads the plan ``given`` runs with."""
        code = ("import json, sys\n"
                "from sparklm.config import Config\n"
                "from sparklm.train import resolve\n"
                "from sparklm.train.plan import RunPlan, make\n"
                "alone = make(resolve.settings(Config(), 2), train_rows=100, seq_len=64)\n"
                "given = RunPlan.from_dict(json.loads(sys.argv[1])) if sys.argv[1] != '{}' else alone\n"
                "for plan in (alone, given):\n"
                "    print(plan.device.dtype_name, plan.config.train.optimizer)\n"
                + ("print(alone.to_json())\n" if driver else ""))
        env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / name)}
        return subprocess.run([sys.executable, "-c", code, given], env=env, capture_output=True, text=True,
                              check=True).stdout.strip().splitlines()

    fast_alone, _, driver = host("fast", driver=True)
    decided = json.loads(driver)["config"]
    assert (decided["train"]["dtype"], decided["train"]["optimizer"], decided["train"]["lr"]) == ("bfloat16", "muon",
                                                                                                 3e-3)
    slow_alone, slow_given = host("slow", driver=False, given=driver)
    assert (fast_alone, slow_alone) == ("bfloat16 muon", "float32 adamw")  # each deciding alone
    assert host("fast", driver=False, given=driver)[1] == slow_given == "bfloat16 muon"  # given the driver's plan


def test_a_peak_is_the_best_window_not_the_mean():
    """A host busy for part of the measurement: the peak is the rate of its fastest window, not one average."""
    import time

    from sparklm.train.peak import best_rate

    calls = []

    def work():  # the first half of the calls are slowed by another process's burst
        calls.append(1)
        time.sleep(0.004 if len(calls) < 40 else 0.001)

    rate = best_rate(work, 1.0, seconds=0.4, windows=8)
    assert 600 < rate <= 1000  # ~1/0.001 s (sleep overshoots), not the mean ~1/0.0025
    assert best_rate(lambda: time.sleep(0.05), 1.0, seconds=0.01, windows=2) > 0  # a call longer than a window


def test_summary_peak_is_the_exact_reading_unless_an_earlier_segment_logged_more():
    rows = [{"rss_mb": 496.715}, {"rss_mb": None}]  # the CSV keeps 6 significant digits: 496.71484375 rounded up
    assert peak_mb(496.71484375, rows) == 496.71484375
    assert peak_mb(400.0, [{"rss_mb": 512.0}]) == 512.0  # a resumed run's earlier process peaked higher
    assert peak_mb(None, []) == 0.0


def test_the_run_plan_round_trips_records_what_the_memory_plan_changed_and_refuses_a_changed_resume():
    import dataclasses
    import json

    from sparklm.config import from_dict
    from sparklm.infra.errors import SparklmError
    from sparklm.train import memory, resolve
    from sparklm.train.plan import RunPlan, make

    settled = resolve.settings(from_dict({"train": {"dtype": "float32", "optimizer": "adamw", "batch_size": 8,
                                                    "strategy": "diloco"}}), 2)
    shrunk = memory.MemoryPlan(batch_size=2, grad_accum=4, checkpointing=True, estimate=1 << 30, limit=2 << 30,
                               source="train.memory_limit", hand_back=True)
    plan = make(settled, train_rows=1000, seq_len=64, mem=shrunk)
    assert RunPlan.from_dict(json.loads(plan.to_json())) == plan  # as a worker reads it
    tc = plan.config.train  # what runs: the global batch kept, the rest as the memory plan says
    assert (tc.batch_size, tc.grad_accum, tc.grad_checkpoint, tc.allocator) == (2, 4, "on", "return")
    assert plan.steps.rows_per_step == 8 * settled.train.workers  # the global batch the settings asked for
    assert plan.codec == {"name": "int4", "density": settled.train.rounds.density, "bits": settled.train.rounds.bits}
    recorded = plan.record(settled)
    assert "config" not in recorded and recorded["runs"] == {"train.parallel": "replicate", "train.batch_size": 2, "train.grad_accum": 4,
                                                             "train.grad_checkpoint": "on", "train.allocator": "return"}
    assert recorded["memory"]["source"] == "train.memory_limit" and recorded["threads"] == 2
    plan.check_resumable(recorded, "run")  # the same plan resumes
    plan.check_resumable(None, "run")  # a run from before plans were recorded
    other = make(settled.replace(train=dataclasses.replace(settled.train, dtype="bfloat16")), train_rows=1000,
                 seq_len=64)
    with pytest.raises(SparklmError, match="its plan had compute dtype float32, this one bfloat16"):
        other.check_resumable(recorded, "run")
