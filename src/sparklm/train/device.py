"""The device seam: where tensors live, the autocast dtype and the process-group backend, chosen in one
place; and the host's memory settings and figures (RSS, the glibc allocator; the matmul peak is peak.py's).

Only the CPU with gloo exists today; a CUDA device (NCCL, Spark's GPU resources) plugs in here. The module
imports torch only where a tensor is made: the driver asks a device how many workers Spark can run at once.
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import platform
import re
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from .peak import matmul_peak

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Device:
    kind: str = "cpu"
    dtype_name: str = "float32"  # autocast dtype (train.dtype as the driver decided it); float32: no autocast
    backend: str = "gloo"  # torch.distributed backend for this device

    @property
    def dtype(self) -> torch.dtype:
        import torch

        return getattr(torch, self.dtype_name)

    def slots(self, spark) -> int:
        """How many workers of this device Spark can run at once (the driver asks before a barrier stage): on the
        CPU, task slots — cores (local[N]: N) ÷ spark.task.cpus; a GPU device would count Spark's GPU resources."""
        sc = spark.sparkContext
        cpus = int(sc.getConf().get("spark.task.cpus", "1"))
        m = re.match(r"local(?:\[(\*|\d+)(?:,\s*\d+)?\])?$", sc.master)
        if m:
            n = 1 if m.group(1) is None else (os.cpu_count() or 1) if m.group(1) == "*" else int(m.group(1))
            return n // cpus
        return sc.defaultParallelism // cpus

    # Everything a worker places goes through these: on the CPU they are what torch does anyway; a CUDA device
    # overrides them (tensors moved to the card, its RNG state saved beside the CPU's, DDP with device_ids).

    def put(self, x):
        """A tensor, module or batch (a dataclass of tensors) on this device."""
        if self.kind == "cpu":
            return x
        if dataclasses.is_dataclass(x):
            return type(x)(**{f.name: self.put(getattr(x, f.name)) for f in dataclasses.fields(x)})
        return x if x is None else x.to(self.kind)

    def zeros(self, *shape: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        """A buffer on this device (sums, collective buffers); float32 unless ``dtype`` says."""
        import torch

        return torch.zeros(shape, dtype=dtype or torch.float32, device=self.kind)

    def tensor(self, data, dtype: torch.dtype | None = None) -> torch.Tensor:
        """``data`` as a tensor on this device (float64 unless ``dtype`` says)."""
        import torch

        return torch.tensor(data, dtype=dtype or torch.float64, device=self.kind)

    def rng_state(self) -> torch.Tensor:
        """This process's random state for a checkpoint (dropout; the data order has its own seed)."""
        import torch

        return torch.get_rng_state()

    def set_rng_state(self, state: torch.Tensor) -> None:
        import torch

        torch.set_rng_state(state)

    def data_parallel(self, model: torch.nn.Module) -> torch.nn.Module:
        """``model`` under DistributedDataParallel over this device's process group."""
        import torch

        return torch.nn.parallel.DistributedDataParallel(model)

    def autocast(self) -> AbstractContextManager:
        import torch

        return torch.autocast(self.kind, dtype=self.dtype, enabled=self.dtype_name != "float32")

    def peak_flops(self, threads: int) -> float:
        return matmul_peak(threads, self.dtype_name)


def select(dtype: str) -> Device:
    """The device for a rank: the CPU, with the autocast dtype ``dtype`` names (decided on the driver:
    resolve.settings, which picks bf16 only where its matmuls measure clearly faster than fp32)."""
    return Device(dtype_name=dtype)


def rss_mb() -> float:
    """This process's resident memory now."""
    return _status_mb("VmRSS")


def peak_rss_mb() -> float:
    """The largest resident memory of this process so far (VmHWM): what a container's memory limit is held to."""
    return _status_mb("VmHWM")


def _status_mb(key: str) -> float:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def keep_freed_memory() -> None:
    """glibc: keep freed memory in the process instead of handing it back to the OS every step.

    By default glibc serves blocks above a (dynamic, ≤32 MB) threshold with mmap and returns them on
    free, so every step page-faults its largest tensors (logits, their gradients, activations) in
    again: millions of page faults a minute. Raising the mmap and trim thresholds made training
    steps 15-25% faster here (benchmarks/train_throughput.py), for ~15% more peak RSS (freed blocks
    stay mapped for the next step). :func:`trim_memory` hands the memory back at the end.
    """
    if (libc := _glibc()) is not None:
        libc.mallopt(-3, 1 << 30)  # M_MMAP_THRESHOLD: 1 GiB
        libc.mallopt(-1, (1 << 31) - 1)  # M_TRIM_THRESHOLD: 2 GiB


def set_allocator(policy: str) -> None:
    """train.allocator: "return" hands freed memory back (:func:`hand_back_memory`), else keep it (auto: the memory
    plan resolved it on the driver; a core run without a plan keeps it)."""
    hand_back_memory() if policy == "return" else keep_freed_memory()


def hand_back_memory() -> None:
    """glibc: serve every block over 256 KB with mmap and hand it back on free — the opposite of
    :func:`keep_freed_memory`, for a rank under a memory limit. glibc's default threshold grows to the largest
    block freed so far (up to 32 MB), after which freed activations stay in the heap, fragmented: measured on
    SmolLM2-135M LoRA (bf16 base, checkpointing), 2.5 GB peak resident memory with the default, 1.2 GB with
    this (the rest of the difference was heap never handed back)."""
    if (libc := _glibc()) is not None:
        libc.mallopt(-3, 256 << 10)  # M_MMAP_THRESHOLD (fixed: no dynamic growth)
        libc.mallopt(-1, 1 << 20)  # M_TRIM_THRESHOLD


def trim_memory() -> None:
    if (libc := _glibc()) is not None:
        libc.malloc_trim(0)


def _glibc():
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


