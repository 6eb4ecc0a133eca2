"""Benchmark: Muon's optimizer step on the main job's hidden matrices, torch's ``torch.optim.Muon`` (one matrix at a
time) against sparklm's ``train.optim.Muon`` (same-shaped matrices orthogonalized as one batch).

    .venv/bin/python benchmarks/muon_step.py [--repeats 3] [--threads 2] [--steps 20]

The matrices are the default model's (4 layers of 256: q, k, v, o 256 x 256; gate and up 704 x 256; down 256 x 704;
28 in all), built by sparklm as the main job builds them, with random gradients. Each contender runs in a fresh
process, the contenders interleaved, ``--repeats`` rounds; each process times ``--steps`` optimizer steps after two
warm-up steps (glibc keeping freed memory, as a training process does) and reports its median ms per step. The
figure is the median over the rounds.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time


def one(contender: str, threads: int, steps: int) -> tuple[float, int]:
    """Median ms of one Muon step over the default model's hidden matrices in this process, and how many there are."""
    import torch

    from sparklm.config import ModelConfig
    from sparklm.model.build import build_model
    from sparklm.tasks.causal_lm import CausalLM
    from sparklm.train import optim
    from sparklm.train.device import keep_freed_memory

    keep_freed_memory()  # as a training process does (train.allocator keep)
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = build_model(ModelConfig(), vocab_size=8192, context=256, bos_id=0, eos_id=1, pad_id=2)
    matrices = CausalLM().matrices(model)
    params = [p for p in model.parameters() if id(p) in matrices]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    cls = optim.Muon if contender == "sparklm" else torch.optim.Muon
    opt = cls(params, lr=3e-3, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    times = []
    for i in range(steps + 2):
        t = time.perf_counter()
        opt.step()
        if i >= 2:
            times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3, len(params)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--one", choices=["torch", "sparklm"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        ms, n = one(args.one, args.threads, args.steps)
        print(json.dumps({"ms": ms, "matrices": n}))
        return
    results: dict[str, list[float]] = {"torch": [], "sparklm": []}
    for r in range(args.repeats):
        for contender in results:
            out = subprocess.run([sys.executable, __file__, "--one", contender, "--threads", str(args.threads),
                                  "--steps", str(args.steps)], check=True, capture_output=True, text=True).stdout
            row = json.loads(out.strip().splitlines()[-1])
            results[contender].append(row["ms"])
            print(f"round {r + 1}: {contender} {row['ms']:.1f} ms a step ({row['matrices']} matrices)", flush=True)
    base = statistics.median(results["torch"])
    print("\n| contender | ms per step (median of rounds) | runs | vs torch |\n|---|---|---|---|")
    for contender, values in results.items():
        med = statistics.median(values)
        runs = ", ".join(f"{v:.1f}" for v in values)
        print(f"| {contender} | {med:.1f} | {runs} | {base / med:.2f}× |")


if __name__ == "__main__":
    main()
