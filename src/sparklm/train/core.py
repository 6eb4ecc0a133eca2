"""The training core: one worker's model, optimizer, data and steps, and the DDP rank's unit of the run loop.

Every strategy runs these same steps. A DDP rank runs :func:`train`: the run loop (loop.py) over a
:class:`RankUnit` of one optimizer step, its collectives behind one object (collective.py); an average/DiLoCo
worker runs :meth:`Trainer.run_steps` for one round's ``sync_every`` steps (strategies/round_worker.py). The core
knows nothing of Spark and decides nothing: the run plan (plan.py) says what runs, the task seam (model/task.py)
what is trained, the device seam (device.py) where, and its figures go to metrics sinks (sinks.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from ..data.manifest import PreparedDataset, checked_row_groups
from ..data.stream import TokenStream, validation_rows
from ..data.tokenizer import TokenizerSpec, token_byte_lengths
from ..infra.errors import SparklmError
from ..infra.fs import delete, exists, join, local_copy, local_path, upload_tree
from ..metrics.recorder import Best, Recorder, RunResult
from ..metrics.sinks import Sink
from ..model import param_count
from ..model.task import Batch, Task
from ..registry import make_task
from . import checkpoint, collective, compiling, device, loop, optim, shard
from .plan import RunPlan
from .schedule import Schedule, fraction

__all__ = ["Rank", "RankUnit", "Trainer", "TrainState", "fraction", "train"]


@dataclass(frozen=True)
class Rank:
    rank: int = 0
    world: int = 1
    threads: int = 1
    gpu: str | None = None  # the GPU address Spark assigned this rank's task (TaskContext.resources()); None: none


@dataclass
class TrainState:
    step: int = 0
    position: int = 0  # global rows consumed: where the data stream resumes
    tokens_seen: int = 0
    elapsed: float = 0.0  # seconds trained before this process started (a resumed run)


# -- one worker's training --------------------------------------------------------------------


class Trainer:
    """One worker's model, optimizer and data; the steps and evaluations it runs, as its run plan says."""

    def __init__(self, plan: RunPlan, dataset: PreparedDataset, spec: TokenizerSpec, *, rank: Rank = Rank(),
                 task: Task | None = None, comm: collective.Single | None = None):
        self.use(plan)
        # the plan's device placed on this rank's GPU (on the CPU: as it is)
        self.device = plan.device.placed(rank.gpu, rank.rank)
        self.dataset, self.spec, self.rank = dataset, spec, rank
        self.comm = comm or collective.Single()
        self.task = task or make_task(self.config)
        self.seq_len = dataset.seq_len
        self.model = self.sharded_pretrained() if self.comm.sharded else None
        if self.model is None:
            self.model = self.device.put(self.task.build(self.config, spec, self.seq_len))
            if self.comm.sharded:  # FSDP2 (train.parallel shard): before the optimizer, which takes the shards
                self.model = shard.shard(self.model, SHARD_DTYPES.get(self.device.dtype_name))
        # what draws at random while training (dropout, masked-LM masks) is a function of (seed, rank), whatever ran
        # in this process before; checkpoints keep the state from there (save/restore below)
        torch.manual_seed((self.tc.seed << 16) + rank.rank)
        self.net: torch.nn.Module = self.model
        self.compile_pending = False  # train.compile on: compiled after the first step (wrap)
        self.optimizer = self.new_optimizer()
        self.train_groups = checked_row_groups(dataset, "train", self.config.storage)
        self.val_groups = checked_row_groups(dataset, "validation", self.config.storage)
        self.byte_lengths = self.device.tensor(token_byte_lengths(spec))
        self.scaler = self.device.grad_scaler()  # fp16 only
        self.state = TrainState()

    def sharded_pretrained(self) -> torch.nn.Module | None:
        """A pretrained model sharded before its weights exist: built on the meta device, sharded, then each rank
        reads its rows of every weight (shard.materialize). None where the task builds it otherwise, or where the
        files do not name every weight as the model does (then it is loaded whole and sharded after)."""
        empty = getattr(self.task, "build_empty", None)
        found = empty(self.config, self.spec, self.seq_len) if empty is not None else None
        if found is None:
            return None
        model, path = found
        shard.shard(model, SHARD_DTYPES.get(self.device.dtype_name))
        if shard.materialize(model, path, self.device.where):
            return None  # (the weights it lacks: named otherwise in the files)
        self.task.weights_loaded(model)
        return model

    def use(self, plan: RunPlan) -> None:
        """Run as ``plan`` says from now on (an elastic round's share of the batch: the run plan at its world); the
        plan, its settings and its step plan change together."""
        self.plan, self.config, self.tc = plan, plan.config, plan.config.train
        self.steps = plan.steps  # rows and tokens per step, the run's steps

    # -- building blocks --

    def new_optimizer(self) -> torch.optim.Optimizer | optim.Chained:
        """The plan's optimizer over the task's trainable parameters, weight decay where the task says."""
        return optim.build(list(self.task.trainable(self.model).values()), self.plan.optimizer,
                           decays=self.task.decays(self.model), matrices=self.task.matrices(self.model))

    def batches(self, position: int, *, part: int | None = None, parts: int | None = None) -> Iterator[Batch]:
        """This worker's micro-batches from global row ``position`` (slice ``part`` of ``parts`` of each global
        batch: by default this rank's)."""
        stream = TokenStream(self.train_groups, seq_len=self.seq_len, batch_size=self.tc.batch_size,
                             rank=self.rank.rank if part is None else part, world=self.rank.world if parts is None else parts,
                             seed=self.tc.seed, window=self.tc.window_row_groups, start=position,
                             storage=self.config.storage)
        return (self.device.put(self.task.batch(rows)) for rows in stream)

    def train_step(self, batches: Iterator[Batch], lr: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One optimizer step over ``grad_accum`` micro-batches; returns (mean loss, gradient norm, [correct,
        counted] next-token predictions: the training accuracy's counts, device tensors, no sync here)."""
        tc = self.tc
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        loss_sum, tally = self.device.zeros(), self.device.zeros(2)
        micros = [next(batches) for _ in range(tc.grad_accum)]
        total = sum(self.task.weight(b) for b in micros)  # micro-batches weigh by their share of the step
        scaler = self.scaler
        for micro, batch in enumerate(micros):
            with self.comm.no_sync(self.net, last=micro == tc.grad_accum - 1), self.device.autocast():
                loss = self.task.loss(self.net, batch, total, tally)
            (scaler.scale(loss) if scaler else loss).backward()
            loss_sum += loss.detach().float()
        if scaler:  # fp16: the gradients back to their true scale before clipping; a step with inf/nan is skipped
            for opt in optim.parts(self.optimizer):
                scaler.unscale_(opt)
        grad_norm = shard.whole(torch.nn.utils.clip_grad_norm_(self.model.parameters(), tc.grad_clip or float("inf")))
        if scaler:
            for opt in optim.parts(self.optimizer):
                scaler.step(opt)
            scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if tc.allocator == "trim":  # what the step freed goes back to the OS: the next step's peak does not grow
            device.trim_memory()
        return loss_sum, grad_norm, tally

    def run_steps(self, batches: Iterator[Batch], n: int, frac: Callable[[int], float], *, stop: bool = True
                  ) -> Iterator[tuple[torch.Tensor, torch.Tensor, float, torch.Tensor]]:
        """Up to ``n`` optimizer steps; before step ``i``, ``frac(i)`` says how much of the run is done (with
        ``stop``, the steps end at 1.0; a round's worker runs all ``n`` its driver planned). Yields (loss,
        grad norm, lr, accuracy counts) after each step, the state already advanced."""
        self.model.train()
        for i in range(n):
            done = frac(i)
            if stop and done >= 1.0:
                return
            yield self.step(batches, done)

    def step(self, batches: Iterator[Batch], done: float) -> tuple[torch.Tensor, torch.Tensor, float, torch.Tensor]:
        """One optimizer step at progress ``done`` (the learning rate follows it), the state advanced: (loss, grad
        norm, lr, accuracy counts)."""
        if self.compile_due():
            self.compile_now()
        lr = self.plan.optimizer.lr_at(self.state.step, done)
        loss, grad_norm, tally = self.train_step(batches, lr)
        self.state.step += 1
        self.state.position += self.steps.rows_per_step
        self.state.tokens_seen += self.steps.tokens_per_step
        return loss, grad_norm, lr, tally

    @torch.no_grad()
    @compiling.eager()
    def eval_sums(self, part: int, parts: int) -> torch.Tensor:
        """The task's evaluation sums ([nats, tokens, correct, bytes] for a causal LM) over this worker's part of the
        validation split (row i → part i mod parts)."""
        tc = self.tc
        self.model.eval()
        limit = tc.eval_batches * tc.batch_size if tc.eval_batches else None
        sums = self.device.zeros(self.task.eval_width, dtype=torch.float64)
        batches = (self.device.put(self.task.batch(rows.take(slice(i, i + tc.batch_size))))
                   for rows in validation_rows(self.val_groups, seq_len=self.seq_len, rank=part, world=parts,
                                               limit=limit, storage=self.config.storage)
                   for i in range(0, len(rows.input_ids), tc.batch_size))
        for batch, counts in (self.lockstep(batches) if self.comm.sharded else ((b, True) for b in batches)):
            with self.device.autocast():
                scored = self.task.eval_sums(self.model, batch, self.byte_lengths)
            if counts:
                sums += scored
        self.model.train()
        return sums

    def lockstep(self, batches: Iterator[Batch]) -> Iterator[tuple[Batch, bool]]:
        """A sharded model's ranks compute together (each forward gathers every rank's shards), so each runs as many
        batches as the rank with the most: one that has run out computes a spare batch again, not counted (False)."""
        spare = None
        for batch in _then_none(batches):
            more = float(self.comm.max(self.device.tensor([0.0 if batch is None else 1.0])))
            if not more:
                return
            if batch is None:
                spare = spare if spare is not None else next(self.batches(0))
                yield spare, False
            else:
                spare = batch
                yield batch, True

    def evaluate(self) -> dict:
        """Validation figures over the whole (or ``eval_batches`` of the) split, summed over the ranks."""
        if not self.val_groups:
            return {}
        sums = self.comm.sum(self.eval_sums(self.rank.rank, self.rank.world))
        return self.task.figures(sums.tolist())

    def facts(self) -> dict:
        return {"params": param_count(self.model), "flops_per_token": self.task.flops_per_token(self.model, self.seq_len),
                "peak_flops": self.device.peak(), "dtype": self.device.dtype_name,
                "device": self.device.where,
                "optimizer": self.plan.optimizer.name,
                "trainable_params": sum(p.numel() for p in self.task.trainable(self.model).values())}

    def frozen(self) -> bool:
        """Whether part of the model does not train (LoRA): checkpoints then hold only the trainable weights,
        the rest comes from the pretrained model again."""
        return any(not p.requires_grad for p in self.model.parameters())

    def checkpoint_weights(self) -> dict[str, torch.Tensor]:
        if self.frozen():
            return {n: p.detach() for n, p in self.task.trainable(self.model).items()}
        return checkpoint.model_tensors(self.model)

    def load_checkpoint_weights(self, weights: dict[str, torch.Tensor], path: str) -> None:
        if not self.frozen():
            checkpoint.load_model_tensors(self.model, weights, path)
            return
        trainable = self.task.trainable(self.model)
        if set(weights) != set(trainable):
            raise SparklmError(f"checkpoint {path} does not hold this model's trainable weights (LoRA adapters)",
                               hint="resume with the same model and lora settings")
        with torch.no_grad():
            for n, p in trainable.items():
                p.copy_(weights[n])

    def wrap(self) -> None:
        """The network the steps run: DDP across the ranks (the collectives say), compiled where train.compile says
        (its blocks, each in place: compiling.py). A fresh run compiles from its second step on, its first eager:
        the first step comes seconds after the command, not after the compiling (the main job's: 24 s on 2 CPU cores,
        ~3 s from Inductor's cache). A resumed run compiles now, so that every step it runs is compiled as the
        original run's were (bitwise resume)."""
        self.net = self.comm.wrap(self.model, self.device)
        self.compile_pending = self.tc.compile == "on"
        if self.compile_due():
            self.compile_now()

    def compile_due(self) -> bool:
        """Whether the network is to be compiled before the next step: a fresh run's second, a resumed run's first."""
        return self.compile_pending and self.state.step > 0

    def compile_now(self) -> None:
        self.compile_pending = False
        self.net = compiling.compile_model(self.net, self.model)

    def gather_peaks(self) -> list[float]:
        """Every rank's peak resident memory, in rank order: a collective, so every rank calls it at the same step."""
        return self.comm.gather(self.device.tensor([self.device.peak_mb()])).tolist()

    def global_mean(self, loss: torch.Tensor, tally: torch.Tensor) -> tuple[float, float]:
        """The step's loss averaged over the ranks and its training accuracy over all their predictions (one
        collective)."""
        both = self.comm.sum(torch.cat([loss.reshape(1), tally]))
        mean, correct, counted = both.tolist()
        return mean / self.comm.world, correct / counted if counted else float("nan")

    def weights(self) -> dict[str, torch.Tensor]:
        """A copy of the trainable weights (sharded: this rank's shards)."""
        return {n: p.detach().clone() for n, p in self.task.trainable(self.model).items()}

    def export(self, run_dir: str, best: dict[str, torch.Tensor] | None = None) -> None:
        """model/ (HF format) and samples.txt: what a run leaves for generate, eval and export. With ``best``
        (trainable weights better than the current ones), model/ holds those and model-final/ the current ones.
        Rank 0 writes them; a sharded run's ranks all take part (:meth:`export_sharded`)."""
        if self.comm.sharded:
            self.export_sharded(run_dir, best)
            return
        storage = self.config.storage
        final_dir = join(run_dir, "model-final")
        if best is not None:
            self.task.export(self.model, self.spec, final_dir, storage)
            with torch.no_grad():
                for n, p in self.task.trainable(self.model).items():
                    p.copy_(best[n])
        elif exists(final_dir, storage):  # from an earlier end of this run (--resume): now the final weights are best
            delete(final_dir, storage)
        self.task.export(self.model, self.spec, join(run_dir, "model"), storage)
        with compiling.eager():  # samples: each new length would compile the blocks again
            self.task.artefacts(self.model, self.spec, run_dir, self.dataset, self.config)

    def export_sharded(self, run_dir: str, best: dict[str, torch.Tensor] | None) -> None:
        """:meth:`export` of a sharded model: rank 0 builds the model whole on the CPU and the ranks gather the
        trained weights into it one tensor at a time (a collective each), for model-final/ first when ``best`` (this
        rank's shards of the best weights) is kept apart, then for model/ and the samples."""
        main, storage = self.rank.rank == 0, self.config.storage
        if not self.frozen() and getattr(self.task, "streams_export", False):
            self.export_streamed(run_dir, best)
            return
        whole = self.task.build(self.config, self.spec, self.seq_len) if main else None
        into = dict(whole.named_parameters()) if main else {}

        def pull() -> None:
            with torch.no_grad():
                for name, t in shard.gathered(self.task.trainable(self.model), keep=main):
                    into[name].copy_(t)

        final_dir = join(run_dir, "model-final")
        if best is not None:
            pull()
            if main:
                self.task.export(whole, self.spec, final_dir, storage)
            with torch.no_grad():
                for n, p in self.task.trainable(self.model).items():
                    p.copy_(best[n])
        elif main and exists(final_dir, storage):
            delete(final_dir, storage)
        pull()
        if main:
            self.task.export(whole, self.spec, join(run_dir, "model"), storage)
            self.task.artefacts(whole, self.spec, run_dir, self.dataset, self.config)
        self.comm.barrier()

    # -- checkpoints (DDP) --

    def save(self, run_dir: str, best: Best | None = None, best_weights: dict | None = None) -> None:
        """A checkpoint of the weights, optimizer state, every rank's RNG and the best evaluation (written by rank 0;
        a collective)."""
        states = self.comm.gather_tensors(self.device.rng_state())
        if self.comm.sharded:
            self.save_sharded(run_dir, best, best_weights, states)
            return
        if self.rank.rank == 0:
            best = best or Best(key=self.task.figure_set.loss)
            opt, groups = checkpoint.optimizer_tensors(self.optimizer)
            s = self.state
            files = {"model": self.checkpoint_weights(), "optimizer": opt,
                     "rng": {f"torch.{r}": t for r, t in enumerate(states)},
                     **best.checkpoint_files(best_weights, s.step)}
            run = checkpoint.RunState(strategy=self.tc.strategy, world=self.rank.world, step=s.step,
                                      tokens_seen=s.tokens_seen, position=s.position, elapsed=s.elapsed,
                                      best=best.to_state(), extra={"param_groups": groups})
            checkpoint.save_run(join(run_dir, "checkpoints"), run, files, keep=self.tc.keep_checkpoints,
                                storage=self.config.storage)
        self.comm.barrier()

    def export_streamed(self, run_dir: str, best: dict[str, torch.Tensor] | None) -> None:
        """:meth:`export_sharded` without a whole model anywhere: rank 0 writes the directory, its weights' files
        streamed as the ranks gather each tensor (shard.save_streamed: no process holds more than one whole tensor),
        and the ranks compute the samples together from the sharded model."""
        main, storage = self.rank.rank == 0, self.config.storage

        def one(uri: str) -> None:
            if main:
                self.task.export(self.model, self.spec, uri, storage,
                                 weights=lambda where: shard.save_streamed(where, self.model))
            else:  # the same gathers, in the same order, written by rank 0
                shard.save_streamed(None, self.model)

        final_dir = join(run_dir, "model-final")
        if best is not None:
            one(final_dir)
            with torch.no_grad():
                for n, p in self.task.trainable(self.model).items():
                    p.copy_(best[n])
        elif main and exists(final_dir, storage):
            delete(final_dir, storage)
        one(join(run_dir, "model"))
        self.task.artefacts(self.model, self.spec, run_dir, self.dataset, self.config, write=main)
        self.comm.barrier()

    def save_sharded(self, run_dir: str, best: Best | None, best_weights: dict | None, states: list) -> None:
        """A sharded checkpoint: every rank writes its shards of the weights, optimizer state and kept best weights
        (torch.distributed.checkpoint) beside the checkpoint's staging; rank 0 then takes them into it with the RNG
        states and state.json, which appears last (checkpoint.save: a checkpoint is whole or absent)."""
        s, main, storage = self.state, self.rank.rank == 0, self.config.storage
        best = best or Best(key=self.task.figure_set.loss)
        kept = best.apart(best_weights, s.step)
        directory = join(run_dir, "checkpoints")
        staging = join(directory, f".{checkpoint.step_name(s.step)}.{shard.DCP}")
        if main and exists(staging, storage):  # from a save that was killed
            delete(staging, storage)
        self.comm.barrier()
        state = {"model": shard.model_state(self.model),
                 "optimizer": shard.optimizer_state(self.model, optim.parts(self.optimizer))}
        if kept is not None:
            state["best"] = dict(kept)
        here = local_path(staging)
        with shard.staged(None if here is None else str(here)) as where:
            shard.save(state, where)
            self.comm.barrier()  # every rank's files and rank 0's metadata are written
            if here is None:  # an object store: each rank uploads its own files
                upload_tree(Path(where), staging, storage)
        del state
        self.comm.barrier()
        if main:
            run = checkpoint.RunState(strategy=self.tc.strategy, world=self.rank.world, step=s.step,
                                      tokens_seen=s.tokens_seen, position=s.position, elapsed=s.elapsed,
                                      best=best.to_state(), extra={"sharded": True, "best_kept": kept is not None})
            checkpoint.save_run(directory, run, {"rng": {f"torch.{r}": t for r, t in enumerate(states)}},
                                keep=self.tc.keep_checkpoints, storage=storage, adopt={shard.DCP: staging})
        self.comm.barrier()

    def restore(self, run_dir: str, warn: Callable[[str], None] | None = None) -> loop.Restored | None:
        """Continue from the newest readable checkpoint, if there is one (weights, optimizer, position, RNG);
        a damaged newest one is skipped with ``warn``. Returns what the run loop restores of it."""
        # a run resumes on any number of ranks that keeps its global batch (the plan checked it: a checkpoint's
        # position counts global rows); a sharded checkpoint is resharded to this world as it is read, a replicated
        # one is whole, and a rank the checkpoint did not have draws from its seed
        names = ("rng",) if self.comm.sharded else ("model", "optimizer", "rng", "best")
        found = checkpoint.restore_run(join(run_dir, "checkpoints"), world=None, warn=warn, names=names,
                                       storage=self.config.storage)
        if found is None:
            return None
        path, run, files = found
        if bool(run.extra.get("sharded")) != self.comm.sharded:
            raise SparklmError(f"checkpoint {path} is {'' if run.extra.get('sharded') else 'not '}sharded, this run "
                               f"{'is' if self.comm.sharded else 'is not'}",
                               hint=f"resume with --parallel {'shard' if run.extra.get('sharded') else 'replicate'}")
        if self.comm.sharded:
            files.update(model={}, optimizer={}, best=self.load_sharded(path, run))
        else:
            self.load_checkpoint_weights(files["model"], path)
            checkpoint.load_optimizer(self.optimizer, files["optimizer"], run.extra["param_groups"])
        rng = files["rng"].get(f"torch.{self.rank.rank}")
        if rng is not None:  # a rank an elastic run did not have at the checkpoint draws from its seed
            self.device.set_rng_state(rng)
        self.state = TrainState(step=run.step, position=run.position, tokens_seen=run.tokens_seen, elapsed=run.elapsed)
        return loop.Restored(loop.Position(run.step, run.tokens_seen, run.elapsed), run.best, files["best"])


    def load_sharded(self, path: str, run: checkpoint.RunState) -> dict:
        """The weights and optimizer state of sharded checkpoint ``path``, each rank reading its shards (another world
        size's resharded); returns this rank's shards of the kept best weights ({}: none kept)."""
        parts = optim.parts(self.optimizer)
        state = {"model": shard.model_state(self.model), "optimizer": shard.optimizer_state(self.model, parts)}
        if run.extra.get("best_kept"):
            state["best"] = self.weights()
        try:
            shard.load(state, str(local_copy(join(path, shard.DCP), self.config.storage)))
        except Exception as e:  # a missing or damaged shard
            raise checkpoint.unreadable(path, e) from None
        shard.load_states(self.model, parts, state["model"], state["optimizer"])
        return state.get("best", {})


def _then_none(items):
    yield from items
    yield None


SHARD_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}  # weights gathered in the compute dtype


class RankUnit:
    """A DDP rank (or a single process) as the run loop's unit: one optimizer step at a time, its collectives (the
    step's mean loss, peaks, the time budget's progress, checkpoints) made by every rank at the same steps."""

    size, deferred_eval = 1, False
    note_at = loop.NOTE_STEP

    def __init__(self, trainer: Trainer, run_dir: str, *, warn: Callable[[str], None],
                 note: Callable[[str], None] = lambda _: None, on_step: Callable[[int], None] | None = None,
                 leaving: Callable[[], bool] | None = None, halts: bool = False,
                 halting: Callable[[], bool] | None = None):
        self.t, self.run_dir, self.warn, self.note, self.on_step = trainer, run_dir, warn, note, on_step
        # an elastic run's ranks agree after every step whether to leave, and a run the driver may end early (a
        # search's trial: ``halts``) whether to end (rank 0 hears both from the driver)
        self.leaving, self.halts, self.halting = leaving, halts, halting
        self.log_every = trainer.tc.log_every
        self.main = trainer.rank.rank == 0
        self.stream: Iterator[Batch] | None = None

    def restore(self) -> loop.Restored | None:
        # The launcher refuses a run directory that holds a run unless resuming, so a checkpoint found here is this
        # run's own: from --resume, or from an earlier attempt that Spark (a re-run barrier stage) or the driver
        # (train.ddp.max_restarts) restarted. Either way the run continues from it.
        found = self.t.restore(self.run_dir, warn=self.warn)
        self.t.wrap()
        self.stream = self.t.batches(self.t.state.position)
        self.t.model.train()
        return found

    def facts(self) -> dict:
        return self.t.facts() if self.main else {"peak_flops": 1.0}

    def agree(self, done: float) -> float:
        if not self.t.tc.time_budget:  # by steps alone every rank knows the same
            return done
        return float(self.t.comm.max(self.t.device.tensor([done])))

    def advance(self, steps: int, *, done: float, evaluate: bool, checkpoint: bool) -> loop.Advance:
        t = self.t
        if t.compile_due():  # said, as the steps' lines will show its time
            self.note("  compiling the model's layers (train.compile): once, up to half a minute the first time, "
                      "seconds from Inductor's cache")
        loss, grad_norm, lr, tally = t.step(self.stream, done)
        if self.on_step is not None:
            self.on_step(t.state.step)
        mean, acc = t.global_mean(loss, tally)
        leave = halt = False
        if t.tc.workers_min or self.halts:  # flags per step, the same on every rank
            asked = [1.0 if self.leaving is not None and self.leaving() else 0.0,
                     1.0 if self.halting is not None and self.halting() else 0.0]
            leave, halt = (float(v) > 0 for v in t.comm.max(t.device.tensor(asked)))
        return loop.Advance(tokens=t.steps.tokens_per_step, loss=mean, acc=acc, lr=lr, grad_norm=float(grad_norm),
                            rss_mb=device.rss_mb(), leave=leave, halt=halt)

    def evaluate(self) -> loop.Evaluation:
        return loop.Evaluation(self.t.evaluate())

    def snapshot(self) -> dict | None:
        return self.t.weights() if self.main or self.t.comm.sharded else None  # sharded: each rank its shards

    def peaks(self) -> list[float | None]:
        return self.t.gather_peaks()

    def where(self) -> str:
        return f"step {self.t.state.step}"

    def save(self, position: loop.Position, best: Best, best_weights: dict | None) -> None:
        self.t.state.elapsed = position.elapsed
        self.t.save(self.run_dir, best, best_weights)

    def final_evaluation(self, will_export: bool) -> loop.Evaluation:
        return self.evaluate()

    def finish(self, best: dict | None) -> dict:
        if self.main or self.t.comm.sharded:
            self.t.export(self.run_dir, best)
        device.trim_memory()
        return {}


def train(plan: RunPlan, dataset: PreparedDataset, spec: TokenizerSpec, run_dir: str, *,
          rank: Rank = Rank(), sink: Sink | None = None, on_step: Callable[[int], None] | None = None,
          comm: collective.Single | None = None, halts: bool = False) -> RunResult:
    """A whole run on one rank (of ``rank.world``, whose collectives are ``comm``): train, evaluate, checkpoint;
    rank 0 exports ``model/`` and samples and sends its rows to ``sink``. ``on_step(step)`` runs after every step
    (a hook for fault injection and profiling); ``halts``: the driver may end the run early (rank 0's sink says
    when). The run loop (loop.py) sequences it."""
    torch.set_num_threads(rank.threads)
    device.set_allocator(plan.config.train.allocator)  # before the model's first allocation
    trainer = Trainer(plan, dataset, spec, rank=rank, comm=comm or collective.of(rank.rank, rank.world))
    tc = trainer.tc
    rec = Recorder(sink if rank.rank == 0 else None, tc, strategy=tc.strategy, workers=rank.world,
                   epoch_tokens=dataset.manifest["splits"]["train"]["tokens"], figures=trainer.task.figure_set)
    unit = RankUnit(trainer, run_dir, warn=rec.warn, note=rec.note, on_step=on_step,
                    leaving=getattr(sink, "leaving", None), halts=halts, halting=getattr(sink, "halted", None))
    schedule = Schedule(trainer.steps.total_steps, tc.eval_every, tc.checkpoint_every, tc.time_budget)
    return loop.run(unit, rec, schedule, keep_best=tc.keep_best, info={"threads": rank.threads})
