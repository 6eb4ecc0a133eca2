"""The training core: one process, one rank. Readable top to bottom.

Distribution is a few guarded lines (``world > 1``): DDP wraps the model, ranks stream their
slice of every global batch, and a tiny all-reduce keeps them agreeing on when to stop.
"""

from __future__ import annotations

import ctypes
import math
import os
import platform
import shutil
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..config import Config
from ..data.manifest import PreparedDataset
from ..data.stream import TokenStream, row_groups, validation_rows
from ..data.tokenizer import TokenizerSpec, token_byte_lengths
from ..errors import SparklmError
from ..model import build_model, flops_per_token, load_model, param_count
from . import checkpoint
from .metrics import MetricsWriter, matmul_peak, rss_mb
from .report import write_samples


@dataclass(frozen=True)
class Rank:
    rank: int = 0
    world: int = 1
    threads: int = 1


def train(config: Config, dataset: PreparedDataset, spec: TokenizerSpec, run_dir: Path, *, rank: Rank = Rank(),
          resume: bool = False) -> dict:
    """Train on ``dataset`` and write checkpoints, metrics and ``model/`` into ``run_dir`` (rank 0)."""
    tc = config.train
    torch.set_num_threads(rank.threads)
    _keep_freed_memory()
    is_main = rank.rank == 0
    seq_len = dataset.seq_len
    dtype = _autocast_dtype(tc.dtype, rank.threads)

    # -- model and optimizer -----------------------------------------------------------------
    model = _model(config, spec, seq_len)
    n_params = param_count(model)
    flops_tok = flops_per_token(model, seq_len)
    optimizer = _optimizer(model, config)
    step, position, tokens_seen, elapsed_before = 0, 0, 0, 0.0
    ckpt_dir = run_dir / "checkpoints"
    if resume and (last := checkpoint.latest(ckpt_dir)) is not None:
        state, rng = checkpoint.load(last, model=model, optimizer=optimizer)
        if state["world"] != rank.world:
            raise SparklmError(f"checkpoint {last} was written by {state['world']} workers, not {rank.world}",
                               hint="resume with the same --workers")
        step, position, tokens_seen, elapsed_before = (state["step"], state["position"], state["tokens_seen"],
                                                       state["elapsed"])
        torch.set_rng_state(rng[f"torch.{rank.rank}"])
    net = torch.nn.parallel.DistributedDataParallel(model) if rank.world > 1 else model
    if tc.compile:
        net = torch.compile(net)

    # -- data ----------------------------------------------------------------------------------
    train_groups = row_groups(dataset.files("train"), config.storage)
    val_groups = row_groups(dataset.files("validation"), config.storage)
    rows_per_step = tc.batch_size * rank.world * tc.grad_accum
    total_steps = _total_steps(config, dataset, rows_per_step, seq_len)
    if sum(g.rows for g in train_groups) < tc.batch_size * rank.world:
        raise SparklmError(f"the training split has {sum(g.rows for g in train_groups)} sequences, fewer than one "
                           f"global batch ({tc.batch_size} x {rank.world} workers)",
                           hint="lower train.batch_size or --workers, or prepare more text / a shorter --seq-len")
    batches = iter(TokenStream(train_groups, seq_len=seq_len, batch_size=tc.batch_size, rank=rank.rank,
                               world=rank.world, seed=tc.seed, window=tc.window_row_groups, start=position,
                               storage=config.storage))
    byte_lengths = torch.tensor(token_byte_lengths(spec), dtype=torch.float64)

    metrics = MetricsWriter(run_dir / "metrics.csv") if is_main else None
    peak = matmul_peak(rank.threads, dtype) if is_main else 1.0
    if is_main:
        metrics.info(params=n_params, flops_per_token=flops_tok, total_steps=total_steps, peak_flops=peak,
                     dtype=str(dtype).replace("torch.", ""), workers=rank.world, threads=rank.threads)

    # -- the loop --------------------------------------------------------------------------------
    t_start = time.time() - elapsed_before
    last_log, last_tokens, last_step = time.time(), tokens_seen, step
    last_eval: dict = {}
    while step < total_steps:
        progress_frac = _progress(step, total_steps, time.time() - t_start, tc.time_budget, rank)
        if progress_frac >= 1.0:
            break
        lr = _lr(step, progress_frac, tc)
        for group in optimizer.param_groups:
            group["lr"] = lr
        loss_sum, grad_norm = train_step(net, model, optimizer, batches, tc=tc, dtype=dtype, world=rank.world)
        step += 1
        position += rows_per_step
        tokens_seen += rows_per_step * seq_len

        if rank.world > 1:  # report the global mean loss
            dist.all_reduce(loss_sum)
            loss_sum /= rank.world
        if is_main and (step % tc.log_every == 0 or step == 1):
            now = time.time()
            tps = (tokens_seen - last_tokens) / max(now - last_log, 1e-9)
            metrics.train(step=step, epoch=tokens_seen / max(dataset.manifest["splits"]["train"]["tokens"], 1),
                          tokens=tokens_seen, loss=loss_sum.item(), lr=lr, grad_norm=float(grad_norm),
                          tokens_per_s=tps, ms_per_step=1000 * (now - last_log) / max(step - last_step, 1),
                          mfu=tps * flops_tok / (peak * rank.world), rss_mb=rss_mb(), elapsed=now - t_start)
            last_log, last_tokens, last_step = now, tokens_seen, step
        if tc.eval_every and step % tc.eval_every == 0 and step < total_steps:
            last_eval = evaluate(model, val_groups, seq_len, tc, rank, dtype, byte_lengths, config)
            if is_main:
                metrics.evaluation(step=step, tokens=tokens_seen, **last_eval)
        if tc.checkpoint_every and step % tc.checkpoint_every == 0 and step < total_steps:
            _save(ckpt_dir, step, model, optimizer, rank, position, tokens_seen, time.time() - t_start, tc)

    # -- the end: evaluate, checkpoint, export ---------------------------------------------------
    elapsed = time.time() - t_start
    last_eval = evaluate(model, val_groups, seq_len, tc, rank, dtype, byte_lengths, config)
    if is_main:
        metrics.evaluation(step=step, tokens=tokens_seen, **last_eval)
    _save(ckpt_dir, step, model, optimizer, rank, position, tokens_seen, elapsed, tc)
    if is_main:
        _export(model, spec, run_dir / "model")
        metrics.close()
        write_samples(model, run_dir, dataset, config)
    _trim_memory()
    return {"steps": step, "tokens": tokens_seen, "seconds": elapsed, "params": n_params,
            "flops_per_token": flops_tok, "final": last_eval, "peak_flops": peak,
            "dtype": str(dtype).replace("torch.", "")}


def train_step(net, model, optimizer, batches, *, tc, dtype, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One optimizer step over ``tc.grad_accum`` micro-batches (lr already set); returns (loss, grad norm).

    Shared by every strategy, so one worker of a round trains exactly like the single-process loop.
    """
    loss_sum = torch.zeros(())
    for micro in range(tc.grad_accum):
        ids, mask = next(batches)
        x = torch.from_numpy(ids)
        labels = x.masked_fill(torch.from_numpy(mask) == 0, -100) if mask is not None else x
        attn = torch.from_numpy(mask).long() if mask is not None else None
        sync = world == 1 or micro == tc.grad_accum - 1
        ctx = net.no_sync() if not sync and hasattr(net, "no_sync") else nullcontext()
        with ctx, torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
            loss = net(input_ids=x, attention_mask=attn, labels=labels).loss / tc.grad_accum
        loss.backward()
        loss_sum += loss.detach().float()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), tc.grad_clip or float("inf"))
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss_sum, grad_norm


def evaluate(net, groups, seq_len: int, tc, rank: Rank, dtype, byte_lengths: torch.Tensor, config) -> dict:
    """Loss, perplexity, bits per byte and next-token accuracy over (a part of) the validation split.

    ``net`` is the bare model, not the DDP wrapper: ranks may hold different numbers of validation
    rows, and DDP may run a collective on every forward; one all-reduce at the end sums the parts.
    """
    if not groups:
        return {}
    sums = eval_sums(net, groups, seq_len, tc, rank, dtype, byte_lengths, config)
    if rank.world > 1:
        dist.all_reduce(sums)
    return eval_metrics(sums.tolist())


@torch.no_grad()
def eval_sums(net, groups, seq_len: int, tc, rank: Rank, dtype, byte_lengths: torch.Tensor, config) -> torch.Tensor:
    """[nats, tokens, bytes, correct] over this rank's part of the validation split (row i → rank i mod world)."""
    net.eval()
    limit = tc.eval_batches * tc.batch_size if tc.eval_batches else None
    sums = torch.zeros(4, dtype=torch.float64)
    for ids, mask in validation_rows(groups, seq_len=seq_len, rank=rank.rank, world=rank.world, limit=limit,
                                     storage=config.storage):
        for i in range(0, len(ids), tc.batch_size):
            x = torch.from_numpy(ids[i:i + tc.batch_size])
            m = torch.from_numpy(mask[i:i + tc.batch_size]) if mask is not None else torch.ones_like(x)
            with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
                logits = net(input_ids=x, attention_mask=m.long()).logits
            logits, target, valid = logits[:, :-1].float(), x[:, 1:], m[:, 1:].bool()
            nats = F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1), reduction="none")
            valid = valid.reshape(-1)
            sums[0] += nats[valid].double().sum()
            sums[1] += valid.sum()
            sums[2] += byte_lengths[target.reshape(-1)[valid]].sum()
            sums[3] += (logits.argmax(-1).reshape(-1)[valid] == target.reshape(-1)[valid]).sum()
    net.train()
    return sums


def eval_metrics(sums: list[float]) -> dict:
    nats, tokens, nbytes, correct = sums
    if tokens == 0:
        return {}
    loss = nats / tokens
    return {"val_loss": loss, "val_ppl": math.exp(min(loss, 50)), "val_bpb": nats / max(nbytes, 1) / math.log(2),
            "val_acc": correct / tokens, "val_tokens": int(tokens)}


# -- helpers ----------------------------------------------------------------------------------


def _model(config: Config, spec: TokenizerSpec, seq_len: int) -> torch.nn.Module:
    vocab = spec.vocab_size
    if config.model.init_from:
        model = load_model(config.model.init_from)
        if model.get_input_embeddings().weight.shape[0] < vocab:
            raise SparklmError(f"{config.model.init_from} has a vocabulary of "
                               f"{model.get_input_embeddings().weight.shape[0]} tokens, the data's tokenizer {vocab}",
                               hint="prepare the data with --tokenizer pointing at that model's tokenizer")
        return model
    # Round the embedding table up to a multiple of 64: faster matmuls, unused rows are never targets.
    return build_model(config.model, vocab_size=64 * math.ceil(vocab / 64), context=seq_len, bos_id=spec.bos_id,
                       eos_id=spec.eos_id, pad_id=spec.pad_id, seed=config.train.seed)


def _optimizer(model: torch.nn.Module, config: Config) -> torch.optim.Optimizer:
    tc = config.train
    embed = {id(model.get_input_embeddings().weight)}
    decay = [p for p in model.parameters() if p.dim() >= 2 and id(p) not in embed]
    other = [p for p in model.parameters() if p.dim() < 2 or id(p) in embed]
    groups = [{"params": decay, "weight_decay": tc.weight_decay}, {"params": other, "weight_decay": 0.0}]
    # The fused kernel: one pass over all parameters (on CPU 5x faster than foreach: 10 vs 51 ms per
    # step at 11M parameters here).
    return torch.optim.AdamW(groups, lr=tc.lr, betas=(tc.beta1, tc.beta2), fused=True)


def _total_steps(config: Config, dataset: PreparedDataset, rows_per_step: int, seq_len: int) -> int:
    tc = config.train
    train_rows = dataset.manifest["splits"]["train"]["sequences"]
    candidates = []
    if tc.max_steps:
        candidates.append(tc.max_steps)
    if tc.epochs:
        candidates.append(math.ceil(tc.epochs * train_rows / rows_per_step))
    if tc.max_tokens:
        candidates.append(math.ceil(tc.max_tokens / (rows_per_step * seq_len)))
    if not candidates:
        if tc.time_budget:
            return 10**12  # the time budget ends the run
        candidates.append(math.ceil(train_rows / rows_per_step))  # one epoch
    return max(1, min(candidates))


def _progress(step: int, total: int, elapsed: float, budget: float, rank: Rank) -> float:
    """Fraction of the run done: by steps, or by time when there is a time budget (ranks agree)."""
    frac = step / total if total < 10**12 else 0.0
    if budget:
        t = torch.tensor([elapsed / budget])
        if rank.world > 1:
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        frac = max(frac, float(t))
    return frac


def _lr(step: int, frac: float, tc) -> float:
    if step < tc.warmup_steps:
        return tc.lr * (step + 1) / tc.warmup_steps
    floor = tc.lr * tc.min_lr_ratio
    return floor + 0.5 * (tc.lr - floor) * (1 + math.cos(math.pi * min(frac, 1.0)))


def _autocast_dtype(name: str, threads: int) -> torch.dtype:
    """``auto`` picks bf16 autocast only where bf16 matmuls measure clearly faster than fp32.

    CPU flags are not enough: on this project's 2-core AVX-512-BF16 machines bf16 matmuls ran at
    ~0.6x fp32 and training slowed down, so the choice follows a (cached) measurement.
    """
    if name == "float32":
        return torch.float32
    if name == "bfloat16":
        return torch.bfloat16
    fast = matmul_peak(threads, torch.bfloat16) > 1.3 * matmul_peak(threads, torch.float32)
    return torch.bfloat16 if fast else torch.float32


def _keep_freed_memory() -> None:
    """glibc: keep freed memory in the process instead of handing it back to the OS every step.

    By default glibc serves blocks above a (dynamic, ≤32 MB) threshold with mmap and returns them on
    free, so every step page-faults its largest tensors (logits, their gradients, activations) in
    again: millions of page faults a minute. Raising the mmap and trim thresholds made training
    steps 15-25% faster here (benchmarks/train_throughput.py), for ~15% more peak RSS (freed blocks
    stay mapped for the next step). ``_trim_memory`` hands the memory back at the end.
    """
    if (libc := _glibc()) is not None:
        libc.mallopt(-3, 1 << 30)  # M_MMAP_THRESHOLD: 1 GiB
        libc.mallopt(-1, (1 << 31) - 1)  # M_TRIM_THRESHOLD: 2 GiB


def _trim_memory() -> None:
    if (libc := _glibc()) is not None:
        libc.malloc_trim(0)


def _glibc():
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


def _save(ckpt_dir: Path, step: int, model, optimizer, rank: Rank, position: int, tokens: int, elapsed: float, tc):
    rng = torch.get_rng_state()
    states = [rng] * rank.world
    if rank.world > 1:
        gathered: list = [None] * rank.world
        dist.all_gather_object(gathered, rng)
        states = gathered
    if rank.rank == 0:
        checkpoint.save(ckpt_dir, step, model=model, optimizer=optimizer, keep=tc.keep_checkpoints,
                        state={"position": position, "tokens_seen": tokens, "elapsed": elapsed, "world": rank.world},
                        rng={f"torch.{r}": s for r, s in enumerate(states)})
    if rank.world > 1:
        dist.barrier()


def _export(model, spec: TokenizerSpec, directory: Path) -> None:
    """model/ in HF format: config, model.safetensors, tokenizer files, generation config."""
    tmp = directory.with_name(f".{directory.name}-tmp-{os.getpid()}")
    model.generation_config.bos_token_id = spec.bos_id
    model.generation_config.eos_token_id = spec.eos_id
    model.generation_config.pad_token_id = spec.pad_id
    model.save_pretrained(str(tmp), safe_serialization=True)
    spec.save(tmp)
    if directory.exists():
        shutil.rmtree(directory)
    tmp.rename(directory)



