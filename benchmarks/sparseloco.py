"""Benchmark: sparse DiLoCo as SparseLoCo does it, against dense DiLoCo at the same H and DDP, over enough rounds
for error feedback to settle (issue 57).

    .venv/bin/python benchmarks/sparseloco.py --corpus tinyshakespeare --bits 3
    .venv/bin/python benchmarks/sparseloco.py --corpus wikitext2 --bits 3
    .venv/bin/python benchmarks/sparseloco.py --corpus mixed --eval-every 128   # read ~1.6 times: no overfitting
    .venv/bin/python benchmarks/sparseloco.py --corpus tinyshakespeare --table-only

Every contender is one `sparklm train` (a fresh process, Spark local[2], 2 workers × 1 thread) of a ~1M-parameter
Llama (2 layers, width 128, BPE 4096 as strategies.py prepares it) for the same steps and tokens. Contenders:
DDP with two seeds (its own noise), dense DiLoCo at the same H (int4 both ways, outer momentum 0.5: the default
codec), and sparse DiLoCo as SparseLoCo: Top-k per 64×64 tile (--density), a sign and a magnitude bin of a codebook
per tensor (--bits), error feedback β, outer SGD lr 1 without momentum, the workers' payloads all-gathered (every
side takes the same step) and each value averaged over the workers that sent it — at β 0.95 and 0.8 (1.0 and 0.9,
and second seeds of dense and sparse, with --only), and once with the old divisor (all workers). Reported: final validation bits/byte, bytes each way as Spark shipped them to
the workers and they sent back, and the ratio to DDP's fp32 ring all-reduce. Results accumulate in
WORK/sparseloco-CORPUS.json (--only NAME... runs a subset).
"""

from __future__ import annotations

import argparse
import csv
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from strategies import ROOT, prepared  # noqa: E402 - the same prepared corpora as the strategies benchmark

MODEL = ["--set", "model.n_layer=2", "--set", "model.n_embd=128", "--set", "model.n_head=4",
         "--set", "train.batch_size=2"]


def sparse(h: int, density: float, beta: float, bits: int = 2, over: str = "senders", lr: float = 1.0) -> list[str]:
    return ["--strategy", "diloco", "--sync-every", str(h), "--codec", "topk",
            "--set", f"train.rounds.density={density}", "--set", f"train.rounds.bits={bits}",
            "--set", "train.rounds.outer_momentum=0.0", "--set", f"train.rounds.outer_lr={lr}",
            "--set", f"train.rounds.residual_decay={beta}", "--set", 'train.rounds.downlink="forward"',
            "--set", f'train.rounds.average_over="{over}"']


def contenders(h: int, density: float, bits: int, lr: float = 1.0) -> dict[str, list[str]]:
    tag = f"sparse-H{h}-1/{1 / density:.0f}-{bits}bit" + (f"-lr{lr:g}" if lr != 1.0 else "")
    return {
        "ddp": [],
        "ddp-seed1": ["--set", "train.seed=1"],
        f"dense-int4-H{h}": ["--strategy", "diloco", "--sync-every", str(h)],
        f"{tag}-b0.95": sparse(h, density, 0.95, bits, lr=lr),
        f"{tag}-b1.0": sparse(h, density, 1.0, bits, lr=lr),
        f"{tag}-b0.8": sparse(h, density, 0.8, bits, lr=lr),
        f"{tag}-b0.95-old-divisor": sparse(h, density, 0.95, bits, "all", lr),
        # a second seed of the two that the target compares (not run by default: --only)
        f"dense-int4-H{h}-seed1": ["--strategy", "diloco", "--sync-every", str(h), "--set", "train.seed=1"],
        f"{tag}-b0.95-seed1": [*sparse(h, density, 0.95, bits, lr=lr), "--set", "train.seed=1"],
        f"{tag}-b0.95-old-divisor-seed1": [*sparse(h, density, 0.95, bits, "all", lr), "--set", "train.seed=1"],
        f"{tag}-b0.9": sparse(h, density, 0.9, bits, lr=lr),  # between the two (not run by default: --only)
    }


def extra(name: str) -> bool:
    """Contenders run only when named (--only): DiLoCo's second seeds and the β between and beyond the two the issue
    compares. The default set is DDP ×2, dense DiLoCo, sparse at β 0.95 and 0.8, and sparse with the old divisor."""
    return (name.endswith("-seed1") and not name.startswith("ddp")) or name.endswith(("-b1.0", "-b0.9"))


def run(name: str, flags: list[str], data: Path, home: Path, steps: int, inner: list[str] = (),
        eval_every: int = 0) -> dict:
    """One contender, its run directory under ``home``; ``inner``: the --set flags of --dtype/--optimizer."""
    out = home / name.replace("/", "_")
    subprocess.run(["rm", "-rf", str(out)], check=True)
    t0 = time.time()
    r = subprocess.run([sys.executable, "-m", "sparklm", "train", "--data", str(data), "-o", str(out),
                        "--workers", "2", "--max-steps", str(steps), "--master", "local[2]", "--threads", "1",
                        "--set", "spark.ui=false", "--set", f"train.eval_every={eval_every}", "--set", "train.samples=0",
                        "--set", "train.checkpoint_every=0", *MODEL, *inner, *flags], capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"{name} failed:\n{r.stderr[-3000:]}")
    s = json.loads((out / "summary.json").read_text())
    res = {"name": name, "wall_s": time.time() - t0, "val_bpb": s["final"]["val_bpb"], "steps": s["steps"],
           "params": s["params"], "trainable": s.get("trainable_params") or s["params"],
           "bytes": s["bytes_communicated"], "out_bytes": s.get("bytes_broadcast"),
           "back_bytes": s.get("bytes_returned"), "rounds": s.get("rounds")}
    info = json.loads((out / "run_info.json").read_text())  # what "auto" picked on this machine
    res["inner"] = f"{info['optimizer']}, {info['dtype']}"
    if eval_every:  # the validation curve: the best point of a run that overfits its corpus is not its end
        with open(out / "metrics.csv") as f:
            curve = [(int(r["step"]), float(r["val_bpb"])) for r in csv.DictReader(f) if r["kind"] == "eval"]
        res["curve"] = curve
        res["best_step"], res["best_bpb"] = min(curve, key=lambda c: c[1])
    print(f"{name}: {res['val_bpb']:.4f} bits/byte, {res['bytes'] / 1e6:,.2f} MB, wall {res['wall_s']:.0f} s",
          flush=True)
    return res


def table(results: dict) -> str:
    """Each contender against DDP (seed 0) and the dense DiLoCo of the same H."""
    ddp = results.get("ddp")
    lines = ["| contender | inner optimizer, dtype | val bits/byte | vs DDP | vs dense DiLoCo | bytes out | bytes back | "
             "less than DDP | bits/param/step | rounds | wall |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        seed = "-seed1" if name.endswith("-seed1") else ""  # a second seed against dense DiLoCo's of the same seed
        dense = next((d for n, d in results.items() if n.startswith("dense") and n.endswith("-seed1") == bool(seed)),
                     None)
        vs = f"{r['val_bpb'] / ddp['val_bpb'] - 1:+.2%}" if ddp else ""
        vd = f"{r['val_bpb'] / dense['val_bpb'] - 1:+.2%}" if dense and r is not dense and "ddp" not in name else ""
        less = f"{ddp['bytes'] / r['bytes']:,.0f}×" if ddp and r["bytes"] and r is not ddp else "1×"
        each = (f"{r['out_bytes'] / 1e6:,.2f} MB | {r['back_bytes'] / 1e6:,.2f} MB" if r.get("out_bytes") is not None
                else "— | —")
        bits = 8 * r["bytes"] / (r["trainable"] * r["steps"] * 2)
        best = f" (best {r['best_bpb']:.4f} at step {r['best_step']})" if "best_bpb" in r else ""
        lines.append(f"| {name} | {r.get('inner', '')} | {r['val_bpb']:.4f}{best} | {vs} | {vd} | {each} | {less} | {bits:.4f} | "
                     f"{r['rounds'] or ''} | {r['wall_s']:.0f} s |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=2048)
    ap.add_argument("--sync-every", type=int, default=16)
    ap.add_argument("--density", type=float, default=1 / 64, help="share of each 64×64 tile sent")
    ap.add_argument("--bits", type=int, default=3, help="bits per value sent: its sign and a magnitude bin")
    ap.add_argument("--outer-lr", type=float, default=1.0, help="the sparse contenders' outer SGD step (SparseLoCo: 1)")
    ap.add_argument("--dtype", default="auto", help="train.dtype of every contender (auto: what the machine picks: "
                    "bfloat16 where the CPU is fast at it)")
    ap.add_argument("--optimizer", default="auto", help="train.optimizer, the inner one for DiLoCo (auto: Muon with "
                    "bfloat16, else AdamW)")
    ap.add_argument("--eval-every", type=int, default=0, help="evaluate every N steps too; the table then adds "
                    "each run's best validation bits/byte and its step (results in WORK/sparseloco-CORPUS-evalN.json)")
    ap.add_argument("--corpus", choices=("tinyshakespeare", "wikitext2", "mixed", "austen"), default="tinyshakespeare",
                    help="mixed: every text in ../shared/data (1.3M training tokens, which 2,048 steps read ~1.6 "
                    "times); austen: the four novels sparklm ships (read ~2.5 times); the first two are read 6-7 "
                    "times and overfit")
    ap.add_argument("--only", nargs="*", help="these contenders only")
    ap.add_argument("--work", default=str(ROOT / ".bench"))
    ap.add_argument("--table-only", action="store_true")
    args = ap.parse_args()
    work = Path(args.work)
    pinned = {k: getattr(args, k) for k in ("dtype", "optimizer") if getattr(args, k) != "auto"}
    inner = [f for k, v in pinned.items() for f in ("--set", f"train.{k}={v}")]
    tag = "".join(f"-{v}" for v in pinned.values()) + (f"-eval{args.eval_every}" if args.eval_every else "")
    saved = work / f"sparseloco-{args.corpus}{tag}.json"  # the runs beside it, in sparseloco-CORPUS-TAG/
    results = json.loads(saved.read_text()) if saved.is_file() else {}
    if not args.table_only:
        data = prepared(work, args.corpus)
        for name, flags in contenders(args.sync_every, args.density, args.bits, args.outer_lr).items():
            if (args.only and name not in args.only) or (not args.only and extra(name)):
                continue
            results[name] = run(name, flags, data, saved.with_suffix(""), args.steps, inner, args.eval_every)
            saved.write_text(json.dumps(results, indent=2))
    print(table(results))


if __name__ == "__main__":
    main()
