"""Synchronous data parallelism: N Spark barrier tasks, each running one torch.distributed rank.

Each barrier task starts its rank as a child process (``python -m sparklm.train.strategies.ddp_rank``):
the rank's threads, memory and gloo teardown stay out of Spark's Python worker, and a rank that dies
takes its task down with it (and the barrier stage with it) instead of hanging. Rank 0's address is
shared with ``BarrierTaskContext.allGather``; rank 0 streams its metrics rows to the driver over a
socket (sinks.Channel). Launching 2 ranks this way took 3.6 s against 5.8 s / 12.9 s for
``TorchDistributor`` (local_mode True / False; benchmarks/launch_overhead.py), and rank 0's result
comes back directly.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
from collections import deque
from dataclasses import asdict, dataclass

from ...config import Config
from ...errors import SparklmError, spark_errors
from ...fs import local_path
from ..sinks import Channel, Sink
from .base import Job, RunResult

RESULT = "SPARKLM-RESULT "


@dataclass(frozen=True)
class RankStart:
    """What a rank process reads on stdin once the ranks have found each other."""

    job: str  # Job.to_json()
    rank: int
    world: int
    threads: int
    master_addr: str
    master_port: int
    channel: tuple[str, int, str]  # the driver's metrics channel: host, port, token


class DDP:
    name = "ddp"

    def describe(self, config: Config) -> str:
        n = config.train.workers
        return f"ddp, {n} worker{'s' * (n > 1)}"

    def run(self, spark, job: Job, sink: Sink) -> RunResult:
        channel = Channel(sink, _driver_host(spark))
        try:
            r = launch(spark, job, channel=(*channel.address, channel.token))
        finally:
            channel.close()
        # gloo has no counters: a ring all-reduce of the fp32 gradients per step sends 2·(N−1)/N of them
        # from each of the N ranks
        traffic = int(r["steps"] * 2 * (job.workers - 1) * 4 * (r.get("params") or 0))
        return RunResult(**{k: r[k] for k in ("steps", "tokens", "seconds", "params", "flops_per_token", "peak_flops",
                                              "dtype", "final")}, bytes_communicated=traffic)


def launch(spark, job: Job, *, channel: tuple[str, int, str]) -> dict:
    """Run ``job`` on ``job.workers`` ranks and return rank 0's result."""
    workers, threads = job.workers, job.threads
    local_run = local_path(job.run_dir)
    log_dir = str(local_run / "logs") if local_run is not None else os.path.join(tempfile.gettempdir(), "sparklm-logs",
                                                                                  job.uid)
    job_json = job.to_json()

    def task(_):
        from pyspark import BarrierTaskContext

        ctx = BarrierTaskContext.get()
        rank = ctx.partitionId()
        # Start the rank first: it imports torch and transformers (~4 s) while the ranks find each other.
        proc, log_path = _start_rank(log_dir, rank, threads)
        try:
            host = ctx.getTaskInfos()[rank].address.rsplit(":", 1)[0] or "127.0.0.1"
            port = _free_port(host) if rank == 0 else 0
            peers = [json.loads(m) for m in ctx.allGather(json.dumps({"host": host, "port": port}))]
            same_host = sum(p["host"] == host for p in peers)
            n_threads = threads or max(1, (os.cpu_count() or 1) // same_host)
            start = RankStart(job=job_json, rank=rank, world=workers, threads=n_threads,
                              master_addr=peers[0]["host"], master_port=peers[0]["port"], channel=channel)
            yield json.dumps(_finish_rank(proc, start, log_path))
        finally:
            if proc.poll() is None:
                proc.kill()

    rdd = spark.sparkContext.parallelize(range(workers), workers).barrier().mapPartitions(task)
    try:
        with spark_errors():
            results = [json.loads(r) for r in rdd.collect()]
    except SparklmError:
        raise
    except Exception as e:
        if "requires more slots than the total number" in str(e) or "BARRIER_SLOTS" in str(e).upper():
            raise SparklmError(f"--workers {workers} needs {workers} free Spark task slots at once",
                               hint="lower --workers, or give the cluster more cores (local[N], executors)") from None
        raise
    return next(r for r in results if r.get("rank") == 0)


def _driver_host(spark) -> str:
    if spark.sparkContext.master.startswith("local"):
        return "127.0.0.1"
    host = spark.sparkContext.getConf().get("spark.driver.host", "127.0.0.1")
    try:
        return socket.gethostbyname(host)
    except OSError:
        return host


def _start_rank(log_dir: str, rank: int, threads: int) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
    if threads:  # otherwise the rank sets its thread count once it knows how many ranks share the host
        env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    os.makedirs(log_dir, exist_ok=True)
    log_path = os.path.join(log_dir, f"rank-{rank}.log")
    with open(log_path, "ab") as log:
        proc = subprocess.Popen([sys.executable, "-m", "sparklm.train.strategies.ddp_rank"], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=log, env=env, preexec_fn=_die_with_parent)
    return proc, log_path


def _finish_rank(proc: subprocess.Popen, start: RankStart, log_path: str) -> dict:
    """Send the rank its start message, wait for it, and return its result (or raise its error)."""
    try:
        proc.stdin.write(json.dumps(asdict(start)).encode())
        proc.stdin.close()
    except BrokenPipeError:  # the rank died while importing; its log says why
        pass
    result = None
    for line in proc.stdout:
        text = line.decode(errors="replace").rstrip("\n")
        if text.startswith(RESULT):
            result = json.loads(text[len(RESULT):])
    code = proc.wait()
    if result is not None:
        return {**result, "rank": start.rank}
    raise SparklmError(_last_error(log_path) or f"training rank {start.rank} exited with code {code}",
                       hint=f"see {log_path}")


def _last_error(path: str) -> str | None:
    try:
        with open(path, errors="replace") as f:
            tail = deque(f, maxlen=50)
    except OSError:
        return None
    for line in reversed(tail):
        if line.startswith("error: "):
            return line[len("error: "):].strip()
    return None


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host if host not in ("localhost",) else "127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """Linux: the rank gets SIGKILL when its Spark task's process dies (a cancelled job leaves no orphans)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
