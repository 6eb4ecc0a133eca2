"""Benchmark: DDP vs parameter averaging vs DiLoCo (and its codecs), the same token budget for every contender.

    .venv/bin/python benchmarks/strategies.py                 # all contenders, then the scaling model
    .venv/bin/python benchmarks/strategies.py --only ddp diloco-32
    .venv/bin/python benchmarks/strategies.py --corpus wikitext2 --workers 4 --only ddp diloco
    .venv/bin/python benchmarks/strategies.py --model-only    # the scaling model from the last results

Corpora: Tiny Shakespeare as in time_to_quality.py (first 90% of the text trains, the last 10% validates), or
WikiText-2 (its test split trains, its validation split validates); BPE 4096, seq 256.
Every contender is one `sparklm train` command (a fresh process, Spark local[N], N workers × 1 thread,
batch 8 per worker, the defaults otherwise) for --steps optimizer steps: the same tokens for all. Results go
to WORK/strategies.json (Tiny Shakespeare, 2 workers) or WORK/strategies-CORPUS-Nw.json.
Reported: final validation bits/byte over the whole validation split, bytes communicated (measured
payloads for the rounds; for DDP computed from the ring all-reduce of fp32 gradients, as gloo has no
counters), wall time of the command.

Then a written model of step time against the number of workers (see BENCHMARKS.md), calibrated with
the compute and Spark round overheads measured here.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared" / "data"

M09 = ["train.rounds.outer_momentum=0.9"]
# Round contenders name their codec: the default (auto) is int4 for diloco since issue 41, fp32 before it.
CONTENDERS = {
    "ddp": [],
    "average-8": ["--strategy", "average", "--sync-every", "8"],
    "average-32": ["--strategy", "average", "--sync-every", "32"],
    # the paper's outer momentum, 0.9 (the default before issue 41)
    "diloco-32": ["--strategy", "diloco", "--sync-every", "32", "--codec", "fp32", "--set", *M09],
    "diloco-128": ["--strategy", "diloco", "--sync-every", "128", "--codec", "fp32", "--set", *M09],
    "diloco-32-reset": ["--strategy", "diloco", "--sync-every", "32", "--codec", "fp32", "--set", *M09,
                        "--set", "train.rounds.inner_state=\"reset\""],
    # The paper's outer momentum (0.9) carries early, large deltas into the last rounds of a short run;
    # with a few dozen rounds at most, a shorter memory:
    "diloco-32-m0.5": ["--strategy", "diloco", "--sync-every", "32", "--codec", "fp32",
                       "--set", "train.rounds.outer_momentum=0.5"],
    "diloco-64-m0.5": ["--strategy", "diloco", "--sync-every", "64", "--codec", "fp32",
                        "--set", "train.rounds.outer_momentum=0.5"],
    "diloco-128-m0.5": ["--strategy", "diloco", "--sync-every", "128", "--codec", "fp32",
                        "--set", "train.rounds.outer_momentum=0.5"],
    "average-8-reset": ["--strategy", "average", "--sync-every", "8", "--set", "train.rounds.inner_state=\"reset\""],
    # What a round sends (train.rounds.codec): SparseLoCo's rule (Top-k in 2 bits, error feedback decaying 0.95, no
    # outer momentum, outer lr 1: a sparse outer step, so the driver sends back only the changed weights), and a
    # dense 4-bit delta under the momentum that measured best above
    **{f"diloco-{h}-topk{d}": ["--strategy", "diloco", "--sync-every", str(h), "--codec", "topk",
                               "--set", f"train.rounds.density={d / 100}", "--set", "train.rounds.outer_momentum=0.0",
                               "--set", "train.rounds.outer_lr=1.0", "--set", "train.rounds.residual_decay=0.95"]
       for h in (8, 16, 32, 64) for d in (1, 3)},
    **{f"diloco-{h}-{c}-m0.5": ["--strategy", "diloco", "--sync-every", str(h), "--codec", c,
                                "--set", "train.rounds.outer_momentum=0.5"] for h in (16, 32, 64, 128) for c in ("int4", "int2")},
    # the driver's step sent whole (train.rounds.downlink exact) instead of encoded: what the encoding costs
    "diloco-64-int4-m0.5-exact": ["--strategy", "diloco", "--sync-every", "64", "--codec", "int4",
                                  "--set", "train.rounds.outer_momentum=0.5", "--set", 'train.rounds.downlink="exact"'],
    "diloco": ["--strategy", "diloco"],  # the defaults
}


def _write(directory: Path, name: str, text: str) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / name).write_text(text)
    return directory / name


def prepared(work: Path, corpus: str = "tinyshakespeare") -> Path:
    home = work / ("tts" if corpus == "tinyshakespeare" else corpus)
    data = home / "prepared-4096"  # the vocabulary its recorded figures used (the default is now 8192)
    if (data / "manifest.json").is_file():
        return data
    home.mkdir(parents=True, exist_ok=True)
    if corpus == "tinyshakespeare":
        text = (SHARED / "tinyshakespeare.txt").read_text()
        n = int(0.9 * len(text))
        train_in, val_in = _write(home, "train.txt", text[:n]), _write(home, "val.txt", text[n:])
    elif corpus == "wikitext2":
        train_in, val_in = (_write(home, f"{split}.txt", (SHARED / "wikitext-2" / f).read_text())
                            for split, f in (("train", "test.txt"), ("val", "valid.txt")))
    else:  # each text its own document, its last 5% held out
        from sparklm.cli import default_corpus

        wiki = [SHARED / "wikitext-2" / "test.txt", SHARED / "wikitext-2" / "valid.txt"]
        # mixed: every shared text (1.3M training tokens); austen: the four novels sparklm ships (0.7M), none of them
        texts = [Path(p) for p in default_corpus()] if corpus == "austen" else [*sorted(SHARED.glob("*.txt")), *wiki]
        for f in texts:
            text = f.read_text(encoding="utf-8-sig")
            n = int(0.95 * len(text))
            name = f"wikitext-2-{f.name}" if f in wiki else f.name
            _write(home / "train", name, text[:n])
            _write(home / "val", name, text[n:])
        train_in, val_in = home / "train", home / "val"
    subprocess.run([sys.executable, "-m", "sparklm", "prepare", str(train_in), "--validation-input",
                    str(val_in), "-o", str(data), "--overwrite", "--doc-mode", "file",
                    "--vocab-size", "4096", "--master", "local[2]", "--set", "spark.ui=false"], check=True,
                   capture_output=True)
    return data


def run(name: str, data: Path, work: Path, steps: int, workers: int = 2, tag: str = "") -> dict:
    out = work / f"strategies{tag}" / name
    subprocess.run(["rm", "-rf", str(out)], check=True)
    t0 = time.time()
    r = subprocess.run([sys.executable, "-m", "sparklm", "train", "--data", str(data), "-o", str(out),
                        "--workers", str(workers), "--max-steps", str(steps), "--master", f"local[{workers}]",
                        "--set", "spark.ui=false",
                        "--set", "train.eval_batches=0", "--set", "train.eval_every=0", "--set", "train.samples=0",
                        "--set", "train.checkpoint_every=0", *CONTENDERS[name]], capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"{name} failed:\n{r.stderr[-3000:]}")
    s = json.loads((out / "summary.json").read_text())
    res = {"name": name, "wall_s": time.time() - t0, "train_s": s["train_seconds"], "val_bpb": s["final"]["val_bpb"],
           "val_loss": s["final"]["val_loss"], "steps": s["steps"], "tokens": s["tokens"], "params": s["params"],
           "bytes": s["bytes_communicated"], "ms_per_step": s["ms_per_step"], "rounds": s.get("rounds"),
           "out_bytes": s.get("bytes_broadcast"), "back_bytes": s.get("bytes_returned"), "workers": workers,
           "trainable": s.get("trainable_params") or s["params"]}
    if (out / "rounds.csv").is_file():
        with (out / "rounds.csv").open() as f:
            rows = list(csv.DictReader(f))
        steady = rows[1:] or rows  # the first round pays the Python workers' imports
        per = {k: sum(float(r[k]) for r in steady) / len(steady)
               for k in ("round_s", "compute_s", "broadcast_s", "fetch_s", "aggregate_s")}
        res["round"] = {**per, "steps": int(rows[0]["step"]), "n": len(rows)}
    print(f"{name}: {res['val_bpb']:.4f} bits/byte, {res['bytes'] / 1e6:,.0f} MB, wall {res['wall_s']:.0f} s, "
          f"train {res['train_s']:.0f} s", flush=True)
    return res


# -- the scaling model ------------------------------------------------------------------------------

LINKS = {"1 Gbit/s": (1e9 / 8, 500e-6), "10 Gbit/s": (10e9 / 8, 100e-6), "100 Gbit/s": (100e9 / 8, 20e-6)}


def ddp_step(compute: float, nbytes: float, n: int, bw: float, lat: float) -> float:
    """Ring all-reduce after every step, not overlapped with compute: 2(N-1) hops of S/N bytes."""
    if n == 1:
        return compute
    return compute + 2 * (n - 1) / n * nbytes / bw + 2 * (n - 1) * lat


def diloco_step(compute: float, nbytes: float, n: int, bw: float, lat: float, h: int, overhead: float) -> float:
    """A round every h steps: torrent broadcast of the weights (~S/B + log2(N) hops), a depth-2 tree
    aggregation of the deltas (√N deltas into each aggregator, then √N partial sums into the driver),
    plus Spark's per-round job overhead (measured)."""
    if n == 1:
        return compute + overhead / h
    fan = math.ceil(math.sqrt(n))
    comm = nbytes / bw + math.ceil(math.log2(n)) * lat + 2 * fan * nbytes / bw + 2 * lat
    return compute + (comm + overhead) / h


def scaling_tables(results: dict) -> str:
    ddp = results["ddp"]
    rounds = [r["round"] for r in results.values() if "round" in r]
    params = ddp["params"]
    # compute per step per worker, measured: the rounds' inner steps (no communication in them); the
    # median over contenders, as this machine's speed drifts between runs
    compute = sorted(r["compute_s"] / r["steps"] for r in rounds)[len(rounds) // 2]
    overhead = sorted(max(r["round_s"] - r["compute_s"], 0.0) for r in rounds)[len(rounds) // 2]
    flops_ratio = 125e6 / params
    lines = [f"Calibration (measured here): default model {params / 1e6:.1f}M parameters; {1000 * compute:.0f} ms "
             f"compute per step per worker (batch 8 × 256 tokens, 1 thread; median over the round-based runs); "
             f"Spark's overhead per round (job, broadcast, fetch, tree aggregation, outer step) {overhead:.2f} s; "
             f"DDP measured {ddp['ms_per_step']:.0f} ms per step with its all-reduce over loopback. 125M model: "
             f"compute × {flops_ratio:.0f} (parameters) on a CPU worker like this one, or 50 ms/step on a "
             f"GPU-class worker.",
             "", "Scaling efficiency (compute time ÷ step time: 100% = linear speed-up in N), DDP / DiLoCo H=32 / "
             "DiLoCo H=128:", "", "| model, worker | link (latency) | N = 2 | N = 8 | N = 32 | N = 128 |",
             "|---|---|---|---|---|---|"]
    for label, p, c in (("default model, CPU", params, compute), ("125M, CPU", 125e6, compute * flops_ratio),
                        ("125M, GPU-class (50 ms/step)", 125e6, 0.05)):
        for link, (bw, lat) in LINKS.items():
            cells = []
            for n in (2, 8, 32, 128):
                d = ddp_step(c, 4 * p, n, bw, lat)
                l32 = diloco_step(c, 4 * p, n, bw, lat, 32, overhead)
                l128 = diloco_step(c, 4 * p, n, bw, lat, 128, overhead)
                cells.append(f"{c / d:.0%} / {c / l32:.0%} / {c / l128:.0%}")
            lines.append(f"| {label} | {link} ({1e6 * lat:.0f} µs) | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def table(results: dict) -> str:
    """DDP vs each contender: quality, bytes each way, bits per trainable parameter per inner step, wall time."""
    ddp = results.get("ddp")
    lines = ["| strategy | val bits/byte | vs DDP | bytes out (driver → workers) | bytes back | total | less than "
             "DDP | bits/param/step | rounds | wall time |", "|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        vs = f"{(r['val_bpb'] / ddp['val_bpb'] - 1):+.1%}" if ddp else ""
        less = f"{ddp['bytes'] / r['bytes']:,.0f}×" if ddp and r["bytes"] else ""
        each = (f"{r['out_bytes'] / 1e6:,.1f} MB | {r['back_bytes'] / 1e6:,.1f} MB" if r.get("out_bytes") is not None
                else "— | —")
        # per worker and step, both directions, against the parameters that travel (DDP: 2 × 32 bits, ring)
        bits = 8 * r["bytes"] / (r.get("trainable", r["params"]) * r["steps"] * r.get("workers", 2))
        lines.append(f"| {name} | {r['val_bpb']:.4f} | {vs} | {each} | {r['bytes'] / 1e6:,.1f} MB | {less} | "
                     f"{bits:.3f} | {r['rounds'] or ''} | {r['wall_s']:.0f} s |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=512, help="optimizer steps for every contender")
    ap.add_argument("--only", nargs="*", choices=list(CONTENDERS), help="run these contenders only")
    ap.add_argument("--model-only", action="store_true", help="print the scaling model from saved results")
    ap.add_argument("--work", default=str(ROOT / ".bench"))
    ap.add_argument("--corpus", choices=("tinyshakespeare", "wikitext2", "mixed", "austen"),
                    default="tinyshakespeare")
    ap.add_argument("--workers", type=int, default=2, help="workers (and Spark local[N] slots), one thread each")
    args = ap.parse_args()
    work = Path(args.work)
    tag = "" if (args.corpus, args.workers) == ("tinyshakespeare", 2) else f"-{args.corpus}-{args.workers}w"
    saved = work / f"strategies{tag}.json"
    results = json.loads(saved.read_text()) if saved.is_file() else {}
    if not args.model_only:
        data = prepared(work, args.corpus)
        for name in args.only or list(CONTENDERS):
            results[name] = run(name, data, work, args.steps, args.workers, tag)
            saved.write_text(json.dumps(results, indent=2))
    print(table(results))
    if "ddp" in results and any("round" in r for r in results.values()):
        print("\n" + scaling_tables(results))


if __name__ == "__main__":
    main()
