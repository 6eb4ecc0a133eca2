"""Benchmark: validation bits/byte against wall time on Tiny Shakespeare, sparklm vs nanoGPT's CPU recipe.

    git clone https://github.com/karpathy/nanoGPT .bench/nanoGPT   # optional: the real train.py
    .venv/bin/python benchmarks/time_to_quality.py

Split as nanoGPT splits it: the first 90% of characters train, the last 10% validate.
  * nanoGPT: its documented CPU recipe (char-level, 4 layers × 4 heads × 128, block 64, batch 12,
    2000 iterations, lr 1e-3 → 1e-4, warmup 100, beta2 0.99, dropout 0, fp32, evaluation every 250
    iterations on 20 batches). With a local copy of the repository (``--nanogpt DIR``, default
    .bench/nanoGPT) its own ``data/shakespeare_char/prepare.py`` and ``train.py`` run in a fresh
    process (the text is put where prepare.py looks first, so nothing is downloaded); otherwise the
    re-implementation in benchmarks/nanogpt_ref.py runs. The table names which one ran. Its final
    validation loss is nats per character = per byte (the text is ASCII); its wall time is the
    whole train.py process.
  * sparklm: `sparklm prepare` (the train part, `--validation-input` the val part, `doc_mode=file` so
    every byte of the text counts) then `sparklm train --time-budget S` through Spark local mode; the
    reported bits/byte is model/'s over the whole validation split. Its wall time is the whole
    `sparklm train` command. The budgets are chosen so that the command's wall time matches
    nanoGPT's and a third of it (the fixed cost is measured by a short probe run first), for the
    defaults as they run here and as they run where bf16 is not fast (fp32 and AdamW: what `auto`
    picks on such a machine).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
SHARED = ROOT.parent / "shared" / "data"
# What sparklm runs with the defaults on this machine, and what it runs where bf16 is not fast (there
# `auto` picks fp32 autocast and AdamW: torch's Muon orthogonalises in bf16)
MACHINES = {"auto": [], "fp32-only": ["--set", 'train.dtype="float32"', "--set", 'train.optimizer="adamw"']}

from nanogpt_ref import GPT, GPTConfig, train_steps  # noqa: E402


def nanogpt_recipe(text: str) -> dict:
    chars = sorted(set(text))
    stoi = {c: i for i, c in enumerate(chars)}
    data = np.array([stoi[c] for c in text], dtype=np.int64)
    n = int(0.9 * len(data))
    splits = {"train": data[:n], "val": data[n:]}
    block, batch, iters, eval_interval, eval_iters = 64, 12, 2000, 250, 20
    torch.manual_seed(1337)
    rng = np.random.default_rng(1337)

    def get_batch(split="train"):
        d = splits[split]
        ix = rng.integers(0, len(d) - block, batch)
        x = torch.from_numpy(np.stack([d[i:i + block] for i in ix]))
        y = torch.from_numpy(np.stack([d[i + 1:i + 1 + block] for i in ix]))
        return x, y

    model = GPT(GPTConfig(block_size=block, vocab_size=len(chars), n_layer=4, n_head=4, n_embd=128, bias=False))
    history = []

    @torch.no_grad()
    def estimate(it):
        model.eval()
        losses = [model(*get_batch("val"))[1].item() for _ in range(eval_iters)]
        model.train()
        history.append({"iter": it, "seconds": time.time() - t0, "val_loss": float(np.mean(losses))})

    def on_step(it, loss):
        if (it + 1) % eval_interval == 0:
            estimate(it + 1)

    t0 = time.time()
    estimate(0)
    train_steps(model, get_batch, steps=iters, lr=1e-3, betas=(0.9, 0.99), min_lr=1e-4, warmup=100,
                decay_iters=iters, on_step=on_step)
    seconds = time.time() - t0
    final = history[-1]["val_loss"]
    return {"system": "nanoGPT re-implementation (benchmarks/nanogpt_ref.py)", "seconds": seconds,
            "val_loss_nats_per_char": final, "val_bpb": final / math.log(2), "history": history}


def nanogpt_real(text: str, repo: Path, work: Path) -> dict:
    """karpathy/nanoGPT's own prepare.py and train.py, the README's CPU command, in a fresh process."""
    copy = work / "nanoGPT-run"
    shutil.rmtree(copy, ignore_errors=True)
    shutil.copytree(repo, copy, ignore=shutil.ignore_patterns(".git", "out-*"))
    data = copy / "data" / "shakespeare_char"
    (data / "input.txt").write_text(text)
    subprocess.run([sys.executable, "prepare.py"], cwd=data, check=True, capture_output=True)
    args = [sys.executable, "train.py", "config/train_shakespeare_char.py", "--device=cpu", "--compile=False",
            "--eval_iters=20", "--log_interval=1", "--block_size=64", "--batch_size=12", "--n_layer=4", "--n_head=4",
            "--n_embd=128", "--max_iters=2000", "--lr_decay_iters=2000", "--dropout=0.0", "--dtype=float32"]
    t0 = time.time()
    r = subprocess.run(args, cwd=copy, capture_output=True, text=True)
    seconds = time.time() - t0
    if r.returncode:
        raise SystemExit(f"nanoGPT train.py failed: {r.stderr[-2000:]}")
    history = [{"iter": int(m[1]), "val_loss": float(m[2])}
               for m in re.finditer(r"step (\d+): train loss [\d.]+, val loss ([\d.]+)", r.stdout)]
    final = history[-1]["val_loss"]
    return {"system": "nanoGPT train.py (karpathy/nanoGPT)", "seconds": seconds, "val_loss_nats_per_char": final,
            "val_bpb": final / math.log(2), "history": history}


def sparklm_runs(text: str, budgets: list[float], work: Path, extra: list[str]) -> list[dict]:
    n = int(0.9 * len(text))
    (work / "tts").mkdir(parents=True, exist_ok=True)
    (work / "tts" / "train.txt").write_text(text[:n])
    (work / "tts" / "val.txt").write_text(text[n:])
    data = work / "tts" / "prepared"
    subprocess.run([sys.executable, "-m", "sparklm", "prepare", str(work / "tts" / "train.txt"), "--validation-input",
                    str(work / "tts" / "val.txt"), "-o", str(data), "--overwrite", "--doc-mode", "file",
                    "--master", "local[2]", "--set", "spark.ui=false", *extra], check=True, capture_output=True)
    out = []
    for budget in budgets:
        run = work / "tts" / f"run-{int(budget)}s"
        subprocess.run(["rm", "-rf", str(run)], check=True)
        t0 = time.time()
        r = subprocess.run([sys.executable, "-m", "sparklm", "train", "--data", str(data), "-o", str(run),
                            "--time-budget", str(budget), "--master", "local[2]", "--set", "spark.ui=false",
                            "--set", "train.eval_batches=0", "--set", "train.samples=2", *extra],
                           capture_output=True, text=True)
        if r.returncode:
            raise SystemExit(r.stderr[-3000:])
        wall = time.time() - t0
        s = json.loads((run / "summary.json").read_text())
        kept = s.get("best") or s["final"]  # model/: the best evaluation
        out.append({"budget_s": budget, "wall_s": wall, "train_s": s["train_seconds"],
                    "val_bpb": kept["val_bpb"], "val_loss": kept["val_loss"], "steps": s["steps"],
                    "optimizer": json.loads((run / "run_info.json").read_text()).get("optimizer"),
                    "tokens_per_s": s["tokens_per_s"], "mfu": s["mfu"], "params": s["params"], "dtype": s["dtype"]})
        print(f"sparklm budget {budget:.0f}s: {out[-1]['val_bpb']:.3f} bits/byte "
              f"(wall {out[-1]['wall_s']:.0f}s, {s['steps']} steps)", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budgets", type=float, nargs="*", default=[], help="extra sparklm training budgets (s)")
    ap.add_argument("--nanogpt", default=str(ROOT / ".bench" / "nanoGPT"),
                    help="a local copy of karpathy/nanoGPT (else the re-implementation runs)")
    ap.add_argument("--machines", nargs="+", default=["auto", "fp32-only"], choices=sorted(MACHINES))
    ap.add_argument("--work", default=str(ROOT / ".bench"))
    ap.add_argument("--set", dest="sets", action="append", default=[], help="extra sparklm --set overrides")
    args = ap.parse_args()
    text = (SHARED / "tinyshakespeare.txt").read_text()
    work = Path(args.work)
    extra = [a for s in args.sets for a in ("--set", s)]
    repo = Path(args.nanogpt)
    ng = nanogpt_real(text, repo, work) if (repo / "train.py").is_file() else nanogpt_recipe(text)
    print(f"{ng['system']}: {ng['val_bpb']:.3f} bits/byte ({ng['val_loss_nats_per_char']:.3f} nats/char) "
          f"in {ng['seconds']:.0f}s", flush=True)
    result = {"nanogpt": ng, "sparklm": []}
    for machine in args.machines:
        flags = [*extra, *MACHINES[machine]]
        probe = sparklm_runs(text, [5], work, flags)[0]
        fixed = probe["wall_s"] - probe["train_s"]  # Spark and rank start, final evaluation, export, samples
        budgets = sorted({max(2.0, round(ng["seconds"] / 3 - fixed)), max(2.0, round(ng["seconds"] - fixed)),
                          *args.budgets})
        result["sparklm"] += [{**r, "machine": machine, "fixed_s": fixed}
                              for r in sparklm_runs(text, budgets, work, flags)]
    (work / "time_to_quality.json").write_text(json.dumps(result, indent=2))
    print("\n| system | settings | training budget | wall time | val bits/byte |\n|---|---|---|---|---|")
    print(f"| {ng['system']} (char, 4L/128, 2000 iterations) | float32, AdamW | 2000 iterations | "
          f"{ng['seconds']:.0f} s | {ng['val_bpb']:.3f} |")
    for r in result["sparklm"]:
        print(f"| sparklm (BPE, {r['params'] / 1e6:.1f}M params) | {r['machine']}: {r['dtype']}, {r['optimizer']} | "
              f"{r['budget_s']:.0f} s | {r['wall_s']:.0f} s | {r['val_bpb']:.3f} |")


if __name__ == "__main__":
    main()
