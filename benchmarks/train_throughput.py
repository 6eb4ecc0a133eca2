"""Benchmark: sparklm's training step against a minimal plain-PyTorch nanoGPT-style loop, side by side.

    .venv/bin/python benchmarks/train_throughput.py

Same machine, same 2 threads, same batch (16 × 256 tokens), same vocabulary (a 4096 BPE trained
on Tiny Shakespeare from ../shared/data). For a 4-layer/128-wide and a ~10M-parameter model:
  * plain: benchmarks/nanogpt_ref.py's GPT and loop (random batches from the same tokens);
  * sparklm (loop): sparklm.train.loop.train in this process (HF model, Parquet stream, AdamW, clipping,
    metrics) — GPT-2 architecture (the same math as the plain GPT) and the default Llama;
  * sparklm (Spark): the same through `sparklm train` on Spark local mode, 1 worker × 2 threads,
    with the time from command start to the first step.
MFU is against the measured matmul peak (torch, 2 threads) of the dtype used.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
SHARED = ROOT.parent / "shared" / "data"

from nanogpt_ref import GPT, GPTConfig, train_steps  # noqa: E402

from sparklm.config import from_dict  # noqa: E402
from sparklm.train.metrics import matmul_peak, read_metrics  # noqa: E402

SIZES = {"4L/128": {"n_layer": 4, "n_head": 4, "n_embd": 128}, "~10M 8L/320": {"n_layer": 8, "n_head": 8, "n_embd": 320}}
BATCH, SEQ, THREADS = 16, 256, 2


def prepared(work: Path) -> Path:
    out = work / "shakespeare-4096"
    if not (out / "manifest.json").exists():
        subprocess.run([sys.executable, "-m", "sparklm", "prepare", str(SHARED / "tinyshakespeare.txt"), "-o", str(out),
                        "--overwrite", "--vocab-size", "4096", "--seq-len", str(SEQ), "--master", "local[2]",
                        "--set", "spark.ui=false"], check=True, capture_output=True)
    return out


def tokens_of(data: Path) -> np.ndarray:
    import pyarrow.parquet as pq

    t = pq.read_table(data / "train")
    return np.asarray(t.column("input_ids").combine_chunks().flatten(), dtype=np.int64)


def plain(size: dict, tokens: np.ndarray, dtype: torch.dtype, steps: int) -> dict:
    torch.set_num_threads(THREADS)
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=SEQ, vocab_size=4096, **size))
    rng = np.random.default_rng(0)

    def batch():
        ix = rng.integers(0, len(tokens) - SEQ - 1, BATCH)
        x = torch.from_numpy(np.stack([tokens[i:i + SEQ] for i in ix]))
        y = torch.from_numpy(np.stack([tokens[i + 1:i + 1 + SEQ] for i in ix]))
        return x, y

    times = train_steps(model, batch, steps=steps, lr=1e-3, dtype=dtype)
    dt = float(np.median(times[steps // 4:]))
    tps = BATCH * SEQ / dt
    return {"tokens_per_s": tps, "ms_per_step": dt * 1000, "flops_per_token": model.flops_per_token(),
            "params": sum(p.numel() for p in model.parameters())}


def settings(size: dict, arch: str, dtype: str, steps: int, compile: bool = False) -> dict:
    return {"model": {"arch": arch, **size},
            "train": {"batch_size": BATCH, "max_steps": steps, "eval_every": 0, "eval_batches": 1, "log_every": 5,
                      "checkpoint_every": 0, "dtype": dtype, "threads": THREADS, "samples": 0, "warmup_steps": 5,
                      "compile": compile}}


def sparklm_loop(size: dict, arch: str, dtype: str, steps: int, data: Path, compile: bool = False) -> dict:
    from sparklm.data.manifest import load_prepared
    from sparklm.train.loop import Rank, train
    from sparklm.train.run import dataset_tokenizer

    ds = load_prepared(str(data))
    with tempfile.TemporaryDirectory() as run:
        t0 = time.time()
        train(from_dict(settings(size, arch, dtype, steps, compile)), ds, dataset_tokenizer(ds), Path(run),
              rank=Rank(threads=THREADS))
        rows = read_metrics(Path(run) / "metrics.csv")
        first = next(r for r in rows if r["kind"] == "train")
        return {**_steady(rows), "first_step_s": first["elapsed"], "wall_s": time.time() - t0}


def sparklm_spark(size: dict, arch: str, dtype: str, steps: int, data: Path) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "run"
        args = [sys.executable, "-m", "sparklm", "train", "--data", str(data), "-o", str(run), "--workers", "1",
                "--master", "local[2]", "--set", "spark.ui=false"]
        for section, values in settings(size, arch, dtype, steps).items():
            args += [a for k, v in values.items() for a in ("--set", f"{section}.{k}={json.dumps(v)}")]
        t0 = time.time()
        proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        first = None
        while proc.poll() is None:
            if first is None and (run / "metrics.csv").exists() and len(read_metrics(run / "metrics.csv")) > 0:
                first = time.time() - t0
            time.sleep(0.05)
        if proc.returncode:
            raise SystemExit(proc.stderr.read()[-3000:])
        return {**_steady(read_metrics(run / "metrics.csv")), "seconds_to_first_step": first}


def _steady(rows: list[dict]) -> dict:
    train = [r for r in rows if r["kind"] == "train"][2:]  # skip the first logged steps (warm-up)
    return {"tokens_per_s": float(np.median([r["tokens_per_s"] for r in train])),
            "ms_per_step": float(np.median([r["ms_per_step"] for r in train])),
            "peak_rss_mb": max(r["rss_mb"] for r in train)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--work", default=str(ROOT / ".bench"))
    args = ap.parse_args()
    work = Path(args.work)
    work.mkdir(exist_ok=True)
    data = prepared(work)
    tokens = tokens_of(data)
    peaks = {d: matmul_peak(THREADS, getattr(torch, d)) for d in ("float32", "bfloat16")}
    print(f"matmul peak on {THREADS} threads: fp32 {peaks['float32'] / 1e9:.0f} GFLOP/s, "
          f"bf16 {peaks['bfloat16'] / 1e9:.0f} GFLOP/s", flush=True)
    rows = []
    for name, size in SIZES.items():
        # bf16 autocast measured slower than fp32 on this CPU (see the peaks): shown on the small model only
        for dtype in ("float32", "bfloat16") if name == "4L/128" else ("float32",):
            p = plain(size, tokens, getattr(torch, dtype), args.steps)
            fpt = p["flops_per_token"]
            g = sparklm_loop(size, "gpt2", dtype, args.steps, data)
            lla = sparklm_loop(size, "llama", dtype, args.steps, data)
            rows.append((name, dtype, p, g, lla, fpt))
            print(f"{name} {dtype}: plain {p['tokens_per_s']:,.0f} tok/s | sparklm gpt2 {g['tokens_per_s']:,.0f} "
                  f"({g['tokens_per_s'] / p['tokens_per_s']:.2f}x) | sparklm llama {lla['tokens_per_s']:,.0f}", flush=True)
    size = SIZES["~10M 8L/320"]
    dtype = "float32"
    loop = sparklm_loop(size, "llama", dtype, args.steps, data)
    compiled = sparklm_loop(size, "llama", dtype, args.steps, data, compile=True)
    print(f"torch.compile (~10M llama): {compiled['tokens_per_s']:,.0f} tok/s vs {loop['tokens_per_s']:,.0f} "
          f"({compiled['tokens_per_s'] / loop['tokens_per_s']:.2f}x); first step after {compiled['first_step_s']:.0f}s "
          f"vs {loop['first_step_s']:.0f}s", flush=True)
    spark = sparklm_spark(size, "llama", dtype, args.steps, data)
    print("\n| model | dtype | plain tok/s (ms/step, MFU) | sparklm gpt2 tok/s (ratio, MFU) | sparklm llama tok/s (MFU) "
          "| peak RSS MB |")
    print("|---|---|---|---|---|---|")
    for name, dt, p, g, lla, fpt in rows:
        peak = peaks[dt]
        print(f"| {name} ({p['params'] / 1e6:.1f}M) | {dt} | {p['tokens_per_s']:,.0f} ({p['ms_per_step']:.0f} ms, "
              f"{p['tokens_per_s'] * fpt / peak:.0%}) | {g['tokens_per_s']:,.0f} ({g['tokens_per_s'] / p['tokens_per_s']:.2f}×, "
              f"{g['tokens_per_s'] * fpt / peak:.0%}) | {lla['tokens_per_s']:,.0f} | {g['peak_rss_mb']:.0f} |")
    print(f"\ntorch.compile (~10M llama, fp32): {compiled['tokens_per_s']:,.0f} tok/s "
          f"({compiled['tokens_per_s'] / loop['tokens_per_s']:.2f}x of eager), first step after "
          f"{compiled['first_step_s']:.0f}s (eager {loop['first_step_s']:.0f}s)")
    print(f"\nSpark overhead (~10M llama, fp32, 1 worker × 2 threads): loop {loop['tokens_per_s']:,.0f} tok/s, "
          f"through Spark {spark['tokens_per_s']:,.0f} tok/s ({spark['tokens_per_s'] / loop['tokens_per_s'] - 1:+.1%}), "
          f"{spark['seconds_to_first_step']:.1f} s from command start to the first step")
    os.makedirs(work, exist_ok=True)
    (work / "train_throughput.json").write_text(json.dumps({"peaks": peaks, "loop": loop, "spark": spark,
                                                            "compiled": compiled,
                                                            "rows": [r[:5] for r in rows]}, indent=2, default=str))


if __name__ == "__main__":
    main()
