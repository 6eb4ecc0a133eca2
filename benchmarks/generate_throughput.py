"""Benchmark: generation and inference speed, side by side in one run (same machine, same threads).

    .venv/bin/python benchmarks/generate_throughput.py [--model RUN_DIR]

1. Generation tokens/s at batch 1 and 8, greedy, sparklm's KV-cache loop vs HF ``model.generate``
   on the same model, prompts and settings; ``min_new_tokens = max_new_tokens`` in both, so every
   row generates exactly that many tokens (the same tokens: checked).
2. Batch generation over a Spark DataFrame with 2 workers × 1 thread (local[2]) vs one process with
   2 threads, the same 32 prompts.
3. ONNX fp32 vs int8 (dynamic) vs int4 (weight-only): scoring throughput (tokens/s of batch-8
   context-length windows) and perplexity on ../shared/data/wikitext-2/test.txt (first --eval-kb KB,
   windows of the context with half-context stride), plus torch fp32 for reference.
The model defaults to a run trained here on Tiny Shakespeare for --train-seconds (default model).
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared" / "data"
THREADS = 2


def trained_model(work: Path, seconds: int) -> Path:
    run = work / "generate-bench-run"
    if not (run / "model" / "config.json").exists():
        data = work / "shakespeare-4096"
        if not (data / "manifest.json").exists():
            subprocess.run([sys.executable, "-m", "sparklm", "prepare", str(SHARED / "tinyshakespeare.txt"), "-o",
                            str(data), "--vocab-size", "4096", "--seq-len", "256", "--master", "local[2]"], check=True)
        subprocess.run([sys.executable, "-m", "sparklm", "train", "--data", str(data), "-o", str(run),
                        "--time-budget", str(seconds), "--master", "local[2]"], check=True)
    return run


def prompts_of(n: int) -> list[str]:
    lines = [x.strip() for x in (SHARED / "tinyshakespeare.txt").read_text().splitlines() if len(x.strip()) > 30]
    return [" ".join(lines[i * 97 % len(lines)].split()[:8]) for i in range(n)]


def bench_generate(run: Path, new_tokens: int) -> list[dict]:
    from sparklm.infer.generate import encode, generate, load
    from sparklm.infer.sampling import Sampling

    torch.set_num_threads(THREADS)
    lm = load(str(run))
    s = Sampling(temperature=0, max_new_tokens=new_tokens, min_new_tokens=new_tokens)
    rows = []
    for batch in (1, 8):
        prompts = prompts_of(batch)
        generate(lm, prompts, sampling=Sampling(temperature=0, max_new_tokens=4), batch_size=batch)  # warm-up
        t = time.perf_counter()
        ours = generate(lm, prompts, sampling=s, batch_size=batch)
        t_ours = time.perf_counter() - t
        n_ours = sum(len(g.token_ids) for g in ours)
        tok = lm.tokenizer
        tok.padding_side = "left"
        ids = [encode(lm, p, new_tokens)[0] for p in prompts]
        width = max(len(i) for i in ids)
        x = torch.tensor([[tok.pad_token_id] * (width - len(i)) + i for i in ids])
        mask = torch.tensor([[0] * (width - len(i)) + [1] * len(i) for i in ids])
        kw = dict(do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=tok.pad_token_id,
                  eos_token_id=tok.eos_token_id)
        with torch.no_grad():
            lm.model.generate(x, attention_mask=mask, **{**kw, "max_new_tokens": 4, "min_new_tokens": 4})
            t = time.perf_counter()
            ref = lm.model.generate(x, attention_mask=mask, **kw)
            t_hf = time.perf_counter() - t
        new = ref[:, width:]
        n_hf = new.numel()  # every row runs to max_new_tokens
        same = all(g.token_ids == new[i, :len(g.token_ids)].tolist() for i, g in enumerate(ours))
        rows.append({"batch": batch, "ours_tok_s": n_ours / t_ours, "hf_tok_s": n_hf / t_hf, "ours_tokens": n_ours,
                     "hf_tokens": n_hf, "same_tokens": same})
        print(f"generate batch {batch}: sparklm {n_ours / t_ours:,.1f} tok/s vs HF generate {n_hf / t_hf:,.1f} tok/s "
              f"({n_ours / t_ours / (n_hf / t_hf):.2f}x), same tokens: {same}", flush=True)
    return rows


def bench_spark(run: Path, new_tokens: int, n_prompts: int) -> dict:
    from sparklm.config import SparkConfig
    from sparklm.infer.batch import generate_dataframe
    from sparklm.infer.generate import generate, load
    from sparklm.infer.sampling import Sampling
    from sparklm.spark.session import get_session

    s = Sampling(temperature=0.8, top_k=50, max_new_tokens=new_tokens, min_new_tokens=new_tokens, seed=1)
    prompts = prompts_of(n_prompts)
    torch.set_num_threads(THREADS)
    lm = load(str(run))
    t = time.perf_counter()
    single = generate(lm, prompts, sampling=s, batch_size=8)
    t_single = time.perf_counter() - t
    spark = get_session(SparkConfig(master="local[2]", ui=False))
    df = spark.createDataFrame(list(enumerate(prompts)), "id long, prompt string").repartition(2)
    generate_dataframe(df, model=str(run), sampling=s, batch_size=8, threads=1).collect()  # workers load the model
    t = time.perf_counter()
    rows = generate_dataframe(df, model=str(run), sampling=s, batch_size=8, threads=1).collect()
    t_spark = time.perf_counter() - t
    n = sum(len(g.token_ids) for g in single)
    n_spark = sum(r.new_tokens for r in rows)
    print(f"batch generation, {n_prompts} prompts: Spark 2 workers x 1 thread {n_spark / t_spark:,.1f} tok/s "
          f"({t_spark:.1f} s) vs one process 2 threads {n / t_single:,.1f} tok/s ({t_single:.1f} s)", flush=True)
    spark.stop()
    return {"spark_tok_s": n_spark / t_spark, "spark_s": t_spark, "single_tok_s": n / t_single, "single_s": t_single}


def bench_quantized(run: Path, work: Path, eval_kb: int) -> list[dict]:
    from sparklm.infer.evaluate import windows
    from sparklm.infer.export import LogitsGraph, export, load_onnx
    from sparklm.infer.generate import load, token_ids

    torch.set_num_threads(THREADS)
    lm = load(str(run))
    text = (SHARED / "wikitext-2" / "test.txt").read_text()[: eval_kb * 1024]
    ids = token_ids(lm, text)
    ctx = lm.context
    ws = windows(len(ids), ctx, ctx // 2)
    torch_graph = LogitsGraph(lm.model).eval()
    int8_graph = LogitsGraph(torch.ao.quantization.quantize_dynamic(load(str(run)).model, {torch.nn.Linear},
                                                                    dtype=torch.qint8)).eval()
    variants = {"torch fp32": lambda x, m: torch_graph(x, m), "torch int8 (dynamic)": lambda x, m: int8_graph(x, m)}
    for q in ("none", "int8", "int4"):
        out = work / f"onnx-{q}"
        try:
            export(str(run), str(out), quantize=q, overwrite=True)
        except Exception as e:  # int4 needs a recent onnxruntime
            print(f"export {q} failed: {' '.join(str(e).split())[:200]}", flush=True)
            continue
        onnx_lm = load_onnx(str(out), threads=THREADS)
        variants[f"onnx {'fp32' if q == 'none' else q}"] = (
            lambda x, m, model=onnx_lm.model: model(input_ids=x, attention_mask=m).logits)
    results = []
    for name, fn in variants.items():
        nats, count, t_total, n_tok = 0.0, 0, 0.0, 0
        for i in range(0, len(ws), 8):
            chunk = ws[i:i + 8]
            width = max(e - b for b, e, _ in chunk)
            x = torch.zeros((len(chunk), width), dtype=torch.long)
            m = torch.zeros_like(x)
            for j, (b, e, _) in enumerate(chunk):
                x[j, :e - b] = torch.tensor(ids[b:e])
                m[j, :e - b] = 1
            t = time.perf_counter()
            with torch.no_grad():
                logits = fn(x, m).float()
            t_total += time.perf_counter() - t
            n_tok += int(m.sum())
            logp = logits[:, :-1].log_softmax(-1)
            for j, (b, e, targets) in enumerate(chunk):
                n = e - b
                lo = max(1, n - targets)
                tgt = x[j, lo:n]
                nats -= float(logp[j, lo - 1:n - 1].gather(-1, tgt[:, None]).sum())
                count += n - lo
        ppl = math.exp(nats / count)
        results.append({"variant": name, "tok_s": n_tok / t_total, "perplexity": ppl, "tokens": count})
        print(f"{name}: {n_tok / t_total:,.0f} tok/s scored, perplexity {ppl:.3f} over {count:,} tokens", flush=True)
    base = next(r for r in results if r["variant"] == "onnx fp32")
    for r in results:
        r["speedup_vs_onnx_fp32"] = r["tok_s"] / base["tok_s"]
        r["ppl_change_vs_onnx_fp32"] = r["perplexity"] / base["perplexity"] - 1
    return results


def random_model(work: Path, run: Path, layers: int, width: int) -> Path:
    """The trained model's tokenizer with a random Llama of another size: for speed figures only."""
    from sparklm.config import from_dict
    from sparklm.infer.generate import load
    from sparklm.model import build_model

    out = work / f"random-{layers}L-{width}"
    lm = load(str(run))
    tok = lm.tokenizer
    cfg = from_dict({"model": {"n_layer": layers, "n_embd": width, "n_head": max(1, width // 64)}})
    model = build_model(cfg.model, vocab_size=lm.model.config.vocab_size, context=lm.context, bos_id=tok.bos_token_id,
                        eos_id=tok.eos_token_id, pad_id=tok.pad_token_id)
    model.save_pretrained(str(out / "model"), safe_serialization=True)
    tok.save_pretrained(str(out / "model"))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="a run directory (default: train one here)")
    ap.add_argument("--work", default=str(ROOT / ".bench"))
    ap.add_argument("--train-seconds", type=int, default=180)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--eval-kb", type=int, default=256)
    ap.add_argument("--bigger", nargs=2, type=int, default=[8, 768], metavar=("LAYERS", "WIDTH"),
                    help="also time quantization on a random Llama of this size (speed only)")
    ap.add_argument("--quant-only", action="store_true", help="only the quantization figures for --model")
    args = ap.parse_args()
    work = Path(args.work)
    work.mkdir(exist_ok=True)
    run = Path(args.model) if args.model else trained_model(work, args.train_seconds)
    if args.quant_only:
        quant = bench_quantized(run, work, args.eval_kb)
        print("\n| variant | scoring tok/s | vs ONNX fp32 | perplexity | change |\n|---|---|---|---|---|")
        for r in quant:
            print(f"| {r['variant']} | {r['tok_s']:,.0f} | {r['speedup_vs_onnx_fp32']:.2f}× | {r['perplexity']:.3f} | "
                  f"{r['ppl_change_vs_onnx_fp32']:+.2%} |")
        (work / "generate_quant_only.json").write_text(json.dumps({"model": str(run), "quantized": quant}, indent=2))
        return
    gen = bench_generate(run, args.new_tokens)
    spark = bench_spark(run, args.new_tokens // 2, args.prompts)
    quant = bench_quantized(run, work, args.eval_kb)
    big = random_model(work, run, *args.bigger)
    print(f"random Llama {args.bigger[0]}L/{args.bigger[1]} (speed only; its perplexity means nothing):", flush=True)
    quant_big = bench_quantized(big, work, args.eval_kb // 4)
    print("\n| batch | sparklm tok/s | HF generate tok/s | ratio | same tokens |\n|---|---|---|---|---|")
    print(f"\nbatch generation: Spark 2 workers x 1 thread {spark['spark_tok_s']:,.1f} tok/s vs one process 2 threads "
          f"{spark['single_tok_s']:,.1f} tok/s")
    for r in gen:
        print(f"| {r['batch']} | {r['ours_tok_s']:,.1f} | {r['hf_tok_s']:,.1f} | **{r['ours_tok_s'] / r['hf_tok_s']:.2f}×** "
              f"| {r['same_tokens']} |")
    print("\n| variant | scoring tok/s | vs ONNX fp32 | perplexity | change |\n|---|---|---|---|---|")
    for r in quant:
        print(f"| {r['variant']} | {r['tok_s']:,.0f} | {r['speedup_vs_onnx_fp32']:.2f}× | {r['perplexity']:.3f} | "
              f"{r['ppl_change_vs_onnx_fp32']:+.2%} |")
    print(f"\nrandom Llama {args.bigger[0]}L/{args.bigger[1]}: " + "; ".join(
        f"{r['variant']} {r['tok_s']:,.0f} tok/s ({r['speedup_vs_onnx_fp32']:.2f}x)" for r in quant_big))
    (work / "generate_throughput.json").write_text(json.dumps({"generate": gen, "spark": spark, "quantized": quant,
                                                               "quantized_bigger": quant_big}, indent=2))


if __name__ == "__main__":
    main()
