"""Benchmark: the fixed cost of a `sparklm train` command, before its first step and after its last.

    .venv/bin/python benchmarks/fixed_cost.py --repeats 3
    .venv/bin/python benchmarks/fixed_cost.py --repeats 3 --warm-ab   # warm rank processes on vs off

Runs `sparklm train --max-steps N` with the default model on the main job's data (the bundled corpus,
prepared once with the defaults), each in a fresh process on `local[2]`, and timestamps its console
lines as they arrive:
  * start → first step: from launching the command to the line of step 1 (Spark start, the
    rank's start and imports, model build, the first step itself);
  * after the last step: from the line of the last step to the command's exit (the final
    evaluation, checkpoint, export of model/, samples, summary.json and loss.png).
Median of the repeats; the second and later runs are warm (JVM class cache, OS file cache), as a
user's second command is. --warm-ab runs each repeat twice, interleaved: with the rank's process started
before Spark (the default, ddp.DDP.prestart) and with SPARKLM_WARM_RANKS=0 (a fresh process per task).
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


def timed_run(args: list[str], env: dict | None = None) -> dict:
    import os

    t0 = time.time()
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, **(env or {})})
    first = last = None
    lines = []
    for line in proc.stdout:
        now = time.time() - t0
        lines.append(line)
        if line.startswith("step "):
            first = now if first is None else first
            last = now
    proc.wait()
    end = time.time() - t0
    if proc.returncode or first is None:
        raise SystemExit("".join(lines[-20:]))
    return {"first_step_s": first, "after_last_step_s": end - last, "wall_s": end}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--work", default=str(ROOT / ".bench" / "fixed_cost"))
    ap.add_argument("--warm-ab", action="store_true", help="rank processes started before Spark vs fresh ones")
    ap.add_argument("--set", dest="sets", action="append", default=[], help="extra --set for every run")
    args = ap.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    data = work / "data"
    common = ["--master", "local[2]", "--set", "spark.ui=false"]
    if not (data / "manifest.json").exists():
        subprocess.run([sys.executable, "-m", "sparklm", "prepare", "-o", str(data), "--overwrite", *common],
                       check=True, capture_output=True)
    extra = [a for s in args.sets for a in ("--set", s)]
    contenders = {"warm": {}, "fresh": {"SPARKLM_WARM_RANKS": "0"}} if args.warm_ab else {"default": {}}
    runs: dict[str, list[dict]] = {name: [] for name in contenders}
    for i in range(args.repeats):
        for name, env in contenders.items():
            out = work / f"run-{i}"
            subprocess.run(["rm", "-rf", str(out)], check=True)
            r = timed_run([sys.executable, "-m", "sparklm", "train", "--data", str(data), "-o", str(out), "--max-steps",
                           str(args.steps), "--set", "train.log_every=1", *common, *extra], env)
            runs[name].append(r)
            print(f"run {i} ({name}): first step at {r['first_step_s']:.1f} s, {r['after_last_step_s']:.1f} s after "
                  f"the last step, {r['wall_s']:.1f} s in all", flush=True)
    result = {}
    for name, rs in runs.items():
        med = result[name] = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
        print(f"{name}: median of {args.repeats}: command start → first step {med['first_step_s']:.1f} s; last step "
              f"→ exit {med['after_last_step_s']:.1f} s; wall {med['wall_s']:.1f} s")
    (work / "fixed_cost.json").write_text(json.dumps({"runs": runs, "median": result}, indent=2))

if __name__ == "__main__":
    main()
