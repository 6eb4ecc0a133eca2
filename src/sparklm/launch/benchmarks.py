"""``sparklm eval --tasks`` as a command, and ``train.eval_tasks`` at the end of a run: lm-evaluation-harness's tasks
scored on Spark (:mod:`sparklm.infer.harness`), their results written where tooling reads them (the harness's
results.json, a report, a run's eval_tasks.json and .csv) and sent to the trackers."""

from __future__ import annotations

from ..infer.harness import evaluate_tasks, metrics, results_json, samples_jsonl, table
from ..infra import progress
from ..infra.errors import SparklmError

# -- the command ---------------------------------------------------------------------------------------------------

OUTPUT_FILES = ("results.json", "report.html")  # what --output holds (and samples_TASK.jsonl with --log-samples)


def check_output(output: str | None, overwrite: bool, storage=None) -> None:
    """``--output`` is a new directory, or with ``--overwrite`` one that holds only what an earlier evaluation wrote
    (``--overwrite`` never deletes a user's files)."""
    from ..infra.fs import exists, list_names

    if not output or not exists(output, storage):
        return
    if not overwrite:
        raise SparklmError(f"{output} already exists", hint="pass --overwrite to replace it, or another --output")
    names = [n.rstrip("/").rsplit("/", 1)[-1] for n in list_names(output, storage)]
    foreign = [n for n in names if n not in OUTPUT_FILES and not (n.startswith("samples_") and n.endswith(".jsonl"))]
    if foreign:
        raise SparklmError(f"--overwrite would replace {output}, which holds files eval did not write ({foreign[0]})",
                           hint="pass another --output")


def run_benchmarks(model: str, tasks: list[str], *, config=None, output: str | None = None, overwrite: bool = False,
                   spark=None, **options) -> dict:
    """``sparklm eval --tasks``: the evaluation, its files in ``output`` (results.json, report.html, the samples),
    its figures in the trackers the config turns on. Returns {"results", "metrics", "table"}."""
    from ..config import Config
    from ..infra.fs import effective, staged_dir
    from ..metrics import trackers
    from ..metrics.html_report import render_benchmarks

    config = config or Config()
    storage = effective(config.storage)
    check_output(output, overwrite, storage)
    trackers.check(config, "eval")
    results = evaluate_tasks(model, tasks, storage=config.storage, spark=spark, spark_config=config.spark, **options)
    figures = metrics(results)
    if output:
        with staged_dir(output, storage, marker="results.json") as stage:
            (stage / "results.json").write_text(results_json(results))
            (stage / "report.html").write_text(render_benchmarks(results, results["config"]["model"]))
            for name, text in samples_jsonl(results).items():
                (stage / name).write_text(text)
        progress.info(f"results → {output}/results.json, report → {output}/report.html")
    params = {"eval.model": results["config"]["model"], "eval.tasks": ",".join(tasks),
              **{f"eval.{k}": v for k, v in options.items() if v not in (None, [], (), False)}}
    opened = trackers.open_trackers(config, trackers.Context("eval", output or results["config"]["model"], storage,
                                                             params))
    trackers.finish_all(opened, trackers.Outcome(ok=True, summary=figures))
    return {"results": results, "metrics": figures, "table": table(results)}


# -- at the end of a training run (train.eval_tasks) ----------------------------------------------------------------

RUN_RESULTS, RUN_ROWS = "eval_tasks.json", "eval_tasks.csv"  # a run directory's: the harness's results, one row a figure
ROW_COLUMNS = ("step", "tokens", "task", "metric", "filter", "value", "stderr")


def _run_options(tc) -> dict:
    return {"num_fewshot": None if tc.eval_tasks_fewshot < 0 else tc.eval_tasks_fewshot,
            "limit": tc.eval_tasks_limit or None, "task_data": list(tc.eval_tasks_data)}


def check_run_tasks(tc) -> None:
    """Before a run trains: ``train.eval_tasks`` are tasks the harness knows, with their data on this machine."""
    from ..infer.harness import check_tasks

    check_tasks(list(tc.eval_tasks), list(tc.eval_tasks_data))


def score_run(run_dir: str, tc, *, step: int, tokens: int, storage, spark) -> dict:
    """The run's exported model scored on ``train.eval_tasks`` (Spark jobs on the run's session): the harness's
    results in eval_tasks.json, one row per figure in eval_tasks.csv; returns the figures (``task/metric``)."""
    import csv
    import io

    from ..infra.fs import join, write_text
    from ..metrics.html_report import benchmark_rows

    progress.info(f"scoring the model on {', '.join(tc.eval_tasks)} (train.eval_tasks)")
    results = evaluate_tasks(join(run_dir, "model"), list(tc.eval_tasks), storage=storage, spark=spark,
                             **_run_options(tc))
    out = io.StringIO()
    writer = csv.writer(out)
    writer.writerow(ROW_COLUMNS)
    for task, metric, flt, value, stderr, _, _ in benchmark_rows(results):
        writer.writerow([step, tokens, task, metric, flt, value, stderr if isinstance(stderr, (int, float)) else ""])
    write_text(join(run_dir, RUN_ROWS), out.getvalue(), storage)
    write_text(join(run_dir, RUN_RESULTS), results_json(results), storage)
    progress.plain(table(results))
    return metrics(results)
