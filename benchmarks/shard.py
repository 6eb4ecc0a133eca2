"""Benchmark: sharded (FSDP2) against replicated DDP, and LoRA on a 4-bit base, on models of real families' shapes.

    .venv/bin/python benchmarks/shard.py [--only memory,speed,resume,nf4] [--repeats 3]

Models: random weights in SmolLM2's configurations (135M, 360M, 1.7B: Llama blocks, tied embeddings, vocabulary
49152), saved once under .bench/shard/ (memory and speed need no trained weights); data: Tiny Shakespeare (BPE 4096,
sequences of 256, benchmarks/train_throughput.prepared). Every run is `sparklm train` in a fresh process in local
mode (`--master local[N]`), its figures read from the run's summary.json and config.json:

- memory: each rank's peak resident memory, a full fine-tune (AdamW, float32, micro-batch 1, 3 steps), replicated
  and sharded on 2 ranks of the 360M shape, sharded on 4 (where the plan refuses a replica: its one line is
  printed), the 135M shape sharded on 2; beside the memory plan's estimate (config.json) for each;
- speed: tokens/s of the 135M shape on 2 ranks, replicated and sharded, interleaved, median of ``--repeats``;
- resume: the 135M shape sharded on 4 ranks, checkpointed, resumed on 2 ranks, then on 1 (the global batch kept);
- nf4: LoRA (r 16, all linear layers) of the 1.7B shape on 1 rank, its base in NF4 against bfloat16: peak memory
  and tokens/s, median of ``--repeats``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
WORK = ROOT / ".bench" / "shard"
SHAPES = {  # SmolLM2's configurations (HuggingFaceTB/SmolLM2-*): hidden, MLP, layers, heads, key-value heads
    "135M": (576, 1536, 30, 9, 3),
    "360M": (960, 2560, 32, 15, 5),
    "1.7B": (2048, 8192, 24, 32, 32),
}


def model(shape: str) -> Path:
    """A random model of ``shape`` saved as an HF directory (no tokenizer: the data's is used), made once."""
    out = WORK / f"smollm2-{shape}"
    if (out / "config.json").is_file():
        return out
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden, mlp, layers, heads, kv = SHAPES[shape]
    config = LlamaConfig(vocab_size=49152, hidden_size=hidden, intermediate_size=mlp, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=2048,
                         rope_theta=100000.0, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    dtype = torch.bfloat16 if shape == "1.7B" else torch.float32  # (as SmolLM2-1.7B is published)
    with torch.device("cpu"):
        m = LlamaForCausalLM(config).to(dtype)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    m.save_pretrained(tmp, max_shard_size="2GB")
    tmp.rename(out)
    return out


def run(name: str, data: Path, *args: str, workers: int = 1, resume: bool = False) -> dict:
    """``sparklm train`` in a fresh process; its summary and plan, or its last line where it stops."""
    out = WORK / "runs" / name
    if not resume:
        shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, "-m", "sparklm", "train", "--output", str(out), "--master", f"local[{workers}]",
           "--set", "spark.ui=false", "--workers", str(workers), *args]
    cmd += ["--resume"] if resume else ["--data", str(data)]
    t0 = time.time()
    p = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    wall = time.time() - t0
    if p.returncode:
        return {"error": (p.stderr.strip().splitlines() or ["?"])[-1], "wall": wall}
    summary = json.loads((out / "summary.json").read_text())
    saved = json.loads((out / "config.json").read_text())
    return {"summary": summary, "plan": saved["plan"], "wall": wall, "dir": out}


FULL = ["--set", "train.dtype=float32", "--set", "train.batch_size=1", "--set", "train.eval_batches=1",
        "--set", "train.samples=0", "--set", "train.log_every=1", "--set", "train.optimizer=adamw",
        "--set", "train.keep_best=false", "--eval-every", "0"]


def peaks(r: dict) -> str:
    return " / ".join(f"{m / 1024:.2f}" for m in r["summary"]["rank_peak_rss_mb"])


def memory(data: Path, only: str = "") -> None:
    print("\n## memory: a full fine-tune, AdamW, float32, micro-batch 1 x 256 tokens, 3 steps\n")
    print("| model | ranks | parallel | per-rank peak GB | plan's estimate GB | estimate / measured | tokens/s |")
    print("|---|---|---|---|---|---|---|")
    cases = [("135M", 2, "shard"), ("135M", 4, "shard"), ("360M", 2, "replicate"), ("360M", 2, "shard"),
             ("360M", 4, "replicate"), ("360M", 4, "shard")]
    for shape, n, way in cases:
        if only and f"{shape}-{n}-{way}" not in only.split(","):
            continue
        r = run(f"mem-{shape}-{n}-{way}", data, "--init-from", str(model(shape)), "--parallel", way, "--max-steps",
                "3", *FULL, workers=n)
        if "error" in r:
            print(f"| {shape} | {n} | {way} | does not start: `{r['error']}` | | | |")
            continue
        mem = r["plan"]["memory"]
        top = max(r["summary"]["rank_peak_rss_mb"]) * (1 << 20)
        print(f"| {shape} | {n} | {mem['parallel']} | {peaks(r)} | {mem['estimate'] / (1 << 30):.2f} | "
              f"{mem['estimate'] / top:.2f} | {r['summary']['tokens_per_s']:,.0f} |", flush=True)


def speed(data: Path, repeats: int) -> None:
    print("\n## speed: the 135M shape on 2 ranks, micro-batch 2 x 256 tokens, 8 steps (autocast dtype: auto)\n")
    args = ["--init-from", str(model("135M")), "--max-steps", "8", "--set", "train.batch_size=2",
            "--set", "train.eval_batches=1", "--set", "train.samples=0", "--set", "train.log_every=1",
            "--set", "train.keep_best=false", "--eval-every", "0", "--set", "train.checkpoint_every=0"]
    got: dict[str, list[float]] = {"replicate": [], "shard": []}
    for i in range(repeats):
        for way in got:
            r = run(f"speed-{way}", data, *args, "--parallel", way, workers=2)
            if "error" in r:
                raise SystemExit(f"{way}: {r['error']}")
            got[way].append(r["summary"]["tokens_per_s"])
            print(f"#{i + 1} {way}: {got[way][-1]:,.0f} tok/s ({r['summary']['dtype']}), peaks {peaks(r)} GB",
                  flush=True)
    rep, sh = statistics.median(got["replicate"]), statistics.median(got["shard"])
    print("\n| parallel | median tok/s (runs) |\n|---|---|")
    for way, v in got.items():
        print(f"| {way} | {statistics.median(v):,.0f} ({' · '.join(f'{x:,.0f}' for x in v)}) |")
    print(f"\nsharded / replicated: {sh / rep:.2f}x")


def resume(data: Path) -> None:
    print("\n## resume: the 135M shape sharded on 4 ranks (global batch 4), then on 2, then on 1\n")
    base = ["--init-from", str(model("135M")), "--parallel", "shard", "--set", "train.dtype=float32",
            "--set", "train.eval_batches=1", "--set", "train.samples=0", "--set", "train.log_every=1",
            "--eval-every", "0", "--checkpoint-every", "2"]
    name = "resume-4-2-1"
    for n, batch, steps in ((4, 1, 2), (2, 2, 4), (1, 4, 6)):
        r = run(name, data, *([] if n < 4 else base), "--max-steps", str(steps), "--set", f"train.batch_size={batch}",
                *(["--workers", str(n)] if n < 4 else []), workers=n, resume=n < 4)
        if "error" in r:
            print(f"- on {n} ranks: does not run: {r['error']}")
            return
        ck = sorted(p.name for p in (r["dir"] / "checkpoints").glob("step-*"))
        print(f"- {n} rank{'s' * (n > 1)} x micro-batch {batch}: to step {r['summary']['steps']}, loss "
              f"{r['summary']['final'].get('val_loss', float('nan')):.4f} (validation), checkpoints {ck}, "
              f"{r['wall']:.0f} s", flush=True)


def nf4(data: Path, repeats: int) -> None:
    print("\n## nf4: LoRA r 16 (all linear layers) of the 1.7B shape, 1 rank, micro-batch 1 x 256 tokens, 4 steps\n")
    args = ["--init-from", str(model("1.7B")), "--lora-r", "16", "--max-steps", "4", "--set", "train.dtype=bfloat16",
            "--set", "train.eval_batches=1", "--set", "train.samples=0", "--set", "train.log_every=1",
            "--set", "train.batch_size=1", "--eval-every", "0", "--set", "train.checkpoint_every=0"]
    got: dict[str, list[dict]] = {"bfloat16": [], "nf4": []}
    for i in range(repeats):
        for base in got:
            r = run(f"nf4-{base}", data, *args, "--lora-base-dtype", base)
            if "error" in r:
                raise SystemExit(f"{base}: {r['error']}")
            got[base].append(r)
            print(f"#{i + 1} {base} base: {r['summary']['tokens_per_s']:,.0f} tok/s, peak {peaks(r)} GB, estimate "
                  f"{r['plan']['memory']['estimate'] / (1 << 30):.2f} GB", flush=True)
    print("\n| base | median tok/s | median peak GB | plan's estimate GB |\n|---|---|---|---|")
    for base, rs in got.items():
        print(f"| {base} | {statistics.median(r['summary']['tokens_per_s'] for r in rs):,.0f} | "
              f"{statistics.median(r['summary']['peak_rss_mb'] for r in rs) / 1024:.2f} | "
              f"{rs[0]['plan']['memory']['estimate'] / (1 << 30):.2f} |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="memory,speed,resume,nf4")
    ap.add_argument("--cases", default="", help="memory: only these cases, e.g. 135M-4-shard")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    import train_throughput

    WORK.mkdir(parents=True, exist_ok=True)
    data = train_throughput.prepared(ROOT / ".bench")
    for part in args.only.split(","):
        {"memory": lambda: memory(data, args.cases), "speed": lambda: speed(data, args.repeats),
         "resume": lambda: resume(data), "nf4": lambda: nf4(data, args.repeats)}[part]()


if __name__ == "__main__":
    main()
