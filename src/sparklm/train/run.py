"""``sparklm train``: a prepared dataset → a run directory, trained by ranks on Spark tasks.

The driver checks the inputs, writes the resolved ``config.json``, starts the ranks, follows
rank 0's ``metrics.csv`` to show live progress, then writes ``summary.json`` and ``loss.png``
(rank 0 writes ``model/`` and ``samples.txt``).
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

from .. import __version__, progress
from ..config import Config, StorageConfig, from_dict
from ..data.manifest import PreparedDataset, load_prepared
from ..data.tokenizer import TokenizerSpec, from_tokenizer
from ..errors import SparklmError
from ..fs import effective, resolve
from .metrics import read_metrics
from .report import plot_loss


def dataset_tokenizer(dataset: PreparedDataset, storage: StorageConfig | None = None) -> TokenizerSpec:
    """The tokenizer a prepared dataset was made with, with its special ids from the manifest."""
    from tokenizers import Tokenizer

    fs, path = resolve(dataset.uri, storage)
    with fs.open_input_stream(f"{path}/tokenizer.json") as f:
        tok = Tokenizer.from_str(f.read().decode("utf-8"))
    t = dataset.manifest["tokenizer"]
    names = [tok.id_to_token(t[k]) for k in ("bos_id", "eos_id", "pad_id")]
    spec = from_tokenizer(tok, *names)
    if spec.sha256 != t["sha256"]:
        raise SparklmError(f"{dataset.uri}/tokenizer.json does not match its manifest (fingerprint differs)",
                           hint="prepare the dataset again; do not edit its files")
    return spec


def train(data: str | None, *, output: str, config: Config | None = None, resume: bool = False, spark=None) -> dict:
    """Train a model on a prepared dataset into ``output`` (a run directory); return the summary."""
    from ..spark import get_session
    from .strategies import averaging, ddp

    run_dir = Path(output)
    if resume:
        saved = run_dir / "config.json"
        if not saved.is_file():
            raise SparklmError(f"cannot resume: {saved} not found", hint="pass the run directory of an earlier run")
        meta = json.loads(saved.read_text())
        base = from_dict(meta["config"])
        config = base.replace(train=config.train) if config is not None else base  # a new budget may extend it
        data = data or meta["data"]
        _check_resumable(run_dir, config)
    elif (run_dir / "config.json").exists() or (run_dir / "checkpoints").exists():
        raise SparklmError(f"run directory {run_dir} already holds a run",
                           hint="use --resume to continue it, or another --output")
    config = config or Config()
    config = config.replace(storage=effective(config.storage))
    if not data:
        raise SparklmError("no prepared dataset given", hint="pass --data DIR (made by `sparklm prepare`)")
    dataset = load_prepared(data, config.storage)
    spec = dataset_tokenizer(dataset, config.storage)
    _check_init_from(config, spec)
    if dataset.manifest["splits"]["train"]["sequences"] == 0:
        raise SparklmError(f"{data} has no training sequences", hint="prepare more text or a shorter --seq-len")
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(json.dumps(
        {"config": config.to_dict(), "data": data, "sparklm_version": __version__}, indent=2))

    t_spark = time.time()
    spark = spark() if callable(spark) else get_session(config.spark, spark=spark)
    spark_start = time.time() - t_spark
    job = {"config": config.to_dict(), "data": data, "run_dir": str(run_dir.resolve()), "resume": resume}
    tc = config.train
    label = f"train: {tc.strategy}, {tc.workers} worker{'s' * (tc.workers > 1)}"
    if tc.strategy != "ddp":
        label += f", sync every {tc.sync_every} steps"
    t0 = time.time()
    if tc.strategy == "ddp":
        follower = _Follower(run_dir / "metrics.csv")  # the ranks write metrics.csv; the driver shows it
        follower.start()
        try:
            with progress.stage(spark, label, quiet=True):
                result = ddp.run(spark, job, workers=tc.workers, threads=tc.threads, log_dir=str(run_dir / "logs"))
        finally:
            follower.stop()
        result["bytes_communicated"] = _allreduce_bytes(result, tc.workers)
    else:
        with progress.stage(spark, label, quiet=True):
            result = averaging.run(spark, job, workers=tc.workers,
                                   threads=tc.threads or averaging.default_threads(spark, tc.workers), run_dir=run_dir)
    summary = _summary(run_dir, config, dataset, result, spark, time.time() - t0, spark_start)
    plot_loss(run_dir / "metrics.csv", run_dir / "loss.png")
    final = summary["final"]
    if final:
        progress.info(f"validation: loss {final['val_loss']:.3f}, perplexity {final['val_ppl']:.1f}, "
                      f"{final['val_bpb']:.3f} bits/byte, accuracy {final['val_acc']:.1%}")
    return summary


def _check_resumable(run_dir: Path, config: Config) -> None:
    """The newest checkpoint must come from the same strategy (and, in rounds, the same sync_every)."""
    # checkpoint.latest() without importing torch on the driver
    done = sorted(p for p in (run_dir / "checkpoints").glob("step-*") if (p / "state.json").is_file())
    if not done:
        return  # killed before its first checkpoint: the run starts again from the beginning
    state = json.loads((done[-1] / "state.json").read_text())
    was = state.get("strategy", "ddp")
    if was != config.train.strategy:
        raise SparklmError(f"{done[-1]} was written by strategy {was}, not {config.train.strategy}",
                           hint=f"resume with --strategy {was}")


def _allreduce_bytes(result: dict, workers: int) -> int:
    """DDP's traffic, computed (gloo has no counters): a ring all-reduce of the fp32 gradients per step
    sends 2·(N−1)/N of them from each of the N ranks."""
    return int(result["steps"] * 2 * (workers - 1) * 4 * (result.get("params") or 0))


def _check_init_from(config: Config, spec: TokenizerSpec) -> None:
    if not config.model.init_from:
        return
    path = Path(config.model.init_from)
    if not (path / "tokenizer.json").is_file():
        return
    from ..data.tokenizer import load

    if load(str(path)).sha256 != spec.sha256:
        raise SparklmError(f"the tokenizer of {path} differs from the dataset's",
                           hint=f"prepare the data with --tokenizer {path}")


def _summary(run_dir: Path, config: Config, dataset: PreparedDataset, result: dict, spark, seconds: float,
             spark_start: float) -> dict:
    rows = read_metrics(run_dir / "metrics.csv")
    train_rows = [r for r in rows if r["kind"] == "train"]
    steady = train_rows[len(train_rows) // 4:] or train_rows  # skip warm-up for the steady-state figures
    epoch_tokens = dataset.manifest["splits"]["train"]["tokens"]
    summary = {
        "final": result.get("final", {}),
        "steps": result["steps"], "tokens": result["tokens"], "epochs": result["tokens"] / max(epoch_tokens, 1),
        "train_seconds": result["seconds"], "wall_seconds": seconds, "spark_start_seconds": spark_start,
        "seconds_per_epoch": result["seconds"] / max(result["tokens"] / max(epoch_tokens, 1), 1e-9),
        "tokens_per_s": _mean(steady, "tokens_per_s"), "ms_per_step": _mean(steady, "ms_per_step"),
        "mfu": _mean(steady, "mfu"), "peak_rss_mb": max((r["rss_mb"] or 0 for r in train_rows), default=0),
        "params": result["params"], "flops_per_token": result["flops_per_token"],
        "peak_flops": result["peak_flops"], "dtype": result["dtype"],
        "workers": config.train.workers, "strategy": config.train.strategy,
        "bytes_communicated": result.get("bytes_communicated"),
        **{k: result[k] for k in ("rounds", "bytes_broadcast", "bytes_returned") if k in result},
        "spark_application_id": spark.sparkContext.applicationId,
        "spark_master": spark.sparkContext.master, "sparklm_version": __version__,
    }
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def _mean(rows: list[dict], key: str) -> float | None:
    vals = [r[key] for r in rows if r.get(key) is not None]
    return sum(vals) / len(vals) if vals else None


class _Follower:
    """Prints rank 0's progress from metrics.csv while the ranks run."""

    def __init__(self, path: Path):
        self.path, self.seen, self._stop = path, 0, threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self.seen = len(read_metrics(self.path))
        self.thread.start()

    def stop(self) -> None:
        self._stop.set()
        self.thread.join()
        self._show()

    def _run(self) -> None:
        while not self._stop.wait(1.0):
            self._show()

    def _show(self) -> None:
        try:
            info = json.loads((self.path.parent / "run_info.json").read_text())
        except (OSError, ValueError):
            info = {}
        rows = read_metrics(self.path)
        for r in rows[self.seen:]:
            progress.info(_line(r, info))
        self.seen = len(rows)


def _line(r: dict, info: dict) -> str:
    if r["kind"] == "eval":
        return (f"  eval step {r['step']}: val loss {r['val_loss']:.3f} | ppl {r['val_ppl']:.1f} | "
                f"{r['val_bpb']:.3f} bits/byte | acc {r['val_acc']:.1%}")
    total = info.get("total_steps") or 0
    of = f"/{total}" if total and total < 10**12 else ""
    eta = ""
    if of and r.get("ms_per_step"):
        eta = f" | ETA {_hms((total - r['step']) * r['ms_per_step'] / 1000)}"
    return (f"step {r['step']}{of} | loss {r['loss']:.3f} | lr {r['lr']:.2e} | {r['tokens_per_s']:,.0f} tok/s | "
            f"{r['ms_per_step']:.0f} ms/step | MFU {r['mfu']:.0%} | {r['elapsed']:.0f}s{eta}")


def _hms(seconds: float) -> str:
    m, s = divmod(int(seconds), 60)
    return f"{m}m{s:02d}s" if m else f"{s}s"
