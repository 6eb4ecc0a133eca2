"""``sparklm tune``: a hyperparameter search whose trials are sparklm runs, an Optuna study on the cluster.

Optuna is the search (TPE by default, random, or a grid); the study lives in ``OUTPUT/study.db`` (SQLite) or any
storage URL Optuna takes (a PostgreSQL or MySQL server for a study several drivers share). Each trial is a
``train`` run of its own in ``OUTPUT/trials/trial-NNNN`` with the base settings and the trial's values on top; up to
``concurrent`` trials run at once from threads of this driver, each in a Spark scheduler pool of its own (with
``spark.scheduler.mode=FAIR``, which a session sparklm starts for a search gets, no trial starves the others) and,
in local mode, with the cores shared out among them. A trial that fails is recorded as failed with its one line and
the study goes on; ``--resume`` continues a study, and the trials a killed search left running are marked failed
(``interrupted``) and run again with the same values, never counted twice. Each trial's evaluations are reported to
the study as they come (Optuna's intermediate values); the pruner (median by default, or successive halving) judges
each, and a pruned trial's run ends at its next step — as at its last one, model exported — with ``pruned.json`` in
its run directory.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
import threading
import time
from typing import Any

from ..config import Config, flatten, merge
from ..infra import progress
from ..infra.errors import SparklmError
from ..infra.fs import exists, join, local_path, write_text
from ..infra.runlock import RunLock
from ..metrics import rows, trackers
from ..metrics.sinks import StatelessSink
from . import search_space
from .search_space import Dimension

STUDY = "sparklm"  # the study's name in its storage
_MAXIMIZED = ("acc", "accuracy", "f1", "r2", "auc", "precision", "recall")


def direction_of(metric: str) -> str:
    """Lower is better for losses, perplexity and bits/byte; higher for accuracy-like figures."""
    name = metric.removeprefix("val_").removeprefix("train_")
    return "maximize" if any(name == m or name.endswith("_" + m) for m in _MAXIMIZED) else "minimize"


def tune(data: str, *, output: str, space: list[str] | dict[str, str], trials: int = 16, concurrent: int = 1,
         metric: str = "val_bpb", direction: str = "auto", sampler: str = "tpe", pruner: Any = "median",
         storage: str | None = None, resume: bool = False, seed: int = 0, config: Config | None = None,
         spark=None) -> dict:
    """Search ``space`` (``["train.lr=loguniform(1e-4,1e-2)", ...]`` or ``{"train.lr": "loguniform(1e-4,1e-2)"}``)
    with ``trials`` sparklm runs on ``data``, ``concurrent`` at once; ``pruner``: "median", "halving", "none" or an
    Optuna pruner. Returns the study's summary (best trial, its value, settings and run directory, and every
    trial)."""
    optuna = _optuna()
    dims = [search_space.parse(s) for s in (space if isinstance(space, list)
                                            else [f"{k}={v}" for k, v in space.items()])]
    if not dims:
        raise SparklmError("nothing to search", hint="give --space KEY=DIST(...) at least once")
    base = config or Config()
    _check(base, dims, trials, concurrent, sampler)
    pruning = _pruner(optuna, pruner)
    trackers.check(base, "tune")  # a missing package or a bad setting is one line before anything runs
    url = storage or _default_storage(output)
    direction = direction_of(metric) if direction == "auto" else direction
    with RunLock(output, base.storage):
        if not resume and _holds_study(url, optuna):
            raise SparklmError(f"{output} already holds a study", hint="--resume continues it; or choose another -o")
        study = optuna.create_study(storage=url, study_name=STUDY, direction=direction, load_if_exists=True,
                                    sampler=_sampler(optuna, sampler, dims, seed), pruner=pruning)
        rerun = _interrupted(study, optuna, url) if resume else 0
        left = trials - _counted(study, optuna)
        progress.info(f"tune: {len(dims)} setting(s), {max(left, 0)} of {trials} trial(s) to run, {concurrent} at "
                      f"once, {direction} {metric} (study in {url})" + (f"; {rerun} interrupted trial(s) run again"
                                                                        if rerun else ""))
        # one tracker run for the search, its trials' runs under it (MLflow's children, W&B's group)
        tracking = trackers.open_trackers(base, trackers.Context(
            command="tune", run_dir=output, storage=base.storage, resume=resume,
            params={**flatten(base.to_saved()), **{f"search.space.{d.key}": d.describe() for d in dims},
                    "search.trials": trials, "search.concurrent": concurrent, "search.metric": metric,
                    "search.sampler": sampler, "search.pruner": pruner if isinstance(pruner, str) else "custom"}))
        with trackers.failed_on_error(tracking):
            if left > 0:
                spark = _session(base, spark)
                base = _shared_threads(base, spark, concurrent, dims)
                _run_trials(study, data, output, dims, base, metric, left, concurrent, spark,
                            trackers.parents(tracking))
            out = _summary(study, output, metric, direction, base.storage)
        counts = {s: sum(t["state"] == s for t in out["trials"]) for s in ("complete", "pruned", "fail")}
        trackers.finish_all(tracking, trackers.Outcome(ok=True, summary={
            "best": {metric: out["best"]["value"]} if out["best"] else {}, "trials": counts}))
        return out


def _optuna():
    try:
        import optuna
    except ImportError:
        raise SparklmError("sparklm tune needs Optuna", hint="pip install 'sparklm[tune]' (or optuna)") from None
    optuna.logging.set_verbosity(optuna.logging.ERROR)  # sparklm prints each trial's line itself
    return optuna


def _check(base: Config, dims: list[Dimension], trials: int, concurrent: int, sampler: str) -> None:
    """Every key a setting ``train`` takes, before anything runs. Values are checked by each trial: settings that
    depend on each other (n_embd and n_head) may not take every pair, and such a trial fails with its one line."""
    if trials < 1 or concurrent < 1:
        raise SparklmError(f"--trials {trials} --concurrent {concurrent}: both must be at least 1")
    if sampler not in ("tpe", "random", "grid"):
        raise SparklmError(f"--sampler {sampler!r} is not one of tpe, random, grid")
    seen = set()
    settings = [k for k, v in flatten(base.to_dict()).items() if not isinstance(v, dict)]
    for d in dims:
        if d.key in seen:
            raise SparklmError(f"--space {d.key} is given twice", hint="one distribution per setting")
        seen.add(d.key)
        if d.key not in settings:
            near = difflib.get_close_matches(d.key, settings, 1)
            raise SparklmError(f"--space {d.describe()}: {d.key} is not a setting",
                               hint=f"did you mean {near[0]}?" if near else "`sparklm config` lists every setting")
    if sampler == "grid":
        search_space.grid(dims)  # a continuous range is one line


def _default_storage(output: str) -> str:
    path = local_path(output)
    if path is None:
        raise SparklmError(f"the study of a search in {output} needs a database: SQLite files live on local disk",
                           hint="give --storage URL (e.g. postgresql://host/db), or a local -o")
    path.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{path.resolve() / 'study.db'}"


def _holds_study(url: str, optuna) -> bool:
    if url.startswith("sqlite:///") and not os.path.exists(url.removeprefix("sqlite:///")):
        return False
    return STUDY in {s.study_name for s in optuna.get_all_study_summaries(storage=url)}


def _sampler(optuna, kind: str, dims: list[Dimension], seed: int):
    if kind == "grid":
        return optuna.samplers.GridSampler(search_space.grid(dims), seed=seed)
    if kind == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    return optuna.samplers.TPESampler(seed=seed)


def _pruner(optuna, kind: Any):
    if not isinstance(kind, str):
        return kind  # an Optuna pruner of the caller's
    pruners = {"median": optuna.pruners.MedianPruner, "halving": optuna.pruners.SuccessiveHalvingPruner,
               "none": optuna.pruners.NopPruner}
    if kind not in pruners:
        raise SparklmError(f"--pruner {kind!r} is not one of {', '.join(pruners)}")
    return pruners[kind]()


def _interrupted(study, optuna, url: str) -> int:
    """Trials a killed search left running: failed (marked interrupted, not counted), their values queued again."""
    storage = optuna.storages.get_storage(url)
    study_id = storage.get_study_id_from_name(STUDY)
    n = 0
    for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
        trial_id = storage.get_trial_id_from_study_id_trial_number(study_id, t.number)
        storage.set_trial_user_attr(trial_id, "interrupted", True)
        storage.set_trial_state_values(trial_id, optuna.trial.TrialState.FAIL)
        study.enqueue_trial(t.params, user_attrs={"rerun_of": t.number})
        n += 1
    return n


def _counted(study, optuna) -> int:
    done = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED, optuna.trial.TrialState.FAIL)
    return sum(1 for t in study.get_trials(deepcopy=False, states=done) if not t.user_attrs.get("interrupted"))


def fair(config: Config) -> Config:
    """``config`` whose session shares its executors among the trials' scheduler pools (only the FAIR scheduler
    does; a mode the user set wins): for the session a search starts (here, or the CLI's starter)."""
    return config.replace(spark=dataclasses.replace(
        config.spark, conf={"spark.scheduler.mode": "FAIR", **config.spark.conf}))


def _session(base: Config, spark):
    from ..spark.session import get_session

    if spark is not None:
        return spark() if callable(spark) else spark  # (the CLI's starter, made with fair(): its Ctrl-C, its log)
    return get_session(fair(base).spark)


def _shared_threads(base: Config, spark, concurrent: int, dims: list[Dimension]) -> Config:
    """In local mode the cores are shared out among the trials that run at once (unless the search sets threads).
    What a run decides by the threads it has (its dtype, and so its optimizer, from how fast bf16 matmuls measure)
    is decided here once, as a lone run on every core would: the trials then differ by the searched settings only,
    and the best one's settings are those of a run of its own."""
    if base.train.threads or concurrent == 1 or any(d.key == "train.threads" for d in dims):
        return base
    if not spark.sparkContext.master.startswith("local") or base.train.device == "cuda":
        return base
    from ..train import resolve

    cores = spark.sparkContext.defaultParallelism
    searched = {d.key for d in dims}
    tc = base.train
    fixed: dict[str, Any] = {"threads": max(1, cores // concurrent)}
    if tc.dtype == "auto" and "train.dtype" not in searched:
        fixed["dtype"] = resolve.dtype("auto", "cpu", cores)
    if tc.optimizer == "auto" and not searched & {"train.optimizer", "train.dtype"}:
        fixed["optimizer"] = resolve.optimizer(dataclasses.replace(tc, dtype=fixed.get("dtype", tc.dtype)), cores,
                                               pretrained=bool(base.model.init_from))
    return merge(base, {"train": fixed})


class _Reporter(StatelessSink):
    """A sink that hands a trial's evaluations to the study (Optuna's intermediate values) and, once the pruner
    judges the trial hopeless, asks the run to end (``halted``: the run's loop ends at its next step)."""

    def __init__(self, trial, metric: str):
        self.trial, self.metric = trial, metric
        self.pruned_at: int | None = None

    def write(self, row) -> None:
        if not (isinstance(row, rows.Eval) and self.metric in row.figures) or self.pruned_at is not None:
            return
        try:
            self.trial.report(float(row.figures[self.metric]), row.step)
        except Exception:  # noqa: BLE001 - a step reported twice (a restart): the first value stays
            return
        if self.trial.should_prune():
            self.pruned_at = row.step

    def halted(self) -> bool:
        return self.pruned_at is not None


class TrialFailed(Exception):
    """A trial's run stopped with its one line (recorded in the trial's ``error``): Optuna marks it failed and the
    study goes on."""


def _run_trials(study, data: str, output: str, dims: list[Dimension], base: Config, metric: str,
                left: int, concurrent: int, spark, parent: dict[str, str]) -> None:
    """Optuna's own loop (``optimize``: its threads, its stop when a grid is walked), each thread's jobs in a
    scheduler pool of its own."""
    pools: dict[int, str] = {}
    lock = threading.Lock()

    def objective(trial) -> float:
        with lock:
            pool = pools.setdefault(threading.get_ident(), f"sparklm-trial-{len(pools)}")
        spark.sparkContext.setLocalProperty("spark.scheduler.pool", pool)
        return _one_trial(trial, data, output, dims, base, metric, spark, parent)

    study.optimize(objective, n_trials=left, n_jobs=concurrent, catch=(TrialFailed,), gc_after_trial=False)


def _one_trial(trial, data, output, dims, base, metric, spark, parent) -> float:
    import optuna

    from .train import train

    values = {d.key: search_space.suggest(trial, d) for d in dims}
    run_dir = join(output, "trials", f"trial-{trial.number:04d}")
    trial.set_user_attr("run_dir", run_dir)
    shown = ", ".join(f"{k}={_short(v)}" for k, v in values.items())
    progress.info(f"trial {trial.number}: {shown}")
    t0 = time.time()
    try:
        reporter = _Reporter(trial, metric)
        summary = train(data, output=run_dir, config=merge(base, search_space.nested(values)), spark=spark,
                        observers=(reporter,), parent=parent)
        value = figure(summary, metric)
    except SparklmError as e:
        line = e.one_line().removeprefix("error: ")
    except Exception as e:  # noqa: BLE001 - any failure of one trial (out of memory, a lost executor) is recorded
        line = f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"
    else:
        trial.set_user_attr("seconds", round(time.time() - t0, 1))
        if reporter.pruned_at is not None:
            write_text(join(run_dir, "pruned.json"), json.dumps(
                {"pruned_at_step": reporter.pruned_at, "steps": summary.get("steps"), metric: value}), base.storage)
            trial.set_user_attr("pruned_at_step", reporter.pruned_at)
            progress.info(f"trial {trial.number}: pruned at step {reporter.pruned_at} ({metric} {value:.4f}, "
                          f"{time.time() - t0:.0f}s)")
            raise optuna.TrialPruned(f"pruned at step {reporter.pruned_at}")
        progress.info(f"trial {trial.number}: {metric} {value:.4f} ({time.time() - t0:.0f}s)")
        return value
    trial.set_user_attr("error", line)
    progress.warn(f"trial {trial.number} failed: {line}")
    raise TrialFailed(line)


def figure(summary: dict, metric: str) -> float:
    """The run's value of ``metric``: its best evaluation's, else its final one (one line where it has none)."""
    for part in ("best", "final"):
        got = (summary.get(part) or {}).get(metric)
        if got is not None:
            return float(got)
    names = sorted(k for k in (summary.get("final") or {}) if isinstance((summary.get("final") or {})[k], float))
    raise SparklmError(f"the run has no figure {metric!r}", hint=f"--metric one of: {', '.join(names) or 'none'}")


def _short(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def _summary(study, output: str, metric: str, direction: str, storage) -> dict:
    """What the search found, also written to OUTPUT/best.json, with OUTPUT/report.html (the page people look
    at: the trials and Optuna's plots)."""
    trials = []
    for t in study.get_trials(deepcopy=False):
        trials.append({"number": t.number, "state": t.state.name.lower(), "value": t.value, "params": t.params,
                       "run_dir": t.user_attrs.get("run_dir"), "error": t.user_attrs.get("error"),
                       "interrupted": bool(t.user_attrs.get("interrupted"))})
    best = None
    if any(t["state"] == "complete" for t in trials):
        b = study.best_trial
        run_dir = b.user_attrs.get("run_dir")
        model = join(run_dir, "model") if run_dir else None
        best = {"number": b.number, "value": b.value, "params": b.params, "run_dir": run_dir,
                "model": model if model and exists(model) else None}
    out = {"metric": metric, "direction": direction, "best": best, "trials": trials}
    from ..metrics.study_report import render_study

    write_text(join(output, "best.json"), json.dumps(out, indent=2, default=str), storage)
    write_text(join(output, "report.html"), render_study(out, study), storage)
    rows_shown = [(str(t["number"]), t["state"], "" if t["value"] is None else f"{t['value']:.4f}",
                   ", ".join(f"{k}={_short(v)}" for k, v in t["params"].items())) for t in trials]
    progress.table(f"tune: {metric} ({direction})", rows_shown, ("trial", "state", metric, "settings"))
    if best:
        progress.info(f"best: trial {best['number']}, {metric} {best['value']:.4f}, model in {best['model']}")
    else:
        progress.warn("no trial completed: nothing to compare (see each trial's error above)")
    return out
