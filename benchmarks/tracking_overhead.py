"""Benchmark: what experiment tracking costs training. The same `sparklm train` with no tracker, and with all three
(TensorBoard event files, MLflow to an `mlflow server` on 127.0.0.1, W&B offline), side by side: each run a fresh
`sparklm train` process, the two interleaved, 3 repeats, medians.

    .venv/bin/python benchmarks/tracking_overhead.py [STEPS]

Data: ../shared/data/tinyshakespeare.txt prepared once (seq 256, BPE 4096) under /tmp/trackbench. Model: Llama
4L/256 (fresh), 2 DDP workers x 1 thread, batch 4, log every 10 steps, checkpoint every 50 (MLflow and W&B
receive the rows at each checkpoint: the flush the ranks wait for), STEPS (default 200) steps. Figures: the
summary's steady tokens/s (train rows after the first quarter), tokens / training seconds (checkpoints, flushes,
the final evaluation and export, and the trackers' model logging included), and the command's wall time.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORK = Path("/tmp/trackbench")
SPARKLM = str(ROOT / ".venv" / "bin" / "sparklm")
TEXT = ROOT.parent / "shared" / "data" / "tinyshakespeare.txt"


def prepare() -> Path:
    data = WORK / "data"
    if not (data / "manifest.json").exists():
        if not TEXT.exists():
            raise SystemExit(f"{TEXT} not found: the benchmark reads ../shared/data")
        subprocess.run([SPARKLM, "prepare", str(TEXT), "--output", str(data), "--seq-len", "256", "--vocab-size",
                        "4096", "--overwrite"], check=True)
    return data


def mlflow_server() -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    root = WORK / "mlflow"
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    proc = subprocess.Popen([str(ROOT / ".venv" / "bin" / "mlflow"), "server", "--host", "127.0.0.1", "--port",
                             str(port), "--workers", "1", "--backend-store-uri", f"sqlite:///{root}/db.sqlite",
                             "--artifacts-destination", str(root / "artifacts")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    uri = f"http://127.0.0.1:{port}"
    for _ in range(180):
        try:
            urllib.request.urlopen(f"{uri}/health", timeout=2)
            return proc, uri
        except OSError:
            time.sleep(0.5)
    raise SystemExit("mlflow server did not start")


def run(data: Path, mode: str, steps: int, uri: str, i: int) -> dict:
    out = WORK / f"run-{mode}-{i}"
    shutil.rmtree(out, ignore_errors=True)
    args = [SPARKLM, "train", "--data", str(data), "--output", str(out), "--max-steps", str(steps),
            "--workers", "2", "--threads", "1", "--checkpoint-every", "50", "--eval-every", "0",
            "--master", "local[2]"]
    args += [a for kv in ("train.batch_size=4", "model.n_layer=4", "model.n_embd=256", "model.n_head=4",
                          "train.log_every=10", "train.samples=0") for a in ("--set", kv)]
    if mode == "tracked":
        args += ["--tensorboard", "--mlflow", uri, "--mlflow-experiment", "bench", "--wandb", "bench"]
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    t = time.perf_counter()
    subprocess.run(args, check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wall = time.perf_counter() - t
    s = json.loads((out / "summary.json").read_text())
    return {"mode": mode, "steady_tok_s": s["tokens_per_s"], "train_tok_s": s["tokens"] / s["train_seconds"],
            "wall_s": wall}


def main() -> None:
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 200
    WORK.mkdir(exist_ok=True)
    data = prepare()
    server, uri = mlflow_server()
    results = []
    try:
        for i in range(3):
            for mode in ("off", "tracked") if i % 2 == 0 else ("tracked", "off"):
                r = run(data, mode, steps, uri, i)
                results.append(r)
                print(json.dumps({k: round(v, 1) if isinstance(v, float) else v for k, v in r.items()}), flush=True)
    finally:
        os.killpg(server.pid, signal.SIGTERM)
    med = {m: {k: statistics.median(r[k] for r in results if r["mode"] == m)
               for k in ("steady_tok_s", "train_tok_s", "wall_s")} for m in ("off", "tracked")}
    for k in ("steady_tok_s", "train_tok_s"):
        cost = 1 - med["tracked"][k] / med["off"][k]
        print(f"{k}: off {med['off'][k]:,.0f}, tracked {med['tracked'][k]:,.0f} -> overhead {cost:+.1%}")
    print(f"wall_s: off {med['off']['wall_s']:.1f}, tracked {med['tracked']['wall_s']:.1f}")


if __name__ == "__main__":
    main()
