"""Synchronous data parallelism: N Spark barrier tasks, each running one torch.distributed rank.

Each barrier task starts its rank as a child process (``python -m sparklm.strategies.ddp_rank``):
the rank's threads, memory and gloo teardown stay out of Spark's Python worker, and a rank that dies
takes its task down with it (and the barrier stage with it) instead of hanging. Rank 0's address is
shared with ``BarrierTaskContext.allGather`` (with peers to tell): rank 0's task binds the store's port
before it publishes it and hands the socket to its rank, so no other process can take the port in between.
Rank 0 streams its metrics rows to the driver over a socket (metrics.sinks.Channel). Launching 2 ranks
this way took 3.6 s against 5.8 s / 12.9 s for ``TorchDistributor`` (local_mode True / False;
benchmarks/launch_overhead.py), and rank 0's result comes back directly.

In local mode the ranks' processes start before Spark does (``DDP.prestart``): they import torch and
transformers (~3 s) while the JVM starts, then wait on a Unix socket; each barrier task takes one
over (the warm process forks the rank for it, with the task's socket as stdin and stdout, and sends
back its exit status), or starts a fresh one when none is left (a restart).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from contextlib import contextmanager
from pathlib import Path

from ..config import Config
from ..infra import progress
from ..infra.errors import SparklmError, killed_note, known_cause, spark_errors
from ..infra.fs import join, local_path, read_text, write_bytes
from ..metrics.sinks import Channel, Sink
from ..spark.resources import gpu_slots, task_gpu
from ..spark.session import LEAN_ADDRESS_SPACE, process_limit
from ..train import checkpoint
from ..train.device import Device
from .base import Job, RankStart, RunResult

RESULT = "SPARKLM-RESULT "


class DDP:
    name = "ddp"

    def describe(self, config: Config) -> str:
        n = config.train.workers
        return f"ddp, {n} worker{'s' * (n > 1)}"

    @contextmanager
    def prestart(self, config: Config, master: str):
        """Local mode: one warm rank process per worker, started now (see the module docstring)."""
        tc = config.train
        if not master.startswith("local") or not WARM_RANKS:
            yield ()
            return
        threads = tc.threads  # decided on the driver (resolve.threads) before prestart
        where = tempfile.mkdtemp(prefix="sparklm-warm-")
        procs, paths = [], []
        try:
            for r in range(tc.workers):
                path = os.path.join(where, f"rank-{r}.sock")
                with socket.socket(socket.AF_UNIX) as listener:
                    listener.bind(path)
                    listener.listen(1)
                    procs.append(subprocess.Popen(
                        [sys.executable, "-m", "sparklm.strategies.ddp_rank", "--warm", str(listener.fileno())],
                        pass_fds=(listener.fileno(),), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                        stderr=subprocess.DEVNULL, env=_rank_env(threads), preexec_fn=die_with_parent))
                paths.append(path)
            yield tuple(paths)
        finally:
            for proc in procs:  # a warm process exits by itself once its rank has; an unused one waits
                if proc.poll() is None:
                    proc.kill()
                proc.wait()
            shutil.rmtree(where, ignore_errors=True)

    def check(self, spark, plan) -> None:
        tc = plan.config.train
        check_slots(spark, min(tc.workers_min or tc.workers, tc.workers), plan.device)

    def run(self, spark, job: Job, sink: Sink) -> RunResult:
        full = job.plan  # an elastic run's plan at its most workers: every attempt is sized from it
        job = sized(spark, job, full, START_WAIT)
        channel = Channel(sink, _driver_host(spark))
        restarts = job.config.train.ddp.max_restarts
        before = None  # the last restart's (cause, checkpoint step, ranks)
        leaving: set[str] = set()  # executors seen decommissioning (each asks the ranks to leave once)
        try:
            for attempt in range(restarts + 1):
                channel.attempt()
                try:
                    with _watch_decommission(spark, channel, leaving, elastic=bool(full.config.train.workers_min)):
                        r = launch(spark, job, channel=(*channel.address, channel.token))
                    break
                except Exception as e:
                    lost = lost_cause(e)
                    if lost is None and full.config.train.workers_min and SHORT in str(e):
                        # an elastic run sized itself before Spark had counted an executor's loss
                        lost = "Spark has fewer task slots than ranks now"
                    if lost is None:
                        raise
                    left = channel.left(wait=PEER_GRACE)
                    if left is not None:  # the ranks stopped as asked, whichever failure Spark reported first
                        from ..train.loop import Leaving  # (torch: the driver imports it only here)

                        lost = f"the training ranks are {Leaving(left)}"
                    fatal = _fatal_cause(job)  # a peer's loss may be the echo of a rank's own error
                    if fatal is not None:
                        raise fatal from None
                    if attempt == restarts:
                        raise SparklmError(f"{lost} (after {restarts} restart{'s' * (restarts != 1)} from the last "
                                           "checkpoint)", hint="see the ranks' logs; raise train.ddp.max_restarts, or "
                                           "continue later with --resume") from None
                    step = _restart_step(job)
                    was = job.workers
                    job = dataclasses.replace(sized(spark, job, full, RESTART_WAIT), resume=True)
                    if before == (lost, step, job.workers):  # the same loss again before any new checkpoint
                        raise SparklmError(f"{lost}, again before the checkpoint after step {step}",
                                           hint="see the ranks' logs; a rank that runs out of memory at the same step "
                                                "needs more memory or a smaller batch") from None
                    before = (lost, step, job.workers)
                    ranks = f" on {job.workers} ranks (was {was})" if job.workers != was else ""
                    progress.warn(f"{lost}; restarting the ranks from "
                                  f"{f'the checkpoint of step {step}' if step else 'the start'}{ranks} "
                                  f"(restart {attempt + 1} of {restarts})")
                    sink.rewind(step)  # the steps after the checkpoint run again: their rows come again
        finally:
            channel.close()
        if channel.error is not None:
            raise channel.error
        # gloo has no counters: a ring all-reduce of the fp32 gradients per step sends 2·(N−1)/N of them from each
        # of the N ranks (only the trainable ones: with LoRA, the adapters'; an elastic run: at its last size).
        # Sharded (FSDP2): every weight all-gathered for the forward and again for the backward, (N−1)/N each, and
        # the gradients reduce-scattered, (N−1)/N, at every micro-batch (counted at 4 bytes a value)
        n = job.workers
        if job.config.train.parallel == "shard":
            micro = job.config.train.grad_accum
            traffic = int(r.steps * micro * (n - 1) * 4 * (2 * (r.params or 0) + (r.trainable_params or r.params or 0)))
        else:
            traffic = int(r.steps * 2 * (n - 1) * 4 * (r.trainable_params or r.params or 0))
        return dataclasses.replace(r, bytes_communicated=traffic)


@contextmanager
def _watch_decommission(spark, channel: Channel, seen: set[str], *, elastic: bool, every: float = 1.0):
    """While the ranks run: once Spark starts decommissioning an executor not ``seen`` before, ask the ranks to
    checkpoint and stop (Channel.ask_to_leave), so that an elastic run restarts on the executors that stay having
    lost no step; a run of fixed size waits for the executor to go."""
    if not elastic:
        yield
        return
    from ..spark.resources import decommissioning

    stop = threading.Event()

    def watch() -> None:
        new = set()
        while not stop.wait(every):
            new |= decommissioning(spark) - seen
            if new:  # again at every poll until the attempt ends: rank 0 may connect after the first
                channel.ask_to_leave()
        seen.update(new)

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    try:
        yield
    finally:
        stop.set()
        t.join()


SHORT = "free Spark task slots at once"  # a barrier stage that Spark cannot run: too few slots
START_WAIT, RESTART_WAIT = 30.0, 10.0  # seconds an elastic run waits for its most ranks' slots (executors joining)


def sized(spark, job: Job, full, wait: float) -> Job:
    """``job`` on as many ranks as Spark can run at once: ``full`` (the plan at ``train.workers``) for a run of fixed
    size, which needs every slot (one line if they are not there); an elastic run (``train.workers_min``) waits up to
    ``wait`` seconds (none in local mode) for the slots of its most ranks, then takes the most it can run, keeping
    the global batch (RunPlan.at)."""
    from ..train.plan import elastic_world, world_for

    tc = full.config.train
    if not tc.workers_min or tc.workers_min >= tc.workers:
        check_slots(spark, tc.workers, full.device)
        return dataclasses.replace(job, plan=full)
    check_slots(spark, tc.workers_min, full.device)  # the fewest, or one line (a cluster: after executors register)
    deadline = time.time() + (0.0 if re.match(r"local(\[|$)", spark.sparkContext.master) else wait)
    while elastic_world(full, slots := available(spark, full.device)) != tc.workers and time.time() < deadline:
        time.sleep(1.0)
    plan = world_for(full, slots)
    return dataclasses.replace(job, plan=plan)


def launch(spark, job: Job, *, channel: tuple[str, int, str]) -> RunResult:
    """Run ``job`` on ``job.workers`` ranks and return rank 0's result."""
    workers, threads = job.workers, job.threads  # threads: decided on the driver (resolve.threads)
    local_run = local_path(job.run_dir)
    # a run directory elsewhere: each host's own private directory, found where the task runs
    log_dir = str(local_run / "logs") if local_run is not None else None
    job_json = job.to_json()
    # where rank 0 serves the ranks' store (ddp_rank.join_group): loopback when every rank runs on this host
    loopback = spark.sparkContext.master.startswith("local")

    def task(_):
        from pyspark import BarrierTaskContext

        ctx = BarrierTaskContext.get()
        rank = ctx.partitionId()
        host = "127.0.0.1" if loopback else ctx.getTaskInfos()[rank].address.rsplit(":", 1)[0] or "127.0.0.1"
        # rank 0's store: bound (port 0) and listening before its port is published, then its rank's alone
        store = store_listener(host) if rank == 0 and workers > 1 else None
        port = store.getsockname()[1] if store else 0
        try:
            # Start the rank first: it imports torch and transformers (~3 s) while the ranks find each other.
            proc, log_path = _start_rank(log_dir or str(rank_log_dir(job.uid)), rank, threads, job.warm[rank] if len(job.warm) > rank else "",
                                         store=store)
        finally:
            if store:
                store.close()  # the rank holds its own copy
        try:
            if workers > 1:
                peers = [json.loads(m) for m in ctx.allGather(json.dumps({"host": host, "port": port}))]
            else:  # no peers to find (and a barrier call costs about a second: Spark 4 polls once a second)
                peers = [{"host": host, "port": 0}]
            gpu = task_gpu(ctx)
            start = RankStart(job=job_json, rank=rank, world=workers, threads=threads,
                              master_addr=peers[0]["host"], master_port=peers[0]["port"], channel=channel, gpu=gpu)
            yield rank, (gpu, _finish_rank(proc, start, log_path).to_json())
        finally:
            if proc.poll() is None:
                proc.kill()
            if local_run is None:  # the run directory is on an object store: the log goes there too
                _publish_log(log_path, join(job.run_dir, "logs", f"rank-{rank}.log"), job.config.storage)

    rdd = spark.sparkContext.parallelize(range(workers), workers).barrier().mapPartitions(task)
    try:
        with spark_errors():
            results = dict(rdd.collect())
    except SparklmError:
        raise
    except Exception as e:
        if "requires more slots than the total number" in str(e) or "BARRIER_SLOTS" in str(e).upper():
            raise SparklmError(f"--workers {workers} needs {workers} {SHORT}",
                               hint="lower --workers, or give the cluster more cores (local[N], executors)") from None
        raise
    gpus = [results[r][0] for r in range(workers)]
    return dataclasses.replace(RunResult.from_json(results[0][1]), gpus=gpus if any(gpus) else [])


def _publish_log(path: str, uri: str, storage) -> None:
    try:
        with open(path, "rb") as f:
            write_bytes(uri, f.read(), storage)
    except OSError:
        pass  # the log is a convenience; the error line has already reached the driver


def _driver_host(spark) -> str:
    if spark.sparkContext.master.startswith("local"):
        return "127.0.0.1"
    host = spark.sparkContext.getConf().get("spark.driver.host", "127.0.0.1")
    try:
        return socket.gethostbyname(host)
    except OSError:
        return host


def _rank_env(threads: int) -> dict[str, str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
    if threads:  # otherwise the rank sets its thread count once it knows how many ranks share the host
        env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    return env


def _start_rank(log_dir: str, rank: int, threads: int, warm: str = "",
                store: socket.socket | None = None) -> tuple[subprocess.Popen | WarmRank, str]:
    """Start rank ``rank``'s process (a warm one's fork where there is one), handing it ``store``, the listening
    socket it serves the ranks' store on (rank 0's)."""
    os.makedirs(log_dir, exist_ok=True)
    log_path = os.path.join(log_dir, f"rank-{rank}.log")
    with open(log_path, "ab") as log:
        log.write(f"{START_MARK} {time.strftime('%Y-%m-%d %H:%M:%S')}\n".encode())  # a restart appends to the log
        log.flush()
        limited = process_limit() is not None  # this task's address-space limit binds the rank too
        if warm and not limited and (taken := WarmRank.take(warm, log_path, store=store)) is not None:
            return taken, log_path
        env = _rank_env(threads)
        if limited:
            env.update(LEAN_ADDRESS_SPACE)
        if store is not None:
            env[STORE_FD] = str(store.fileno())
        proc = subprocess.Popen([sys.executable, "-m", "sparklm.strategies.ddp_rank"], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=log, env=env, preexec_fn=die_with_parent,
                                pass_fds=(store.fileno(),) if store is not None else ())
    return proc, log_path


WARM_RANKS = os.environ.get("SPARKLM_WARM_RANKS", "1") != "0"  # off: every task starts a fresh rank process
WARM_PID, WARM_EXIT = b"SPARKLM-WARM-PID ", b"SPARKLM-WARM-EXIT "
STORE_FD = "SPARKLM_STORE_FD"  # rank 0's environment: the store's listening socket (ddp_rank.join_group's listen_fd)


class WarmRank:
    """A rank forked for this task by a warm process (``ddp_rank --warm``), with the parts of ``Popen``'s interface
    the task uses: ``stdin`` (the start message), ``stdout`` (the rank's lines), ``wait``, ``poll``, ``kill``."""

    def __init__(self, sock: socket.socket, pid: int, lines):
        self.sock, self.pid, self.lines, self.returncode = sock, pid, lines, None
        self.stdin = self

    @classmethod
    def take(cls, path: str, log_path: str, wait: float = 120.0, store: socket.socket | None = None) -> WarmRank | None:
        """The warm process at ``path`` forks a rank logging to ``log_path`` (and serving the store on ``store``,
        passed with the header); None when it is gone (taken by an earlier attempt, or dead): the task then starts a
        fresh process."""
        sock = socket.socket(socket.AF_UNIX)
        try:
            sock.settimeout(wait)  # the warm process answers once its imports are done
            sock.connect(path)
            header = json.dumps({"log": log_path}).encode() + b"\n"
            sent = socket.send_fds(sock, [header], [store.fileno()]) if store is not None else 0
            sock.sendall(header[sent:])
            lines = sock.makefile("rb")
            first = lines.readline(64)  # "SPARKLM-WARM-PID N": no more is read before it is checked
            sock.settimeout(None)
        except OSError:
            sock.close()
            return None
        if not first.startswith(WARM_PID):
            sock.close()
            return None
        return cls(sock, int(first[len(WARM_PID):]), lines)

    def write(self, data: bytes) -> None:
        self.sock.sendall(data)

    def close(self) -> None:  # the end of the start message: the rank reads its stdin to the end
        self.sock.shutdown(socket.SHUT_WR)

    @property
    def stdout(self):
        for line in self.lines:
            if line.startswith(WARM_EXIT):
                self.returncode = int(line[len(WARM_EXIT):])
            else:
                yield line

    def wait(self) -> int:
        for _ in self.stdout:
            pass
        if self.returncode is None:  # the warm process itself died: its rank with it
            self.returncode = -signal.SIGKILL
        self.sock.close()
        return self.returncode

    def poll(self) -> int | None:
        return self.returncode

    def kill(self) -> None:
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _finish_rank(proc: subprocess.Popen | WarmRank, start: RankStart, log_path: str) -> RunResult:
    """Send the rank its start message, wait for it, and return its result (or raise its error)."""
    try:
        proc.stdin.write(start.to_json().encode())
        proc.stdin.close()
    except (BrokenPipeError, ConnectionResetError):  # the rank died while importing; its log says why
        pass
    result = None
    for line in proc.stdout:
        text = line.decode(errors="replace").rstrip("\n")
        if text.startswith(RESULT):
            result = RunResult.from_json(text[len(RESULT):])
    code = proc.wait()
    if result is not None:
        return result
    error = _last_error(log_path)
    if error is not None:  # the rank said what went wrong (bad input, disk full, …): running again would not help
        if lost_cause(error) is not None:
            # "a peer stopped": the peer's own failure is the news. Spark reports a barrier stage's first failed
            # task and kills the others, so a moment's wait lets the rank that died be the one named.
            time.sleep(PEER_GRACE)
        raise SparklmError(error.message, hint="; ".join(filter(None, [error.hint, f"see {log_path}"])))
    how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
    cause = known_cause(_tail(log_path))
    why = cause[0] if cause else ("out of memory, or stopped from outside" if code in (-9, 137) else "see its log")
    raise SparklmError(f"{LOST} {start.rank} on {socket.gethostname()} {how} ({why})", hint=f"see {log_path}")


def available(spark, dev: Device) -> int:
    """Ranks this Spark can run at once now: its task slots, and its GPUs where the ranks use them."""
    slots = dev.slots(spark)
    return min(slots, gpu_slots(spark)) if _uses_gpus(spark, dev) else slots


def _uses_gpus(spark, dev: Device) -> bool:
    # GPUs bound the ranks where they compute on them, or where Spark hands each task some (it then holds a
    # barrier stage until it can hand them all out)
    return dev.kind == "cuda" or float(spark.sparkContext.getConf().get("spark.task.resource.gpu.amount", "0")) > 0


def check_slots(spark, workers: int, dev: Device, wait: float = 30.0) -> None:
    """DDP needs ``workers`` task slots at once: say so in one line before submitting, instead of letting the
    barrier stage wait (Spark retries its slot check for minutes). On a cluster, executors that are still
    registering get ``wait`` seconds."""
    deadline = time.time() + wait
    local = re.match(r"local(\[|$)", spark.sparkContext.master) is not None  # (not local-cluster: it has executors)
    uses_gpus = _uses_gpus(spark, dev)
    while True:
        slots = dev.slots(spark)
        gpus = gpu_slots(spark) if uses_gpus else None
        if slots >= workers and (gpus is None or gpus >= workers):
            return
        if gpus is not None and gpus < workers and (local or time.time() > deadline):
            raise SparklmError(f"--workers {workers} needs {workers} GPUs at once, one per rank; this Spark can "
                               f"hand out {gpus}", hint="lower --workers, or give Spark more GPUs (executors with "
                               "spark.executor.resource.gpu.amount; docs/gpus.md)")
        if local or time.time() > deadline:
            raise SparklmError(f"--workers {workers} needs {workers} free Spark task slots at once; this Spark "
                               f"has {slots}", hint="lower --workers, or give Spark more cores (local[N], more "
                               "executors), or use --strategy average/diloco, which needs no slots at once")
        time.sleep(1.0)


PEER_GRACE = 3.0  # seconds a rank that lost its peer waits before failing its task (see _finish_rank)
LOST = "training rank"  # "training rank N on HOST killed by …": a lost rank, which a restart may cure


def lost_cause(e: Exception) -> str | None:
    """The one-line description of a lost rank or executor in ``e`` (a restart may cure it), else None."""
    if isinstance(e, SparklmError):
        # a rank that died, or one that lost its peer (a dead or stuck rank): a restart may cure both
        m = re.match(rf"{LOST} \d+ on \S+ (killed by|exited with code)|{LOST} \d+ on \S+: (a peer rank stopped|leaving)",
                     e.message)
        return e.message if m else None
    text = str(e)
    if "ExecutorLostFailure" in text or "Python worker exited unexpectedly" in text or "TaskKilled" in text:
        note = killed_note(text)
        return "a Spark executor running a training rank was lost" + (f" ({note})" if note else "")
    return None


def _fatal_cause(job: Job) -> SparklmError | None:
    """The error a rank of the failed attempt reported that no restart can cure (disk full, a damaged input, a bad
    setting), from the ranks' logs the driver can read (local mode, a shared mount, an object store); None if none
    did (a rank killed from outside, a lost executor: those a restart may cure)."""
    for rank in range(job.workers):
        err = _last_error_text(_rank_log_text(job, rank))
        if err is not None and lost_cause(err) is None:
            return err
    return None


def _rank_log_text(job: Job, rank: int) -> str:
    local = local_path(job.run_dir)
    try:
        if local is not None:
            return (local / "logs" / f"rank-{rank}.log").read_text(errors="replace")
        return read_text(join(job.run_dir, "logs", f"rank-{rank}.log"), job.config.storage)
    except (OSError, UnicodeDecodeError):
        return ""


def _restart_step(job: Job) -> int:
    found = checkpoint.newest_readable(join(job.run_dir, "checkpoints"),
                                       lambda p: checkpoint.read_state(p, job.config.storage), job.config.storage)
    return found["step"] if found else 0


START_MARK = "--- sparklm rank started"


def _tail(path: str) -> str:
    """The last lines the latest start of a rank wrote to its log."""
    try:
        with open(path, errors="replace") as f:
            lines = list(deque(f, maxlen=200))
    except OSError:
        return ""
    starts = [i for i, line in enumerate(lines) if line.startswith(START_MARK)]
    return "".join(lines[starts[-1] + 1 if starts else 0:][-50:])


def _last_error(path: str) -> SparklmError | None:
    return _last_error_text(_tail(path))


def _last_error_text(log: str) -> SparklmError | None:
    """The ``error:`` line the latest start of a rank wrote (its log holds every start of it)."""
    for line in reversed(log.rsplit(START_MARK, 1)[-1].splitlines()):
        if line.startswith("error: "):
            return SparklmError.from_line(line)
    return None


def store_listener(host: str) -> socket.socket:
    """A socket listening on a port of ``host`` that the system chose and that stays bound until the ranks' store
    closes it: choosing a free port, releasing it and binding it again would let another process take it between
    the two (and serve the ranks' store itself)."""
    return socket.create_server((host if host not in ("localhost",) else "127.0.0.1", 0))


def die_with_parent() -> None:
    """Linux: this process gets SIGKILL when its parent dies — a rank when its Spark task's process does (a
    cancelled job leaves no orphans), a warm rank process when the driver does, a rank forked by a warm
    process when that one does."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def rank_log_dir(job_uid: str) -> Path:
    """Where a run whose directory is not on this host's disk keeps its ranks' logs on this host: this user's own
    directory (they are read back for the ranks' errors, so no other user may write them; nor read them)."""
    from ..infra.private import host_dir

    return host_dir("logs", job_uid)
