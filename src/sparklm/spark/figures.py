"""Spark's own figures for a block of work: jobs, stages, tasks, task and GC time, bytes read and shuffled, failed tasks
and retried stages, executors' peak memory.

:func:`window` tags the jobs a block starts; :func:`collect` reads what Spark recorded of them, from the UI's REST API
(every figure) or, with the UI off (``spark.ui.enabled=false``), from the status tracker (jobs, stages, tasks, failures
only). Both read the same status store, so they describe the same jobs; Spark keeps the last
``spark.ui.retainedJobs``/``retainedStages`` (1000 by default) of them. Best effort throughout: the figures are a
report's, and a run never fails for want of them. :func:`aggregate` is the pure part.
"""

from __future__ import annotations

import json
import time
import urllib.request
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

_GROUP = "spark.jobGroup.id"  # the local property behind SparkContext.setJobGroup


@dataclass(frozen=True)
class Window:
    """The jobs of one block: those of ``group`` that were not there before it started."""

    group: str
    before: frozenset[int]


@contextmanager
def window(spark) -> Iterator[Window | None]:
    """Tag the jobs the block starts on this thread, so that :func:`collect` finds them afterwards.

    The jobs go into a job group of their own, unless this thread already has one: a notebook's job group is what
    cancels its cell, so it is kept, and the jobs it held before the block are left out instead. Yields None where
    Spark cannot say (the figures are then left out)."""
    sc, own, found = None, False, None
    try:
        sc = spark.sparkContext
        group = sc.getLocalProperty(_GROUP)
        own = group is None
        group = group or f"sparklm-{uuid.uuid4().hex[:12]}"
        if own:
            sc.setLocalProperty(_GROUP, group)
        found = Window(group, frozenset(sc.statusTracker().getJobIdsForGroup(group)))
    except Exception:  # not a classic SparkContext, or its JVM is gone: no figures, the block runs all the same
        pass
    try:
        yield found
    finally:
        if own:
            try:
                sc.setLocalProperty(_GROUP, None)
            except Exception:  # the JVM is gone (its failure is what is being reported): nothing to reset
                pass


def collect(spark, jobs: Window | None, *, settle_s: float = 2.0) -> dict:
    """Spark's figures for the jobs of ``jobs`` (see :func:`aggregate`); {} when Spark cannot say."""
    if jobs is None:
        return {}
    try:
        sc = spark.sparkContext
        tracker = sc.statusTracker()
        ids = sorted(set(tracker.getJobIdsForGroup(jobs.group)) - jobs.before)
        # Spark's listener records a job's end a moment after the driver's call returns: wait for it, briefly
        deadline = time.monotonic() + settle_s
        while time.monotonic() < deadline and any(_status(tracker, j) == "RUNNING" for j in ids):
            time.sleep(0.05)
        stage_ids = {s for j in ids if (info := tracker.getJobInfo(j)) is not None for s in info.stageIds}
        rest = _from_rest(sc, stage_ids) if sc.uiWebUrl else None
        if rest is not None:
            return aggregate(rest[0], rest[1], jobs=len(ids), source="Spark UI REST API")
        stages = [_tracker_stage(info) for s in sorted(stage_ids) if (info := tracker.getStageInfo(s)) is not None]
        why = "the UI's REST API did not answer" if sc.uiWebUrl else "UI disabled"
        return aggregate(stages, [], jobs=len(ids), source=f"Spark status tracker ({why})")
    except Exception:  # best effort (a stopped context, an unexpected answer): the run goes on without them
        return {}


def _status(tracker, job: int) -> str:
    info = tracker.getJobInfo(job)
    return str(info.status) if info is not None else ""


def _tracker_stage(info) -> dict:
    """A status tracker's SparkStageInfo as the REST API's stage keys (the few it has)."""
    return {"stageId": info.stageId, "attemptId": info.currentAttemptId, "name": info.name, "numTasks": info.numTasks,
            "numCompleteTasks": info.numCompletedTasks, "numFailedTasks": info.numFailedTasks}


def _from_rest(sc, stage_ids: set[int], timeout: float = 5.0) -> tuple[list[dict], list[dict]] | None:
    """(the stage attempts of ``stage_ids``, every executor, dead ones included) from the UI's REST API; None when it
    does not answer (UI behind authentication or TLS, a proxy)."""
    base = f"{sc.uiWebUrl.rstrip('/')}/api/v1/applications/{sc.applicationId}"
    try:
        stages = _fetch_json(f"{base}/stages", timeout)
        executors = _fetch_json(f"{base}/allexecutors", timeout)
    except (OSError, ValueError):
        return None
    return [s for s in stages if s.get("stageId") in stage_ids], executors


def _fetch_json(url: str, timeout: float):
    with urllib.request.urlopen(url, timeout=timeout) as answer:
        return json.loads(answer.read())


# The sums over stage attempts: (key in the result, key of the REST API's StageData, scale to the result's unit)
_SUMS = (("task_seconds", "executorRunTime", 1e-3), ("cpu_seconds", "executorCpuTime", 1e-9),
         ("gc_seconds", "jvmGcTime", 1e-3), ("input_bytes", "inputBytes", 1), ("output_bytes", "outputBytes", 1),
         ("shuffle_read_bytes", "shuffleReadBytes", 1), ("shuffle_write_bytes", "shuffleWriteBytes", 1),
         ("spilled_bytes", "diskBytesSpilled", 1))
# Executors' peaks (REST API's peakMemoryMetrics; the Python figure needs spark.executor.processTreeMetrics.enabled)
_PEAKS = (("executor_peak_jvm_heap_bytes", "JVMHeapMemory"), ("executor_peak_jvm_off_heap_bytes", "JVMOffHeapMemory"),
          ("executor_peak_python_rss_bytes", "ProcessTreePythonRSSMemory"))


# What each figure of :func:`aggregate` is, for a reader: (key, label, unit: count | seconds | bytes | text)
FIELDS = (("source", "source", "text"), ("jobs", "jobs", "count"), ("stages", "stages", "count"),
          ("stage_attempts", "stage attempts", "count"), ("retried_stages", "stages retried", "count"),
          ("tasks", "tasks", "count"), ("failed_tasks", "failed tasks", "count"), ("killed_tasks", "killed tasks", "count"),
          ("task_seconds", "task time (executorRunTime)", "seconds"), ("cpu_seconds", "task CPU time (JVM threads)", "seconds"),
          ("gc_seconds", "JVM GC time", "seconds"), ("input_bytes", "input", "bytes"), ("output_bytes", "output", "bytes"),
          ("shuffle_read_bytes", "shuffle read", "bytes"), ("shuffle_write_bytes", "shuffle write", "bytes"),
          ("spilled_bytes", "spilled to disk", "bytes"), ("executors", "executors", "count"),
          ("executor_peak_jvm_heap_bytes", "executor peak JVM heap", "bytes"),
          ("executor_peak_jvm_off_heap_bytes", "executor peak JVM off-heap", "bytes"),
          ("executor_peak_python_rss_bytes", "executor peak Python RSS", "bytes"))


def aggregate(stages: list[dict], executors: list[dict], *, jobs: int | None = None, source: str = "") -> dict:
    """Totals over stage attempts (dicts with the REST API's StageData keys; skipped stages, which ran nothing, left
    out) and executors (ExecutorSummary's keys). A figure the source does not give is absent, not 0; an executor peak
    Spark has not sampled yet (its first heartbeat, 10 s in) is absent too."""
    ran = [s for s in stages if s.get("status") != "SKIPPED"]
    out: dict = {"source": source} if source else {}
    if jobs is not None:
        out["jobs"] = jobs
    attempts: dict[int, int] = {}
    for s in ran:
        attempts[s["stageId"]] = max(attempts.get(s["stageId"], 0), s.get("attemptId", 0))
    out.update(stages=len(attempts), stage_attempts=len(ran), retried_stages=sum(a > 0 for a in attempts.values()),
               tasks=sum(s.get("numTasks", 0) for s in ran),
               failed_tasks=sum(s.get("numFailedTasks", 0) for s in ran))
    if any("numKilledTasks" in s for s in ran):
        out["killed_tasks"] = sum(s.get("numKilledTasks", 0) for s in ran)
    for key, field, scale in _SUMS:
        if any(field in s for s in ran):
            out[key] = sum(s.get(field, 0) for s in ran) * scale
    if executors:
        # local mode: the driver is the executor; on a cluster, the driver's own peak is not an executor's
        workers = [e for e in executors if e.get("id") != "driver"] or executors
        out["executors"] = len(workers)
        for key, field in _PEAKS:
            peak = max(((e.get("peakMemoryMetrics") or {}).get(field, 0) for e in workers), default=0)
            if peak:
                out[key] = peak
    return out
