"""Benchmark: the LM-head loss of one micro-batch (forward and backward), chunked (sparklm's model/lm_head.py)
against the unchunked loss (what HF models compute: logits for every position, then cross-entropy against the
labels shifted by one) and torch's own chunked
``F.linear_cross_entropy``, at SmolLM2-135M's head (576 → 49,152) on 8 × 256 positions, 2 threads.

    .venv/bin/python benchmarks/lm_head_loss.py [--repeats 3] [--frozen-head]

Each contender runs in a fresh process (peak RSS is the process's), interleaved, median of --repeats; a
measurement is the best of 3 timed passes after one warm-up, with the head's weight trainable (full
fine-tuning) or, with --frozen-head, frozen (LoRA: only the hidden states' gradient), in float32 and under bf16
autocast.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

CONTENDERS = ["unchunked", "sparklm chunked", "torch linear_cross_entropy"]


def measure(name: str, bf16: bool, frozen: bool = False) -> dict:
    import resource
    import time

    import torch
    import torch.nn.functional as F

    from sparklm.model import lm_head

    torch.set_num_threads(2)
    torch.manual_seed(0)
    B, T, d, V = 8, 257, 576, 49152
    hidden = torch.randn(B, T, d, requires_grad=True)
    head = torch.nn.Linear(d, V, bias=False).requires_grad_(not frozen)
    labels = torch.randint(0, V, (B, T))

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            if name == "unchunked":
                # as HF's causal-LM loss: the labels shifted (no copy of the logits), the logits in float32
                logits = head(hidden).float()
                shifted = F.pad(labels[:, 1:], (0, 1), value=-100)
                loss = F.cross_entropy(logits.reshape(-1, V), shifted.reshape(-1), ignore_index=-100, reduction="sum")
            elif name == "sparklm chunked":
                loss = lm_head.nll_sum(hidden, head, labels, 0)
            else:
                x = hidden[:, :-1].reshape(-1, d)
                opts = torch.nn.LinearCrossEntropyOptions()  # its default chunking and precision policy
                loss = F.linear_cross_entropy(x.to(torch.bfloat16) if bf16 else x,
                                              head.weight.to(torch.bfloat16) if bf16 else head.weight,
                                              labels[:, 1:].reshape(-1), reduction="sum", options=opts)
        loss.backward()
        hidden.grad = head.weight.grad = None
        return float(loss)

    step()
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        value = step()
        times.append(time.perf_counter() - t0)
    return {"ms": 1000 * min(times), "loss": value,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--frozen-head", action="store_true")
    ap.add_argument("--one", nargs=2, help=argparse.SUPPRESS)  # a single measurement, in this process
    args = ap.parse_args()
    if args.one:
        print("RESULT " + json.dumps(measure(args.one[0], args.one[1] == "bf16", args.frozen_head)))
        return
    table = {}
    for dtype in ("fp32", "bf16"):
        runs: dict[str, list[dict]] = {n: [] for n in CONTENDERS}
        for _ in range(args.repeats):
            for name in CONTENDERS:
                frozen = ["--frozen-head"] if args.frozen_head else []
                out = subprocess.run([sys.executable, __file__, "--one", name, dtype, *frozen], check=True,
                                     text=True, capture_output=True).stdout
                runs[name].append(json.loads(next(x for x in out.splitlines() if x.startswith("RESULT "))[7:]))
        for name, rs in runs.items():
            row = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
            table[f"{name}, {dtype}"] = row
            print(f"{name + ', ' + dtype:36s} {row['ms']:7.0f} ms {row['peak_rss_mb']:6.0f} MB peak RSS "
                  f"loss {row['loss']:.2f}", flush=True)
    print(json.dumps(table, indent=2))


if __name__ == "__main__":
    main()
