"""Benchmark: which training changes reach a lower validation loss in the same wall time.

    .venv/bin/python benchmarks/convergence.py --budget 120 --variants base muon qk_norm untied --repeats 1

Every variant is a `sparklm train --time-budget S` of the defaults plus a few settings, on the same
prepared data (the main job's: `sparklm prepare` defaults on Pride and Prejudice; a variant that
changes the tokenizer or the training text prepares its own), each in a fresh process, interleaved
across repeats, on `local[2]`. Every run's model/ is scored on the same reference: Pride and
Prejudice's validation documents (its hash split, as the main job splits it), packed with the run's
own tokenizer, so variants with other tokenizers or more books compare on equal terms. Reported:
the median over repeats of that figure, of the run's own best and final validation bits/byte,
steps, ms/step, and the train − validation loss gap at the end.
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PRIDE = ROOT / "src" / "sparklm" / "corpus" / "pride_and_prejudice.txt"

# name -> (prepare flags, train flags); a prepare flag "@books" trains on every bundled book.
# Variants combine with "+": books+muon+qk_norm.
VARIANTS: dict[str, tuple[list[str], list[str]]] = {
    "base": ([], []),
    "muon": ([], ["--set", "train.optimizer=muon"]),
    "qk_norm": ([], ["--set", "model.qk_norm=true"]),
    "untied": ([], ["--set", "model.tie_embeddings=false"]),
    "vocab_8192": (["--vocab-size", "8192"], []),
    "vocab_2048": (["--vocab-size", "2048"], []),
    "dropout_0.1": ([], ["--set", "model.dropout=0.1"]),
    "wd_0.3": ([], ["--set", "train.weight_decay=0.3"]),
    "batch_16": ([], ["--set", "train.batch_size=16"]),
    "lr_2e-3": ([], ["--set", "train.lr=2e-3"]),
    "lr_5e-3": ([], ["--set", "train.lr=5e-3"]),
    "books": (["@books"], []),
    "small_3x192": ([], ["--set", "model.n_layer=3", "--set", "model.n_embd=192"]),
}


def variant(name: str) -> tuple[list[str], list[str]]:
    prep, flags = [], []
    for part in name.split("+"):
        if part not in VARIANTS:
            raise SystemExit(f"unknown variant {part!r}: one of {', '.join(sorted(VARIANTS))}")
        prep, flags = prep + VARIANTS[part][0], flags + VARIANTS[part][1]
    return prep, flags


def books() -> list[str]:
    return [str(p) for p in sorted(PRIDE.parent.glob("*.txt"))]


def prepared(work: Path, flags: list[str], inputs: list[str] | None = None) -> Path:
    out = work / ("data-" + ("-".join(f.strip("-@/").replace("/", "_") for f in flags) or "default"))
    if "@books" in flags:
        flags, inputs = [f for f in flags if f != "@books"], books()
    if not (out / "manifest.json").exists():
        subprocess.run([sys.executable, "-m", "sparklm", "prepare", *(inputs or [str(PRIDE)]), "-o", str(out),
                        "--overwrite", "--master", "local[2]", "--set", "spark.ui=false", *flags], check=True,
                       capture_output=True)
    return out


def reference_bpb(model_dir: Path, data: Path) -> float:
    """Bits/byte of ``model_dir`` on the validation split of the prepared ``data``: the training core's
    evaluation (whole split, packed rows, fp32) of the model continued from ``model_dir``."""
    from sparklm.config import from_dict
    from sparklm.data.manifest import load_prepared, load_tokenizer
    from sparklm.train.core import Trainer
    from sparklm.train.resolve import local

    dataset = load_prepared(str(data))
    config = from_dict({"model": {"init_from": str(model_dir)},
                        "train": {"eval_batches": 0, "dtype": "float32", "optimizer": "adamw"}})
    trainer = Trainer(local(config, dataset), dataset, load_tokenizer(dataset))
    return trainer.task.figures(trainer.eval_sums(0, 1).tolist())["val_bpb"]


def run(name: str, data: Path, flags: list[str], budget: float, work: Path, extra: list[str], rep: int) -> dict:
    out = work / f"{name}-{rep}"
    subprocess.run(["rm", "-rf", str(out)], check=True)
    t0 = time.time()
    r = subprocess.run([sys.executable, "-m", "sparklm", "train", "--data", str(data), "-o", str(out),
                        "--time-budget", str(budget), "--master", "local[2]", "--set", "spark.ui=false",
                        "--set", "train.eval_batches=0", "--set", "train.samples=0", *flags, *extra],
                       capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"{name}: {r.stderr[-3000:]}")
    wall = time.time() - t0
    s = json.loads((out / "summary.json").read_text())
    with open(out / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    evals = [float(x["val_bpb"]) for x in rows if x["kind"] == "eval" and x["val_bpb"]]
    train = [float(x["loss"]) for x in rows if x["kind"] == "train" and x["loss"]]
    tail = train[-5:] or [float("nan")]
    ref = prepared(work, ["--tokenizer", str(out / "model")], [str(PRIDE)])  # Pride and Prejudice, this tokenizer
    return {"variant": name, "rep": rep, "wall_s": wall, "steps": s["steps"], "ms_per_step": s["ms_per_step"],
            "pride_bpb": reference_bpb(out / "model", ref),
            "final_bpb": s["final"]["val_bpb"], "best_bpb": min(evals), "val_loss": s["final"]["val_loss"],
            "train_loss": sum(tail) / len(tail), "epochs": s["epochs"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budget", type=float, default=120, help="training seconds per run")
    ap.add_argument("--variants", nargs="+", default=["base", "muon"], help=f"of {', '.join(VARIANTS)}, or A+B+…")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--input", action="append", default=[], help="text to prepare (default: the bundled corpus)")
    ap.add_argument("--work", default=str(ROOT / ".bench" / "convergence"))
    ap.add_argument("--set", dest="sets", action="append", default=[], help="extra --set for every run")
    args = ap.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    extra = [a for s in args.sets for a in ("--set", s)]
    results = []
    for rep in range(args.repeats):
        for name in args.variants:
            prep, flags = variant(name)
            r = run(name, prepared(work, prep, args.input), flags, args.budget, work, extra, rep)
            results.append(r)
            print(f"{name} #{rep}: Pride and Prejudice {r['pride_bpb']:.4f}, best {r['best_bpb']:.4f}, final {r['final_bpb']:.4f} bits/byte, {r['steps']} steps, "
                  f"{r['ms_per_step']:.0f} ms/step, train {r['train_loss']:.3f} vs val {r['val_loss']:.3f} nats",
                  flush=True)
    (work / f"results-{int(time.time())}.json").write_text(json.dumps(results, indent=2))
    print(f"\n{args.budget:.0f} s of training each, median of {args.repeats}\n")
    print("| variant | model/ on P&P validation (bits/byte) | own best val | own final val | steps | ms/step "
          "| train − val loss (nats) |")
    print("|---|---|---|---|---|---|---|")
    for name in args.variants:
        rs = [r for r in results if r["variant"] == name]
        med = {k: statistics.median(r[k] for r in rs)
               for k in ("pride_bpb", "best_bpb", "final_bpb", "steps", "ms_per_step")}
        gap = statistics.median(r["train_loss"] - r["val_loss"] for r in rs)
        print(f"| {name} | {med['pride_bpb']:.4f} | {med['best_bpb']:.4f} | {med['final_bpb']:.4f} | "
              f"{med['steps']:.0f} | {med['ms_per_step']:.0f} | {gap:+.3f} |")


if __name__ == "__main__":
    main()
