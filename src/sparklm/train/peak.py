"""The host's measured matmul peak per thread count and dtype: the ceiling MFU is measured against, the test of
whether bf16 is fast here, and the speed the model's fit to a time budget assumes (``train.fit``).

Measured once per machine and cached in ~/.cache/sparklm/peak.json; torch is imported only to measure, so the
driver can read a cached peak without it (importing torch costs ~1 s before a run starts).
"""

from __future__ import annotations

import functools
import json
import time
from pathlib import Path

from ..infra.cache import cache_dir

BF16_FAST = 1.3  # bf16 counts as fast where its matmuls measure this much faster than fp32


@functools.cache  # once per process: the driver and a rank ask several times
def matmul_peak(threads: int, dtype: str, *, size: int = 1024, seconds: float = 1.0) -> float:
    """FLOP/s of a square matmul on ``threads`` threads in ``dtype`` ("float32", "bfloat16"), cached (~1-2 s to
    measure)."""
    cache = cache_dir("peak.json")
    key = cache_key(threads, dtype)
    try:
        known = json.loads(cache.read_text())
    except (OSError, ValueError):
        known = {}
    if key in known:
        return float(known[key])
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    a = torch.randn(size, size, dtype=getattr(torch, dtype))
    b = torch.randn(size, size, dtype=getattr(torch, dtype))
    for _ in range(3):
        a @ b
    peak = best_rate(lambda: a @ b, 2 * size**3, seconds)
    torch.set_num_threads(before)
    known[key] = peak
    from ..infra.fs import write_text

    try:  # whole or not at all: ranks on one host read it while another writes it
        write_text(str(cache), json.dumps(known, indent=2))
    except OSError:
        pass
    return peak


WINDOWS = 8  # the peak is the best of this many short windows


def best_rate(work, flops: float, seconds: float, windows: int = WINDOWS) -> float:
    """FLOP/s of ``work()`` (``flops`` each call): the best of ``windows`` windows of ``seconds / windows`` (fewer where
    calls are slower than that: ``seconds`` in all, at least one call). A peak
    is what the host can do: a window that another process's burst slowed says less about it than the fastest one
    (one window over the whole second measured 34 instead of 66 GFLOP/s on a busy 2-core host, and the runs after
    it then reported an MFU of 149%)."""
    best, start = 0.0, time.perf_counter()
    for _ in range(windows):
        n, t0 = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - t0) < seconds / windows or n == 0:
            work()
            n += 1
        best = max(best, flops * n / elapsed)
        if time.perf_counter() - start >= seconds:  # one call longer than a window (bf16 without hardware support)
            break
    return best


def cache_key(threads: int, dtype: str) -> str:
    """Where peak.json keeps the peak of ``dtype`` on ``threads`` threads of this machine's CPU model (``best``: the
    best-window measurement; peaks one long window measured are measured again)."""
    return f"{_cpu_model()}|{threads}|torch.{dtype}|best"


def compute_dtype(setting: str, threads: int) -> str:
    """``train.dtype`` resolved: "auto" is "bfloat16" where bf16 matmuls measure fast here, else "float32"."""
    if setting != "auto":
        return setting
    return "bfloat16" if bf16_fast(threads) else "float32"


def bf16_fast(threads: int) -> bool:
    """Whether bf16 matmuls measure clearly faster than fp32 here (cached, like the peaks)."""
    return matmul_peak(threads, "bfloat16") > BF16_FAST * matmul_peak(threads, "float32")


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def gpu_peak(name: str, dtype: str, index: int = 0) -> float:
    """The matmul peak of GPU ``name`` (cuda:``index``) in ``dtype``: the datasheet's where known
    (device.datasheet_peak, what a rank reports MFU against), else measured (a benchmark: driver and tools only)."""
    from .device import datasheet_peak

    known = datasheet_peak(name, dtype)
    if known is not None:
        return known
    import torch

    size, kind = 8192, getattr(torch, dtype)
    a = torch.randn(size, size, dtype=kind, device=f"cuda:{index}")
    for _ in range(3):
        a @ a
    torch.cuda.synchronize(index)
    t0, n = time.perf_counter(), 0
    while time.perf_counter() - t0 < 0.5:
        a @ a
        n += 1
        torch.cuda.synchronize(index)
    return 2 * size**3 * n / (time.perf_counter() - t0)
