"""The run loop's two halves, alone: the schedule (pure) and the recorder (rows, best, early stop, the result)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from sparklm.config import TrainConfig
from sparklm.train.recorder import Recorder, RunResult
from sparklm.train.schedule import Schedule
from sparklm.train.sinks import METRIC_COLUMNS


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

    def rewind(self, step):
        self.rows = [r for r in self.rows if r.get("step", 0) <= step]

    def close(self):
        pass


def test_the_recorder_writes_one_kind_of_train_row_and_tracks_the_best():
    sink = Rows()
    rec = Recorder(sink, TrainConfig(early_stop=2), strategy="diloco", workers=2, epoch_tokens=1000)
    rec.info({"params": 10, "flops_per_token": 60.0, "peak_flops": 1000.0, "dtype": "float32"}, 40, sync_every=4)
    row = rec.train(step=4, tokens=500, loss=2.0, lr=1e-3, grad_norm=0.5, tokens_per_s=10.0, ms_per_step=5.0,
                    rss_mb=100.0, peaks=[120.0, None], elapsed=1.0)
    assert set(METRIC_COLUMNS) - {"val_loss", "val_ppl", "val_bpb", "val_acc", "val_tokens"} == set(row)
    assert row["epoch"] == 0.5 and row["mfu"] == 10.0 * 60.0 / (1000.0 * 2) and row["rank_peak_rss_mb"] == "120/-"
    figures = {"val_loss": 3.0, "val_bpb": 1.5}
    assert rec.evaluation(4, 500, figures)  # the first is the best
    assert not rec.evaluation(8, 900, {**figures, "val_loss": 3.1}) and not rec.should_stop("round 2")
    assert not rec.evaluation(12, 1300, {**figures, "val_loss": 3.2}) and rec.should_stop("round 3")
    assert sink.rows[-1] == {"kind": "note", "message": "early stop at round 3: no lower validation loss in 2 "
                                                        "evaluations (best at step 4)"}
    rec.note_peaks([90.0, 140.0])
    result = rec.result(steps=12, tokens=1300, seconds=2.0, rounds=3)
    assert isinstance(result, RunResult) and result.best == {"step": 4, **figures}
    assert result.final["val_loss"] == 3.2 and result.rank_peak_rss_mb == [120.0, 140.0] and result.peak_rss_mb == 140
    assert RunResult.from_dict({**result.to_dict(), "rank": 0}) == result  # as a DDP rank's JSON brings it back


def test_a_rank_that_records_nothing_still_decides_early_stopping():
    quiet = Recorder(None, TrainConfig(early_stop=1), strategy="ddp", workers=2, epoch_tokens=10)
    quiet.evaluation(1, 5, {"val_loss": 1.0})
    quiet.evaluation(2, 10, {"val_loss": 2.0})
    assert quiet.should_stop("step 2")
