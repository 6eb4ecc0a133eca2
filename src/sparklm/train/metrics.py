"""metrics.csv (one row per log step or evaluation), the measured matmul peak (for MFU), memory."""

from __future__ import annotations

import csv
import json
import time
from pathlib import Path

from ..cache import cache_dir

COLUMNS = ["kind", "step", "epoch", "tokens", "loss", "lr", "grad_norm", "tokens_per_s", "ms_per_step", "mfu",
           "rss_mb", "elapsed", "val_loss", "val_ppl", "val_bpb", "val_acc", "val_tokens"]


class CsvLog:
    """Appends rows to a CSV file and flushes each one, so the driver (or a reader) can follow it live."""

    def __init__(self, path: Path, columns: list[str]):
        self.path = path
        fresh = not path.exists()
        self.file = path.open("a", newline="")
        self.writer = csv.DictWriter(self.file, fieldnames=columns, extrasaction="ignore")
        if fresh:
            self.writer.writeheader()
        self.file.flush()

    def write(self, row: dict) -> None:
        self.writer.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in row.items()})
        self.file.flush()

    def close(self) -> None:
        self.file.close()


class MetricsWriter(CsvLog):
    """metrics.csv: a row per log step (``train``) or evaluation (``eval``); run_info.json beside it."""

    def __init__(self, path: Path):
        super().__init__(path, COLUMNS)

    def info(self, **facts) -> None:
        (self.path.parent / "run_info.json").write_text(json.dumps(facts, indent=2))

    def train(self, **row) -> None:
        self.write({"kind": "train", **row})

    def evaluation(self, **row) -> None:
        self.write({"kind": "eval", **row})


def read_metrics(path: Path) -> list[dict]:
    if not path.exists():
        return []
    with path.open(newline="") as f:
        return [{k: _num(v) for k, v in row.items()} for row in csv.DictReader(f)]


def _num(v: str):
    if v in ("", None):
        return None
    try:
        f = float(v)
    except ValueError:
        return v
    return int(f) if f.is_integer() and "." not in v and "e" not in v else f


def rss_mb() -> float:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def matmul_peak(threads: int, dtype, *, size: int = 1024, seconds: float = 1.0) -> float:
    """FLOP/s of a square matmul on ``threads`` threads in ``dtype``: the ceiling MFU is measured against.

    Cached per machine, thread count and dtype in ~/.cache/sparklm/peak.json (it costs ~1-2 s).
    """
    cache = cache_dir("peak.json")
    key = f"{_cpu_model()}|{threads}|{dtype}"
    try:
        known = json.loads(cache.read_text())
    except (OSError, ValueError):
        known = {}
    if key in known:
        return float(known[key])
    import torch  # here, not at the top: the driver imports this module and never needs torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    a = torch.randn(size, size, dtype=dtype)
    b = torch.randn(size, size, dtype=dtype)
    for _ in range(3):
        a @ b
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        a @ b
        n += 1
    peak = 2 * size**3 * n / (time.perf_counter() - t0)
    torch.set_num_threads(before)
    known[key] = peak
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        cache.write_text(json.dumps(known, indent=2))
    except OSError:
        pass
    return peak


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"
