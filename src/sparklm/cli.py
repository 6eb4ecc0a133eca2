"""The ``sparklm`` command: argument parsing only; each subcommand calls one stage function."""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from importlib import resources
from pathlib import Path

from . import __version__, progress
from .config import load_config
from .errors import SparklmError

# flag dest -> config key; flags win over --set, which wins over --config.
_FLAG_KEYS = {
    "seq_len": "data.seq_len", "stride": "data.stride", "val_fraction": "data.val_fraction",
    "text_field": "data.text_field", "doc_mode": "data.doc_mode", "min_chars": "data.min_chars",
    "encoding": "data.encoding", "last_block": "data.last_block", "concat": "data.concat",
    "dedup": "data.dedup", "vocab_size": "tokenizer.vocab_size", "tokenizer": "tokenizer.path",
    "master": "spark.master", "endpoint_url": "storage.endpoint_url",
    "workers": "train.workers", "threads": "train.threads", "max_steps": "train.max_steps", "epochs": "train.epochs",
    "max_tokens": "train.max_tokens", "time_budget": "train.time_budget", "init_from": "model.init_from",
    "eval_every": "train.eval_every", "checkpoint_every": "train.checkpoint_every",
}
RUN_TIME_BUDGET = 360  # seconds of training when `sparklm run` is given no budget: the whole job fits in 10 minutes


def default_corpus() -> str:
    """The public-domain book bundled with sparklm: the default input of the main job."""
    corpus = resources.files("sparklm") / "corpus"
    return str(next(p for p in corpus.iterdir() if p.name.endswith(".txt")))


def _common(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("configuration")
    g.add_argument("--config", metavar="FILE", help="TOML config file (see configs/default.toml)")
    g.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override one config value, e.g. --set data.seq_len=128 (repeatable)")
    g.add_argument("--master", metavar="URL", help="Spark master: local[*] (default), spark://host:7077, yarn, k8s://…")
    g.add_argument("--conf", action="append", default=[], metavar="KEY=VALUE", help="Spark configuration (repeatable)")
    g.add_argument("--endpoint-url", metavar="URL", help="S3 endpoint for s3:// paths (default: AWS_ENDPOINT_URL)")
    g.add_argument("--debug", action="store_true", help="show tracebacks")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sparklm", description="Train transformer language models on Apache Spark.")
    parser.add_argument("--version", action="version", version=f"sparklm {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("prepare", help="raw text → tokenized, packed Parquet (a Spark job)",
                       description="Read, clean, deduplicate, split, tokenize and pack text into Parquet.")
    p.add_argument("inputs", nargs="*", metavar="INPUT",
                   help="files, directories or globs (.txt[.gz|.bz2], .jsonl[.gz], .csv, .parquet; local or s3://); "
                        "default: the bundled corpus")
    p.add_argument("--output", "-o", default="prepared", metavar="DIR", help="output directory (default: prepared)")
    p.add_argument("--validation-input", dest="validation_inputs", action="append", default=[], metavar="PATH",
                   help="explicit validation files (repeatable); otherwise a hash split by --val-fraction")
    tok = p.add_mutually_exclusive_group()
    tok.add_argument("--tokenizer", metavar="PATH", help="existing tokenizer.json or HF tokenizer directory")
    tok.add_argument("--vocab-size", type=int, metavar="N", help="train a byte-level BPE of this size")
    p.add_argument("--seq-len", type=int, metavar="N", help="tokens per sequence")
    p.add_argument("--stride", type=int, metavar="N", help="window stride (< seq-len: overlapping windows)")
    p.add_argument("--val-fraction", type=float, metavar="F", help="fraction of documents for validation")
    p.add_argument("--text-field", metavar="NAME", help="text column/field of JSONL, CSV and Parquet inputs")
    p.add_argument("--doc-mode", choices=["file", "paragraph", "line"], help="how plain text splits into documents")
    p.add_argument("--min-chars", type=int, metavar="N", help="drop documents shorter than this")
    p.add_argument("--encoding", metavar="NAME", help="input text encoding (default utf-8)")
    p.add_argument("--last-block", choices=["auto", "drop", "pad"], help="last partial block: drop or pad")
    p.add_argument("--no-concat", dest="concat", action="store_false", default=None,
                   help="one document per sequence, padded (default: concatenate documents)")
    p.add_argument("--no-dedup", dest="dedup", action="store_false", default=None, help="keep exact duplicates")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output")
    _common(p)

    t = sub.add_parser("train", help="train a model on a prepared dataset (Spark barrier tasks, DDP)",
                       description="Train a decoder-only transformer on a prepared dataset.")
    t.add_argument("--data", metavar="DIR", help="prepared dataset (from `sparklm prepare`)")
    t.add_argument("--output", "-o", required=True, metavar="RUN_DIR", help="run directory")
    t.add_argument("--resume", action="store_true", help="continue the run in --output from its last checkpoint")
    _train_flags(t)
    _common(t)

    r = sub.add_parser("run", help="the main job: prepare → train → samples (default: the bundled corpus)",
                       description="Prepare text, train a model on it and write samples, in one run directory.")
    r.add_argument("inputs", nargs="*", metavar="INPUT", help="text inputs as for prepare; default: the bundled corpus")
    r.add_argument("--output", "-o", metavar="RUN_DIR", help="run directory (default: runs/run-TIMESTAMP)")
    r.add_argument("--vocab-size", type=int, metavar="N", help="tokenizer vocabulary size")
    r.add_argument("--seq-len", type=int, metavar="N", help="tokens per sequence")
    _train_flags(r)
    _common(r)
    return parser


def _train_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("training")
    g.add_argument("--workers", type=int, metavar="N", help="Spark tasks, one DDP rank each (default 1)")
    g.add_argument("--threads", type=int, metavar="N", help="torch threads per worker (default: cores / workers)")
    g.add_argument("--max-steps", type=int, metavar="N", help="optimizer steps")
    g.add_argument("--epochs", type=float, metavar="N", help="passes over the training tokens")
    g.add_argument("--max-tokens", type=int, metavar="N", help="training tokens")
    g.add_argument("--time-budget", type=float, metavar="SECONDS", help="seconds of training")
    g.add_argument("--init-from", metavar="DIR", help="continue training a local HF causal-LM directory")
    g.add_argument("--eval-every", type=int, metavar="N", help="evaluate every N steps")
    g.add_argument("--checkpoint-every", type=int, metavar="N", help="checkpoint every N steps")


def _config(args: argparse.Namespace):
    overrides = list(args.overrides)
    for dest, key in _FLAG_KEYS.items():
        value = getattr(args, dest, None)
        if value is not None:
            overrides.append(f"{key}={json.dumps(value)}")
    for item in args.conf:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SparklmError(f"bad --conf '{item}'", hint="write --conf key=value, e.g. --conf spark.executor.memory=4g")
        overrides.append(f"spark.conf.{key}={value}")
    return load_config(args.config, overrides)


def _session_factory(args: argparse.Namespace, config):
    """Start Spark only when a stage needs it (after its inputs are checked), logging the JVM to a file."""
    from .spark import default_jvm_log, get_session

    def start():
        log = None if args.debug else default_jvm_log()
        t0 = time.time()
        spark = get_session(config.spark, jvm_log=log)
        progress.info(f"Spark {spark.version} ({config.spark.master}) started in {time.time() - t0:.1f}s"
                      + (f" [dim](JVM log: {log})[/dim]" if log else ""))
        return spark

    return start


def _prepare(args: argparse.Namespace) -> int:
    from .data.prepare import prepare

    config = _config(args)
    inputs = args.inputs or [default_corpus()]
    if not args.inputs:
        progress.info(f"no input given: using the bundled corpus {inputs[0]}")
    dataset = prepare(inputs, output=args.output, config=config, validation_inputs=args.validation_inputs,
                      overwrite=args.overwrite, spark=_session_factory(args, config))
    progress.plain(dataset.uri)
    return 0


def _train(args: argparse.Namespace) -> int:
    from .train.run import train

    config = _config(args)
    summary = train(args.data, output=args.output, config=config, resume=args.resume,
                    spark=_session_factory(args, config))
    progress.plain(args.output)
    return 0 if summary else 1


def _run(args: argparse.Namespace) -> int:
    from .data.prepare import prepare
    from .train.run import train

    config = _config(args)
    tc = config.train
    if not (tc.max_steps or tc.epochs or tc.max_tokens or tc.time_budget):
        config = config.replace(train=replace(tc, time_budget=RUN_TIME_BUDGET))
    run_dir = args.output or f"runs/run-{time.strftime('%Y%m%d-%H%M%S')}"
    inputs = args.inputs or [default_corpus()]
    if not args.inputs:
        progress.info(f"no input given: using the bundled corpus {inputs[0]}")
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
    progress.info(f"samples: {run_dir}/samples.txt, loss curve: {run_dir}/loss.png")
    progress.plain(run_dir)
    if summary["final"]:
        progress.plain(f"final validation bits/byte: {summary['final']['val_bpb']:.4f}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return {"prepare": _prepare, "train": _train, "run": _run}[args.command](args)
    except SparklmError as e:
        if args.debug:
            raise
        print(e.one_line(), file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    finally:
        _stop_spark()


def _stop_spark() -> None:
    if "pyspark" in sys.modules:
        from pyspark.sql import SparkSession

        active = SparkSession.getActiveSession()
        if active is not None:
            active.stop()


if __name__ == "__main__":
    sys.exit(main())
