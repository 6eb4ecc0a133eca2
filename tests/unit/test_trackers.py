"""The trackers' pure parts: what waits for a flush, what a rewind drops, the figures each tracker logs."""

from __future__ import annotations

import pytest

from sparklm.config import Config, TrackingConfig
from sparklm.infra.errors import SparklmError
from sparklm.metrics import rows, trackers


def _eval(step: int) -> rows.Eval:
    return rows.Eval(step=step, tokens=step, figures={"val_loss": 1.0 / step})


def test_pending_rows_go_out_in_step_order_and_a_rewind_drops_what_runs_again():
    p = trackers.Pending()
    for row in (_eval(8), rows.Note(message="hi"), _eval(4), _eval(6)):
        p.add(row)  # a note has no step: no tracker curve
    p.rewind(6, evaluated=True)
    assert [s for s, _ in p.take()] == [4, 6]
    assert p.take() == []
    p.add(_eval(6))
    p.rewind(6, evaluated=False)  # the checkpoint precedes its own evaluation: that evaluation comes again
    assert p.take() == []


def test_figures_are_named_by_kind_and_summaries_flatten():
    assert trackers.numbers(_eval(4)) == {"eval/tokens": 4.0, "eval/val_loss": 0.25}
    assert trackers.summary_figures({"final": {"val_bpb": 1.5, "note": "x"}, "steps": 10, "ok": True,
                                     "strategy": "ddp"}) == {"final/val_bpb": 1.5, "steps": 10.0}
    manifest = {"splits": {"train": {"tokens": 100, "bytes_per_token": 1.5}}, "timing": {"seconds": 2.0},
                "tokenizer": {"vocab_size": 300}}
    assert trackers.manifest_figures(manifest) == {"splits": {"train_tokens": 100.0, "train_bytes_per_token": 1.5},
                                                   "timing": {"seconds": 2.0}}


def test_a_tracker_without_its_package_or_with_a_password_in_its_uri_is_one_line(monkeypatch):
    missing = trackers.Registered(lambda t: True, "mlflow_tracker", "sparklm_no_such_package", "mlflow")
    monkeypatch.setitem(trackers.TRACKERS, "mlflow", missing)
    with pytest.raises(SparklmError, match="needs the sparklm_no_such_package package") as e:
        trackers.check(Config())
    assert "pip install 'sparklm[mlflow]'" in e.value.hint
    monkeypatch.undo()
    with pytest.raises(SparklmError, match="holds a password"):
        trackers.check(Config().replace(tracking=TrackingConfig(mlflow_uri="http://u:secret@host:5000")))
    assert trackers.enabled(Config().replace(tracking=TrackingConfig(tensorboard=True, wandb_project="p")),
                            "prepare") == ["wandb"]  # TensorBoard has nothing to show of a prepare
