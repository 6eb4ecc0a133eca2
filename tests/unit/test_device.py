"""The device seam's decisions (issue 52), pure: where a run computes, in which dtype, and the CUDA device's
placement refused in one line on a machine without a GPU. The CUDA paths run on a GPU (benchmarks/gpu_check.py)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from sparklm.config import Config, from_dict
from sparklm.infra.errors import SparklmError
from sparklm.train import device, memory, resolve
from sparklm.train.plan import RunPlan
from sparklm.train.schedule import Steps


@pytest.mark.parametrize("setting,master,task_gpus,local_gpus,want", [
    ("auto", "local[2]", 0, 0, "cpu"),
    ("auto", "local[2]", 0, 2, "cuda"),  # a local machine with GPUs works without settings
    ("auto", "spark://h:7077", 1, 0, "cuda"),  # Spark hands the tasks GPUs
    ("auto", "yarn", 0.5, 0, "cuda"),  # two tasks share a GPU
    ("auto", "yarn", 0, 4, "cpu"),  # the driver's GPUs say nothing of the executors'
    ("cpu", "local[2]", 1, 2, "cpu"),
    ("cuda", "spark://h:7077", 1, 0, "cuda"),
])
def test_the_device_follows_what_spark_hands_the_tasks(setting, master, task_gpus, local_gpus, want):
    assert resolve.device_for(setting, master, task_gpus, local_gpus) == want


def test_cuda_where_there_is_none_is_one_line():
    with pytest.raises(SparklmError, match="this machine has no CUDA GPU") as e:
        resolve.device_for("cuda", "local[*]", 0, 0)
    assert "docs/gpus.md" in e.value.hint
    with pytest.raises(SparklmError, match="hands its tasks no GPUs") as e:
        resolve.device_for("cuda", "k8s://https://api:443", 0, 0)
    assert "spark.task.resource.gpu.amount" in e.value.hint


def test_dtype_and_optimizer_on_cuda():
    assert resolve.dtype("auto", "cuda", 1) == "bfloat16"  # this driver sees no GPU: bf16, checked on the rank
    assert resolve.dtype("float16", "cuda", 1) == "float16"
    assert resolve.dtype("float32", "cpu", 1) == "float32"
    with pytest.raises(SparklmError, match="float16 is for GPUs"):
        resolve.dtype("float16", "cpu", 1)
    cfg = Config()
    cuda = cfg.replace(train=replace(cfg.train, device="cuda"))
    settled = resolve.settings(cuda, 4)
    assert (settled.train.device, settled.train.dtype, settled.train.optimizer) == ("cuda", "bfloat16", "muon")
    half = resolve.settings(cuda.replace(train=replace(cuda.train, dtype="float16")), 4)
    assert half.train.optimizer == "adamw"  # Muon orthogonalises in bf16, which such a GPU lacks
    lora = from_dict({"train": {"device": "cuda"}, "lora": {"r": 8}, "model": {"init_from": "x"}})
    assert resolve.settings(lora, 4).lora.base_dtype == "bfloat16"
    # a worker driven directly decides for its own machine (this one has no GPU)
    assert resolve.settings(Config(), 1).train.device == "cpu"


def test_the_cuda_device_and_its_plan():
    dev = device.select("cuda", "bfloat16")
    assert (dev.backend, dev.where, dev.index) == ("nccl", "cuda:0", None)
    assert device.select("cpu", "float32") == device.Device()
    assert device.Device().grad_scaler() is None  # fp32 and bf16 need no loss scaling
    cpu = device.Device()
    assert cpu.placed("1", 0) is cpu  # the CPU ignores a GPU Spark hands its task
    with pytest.raises(SparklmError, match="has no CUDA GPU torch can use"):
        dev.placed("0", 0)
    # the plan keeps the device whole (a rank places its own copy)
    plan = RunPlan(config=Config(), threads=2, device=dev, steps=Steps(rows_per_step=8, tokens_per_step=256,
                                                                         total_steps=10))
    assert RunPlan.from_dict(plan.to_dict()).device == dev


def test_a_gpu_ranks_memory_limit():
    assert memory.gpu_limit("2g") == (2 * 2**30, "train.memory_limit")
    assert memory.gpu_limit("none") == (None, "train.memory_limit = none")
    assert memory.gpu_limit("") == (None, "")  # no GPU on this driver: nothing planned


def test_inference_device():
    from sparklm.infer.generate import inference_device

    assert inference_device("auto") == "cpu" and inference_device("cpu") == "cpu"  # this machine has no GPU
    assert inference_device("auto", cpu_only=True) == "cpu"
    with pytest.raises(SparklmError, match="torch sees no CUDA GPU here"):
        inference_device("cuda:1")
    with pytest.raises(SparklmError, match="use cpu, cuda, cuda:N or auto"):
        inference_device("tpu")


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA GPU (benchmarks/gpu_check.py)")
def test_a_rank_places_itself_on_the_gpu_spark_assigned():
    import torch

    dev = device.select("cuda", "bfloat16").placed("0", 3)
    assert dev.where == "cuda:0" and dev.zeros(2).device.type == "cuda" and dev.peak() > 1e12
    assert torch.backends.cuda.matmul.allow_tf32


def test_compile_auto_only_where_it_was_measured_to_pay(monkeypatch):
    """train.compile auto: on for a causal LM trained from scratch with DDP whose time budget is at least 6 minutes,
    on a GPU in bf16/fp16 or on the CPU in bf16 with a C++ compiler; off for a shorter run, float32 on the CPU,
    rounds, pretrained or LoRA."""
    def settled(**train):
        raw = {"train": {"device": "cuda", "time_budget": 3600.0, **train.pop("train", {})}, **train}
        return resolve.settings(from_dict(raw), 4).train.compile

    assert settled() == "on"  # bf16 on CUDA, an hour
    assert settled(train={"dtype": "float16"}) == "on"
    assert settled(train={"time_budget": 360.0}) == "on"  # the main job's 6 minutes
    assert settled(train={"time_budget": 300.0}) == "off"  # shorter than measured
    assert settled(train={"time_budget": 0.0, "max_steps": 10**6}) == "off"  # steps say nothing of its length
    assert settled(train={"device": "cpu", "dtype": "bfloat16"}) == ("on" if resolve.cxx_compiler() else "off")
    assert settled(train={"device": "cpu", "dtype": "float32"}) == "off"
    assert settled(train={"strategy": "diloco"}) == "off"  # every round's task would compile again
    assert settled(model={"init_from": "some/model"}) == "off"
    assert settled(lora={"r": 8}, model={"init_from": "some/model"}) == "off"
    assert settled(model={"task": "classify"}) == "off"
    assert settled(train={"compile": "on", "device": "cpu", "time_budget": 0.0}) == "on"  # a setting is kept
    assert settled(train={"compile": False}) == "off"  # TOML's false, as before the setting had "auto"
    monkeypatch.setenv("CXX", "no-such-compiler++")  # a host without Inductor's compiler stays eager
    assert settled(train={"device": "cpu", "dtype": "bfloat16"}) == "off"
    assert settled() == "on"  # a GPU's kernels need none
    assert settled(train={"compile": True, "dtype": "float32"}) == "on"
