"""Elastic training: hosts that leave, are decommissioned and join mid-run, under ddp, average and diloco (issue 54).

    .venv/bin/python benchmarks/elastic.py                                  # every strategy and event, ~15 min
    .venv/bin/python benchmarks/elastic.py --strategies ddp --events kill

Each run is `sparklm train --workers 1:2` on a fresh standalone cluster from the pyspark package on 127.0.0.1
(1-core workers, as tests/conftest.py starts them), with the same data, model and steps:

- reference: two workers all along;
- kill: once the run passes step --at, one worker is SIGKILLed with everything below it (its executor, Python
  workers and rank): a host gone;
- decommission: once the run passes step --at, one worker gets SIGPWR, which Spark's standalone worker takes as
  "decommission me" (the application runs with spark.decommission.enabled);
- add: the cluster starts with one worker; once the run passes step --at, a second joins.

Measured per run: whether it finished, each step's row once, the tokens trained against the plan's, the final
held-out bits/byte against the reference's, the wall time (and its difference to the reference: the time the event
cost), and the workers over time (metrics.csv's ``workers`` column). The table goes to RELIABILITY.md.
"""

from __future__ import annotations

import argparse
import signal
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from conftest import add_worker, kill_tree, start_standalone, stop_processes  # noqa: E402
from kill_campaign import prepared, start  # noqa: E402
from sparklm.metrics.sinks import read_metrics  # noqa: E402

SETTINGS = ["model.n_layer=2", "model.n_head=2", "model.n_embd=64", "train.batch_size=4", "train.log_every=1",
            "train.eval_every=0", "train.eval_batches=8", "train.samples=0", "train.threads=1",
            'train.dtype="float32"', "train.checkpoint_every=10", "train.rounds.sync_every=4"]


def run_once(work: Path, data: str, strategy: str, event: str, steps: int, at: int) -> dict:
    cluster = work / "cluster"
    cluster.mkdir(parents=True)
    procs, url, _ = start_standalone(cluster, workers=1 if event == "add" else 2)
    out = work / "run"
    args = ["train", "--data", data, "-o", str(out), "--workers", "1:2", "--strategy", strategy, "--master", url,
            "--max-steps", str(steps), "--conf", "spark.executor.memory=1g", "--conf", "spark.ui.enabled=false",
            "--conf", "spark.decommission.enabled=true"]
    for s in SETTINGS:
        args += ["--set", s]
    t0 = time.time()
    proc = start(args, {})
    acted, lines = None, []
    try:
        for line in proc.stderr:
            lines.append(line)
            step = _step(line)
            if acted is None and step is not None and step >= at and event != "none":
                acted = time.time()
                if event == "kill":
                    kill_tree(procs[2].pid)
                elif event == "decommission":
                    procs[2].send_signal(signal.SIGPWR)
                elif event == "add":
                    procs.append(add_worker(cluster, url, "w-added"))
        proc.wait(timeout=900)
    finally:
        if proc.poll() is None:
            proc.kill()
        stop_processes(procs)
    wall = time.time() - t0
    rows = [r for r in read_metrics(str(out / "metrics.csv")) if r["kind"] == "train"]
    evals = [r for r in read_metrics(str(out / "metrics.csv")) if r["kind"] == "eval"]
    return {"rc": proc.returncode, "wall": wall, "steps": [r["step"] for r in rows],
            "tokens": rows[-1]["tokens"] if rows else None, "workers": [r["workers"] for r in rows],
            "bpb": evals[-1]["val_bpb"] if evals else None, "last": "".join(lines[-3:]).strip()[-300:],
            "warnings": [x.strip() for x in lines if x.startswith(("warning:", "note:", "error:"))]}


def _step(line: str) -> int | None:
    """The step a progress line reports ("step 12/60 | …", "round 3 | step 12/60 | …")."""
    for part in line.split("|"):
        part = part.strip()
        if part.startswith("step ") and "/" in part:
            try:
                return int(part[5:].split("/")[0])
            except ValueError:
                return None
    return None


def runs_over_time(workers: list[int]) -> str:
    """``[2, 2, 1, 1, 1]`` → ``2×2, 1×3``: the world size over the run's train rows."""
    out: list[list[int]] = []
    for w in workers:
        if out and out[-1][0] == w:
            out[-1][1] += 1
        else:
            out.append([w, 1])
    return ", ".join(f"{w}×{n}" for w, n in out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--strategies", default="ddp,average,diloco")
    ap.add_argument("--events", default="kill,decommission,add")
    ap.add_argument("--steps", type=int, default=160)
    ap.add_argument("--at", type=int, default=40, help="the step after which the event happens")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="sparklm-elastic-"))
    data = prepared(work)
    print("| strategy | event | finished | each step once | tokens = plan | final bits/byte (reference) | wall s "
          "(reference) | time lost s | workers over the run's rows |")
    print("|---|---|---|---|---|---|---|---|---|")
    for strategy in args.strategies.split(","):
        ref = run_once(work / f"{strategy}-ref", data, strategy, "none", args.steps, args.at)
        for event in args.events.split(","):
            r = run_once(work / f"{strategy}-{event}", data, strategy, event, args.steps, args.at)
            once = r["steps"] == ref["steps"]
            bpb = f"{r['bpb']:.4f} ({ref['bpb']:.4f}, {100 * (r['bpb'] / ref['bpb'] - 1):+.2f}%)" if r["bpb"] else "-"
            print(f"| {strategy} | {event} | {'yes' if r['rc'] == 0 else 'no: ' + r['last']} | "
                  f"{'yes' if once else 'no'} | {'yes' if r['tokens'] == ref['tokens'] else 'no'} | {bpb} | "
                  f"{r['wall']:.1f} ({ref['wall']:.1f}) | {r['wall'] - ref['wall']:+.1f} | "
                  f"{runs_over_time(r['workers'])} |", flush=True)
            for w in r["warnings"]:
                print(f"  {w}", flush=True)


if __name__ == "__main__":
    main()
