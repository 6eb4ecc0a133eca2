"""`sparklm tune` (issue 82): an Optuna study whose trials are sparklm runs on the test session's Spark."""

from __future__ import annotations

import json

import optuna
import pytest
from test_report import chromium

from conftest import cfg
from sparklm.cli import main
from sparklm.launch.tune import STUDY, tune

pytestmark = pytest.mark.slow


def test_trials_run_concurrently_a_failed_one_is_recorded_and_the_best_model_is_kept(spark, dataset, tmp_path):
    """A grid of 4: the two with n_head 3 cannot split n_embd 32 and fail with their one line; the study goes on,
    the two others complete (2 at once), report their evaluations, and the better one's model is the study's."""
    out = tmp_path / "search"
    s = tune(dataset, output=str(out), space=["model.n_head=choice(2,3)", "train.lr=choice(0.001,0.004)"],
             trials=4, concurrent=2, sampler="grid", config=cfg(max_steps=4, eval_every=2), spark=spark)
    states = sorted((t["params"]["model.n_head"], t["state"]) for t in s["trials"])
    assert states == [(2, "complete"), (2, "complete"), (3, "fail"), (3, "fail")]
    for t in s["trials"]:
        if t["state"] == "fail":
            assert "must be divisible by model.n_head (3)" in t["error"] and "\n" not in t["error"]
    done = [t for t in s["trials"] if t["state"] == "complete"]
    best = min(done, key=lambda t: t["value"])
    assert s["best"]["number"] == best["number"] and s["best"]["value"] == best["value"]
    assert (out / "trials" / f"trial-{best['number']:04d}" / "model" / "model.safetensors").is_file()
    assert json.loads((out / "best.json").read_text())["best"]["number"] == best["number"]
    page = (out / "report.html").read_text()
    assert page.count("<svg") >= 3 and "must be divisible by model.n_head (3)" in page  # Optuna's plots, the trials
    dom, console, shot = chromium(out / "report.html", tmp_path, "study")  # as a browser shows it: no script, no load
    assert console == [] and dom.count("<svg") == page.count("<svg") and shot.stat().st_size > 30_000
    study = optuna.load_study(study_name=STUDY, storage=f"sqlite:///{out / 'study.db'}")
    for t in study.trials:
        assert t.user_attrs["run_dir"].endswith(f"trial-{t.number:04d}")
        if t.state == optuna.trial.TrialState.COMPLETE:
            assert sorted(t.intermediate_values) == [2, 4]  # each evaluation, reported as the run made it
    # a study there already: one line, nothing run (no Spark needed for it)
    assert main(["tune", "--data", dataset, "-o", str(out), "--space", "train.lr=uniform(0.001,0.01)"]) == 2


def test_resume_runs_the_interrupted_trials_again_and_counts_none_twice(spark, dataset, tmp_path):
    """A killed search leaves a trial running in the study: --resume marks it failed (interrupted, not counted) and
    runs its settings again."""
    out = tmp_path / "search"
    base = cfg(max_steps=2)
    space = ["train.lr=loguniform(0.0001,0.01)"]
    tune(dataset, output=str(out), space=space, trials=1, config=base, spark=spark)
    study = optuna.load_study(study_name=STUDY, storage=f"sqlite:///{out / 'study.db'}")
    killed = study.ask()
    lr = killed.suggest_float("train.lr", 0.0001, 0.01, log=True)  # running when the search was killed
    s = tune(dataset, output=str(out), space=space, trials=2, config=base, spark=spark, resume=True)
    states = [(t["number"], t["state"], t["interrupted"]) for t in s["trials"]]
    assert states == [(0, "complete", False), (1, "fail", True), (2, "complete", False)]
    assert s["trials"][2]["params"]["train.lr"] == pytest.approx(lr)
    assert optuna.load_study(study_name=STUDY, storage=f"sqlite:///{out / 'study.db'}").trials[2].user_attrs[
        "rerun_of"] == 1
    # the study is complete: --resume with the same count runs nothing more
    again = tune(dataset, output=str(out), space=space, trials=2, config=base, spark=spark, resume=True)
    assert len(again["trials"]) == 3


@pytest.mark.parametrize("space, says", [
    ("train.lr=normal(0,1)", "unknown distribution 'normal'"),
    ("train.lrr=uniform(0.001,0.01)", "train.lrr is not a setting (hint: did you mean train.lr?)"),
])
def test_a_bad_space_is_one_line_before_anything_runs(dataset, tmp_path, capsys, space, says):
    assert main(["tune", "--data", dataset, "-o", str(tmp_path / "s"), "--space", space]) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "s").exists()


@pytest.mark.parametrize("strategy", ["ddp", "diloco"])
def test_a_pruned_trial_ends_at_its_next_step_with_its_model(spark, dataset, tmp_path, strategy):
    """The pruner judges each evaluation; a pruned trial's run ends at its next step (the driver tells rank 0, which
    tells the other ranks; a rounds run's driver ends it itself), exports its model and says so in pruned.json."""
    out = tmp_path / "search"
    s = tune(dataset, output=str(out), space=["train.lr=choice(0.003)"], trials=1, metric="val_loss",
             pruner=optuna.pruners.ThresholdPruner(upper=0.0),  # every evaluation is above 0: pruned at the first
             config=cfg(max_steps=40, eval_every=4, strategy=strategy, workers=2, sync_every=4), spark=spark)
    (t,) = s["trials"]
    assert t["state"] == "pruned"
    run = out / "trials" / "trial-0000"
    marked = json.loads((run / "pruned.json").read_text())
    assert marked["pruned_at_step"] == 4 and marked["steps"] < 40, marked
    assert (run / "model" / "model.safetensors").is_file()
