"""Benchmark: sparklm's training step against a minimal plain-PyTorch nanoGPT-style loop, side by side.

    .venv/bin/python benchmarks/train_throughput.py [--steps 24] [--repeats 3]
    .venv/bin/python benchmarks/train_throughput.py --compile-ab "main 4L/256" "~10M 8L/320"  # torch.compile only
    .venv/bin/python benchmarks/train_throughput.py --compile-ab "main 4L/256" --dtype bfloat16 --optimizer adamw

Every measurement runs in a fresh process, the contenders interleaved (plain, sparklm, plain, ...),
and the median of the repeats is reported: on this machine one run can be 10-20% off the next.

Same machine, same 2 threads, same batch (16 × 256 tokens), same vocabulary (a 4096 BPE trained
on Tiny Shakespeare from ../shared/data). For a 4-layer/128-wide and a ~10M-parameter model:
  * plain: benchmarks/nanogpt_ref.py's GPT and loop (random batches from the same tokens);
  * plain + allocator: the same, with the glibc allocator setting sparklm's loop makes
    (sparklm.train.device.keep_freed_memory), to show how much of the difference that setting is;
  * sparklm (loop): sparklm.train.core.train in this process (HF model, Parquet stream, AdamW, clipping,
    metrics) — GPT-2 architecture (the same math as the plain GPT) and the default Llama;
  * sparklm (Spark): the same through `sparklm train` on Spark local mode, 1 worker × 2 threads,
    with the time from command start to the first step.
MFU is against the measured matmul peak (torch, 2 threads) of the dtype used.
"""

from __future__ import annotations

import argparse
import json
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
from sparklm.metrics.sinks import read_metrics  # noqa: E402
from sparklm.train.peak import matmul_peak  # noqa: E402

SIZES = {"4L/128": {"n_layer": 4, "n_head": 4, "n_embd": 128}, "~10M 8L/320": {"n_layer": 8, "n_head": 8, "n_embd": 320},
         "main 4L/256": {"n_layer": 4, "n_head": 4, "n_embd": 256}}  # the main job's fitted shape
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


def plain(size: dict, tokens: np.ndarray, dtype: torch.dtype, steps: int, compile: bool = False) -> dict:
    torch.set_num_threads(THREADS)
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=SEQ, vocab_size=4096, **size))
    flops = model.flops_per_token()
    if compile:  # nanoGPT's own default (train.py: compile = True)
        model = torch.compile(model)
    rng = np.random.default_rng(0)

    def batch():
        ix = rng.integers(0, len(tokens) - SEQ - 1, BATCH)
        x = torch.from_numpy(np.stack([tokens[i:i + SEQ] for i in ix]))
        y = torch.from_numpy(np.stack([tokens[i + 1:i + 1 + SEQ] for i in ix]))
        return x, y

    times = train_steps(model, batch, steps=steps, lr=1e-3, dtype=dtype)
    dt = float(np.median(times[steps // 4:]))
    tps = BATCH * SEQ / dt
    return {"tokens_per_s": tps, "ms_per_step": dt * 1000, "flops_per_token": flops,
            "params": sum(p.numel() for p in model.parameters()), "first_step_s": times[0]}


def settings(size: dict, arch: str, dtype: str, steps: int, compile: bool = False, optimizer: str = "adamw",
             attention: str = "auto") -> dict:
    return {"model": {"arch": arch, **size},
            "train": {"batch_size": BATCH, "max_steps": steps, "eval_every": 0, "eval_batches": 1, "log_every": 5,
                      "checkpoint_every": 0, "dtype": dtype, "threads": THREADS, "samples": 0, "warmup_steps": 5,
                      "compile": compile, "optimizer": optimizer, "attention": attention}}


def sparklm_loop(size: dict, arch: str, dtype: str, steps: int, data: Path, compile: bool = False,
                 optimizer: str = "adamw", attention: str = "auto") -> dict:
    from sparklm.data.manifest import load_prepared, load_tokenizer
    from sparklm.metrics.sinks import CsvSink, JsonSink, Sinks, metric_columns
    from sparklm.model.figures import LM_FIGURES
    from sparklm.train.core import Rank, train
    from sparklm.train.resolve import local

    ds = load_prepared(str(data))
    with tempfile.TemporaryDirectory() as run:
        t0 = time.time()
        sinks = Sinks([CsvSink(f"{run}/metrics.csv", metric_columns(LM_FIGURES), {"train", "eval"}), JsonSink(f"{run}/run_info.json")])
        config = from_dict(settings(size, arch, dtype, steps, compile, optimizer, attention))
        train(local(config, ds, THREADS), ds, load_tokenizer(ds), run, rank=Rank(threads=THREADS), sink=sinks)
        sinks.close()
        rows = read_metrics(Path(run) / "metrics.csv")
        first = next(r for r in rows if r["kind"] == "train")
        info = json.loads((Path(run) / "run_info.json").read_text())
        return {**_steady(rows), "first_step_s": first["elapsed"], "wall_s": time.time() - t0,
                "flops_per_token": info["flops_per_token"]}


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


def one(kind: str, size_name: str, dtype: str, steps: int, data: Path, optimizer: str = "adamw") -> dict:
    """One measurement, in this (fresh) process."""
    size = SIZES[size_name]
    if kind in ("plain", "plain+allocator", "plain-compile"):
        if kind == "plain+allocator":
            from sparklm.train.device import keep_freed_memory

            keep_freed_memory()
        return plain(size, tokens_of(data), getattr(torch, dtype), steps, compile=kind == "plain-compile")
    if kind == "spark":
        return sparklm_spark(size, "llama", dtype, steps, data)
    # "-sdpa": train.attention forced to torch's SDPA (else auto: matmul on a CPU in bf16, model/attention.py)
    base, sdpa = kind.removesuffix("-sdpa"), kind.endswith("-sdpa")
    arch = {"sparklm-gpt2": "gpt2", "sparklm-llama": "llama", "sparklm-llama-compile": "llama"}[base]
    return sparklm_loop(size, arch, dtype, steps, data, compile=base.endswith("compile"), optimizer=optimizer,
                        attention="sdpa" if sdpa else "auto")


def measure(kind: str, size_name: str, dtype: str, steps: int, data: Path, optimizer: str = "adamw") -> dict:
    out = subprocess.run([sys.executable, __file__, "--one", kind, size_name, dtype, "--steps", str(steps),
                          "--data", str(data), "--optimizer", optimizer], capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"{kind} {size_name} {dtype} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def median_of(runs: list[dict]) -> dict:
    return {k: float(np.median([r[k] for r in runs])) for k in runs[0] if isinstance(runs[0][k], (int, float))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--work", default=str(ROOT / ".bench"))
    ap.add_argument("--compile-ab", nargs="+", metavar="SIZE", choices=list(SIZES),
                    help="only: sparklm's Llama eager and compiled beside the plain loop (eager and compiled), at these "
                         "sizes")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "auto"],
                    help="--compile-ab: the dtype of every contender (auto: what sparklm's train.dtype auto picks here); "
                         "the plain loop also runs in float32, as a plain PyTorch loop does by default")
    ap.add_argument("--optimizer", default="adamw", choices=["adamw", "muon", "auto"],
                    help="sparklm's train.optimizer (the plain loop runs AdamW); auto: sparklm's default")
    ap.add_argument("--one", nargs=3, metavar=("KIND", "SIZE", "DTYPE"), help=argparse.SUPPRESS)
    ap.add_argument("--data", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        import resource

        result = one(*args.one, args.steps, Path(args.data), args.optimizer)
        if args.one[0] != "spark":  # this process's peak (the Spark run's rank is another process)
            result["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        print(json.dumps(result))
        return
    work = Path(args.work)
    work.mkdir(exist_ok=True)
    data = prepared(work)
    peaks = {d: matmul_peak(THREADS, d) for d in ("float32", "bfloat16")}
    print(f"matmul peak on {THREADS} threads: fp32 {peaks['float32'] / 1e9:.0f} GFLOP/s, "
          f"bf16 {peaks['bfloat16'] / 1e9:.0f} GFLOP/s", flush=True)
    if args.compile_ab:
        from sparklm.train.peak import compute_dtype

        dtype = compute_dtype(args.dtype, THREADS)
        return compile_ab(args.compile_ab, args.steps, args.repeats, data, peaks, dtype, args.optimizer, work)
    kinds = ["plain", "sparklm-gpt2", "sparklm-llama", "plain+allocator"]
    cases = [("4L/128", "float32", kinds, args.repeats), ("~10M 8L/320", "float32", kinds, args.repeats),
             # bf16 autocast measured slower than fp32 on this CPU (see the peaks): one round, small model
             ("4L/128", "bfloat16", ["plain", "sparklm-gpt2"], 1)]
    results: dict = {}
    for size_name, dtype, case_kinds, repeats in cases:
        runs: dict = {k: [] for k in case_kinds}
        for r in range(repeats):
            for kind in case_kinds:  # interleaved, so drifts of the machine hit every contender alike
                runs[kind].append(measure(kind, size_name, dtype, args.steps, data))
                print(f"{size_name} {dtype} {kind} #{r + 1}: {runs[kind][-1]['tokens_per_s']:,.0f} tok/s", flush=True)
        results[(size_name, dtype)] = {k: median_of(v) | {"all": [x["tokens_per_s"] for x in v]} for k, v in runs.items()}
    big = "~10M 8L/320"
    compiled = measure("sparklm-llama-compile", big, "float32", args.steps, data)
    spark_runs = [measure("spark", big, "float32", args.steps, data) for _ in range(args.repeats)]
    spark = median_of(spark_runs)
    loop = results[(big, "float32")]["sparklm-llama"]
    firsts = [r["seconds_to_first_step"] for r in spark_runs]

    print("\n| model | dtype | plain tok/s (ms/step, MFU) | sparklm gpt2 tok/s (vs plain, MFU) | sparklm llama tok/s "
          "(MFU) | plain + allocator tok/s (vs plain) | peak RSS MB plain / sparklm gpt2 |")
    print("|---|---|---|---|---|---|---|")
    params = {n: plain_params(SIZES[n]) for n in SIZES}
    for (size_name, dtype), res in results.items():
        peak, p, g = peaks[dtype], res["plain"], res["sparklm-gpt2"]
        fpt = p["flops_per_token"]
        lla, pa = res.get("sparklm-llama"), res.get("plain+allocator")
        llama_cell = f"{lla['tokens_per_s']:,.0f} ({lla['tokens_per_s'] * lla['flops_per_token'] / peak:.0%})" if lla else "–"
        alloc_cell = f"{pa['tokens_per_s']:,.0f} ({pa['tokens_per_s'] / p['tokens_per_s']:.2f}×)" if pa else "–"
        print(f"| {size_name} ({params[size_name] / 1e6:.1f}M) | {dtype} | {p['tokens_per_s']:,.0f} "
              f"({p['ms_per_step']:.0f} ms, {p['tokens_per_s'] * fpt / peak:.0%}) | {g['tokens_per_s']:,.0f} "
              f"(**{g['tokens_per_s'] / p['tokens_per_s']:.2f}×**, {g['tokens_per_s'] * fpt / peak:.0%}) | "
              f"{llama_cell} | {alloc_cell} | {p['peak_rss_mb']:.0f} / {g['peak_rss_mb']:.0f} |")
    print("\nruns (tok/s): " + "; ".join(f"{n} {d} {k}: {', '.join(f'{x:,.0f}' for x in v['all'])}"
                                        for (n, d), res in results.items() for k, v in res.items()))
    print(f"\ntorch.compile (~10M llama, fp32, one run): {compiled['tokens_per_s']:,.0f} tok/s "
          f"({compiled['tokens_per_s'] / loop['tokens_per_s']:.2f}x of eager's median), first step after "
          f"{compiled['first_step_s']:.0f}s (eager {loop['first_step_s']:.0f}s)")
    print(f"\nSpark overhead (~10M llama, fp32, 1 worker × 2 threads, median of {args.repeats}): loop "
          f"{loop['tokens_per_s']:,.0f} tok/s, through Spark {spark['tokens_per_s']:,.0f} tok/s "
          f"({spark['tokens_per_s'] / loop['tokens_per_s'] - 1:+.1%}); from command start to the first step "
          f"{spark['seconds_to_first_step']:.1f} s (runs: {', '.join(f'{x:.1f}' for x in firsts)} s)")
    (work / "train_throughput.json").write_text(json.dumps(
        {"peaks": peaks, "results": {f"{n} {d}": r for (n, d), r in results.items()}, "compiled": compiled,
         "spark": spark_runs}, indent=2, default=str))


def compile_ab(sizes: list[str], steps: int, repeats: int, data: Path, peaks: dict, dtype: str, optimizer: str,
               work: Path) -> None:
    """sparklm's Llama loop eager and with ``train.compile`` beside the plain loop eager and compiled, all in ``dtype``,
    and the plain loop in float32 (a plain PyTorch loop's default), interleaved: steady tokens/s (median of the
    repeats), MFU against the measured peak of the dtype each ran in, and the seconds to the first step (compile
    time)."""
    cases = [("plain", "float32"), ("plain", dtype), ("plain-compile", dtype), ("sparklm-llama-sdpa", dtype),
             ("sparklm-llama", dtype), ("sparklm-llama-compile", dtype)]
    cases = list(dict.fromkeys(cases))  # float32: the first two are one
    out = {}
    for size_name in sizes:
        runs: dict = {c: [] for c in cases}
        for r in range(repeats):
            for kind, dt in cases:
                runs[(kind, dt)].append(measure(kind, size_name, dt, steps, data, optimizer))
                print(f"{size_name} {kind} {dt} #{r + 1}: {runs[(kind, dt)][-1]['tokens_per_s']:,.0f} tok/s", flush=True)
        out[size_name] = runs
    print("\npeaks (GFLOP/s): " + ", ".join(f"{d} {p / 1e9:.0f}" for d, p in peaks.items()) +
          f"; sparklm's optimizer {optimizer}, the plain loop's AdamW; median of {repeats}; {steps} steps of "
          f"{BATCH} × {SEQ}")
    print("| size | contender | dtype | tok/s | vs plain fp32 | vs plain same dtype | MFU | first step |")
    print("|---|---|---|---|---|---|---|---|")
    for size_name, runs in out.items():
        med = {c: median_of(v) for c, v in runs.items()}
        base32, base = med[("plain", "float32")]["tokens_per_s"], med[("plain", dtype)]["tokens_per_s"]
        for (kind, dt), m in med.items():
            tps = m["tokens_per_s"]
            print(f"| {size_name} | {kind} | {dt} | {tps:,.0f} | {tps / base32:.2f}× | "
                  f"{tps / base:.2f}× | {tps * m['flops_per_token'] / peaks[dt]:.0%} | {m['first_step_s']:.1f} s |")
        print("  runs: " + "; ".join(f"{k} {d} " + ", ".join(f"{x['tokens_per_s']:,.0f}" for x in v)
                                     for (k, d), v in runs.items()))
    (work / "train_compile_ab.json").write_text(json.dumps(
        {size: {f"{k} {d}": v for (k, d), v in runs.items()} for size, runs in out.items()}, indent=2, default=str))


def plain_params(size: dict) -> int:
    return sum(p.numel() for p in GPT(GPTConfig(block_size=SEQ, vocab_size=4096, **size)).parameters())


if __name__ == "__main__":
    main()
