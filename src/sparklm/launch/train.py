"""``sparklm train``: a prepared dataset → a run directory, trained by a strategy on Spark tasks.

The launcher checks the inputs, resolves the configuration (on ``--resume``: the saved one plus what
the user set now), writes ``config.json``, and hands the job to the strategy with the metrics sinks
(metrics.csv, run_info.json, the console); at the end it writes ``summary.json`` (with Spark's own figures
for the training's jobs), ``loss.png`` and ``report.html``. It knows nothing of training: that is the strategy's
and the core's.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
import uuid
from typing import Any

from ..config import Config, TrackingConfig, diff, flatten, from_dict, merge
from ..data.manifest import MANIFEST, PreparedDataset, load_prepared, load_tokenizer
from ..data.tokenizer import TokenizerSpec
from ..infra import progress, redact
from ..infra.errors import SparklmError
from ..infra.fs import effective, exists, is_remote, join, read_text, write_text
from ..infra.runlock import RunLock
from ..metrics import rows, trackers
from ..metrics.epochs import EpochRows
from ..metrics.html_report import write_report
from ..metrics.recorder import RunResult
from ..metrics.report import plot_loss
from ..metrics.sinks import ConsoleSink, CsvSink, JsonSink, Sink, Sinks, metric_columns, read_metrics
from ..model.figures import FigureSet
from ..registry import DEFAULT_TASK
from ..registry import task as task_info
from ..spark import figures as spark_figures
from ..train import checkpoint, memory, resolve
from ..train import plan as plans
from ..version import __version__

# Settings that decide which rows each step trains on: a resumed run must keep them.
DATA_ORDER_KEYS = ("train.seed", "train.window_row_groups")
# a step's global rows: these may change on resume only together, keeping their product (another world size)
GLOBAL_BATCH_KEYS = ("train.batch_size", "train.grad_accum", "train.workers")


def train(data: str | None, *, output: str, config: Config | None = None, resume: bool = False, spark=None,
          changes: dict[str, Any] | None = None, observers: tuple[Sink, ...] = (),
          parent: dict[str, str] | None = None) -> dict:
    """Train a model on a prepared dataset into ``output`` (a run directory); return the summary.

    On ``resume``, the run's saved configuration is used, with ``changes`` (nested settings, as the CLI
    collects what the user set) or else the settings where ``config`` differs from the defaults applied on top.
    ``observers``: sinks that see the run's rows on the driver too (a search's pruner reads its evaluations);
    ``parent``: the trackers' runs of the search this run is a trial of (``trackers.parents``).
    """
    storage = effective((config or Config()).storage)
    with RunLock(output, storage) as lock:  # one writer per run directory
        return _train(data, output=output, config=config, resume=resume, spark=spark, changes=changes,
                      storage=storage, lock=lock, observers=observers, parent=parent or {})


def _check_fresh(run_dir: str, storage) -> None:
    """A new run's directory holds no run, nor a prepared dataset (`--data d -o d`: their files would mix)."""
    if exists(join(run_dir, "config.json"), storage) or exists(join(run_dir, "checkpoints"), storage):
        raise SparklmError(f"run directory {run_dir} already holds a run",
                           hint="use --resume to continue it, or another --output")
    if exists(join(run_dir, MANIFEST), storage):
        raise SparklmError(f"--output {run_dir} holds a prepared dataset ({MANIFEST}), not a run",
                           hint="choose another --output for the run, e.g. runs/NAME")


def _train(data: str | None, *, output: str, config: Config | None, resume: bool, spark, changes, storage,
           lock: RunLock, observers: tuple[Sink, ...] = (), parent: dict[str, str] | None = None) -> dict:
    from ..spark.session import check_shared, get_session, planned_master
    from ..strategies import Job, get

    run_dir, saved_plan = output, None
    if resume:
        config, data, saved_plan = _resumed(run_dir, config, changes, data, storage)
    else:
        _check_fresh(run_dir, storage)
    config = config or Config()
    config = config.replace(storage=effective(config.storage))
    storage = config.storage
    if not data:
        raise SparklmError("no prepared dataset given", hint="pass --data DIR (made by `sparklm prepare`)")
    strategy = get(config.train.strategy)
    trackers.check(config)  # a missing package or a bad setting is one line before anything is written
    master = planned_master(config.spark, None if callable(spark) else spark)
    dataset = load_prepared(data, storage)
    config = task_data(config, dataset, data)
    spec = load_tokenizer(dataset, storage)
    # Every "auto" decided here, once, for every rank and round worker (a resumed run's were decided before).
    asked = config
    config, note = resolve.settle(config, threads=resolve.threads(config.train, master, config.spark,
                                                                None if callable(spark) else spark),
                                vocab=spec.vocab_size, context=dataset.seq_len,
                                train_tokens=dataset.manifest["splits"]["train"]["tokens"], master=master,
                                resume=resume, spark=None if callable(spark) else spark)
    if note:
        progress.info(note)
    # Processes the strategy starts now (local mode), so that their imports overlap Spark's start.
    with strategy.prestart(config, master) as warm:
        shapes = _checked_shapes(config, spec, dataset, data)
        ours, t_spark = spark is None or callable(spark), time.time()  # a session of sparklm's: this run's jobs only
        spark = spark() if callable(spark) else get_session(config.spark, spark=spark)
        spark_start = time.time() - t_spark
        lock.on_lost = spark.sparkContext.cancelAllJobs if ours else None  # taken over: stop; the lock's exit says why
        check_shared(spark, {"run directory": run_dir, "dataset": data})
        # Before anything is written: a job that cannot fit stops here, and the same --output can be used again.
        mem = memory.plan_for(config, shapes, dataset.seq_len, spark)
        progress.info(mem.describe())
        plan = plans.make(config, train_rows=dataset.manifest["splits"]["train"]["sequences"],
                          seq_len=dataset.seq_len, mem=mem, peak=resolve.worker_peak(config))
        plan.check_resumable(saved_plan, run_dir)  # (a new run has no saved plan)
        strategy.check(spark, plan)  # DDP: slots and GPUs for every rank, before anything is written
        # an unreachable tracker stops the run here, before its directory holds anything
        tracking = trackers.open_trackers(config, trackers.Context(
            command="train", run_dir=run_dir, storage=storage, params=flatten(config.to_saved()), resume=resume,
            parent=parent or {}))
        # config: the settings, every "auto" decided ("decided" lists what the driver chose where they left it open;
        # --resume starts from them); plan: everything else decided about the run, and the settings it changed
        write_text(join(run_dir, "config.json"), json.dumps(
            {"config": config.to_saved(), "decided": resolve.decided(asked, config), "plan": plan.record(config),
             "data": redact.value(data), "sparklm_version": __version__}, indent=2), storage)
        job = Job(plan, data=data, run_dir=run_dir, resume=resume, uid=uuid.uuid4().hex, warm=warm,
                  halts=any(hasattr(o, "halted") for o in observers))
        figures = task_info(config.model.task).figures
        sinks = _sinks(run_dir, figures, storage, [*tracking, *observers], resume)
        t0 = time.time()
        with trackers.failed_on_error(tracking):
            try:
                with progress.stage(spark, f"train: {strategy.describe(plan.config)}", quiet=True), \
                        spark_figures.window(spark) as jobs:
                    result = strategy.run(spark, job, sinks)
            finally:
                sinks.close()
    with trackers.failed_on_error(tracking):
        scores = _scores(run_dir, config, result, spark)
        summary = _summary(run_dir, config, dataset, result, spark, time.time() - t0, spark_start,
                           spark_figures.collect(spark, jobs), scores)
        _cards(run_dir, config, data, summary)
        plot_loss(run_dir, figures, storage)
        if (draw := task_info(config.model.task).report) is not None:  # the task's own pictures
            draw(run_dir, summary["best"] or summary["final"], storage)
        write_report(run_dir, storage)
    model_dir = join(run_dir, "model")
    trackers.finish_all(tracking, trackers.Outcome(ok=True, summary=summary,
                                                   model_dir=model_dir if exists(model_dir, storage) else None))
    _report(summary, config, figures)
    return summary


def _scores(run_dir: str, config: Config, result, spark) -> dict:
    """train.eval_tasks: the exported model scored on benchmark tasks, Spark jobs on the run's session ({}: none)."""
    if not config.train.eval_tasks:
        return {}
    from .benchmarks import score_run

    return score_run(run_dir, config.train, step=result.steps, tokens=result.tokens, storage=config.storage, spark=spark)


def _checked_shapes(config: Config, spec: TokenizerSpec, dataset: PreparedDataset, data: str):
    """The model's shapes for the memory plan, once the pretrained model, LoRA's targets, the data and the benchmark
    tasks the run ends with (train.eval_tasks) are checked (before Spark starts)."""
    _check_init_from(config, spec, dataset.seq_len)
    if config.train.eval_tasks:
        from .benchmarks import check_run_tasks

        check_run_tasks(config.train)
    shapes = memory.model_shapes(config, spec, dataset.seq_len)
    if dataset.manifest["splits"]["train"]["sequences"] == 0:
        raise SparklmError(f"{data} has no training sequences", hint="prepare more text or a shorter --seq-len")
    return shapes


def _sinks(run_dir: str, figures: FigureSet, storage, tracking: list, resume: bool) -> EpochRows:
    """Where the run's rows go: metrics.csv, epochs.csv, run_info.json, the console and the trackers; epoch rows
    are made in front of them (a resumed run's from metrics.csv's rows on)."""
    metrics = join(run_dir, "metrics.csv")
    earlier = [r for r in read_metrics(metrics, storage) if r["kind"] == "train"] if resume else []
    return EpochRows(Sinks([CsvSink(metrics, metric_columns(figures), {"train", "eval"}, storage),
                            CsvSink(join(run_dir, "epochs.csv"), rows.EPOCH_COLUMNS, {"epoch"}, storage),
                            JsonSink(join(run_dir, "run_info.json"), storage), ConsoleSink(figures), *tracking]),
                     earlier)


def _cards(run_dir: str, config: Config, data: str, summary: dict) -> None:
    """A model card (README.md) in each model directory the run wrote."""
    from ..model.build import ADAPTER_CONFIG
    from ..model.card import base_license, model_card

    base = config.model.init_from
    license = base_license(base) if base and not is_remote(base) else None
    for name, which in (("model", "the best evaluation"), ("model-final", "the last step")):
        directory = join(run_dir, name)
        adapter = exists(join(directory, ADAPTER_CONFIG), config.storage)
        if not adapter and not exists(join(directory, "config.json"), config.storage):
            continue
        card = model_card(name=directory, summary=summary, data=redact.value(data), base=redact.value(base),
                          license=license, adapter=adapter, which=which, final=name == "model-final")
        write_text(join(directory, "README.md"), card, config.storage)


def _resumed(run_dir: str, config: Config | None, changes: dict[str, Any] | None, data: str | None,
             storage) -> tuple[Config, str | None, dict | None]:
    """The configuration, dataset and recorded plan of a run resumed from ``run_dir`` (its config.json, with what
    the user set)."""
    saved = join(run_dir, "config.json")
    if not exists(saved, storage):
        raise SparklmError(f"cannot resume: {saved} not found", hint="pass the run directory of an earlier run")
    try:
        meta = json.loads(read_text(saved, storage))
        base = from_dict(redact.unmasked(meta["config"]))  # a masked secret is given again or left to Spark
    except (ValueError, KeyError, TypeError) as e:
        raise SparklmError(f"cannot resume: {saved} is not a sparklm run configuration ({type(e).__name__})",
                           hint="restore it from a copy, or start a new run with another --output") from None
    changes = changes if changes is not None else diff(config) if config is not None else {}
    masked = sorted(set(flatten(meta["config"]).get("spark.conf", {})) - set(base.spark.conf)
                    - set(changes.get("spark", {}).get("conf", {})))
    if masked:
        progress.warn(f"{saved} holds {', '.join(masked)} masked (secrets are never written); this resumed run goes "
                      "without them: give them again (--config, or --conf KEY='${env:NAME}') if it needs them")
    config = resume_config(_untracked(base, changes, saved), changes)
    _check_resumable(run_dir, config)
    if not data and redact.holds_mask(meta["data"]):
        raise SparklmError(f"cannot resume: {saved} names the dataset {meta['data']}, its credential masked",
                           hint="pass --data again (a credential inside a URI is never written)")
    return config, data or meta["data"], meta.get("plan")


def _untracked(saved: Config, changes: dict[str, Any], where: str) -> Config:
    """The saved settings without their tracking destinations: whoever can write a run directory could otherwise
    send the resumed run's parameters and model to a server of theirs. A resumed run logs where it is told now."""
    default = dataclasses.asdict(TrackingConfig())
    dropped = [k for k, v in dataclasses.asdict(saved.tracking).items()
               if v and v != default[k] and k not in changes.get("tracking", {})]
    if dropped:
        progress.warn(f"{where} names tracking settings ({', '.join(f'tracking.{k}' for k in dropped)}) that a resumed "
                      "run does not take from the run directory; give them again to log there")
    return saved.replace(tracking=TrackingConfig())


def _report(summary: dict, config: Config, figures: FigureSet) -> None:
    """The run's closing lines: the final evaluation, and where the best weights went."""
    final, best = summary["final"], summary["best"]
    if final:
        progress.info(f"validation: {figures.line(final)}")
    if best and best["step"] != summary["steps"] and config.train.keep_best:
        head = figures.main
        progress.info(f"model/ holds the best evaluation's weights (step {best['step']}: {head.label} "
                      f"{best[head.key]:{head.fmt}}); the final weights (step {summary['steps']}) are in model-final/")


def resume_config(saved: Config, changes: dict[str, Any]) -> Config:
    """The configuration of a resumed run: the saved one, with only what the user set now applied.

    A change of a setting that decides the data order (the seed, the shuffle window, the global batch: batch size x
    accumulation x workers) is refused: the checkpoint's position in the data would then mean other rows. The
    workers, micro-batch and accumulation may change together where their product stays (a run resumed on another
    number of ranks).
    """
    was = flatten(saved.to_dict())
    for key, value in flatten(changes).items():
        if key in DATA_ORDER_KEYS and key in was and was[key] != value:
            raise SparklmError(f"cannot change {key} when resuming (the run used {was[key]!r}, now {value!r}): "
                               "it changes which rows each step trains on",
                               hint=f"drop the {key} setting to resume, or start a new run with another --output")
    merged = merge(saved, changes)
    now = flatten(merged.to_dict())
    rows = {k: (was[k], now[k]) for k in GLOBAL_BATCH_KEYS}
    before, after = (math.prod(v[i] for v in rows.values()) for i in (0, 1))
    if before != after:
        key = next(k for k, (a, b) in rows.items() if a != b)
        raise SparklmError(f"cannot change {key} when resuming (the run used {was[key]!r}, now {now[key]!r}): a "
                           f"step's global batch would be {after} rows, not {before}, which changes which rows each "
                           "step trains on",
                           hint=f"keep batch_size x grad_accum x workers at {before} (e.g. double batch_size when "
                                "halving workers), or start a new run with another --output")
    return merged


def _check_resumable(run_dir: str, config: Config) -> None:
    """The newest checkpoint must come from the same strategy."""
    found = checkpoint.newest_readable(join(run_dir, "checkpoints"),
                                       lambda p: (p, checkpoint.read_state(p, config.storage)), config.storage)
    if found is None:
        return  # killed before its first checkpoint: the run starts again from the beginning
    last, state = found
    was = state.get("strategy", "ddp")
    if was != config.train.strategy:
        raise SparklmError(f"{last} was written by strategy {was}, not {config.train.strategy}",
                           hint=f"resume with --strategy {was}")


def task_data(config: Config, dataset: PreparedDataset, data: str) -> Config:
    """The dataset must be prepared for what the run trains (its task says which); what the data fixes (a
    classifier's classes) the task takes from its manifest."""
    info = task_info(config.model.task)
    prepared = dataset.manifest.get("task", DEFAULT_TASK)
    if prepared not in info.data:
        raise SparklmError(f"{data} was prepared for --task {prepared}, and this run trains --task {info.name}",
                           hint=f"prepare the data with `sparklm prepare --task {info.data[0]}`, or train with "
                                f"--task {prepared}")
    return info.settle(config, dataset.manifest, data) if info.settle is not None else config


def _check_init_from(config: Config, spec: TokenizerSpec, seq_len: int | None = None) -> None:
    """Before Spark starts: the pretrained model exists and loads (config and safetensors weights) and its tokenizer
    is the dataset's (LoRA's targets are checked with the model's shapes, memory.model_shapes)."""
    info = task_info(config.model.task)
    if not config.model.init_from:
        if info.pretrained:
            from ..model.encoders import no_model  # imports torch: only on the error's path

            raise no_model(config.model.task)
        if config.lora.r:
            from ..model import lora  # imports torch (~1 s): only on the error's path

            raise lora.no_base()
        return
    from ..data.tokenizer import load
    from ..model.build import ADAPTER_CONFIG, check_causal, check_model_dir, model_source

    name = config.model.init_from
    path = model_source(name, config.storage)  # a .gguf file is converted here, once per host
    if (path / ADAPTER_CONFIG).is_file():  # a LoRA run's model/: its base is checked when it loads
        return
    hf_config = check_model_dir(path, name)
    if not info.pretrained:  # a model built from [model]
        check_causal(hf_config, name)
    if (path / "tokenizer.json").is_file() and load(str(path)).sha256 != spec.sha256:
        raise SparklmError(f"the tokenizer of {name} differs from the dataset's",
                           hint=f"prepare the data with --tokenizer {name}")
    if info.pretrained:
        from ..model.encoders import check_loadable

        check_loadable(config, path, seq_len, info.auto)


def _summary(run_dir: str, config: Config, dataset: PreparedDataset, result: RunResult, spark, seconds: float,
             spark_start: float, spark_job: dict, scores: dict | None = None) -> dict:
    rows = read_metrics(join(run_dir, "metrics.csv"), config.storage)
    train_rows = [r for r in rows if r["kind"] == "train"]
    steady = train_rows[len(train_rows) // 4:] or train_rows  # skip warm-up for the steady-state figures
    epoch_tokens = dataset.manifest["splits"]["train"]["tokens"]
    r = result
    summary = {
        "task": config.model.task,  # its figures' names: tasks/
        "final": r.final, "best": r.best,
        "steps": r.steps, "tokens": r.tokens, "epochs": r.tokens / max(epoch_tokens, 1),
        "train_seconds": r.seconds, "wall_seconds": seconds, "spark_start_seconds": spark_start,
        "seconds_per_epoch": r.seconds / max(r.tokens / max(epoch_tokens, 1), 1e-9),
        "tokens_per_s": _mean(steady, "tokens_per_s"), "ms_per_step": _mean(steady, "ms_per_step"),
        "mfu": _mean(steady, "mfu"),
        "peak_rss_mb": peak_mb(r.peak_rss_mb, train_rows),
        "rank_peak_rss_mb": r.rank_peak_rss_mb,  # each rank's (round worker's), in rank order
        "params": r.params, "trainable_params": r.trainable_params, "flops_per_token": r.flops_per_token,
        "peak_flops": r.peak_flops, "dtype": r.dtype, "device": r.device,
        **({"gpus": r.gpus} if r.gpus else {}),  # the GPU Spark assigned each rank's task
        "workers": config.train.workers, "strategy": config.train.strategy,
        "bytes_communicated": r.bytes_communicated,
        **{k: getattr(r, k) for k in ("rounds", "bytes_broadcast", "bytes_returned") if getattr(r, k) is not None},
        "spark_application_id": spark.sparkContext.applicationId,
        "spark_master": spark.sparkContext.master, "sparklm_version": __version__,
        "spark": spark_job,  # Spark's own figures for the training's jobs (spark_figures.py)
        **({"tasks": scores} if scores else {}),  # train.eval_tasks: "arc_easy/acc" → the exported model's score
    }
    write_text(join(run_dir, "summary.json"), json.dumps(summary, indent=2), config.storage)
    return summary


def peak_mb(peak: float | None, train_rows: list[dict]) -> float:
    """This process's exact peak, unless the CSV's rows (a resumed run's earlier segment) held more: the CSV
    keeps 6 significant digits, so a row within that rounding of the exact peak is the same reading."""
    logged = max((row["rss_mb"] or 0 for row in train_rows), default=0.0)
    peak = peak or 0.0
    return logged if logged > peak * (1 + 1e-5) else peak


def _mean(rows: list[dict], key: str) -> float | None:
    vals = [r[key] for r in rows if r.get(key) is not None]
    return sum(vals) / len(vals) if vals else None
