"""Spark's resources: which GPU a task was handed, how many GPU tasks Spark can run at once, and which executors
Spark is decommissioning.

Spark schedules GPUs as a custom resource (``spark.executor.resource.gpu.amount``, ``spark.task.resource.gpu.amount``,
a discovery script on each worker), as TorchDistributor and RAPIDS use it; local mode schedules none, so there a
process takes the GPUs its machine has. Torch-free.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path


def cuda_gpus() -> int:
    """CUDA GPUs this process sees. A CPU build of torch (its version.py says ``cuda = None``) answers 0 without
    being imported: the driver of a CPU run never imports torch (~1 s before the run starts)."""
    spec = importlib.util.find_spec("torch")
    if spec is None or spec.origin is None:
        return 0
    try:
        if re.search(r"^cuda\s*(:[^=]*)?=\s*None", (Path(spec.origin).parent / "version.py").read_text(), re.M):
            return 0
    except OSError:
        pass
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def task_gpu(ctx=None) -> str | None:
    """The GPU address Spark assigned the running task (``ctx``: its TaskContext; None: the current one), or None:
    one GPU per task, as TorchDistributor places them; a task given several computes on the first."""
    if ctx is None:
        from pyspark import TaskContext

        ctx = TaskContext.get()
        if ctx is None:  # not in a Spark task (the driver, a test)
            return None
    res = ctx.resources().get("gpu")
    return res.addresses[0] if res is not None and res.addresses else None


def check_batching(batch_size: int, threads: int) -> None:
    """A task's batch size and torch threads, refused on the driver: in every task they would fail (a negative
    thread count) or be taken as another (a batch of 0)."""
    from ..infra.errors import SparklmError

    if batch_size < 1:
        raise SparklmError(f"--batch-size must be >= 1 (got {batch_size})")
    check_threads(threads)


def check_threads(threads: int) -> None:
    """torch threads: 0 (every core) or more; torch refuses a negative count with a traceback."""
    from ..infra.errors import SparklmError

    if threads < 0:
        raise SparklmError(f"--threads must be >= 0 (0: every core; got {threads})")


def task_device(setting: str = "auto") -> str:
    """Where an inference task computes: with ``setting`` auto, the GPU Spark assigned it ("cuda:N"), else auto
    (the one torch sees, if any: local mode); an explicit setting as it is."""
    if setting != "auto":
        return setting
    gpu = task_gpu()
    return f"cuda:{gpu}" if gpu is not None and gpu.isdigit() else "auto"


def gpu_slots(spark) -> int:
    """GPU tasks Spark can run at once: per executor, spark.executor.resource.gpu.amount ÷
    spark.task.resource.gpu.amount; in local mode (no resource scheduling) this machine's GPUs."""
    sc = spark.sparkContext
    conf = sc.getConf()
    if re.match(r"local(\[|$)", sc.master):
        return cuda_gpus()
    task = float(conf.get("spark.task.resource.gpu.amount", "0") or 0)
    per_executor = float(conf.get("spark.executor.resource.gpu.amount", "0") or 0)
    if task <= 0 or per_executor <= 0:
        return 0
    # the driver is listed among the executors' infos, except in local mode (handled above)
    executors = max(0, len(sc._jsc.sc().statusTracker().getExecutorInfos()) - 1)
    return executors * int(per_executor // task + 1e-9)


def decommissioning(spark) -> set[str]:
    """The ids of this application's executors that Spark is decommissioning (``spark.decommission.enabled``: a
    SIGPWR to the executor, as Kubernetes sends before a pod goes, a spot notice, a YARN graceful decommission): their
    running tasks may finish, and no new task goes to them. Asked through py4j (PySpark has no API for it); a Spark
    without these methods answers none."""
    try:
        sc = spark.sparkContext._jsc.sc()
        scheduler = sc.taskScheduler()
        ids = [i for i in sc.getExecutorIds().mkString(",").split(",") if i]
        return {i for i in ids if scheduler.getExecutorDecommissionState(i).isDefined()}
    except Exception:  # (py4j errors, a stopped context): nothing known to be leaving
        return set()
