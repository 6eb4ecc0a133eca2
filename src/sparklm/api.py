"""The Python API a notebook uses: keyword-only functions over paths, DataFrames and tables, run in the caller's
Spark session (the active one, or ``spark=``), which they leave running.

Each function wraps the one the command line calls; nothing here trains, reads or generates by itself.
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .config import Config, from_dict, load_config, load_raw, merge
from .infra import progress
from .infra.errors import SparklmError

# A table name as Spark SQL writes one: table, db.table or catalog.db.table (backquotes not needed).
_TABLE = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*){0,2}")


def settings_of(config: Config | dict | str | Path | None, settings: dict[str, Any] | None = None) -> Config:
    """A :class:`Config` from a Config, nested settings (as in TOML), a TOML file's path or None (the defaults),
    with ``settings`` (dotted keys, ``{"train.max_steps": 100}``) on top; unknown keys are one line."""
    if isinstance(config, Config):
        base = config
    elif config is None:
        base = Config()
    elif isinstance(config, dict):
        base = from_dict(config)
    elif isinstance(config, (str, Path)):
        base = load_config(config)
    else:
        raise SparklmError(f"config= is a {type(config).__name__}",
                           hint="pass a sparklm.Config, a dict of sections, or a TOML file's path")
    return merge(base, load_raw(None, (), settings)) if settings else base


def _running(spark, *frames):
    """The session a call runs in, if one runs already: ``spark``, a DataFrame's, or the active one."""
    from .launch.prepare import is_dataframe

    if spark is not None:
        return spark
    for frame in frames:
        if is_dataframe(frame):
            return frame.sparkSession
    from .spark.session import active_session

    return active_session()


def _session(config: Config, spark):
    from .spark.session import get_session

    return get_session(config.spark, spark=spark)


def _source(source, config: Config, spark, role: str):
    """(what prepare reads, how the manifest names it): a DataFrame, a table's DataFrame, or a list of paths."""
    from .launch.prepare import is_dataframe

    if is_dataframe(source):
        return source, None
    local = _local_table(source, role)
    if local is not None:  # rows in this process: Spark takes them as a DataFrame (through Arrow)
        kind = type(source)
        return _session(config, spark).createDataFrame(local), f"{kind.__module__.split('.')[0]}.{kind.__name__}"
    if isinstance(source, (str, Path)):
        source = [str(source)]
    if not isinstance(source, (list, tuple)) or not all(isinstance(s, (str, Path)) for s in source):
        raise SparklmError(f"the {role} is a {type(source).__name__}",
                           hint="pass paths (a str or a list of them), a Spark DataFrame or a table name")
    paths = [str(s) for s in source]
    if len(paths) == 1 and _TABLE.fullmatch(paths[0]) and not os.path.exists(paths[0]):
        spark = _session(config, spark)
        if spark.catalog.tableExists(paths[0]):
            return spark.table(paths[0]), f"table {paths[0]}"
        raise SparklmError(f"{paths[0]} is neither a file nor a table", hint="check the path, or the table's "
                           "name among spark.catalog.listTables() (db.table for another database)")
    return paths, None


def _local_table(source, role: str):
    """A pandas DataFrame, a pyarrow Table or an HF ``datasets.Dataset`` (its rows as selected, through its Arrow
    table), told apart by type name so that none of the three is imported for paths; None for anything else."""
    kind = type(source)
    where = kind.__module__.split(".")[0]
    if where == "datasets" and kind.__name__ in ("DatasetDict", "IterableDataset", "IterableDatasetDict"):
        raise SparklmError(f"the {role} is a {kind.__name__}", hint="pass one split of a Dataset loaded whole, e.g. "
                           "ds['train'] (and validation=ds['test']), or the files it was loaded from")
    if where == "datasets" and kind.__name__ == "Dataset":
        return source.with_format("arrow")[:]
    if (where, kind.__name__) in (("pyarrow", "Table"), ("pandas", "DataFrame")):
        return source
    return None


def prepare(source, *, output: str, text_col: str | None = None, validation=None,
            config: Config | dict | str | None = None, settings: dict[str, Any] | None = None,
            overwrite: bool = False, spark=None):
    """Raw text → a tokenized, packed dataset at ``output`` (local or on an object store); returns it.

    ``source`` is paths (files, directories, globs), a Spark DataFrame (a row per document, in ``text_col``,
    default ``text``) or a table name (``spark.table``); ``validation`` likewise, else documents are split by hash.
    A DataFrame's text is read by the executors, never collected to the driver. A pandas DataFrame, a pyarrow
    Table or an HF ``datasets.Dataset`` (rows already in this process) becomes a Spark DataFrame first.
    """
    from .launch.prepare import prepare as run

    config = settings_of(config, {**(settings or {}), **({"data.text_field": text_col} if text_col else {})})
    inputs, described = _source(source, config, spark, "source")
    held_out, _ = _source(validation, config, spark, "validation") if validation is not None else ((), None)
    with progress.spark_bar_paused(_running(spark, inputs)):
        return run(inputs, output=output, config=config, validation_inputs=held_out, overwrite=overwrite,
                   spark=spark, described=described)


@dataclass
class FitResult:
    """What :func:`fit` leaves: the run directory, its summary, and the trained model, loaded on first use."""

    run_dir: str
    summary: dict[str, Any]
    _loaded: Any = dataclasses.field(default=None, repr=False)

    @property
    def model(self):
        """The kept model (``model/`` of the run) as a loaded handle: ``.model`` (a transformers model),
        ``.tokenizer``, ``.context``."""
        if self._loaded is None:
            from .infer.generate import load

            self._loaded = load(self.run_dir)
        return self._loaded

    def generate(self, prompts: str | list[str], **sampling: Any) -> str | list[str]:
        """:func:`generate` with this run's model, kept loaded between calls."""
        return _generate(self.model, prompts, sampling)


def fit(*, data, output: str, config: Config | dict | str | None = None, settings: dict[str, Any] | None = None,
        resume: bool = False, spark=None) -> FitResult:
    """Train on a prepared dataset (its path, or what :func:`prepare` returned) into the run directory ``output``,
    as ``sparklm train`` does; ``resume`` continues the run there from its last checkpoint."""
    from .data.manifest import PreparedDataset
    from .launch.train import train

    config = settings_of(config, settings)
    path = data.uri if isinstance(data, PreparedDataset) else data
    if path is not None and not isinstance(path, (str, Path)):
        raise SparklmError(f"data= is a {type(data).__name__}",
                           hint="pass a prepared dataset's path or what sparklm.prepare returned")
    with progress.spark_bar_paused(_running(spark)):
        summary = train(None if path is None else str(path), output=output, config=config, resume=resume,
                        spark=spark, changes=settings and load_raw(None, (), settings))
    return FitResult(output, summary)


def _generate(lm, prompts: str | list[str], sampling: dict[str, Any]) -> str | list[str]:
    from .infer.generate import generate as run
    from .infer.sampling import Sampling

    try:
        chosen = Sampling(**sampling)
    except TypeError as e:
        names = ", ".join(f.name for f in dataclasses.fields(Sampling))
        raise SparklmError(f"generate: {e}", hint=f"sampling settings are: {names}") from None
    one = isinstance(prompts, str)
    # any iterable of prompts (a list, a pandas Series, a generator); anything else is one prompt, checked below
    given = [prompts] if isinstance(prompts, (str, bytes)) or not hasattr(prompts, "__iter__") else list(prompts)
    for i, p in enumerate(given, 1):
        if not isinstance(p, str):
            raise SparklmError(f"prompt {i} is a {type(p).__name__}, not text",
                               hint="pass a str, or a list of them (decode bytes first)")
    texts = [g.text for g in run(lm, given, sampling=chosen, warn=False)]
    return texts[0] if one and chosen.num_samples == 1 else texts


def generate(model: str, prompts: str | list[str], *, backend: str = "torch", quantize: str = "none",
             **sampling: Any) -> str | list[str]:
    """Continuations of ``prompts`` by ``model`` (a run directory, an HF model directory, a GGUF file) in this
    process; ``sampling`` as ``sparklm generate``'s flags (``max_new_tokens``, ``temperature``, ``top_k``,
    ``top_p``, ``min_p``, ``repetition_penalty``, ``num_samples``, ``seed``); ``backend`` and ``quantize`` as its
    ``--backend`` and ``--quantize`` ("llama.cpp": the model exported to GGUF once and decoded by llama.cpp). For a
    DataFrame of prompts, on Spark, use :func:`generate_dataframe`."""
    from .infer import backends

    return _generate(backends.load(str(model), backend=backend, quantize=quantize), prompts, sampling)


def evaluate(model: str, source=None, *, tasks: str | list[str] | None = None, max_length: int = 0, stride: int = 0,
             batch_size: int = 8, num_fewshot: int | None = None, limit: float | None = None, seed: int | None = None,
             task_data: str | list[str] = (), log_samples: bool = False, output: str | None = None,
             overwrite: bool = False, config: Config | dict | str | None = None, settings: dict[str, Any] | None = None,
             spark=None) -> dict:
    """``model`` evaluated on Spark, as ``sparklm eval``: on text files (``source``: paths; loss, perplexity, bits per
    byte and accuracy with a sliding window), or on lm-evaluation-harness tasks (``tasks``: names, task YAML files or
    directories; ``task_data``: where their datasets are, ``--task-data``), which returns the harness's own results
    dict (``results["results"]["arc_easy"]["acc,none"]``), written to ``output`` as results.json and report.html."""
    config = settings_of(config, settings)
    if (tasks is None) == (source is None):
        raise SparklmError("evaluate takes a source (text files) or tasks (benchmark tasks), one of the two",
                           hint="evaluate(model, 'data.txt') or evaluate(model, tasks=['arc_easy'])")
    if tasks is not None:
        from .launch.benchmarks import run_benchmarks

        names = tasks.split(",") if isinstance(tasks, str) else [str(t) for t in tasks]
        with progress.spark_bar_paused(_running(spark)):
            return run_benchmarks(str(model), names, config=config, output=output, overwrite=overwrite,
                                  num_fewshot=num_fewshot, limit=limit, batch_size=batch_size, seed=seed,
                                  task_data=[task_data] if isinstance(task_data, str) else list(task_data),
                                  log_samples=log_samples, spark=spark)["results"]
    from .infer.evaluate import evaluate as run

    inputs, _ = _source(source, config, spark, "source")
    if not isinstance(inputs, list):
        raise SparklmError("evaluate reads text files", hint="write the DataFrame's text out, or pass paths")
    with progress.spark_bar_paused(_running(spark)):
        return run(str(model), inputs, config=config, max_length=max_length, stride=stride, batch_size=batch_size,
                   spark=spark)


def tune(*, data, output: str, space: dict[str, str] | list[str], trials: int = 16, concurrent: int = 1,
         metric: str = "val_bpb", direction: str = "auto", sampler: str = "tpe", pruner: Any = "median",
         storage: str | None = None, resume: bool = False, seed: int = 0, config: Config | dict | str | None = None,
         settings: dict[str, Any] | None = None, spark=None) -> dict:
    """A hyperparameter search (``sparklm tune``): an Optuna study of ``trials`` runs on ``data`` (a prepared
    dataset's path) over ``space`` (``{"train.lr": "loguniform(1e-4,1e-2)", "model.n_embd": "choice(128,256)"}``),
    ``concurrent`` at once on the session's executors; ``settings`` fixed for every trial. Returns the study's
    summary: ``best`` (its trial's value, settings, run directory and model/) and every trial."""
    from .launch.tune import tune as search

    config = settings_of(config, settings)
    with progress.spark_bar_paused(_running(spark)):
        return search(str(data), output=output, space=space, trials=trials, concurrent=concurrent, metric=metric,
                      direction=direction, sampler=sampler, pruner=pruner, storage=storage, resume=resume, seed=seed,
                      config=config,
                      spark=spark)


def export(model: str, *, output: str, format: str = "onnx", quantize: str = "none", merge_adapter: bool = False,
           overwrite: bool = False) -> dict:
    """``model`` in the directory ``output``, as ``sparklm export``: ``format="onnx"`` a graph with its tokenizer
    (``quantize`` none, int8 or int4; ``merge_adapter`` also writes a LoRA run's merged model as an HF directory),
    ``format="gguf"`` one llama.cpp file (``quantize`` none/f32, f16, bf16, q8_0, q4_0 or q4_1; a LoRA run merged),
    ``format="hub"`` the files of a Hugging Face Hub repository (``merge_adapter``: a LoRA run merged)."""
    from .infer.export import export as run
    from .infer.export import export_hub

    if format == "hub":
        return export_hub(str(model), output, overwrite=overwrite, merge=merge_adapter)
    if format == "gguf":
        from .infer.gguf_export import export_gguf

        return export_gguf(str(model), output, quantize=quantize, overwrite=overwrite)
    if format != "onnx":
        raise SparklmError(f"export format {format!r}: use 'onnx', 'gguf' or 'hub'")
    return run(str(model), output, quantize=quantize, overwrite=overwrite, merge=merge_adapter)
