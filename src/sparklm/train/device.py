"""The device seam: where tensors live, the autocast dtype and the process-group backend, chosen in one
place; and the host's memory settings and figures (RSS, the glibc allocator; the matmul peak is peak.py's).

Two kinds: the CPU with gloo, and CUDA with NCCL (one GPU per rank: the one Spark assigned the task, or in local
mode the rank's own). The driver decides the kind and dtype (resolve.py) and writes them in the run plan; a rank
places its copy on its GPU (:meth:`Device.placed`). The module imports torch only where a tensor is made: the
driver asks a device how many workers Spark can run at once.
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import platform
import re
import socket
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..infra.errors import SparklmError

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Device:
    kind: str = "cpu"  # "cpu" or "cuda"
    dtype_name: str = "float32"  # autocast dtype (train.dtype as the driver decided it); float32: no autocast
    backend: str = "gloo"  # torch.distributed backend for this device
    index: int | None = None  # the rank's GPU (placed); None: not placed yet (the driver's copy), or the CPU
    # a CPU worker's matmul peak (FLOP/s on its threads, in its dtype: what MFU is against), measured by the driver
    # (train/peak.py) when it made the plan; None: not measured (a GPU's is its datasheet's)
    peak_flops: float | None = None

    @property
    def where(self) -> str:
        """torch's name for where this device's tensors go."""
        return "cpu" if self.kind == "cpu" else f"cuda:{self.index or 0}"

    def slots(self, spark) -> int:
        """How many task slots Spark has at once (the driver asks before a barrier stage): cores (local[N]: N) ÷
        spark.task.cpus. The GPUs that may bound them are :func:`spark.resources.gpu_slots`'s."""
        sc = spark.sparkContext
        cpus = int(sc.getConf().get("spark.task.cpus", "1"))
        m = re.match(r"local(?:\[(\*|\d+)(?:,\s*\d+)?\])?$", sc.master)
        if m:
            n = 1 if m.group(1) is None else (os.cpu_count() or 1) if m.group(1) == "*" else int(m.group(1))
            return n // cpus
        try:  # what Spark's own barrier check counts (live executors' cores ÷ task cpus, and their resources)
            jsc = sc._jsc.sc()
            return int(jsc.maxNumConcurrentTasks(jsc.resourceProfileManager().defaultResourceProfile()))
        except Exception:  # (a Spark without it) defaultParallelism, which is never below 2 on a cluster
            return sc.defaultParallelism // cpus

    def placed(self, address: str | None, local_rank: int) -> Device:
        """This device as one rank computes on it: on CUDA the GPU Spark assigned the task (``address``, from
        TaskContext.resources()), else (local mode) GPU ``local_rank`` of this host's; checked, made current, TF32
        matmuls on. The CPU as it is."""
        if self.kind == "cpu":
            return self
        import torch

        where = f"on {socket.gethostname()}"
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise SparklmError(f"a worker {where} has no CUDA GPU torch can use (train.device is cuda)",
                               hint="install a CUDA build of torch on the executors (docs/gpus.md), or --device cpu")
        index = int(address) if address is not None and address.isdigit() else local_rank % count
        if index >= count:
            raise SparklmError(f"Spark assigned GPU {address} to a worker {where}, which sees {count} "
                               f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')})",
                               hint="make the executors' GPU discovery script report the addresses torch sees")
        torch.cuda.set_device(index)
        if self.dtype_name == "bfloat16" and not torch.cuda.is_bf16_supported():
            raise SparklmError(f"GPU {torch.cuda.get_device_name(index)} {where} has no bfloat16",
                               hint="--set train.dtype=float16 (a gradient scaler keeps its gradients in range)")
        torch.backends.cuda.matmul.allow_tf32 = True  # float32 matmuls on tensor cores (10 bits of mantissa)
        torch.backends.cudnn.allow_tf32 = True
        return dataclasses.replace(self, index=index)

    # Everything a worker places goes through these: on the CPU they are what torch does anyway; on CUDA tensors
    # go to the rank's GPU (batches from pinned memory, without waiting), DDP gets its device id.

    def put(self, x):
        """A tensor, module or batch (a dataclass of tensors) on this device."""
        if self.kind == "cpu" or x is None:
            return x
        if dataclasses.is_dataclass(x):
            return type(x)(**{f.name: self.put(getattr(x, f.name)) for f in dataclasses.fields(x)})
        import torch

        if isinstance(x, torch.Tensor):
            if x.device.type == "cpu":  # pinned: the copy runs while the GPU computes what was queued before
                return x.pin_memory().to(self.where, non_blocking=True)
            return x.to(self.where)
        return x.to(self.where) if hasattr(x, "to") else x

    def zeros(self, *shape: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        """A buffer on this device (sums, collective buffers); float32 unless ``dtype`` says."""
        import torch

        return torch.zeros(shape, dtype=dtype or torch.float32, device=self.where)

    def tensor(self, data, dtype: torch.dtype | None = None) -> torch.Tensor:
        """``data`` as a tensor on this device (float64 unless ``dtype`` says)."""
        import torch

        return torch.tensor(data, dtype=dtype or torch.float64, device=self.where)

    def rng_state(self) -> torch.Tensor:
        """This process's random state for a checkpoint (dropout; the data order has its own seed). The CPU's on
        both kinds, so a checkpoint resumes on either: a GPU's dropout draws restart from the seed and rank."""
        import torch

        return torch.get_rng_state()

    def set_rng_state(self, state: torch.Tensor) -> None:
        import torch

        torch.set_rng_state(state)

    def data_parallel(self, model: torch.nn.Module) -> torch.nn.Module:
        """``model`` under DistributedDataParallel over this device's process group."""
        import torch

        ids = None if self.kind == "cpu" else [self.index or 0]
        return torch.nn.parallel.DistributedDataParallel(model, device_ids=ids)

    def autocast(self) -> AbstractContextManager:
        import torch

        return torch.autocast(self.kind, dtype=self.dtype, enabled=self.dtype_name != "float32")

    @property
    def dtype(self) -> torch.dtype:
        import torch

        return getattr(torch, self.dtype_name)

    def grad_scaler(self):
        """fp16 autocast's loss scaler (its gradients underflow without one); None for bf16 and fp32."""
        if self.dtype_name != "float16":
            return None
        import torch

        return torch.amp.GradScaler(self.kind)

    def peak(self) -> float | None:
        """What this worker's MFU is against: the CPU's peak as the plan says, a GPU's from its datasheet; None where
        neither is known (no MFU then). A worker measures nothing: benchmarks of the machine run on the driver."""
        if self.kind == "cpu":
            return self.peak_flops
        import torch

        return datasheet_peak(torch.cuda.get_device_name(self.index or 0), self.dtype_name)

    def peak_mb(self) -> float:
        """The memory figure that limits this worker: the host's peak RSS on the CPU, the GPU's peak reserved
        memory on CUDA."""
        if self.kind == "cpu":
            return peak_rss_mb()
        import torch

        return torch.cuda.max_memory_reserved(self.index or 0) / 2**20

    def synchronize(self) -> None:
        """Wait for queued GPU work (a timed span ends here); nothing on the CPU."""
        if self.kind != "cpu":
            import torch

            torch.cuda.synchronize(self.index or 0)


def select(kind: str, dtype: str, peak: float | None = None) -> Device:
    """The device the driver decided (resolve.device, resolve.dtype): the CPU with gloo (``peak``: its measured
    matmul peak), or CUDA with NCCL."""
    return Device(kind=kind, dtype_name=dtype, backend="nccl" if kind == "cuda" else "gloo",
                  peak_flops=peak if kind == "cpu" else None)


# Dense bf16/fp16 tensor-core peaks from the vendors' datasheets (FLOP/s), by a piece of torch's device name: the
# ceiling GPU MFU is quoted against, as the field quotes it (989 TFLOP/s for an H100 SXM). float32 runs as TF32 on
# these cards, at half the rate. A GPU not listed has no MFU on the workers (peak.gpu_peak measures one, off a run).
GPU_PEAKS = (("H200", 989e12), ("H100 PCIe", 756e12), ("H100", 989e12), ("GH200", 989e12), ("B200", 2250e12),
             ("A100", 312e12), ("L40S", 362e12), ("L40", 181e12), ("A10G", 70e12), ("A10", 125e12), ("L4", 121e12),
             ("A6000", 155e12), ("V100", 125e12), ("T4", 65e12))


def datasheet_peak(name: str, dtype: str) -> float | None:
    """GPU ``name``'s matmul peak in ``dtype`` from its datasheet (pure); None for a GPU not listed."""
    for piece, flops in GPU_PEAKS:
        if piece in name:
            return flops if dtype in ("bfloat16", "float16") else flops / 2
    return None


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
    hand_back_memory() if policy == "return" else keep_freed_memory()  # trim: kept, and trimmed after every step


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


