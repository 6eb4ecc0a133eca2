"""GPUs through Spark's resource scheduling (issue 52), on a machine without one: Spark schedules custom resources on
any machine, so a discovery script that reports two fake GPU addresses shows which GPU each task — each DDP rank,
each round worker — is handed, while the ranks compute on the CPU (``--device cpu``). The CUDA paths themselves run
on a GPU machine (benchmarks/gpu_check.py; the tests marked ``gpu`` below skip without one)."""

from __future__ import annotations

import json
import os
import stat

import pytest

from conftest import run_sparklm

pytestmark = pytest.mark.xdist_group("gpu")


@pytest.fixture(scope="module")
def fake_gpus(tmp_path_factory):
    """--conf arguments for a local-cluster of one executor with 4 cores and 2 fake GPUs, one GPU per task."""
    import pyspark

    root = tmp_path_factory.mktemp("gpus")
    script = root / "gpus.sh"
    script.write_text('#!/bin/sh\necho \'{"name": "gpu", "addresses": ["0", "1"]}\'\n')
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    conf = {"spark.executor.resource.gpu.amount": "2", "spark.task.resource.gpu.amount": "1",
            "spark.worker.resource.gpu.amount": "2", "spark.worker.resource.gpu.discoveryScript": str(script),
            "spark.executor.resource.gpu.discoveryScript": str(script), "spark.ui.enabled": "false",
            "spark.executor.memory": "1g"}
    args = ["--master", "local-cluster[1,4,1024]"]
    for k, v in conf.items():
        args += ["--conf", f"{k}={v}"]
    # local-cluster starts its executors with the pyspark package's scripts
    return args, {"SPARK_HOME": os.path.dirname(pyspark.__file__)}


def _train(dataset, out, extra, env):
    return run_sparklm("train", "--data", dataset, "-o", str(out), "--max-steps", "4", "--eval-every", "0",
                       "--threads", "1", "--device", "cpu", "--set", "model.n_layer=1", "--set", "model.n_embd=32",
                       "--set", "model.n_head=2", *extra, env=env)


def test_spark_hands_each_rank_and_round_worker_its_own_gpu(dataset, tmp_path, fake_gpus):
    args, env = fake_gpus
    r = _train(dataset, tmp_path / "ddp", ["--workers", "2", *args], env)
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads((tmp_path / "ddp" / "summary.json").read_text())
    assert sorted(summary["gpus"]) == ["0", "1"] and summary["device"] == "cpu"  # one GPU per rank, each its own
    plan = json.loads((tmp_path / "ddp" / "config.json").read_text())
    assert plan["config"]["train"]["device"] == "cpu" and plan["plan"]["device"]["backend"] == "gloo"
    # more ranks than GPUs: one line before any training, though the executor has the cores
    r = _train(dataset, tmp_path / "three", ["--workers", "3", *args], env)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert "--workers 3 needs 3 GPUs at once, one per rank; this Spark can hand out 2" in r.stderr, r.stderr[-2000:]
    assert not (tmp_path / "three").exists()  # nothing written: the same --output works again
    # round workers take the GPU their task is handed too
    r = _train(dataset, tmp_path / "avg", ["--workers", "2", "--strategy", "average", "--set",
                                           "train.rounds.sync_every=2", *args], env)
    assert r.returncode == 0, r.stderr[-3000:]


def test_auto_asks_spark_for_gpus_and_cuda_without_one_is_one_line(dataset, tmp_path, fake_gpus):
    args, env = fake_gpus
    # spark.task.resource.gpu.amount set: auto means CUDA, which this machine's ranks do not have
    r = run_sparklm("train", "--data", dataset, "-o", str(tmp_path / "auto"), "--max-steps", "2", "--workers", "1",
                    *args, env=env)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert "has no CUDA GPU torch can use (train.device is cuda)" in r.stderr.splitlines()[-1] or \
        "no CUDA GPU" in r.stderr, r.stderr[-2000:]
    # --device cuda in local mode on a machine without a GPU: one line before Spark starts
    r = run_sparklm("train", "--data", dataset, "-o", str(tmp_path / "cuda"), "--device", "cuda", "--max-steps", "2")
    assert r.returncode == 2 and "Traceback" not in r.stderr and not (tmp_path / "cuda").exists()
    assert "--device cuda: this machine has no CUDA GPU that torch can use" in r.stderr, r.stderr[-2000:]
    r = run_sparklm("train", "--data", dataset, "-o", str(tmp_path / "half"), "--set", "train.dtype=float16",
                    "--max-steps", "2")
    assert r.returncode == 2 and "train.dtype float16 is for GPUs without bfloat16" in r.stderr, r.stderr[-2000:]
