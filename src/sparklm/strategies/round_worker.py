"""One worker's part of a round (strategies ``average`` and ``diloco``), run inside a plain Spark task.

The task gets the global weights, optionally evaluates them on its part of the validation split,
runs ``steps`` inner steps of the training core on its shard of the data and returns its delta
(``global − local``) over the task's trainable parameters. Everything it computes is a function of
(job, round, worker id): the data rows come from the same pure global order as every other strategy
(worker w takes slice w of each global batch), the learning rate from the global step, dropout from
(seed, step, worker), and the inner optimizer state from the worker's own previous round. So when
Spark retries a lost task, the retry recomputes the same delta.

Inner optimizer state (``train.rounds.inner_state = "keep"``) stays with the worker id, not the
driver: a file per worker and round in the executor's temporary directory, read by the next round's
task for that worker. Only checkpoints copy it into the run directory (so ``--resume`` is exact). A
task that does not find its state (its executor was lost, or the previous round dropped it) starts
from a fresh optimizer state and says so (``cold``) in the round's metrics.
"""

from __future__ import annotations

import functools
import json
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save as save_bytes

from ..data.manifest import load_prepared, load_tokenizer
from ..infra.cache import process_local
from ..infra.fs import delete, exists, join, list_names, local_path, read_bytes, write_bytes
from ..infra.private import host_dir
from ..model.task import Batch
from ..train import checkpoint, device
from ..train.core import Rank, Trainer, TrainState
from .base import BEST, Job, RoundSpec, WorkerResult
from .codec import Codec, MissingOwn, apply_update, decode, digest, needs_own


def run_worker(job: Job, worker: int, full: Callable[[], bytes] | None, spec: RoundSpec, *, attempt: int = 0,
               update: Callable[[], bytes] | None = None, gpu: str | None = None
               ) -> tuple[WorkerResult, dict[str, np.ndarray] | bytes | None]:
    """Run ``worker``'s part of round ``spec`` from the global weights (``full()``: serialized whole, None where the
    task was not given them; ``update()``: the changes since the weights of ``spec.base_step``; ``gpu``: the GPU
    address Spark assigned the task); return its figures and its delta (name → float32 array, already multiplied by
    the worker's weight; with a lossy codec, its encoded bytes), or None without steps. A worker that can build
    neither returns a ``stale`` result at once."""
    t_task = time.time()
    torch.set_num_threads(job.plan.threads)
    device.set_allocator(job.plan.config.train.allocator)
    # one per GPU: a Python worker Spark reuses may be handed another GPU by a later task
    trainer: Trainer = process_local(("rounds", job.uid, gpu), lambda: _trainer(job, gpu))
    # an elastic round's share of the global batch, as the driver planned it, else the plan's
    trainer.use(job.plan if spec.world is None else job.plan.at(spec.world))
    tc = trainer.tc
    codec = Codec(**job.plan.codec)  # decided on the driver
    t0 = time.time()
    trainable = trainer.task.trainable(trainer.model)
    state_dir = inner_dir(job.uid)
    state = InnerState(_inner_sources(job, spec, worker, state_dir), trainer.config.storage)
    global_w = global_weights(job, spec, full, update, hold=not codec.lossless, own=trainable, mine=state.sent)
    if global_w is None:  # neither the weights the update applies to nor the whole weights: the driver sends them
        return WorkerResult(worker=worker, attempt=attempt, stale=True, load_s=time.time() - t0), None
    with torch.no_grad():
        for n, p in trainable.items():
            p.copy_(global_w[n])
    out: dict = {"worker": worker, "attempt": attempt, "load_s": time.time() - t0}
    if worker == 0 and spec.round == 0:
        out["facts"] = {**trainer.facts(), "threads": job.threads}
    if spec.eval:
        out["eval_sums"] = tuple(trainer.eval_sums(worker, len(spec.shards)).tolist())

    t0 = time.time()
    # the state a worker keeps between rounds: its inner optimizer's (inner_state keep) and a lossy codec's residual
    stateful = tc.rounds.inner_state == "keep" or not codec.lossless
    delta = _train_round(job, trainer, codec, spec, worker, global_w, out, state_dir, state) if spec.steps else None
    out["compute_s"] = time.time() - t0

    if spec.persist and stateful:  # a checkpoint round: copy the state beside the checkpoint
        src = state_dir / _state_name(worker, spec.step0 + spec.steps)
        if src.is_file():
            write_bytes(join(spec.persist, f"w{worker}.safetensors"), src.read_bytes(), trainer.config.storage)
    if spec.finish:
        if worker == 0:
            best = {n[len(BEST):]: t for n, t in global_w.items() if n.startswith(BEST)}
            trainer.export(job.run_dir, best or None)
        for f in state_dir.glob(f"w{worker}-*"):
            f.unlink(missing_ok=True)
    return WorkerResult(**out, rss_mb=device.rss_mb(), peak_rss_mb=device.peak_rss_mb(),
                        task_s=time.time() - t_task), delta


def _train_round(job: Job, trainer: Trainer, codec: Codec, spec: RoundSpec, worker: int,
                 global_w: dict[str, torch.Tensor], out: dict, state_dir: Path, state: InnerState
                 ) -> dict[str, np.ndarray] | bytes:
    """The worker's inner steps from ``global_w`` (``state``: the one it kept last round), its figures added to
    ``out``; returns its weighted delta (encoded with a lossy codec, error feedback added), its inner state saved for
    its next round."""
    tc = trainer.tc
    keep_opt = tc.rounds.inner_state == "keep"
    stateful = keep_opt or not codec.lossless
    residual, sent = None, None
    trainer.optimizer = trainer.new_optimizer()
    if worker in spec.cold:
        out["cold"] = True
    elif stateful and spec.step0 > 0:
        found, residual = state.load(trainer.optimizer if keep_opt else None)
        out["cold"] = not found
    losses, last, hits, seen = _inner_steps(trainer, spec, worker)
    # weight = tokens / the tokens of a full, unpadded round: exactly 1.0 for unpadded data, so a
    # one-worker round leaves its delta bit for bit unchanged
    weight = seen / (spec.steps * tc.batch_size * tc.grad_accum * trainer.seq_len)
    trainable = trainer.task.trainable(trainer.model)
    with torch.no_grad():
        delta = {n: (global_w[n] - p.detach().cpu()).mul_(weight).numpy() for n, p in trainable.items()}
    sent_bytes = sum(a.nbytes for a in delta.values())
    if not codec.lossless:  # error feedback: what the codec drops now is sent in later rounds
        delta, residual = encode_with_feedback(codec, delta, residual, tc.rounds.residual_decay)
        sent_bytes = len(delta)
        # a forward downlink leaves a worker's own payload out of what it reads next round: it keeps it
        sent = delta if tc.rounds.downlink == "forward" else None
    out.update(losses=tuple(losses), grad_norm=last[0], lr=last[1], tokens=seen, weight=weight,
               correct=float(hits[0]), counted=float(hits[1]), delta_bytes=sent_bytes)
    if stateful:
        # hosts may share nothing: the next round of this worker may run on another one (shared dir)
        directories = [str(state_dir), *filter(None, [shared_inner_dir(job.run_dir)])]
        _save_inner(trainer.optimizer, [join(d, _state_name(worker, spec.step0 + spec.steps)) for d in directories],
                    trainer.config.storage, residual, sent)
        for d in directories:
            _prune_inner(d, worker, spec.step0, trainer.config.storage)
    return delta


def _inner_steps(trainer: Trainer, spec: RoundSpec, worker: int) -> tuple[list[float], tuple, torch.Tensor, int]:
    """The round's inner steps on the worker's shard: (losses, (last grad norm, lr), accuracy counts, tokens)."""
    tc = trainer.tc
    torch.manual_seed(_seed(tc.seed, spec.step0, worker))  # dropout: a function of (seed, step, worker)
    part, parts = spec.shards[worker]
    rows_per_step = tc.batch_size * tc.grad_accum * parts
    seen = [0]  # tokens trained on, padding excluded: the worker's weight in the average
    batches = _counted(trainer.batches(spec.step0 * rows_per_step, part=part, parts=parts), seen)
    trainer.state = TrainState(step=spec.step0)
    losses, last, hits = [], (0.0, 0.0), torch.zeros(2, dtype=torch.float64)
    for loss, grad_norm, lr, tally in trainer.run_steps(batches, spec.steps, spec.fraction, stop=False):
        losses.append(float(loss))
        last = (float(grad_norm), lr)
        hits += tally.double().cpu()
    return losses, last, hits, seen[0]


RESIDUAL = "residual/"  # the codec's residual beside the inner optimizer state, in the same file
SENT = "sent"  # and, with a forward downlink, the payload the worker sent (uint8)

_HELD: dict = {}  # this process's copy of the last global weights it received: {"uid", "step", "arrays"}


def global_weights(job: Job, spec: RoundSpec, full: Callable[[], bytes] | None, update: Callable[[], bytes] | None,
                   *, hold: bool, own: dict[str, torch.Tensor], mine: Callable[[], bytes | None] = lambda: None
                   ) -> dict[str, torch.Tensor] | None:
    """The round's global weights: at round 0, the worker's ``own`` weights when they
    are the driver's (``spec.initial_digest``); later, the update applied to this process's copy of the weights
    of ``spec.base_step`` when it holds them (``mine()``: the payload this worker sent last round, which a forward
    downlink leaves out); else the whole weights, or None when the task was given none (the driver then runs
    the worker again with them). With ``hold``, the result is kept for the next round's update (a copy of the
    trainable weights per Python worker)."""
    from safetensors.numpy import load

    held = _HELD if _HELD.get("uid") == job.uid else {}
    here = inner_dir(job.uid)  # this host's copy, for its other processes
    updatable = update is not None and spec.base_step is not None
    if updatable and held.get("step") != spec.base_step:
        held = _held_on_disk(here, spec.base_step)
    arrays = None
    if spec.initial_digest and digest(own) == spec.initial_digest:
        arrays = {n: p.detach().cpu().numpy().copy() for n, p in own.items()}
    elif updatable and held.get("step") == spec.base_step:
        payload = update()
        try:
            arrays = apply_update(held["arrays"], payload, own=mine() if needs_own(payload) else None)
        except MissingOwn:  # this worker's own payload is not on this host: the whole weights then
            pass
    if arrays is None:
        if full is None:
            return None
        payload = full()
        arrays = load(payload)
    _HELD.clear()
    if hold:
        _HELD.update(uid=job.uid, step=spec.step0, arrays={n: a for n, a in arrays.items() if not n.startswith(BEST)})
        _hold_on_disk(here, spec.step0, _HELD["arrays"])
    return {n: torch.from_numpy(a) for n, a in arrays.items()}


def _held_on_disk(directory: Path, step: int) -> dict:
    """The weights of ``step`` another Python worker of this host kept (a process Spark started since holds none in
    memory: without this copy it would need the whole weights sent), or {}."""
    from safetensors.numpy import load_file

    path = directory / f"held-step{step:07d}.safetensors"
    try:
        return {"step": step, "arrays": load_file(str(path))}
    except (OSError, ValueError):  # not there, or being replaced: the whole weights then
        return {}


def _hold_on_disk(directory: Path, step: int, arrays: dict[str, np.ndarray]) -> None:
    """Keep this host's copy of the weights of ``step`` (written once per host, atomically), and of the step before
    (a retried task of this round applies its update to those); older copies dropped."""
    import os

    from safetensors.numpy import save_file

    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"held-step{step:07d}.safetensors"
    if not path.exists():
        tmp = directory / f".{path.name}.{os.getpid()}"
        save_file({n: np.ascontiguousarray(a) for n, a in arrays.items()}, str(tmp))
        os.replace(tmp, path)
    for old in sorted(directory.glob("held-step*.safetensors"))[:-2]:
        old.unlink(missing_ok=True)


def encode_with_feedback(codec: Codec, delta: dict[str, np.ndarray], residual: dict[str, np.ndarray] | None,
                         decay: float) -> tuple[bytes, dict[str, np.ndarray]]:
    """Error feedback: the codec encodes the delta plus the decayed remainder of earlier rounds, and what it did not
    deliver becomes the new remainder. Returns (the encoded bytes, the new residual)."""
    total = {n: d + decay * residual[n] if residual is not None and n in residual else d.copy()
             for n, d in delta.items()}
    payload = codec.encode(total)
    sent = decode(payload)
    return payload, {n: total[n] - sent[n] for n in total}


def _trainer(job: Job, gpu: str | None) -> Trainer:
    """The job's dataset, tokenizer and model, built once per Python worker (and GPU) and reused across rounds."""
    plan = job.plan
    dataset = load_prepared(job.data, plan.config.storage)
    return Trainer(plan, dataset, load_tokenizer(dataset, plan.config.storage),
                   rank=Rank(0, 1, plan.threads, gpu=gpu))


def _counted(batches: Iterator[Batch], seen: list[int]) -> Iterator[Batch]:
    for b in batches:
        seen[0] += b.input_ids.numel() if b.attention_mask is None else int(b.attention_mask.sum())
        yield b


def _seed(seed: int, step: int, worker: int) -> int:
    return (seed * 1_000_003 + step * 7919 + worker) % (2**63)


def inner_dir(job_uid: str) -> Path:
    """This host's directory of job ``job_uid``'s inner states and held weights: this user's alone (a name in the
    shared temp directory would let another user swap the weights a round loads)."""
    return host_dir("inner") / job_uid


def shared_inner_dir(run_dir: str) -> str | None:
    """Where workers' inner states also go when the run directory is on an object store (executors on hosts
    that share no disk: a worker's next round may run elsewhere); None for a local (shared) run directory."""
    return join(run_dir, ".inner") if local_path(run_dir) is None else None


def _state_name(worker: int, step: int) -> str:
    return f"w{worker}-step{step:07d}.safetensors"


def _inner_sources(job: Job, spec: RoundSpec, worker: int, state_dir: Path) -> list[str]:
    sources = [str(state_dir / _state_name(worker, spec.step0))]
    shared = shared_inner_dir(job.run_dir)
    if shared:
        sources.append(join(shared, _state_name(worker, spec.step0)))
    if spec.inner_from:  # resuming from a checkpoint
        sources.append(join(spec.inner_from, "inner", f"w{worker}.safetensors"))
    return sources


def _save_inner(optimizer: torch.optim.Optimizer, uris: list[str], storage,
                residual: dict[str, np.ndarray] | None = None, sent: bytes | None = None) -> None:
    tensors, groups = checkpoint.optimizer_tensors(optimizer)
    tensors.update({RESIDUAL + n: torch.from_numpy(a) for n, a in (residual or {}).items()})
    if sent is not None:
        tensors[SENT] = torch.frombuffer(bytearray(sent), dtype=torch.uint8)
    data = save_bytes(tensors, metadata={"param_groups": json.dumps(groups)})  # serialised once for every copy
    for uri in uris:
        write_bytes(uri, data, storage)


class InnerState:
    """A worker's state file of the round's start, read at most once, from the first of ``sources`` that exists (on an
    object store the file is downloaded whole, so the payload the worker kept and its optimizer state must not each
    fetch it): its inner optimizer state, the codec's residual and, with a forward downlink, the payload it sent."""

    def __init__(self, sources: list[str], storage):
        self.sources, self.storage = sources, storage

    @functools.cached_property
    def read(self) -> tuple[dict[str, torch.Tensor], list[dict]] | None:
        for uri in self.sources:
            if not exists(uri, self.storage):
                continue
            local = local_path(uri)
            if local is not None:
                return _read_inner(str(local))
            with tempfile.NamedTemporaryFile(suffix=".safetensors") as tmp:  # safe_open reads metadata from a file
                tmp.write(read_bytes(uri, self.storage))
                tmp.flush()
                return _read_inner(tmp.name)
        return None

    def sent(self) -> bytes | None:
        """The payload this worker sent last round, or None."""
        tensors = self.read[0] if self.read else {}
        return tensors[SENT].numpy().tobytes() if SENT in tensors else None

    def load(self, optimizer: torch.optim.Optimizer | None) -> tuple[bool, dict[str, np.ndarray] | None]:
        """(found, the codec's residual if the state holds one); the optimizer state loaded into ``optimizer``."""
        if self.read is None:
            return False, None
        tensors, groups = self.read
        residual = {n[len(RESIDUAL):]: t.numpy() for n, t in tensors.items() if n.startswith(RESIDUAL)}
        if optimizer is not None:
            checkpoint.load_optimizer(
                optimizer, {n: t for n, t in tensors.items() if not n.startswith(RESIDUAL) and n != SENT}, groups)
        return True, residual or None


def _read_inner(path: str) -> tuple[dict[str, torch.Tensor], list[dict]]:
    with safe_open(path, framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, json.loads(f.metadata()["param_groups"])


def _prune_inner(directory: str, worker: int, keep_from: int, storage) -> None:
    """Drop this worker's states older than the round's start (a retry of this round still needs that one)."""
    prefix = f"w{worker}-step"
    for name in list_names(directory, storage):
        if name.startswith(prefix) and name.endswith(".safetensors") and int(name[len(prefix):].split(".")[0]) < keep_from:
            delete(join(directory, name), storage)
