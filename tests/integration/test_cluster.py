"""Spark standalone: a master and two workers started from the pyspark package on 127.0.0.1.

A DiLoCo task that fails is recomputed exactly by Spark's retry, and a capped Python worker trains with the planned
micro-batch. Benchmark tasks scored on the two workers give lm-evaluation-harness's own numbers. (That the same `sparklm train` command trains DDP and DiLoCo on a standalone cluster with the losses of
local mode is shown by tests/integration/test_hosts.py, on workers that share nothing with the driver.)
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from types import SimpleNamespace

import pytest
import torch

from conftest import (
    HARNESS_TASKS,
    assert_one_line_interrupt,
    assert_same_figures,
    harness_reference,
    harness_toy,
    interrupt,
    make_text,
    start_standalone,
    stop_processes,
)
from sparklm.config import from_dict
from sparklm.launch.prepare import prepare
from sparklm.launch.train import train
from sparklm.metrics.sinks import read_metrics

pytestmark = [pytest.mark.cluster, pytest.mark.xdist_group("standalone")]


@pytest.fixture(scope="module")
def standalone(tmp_path_factory):
    procs, url, ui = start_standalone(tmp_path_factory.mktemp("standalone"))
    try:
        yield SimpleNamespace(url=url, ui=ui)
    finally:
        stop_processes(procs)


def _nest(settings):
    out: dict = {}
    for s in settings:
        key, value = s.split("=", 1)
        *tables, name = key.split(".")
        table = out
        for t in tables:
            table = table.setdefault(t, {})
        table[name] = json.loads(value) if value[0] in '"0123456789-' else value
    return out


def test_diloco_on_a_standalone_cluster_recomputes_a_failed_task_exactly(spark, standalone, tmp_path):
    """Plain tasks on the cluster: one task fails after its inner steps; Spark's retry recomputes the same
    delta, so the run ends with the weights of the failure-free run (and local mode's losses)."""
    from safetensors.torch import load_file

    (tmp_path / "a.txt").write_text(make_text(300, seed=11))
    settings = ["model.n_layer=2", "model.n_head=2", "model.n_embd=32", "train.batch_size=4", "train.max_steps=6",
                "train.eval_every=0", "train.eval_batches=2", "train.dtype=\"float32\"", "train.samples=0",
                "train.threads=1", "train.strategy=\"diloco\"", "train.rounds.sync_every=2"]
    data = prepare([str(tmp_path / "a.txt")], output=str(tmp_path / "data"), spark=spark,
                   config=from_dict({"data": {"seq_len": 32}, "tokenizer": {"vocab_size": 300}}))
    local = tmp_path / "local"
    train(data.uri, output=str(local), config=from_dict(_nest(settings + ["train.workers=2"])), spark=spark)

    def remote(name, fault=None):
        out = tmp_path / name
        args = [sys.executable, "-m", "sparklm", "train", "--data", data.uri, "--output", str(out), "--workers", "2",
                "--master", standalone.url, "--conf", "spark.executor.memory=1g", "--conf", "spark.ui.enabled=false"]
        for s in settings:
            args += ["--set", s]
        env = {**os.environ, "SPARK_LOCAL_IP": "127.0.0.1"}
        env.pop("SPARKLM_INJECT_FAULT", None)
        if fault:
            env["SPARKLM_INJECT_FAULT"] = fault
        r = subprocess.run(args, capture_output=True, text=True, timeout=600, env=env)
        assert r.returncode == 0, r.stderr[-3000:]
        with (out / "rounds.csv").open() as f:
            rows = list(__import__("csv").DictReader(f))
        return rows, load_file(str(sorted((out / "checkpoints").glob("step-*"))[-1] / "model.safetensors"))

    clean_rows, clean = remote("clean")
    fault_rows, faulted = remote("faulted", "round=1,worker=1,attempts=1")
    assert [r["attempts"] for r in clean_rows] == ["0;0"] * 3
    assert sorted(fault_rows[1]["attempts"].split(";")) == ["0", "1"]  # worker 1 of round 1 ran twice
    assert all(r["workers_done"] == "2" for r in fault_rows)
    for k in clean:
        assert torch.equal(clean[k], faulted[k]), k
    a = [float(r["loss"]) for r in clean_rows]
    b = [row["loss"] for row in read_metrics(local / "metrics.csv") if row["kind"] == "train"]
    assert a == pytest.approx(b, abs=1e-4)


def test_a_capped_python_worker_trains_with_the_planned_micro_batch(spark, standalone, tmp_path):
    """spark.executor.pyspark.memory caps each Python worker (Spark sets it as the worker's address-space limit,
    inherited by the DDP rank): unplanned, micro-batches of 16 sequences of 512 tokens run out of memory and the
    run fails with one line naming memory; planned, the same global batch trains in smaller micro-batches."""
    (tmp_path / "a.txt").write_text(make_text(3000, seed=12))
    data = prepare([str(tmp_path / "a.txt")], output=str(tmp_path / "data"), spark=spark,
                   config=from_dict({"data": {"seq_len": 512}, "tokenizer": {"vocab_size": 512}}))

    def run(name: str, *extra: str) -> subprocess.CompletedProcess:
        args = [sys.executable, "-m", "sparklm", "train", "--data", data.uri, "--output", str(tmp_path / name),
                "--master", standalone.url, "--threads", "1", "--max-steps", "2", "--eval-every", "0",
                "--conf", "spark.executor.pyspark.memory=1900m", "--conf", "spark.ui.enabled=false",
                "--set", "model.n_embd=256", "--set", "model.n_layer=4", "--set", "model.n_head=4",
                "--set", "train.batch_size=16", "--set", "train.eval_batches=1", "--set", "train.samples=0",
                "--set", "train.log_every=1", "--set", 'train.dtype="float32"', *extra]
        return subprocess.run(args, capture_output=True, text=True, timeout=600,
                              env={**os.environ, "SPARK_LOCAL_IP": "127.0.0.1"})

    unplanned = run("unplanned", "--memory-limit", "none")
    assert unplanned.returncode != 0
    errors = [line for line in unplanned.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "out of memory" in errors[0] and "address-space limit 1.86 GB" in errors[0], \
        unplanned.stderr[-2000:]
    assert "Traceback" not in unplanned.stderr

    planned = run("planned")
    assert planned.returncode == 0, planned.stderr[-3000:]
    line = next(x for x in (planned.stdout + planned.stderr).splitlines() if x.startswith("memory: "))
    assert "(spark.executor.pyspark.memory)" in line
    micro, accum = (int(x) for x in re.search(r"micro-batch (\d+) x (\d+) accumulation", line).groups())
    assert micro < 16 and micro * accum == 16  # the global batch kept
    summary = json.loads((tmp_path / "planned" / "summary.json").read_text())
    assert summary["steps"] == 2 and 0 < summary["peak_rss_mb"] < 1900
    saved = json.loads((tmp_path / "planned" / "config.json").read_text())
    assert saved["config"]["train"]["batch_size"] == 16  # the settings as asked: --resume starts from them
    # what ran, recorded whole before any rank started: the plan's micro-batch and accumulation
    assert (saved["plan"]["runs"]["train.batch_size"], saved["plan"]["runs"]["train.grad_accum"]) == (micro, accum)
    assert saved["plan"]["memory"]["source"].startswith("spark.executor.pyspark.memory")


def test_ctrl_c_on_a_standalone_cluster_is_one_line_and_the_checkpoint_resumes(spark, standalone, dataset, tmp_path):
    """DDP ranks on the cluster's executors; Ctrl-C on the driver: one line, exit 130, the master lets the
    application's executors go, and the last checkpoint resumes (here in local mode) to the end."""
    run = tmp_path / "run"
    args = ["train", "--data", dataset, "-o", str(run), "--workers", "2", "--max-steps", "100000", "--master",
            standalone.url, "--conf", "spark.executor.memory=1g", "--conf", "spark.ui.enabled=false", "--threads", "1",
            "--set", "train.checkpoint_every=5", "--set", "train.log_every=1", "--set", "train.eval_batches=2",
            "--set", "train.samples=0",
            "--set", "model.n_layer=1", "--set", "model.n_head=2", "--set", "model.n_embd=32",
            "--set", "train.batch_size=4", "--set", 'train.dtype="float32"']
    r = interrupt(args, lambda err: any((run / "checkpoints").glob("step-*")))
    assert_one_line_interrupt(r)

    deadline = time.time() + 60
    while True:  # the driver is gone: the master ends its application and the executors with it
        state = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{standalone.ui}/json/", timeout=5).read())
        if not state["activeapps"]:
            break
        assert time.time() < deadline, state["activeapps"]
        time.sleep(1)
    last = max(int(p.name.split("-")[1]) for p in (run / "checkpoints").glob("step-*"))
    summary = train(None, output=str(run), resume=True, spark=spark, changes={"train": {"max_steps": last + 3}})
    assert summary["steps"] == last + 3
    steps = [row["step"] for row in read_metrics(str(run / "metrics.csv")) if row["kind"] == "train"]
    assert steps == list(range(1, last + 4))  # each step once: the rows after the checkpoint rewound


def test_benchmark_tasks_on_two_workers_equal_the_harness(standalone, tmp_path):
    """`sparklm eval --tasks` with the requests spread over two workers' executors: every figure of the harness's
    `simple_evaluate` with its HF backend (one process), to 4 decimals, and the same generated texts."""
    pytest.importorskip("lm_eval")
    toy = harness_toy(tmp_path / "toy")
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, "-m", "sparklm", "eval", str(toy / "model"), "--tasks", str(toy / "tasks"),
                        "--master", standalone.url, "--conf", "spark.ui.enabled=false", "--batch-size", "4",
                        "--threads", "1", "--log-samples", "-o", str(out)], capture_output=True, text=True,
                       timeout=600, env={**os.environ, "SPARK_LOCAL_IP": "127.0.0.1"})
    assert r.returncode == 0, r.stderr[-3000:]
    assert "on 2 task(s)" in r.stderr  # each job's requests in two shares, one per executor's core
    assert "|toy_mc  |" in r.stdout and "|toy_gen |" in r.stdout  # the harness's own table, printed
    ours = json.loads((out / "results.json").read_text())
    ours["samples"] = {"toy_gen": [json.loads(x) for x in (out / "samples_toy_gen.jsonl").read_text().splitlines()]}
    assert_same_figures(ours, harness_reference(toy, list(HARNESS_TASKS)))
