"""Rounds of plain Spark tasks: parameter averaging and DiLoCo (train/strategies/rounds.py, rounds_task.py).

The strategy on real Spark local mode against the
single-process loop, against itself with identical data, with a worker failing, and across a resume.
"""

from __future__ import annotations

import csv
import json

import pytest
import torch

from conftest import cfg, figures, plan_for, resumes_bitwise, stopped_copy, weights
from sparklm.launch.train import train
from sparklm.metrics.sinks import read_metrics


def rounds(run_dir):
    with (run_dir / "rounds.csv").open(newline="") as f:
        return list(csv.DictReader(f))


def worst(a, b):
    """Largest difference; a single-process checkpoint also stores the tied LM head (a copy of the embedding)."""
    a = {k: v for k, v in a.items() if k != "lm_head.weight" or k in b}
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


# -- the strategy on Spark -------------------------------------------------------------------


def test_one_worker_in_rounds_equals_the_single_process_loop(spark, dataset, tmp_path):
    plain, rounds_ = tmp_path / "plain", tmp_path / "rounds"
    train(dataset, output=str(plain), config=cfg(max_steps=6, samples=0), spark=spark)
    s = train(dataset, output=str(rounds_), config=cfg(max_steps=6, samples=0, strategy="average", sync_every=3),
              spark=spark)
    assert s["rounds"] == 2 and s["steps"] == 6
    assert worst(weights(plain), weights(rounds_)) <= 1e-6
    # the inner losses of the rounds are the single-process losses
    la = [r["loss"] for r in read_metrics(plain / "metrics.csv") if r["kind"] == "train"]
    assert [float(r["loss"]) for r in rounds(rounds_)] == pytest.approx([sum(la[:3]) / 3, sum(la[3:]) / 3], abs=1e-5)
    assert s["final"]["val_loss"] == pytest.approx(
        read_metrics(plain / "metrics.csv")[-1]["val_loss"], abs=1e-5)
    for name in ("model/model.safetensors", "samples.txt", "loss.png", "summary.json", "rounds.csv"):
        assert (rounds_ / name).exists() or name == "samples.txt", name


def test_two_workers_averaging_identical_data_equal_one_worker(spark, dataset, tmp_path):
    from sparklm.metrics.sinks import Sinks
    from sparklm.strategies import Job, get

    def run(name, workers, shards):
        config = cfg(max_steps=4, samples=0, strategy="average", sync_every=2)
        run_dir = tmp_path / name
        run_dir.mkdir()
        job = Job(plan_for(config, dataset, workers=workers), data=dataset, run_dir=str(run_dir), resume=False,
                  uid=name)
        get("average").run(spark, job, Sinks([]), shards=shards)
        return weights(run_dir)

    one = run("one", 1, None)
    two = run("two", 2, [(0, 1), (0, 1)])  # both workers stream the one-worker shard
    assert worst(one, two) <= 1e-6


@pytest.mark.parametrize("codec", ["fp32", "auto"])
def test_diloco_learns_and_accounts_its_communication(spark, dataset, tmp_path, codec):
    run = tmp_path / "diloco"
    s = train(dataset, output=str(run), config=cfg(max_steps=12, samples=0, strategy="diloco", sync_every=4,
                                                   workers=2, eval_every=4, codec=codec), spark=spark)
    rows = rounds(run)
    assert len(rows) == 3 and all(r["workers_done"] == "2" for r in rows)
    losses = [float(r["loss"]) for r in rows]
    assert losses[-1] < losses[0]
    params = s["params"]
    if codec == "fp32":  # each round: the weights to 2 workers, 2 fp32 deltas back (tied embeddings counted once)
        assert all(int(r["returned_bytes"]) == 2 * 4 * params for r in rows)
        assert all(int(r["broadcast_bytes"]) >= 2 * 4 * params for r in rows)
    else:  # the default, int4 both ways (4 bits and a bfloat16 scale per 64 values); round 0 sends no weights
        int4 = 2 * params * 4.25 / 8
        assert all(int4 <= int(r["returned_bytes"]) < 1.1 * int4 for r in rows)
        assert rows[0]["broadcast_bytes"] == "0" and all(int4 <= int(r["broadcast_bytes"]) < 1.1 * int4
                                                         for r in rows[1:])
        assert json.loads((run / "config.json").read_text())["config"]["train"]["rounds"]["codec"] == "int4"
    assert s["bytes_communicated"] >= sum(int(r["returned_bytes"]) + int(r["broadcast_bytes"]) for r in rows)
    assert all(float(r["outer_update_norm"]) > 0 and float(r["compute_s"]) > 0 for r in rows)
    metrics = read_metrics(run / "metrics.csv")
    evals = [r for r in metrics if r["kind"] == "eval"]
    assert [r["step"] for r in evals] == [4, 8, 12] and evals[-1]["val_loss"] < evals[0]["val_loss"] + 0.5
    # each worker's peak memory: per round, and its largest over the run
    for r in (r for r in metrics if r["kind"] == "train"):
        per_worker = [float(v) for v in r["rank_peak_rss_mb"].split("/")]
        assert len(per_worker) == 2 and min(per_worker) > 0 and r["peak_rss_mb"] == pytest.approx(max(per_worker), abs=1)
    assert len(s["rank_peak_rss_mb"]) == 2 and min(s["rank_peak_rss_mb"]) > 0
    assert s["peak_rss_mb"] == max(s["rank_peak_rss_mb"])
    ckpt = sorted((run / "checkpoints").glob("step-*"))[-1]
    assert (ckpt / "outer.safetensors").is_file() and (ckpt / "inner" / "w1.safetensors").is_file()


def test_a_worker_that_fails_is_left_out_of_the_round(spark, dataset, tmp_path, monkeypatch):
    # local[2] gives a task one attempt: worker 1 fails in round 1 for good; the round averages worker 0 alone
    monkeypatch.setenv("SPARKLM_INJECT_FAULT", "round=1,worker=1,attempts=9,at=start")
    run = tmp_path / "fewer"
    s = train(dataset, output=str(run), config=cfg(max_steps=6, samples=0, strategy="average", sync_every=2,
                                                   workers=2), spark=spark)
    rows = rounds(run)
    assert [r["workers_done"] for r in rows] == ["2", "1", "2"]
    assert rows[2]["cold"] == "1"  # worker 1's optimizer state of round 1 never came: it restarts fresh
    assert s["steps"] == 6 and s["final"]["val_loss"] > 0


def test_resume_in_rounds_ends_with_the_same_weights(spark, dataset, tmp_path):
    full = tmp_path / "full"
    conf = cfg(max_steps=8, checkpoint_every=4, samples=0, strategy="diloco", sync_every=2, workers=2)
    train(dataset, output=str(full), config=conf, spark=spark)
    stopped = tmp_path / "stopped"
    stopped_copy(full, stopped, after=4, last=8)
    train(None, output=str(stopped), config=conf, resume=True, spark=spark)
    a, b = weights(full), weights(stopped)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    # the rows written after the step-4 checkpoint were rewound, then written again: each step once
    assert figures(stopped) == figures(full) and figures(stopped, "rounds.csv") == figures(full, "rounds.csv")


def test_bad_inputs_in_rounds_are_one_line(spark, dataset, tmp_path):
    from sparklm.infra.errors import SparklmError

    with pytest.raises(SparklmError, match="fewer than one global batch"):
        train(dataset, output=str(tmp_path / "big"), config=cfg(batch_size=100000, max_steps=1, strategy="diloco"),
              spark=spark)
    ddp_run = tmp_path / "ddp"
    train(dataset, output=str(ddp_run), config=cfg(max_steps=2, samples=0), spark=spark)
    with pytest.raises(SparklmError, match="written by strategy ddp, not diloco"):
        train(None, output=str(ddp_run), config=cfg(max_steps=4, strategy="diloco"), resume=True, spark=spark)
    from sparklm.strategies.rounds import parse_fault

    with pytest.raises(SparklmError, match="is not round=R,worker=W"):
        parse_fault("round=one")


# -- what a round sends: codecs, error feedback, the driver's sparse update ---------------------------------------


def test_sparse_diloco_sends_little_both_ways_and_resumes_bitwise(spark, dataset, tmp_path):
    """Top-k deltas in 2 bits with error feedback, no outer momentum (SparseLoCo's rule): the workers return a
    few percent of the fp32 bytes, the driver sends back only the weights that changed, and the residuals kept
    beside the inner optimizer states survive a checkpoint: a resumed run ends with the same weights."""
    full = tmp_path / "full"
    conf = cfg(max_steps=8, checkpoint_every=4, eval_every=4, samples=0, strategy="diloco", sync_every=2, workers=2,
               codec="topk", density=0.05, bits=2, outer_momentum=0.0, outer_lr=1.0, residual_decay=0.95)
    s = train(dataset, output=str(full), config=conf, spark=spark)
    rows = rounds(full)
    dense = 4 * s["trainable_params"]
    assert all(int(r["returned_bytes"]) < 2 * dense / 8 for r in rows), [r["returned_bytes"] for r in rows]
    first, later = int(rows[0]["broadcast_bytes"]), [int(r["broadcast_bytes"]) for r in rows[1:]]
    assert first == 0  # round 0: each worker built the driver's seeded weights itself (their digest says so)
    assert all(0 < b < 2 * dense / 2 for b in later)  # then only the weights that changed
    assert s["bytes_communicated"] < 0.3 * 2 * 2 * dense * len(rows)
    assert float(rows[-1]["loss"]) < float(rows[0]["loss"])
    ckpt = full / "checkpoints" / "step-0000004"
    from safetensors import safe_open

    with safe_open(str(ckpt / "inner" / "w1.safetensors"), "pt") as f:
        assert any(k.startswith("residual/") for k in f.keys())  # the error feedback's remainder is checkpointed
    stopped = tmp_path / "stopped"
    stopped_copy(full, stopped, after=4, last=8)
    train(None, output=str(stopped), config=conf, resume=True, spark=spark)
    a, b = weights(full), weights(stopped)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert figures(stopped, "rounds.csv")[-2:] == figures(full, "rounds.csv")[-2:]


def test_sparseloco_forwards_the_workers_payloads_and_every_side_holds_the_same_weights(spark, dataset, tmp_path):
    """SparseLoCo's downlink: the driver forwards the workers' own Top-k payloads and every side takes the same plain
    SGD step from them — the exported model (worker 0's weights) is bit for bit the driver's checkpoint, the
    downlink is the uplink's payloads as an all-gather moves them (each worker is sent the other's, never its own,
    and no fp32 weights), and a resumed run ends bitwise where the whole one did."""
    from safetensors.torch import load_file

    full = tmp_path / "full"
    conf = cfg(max_steps=8, checkpoint_every=4, eval_every=4, samples=0, strategy="diloco", sync_every=2, workers=2,
               codec="topk", density=0.05, bits=2, outer_momentum=0.0, outer_lr=1.0, residual_decay=0.95,
               downlink="forward")
    s = train(dataset, output=str(full), config=conf, spark=spark)
    rows = rounds(full)
    dense = 4 * s["trainable_params"]
    up = [int(r["returned_bytes"]) for r in rows]
    assert all(u < 2 * dense / 10 for u in up), up
    for prev, r in zip(up, rows[1:]):  # each of the 2 workers is sent the other's payload of the round before
        assert prev <= int(r["broadcast_bytes"]) <= prev + 2 * 1024, (r["broadcast_bytes"], prev)
    ckpt = sorted((full / "checkpoints").glob("step-*"))[-1]
    assert ckpt.name == "step-0000008"
    driver, exported = load_file(str(ckpt / "model.safetensors")), load_file(str(full / "model" / "model.safetensors"))
    assert all(torch.equal(exported[n], driver[n]) for n in driver if n in exported)
    assert float(rows[-1]["loss"]) < float(rows[0]["loss"])
    resumes_bitwise(full, tmp_path / "stopped", after=4, last=8, spark=spark, config=conf)


def test_a_forward_downlink_survives_a_lost_python_worker(spark, dataset, tmp_path, monkeypatch):
    """Worker 1's process dies in round 2: the round averages worker 0 alone; in round 3 the new process Spark starts
    holds no weights in memory and reads this host's copy, so nothing whole is sent; worker 1, which sent nothing in
    round 2, is sent worker 0's payload, and every side still holds the same weights at the end."""
    from safetensors.torch import load_file

    monkeypatch.setenv("SPARKLM_INJECT_FAULT", "round=2,worker=1,at=crash")
    run = tmp_path / "lost"
    conf = cfg(max_steps=10, samples=0, strategy="diloco", sync_every=2, workers=2, codec="topk", density=0.05,
               outer_momentum=0.0, outer_lr=1.0, downlink="forward")
    s = train(dataset, output=str(run), config=conf, spark=spark)
    rows = rounds(run)
    assert [r["workers_done"] for r in rows] == ["2", "2", "1", "2", "2"]
    dense = 4 * s["trainable_params"]
    sent, up = [int(r["broadcast_bytes"]) for r in rows], [int(r["returned_bytes"]) for r in rows]
    assert all(b < dense / 10 for b in sent), sent
    assert up[2] <= sent[3] <= up[2] + 2 * 1024, (sent, up)  # round 2's one payload, to worker 1 only
    driver = load_file(str(sorted((run / "checkpoints").glob("step-*"))[-1] / "model.safetensors"))
    exported = load_file(str(run / "model" / "model.safetensors"))
    assert all(torch.equal(exported[n], driver[n]) for n in driver if n in exported)


@pytest.mark.parametrize("downlink", ["codec", "exact"])
def test_a_dense_lossy_codec_keeps_the_outer_momentum_and_learns(spark, dataset, tmp_path, downlink):
    """int8 deltas under outer momentum, which moves every weight: the driver's step goes back int8-encoded (the
    workers then hold exactly the weights the driver holds: the exported model is its checkpoint's) or whole."""
    from safetensors.torch import load_file

    run = tmp_path / downlink
    s = train(dataset, output=str(run), config=cfg(max_steps=8, samples=0, strategy="diloco", sync_every=2, workers=2,
                                                   eval_every=8, codec="int8", downlink=downlink), spark=spark)
    rows = rounds(run)
    dense = 4 * s["trainable_params"]
    assert all(2 * dense / 4 <= int(r["returned_bytes"]) < 2 * dense / 3 for r in rows)  # a byte and a bit per value
    if downlink == "codec":
        assert all(2 * dense / 4 <= int(r["broadcast_bytes"]) < 2 * dense / 3 for r in rows[1:])
        ckpt = sorted((run / "checkpoints").glob("step-*"))[-1]
        held, exact = load_file(str(ckpt / "model.safetensors")), load_file(str(ckpt / "exact.safetensors"))
        exported = load_file(str(run / "model" / "model.safetensors"))
        assert all(torch.equal(exported[n], held[n]) for n in held if n in exported)
        assert 0 < worst(exact, held) < 0.05  # what the last int8 step did not deliver, kept by the driver
    else:
        assert all(int(r["broadcast_bytes"]) >= 2 * dense for r in rows[1:])  # momentum moves every weight: all
    assert float(rows[-1]["loss"]) < float(rows[0]["loss"]) and s["final"]["val_loss"] < 6
