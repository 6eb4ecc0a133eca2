"""The run loop's two halves, alone: the schedule (pure) and the recorder (rows, best, early stop, the result)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from sparklm.config import TrainConfig
from sparklm.metrics import rows
from sparklm.metrics.recorder import Recorder, RunResult
from sparklm.metrics.sinks import TRAIN_COLUMNS, metric_columns
from sparklm.model.figures import LM_FIGURES, Figure, FigureSet
from sparklm.train.schedule import Schedule


@given(total=st.one_of(st.none(), st.integers(1, 200)), every=st.integers(0, 50), step=st.integers(1, 250))
def test_one_step_units_follow_the_step_cadence(total, every, step):
    s = Schedule(total, every, every)
    want = bool(every) and step % every == 0 and (total is None or step < total)
    assert s.evaluate(step - 1, step) == s.checkpoint(step - 1, step) == want


@given(total=st.one_of(st.none(), st.integers(1, 300)), sync=st.integers(1, 40), every=st.integers(0, 60))
def test_a_round_evaluates_when_it_crossed_a_multiple_and_is_not_the_last(total, sync, every):
    s = Schedule(total, every, 0)
    step, due = 0, []
    while not s.finished(step) and step < 300:
        n = s.unit(step, sync)
        assert n >= 1 and (total is None or step + n <= total)
        crossed = any(every and m % every == 0 for m in range(step + 1, step + n + 1))
        assert s.evaluate(step, step + n) == (crossed and (total is None or step + n < total))
        if s.evaluate(step, step + n):
            due.append(step + n)
        step += n
    if sync == 1:  # rounds of one step are the DDP cadence
        assert due == [e for e in range(1, step + 1) if every and e % every == 0 and (total is None or e < total)]


def test_time_budget_and_units():
    s = Schedule(None, 0, 0, time_budget=10.0)
    assert not s.finished(10**6) and not s.out_of_time(9.9) and s.out_of_time(10.0)
    assert Schedule(10, 0, 0).unit(8, 4) == 2 and Schedule(None, 0, 0).unit(8, 4) == 4
    assert not Schedule(10, 0, 0, time_budget=0.0).out_of_time(10**9)


class Rows:
    def __init__(self):
        self.rows = []

    def write(self, row):
        self.rows.append(row)

    def rewind(self, step, evaluated=True):
        self.rows = [r for r in self.rows if getattr(r, "step", 0) <= step]

    def flush(self):
        pass

    def close(self):
        pass


def test_the_recorder_writes_one_kind_of_train_row_and_tracks_the_best():
    sink = Rows()
    rec = Recorder(sink, TrainConfig(early_stop=2), strategy="diloco", workers=2, epoch_tokens=1000,
                   figures=LM_FIGURES)
    rec.info({"params": 10, "flops_per_token": 60.0, "peak_flops": 1000.0, "dtype": "float32"}, 40, sync_every=4)
    row = rec.train(step=4, tokens=500, loss=2.0, lr=1e-3, grad_norm=0.5, tokens_per_s=10.0, ms_per_step=5.0,
                    rss_mb=100.0, peaks=[120.0, None], elapsed=1.0)
    assert isinstance(sink.rows[0], rows.Info) and sink.rows[0].sync_every == 4 and sink.rows[0].params == 10
    assert list(row.to_dict()) == TRAIN_COLUMNS  # the same fields from every strategy, in metrics.csv's order
    assert metric_columns(LM_FIGURES) == TRAIN_COLUMNS + ["val_loss", "val_ppl", "val_bpb", "val_acc", "val_tokens"]
    assert row.epoch == 0.5 and row.mfu == 10.0 * 60.0 / (1000.0 * 2) and row.rank_peak_rss_mb == "120/-"
    figures = {"val_loss": 3.0, "val_bpb": 1.5}
    assert rec.evaluation(4, 500, figures)  # the first is the best
    assert not rec.evaluation(8, 900, {**figures, "val_loss": 3.1}) and not rec.should_stop("round 2")
    assert not rec.evaluation(12, 1300, {**figures, "val_loss": 3.2}) and rec.should_stop("round 3")
    assert sink.rows[-1] == rows.Note("early stop at round 3: no lower validation loss in 2 evaluations (best at "
                                      "step 4)")
    assert sink.rows[-2] == rows.Eval(step=12, tokens=1300, figures={**figures, "val_loss": 3.2})
    rec.note_peaks([90.0, 140.0])
    result = rec.result(steps=12, tokens=1300, seconds=2.0, rounds=3)
    assert isinstance(result, RunResult) and result.best == {"step": 4, **figures}
    assert result.final["val_loss"] == 3.2 and result.rank_peak_rss_mb == [120.0, 140.0] and result.peak_rss_mb == 140
    assert RunResult.from_json(result.to_json()) == result  # as a DDP rank's JSON brings it back


def test_an_mfu_above_the_peak_warns_once_that_the_cached_peak_is_low():
    sink = Rows()
    rec = Recorder(sink, TrainConfig(), strategy="ddp", workers=1, epoch_tokens=1000, figures=LM_FIGURES)
    rec.info({"params": 10, "flops_per_token": 60.0, "peak_flops": 1000.0, "dtype": "float32"}, 40)
    for step, speed in ((1, 10.0), (2, 20.0), (3, 30.0), (4, 40.0)):  # MFU 60%, 120%, 180%, 240%
        rec.train(step=step, tokens=100 * step, loss=2.0, lr=1e-3, grad_norm=0.5, tokens_per_s=speed, ms_per_step=5.0,
                  rss_mb=100.0, peaks=[100.0], elapsed=1.0)
    (warning,) = [r for r in sink.rows if isinstance(r, rows.Warn)]
    assert sink.rows.index(warning) == 3 and "MFU 120% is above 100%" in warning.message  # after step 2's row
    assert "peak.json" in warning.message


def test_a_rank_that_records_nothing_still_decides_early_stopping():
    quiet = Recorder(None, TrainConfig(early_stop=1), strategy="ddp", workers=2, epoch_tokens=10, figures=LM_FIGURES)
    quiet.evaluation(1, 5, {"val_loss": 1.0})
    quiet.evaluation(2, 10, {"val_loss": 2.0})
    assert quiet.should_stop("step 2")


def test_the_best_follows_the_loss_the_task_names():
    """A task whose figures are not a language model's (a classifier: error rate, F1) gets the same best and early
    stopping, and the console shows its own figures."""
    classifier = FigureSet((Figure("val_xent", "xent", "cross-entropy", ".3f"), Figure("val_f1", "f1", "F1", ".2f")),
                           loss="val_xent", headline="val_f1")
    sink = Rows()
    rec = Recorder(sink, TrainConfig(early_stop=1), strategy="ddp", workers=1, epoch_tokens=10, figures=classifier)
    assert rec.evaluation(1, 5, {"val_xent": 0.7, "val_f1": 0.5}) and not rec.evaluation(2, 9, {"val_xent": 0.8,
                                                                                                 "val_f1": 0.6})
    assert rec.best.step == 1 and rec.should_stop("step 2")
    assert classifier.line(sink.rows[0].figures) == "cross-entropy 0.700 | F1 0.50"
    assert classifier.main.label == "F1" and metric_columns(classifier)[-2:] == ["val_xent", "val_f1"]


def test_every_row_kind_survives_the_json_a_rank_sends():
    samples = [rows.Info(strategy="ddp", workers=2, total_steps=None, params=5, threads=1),
               rows.Train(step=1, epoch=0.1, tokens=64, loss=2.5, lr=1e-3, grad_norm=0.3, tokens_per_s=100.0,
                          ms_per_step=9.0, mfu=0.2, rss_mb=10.0, peak_rss_mb=11.0, rank_peak_rss_mb="11/10", elapsed=0.5,
                          acc=0.25),
               rows.Eval(step=2, tokens=128, figures={"val_loss": 2.0, "val_bpb": 1.1}),
               rows.Round(round=1, step=4, workers=2, workers_done=1, tokens=9, loss=2.0, inner_losses="2.0", attempts="0",
                          cold="", broadcast_bytes=1, returned_bytes=2, broadcast_s=0.1, fetch_s=0.1, compute_s=1.0,
                          aggregate_s=0.1, round_s=1.3, outer_update_norm=0.2, delta_norm=0.3, elapsed=2.0),
               rows.Note("a note"), rows.Warn("a warning")]
    for row in samples:
        assert rows.from_dict(json.loads(json.dumps(row.to_dict()))) == row
    assert rows.ROUND_COLUMNS[-1] == "elapsed" and "eta_s" not in rows.ROUND_COLUMNS  # the progress line's only
    with pytest.raises(ValueError):
        rows.from_dict({"kind": "gossip"})


def _tr(step: int, epoch: float, loss: float, acc: float = 0.5, elapsed: float | None = None) -> dict:
    return {"step": step, "epoch": epoch, "tokens": step * 10, "loss": loss, "acc": acc, "lr": 0.1 * step,
            "elapsed": step if elapsed is None else elapsed, "peak_rss_mb": 100.0 + step}


def test_epoch_rows_sum_the_train_rows_of_each_pass():
    from sparklm.metrics.epochs import epoch_rows

    train = [_tr(2, 0.4, 4.0, 0.1), _tr(4, 0.8, 3.0, 0.2), _tr(6, 1.2, 2.0, 0.3),  # epoch 1 ends at step 6's row
             _tr(8, 1.6, 1.0, 0.4), _tr(10, 2.0, 1.0, 0.5),  # epoch 2 ends exactly at step 10
             _tr(12, 4.4, 0.5, float("nan"))]  # a row that ends two epochs (3 and 4) at once; no accuracy
    got = epoch_rows(train)
    assert [(e.epoch, e.step, e.steps) for e in got] == [(1, 6, 6), (2, 10, 4), (3, 12, 2), (4, 12, 2)]
    assert got[0].loss == pytest.approx(3.0) and got[0].acc == pytest.approx(0.2)  # each row covers 2 steps
    assert got[0].lr == pytest.approx(0.6) and got[0].epoch_s == 6 and got[0].tokens_per_s == pytest.approx(10)
    assert got[0].ms_per_step == pytest.approx(1000) and got[0].peak_rss_mb == 106
    assert got[1].loss == 1.0 and got[1].epoch_s == 4 and math.isnan(got[2].acc)
    assert epoch_rows(train[:2]) == []


def test_the_epoch_sink_adds_epoch_rows_once_and_forgets_them_on_a_rewind():
    from sparklm.metrics.epochs import EpochRows

    class Keep:
        def __init__(self):
            self.rows, self.rewound = [], []

        def write(self, row):
            self.rows.append(row)

        def rewind(self, step, evaluated=True):
            self.rewound.append(step)
            self.rows = [r for r in self.rows if getattr(r, "step", 0) <= step]

        def flush(self):
            pass

        def close(self):
            pass

    def train_row(step, epoch):
        return rows.Train(step=step, epoch=epoch, tokens=step, loss=1.0, lr=0.1, grad_norm=1.0, tokens_per_s=1.0,
                          ms_per_step=1.0, mfu=0.0, rss_mb=1.0, peak_rss_mb=1.0, rank_peak_rss_mb="1",
                          elapsed=float(step), acc=0.5)

    out = Keep()
    sink = EpochRows(out)
    for step in range(1, 7):
        sink.write(train_row(step, step / 2.5))  # epochs end at steps 3 (1.2) and 5 (2.0)
    assert [(r.epoch, r.step) for r in out.rows if r.kind == "epoch"] == [(1, 3), (2, 5)]
    sink.rewind(4)  # a restart from step 4's checkpoint: epoch 2 ends again, once
    for step in range(5, 7):
        sink.write(train_row(step, step / 2.5))
    assert [(r.epoch, r.step) for r in out.rows if r.kind == "epoch"] == [(1, 3), (2, 5)]
    resumed = EpochRows(Keep(), earlier=[_tr(s, s / 2.5, 1.0) for s in range(1, 5)])  # from metrics.csv
    resumed.write(train_row(5, 2.0))
    assert [(r.epoch, r.steps) for r in resumed.out.rows if r.kind == "epoch"] == [(2, 2)]


def test_regression_figures_are_mse_mae_rmse_and_r2_of_summed_errors():
    from sparklm.tasks.regress import regression_figures

    true = np.array([1.0, 2.0, 3.0, 4.0])
    pred = np.array([1.5, 2.0, 2.0, 4.5])
    err = pred - true
    f = regression_figures(float((err ** 2).sum()), 4, float(np.abs(err).sum()), float(true.sum()),
                           float((true ** 2).sum()))
    assert f["loss"] == pytest.approx(0.375) and f["mae"] == pytest.approx(0.5)
    assert f["rmse"] == pytest.approx(math.sqrt(0.375)) and f["examples"] == 4
    assert f["r2"] == pytest.approx(1 - 1.5 / 5.0)  # 1 − SSE/SST, SST = Σ(y − ȳ)² = 5
    assert regression_figures(0.0, 0, 0.0, 0.0, 0.0) == {}
    assert math.isnan(regression_figures(1.0, 2, 1.0, 4.0, 8.0)["r2"])  # constant targets: R² undefined


def test_a_task_is_its_module_and_a_registry_line():
    """The registry names each task's module; the task's module alone says what it is: no code outside a task's
    module compares anything with a task's name (it asks a capability the task declares), and a task added as
    regression was is named nowhere else."""
    import ast
    import re

    from sparklm import registry

    assert set(registry.TASK_NAMES) == {"causal-lm", "classify", "mlm", "regress"}
    for name in registry.TASK_NAMES:
        info = registry.task(name)
        assert info.name == name and info.figures.loss in info.figures.keys()
    assert registry.preparing() == ["causal-lm", "classify", "mlm", "regress"]
    assert registry.generators() == ["causal-lm"]
    src = Path(__file__).resolve().parents[2] / "src" / "sparklm"
    named = [str(p.relative_to(src)) for p in src.rglob("*.py") if re.search(r"\bregress\b", p.read_text())]
    assert sorted(named) == ["registry.py", "tasks/regress.py"], named
    tested = []
    for path in src.rglob("*.py"):
        where = str(path.relative_to(src))
        if where.startswith("tasks/") or where == "registry.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare):
                sides = [node.left, *node.comparators]
                consts = [c.value for side in sides for c in ast.walk(side) if isinstance(c, ast.Constant)]
                if any(c in registry.TASK_NAMES for c in consts):
                    tested.append(f"{where}:{node.lineno}")
    assert not tested, f"a task's name tested outside its module: {tested}"
