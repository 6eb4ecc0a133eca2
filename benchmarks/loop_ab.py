"""Benchmark: the in-process training loop of two checkouts side by side (a refactor's before and after).

    git worktree add /tmp/before <commit>
    .venv/bin/python benchmarks/loop_ab.py --before /tmp/before [--repeats 3] [--steps 24]

Each measurement is ``benchmarks/train_throughput.py --one`` of its own checkout in a fresh process (its ``src/`` first
on ``PYTHONPATH``), the two checkouts interleaved, on the same prepared data (Tiny Shakespeare, BPE 4096, from
../shared/data) and threads; the median of the repeats is printed with every run (one run can be 10-25% off the next).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

CASES = [("sparklm-llama", "4L/128"), ("sparklm-gpt2", "~10M 8L/320")]


def one(root: Path, kind: str, size: str, steps: int, data: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(root / "src")}
    out = subprocess.run([sys.executable, str(root / "benchmarks" / "train_throughput.py"), "--one", kind, size,
                          "float32", "--steps", str(steps), "--data", str(data)], capture_output=True, text=True, env=env)
    if out.returncode:
        raise SystemExit(f"{root}: {kind} {size} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--before", required=True, help="the other checkout (a git worktree of the commit to compare)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=24)
    args = ap.parse_args()
    import train_throughput

    data = train_throughput.prepared(ROOT / ".bench")
    roots = {"before": Path(args.before).resolve(), "after": ROOT}
    runs: dict = {(v, k, s): [] for v in roots for k, s in CASES}
    for r in range(args.repeats):
        for kind, size in CASES:
            for name, root in roots.items():
                res = one(root, kind, size, args.steps, data)
                runs[(name, kind, size)].append(res)
                print(f"#{r + 1} {name} {kind} {size}: {res['tokens_per_s']:,.0f} tok/s", flush=True)
    print("\n| loop | checkout | median tok/s (runs) | ms/step | peak RSS MB |\n|---|---|---|---|---|")
    for (name, kind, size), rs in runs.items():
        tps = [x["tokens_per_s"] for x in rs]
        print(f"| {kind} {size} | {name} | {statistics.median(tps):,.0f} ({' · '.join(f'{t:,.0f}' for t in tps)}) | "
              f"{statistics.median(x['ms_per_step'] for x in rs):.0f} | "
              f"{statistics.median(x['peak_rss_mb'] for x in rs):,.0f} |")


if __name__ == "__main__":
    main()
