"""One worker's part of a round (strategies ``average`` and ``diloco``), run inside a plain Spark task.

The task gets the global weights, optionally evaluates them on its part of the validation split,
runs ``steps`` inner AdamW steps on its shard of the training data and returns its delta
(``global − local``). Everything it computes is a function of (job, round, worker id): the data
rows come from the same pure global order as every other strategy (worker w takes slice w of each
global batch), the learning rate from the global step, dropout from (seed, step, worker), and the
inner optimizer state from the worker's own previous round. So when Spark retries a lost task,
the retry recomputes the same delta.

Inner optimizer state (``train.inner_state = "keep"``) stays with the worker id, not the driver:
a file per worker and round in the executor's temporary directory, read by the next round's task
for that worker. Only checkpoints copy it into the run directory (so ``--resume`` is exact). A
task that does not find its state (its executor was lost, or the previous round dropped it)
starts from a fresh AdamW state and says so (``cold``) in the round's metrics.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load as load_bytes
from safetensors.torch import save_file

from ..config import from_dict
from ..data.manifest import load_prepared
from ..data.stream import TokenStream, row_groups
from ..data.tokenizer import token_byte_lengths
from ..model import flops_per_token, param_count
from .loop import (Rank, _autocast_dtype, _export, _keep_freed_memory, _lr, _model, _optimizer, eval_sums,
                   train_step)
from .metrics import matmul_peak, rss_mb

_CACHE: dict = {}  # per Python worker: the job's parsed inputs and model object, reused across rounds


def run_worker(job: dict, worker: int, weights: bytes, rnd: dict, *, attempt: int = 0) -> dict:
    """Run ``worker``'s part of round ``rnd`` from the serialized global ``weights``; return its result.

    The result holds ``delta`` (name → float32 array, already multiplied by ``weight`` = this worker's
    tokens / the tokens planned per worker), the eval sums, and the worker's figures.
    """
    t_task = time.time()
    threads = job["threads"]
    torch.set_num_threads(threads)
    _keep_freed_memory()
    ctx = _context(job)
    config, model, dataset = ctx["config"], ctx["model"], ctx["dataset"]
    tc, seq_len = config.train, dataset.seq_len
    dtype = _autocast_dtype(tc.dtype, threads)

    t0 = time.time()
    global_w = load_bytes(weights)
    _load_weights(model, global_w)
    out: dict = {"worker": worker, "attempt": attempt, "tokens": 0, "weight": 0.0, "losses": [], "cold": False,
                 "load_s": time.time() - t0}
    if worker == 0 and rnd["round"] == 0:
        out["facts"] = {"params": param_count(model), "flops_per_token": flops_per_token(model, seq_len),
                        "peak_flops": matmul_peak(threads, dtype), "dtype": str(dtype).replace("torch.", ""),
                        "threads": threads}
    if rnd["eval"]:
        sums = eval_sums(model, ctx["val_groups"], seq_len, tc, Rank(worker, job["world"]), dtype,
                         ctx["byte_lengths"], config)
        out["eval_sums"] = sums.tolist()

    t0 = time.time()
    steps = rnd["steps"]
    state_dir = Path(tempfile.gettempdir()) / "sparklm-inner" / job["uid"]
    if steps:
        optimizer = _optimizer(model, config)
        if tc.inner_state == "keep" and rnd["step0"] > 0:
            out["cold"] = not _load_inner(optimizer, _inner_sources(job, worker, rnd["step0"], state_dir))
        torch.manual_seed(_seed(tc.seed, rnd["step0"], worker))  # dropout: a function of (seed, step, worker)
        shard_rank, shard_world = job["shards"][worker]
        rows_per_step = tc.batch_size * tc.grad_accum * shard_world
        stream = TokenStream(ctx["train_groups"], seq_len=seq_len, batch_size=tc.batch_size, rank=shard_rank,
                             world=shard_world, seed=tc.seed, window=tc.window_row_groups,
                             start=rnd["step0"] * rows_per_step, storage=config.storage)
        seen = [0]  # tokens trained on, padding excluded: the worker's weight in the average
        batches = _counted(iter(stream), seen)
        model.train()
        for i in range(steps):
            step = rnd["step0"] + i
            lr = _lr(step, _fraction(step, rnd, i), tc)
            for group in optimizer.param_groups:
                group["lr"] = lr
            loss, grad_norm = train_step(model, model, optimizer, batches, tc=tc, dtype=dtype, world=1)
            out["losses"].append(float(loss))
        out.update(lr=lr, grad_norm=float(grad_norm))
        # weight = tokens / the tokens of a full, unpadded round: exactly 1.0 for unpadded data, so a
        # one-worker round leaves its delta bit for bit unchanged
        out["tokens"] = seen[0]
        out["weight"] = seen[0] / (steps * tc.batch_size * tc.grad_accum * seq_len)
        with torch.no_grad():
            out["delta"] = {n: (global_w[n] - p.detach()).mul_(out["weight"]).numpy()
                            for n, p in model.named_parameters()}
        out["delta_bytes"] = sum(a.nbytes for a in out["delta"].values())
        if tc.inner_state == "keep":
            _save_inner(optimizer, state_dir / f"w{worker}-step{rnd['step0'] + steps:07d}.safetensors")
            _prune_inner(state_dir, worker, rnd["step0"])
    out["compute_s"] = time.time() - t0

    if rnd["persist"] and tc.inner_state == "keep":  # a checkpoint round: copy the state beside the checkpoint
        src = state_dir / f"w{worker}-step{rnd['step0'] + steps:07d}.safetensors"
        if src.is_file():
            dst = Path(rnd["persist"]) / f"w{worker}.safetensors"
            dst.parent.mkdir(parents=True, exist_ok=True)
            tmp = dst.with_name(f".{dst.name}.{os.getpid()}")
            tmp.write_bytes(src.read_bytes())
            tmp.replace(dst)
    if rnd["finish"]:
        if worker == 0:
            from .report import write_samples

            spec = ctx["spec"]
            run_dir = Path(job["run_dir"])
            _export(model, spec, run_dir / "model")
            write_samples(model, run_dir, dataset, config)
        for f in state_dir.glob(f"w{worker}-*"):
            f.unlink(missing_ok=True)
    out["rss_mb"] = rss_mb()
    out["task_s"] = time.time() - t_task
    return out


def _context(job: dict) -> dict:
    """The job's config, dataset, tokenizer, row groups and model, built once per Python worker."""
    key = job["uid"]
    if key not in _CACHE:
        from .run import dataset_tokenizer

        _CACHE.clear()
        config = from_dict(job["config"])
        dataset = load_prepared(job["data"], config.storage)
        spec = dataset_tokenizer(dataset, config.storage)
        _CACHE[key] = {
            "config": config, "dataset": dataset, "spec": spec,
            "model": _model(config, spec, dataset.seq_len),
            "train_groups": row_groups(dataset.files("train"), config.storage),
            "val_groups": row_groups(dataset.files("validation"), config.storage),
            "byte_lengths": torch.tensor(token_byte_lengths(spec), dtype=torch.float64),
        }
    return _CACHE[key]


def _counted(batches, seen: list[int]):
    for ids, mask in batches:
        seen[0] += ids.size if mask is None else int(mask.sum())
        yield ids, mask


def _fraction(step: int, rnd: dict, i: int) -> float:
    """The schedule's progress at ``step``: by steps, or by time as the driver projected it for this round."""
    frac = step / rnd["total_steps"] if rnd["total_steps"] < 10**12 else 0.0
    if rnd["time_frac0"] is not None:
        frac = max(frac, rnd["time_frac0"] + i * rnd["time_frac_per_step"])
    return frac


def _seed(seed: int, step: int, worker: int) -> int:
    return (seed * 1_000_003 + step * 7919 + worker) % (2**63)


def _load_weights(model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(weights[n])


def _inner_sources(job: dict, worker: int, step: int, state_dir: Path) -> list[Path]:
    sources = [state_dir / f"w{worker}-step{step:07d}.safetensors"]
    if job.get("inner_from") and job.get("inner_from_step") == step:  # resuming from a checkpoint
        sources.append(Path(job["inner_from"]) / "inner" / f"w{worker}.safetensors")
    return sources


def _save_inner(optimizer: torch.optim.Optimizer, path: Path) -> None:
    from .checkpoint import _optimizer_tensors

    tensors, groups = _optimizer_tensors(optimizer)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    save_file(tensors, str(tmp), metadata={"param_groups": json.dumps(groups)})
    tmp.replace(path)


def _load_inner(optimizer: torch.optim.Optimizer, sources: list[Path]) -> bool:
    from .checkpoint import _optimizer_state

    for path in sources:
        if not path.is_file():
            continue
        with safe_open(str(path), framework="pt") as f:
            groups = json.loads(f.metadata()["param_groups"])
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        optimizer.load_state_dict(_optimizer_state(tensors, groups))
        return True
    return False


def _prune_inner(state_dir: Path, worker: int, keep_from: int) -> None:
    """Drop this worker's states older than the round's start (a retry of this round still needs that one)."""
    for f in state_dir.glob(f"w{worker}-step*.safetensors"):
        if int(f.stem.rsplit("step", 1)[1]) < keep_from:
            f.unlink(missing_ok=True)

