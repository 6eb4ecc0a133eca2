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

import pytest

from conftest import free_port, kill_tree, start_standalone, stop_processes
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


def test_ddp_goes_on_with_fewer_ranks_when_a_worker_dies_keeping_the_global_batch(spark, dataset, tmp_path):
    reference = tmp_path / "reference"  # uninterrupted, two ranks (local mode)
    train(dataset, output=str(reference), spark=spark,
          config=from_dict({**SETTINGS, "train": {**SETTINGS["train"], "workers": 2}}))
    want = [r for r in read_metrics(reference / "metrics.csv") if r["kind"] == "train"]

    (tmp_path / "cluster").mkdir()
    procs, url, _ = start_standalone(tmp_path / "cluster")
    try:
        run = tmp_path / "run"
        args = [sys.executable, "-m", "sparklm", "train", "--data", dataset, "-o", str(run), "--workers", "1:2",
                "--master", url, "--conf", "spark.executor.memory=1g", "--conf", "spark.ui.enabled=false", *_flags(),
                # rank 1 stops after step 6 (its first launch only), so that the host goes while the run is in flight
                "--conf", "spark.executorEnv.SPARKLM_INJECT_RANK_FAULT=rank=1,step=6,at=hang"]
        job = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "SPARK_LOCAL_IP": "127.0.0.1"})
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


def _add_worker(work, url: str) -> subprocess.Popen:
    """One more 1-core worker joining the cluster (as start_standalone starts them)."""
    import pyspark

    from sparklm.spark.java import find_java_home

    home = pyspark.__file__.rsplit("/", 1)[0]
    env = {**os.environ, "JAVA_HOME": find_java_home(), "SPARK_HOME": home, "SPARK_LOCAL_IP": "127.0.0.1",
           "PYSPARK_PYTHON": sys.executable, "SPARK_LOG_DIR": str(work)}
    return subprocess.Popen([f"{home}/bin/spark-class", "org.apache.spark.deploy.worker.Worker", "--host", "127.0.0.1",
                             "--cores", "1", "--memory", "3g", "--webui-port", str(free_port()), "--work-dir",
                             str(work / "w-added"), url], env=env, stdout=open(work / "worker-added.log", "wb"),
                            stderr=subprocess.STDOUT, start_new_session=True)


def test_diloco_rounds_run_on_the_workers_there_are_as_hosts_leave_and_join(spark, dataset, tmp_path):
    settings = {"model": SETTINGS["model"],
                "train": {**SETTINGS["train"], "max_steps": 120, "checkpoint_every": 0, "strategy": "diloco"},
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
        args = [sys.executable, "-m", "sparklm", "train", "--data", dataset, "-o", str(run), "--workers", "1:2",
                "--master", url, "--conf", "spark.executor.memory=1g", "--conf", "spark.ui.enabled=false",
                *_flags(settings)]
        job = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "SPARK_LOCAL_IP": "127.0.0.1"})
        lines = []
        for line in job.stderr:  # the progress lines: a train row per round
            lines.append(line)
            if "| step 10/" in line:
                kill_tree(procs[2].pid)  # a host gone
            if "| step 14/" in line:
                procs.append(_add_worker(work, url))  # a host joins
        job.wait(timeout=600)
        err = "".join(lines)
        assert job.returncode == 0, err[-3000:]
    finally:
        stop_processes(procs)
    assert "Traceback" not in err
    got = [r for r in read_metrics(run / "metrics.csv") if r["kind"] == "train"]
    assert [r["step"] for r in got] == list(range(2, 122, 2))  # a row per round, each once
    workers = [r["workers"] for r in got]
    assert workers[:4] == [2] * 4 and 1 in workers[5:12] and workers[-1] == 2, workers
    assert got[-1]["tokens"] == want[-1]["tokens"]  # the token budget kept
    # a round on one worker takes the whole global batch in larger inner steps (no drift between workers to
    # average away): the held-out figure is no worse than the two-worker run's
    bpb = [[r["val_bpb"] for r in read_metrics(d / "metrics.csv") if r["kind"] == "eval"][-1] for d in (run, reference)]
    print("workers per round:", workers, "val bits/byte", bpb[0], "uninterrupted", bpb[1])
    assert bpb[0] <= bpb[1] * 1.01
