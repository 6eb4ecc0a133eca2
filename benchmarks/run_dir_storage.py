"""Benchmark: training with the run directory on S3 vs on local disk (issue 11's ≤5% target).

    .venv/bin/python benchmarks/run_dir_storage.py                # 400 steps, 3 repeats
    .venv/bin/python benchmarks/run_dir_storage.py --steps 200 --repeats 1

The same `sparklm train` command (Tiny Shakespeare prepared once, default model and settings — so a
checkpoint every 200 steps, metrics every 10 — `local[2]`, 1 worker × 2 threads) writes its run
directory to a local path or to `s3://` on a real S3 endpoint (moto in server mode on 127.0.0.1, started
here). Contenders alternate, each in a fresh process; medians of the repeats. Reported: wall time of the
command, training seconds and steady tokens/s from summary.json, and what S3 adds to each.

moto keeps objects in its own Python process's memory: uploads cost CPU on this 2-core machine that a
real object store would not, so the figure is an upper bound for the upload work on the host.
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
SHARED = ROOT.parent / "shared" / "data"


def prepared(work: Path) -> Path:
    data = work / "prepared"
    if (data / "manifest.json").is_file():
        return data
    work.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "sparklm", "prepare", str(SHARED / "tinyshakespeare.txt"), "-o", str(data),
                    "--overwrite", "--master", "local[2]", "--set", "spark.ui=false"], check=True, capture_output=True)
    return data


def run(where: str, data: Path, output: str, steps: int, env: dict) -> dict:
    if "://" not in output:
        shutil.rmtree(output, ignore_errors=True)
    t0 = time.time()
    r = subprocess.run([sys.executable, "-m", "sparklm", "train", "--data", str(data), "-o", output,
                        "--max-steps", str(steps), "--master", "local[2]", "--set", "spark.ui=false"],
                       capture_output=True, text=True, env=env)
    wall = time.time() - t0
    if r.returncode:
        raise SystemExit(f"{where} failed:\n{r.stderr[-3000:]}")
    sys.path.insert(0, str(ROOT / "src"))
    from sparklm.infra.fs import read_text

    s = json.loads(read_text(f"{output}/summary.json"))
    res = {"where": where, "wall_s": wall, "train_s": s["train_seconds"], "tokens_per_s": s["tokens_per_s"],
           "ms_per_step": s["ms_per_step"], "steps": s["steps"]}
    print(f"{where}: wall {wall:.1f} s, train {res['train_s']:.1f} s, {res['tokens_per_s']:,.0f} tok/s", flush=True)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--work", default=str(ROOT / ".bench" / "run_dir_storage"))
    args = ap.parse_args()
    work = Path(args.work)
    data = prepared(work)

    import socket

    import boto3
    from moto.server import ThreadedMotoServer

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    server.start()
    env = {**os.environ, "AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_REGION": "us-east-1",
           "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}"}
    os.environ.update({k: v for k, v in env.items() if k.startswith("AWS_")})  # this process reads summaries
    boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"], region_name="us-east-1",
                 aws_access_key_id="bench", aws_secret_access_key="bench").create_bucket(Bucket="bench")
    results: dict[str, list[dict]] = {"local": [], "s3": []}
    try:
        for i in range(args.repeats):
            for where in ("local", "s3") if i % 2 == 0 else ("s3", "local"):
                output = str(work / "runs" / f"local-{i}") if where == "local" else f"s3://bench/runs/s3-{i}"
                results[where].append(run(where, data, output, args.steps, env))
    finally:
        server.stop()
    med = {w: {k: statistics.median(r[k] for r in rs) for k in ("wall_s", "train_s", "tokens_per_s", "ms_per_step")}
           for w, rs in results.items()}
    print(json.dumps({"steps": args.steps, "repeats": args.repeats, "median": med, "runs": results}, indent=2))
    loc, s3 = med["local"], med["s3"]
    print("\n| run directory | wall s | train s | tokens/s | ms/step |\n|---|---|---|---|---|")
    for w in ("local", "s3"):
        m = med[w]
        print(f"| {w} | {m['wall_s']:.1f} | {m['train_s']:.1f} | {m['tokens_per_s']:,.0f} | {m['ms_per_step']:.0f} |")
    print(f"\nS3 adds {s3['wall_s'] / loc['wall_s'] - 1:+.1%} wall, {s3['train_s'] / loc['train_s'] - 1:+.1%} training "
          f"time, {s3['tokens_per_s'] / loc['tokens_per_s'] - 1:+.1%} tokens/s")


if __name__ == "__main__":
    main()
