"""Elastic training (issue 54) on a standalone cluster from the pyspark package: hosts that come and go mid-run.

DDP started with ``--workers 1:2`` on two 1-core workers loses one whole worker (its JVM, executor, Python workers
and rank) after a checkpoint: the ranks restart from that checkpoint on the one slot left, keeping the global batch
by accumulating twice as many micro-batches, and the run ends with every step once, the planned tokens and the
losses of the uninterrupted two-rank run. DiLoCo re-counts the slots before every round: a host taken away and a
new one added mid-run change the workers of the next rounds, never the tokens of a round.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import add_worker, decommission, kill_tree, start_standalone, stop_processes
from sparklm.config import from_dict
from sparklm.launch.train import train
from sparklm.metrics.sinks import read_metrics

pytestmark = [pytest.mark.cluster, pytest.mark.xdist_group("standalone")]

SETTINGS = {"model": {"n_layer": 1, "n_head": 2, "n_embd": 32},
            "train": {"batch_size": 4, "max_steps": 16, "checkpoint_every": 4, "log_every": 1, "eval_every": 0,
                      "eval_batches": 2, "samples": 0, "threads": 1, "dtype": "float32"}}


def _flags(settings: dict = SETTINGS) -> list[str]:
    out = []
    for table, values in settings.items():
        for k, v in values.items():
            out += ["--set", f"{table}.{k}={v}" if not isinstance(v, str) else f'{table}.{k}="{v}"']
    return out


def _launch(dataset: str, run, url: str, settings: dict = SETTINGS, *extra: str) -> subprocess.Popen:
    """``sparklm train --workers 1:2`` on the cluster at ``url``, its progress lines readable from ``stderr``."""
    args = [sys.executable, "-m", "sparklm", "train", "--data", dataset, "-o", str(run), "--workers", "1:2",
            "--master", url, "--conf", "spark.executor.memory=1g", "--conf", "spark.ui.enabled=false",
            *extra, *_flags(settings)]
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "SPARK_LOCAL_IP": "127.0.0.1"})


def test_ddp_goes_on_with_fewer_ranks_when_a_worker_dies_keeping_the_global_batch(spark, dataset, tmp_path):
    reference = tmp_path / "reference"  # uninterrupted, two ranks (local mode)
    train(dataset, output=str(reference), spark=spark,
          config=from_dict({**SETTINGS, "train": {**SETTINGS["train"], "workers": 2}}))
    want = [r for r in read_metrics(reference / "metrics.csv") if r["kind"] == "train"]

    (tmp_path / "cluster").mkdir()
    procs, url, _ = start_standalone(tmp_path / "cluster")
    try:
        run = tmp_path / "run"
        # rank 1 stops after step 6 (its first launch only), so that the host goes while the run is in flight
        job = _launch(dataset, run, url, SETTINGS,
                      "--conf", "spark.executorEnv.SPARKLM_INJECT_RANK_FAULT=rank=1,step=6,at=hang")
        deadline = time.time() + 300
        while not (run / "checkpoints" / "step-0000004").exists():
            assert job.poll() is None and time.time() < deadline, job.communicate()[1][-3000:]
            time.sleep(0.2)
        time.sleep(1.0)
        t_kill = time.time()
        kill_tree(procs[2].pid)  # one host gone for good: the worker, its executor and its rank (either)
        out, err = job.communicate(timeout=600)
        assert job.returncode == 0, err[-3000:]
    finally:
        stop_processes(procs)
    assert "on 1 ranks (was 2)" in err, err[-3000:]
    assert "Traceback" not in err
    got = [r for r in read_metrics(run / "metrics.csv") if r["kind"] == "train"]
    assert [r["step"] for r in got] == list(range(1, 17))  # every step once: the rows after the checkpoint rewound
    assert {r["workers"] for r in got[:4]} == {2} and {r["workers"] for r in got[-4:]} == {1}
    assert got[-1]["tokens"] == want[-1]["tokens"]  # the token budget kept: the same global batch every step
    # the same batches in the same order, the gradient summed in another order: the losses of the uninterrupted run
    assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in want], rel=1e-3)
    print(f"resized after the kill in {time.time() - t_kill:.1f}s")


def test_diloco_rounds_run_on_the_workers_there_are_as_hosts_leave_and_join(spark, dataset, tmp_path):
    settings = {"model": SETTINGS["model"],
                "train": {**SETTINGS["train"], "max_steps": 80, "checkpoint_every": 0, "strategy": "diloco"},
                "train.rounds": {"sync_every": 2}}
    reference = tmp_path / "reference"  # two workers all along (local mode)
    train(dataset, output=str(reference), spark=spark,
          config=from_dict({"model": settings["model"], "train": {**settings["train"], "workers": 2,
                                                                  "rounds": settings["train.rounds"]}}))
    want = [r for r in read_metrics(reference / "metrics.csv") if r["kind"] == "train"]

    work = tmp_path / "cluster"
    work.mkdir()
    procs, url, _ = start_standalone(work)
    try:
        run = tmp_path / "run"
        job = _launch(dataset, run, url, settings)
        lines = []
        for line in job.stderr:  # the progress lines: a train row per round
            lines.append(line)
            if "| step 10/" in line:
                kill_tree(procs[2].pid)  # a host gone
            if "| step 14/" in line:
                procs.append(add_worker(work, url, "w-added"))  # a host joins
        job.wait(timeout=600)
        err = "".join(lines)
        assert job.returncode == 0, err[-3000:]
    finally:
        stop_processes(procs)
    assert "Traceback" not in err
    got = [r for r in read_metrics(run / "metrics.csv") if r["kind"] == "train"]
    assert [r["step"] for r in got] == list(range(2, 82, 2))  # a row per round, each once
    workers = [r["workers"] for r in got]
    assert workers[:4] == [2] * 4 and 1 in workers[5:12] and workers[-1] == 2, workers
    assert got[-1]["tokens"] == want[-1]["tokens"]  # the token budget kept
    # a round on one worker takes the whole global batch in larger inner steps (no drift between workers to
    # average away): the held-out figure is no worse than the two-worker run's
    bpb = [[r["val_bpb"] for r in read_metrics(d / "metrics.csv") if r["kind"] == "eval"][-1] for d in (run, reference)]
    print("workers per round:", workers, "val bits/byte", bpb[0], "uninterrupted", bpb[1])
    assert bpb[0] <= bpb[1] * 1.01
    from sparklm.metrics.html_report import write_report

    html = Path(write_report(str(run))).read_text()
    assert "workers training" in html  # the report draws the world size over time


def test_ddp_checkpoints_and_goes_on_smaller_when_an_executor_is_decommissioned(spark, dataset, tmp_path):
    """Graceful: one worker is told to leave (SIGPWR) and Spark decommissions its executor; the driver asks the ranks
    to checkpoint at their next step and restarts them on the slot that stays, losing no step's work."""
    settings = {"model": SETTINGS["model"], "train": {**SETTINGS["train"], "max_steps": 200, "checkpoint_every": 0,
                                                      "log_every": 10}}
    work = tmp_path / "cluster"
    work.mkdir()
    procs, url, _ = start_standalone(work)
    try:
        run = tmp_path / "run"
        job = _launch(dataset, run, url, settings, "--conf", "spark.decommission.enabled=true")
        lines = []
        for line in job.stderr:
            lines.append(line)
            if line.startswith("step 20/"):
                decommission(procs[2])
        job.wait(timeout=600)
        err = "".join(lines)
        assert job.returncode == 0, err[-3000:]
    finally:
        stop_processes(procs)
    restart = next(x for x in lines if "restarting the ranks" in x)
    # the only checkpoint is the one the ranks made when asked: the restart resumes from a step past 20
    step = int(restart.split("checkpoint of step ")[1].split()[0])
    assert "leaving after the checkpoint of step" in restart and "on 1 ranks (was 2)" in restart and step > 20
    got = [r for r in read_metrics(run / "metrics.csv") if r["kind"] == "train"]
    assert [r["step"] for r in got] == [1, *range(10, 201, 10)]  # every step once (a row each 10, and the first)
    assert {r["workers"] for r in got if r["step"] <= step} == {2} and got[-1]["workers"] == 1
