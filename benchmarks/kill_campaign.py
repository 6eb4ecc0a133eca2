"""Randomized kill campaign: interrupted runs must end bitwise equal to uninterrupted ones.

    .venv/bin/python benchmarks/kill_campaign.py --points 54            # local mode and a standalone cluster
    .venv/bin/python benchmarks/kill_campaign.py --points 6 --seed 17   # repeat one draw
    .venv/bin/python benchmarks/kill_campaign.py --modes local --points 3
    .venv/bin/python benchmarks/kill_campaign.py --points 54 --seed 675085 --only 4,14   # two points of a draw again

Each kill point is drawn at random (the seed is printed; `--seed` repeats a campaign): a strategy (ddp, average,
diloco), a mode (local[2,2], or a standalone master with two 1-core workers started here from the pyspark package on
127.0.0.1), a target and a step:

- driver: the `sparklm train` process is SIGKILLed once metrics.csv reaches the step, then `sparklm train --resume`;
- rank (ddp): training rank R SIGKILLs itself after the step (the test hook SPARKLM_INJECT_RANK_FAULT); the run
  restarts its ranks from the last checkpoint;
- executor (average, diloco): in local mode the Python worker running worker W's task of the round holding the step
  is SIGKILLed (SPARKLM_INJECT_FAULT, at=crash) and local[2,2] retries the task; on the cluster the executor JVM
  running a round is SIGKILLed by PID once metrics.csv reaches the step, and Spark retries its task elsewhere.

A point passes when the finished run's newest checkpoint equals, tensor for tensor, the uninterrupted run's of the
same strategy and mode (torch.equal), metrics.csv holds each step once and says what the uninterrupted one says
(loss and evaluation by step), and no process of the command (JVM, Python workers, ranks) nor any executor of the
cluster outlives it. Outside CI's time budget (~45 s a point here); a short form runs in CI
(tests/integration/test_faults.py). The table goes to RELIABILITY.md.
"""

from __future__ import annotations

import argparse
import collections
import csv
import io
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests")]

STRATEGIES = ("ddp", "average", "diloco")
TARGETS = {"ddp": ("driver", "rank"), "average": ("driver", "executor"), "diloco": ("driver", "executor")}
MAX_STEPS = 12
SETTINGS = ["model.n_layer=1", "model.n_head=2", "model.n_embd=32", "train.batch_size=4", "train.eval_every=4",
            "train.eval_batches=2", "train.samples=0", 'train.dtype="float32"', 'train.optimizer="adamw"',
            "train.log_every=1", "train.checkpoint_every=2", "train.keep_checkpoints=100", "train.threads=1",
            "train.rounds.sync_every=2", "spark.ui=false"]


@dataclass(frozen=True)
class Point:
    strategy: str
    mode: str
    target: str
    step: int  # the step after which the kill lands (at the earliest)
    rank: int  # the rank or worker killed (rank and local executor kills)


@dataclass
class Outcome:
    point: Point
    killed_at: int | None  # the newest step metrics.csv held when the kill landed (None: the run ended first)
    bitwise: bool
    rows_once: bool
    rows_equal: bool
    leftovers: int
    seconds: float
    note: str = ""
    stderr: str = ""  # the end of what the last command printed there

    @property
    def passed(self) -> bool:
        return self.bitwise and self.rows_once and self.rows_equal and not self.leftovers and not self.note


def draw(rng: random.Random, n: int, modes: list[str], strategies: list[str]) -> list[Point]:
    """``n`` kill points: every (strategy, mode) pair in turn, the target, step and rank at random."""
    pairs = [(s, m) for m in modes for s in strategies]
    points = []
    for i in range(n):
        strategy, mode = pairs[i % len(pairs)]
        points.append(Point(strategy, mode, rng.choice(TARGETS[strategy]), rng.randint(1, MAX_STEPS - 2),
                            rng.randint(0, 1)))
    rng.shuffle(points)
    return points


def train_args(strategy: str, master: str, data: str | None, out: Path) -> list[str]:
    args = ["train", "-o", str(out), "--workers", "2", "--max-steps", str(MAX_STEPS), "--master", master]
    args += ["--data", data] if data else ["--resume"]
    for s in SETTINGS + [f'train.strategy="{strategy}"']:
        args += ["--set", s]
    if not master.startswith("local"):
        args += ["--conf", "spark.executor.memory=1g"]
    return args


def start(args: list[str], env: dict) -> subprocess.Popen:
    """``sparklm ARGS`` in its own process group (its JVM, Python workers and ranks inherit it)."""
    return subprocess.Popen([sys.executable, "-m", "sparklm", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True, env={**os.environ, "SPARK_LOCAL_IP": "127.0.0.1", **env})


def newest_step(run: Path) -> int:
    """The newest train step metrics.csv holds (0 while there is none); a half-written last line is ignored."""
    try:
        text = (run / "metrics.csv").read_text()
    except OSError:
        return 0
    steps = [int(r["step"]) for r in csv.DictReader(io.StringIO(text))
             if r.get("kind") == "train" and (r.get("step") or "").isdigit()]
    return max(steps, default=0)


def children(pid: int) -> list[int]:
    """The PIDs whose parent is ``pid`` (read from /proc), zombies (exited, not yet reaped) left out."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            out.append(int(stat.parent.name))
    return out


class Cluster:
    """A standalone master and two 1-core workers on 127.0.0.1, from the pyspark package (conftest.start_standalone)."""

    def __init__(self, work: Path):
        from conftest import start_standalone

        self.procs, self.url, _ = start_standalone(work)

    def executors(self) -> list[int]:
        """PIDs of the executor JVMs the workers run now (their children)."""
        return [pid for worker in self.procs[1:] for pid in children(worker.pid)]

    def executors_gone(self, wait: float = 60) -> int:
        """How many executors still run ``wait`` seconds after an application ended (they are then killed)."""
        deadline = time.time() + wait
        while self.executors() and time.time() < deadline:
            time.sleep(0.5)
        left = self.executors()
        for pid in left:
            print(f"  left behind: {pid} {Path(f'/proc/{pid}/cmdline').read_bytes()[-300:]!r}", flush=True)
            os.kill(pid, signal.SIGKILL)
        return len(left)

    def stop(self) -> None:
        from conftest import stop_processes

        stop_processes(self.procs)


class Campaign:
    def __init__(self, work: Path, data: str, cluster: Cluster | None):
        self.work, self.data, self.cluster = work, data, cluster
        self.references: dict[tuple[str, str], Path] = {}

    def master(self, mode: str) -> str:
        return "local[2,2]" if mode == "local" else self.cluster.url

    def finish(self, proc: subprocess.Popen, mode: str, timeout: float = 600) -> tuple[subprocess.CompletedProcess, int]:
        """Wait for the command; (its result, how many of its processes or executors outlived it)."""
        from conftest import group_gone

        out, err = proc.communicate(timeout=timeout)
        left = 0 if group_gone(proc.pid) else 1
        if mode == "cluster":
            left += self.cluster.executors_gone()
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err), left

    def reference(self, strategy: str, mode: str) -> Path:
        key = (strategy, mode)
        if key not in self.references:
            out = self.work / f"ref-{strategy}-{mode}"
            r, left = self.finish(start(train_args(strategy, self.master(mode), self.data, out), {}), mode)
            if r.returncode or left:
                raise SystemExit(f"the uninterrupted {strategy} run ({mode}) failed (exit {r.returncode}, {left} "
                                 f"process(es) left):\n{r.stderr[-3000:]}")
            self.references[key] = out
        return self.references[key]

    def run(self, i: int, p: Point) -> Outcome:
        ref = self.reference(p.strategy, p.mode)
        out = self.work / f"point-{i:03d}"
        master = self.master(p.mode)
        args = train_args(p.strategy, master, self.data, out)
        env: dict[str, str] = {}
        if p.target == "rank":
            fault = f"rank={p.rank},step={p.step},at=crash"
            env["SPARKLM_INJECT_RANK_FAULT"] = fault
            if p.mode == "cluster":  # a rank runs in an executor: the setting travels with the application
                args += ["--conf", f"spark.executorEnv.SPARKLM_INJECT_RANK_FAULT={fault}"]
        elif p.target == "executor" and p.mode == "local":
            round_ = (p.step - 1) // 2  # sync_every 2: the round holding the step, numbered from 0
            env["SPARKLM_INJECT_FAULT"] = f"round={round_},worker={p.rank},at=crash"
        t0 = time.time()
        proc = start(args, env)
        killed_at, note, left = None, "", 0
        if p.target == "driver" or (p.target == "executor" and p.mode == "cluster"):
            while proc.poll() is None and newest_step(out) < p.step:
                time.sleep(0.05)
            if proc.poll() is None:
                killed_at = newest_step(out)
                if p.target == "driver":
                    os.kill(proc.pid, signal.SIGKILL)
                else:
                    running = self.cluster.executors()
                    if running:
                        os.kill(random.Random(p.step).choice(running), signal.SIGKILL)
                    else:
                        killed_at = None
        r, left = self.finish(proc, p.mode)
        if p.target == "driver" and killed_at is not None:
            r, more = self.finish(start(train_args(p.strategy, master, None, out), {}), p.mode)
            left += more
        elif p.target == "rank" or p.mode == "local":  # the injected faults: did one fire?
            killed_at = p.step if _fault_seen(r.stderr, out) else None
        if r.returncode:
            note = _last_line(r.stderr)
        outcome = _compare(p, out, ref, killed_at, left, time.time() - t0, note)
        outcome.stderr = r.stderr[-4000:]
        return outcome


def _fault_seen(stderr: str, run: Path) -> bool:
    """A rank's death restarts the ranks; a round's failed task is attempted again (rounds.csv's attempts)."""
    if "restarting the ranks" in stderr:
        return True
    try:
        rows = list(csv.DictReader(io.StringIO((run / "rounds.csv").read_text())))
    except OSError:
        return False
    return any(a not in ("", "0") for row in rows for a in (row.get("attempts") or "").split(";"))


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1][:200] if lines else "failed without a message"


def _compare(p: Point, out: Path, ref: Path, killed_at, left: int, seconds: float, note: str) -> Outcome:
    import torch

    from conftest import figures, weights

    try:
        a, b = weights(ref), weights(out)
        bitwise = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        mine = figures(out)
        steps = [(row[0], row[2]) for row in mine]
        once = len(steps) == len(set(steps))
        equal = mine == figures(ref)
    except (OSError, IndexError, ValueError) as e:
        bitwise = once = equal = False
        note = note or f"{type(e).__name__}: {e}"[:200]
    return Outcome(p, killed_at, bitwise, once, equal, left, round(seconds, 1), note)


def prepared(work: Path) -> str:
    """A small dataset (seq 32, BPE 300) from the bundled corpus's first 120 kB."""
    from importlib import resources

    text = "".join(f.read_text() for f in sorted(resources.files("sparklm").joinpath("corpus").iterdir())
                   if f.name.endswith(".txt"))[:120_000]
    (work / "text.txt").write_text(text)
    out = work / "data"
    r = subprocess.run([sys.executable, "-m", "sparklm", "prepare", str(work / "text.txt"), "-o", str(out),
                        "--seq-len", "32", "--vocab-size", "300", "--master", "local[2]", "--set", "spark.ui=false"],
                       capture_output=True, text=True, env={**os.environ, "SPARK_LOCAL_IP": "127.0.0.1"})
    if r.returncode:
        raise SystemExit(f"prepare failed:\n{r.stderr[-3000:]}")
    return str(out)


def campaign(points: int, seed: int, modes: list[str], strategies: list[str], work: Path,
             report=print, only: set[int] | None = None, data: str | None = None) -> list[Outcome]:
    """The outcomes of ``points`` kill points drawn with ``seed``; ``data``: a prepared dataset to train on (else one
    is prepared here from the bundled corpus)."""
    if "cluster" in modes:
        (work / "cluster").mkdir(exist_ok=True)
    cluster = Cluster(work / "cluster") if "cluster" in modes else None
    try:
        runs = Campaign(work, data or prepared(work), cluster)
        outcomes = []
        for i, p in enumerate(draw(random.Random(seed), points, modes, strategies)):
            if only is not None and i + 1 not in only:
                continue
            o = runs.run(i, p)
            outcomes.append(o)
            report(f"[{i + 1}/{points}] {p.strategy:7} {p.mode:7} kill {p.target:8} after step {p.step:2} "
                   f"(landed at {o.killed_at}): {'ok' if o.passed else 'FAILED'} in {o.seconds} s"
                   + (f" — {o.note}" if o.note else ""))
        return outcomes
    finally:
        if cluster is not None:
            cluster.stop()


def table(outcomes: list[Outcome]) -> str:
    """The markdown table for RELIABILITY.md: points by strategy, mode and target."""
    groups: dict[tuple, list[Outcome]] = collections.defaultdict(list)
    for o in outcomes:
        groups[(o.point.strategy, o.point.mode, o.point.target)].append(o)
    lines = ["| strategy | mode | killed | points | kill landed | bitwise equal | each step once | failures |",
             "|---|---|---|---|---|---|---|---|"]
    for (strategy, mode, target), group in sorted(groups.items()):
        failed = [o for o in group if not o.passed]
        causes = "; ".join(sorted({o.note or _cause(o) for o in failed})) or "none"
        lines.append(f"| {strategy} | {mode} | {target} | {len(group)} | "
                     f"{sum(o.killed_at is not None for o in group)} | {sum(o.bitwise for o in group)} | "
                     f"{sum(o.rows_once and o.rows_equal for o in group)} | {len(failed)}: {causes} |")
    return "\n".join(lines)


def _cause(o: Outcome) -> str:
    return ", ".join(what for what, bad in (("weights differ", not o.bitwise), ("a step twice", not o.rows_once),
                                            ("rows differ", not o.rows_equal), ("a process left", o.leftovers))
                     if bad)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--points", type=int, default=54)
    ap.add_argument("--seed", type=int, default=None, help="repeat a campaign (printed at its start)")
    ap.add_argument("--modes", default="local,cluster")
    ap.add_argument("--strategies", default=",".join(STRATEGIES))
    ap.add_argument("--json", default=None, help="also write every outcome here")
    ap.add_argument("--keep", action="store_true", help="keep the runs (their directory is printed)")
    ap.add_argument("--only", default=None, help="run only these points of the draw (numbers as printed: 4,14)")
    args = ap.parse_args()
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(10**6)
    print(f"kill campaign: seed {seed} (repeat with --seed {seed}), {args.points} points", flush=True)
    work = Path(tempfile.mkdtemp(prefix="kill-campaign-"))
    t0 = time.time()
    try:
        only = {int(n) for n in args.only.split(",")} if args.only else None
        outcomes = campaign(args.points, seed, args.modes.split(","), args.strategies.split(","), work,
                            report=lambda line: print(line, flush=True), only=only)
    finally:
        if args.keep:
            print(f"runs kept in {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    print(f"\n{sum(o.passed for o in outcomes)} of {len(outcomes)} points passed in {(time.time() - t0) / 60:.1f} "
          f"min (seed {seed})\n")
    print(table(outcomes))
    if args.json:
        Path(args.json).write_text(json.dumps([{**asdict(o), "passed": o.passed} for o in outcomes], indent=1))
    sys.exit(0 if all(o.passed for o in outcomes) else 1)


if __name__ == "__main__":
    main()
