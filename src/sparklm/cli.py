"""The ``sparklm`` command: argument parsing only; each subcommand calls one stage function."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import signal
import sys
import threading
import time
from dataclasses import replace
from importlib import resources
from pathlib import Path

from . import registry
from .config import choices, fields_with_flags, from_dict, load_raw
from .infra import progress, redact
from .infra.errors import SparklmError, known_cause
from .version import __version__

# Which config sections give each command its flags (the flags come from the fields' metadata).
_FLAG_SECTIONS = {"prepare": ("data", "tokenizer"), "train": ("train", "model", "lora", "tracking"),
                  "run": ("data", "tokenizer", "train", "model", "lora", "tracking")}
# single fields a command reads
_FLAG_KEYS = {"eval": ("data.doc_mode", "data.text_field", "data.encoding", "data.csv_delimiter"),
              "eval-tasks": ("tracking.mlflow_uri", "tracking.mlflow_experiment", "tracking.wandb_project"),
              "prepare": ("beam.runner", "tracking.mlflow_uri", "tracking.mlflow_experiment", "tracking.wandb_project")}
_COMMON_SECTIONS = ("spark", "storage")
_STARTED: list = []  # sessions this command started, stopped when it ends
_SIGINT: list = []  # the SIGINT handler before this command's Spark started, restored when it ends
RUN_TIME_BUDGET = 360  # seconds of training when `sparklm run` is given no budget: the whole job fits in 10 minutes
RUN_EARLY_STOP = 3  # `sparklm run` stops after this many evaluations without a better one, unless told otherwise


def default_corpus() -> list[str]:
    """The public-domain books bundled with sparklm (four novels by Jane Austen): the main job's default input."""
    corpus = resources.files("sparklm") / "corpus"
    return sorted(str(p) for p in corpus.iterdir() if p.name.endswith(".txt"))


def _inputs(args: argparse.Namespace) -> list[str]:
    """The command's inputs; none given: the bundled corpus, said once."""
    if args.inputs:
        return args.inputs
    books = default_corpus()
    progress.info(f"no input given: using the bundled corpus ({len(books)} books in {Path(books[0]).parent})")
    return books


def _common(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("configuration")
    g.add_argument("--config", metavar="FILE", help="TOML config file (`sparklm config` prints every key)")
    g.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override one config value, e.g. --set data.seq_len=128 (repeatable)")
    g.add_argument("--conf", action="append", default=[], metavar="KEY=VALUE", help="Spark configuration (repeatable)")
    _config_flags(g, _COMMON_SECTIONS)
    g.add_argument("--debug", action="store_true", help="show tracebacks")


class _Parser(argparse.ArgumentParser):
    """argparse's parser whose mistakes are one line, as sparklm's own errors are (argparse prints the whole usage
    first: twenty lines for `train`), naming where the options are listed."""

    def error(self, message: str):
        self.exit(2, f"error: {self.prog}: {message} (hint: `{self.prog} --help` lists the options)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="sparklm", description="Train transformer language models on Apache Spark.")
    parser.add_argument("--version", action="version", version=f"sparklm {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("prepare", help="raw text → tokenized, packed Parquet (a Spark job, or a Beam pipeline)",
                       description="Read, clean, deduplicate, split, tokenize and pack text into Parquet.")
    p.add_argument("inputs", nargs="*", metavar="INPUT",
                   help="files, directories or globs (.txt[.gz|.bz2|.zst|.xz], .jsonl, .json, .csv, .parquet; "
                        "local or s3://); "
                        "default: the bundled corpus")
    p.add_argument("--output", "-o", default="prepared", metavar="DIR", help="output directory (default: prepared)")
    p.add_argument("--validation-input", dest="validation_inputs", action="append", default=[], metavar="PATH",
                   help="explicit validation files (repeatable); otherwise a hash split by --val-fraction")
    g = p.add_argument_group("data and tokenizer")
    g.add_argument("--task", dest="prepare_task", choices=registry.preparing(),
                   help="what the dataset is for (data.task): causal-lm (default); an encoder's task (labelled records "
                        "with --label-field, or documents) needs its tokenizer: --tokenizer MODEL_DIR")
    _config_flags(g, _FLAG_SECTIONS["prepare"], _FLAG_KEYS["prepare"])
    g.add_argument("--pipeline-option", dest="pipeline_options", action="append", default=[], metavar="KEY=VALUE",
                   help="with --engine beam: a Beam pipeline option (beam.options), e.g. --pipeline-option "
                        "project=my-project (repeatable)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output")
    _common(p)

    t = sub.add_parser("train", help="train a model on a prepared dataset (Spark barrier tasks, DDP)",
                       description="Train a decoder-only transformer on a prepared dataset.")
    t.add_argument("--data", metavar="DIR", help="prepared dataset (from `sparklm prepare`)")
    t.add_argument("--output", "-o", required=True, metavar="RUN_DIR", help="run directory")
    t.add_argument("--resume", action="store_true",
                   help="continue the run in --output from its last checkpoint, with its saved configuration plus "
                        "only what you set now")
    _config_flags(t.add_argument_group("training"), _FLAG_SECTIONS["train"])
    _common(t)

    r = sub.add_parser("run", help="the main job: prepare → train → samples (default: the bundled corpus)",
                       description="Prepare text, train a model on it and write samples, in one run directory.")
    r.add_argument("inputs", nargs="*", metavar="INPUT", help="text inputs as for prepare; default: the bundled corpus")
    r.add_argument("--output", "-o", metavar="RUN_DIR", help="run directory (default: runs/run-TIMESTAMP)")
    _config_flags(r.add_argument_group("data, tokenizer and training"), _FLAG_SECTIONS["run"])
    _common(r)

    tu = sub.add_parser("tune", help="search hyperparameters: an Optuna study whose trials are sparklm runs",
                        description="Search training settings with Optuna: each trial is a `train` run of its own on "
                                    "the cluster, several at once in Spark scheduler pools.")
    tu.add_argument("--data", required=True, metavar="DIR", help="prepared dataset (from `sparklm prepare`)")
    tu.add_argument("--output", "-o", required=True, metavar="DIR",
                    help="the search's directory: study.db, best.json, trials/trial-NNNN (one run directory each)")
    tu.add_argument("--space", action="append", default=[], required=True, metavar="KEY=DIST(...)",
                    help="a setting to search (repeatable): uniform(lo,hi), loguniform(lo,hi), int(lo,hi[,step]), "
                         "logint(lo,hi), choice(a,b,...); e.g. --space 'train.lr=loguniform(1e-4,1e-2)'")
    tu.add_argument("--trials", type=int, default=16, help="trials in the study (default: 16)")
    tu.add_argument("--concurrent", type=int, default=1, help="trials running at once (default: 1)")
    tu.add_argument("--metric", default="val_bpb", help="the run's figure to optimize (default: val_bpb)")
    tu.add_argument("--direction", choices=("auto", "minimize", "maximize"), default="auto",
                    help="auto: maximize accuracy-like figures, minimize the rest")
    tu.add_argument("--sampler", choices=("tpe", "random", "grid"), default="tpe", help="Optuna's sampler (default: tpe)")
    tu.add_argument("--pruner", choices=("median", "halving", "none"), default="median",
                    help="Optuna's pruner, judging each evaluation: a pruned trial ends at its next step (default: "
                         "median)")
    tu.add_argument("--storage", metavar="URL",
                    help="Optuna storage URL (default: sqlite in --output; postgresql://... for a shared study)")
    tu.add_argument("--seed", type=int, default=0, help="the sampler's seed (default: 0)")
    tu.add_argument("--resume", action="store_true",
                    help="continue the study in --output; trials a killed search left running are run again")
    _config_flags(tu.add_argument_group("training (fixed for every trial)"), _FLAG_SECTIONS["train"])
    _common(tu)

    rp = sub.add_parser("report", help="a run's report.html again, or several runs side by side in one page",
                        description="Write a self-contained HTML page (no network needed to view it) from run "
                                    "directories: with one run, its report.html (curves, rounds, samples, Spark's "
                                    "figures, the config); with several, their headline figures and curves side by "
                                    "side.")
    rp.add_argument("runs", nargs="+", metavar="RUN", help="run directories (local or s3://)")
    rp.add_argument("--output", "-o", metavar="FILE",
                    help="where to write the page (default: RUN/report.html for one run, ./report.html for several)")
    _common(rp)

    _add_inference(sub)
    return parser


def _add_eval(sub) -> None:
    """`sparklm eval`: text scored with a sliding window, or lm-evaluation-harness tasks."""
    e = sub.add_parser("eval", help="a model's loss, perplexity and bits/byte on text, or its scores on standard "
                       "benchmarks (lm-evaluation-harness tasks); a Spark job",
                       description="Evaluate any causal LM on text inputs with a sliding window (--input), or on "
                                   "lm-evaluation-harness tasks, scored as the harness scores them (--tasks).")
    e.add_argument("model", metavar="MODEL", help="a sparklm run directory, an HF model directory, a LoRA adapter "
                   "directory or a .gguf file")
    e.add_argument("--input", dest="inputs", action="append", metavar="PATH",
                   help="text inputs as for prepare (repeatable)")
    e.add_argument("--max-length", type=int, default=0, metavar="N", help="window length (default: the context)")
    e.add_argument("--stride", type=int, default=0, metavar="N", help="window stride (default: --max-length)")
    _config_flags(e.add_argument_group("reading the inputs"), keys=_FLAG_KEYS["eval"])
    t = e.add_argument_group("benchmark tasks (lm-evaluation-harness: pip install 'sparklm[eval]')")
    t.add_argument("--tasks", metavar="NAMES", help="comma-separated harness task, group or tag names (hellaswag,"
                   "arc_easy,mmlu), task YAML files or directories of them")
    t.add_argument("--task-data", action="append", default=[], metavar="[DATASET=]DIR",
                   help="where a task's dataset is on this machine (nothing is downloaded): DATASET (its Hub name, "
                        "or a task or group name) read from DIR, or DIR holding datasets under their Hub names "
                        "(repeatable; docs/lm-eval.md)")
    t.add_argument("--num-fewshot", type=int, metavar="N", help="few-shot examples per prompt (default: each "
                   "task's own)")
    t.add_argument("--limit", type=float, metavar="N", help="documents per task (a fraction below 1: that share)")
    t.add_argument("--seed", type=int, metavar="N", help="the harness's seeds (Python, NumPy, torch, few-shot "
                   "sampling; default: its own)")
    t.add_argument("--log-samples", action="store_true", help="also write each document's requests and answers "
                   "(samples_TASK.jsonl in --output)")
    _config_flags(t, keys=_FLAG_KEYS["eval-tasks"])
    e.add_argument("--batch-size", type=int, default=8, metavar="N")
    e.add_argument("--threads", type=int, default=0, metavar="N", help="torch threads per task (default: the cores "
                   "Spark gives a task with --tasks; all with --input)")
    e.add_argument("--output", "-o", metavar="PATH", help="--input: also write the figures as JSON to this file; "
                   "--tasks: a directory for results.json (the harness's format) and report.html")
    e.add_argument("--overwrite", action="store_true", help="replace an existing --output")
    _common(e)


def _add_inference(sub) -> None:
    """The subcommands that use a trained model: generate, eval, export, import."""
    g = sub.add_parser("generate", help="generate text from a model (one process, or over a Spark DataFrame)",
                       description="Continue prompts with a trained model (KV cache, streaming), or with --input, "
                                   "generate for a file of prompts on Spark.")
    g.add_argument("model", metavar="MODEL", help="a sparklm run directory, an HF model directory, or an ONNX export")
    g.add_argument("--prompt", action="append", default=[], help="prompt text (repeatable)")
    g.add_argument("--prompt-file", metavar="FILE", help="prompts, one per line (or records, as --input reads them)")
    g.add_argument("--input", metavar="FILE",
                   help="prompts.{txt,jsonl,json,csv,parquet}, local or s3://: batch generation on Spark")
    g.add_argument("--prompt-field", default="prompt", metavar="NAME",
                   help="the field/column holding each prompt of a --input or --prompt-file of records (else 'text')")
    g.add_argument("--output", "-o", metavar="FILE", help="write results to .jsonl or .parquet")
    g.add_argument("--overwrite", action="store_true", help="replace an existing --output file")
    _sampling_flags(g.add_argument_group("sampling"))
    g.add_argument("--show-top", type=int, default=0, metavar="N", help="show the N most likely tokens at each step")
    g.add_argument("--backend", choices=["torch", "onnx", "llama.cpp"], default="torch",
                   help="llama.cpp: the model exported to GGUF once (cached) and decoded by llama.cpp on the CPU "
                        "(pip install 'sparklm[llamacpp]')")
    g.add_argument("--device", default="auto", help="cpu, cuda, cuda:N, or auto: CUDA where torch sees a GPU")
    g.add_argument("--quantize", choices=["none", "bf16", "int8", "int4", "f16", "q8_0", "q4_0", "q4_1"],
                   default="none", help="torch backend: bf16 (the weights in bfloat16), or on the CPU int8 (dynamic "
                   "int8 Linear layers) or int4 (4-bit weights, groups of 32); llama.cpp backend: f16, bf16, q8_0, "
                   "q4_0 or q4_1 (GGUF blocks)")
    g.add_argument("--batch-size", type=int, default=8, metavar="N")
    g.add_argument("--threads", type=int, default=0, metavar="N", help="torch threads (default: all)")
    _common(g)

    _add_eval(sub)

    x = sub.add_parser("export", help="export a model to ONNX (optionally int8 / int4 quantized), GGUF or for the Hub",
                       description="Export a model to an ONNX graph (input ids, attention mask -> logits), with "
                                   "--format gguf as one llama.cpp file (llama.cpp, ollama, llama-cpp-python), or with "
                                   "--format hub as the files of a Hugging Face Hub repository (upload_folder).")
    x.add_argument("model", metavar="MODEL", help="a sparklm run directory or an HF model directory")
    x.add_argument("--format", choices=["onnx", "gguf", "hub"], default="onnx")
    x.add_argument("--output", "-o", required=True, metavar="DIR")
    x.add_argument("--quantize", choices=["none", "int8", "int4", "f16", "bf16", "q8_0", "q4_0", "q4_1"],
                   default="none", help="onnx: none, int8 or int4; gguf: none (f32), f16, bf16, q8_0, q4_0 or q4_1")
    x.add_argument("--merge", action="store_true",
                   help="also write the model as an HF directory (model.safetensors), a LoRA adapter merged into its "
                        "base: loadable with AutoModelForCausalLM, without peft")
    x.add_argument("--overwrite", action="store_true")
    _common(x)

    _add_predict(sub)

    i = sub.add_parser("import", help="convert a GGUF model file into an HF model directory (safetensors)",
                       description="Convert a .gguf model (llama.cpp's format; quantized weights are dequantized to "
                                   "float32) with transformers' GGUF loader into an HF directory that --init-from, "
                                   "--tokenizer, generate, eval and export read. --init-from and --tokenizer also take "
                                   "the .gguf file itself, converted once into sparklm's cache.")
    i.add_argument("gguf", metavar="MODEL.gguf")
    i.add_argument("--output", "-o", required=True, metavar="DIR")
    i.add_argument("--overwrite", action="store_true", help="replace an earlier import in --output")
    _common(i)

    c = sub.add_parser("config", help="print every configuration key with its default and help, as TOML",
                       description="Print the default configuration: every section and key that --config files and "
                                   "--set take, with its type, default and help (the text of configs/default.toml). "
                                   "`sparklm config > my.toml`, edit, then `--config my.toml`.")
    c.add_argument("--debug", action="store_true", help="show tracebacks")


def _config_flags(group, sections: tuple[str, ...] = (), keys: tuple[str, ...] = ()) -> None:
    """Add the flags of the config fields in ``sections``, and of the fields ``keys`` names (their metadata names
    the flag; dest = the dotted key, which is how :func:`_config` finds them)."""
    for key, f, tp in fields_with_flags():
        if key.split(".")[0] not in sections and key not in keys:
            continue
        flag = f.metadata["flag"]
        help_text = f.metadata["help"].replace("%", "%%")  # argparse %-formats help: a literal % must be doubled
        if tp is bool:
            group.add_argument(flag, dest=key, action="store_false" if flag.startswith("--no-") else "store_true",
                               default=None, help=help_text)
            continue
        allowed = choices(tp, f.metadata)
        kind = str if allowed else _workers if key == "train.workers" else _names if tp is list else tp
        metavar = None if allowed else {int: "N", float: "X", list: "A,B"}.get(tp, key.rsplit(".", 1)[1].upper())
        optional = {"nargs": "?", "const": f.metadata["const"]} if "const" in f.metadata else {}  # --mlflow [URI]
        group.add_argument(flag, dest=key, type=kind, choices=allowed, metavar=metavar, help=help_text, **optional)


def _names(text: str) -> list[str]:
    """A list setting's flag: comma-separated (--eval-tasks arc_easy,hellaswag)."""
    return [t.strip() for t in text.split(",") if t.strip()]


def _workers(text: str) -> int | tuple[int, int]:
    """``--workers N``, or ``MIN:MAX`` for an elastic run (train.workers_min, train.workers)."""
    m = re.fullmatch(r"\s*(\d+)\s*(?::\s*(\d+)\s*)?", text)
    if m is None or int(m.group(1)) < 1 or (m.group(2) is not None and int(m.group(2)) < int(m.group(1))):
        raise argparse.ArgumentTypeError(f"'{text}': write a number of workers N, or MIN:MAX with 1 <= MIN <= MAX")
    return int(m.group(1)) if m.group(2) is None else (int(m.group(1)), int(m.group(2)))


def _add_predict(sub) -> None:
    """sparklm predict: an encoder scoring a table of texts on Spark."""
    pr = sub.add_parser("predict", help="classify or embed a table of texts with an encoder (a Spark job)",
                        description="Score every row of CSV/TSV (with a header), JSON lines or Parquet inputs with an "
                                    "HF text classifier (label, score) or, with --embed, any encoder (an embedding "
                                    "vector); the input columns are kept; the output is a Parquet directory.")
    pr.add_argument("model", metavar="MODEL", help="an HF model directory (or a sparklm run), local or on an object "
                                                   "store: copied once per host")
    pr.add_argument("--input", dest="inputs", action="append", required=True, metavar="PATH",
                    help="a file or directory Spark reads (repeatable)")
    pr.add_argument("--input-format", choices=["auto", "csv", "tsv", "json", "parquet"], default="auto")
    pr.add_argument("--output", "-o", required=True, metavar="DIR", help="the Parquet directory to write")
    pr.add_argument("--text-field", dest="text_col", default="text", metavar="NAME", help="the column of texts")
    pr.add_argument("--embed", action="store_true", help="write embeddings instead of labels")
    pr.add_argument("--pooling", choices=["mean", "cls", "last"], default="mean", help="--embed: how tokens pool")
    pr.add_argument("--normalize", action="store_true", help="--embed: unit-length vectors")
    pr.add_argument("--probabilities", action="store_true", help="also every label's probability")
    pr.add_argument("--label-field", metavar="NAME", help="a column of true labels: the accuracy against it is "
                                                          "recorded (labels the model does not know are refused)")
    pr.add_argument("--batch-size", type=int, default=32, metavar="N")
    pr.add_argument("--threads", type=int, default=0, metavar="N", help="torch threads per task (default: all)")
    pr.add_argument("--overwrite", action="store_true", help="replace an earlier prediction at --output")
    _common(pr)

def _pairs(items: list[str], flag: str, table: str, example: str) -> list[str]:
    """``flag KEY=VALUE`` items as overrides of the dict-valued field ``table`` (Beam's own ``--key`` spelling of a
    key is accepted too)."""
    out = []
    for item in items:
        key, sep, value = item.partition("=")
        key = key.strip().lstrip("-")
        if not sep or not key:
            raise SparklmError(f"bad {flag} '{item}'", hint=f"write {flag} key=value, e.g. {flag} {example}")
        out.append(f"{table}.{key}={value}")
    return out


def _config(args: argparse.Namespace):
    """(the resolved Config, what the user set: file, --set, --conf and flags, as nested data)."""
    overrides = list(args.overrides)
    overrides += _pairs(args.conf, "--conf", "spark.conf", "spark.executor.memory=4g")
    overrides += _pairs(getattr(args, "pipeline_options", []), "--pipeline-option", "beam.options",
                        "direct_num_workers=2")
    typed = redact.literal_secrets(overrides)  # --set and --conf values (a --config file is not on the command line)
    if typed:
        raise SparklmError(f"{typed[0]} is given on the command line, where every user of this host reads it (ps)",
                           hint="export it in an environment variable NAME and write the value as '${env:NAME}', or "
                                "set it in a --config file only you can read")
    flags = {key: getattr(args, key) for key, _, _ in fields_with_flags() if getattr(args, key, None) is not None}
    if isinstance(flags.get("train.workers"), tuple):  # --workers MIN:MAX
        flags["train.workers_min"], flags["train.workers"] = flags["train.workers"]
    if getattr(args, "prepare_task", None):  # prepare's --task is data.task (train's and run's is model.task)
        flags["data.task"] = args.prepare_task
    if "tokenizer.path" in flags and "tokenizer.vocab_size" in flags:
        raise SparklmError("--tokenizer and --vocab-size exclude each other",
                           hint="--vocab-size sizes a tokenizer sparklm trains; --tokenizer uses an existing one")
    raw = load_raw(args.config, overrides, flags)
    redact.mapping(raw)  # remember secret values given here, so no printed line shows them
    return from_dict(raw), raw


def _session_factory(args: argparse.Namespace, config):
    """Start Spark only when a stage needs it (after its inputs are checked), logging the JVM to a file."""
    from .spark.session import default_jvm_log, get_session, refuse_connect

    def start():
        refuse_connect()  # before pyspark.sql routes to Spark Connect (whose client may not even be installed)
        from pyspark.sql import SparkSession

        log = None if args.debug else default_jvm_log()
        t0 = time.time()
        running = SparkSession.getActiveSession()
        before = signal.getsignal(signal.SIGINT)
        spark = get_session(config.spark, jvm_log=log)
        if spark is not running:
            _STARTED.append(spark)
            if threading.current_thread() is threading.main_thread():
                _SIGINT.append(before)
                signal.signal(signal.SIGINT, _interrupted)
        progress.info(f"Spark {spark.version} ({spark.sparkContext.master}) started in {time.time() - t0:.1f}s"
                      + (f" [dim](JVM log: {log})[/dim]" if log else ""))
        return spark

    return start


def _prepare(args: argparse.Namespace) -> int:
    from .launch.prepare import prepare

    config, _ = _config(args)
    inputs = _inputs(args)
    dataset = prepare(inputs, output=args.output, config=config, validation_inputs=args.validation_inputs,
                      overwrite=args.overwrite, spark=_session_factory(args, config))
    progress.plain(dataset.uri)
    return 0


def _train(args: argparse.Namespace) -> int:
    from .launch.train import train

    config, changes = _config(args)
    summary = train(args.data, output=args.output, config=config, resume=args.resume, changes=changes,
                    spark=_session_factory(args, config))
    progress.plain(args.output)
    return 0 if summary else 1


def _tune(args: argparse.Namespace) -> int:
    from .launch.tune import fair, tune

    config, _ = _config(args)
    summary = tune(args.data, output=args.output, space=args.space, trials=args.trials, concurrent=args.concurrent,
                   metric=args.metric, direction=args.direction, sampler=args.sampler, pruner=args.pruner,
                   storage=args.storage, resume=args.resume, seed=args.seed, config=config,
                   spark=_session_factory(args, fair(config)))
    best = summary["best"]
    progress.plain(best["model"] or best["run_dir"] if best else args.output)
    return 0 if best else 1


def _run(args: argparse.Namespace) -> int:
    from .launch.prepare import prepare
    from .launch.train import train

    config, raw = _config(args)
    tc = config.train
    if not (tc.max_steps or tc.epochs or tc.max_tokens or tc.time_budget):
        tc = replace(tc, time_budget=RUN_TIME_BUDGET)
    if "early_stop" not in raw.get("train", {}):
        tc = replace(tc, early_stop=RUN_EARLY_STOP)
    config = config.replace(train=tc)
    if config.model.init_from and not config.tokenizer.path:  # a pretrained model reads text with its own tokenizer
        config = config.replace(tokenizer=replace(config.tokenizer, path=config.model.init_from))
    # the data is prepared for the task the run trains
    config = config.replace(data=replace(config.data, task=registry.task(config.model.task).data[0]))
    run_dir = args.output or f"runs/run-{time.strftime('%Y%m%d-%H%M%S')}"
    inputs = _inputs(args)
    start = _session_factory(args, config)
    holder: dict = {}

    def session():
        if "spark" not in holder:  # one session for both stages
            holder["spark"] = start()
        return holder["spark"]

    data_dir = f"{run_dir}/data"
    if Path(run_dir).exists() and any(Path(run_dir).iterdir()):
        raise SparklmError(f"run directory {run_dir} already exists", hint="choose another --output")
    prepare(inputs, output=data_dir, config=config, spark=session)
    summary = train(data_dir, output=run_dir, config=config, spark=session)
    made = registry.task(config.model.task).shows  # beside the report
    progress.info((f"{made}: {run_dir}/{made}, " if made else "") + f"report: {run_dir}/report.html")
    progress.plain(run_dir)
    kept = summary["best"] or summary["final"]
    if kept:
        head = registry.task(summary["task"]).figures.main
        progress.plain(f"validation {head.label} of model/ (step {kept.get('step', summary['steps'])}): "
                       f"{kept[head.key]:{head.fmt}}")
    return 0


def _report(args: argparse.Namespace) -> int:
    from .infra.fs import effective
    from .metrics.html_report import REPORT, write_comparison, write_report

    config, _ = _config(args)
    storage = effective(config.storage)
    if len(args.runs) == 1:
        path = write_report(args.runs[0], storage, output=args.output)
    else:
        path = write_comparison(args.runs, args.output or REPORT, storage)
    progress.plain(path)
    return 0


def _sampling_flags(group) -> None:
    """One flag per :class:`Sampling` field (``top_k`` → ``--top-k``), its help and default from the field."""
    from .infer.sampling import Sampling

    for f in dataclasses.fields(Sampling):
        group.add_argument("--" + f.name.replace("_", "-"), dest=f.name, type=type(f.default),
                           metavar=f.metadata["metavar"], help=f"{f.metadata['help']} (default {f.default})")


def _sampling(args: argparse.Namespace):
    from .infer.sampling import Sampling

    names = [f.name for f in dataclasses.fields(Sampling)]
    return Sampling(**{n: getattr(args, n) for n in names if getattr(args, n) is not None})


def _generate(args: argparse.Namespace) -> int:
    from .data.clean import surrogate
    from .infer import batch
    from .infra.fs import effective
    from .spark.resources import check_batching

    sampling = _sampling(args)
    if args.show_top < 0:
        raise SparklmError("--show-top must be >= 0")
    check_batching(args.batch_size, args.threads)
    if args.input:
        return _generate_on_spark(args, sampling)
    from .infer.generate import generate

    if args.output:
        batch.check_output(args.output, args.overwrite)
    prompts = list(args.prompt)
    for prompt in prompts:  # Python decodes argv bytes that are not UTF-8 to half UTF-16 pairs (surrogateescape)
        if (at := surrogate(prompt)) >= 0:
            raise SparklmError(f"--prompt holds bytes that are not UTF-8 (byte 0x{ord(prompt[at]) & 0xFF:02x} at "
                               f"character {at + 1})", hint="set a UTF-8 locale (e.g. LANG=C.UTF-8), or write the "
                                                            "prompt into a UTF-8 --prompt-file")
    storage = effective(_config(args)[0].storage)
    if args.prompt_file:
        prompts += [text for _, text in batch.read_prompts(args.prompt_file, field=args.prompt_field, storage=storage)]
    if not prompts:
        raise SparklmError("no prompt given", hint='pass --prompt "text", --prompt-file FILE or --input FILE')
    lm = _generation_model(args, storage)
    streaming = len(prompts) == 1 and sampling.num_samples == 1 and not args.show_top and not args.output
    echoed = []  # the prompt is echoed with the first piece: a prompt generate refuses prints only its error

    def on_text(_row: int, piece: str) -> None:
        sys.stdout.write(piece if echoed else prompts[0] + piece)
        sys.stdout.flush()
        echoed.append(True)

    gens = generate(lm, prompts, sampling=sampling, batch_size=args.batch_size, show_top=args.show_top,
                    on_text=on_text if streaming else None)
    if streaming:
        sys.stdout.write(("" if echoed else prompts[0]) + "\n")
    elif not args.output:
        for g in gens:
            print(f"--- prompt {g.key}, sample {g.sample}" + (" (prompt truncated)" if g.truncated else ""))
            print(g.prompt + g.text)
            for i, top in enumerate(g.top):
                chosen = lm.tokenizer.decode([g.token_ids[i]])
                cells = "  ".join(f"{t!r} {p:.1%}" for t, p in top)
                print(f"  {i:>3} {chosen!r:>14} <- {cells}")
    if args.output:
        batch.write_generations([g.record() for g in gens], args.output)
        progress.plain(args.output)
    return 0


def _generation_model(args: argparse.Namespace, storage):
    """``generate``'s model on its backend: torch (optionally int8), an ONNX export, or llama.cpp."""
    from .infer import backends

    return backends.load(args.model, backend=args.backend, quantize=args.quantize, threads=args.threads,
                        storage=storage, device=args.device, batch_size=args.batch_size)


def _generate_on_spark(args: argparse.Namespace, sampling) -> int:
    """``generate --input``: a file of prompts, generated for by Spark tasks, written to ``--output``."""
    from .infer import batch
    from .infra.fs import effective

    if args.prompt or args.prompt_file:
        raise SparklmError("give prompts either with --input (batch on Spark) or with --prompt/--prompt-file")
    if not args.output:
        raise SparklmError("--input needs --output FILE (.jsonl or .parquet)")
    batch.check_output(args.output, args.overwrite)
    if args.backend == "onnx":
        raise SparklmError("batch generation on Spark runs on torch or llama.cpp", hint="drop --backend onnx")
    from .infer.generate import model_uri

    config, _ = _config(args)
    model_uri(args.model, effective(config.storage))  # a missing model fails here, not in a task
    prompts = batch.read_prompts(args.input, field=args.prompt_field, storage=effective(config.storage))
    spark = _session_factory(args, config)()
    from .spark.session import check_shared

    check_shared(spark, {"model": args.model})
    df = spark.createDataFrame(prompts, "id long, prompt string")
    df = df.repartition(min(len(prompts), spark.sparkContext.defaultParallelism))
    with progress.stage(spark, f"generate ({len(prompts)} prompts)", quiet=True):
        out = batch.generate_dataframe(df, model=args.model, id_col="id", output_col="text", sampling=sampling,
                                       batch_size=args.batch_size, threads=args.threads, storage=config.storage,
                                       backend=args.backend, quantize=args.quantize)
        rows = [r.asDict() for r in out.select(*batch.OUTPUT_COLUMNS).collect()]
    rows.sort(key=lambda r: (r["id"], r["sample"]))
    batch.write_generations(rows, args.output)
    progress.plain(args.output)
    return 0


def _predict(args: argparse.Namespace) -> int:
    from .infer.predict import check_output, predict
    from .infra.fs import effective
    from .spark.resources import check_batching

    check_batching(args.batch_size, args.threads)
    config, _ = _config(args)
    storage = effective(config.storage)
    check_output(Path(args.output).expanduser().resolve(), args.overwrite)  # before Spark starts
    spark = _session_factory(args, config)()
    with progress.stage(spark, "predict", quiet=True):
        info = predict(spark, args.model, args.inputs, args.output, text_col=args.text_col, embed=args.embed,
                       pooling=args.pooling, normalize=args.normalize, probabilities=args.probabilities,
                       input_format_=args.input_format, batch_size=args.batch_size, threads=args.threads,
                       overwrite=args.overwrite, storage=storage, label_field=args.label_field)
    against = info.get("scored_against")
    if against and against["accuracy"] is not None:
        progress.info(f"accuracy against {against['field']!r}: {against['accuracy']:.2%} of {against['rows']:,} rows")
    labels = ", ".join(f"{k} {v:,}" for k, v in sorted(info.get("labels", {}).items()))
    progress.plain(f"{info['rows']:,} rows → {info['path']}" + (f" ({labels})" if labels else "")
                   + (f"; {info['truncated']:,} truncated to the model's positions" if info["truncated"] else ""))
    return 0


def _eval(args: argparse.Namespace) -> int:
    from .infer.evaluate import evaluate

    if bool(args.tasks) == bool(args.inputs):
        raise SparklmError("eval takes --input (text to score) or --tasks (benchmark tasks)" if not args.tasks
                           else "--input and --tasks exclude each other",
                           hint="e.g. --input data.txt, or --tasks hellaswag,arc_easy")
    if args.tasks:
        return _eval_tasks(args)
    config, _ = _config(args)
    if args.output and Path(args.output).exists() and not args.overwrite:
        raise SparklmError(f"{args.output} already exists", hint="pass --overwrite to replace it, or another --output")
    with progress.stage(None, "eval", quiet=True):
        result = evaluate(args.model, args.inputs, config=config, max_length=args.max_length, stride=args.stride,
                          batch_size=args.batch_size, threads=args.threads, spark=_session_factory(args, config))
    progress.info(f"{result['documents']} documents, {result['tokens']:,} tokens scored "
                  f"(window {result['max_length']}, stride {result['stride']})")
    progress.plain(registry.task(config.model.task).figures.line(result, by="name"))
    if args.output:
        from .infra.fs import write_text

        write_text(args.output, json.dumps(result, indent=2))
    return 0


def _eval_tasks(args: argparse.Namespace) -> int:
    from .launch.benchmarks import run_benchmarks

    config, _ = _config(args)
    result = run_benchmarks(args.model, args.tasks.split(","), config=config, output=args.output,
                            overwrite=args.overwrite, num_fewshot=args.num_fewshot, limit=args.limit,
                            batch_size=args.batch_size, seed=args.seed, threads=args.threads,
                            task_data=args.task_data, log_samples=args.log_samples,
                            spark=_session_factory(args, config))
    progress.plain(result["table"])
    return 0


def _export(args: argparse.Namespace) -> int:
    from .infer.export import export
    from .infra.fs import effective

    config, _ = _config(args)
    if args.format == "hub":
        from .infer.export import export_hub

        if args.quantize != "none":
            raise SparklmError("--quantize applies to --format onnx and gguf", hint="drop --quantize for --format hub")
        info = export_hub(args.model, args.output, overwrite=args.overwrite, merge=args.merge,
                          storage=effective(config.storage))
        progress.info(f"Hub repository files: {', '.join(f for f in info['files'])}")
        progress.plain(info["path"])
        return 0
    if args.format == "gguf":
        from .infer.gguf_export import export_gguf

        if args.merge:
            raise SparklmError("--merge applies to --format onnx", hint="a GGUF file always holds the merged model")
        info = export_gguf(args.model, args.output, quantize=args.quantize, overwrite=args.overwrite,
                           storage=effective(config.storage))
        progress.info(f"GGUF file ({info['quantize']}, {info['arch']}, pre-tokenizer {info['pre_tokenizer']}): "
                      f"{info['bytes'] / 1e6:.1f} MB")
        progress.plain(info["path"])
        return 0
    if args.quantize not in ("none", "int8", "int4"):
        raise SparklmError(f"--quantize {args.quantize} applies to --format gguf", hint="onnx: none, int8 or int4")
    info = export(args.model, args.output, quantize=args.quantize, overwrite=args.overwrite, merge=args.merge,
                  storage=effective(config.storage))
    progress.info(f"ONNX graph ({args.quantize}): {info['bytes'] / 1e6:.1f} MB"
                  + (" and the merged HF model (model.safetensors)" if args.merge else ""))
    progress.plain(info["path"])
    return 0


def _import(args: argparse.Namespace) -> int:
    from .model.gguf import convert

    with progress.stage(None, f"import {Path(args.gguf).name}", quiet=True):
        info = convert(args.gguf, args.output, overwrite=args.overwrite)
    progress.info(f"{info['architecture']}, {info['params'] / 1e6:.1f}M parameters, {info['bytes'] / 1e6:.0f} MB "
                  f"of safetensors in {info['seconds']:.1f}s")
    progress.plain(info["path"])
    return 0


def _print_config(args: argparse.Namespace) -> int:
    from .config import describe

    sys.stdout.write(describe())
    return 0


def main(argv: list[str] | None = None) -> int:
    for name in ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
        redact.remember(os.environ.get(name, ""))
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        commands = {"prepare": _prepare, "train": _train, "run": _run, "report": _report, "generate": _generate,
                    "eval": _eval, "export": _export, "import": _import, "config": _print_config, "tune": _tune,
                    "predict": _predict}
        return commands[args.command](args)
    except SparklmError as e:
        if args.debug:
            raise
        print(e.one_line(), file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except OSError as e:  # the driver's own disk or memory, a path it cannot write: foreseeable, one line
        known = known_cause(f"{e} errno {e.errno}")
        cause = (f"{known[0]}: {e.filename or e}", known[1]) if known else _unwritable(e)
        if cause is None or args.debug:
            raise
        print(SparklmError(cause[0], hint=cause[1]).one_line(), file=sys.stderr)
        return 2
    finally:
        _stop_spark()


def _unwritable(e: OSError) -> tuple[str, str] | None:
    """(what, hint) for a path this user cannot create a file at (no such directory, not a directory, no permission,
    a read-only file system, a file where a directory is needed), naming the directory where the file was one of
    sparklm's temporary names; else None."""
    import errno

    if not e.filename or e.errno not in (errno.ENOENT, errno.ENOTDIR, errno.EACCES, errno.EPERM, errno.EROFS,
                                         errno.EISDIR, errno.EEXIST):
        return None
    where = os.fspath(e.filename)
    name = os.path.basename(where)
    if name.startswith(".") and (".tmp-" in name or ".sparklm-tmp-" in name or name.endswith(".sparklm.lock")):
        where = os.path.dirname(where) or "."
    return (f"cannot write to {where}: {e.strerror}",
            "check the path and that this user may write there (--debug shows where it failed)")


def _stop_spark() -> None:
    """Stop the session this command started (not one it found running: main() may run in a caller's process)."""
    while _STARTED:
        try:
            _STARTED.pop().stop()
        except Exception:  # the JVM already died (its error was reported): stopping it is moot, not a traceback
            pass
    while _SIGINT:  # the caller's Ctrl-C handling again
        signal.signal(signal.SIGINT, _SIGINT.pop())


def _interrupted(signum, frame) -> None:
    """Ctrl-C while this command's Spark runs: one line and exit 130, at once.

    pyspark's own handler cancels the jobs over the py4j connection the main thread is blocked reading (a reentrant
    read), and the Spark calls that follow fail one after another: ~50 lines of tracebacks. Nothing needs that
    clean-up: every output sparklm writes appears whole or not at all (an interrupted checkpoint or dataset is a
    hidden staging name, removed by the next run), and the JVM exits when this process does (its gateway watches
    our pipe), ending its executors' work with it. Only the run's lock is let go first (else the next run waits
    for it, or is refused)."""
    held = sys.modules.get("sparklm.infra.runlock")  # not imported: no lock held
    if held is not None:
        held.release_all()
    progress.last_words("interrupted")
    os._exit(130)


if __name__ == "__main__":
    sys.exit(main())
