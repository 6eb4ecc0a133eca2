"""Benchmark: generation over prompts of mixed lengths, batched as given against bucketed by length (issue 53).

    .venv/bin/python benchmarks/prompt_buckets.py [--model RUN] [--prompts 32] [--new-tokens 32] [--repeats 3]

The prompts are passages of ../shared/data/tinyshakespeare.txt cut to lengths spread from 8 tokens to the model's
context less --new-tokens, in a shuffled order (what a DataFrame of user prompts looks like). Both contenders run
`sparklm.infer.generate.generate` on the torch backend, batch 8, greedy with --new-tokens forced, 2 threads: "as
given" batches the rows in their order (generate's order before bucketing), "bucketed" is generate as it ships.
Each run is a fresh process; the contenders interleave; medians of --repeats. Reported: wall seconds of generate,
new tokens/s, the prompt tokens computed with their padding, and whether both give the same tokens.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared" / "data"


def prompts_of(lm, n: int, longest: int) -> list[str]:
    import numpy as np

    text = (SHARED / "tinyshakespeare.txt").read_text()
    rng = np.random.default_rng(0)
    words = text.split()
    prompts = []
    for length in np.linspace(8, longest, n).astype(int):
        start = int(rng.integers(0, len(words) - 4 * longest))
        ids = lm.tokenizer(" ".join(words[start:start + 4 * longest]))["input_ids"][:length]
        prompts.append(lm.tokenizer.decode(ids, skip_special_tokens=True))
    rng.shuffle(prompts)
    return prompts


def one(model: str, kind: str, n: int, new: int, batch: int) -> dict:
    import torch

    from sparklm.infer import generate as gen
    from sparklm.infer.sampling import Sampling

    torch.set_num_threads(2)
    lm = gen.load(model)
    prompts = prompts_of(lm, n, lm.context - new - 2)
    if kind == "as given":
        gen.bucketed = lambda rows, size: list(range(len(rows)))  # the order before bucketing
    lengths = [len(gen.encode(lm, p, new)[0]) for p in prompts]
    order = gen.bucketed([(0, 0, "", [0] * k, False) for k in lengths], batch)
    computed = sum(len(order[b:b + batch]) * max(lengths[i] for i in order[b:b + batch])
                   for b in range(0, len(order), batch))
    start = time.time()
    out = gen.generate(lm, prompts, sampling=Sampling(temperature=0, max_new_tokens=new, min_new_tokens=new),
                       batch_size=batch)
    wall = time.time() - start
    return {"wall_s": wall, "new_tok_s": sum(len(g.token_ids) for g in out) / wall, "prompt_tokens": sum(lengths),
            "computed_prompt_tokens": computed, "tokens": [g.token_ids for g in out]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(ROOT / ".bench" / "fixed_cost" / "run-0"))
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one(args.model, args.one, args.prompts, args.new_tokens, args.batch)))
        return
    kinds = ["as given", "bucketed"]
    runs: dict[str, list[dict]] = {k: [] for k in kinds}
    for r in range(args.repeats):
        for kind in kinds:
            p = subprocess.run([sys.executable, __file__, "--one", kind, "--model", args.model, "--prompts",
                                str(args.prompts), "--new-tokens", str(args.new_tokens), "--batch", str(args.batch)],
                               capture_output=True, text=True)
            if p.returncode:
                raise SystemExit(f"{kind} failed:\n{p.stderr[-3000:]}")
            runs[kind].append(json.loads(p.stdout.strip().splitlines()[-1]))
            print(f"{kind} #{r + 1}: {runs[kind][-1]['wall_s']:.2f} s", flush=True)
    same = runs["as given"][0]["tokens"] == runs["bucketed"][0]["tokens"]
    print(f"\n{args.prompts} prompts, {args.new_tokens} greedy tokens each, batch {args.batch}, torch, 2 threads, "
          f"median of {args.repeats}; the same tokens: {'yes' if same else 'NO'}")
    print("| order | wall | new tokens/s | prompt tokens computed (with padding) / in the prompts |")
    print("|---|---|---|---|")
    for kind, rs in runs.items():
        print(f"| {kind} | {statistics.median(r['wall_s'] for r in rs):.2f} s | "
              f"{statistics.median(r['new_tok_s'] for r in rs):.1f} | "
              f"{rs[0]['computed_prompt_tokens']:,} / {rs[0]['prompt_tokens']:,} |")
    each = {k: ", ".join(f"{r['wall_s']:.2f}" for r in v) for k, v in runs.items()}
    print("runs (s): " + "; ".join(f"{k} {v}" for k, v in each.items()))


if __name__ == "__main__":
    main()
