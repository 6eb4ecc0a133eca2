"""Issue 82's benchmark: a pruned search against the default settings and against the same search unpruned.

On Tiny Shakespeare (../shared/data), one prepared dataset. Three commands, each a fresh `sparklm` process on
local[2], run one after the other:

1. `train` with the default settings at the per-trial budget (the baseline a search must beat);
2. `tune` with 12 trials over the learning rate and the width, 2 at once, median pruning;
3. the same `tune` with `--pruner none`.

It prints the validation bits/byte of (1) and of each study's best trial, each command's wall time, and the
ratio of the two studies' wall times (target: the pruned one ≥ 30% shorter).

    .venv/bin/python benchmarks/tune.py [--rounds 1] [--steps 200]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TEXT = ROOT.parent / "shared" / "data" / "tinyshakespeare.txt"
SPACE = ["train.lr=loguniform(0.0003,0.03)", "model.n_embd=choice(64,128,256)"]


def sparklm(*args: str) -> tuple[float, str]:
    t0 = time.time()
    r = subprocess.run([sys.executable, "-m", "sparklm", *args], capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"sparklm {' '.join(args[:3])} failed:\n{r.stderr[-3000:]}")
    return time.time() - t0, r.stdout


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--trials", type=int, default=12)
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="sparklm-tune-bench-"))
    fixed = ["--max-steps", str(a.steps), "--eval-every", str(a.steps // 8), "--set", "model.n_layer=2",
             "--set", "model.n_head=4", "--set", "train.batch_size=16", "--set", "train.samples=0",
             "--master", "local[2]", "--set", "spark.ui=false"]
    try:
        sparklm("prepare", str(TEXT), "-o", str(work / "data"), "--seq-len", "64", "--vocab-size", "1000",
                "--master", "local[2]", "--set", "spark.ui=false")
        out: dict[str, list] = {"default": [], "pruned": [], "unpruned": []}
        for k in range(a.rounds):
            wall, _ = sparklm("train", "--data", str(work / "data"), "-o", str(work / f"default-{k}"), *fixed)
            summary = json.loads((work / f"default-{k}" / "summary.json").read_text())
            out["default"].append((wall, summary["best"]["val_bpb"]))
            for name, pruner in (("pruned", "median"), ("unpruned", "none")):
                run = work / f"{name}-{k}"
                wall, _ = sparklm("tune", "--data", str(work / "data"), "-o", str(run), "--trials", str(a.trials),
                                  "--concurrent", "2", "--pruner", pruner,
                                  *[x for s in SPACE for x in ("--space", s)], *fixed)
                best = json.loads((run / "best.json").read_text())
                states = [t["state"] for t in best["trials"]]
                out[name].append((wall, best["best"]["value"], states.count("pruned")))
            print(json.dumps({k: v[-1] for k, v in out.items()}), flush=True)
        print(json.dumps(out, indent=2))
        p, u = sorted(w for w, *_ in out["pruned"]), sorted(w for w, *_ in out["unpruned"])
        print(f"pruned / unpruned wall (medians): {p[len(p) // 2]:.0f} / {u[len(u) // 2]:.0f} s = "
              f"{p[len(p) // 2] / u[len(u) // 2]:.2f}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
