"""The training core: one worker's model, optimizer, data and schedule, and the steps it runs.

Every strategy runs these same steps. A DDP rank runs :func:`train` (the whole run, top to bottom;
distribution is a few guarded lines keyed on ``world > 1``); an average/DiLoCo worker runs
:meth:`Trainer.run_steps` for one round's ``sync_every`` steps (strategies/rounds_task.py). The
core knows nothing of Spark; what is trained comes from the task seam (model/task.py), where it runs
from the device seam (device.py), and its figures go to metrics sinks (sinks.py).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..config import Config, TrainConfig
from ..data.manifest import PreparedDataset, checked_row_groups
from ..data.stream import TokenStream, validation_rows
from ..data.tokenizer import TokenizerSpec, token_byte_lengths
from ..errors import SparklmError
from ..fs import delete, exists, join
from ..model import param_count
from ..model.task import Batch, Task, task_for
from . import checkpoint, device, optim, resolve
from .recorder import NOTE_STEP, Best, Recorder, RunResult
from .schedule import Schedule
from .sinks import Sink


@dataclass(frozen=True)
class Rank:
    rank: int = 0
    world: int = 1
    threads: int = 1


@dataclass(frozen=True)
class Plan:
    """How many rows a step takes and how many steps the run has (None: the time budget ends it)."""

    rows_per_step: int  # global rows of one optimizer step (all workers, all micro-batches)
    tokens_per_step: int
    total_steps: int | None


@dataclass
class TrainState:
    step: int = 0
    position: int = 0  # global rows consumed: where the data stream resumes
    tokens_seen: int = 0
    elapsed: float = 0.0  # seconds trained before this process started (a resumed run)


# -- pure functions: the plan and the schedule -------------------------------------------------


def plan(tc: TrainConfig, *, train_rows: int, seq_len: int, workers: int) -> Plan:
    """The step plan: the smallest of max_steps, epochs and max_tokens (one epoch if none is set and
    there is no time budget)."""
    if train_rows < tc.batch_size * workers:
        raise SparklmError(f"the training split has {train_rows} sequences, fewer than one global batch "
                           f"({tc.batch_size} x {workers} workers)",
                           hint="lower train.batch_size or --workers, or prepare more text / a shorter --seq-len")
    rows = tc.batch_size * workers * tc.grad_accum
    candidates = []
    if tc.max_steps:
        candidates.append(tc.max_steps)
    if tc.epochs:
        candidates.append(math.ceil(tc.epochs * train_rows / rows))
    if tc.max_tokens:
        candidates.append(math.ceil(tc.max_tokens / (rows * seq_len)))
    if not candidates and not tc.time_budget:
        candidates.append(math.ceil(train_rows / rows))  # one epoch
    return Plan(rows_per_step=rows, tokens_per_step=rows * seq_len,
                total_steps=max(1, min(candidates)) if candidates else None)


def fraction(step: int, total_steps: int | None, elapsed: float, budget: float) -> float:
    """How much of the run is done: by steps, or by time when there is a time budget (whichever is further)."""
    frac = step / total_steps if total_steps else 0.0
    return max(frac, elapsed / budget) if budget else frac


def lr_at(step: int, frac: float, tc: TrainConfig) -> float:
    """Linear warmup over ``warmup_steps``, then cosine from ``lr`` to ``lr·min_lr_ratio`` over the run."""
    if step < tc.warmup_steps:
        return tc.lr * (step + 1) / tc.warmup_steps
    floor = tc.lr * tc.min_lr_ratio
    return floor + 0.5 * (tc.lr - floor) * (1 + math.cos(math.pi * min(frac, 1.0)))


# -- one worker's training --------------------------------------------------------------------


def rank_settings(config: Config, threads: int, dev: device.Device | None = None) -> tuple[Config, device.Device]:
    """The settings and device a worker trains with. The driver decided every "auto" (resolve.settings) before the
    job reached the worker, so this takes them as given; only a worker built directly (a test, a benchmark) on a
    config nobody resolved decides here, for itself."""
    config = resolve.settings(config, config.train.threads or threads)
    return config, dev or device.select(config.train.dtype)


class Trainer:
    """One worker's model, optimizer and data; the steps and evaluations it runs."""

    def __init__(self, config: Config, dataset: PreparedDataset, spec: TokenizerSpec, *, rank: Rank = Rank(),
                 task: Task | None = None, dev: device.Device | None = None, workers: int | None = None):
        config, self.device = rank_settings(config, rank.threads, dev)
        self.config, self.dataset, self.spec, self.rank = config, dataset, spec, rank
        self.tc = config.train
        self.task = task or task_for(config)
        self.seq_len = dataset.seq_len
        self.model = self.device.put(self.task.build(config, spec, self.seq_len))
        # what draws at random while training (dropout, masked-LM masks) is a function of (seed, rank), whatever ran
        # in this process before; checkpoints keep the state from there (save/restore below)
        torch.manual_seed((self.tc.seed << 16) + rank.rank)
        self.net: torch.nn.Module = self.model
        self.optimizer_name = self.tc.optimizer
        self.optimizer = self.new_optimizer()
        self.train_groups = checked_row_groups(dataset, "train", config.storage)
        self.val_groups = checked_row_groups(dataset, "validation", config.storage)
        self.plan = plan(self.tc, train_rows=dataset.manifest["splits"]["train"]["sequences"], seq_len=self.seq_len,
                         workers=workers or rank.world)
        self.byte_lengths = self.device.tensor(token_byte_lengths(spec))
        self.state = TrainState()
        self.best = Best(key=self.task.figure_set.loss)
        self.best_weights: dict[str, torch.Tensor] | None = None  # None: the best weights are the current ones

    # -- building blocks --

    def new_optimizer(self) -> torch.optim.Optimizer | optim.Chained:
        """The configured optimizer over the task's trainable parameters, weight decay where the task says."""
        return optim.build(list(self.task.trainable(self.model).values()), decays=self.task.decays(self.model),
                           matrices=self.task.matrices(self.model), tc=self.tc, name=self.optimizer_name)

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
        for micro, batch in enumerate(micros):
            sync = self.rank.world == 1 or micro == tc.grad_accum - 1
            ctx = self.net.no_sync() if not sync and hasattr(self.net, "no_sync") else nullcontext()
            with ctx, self.device.autocast():
                loss = self.task.loss(self.net, batch, total, tally)
            loss.backward()
            loss_sum += loss.detach().float()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), tc.grad_clip or float("inf"))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
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
            lr = lr_at(self.state.step, done, self.tc)
            loss, grad_norm, tally = self.train_step(batches, lr)
            self.state.step += 1
            self.state.position += self.plan.rows_per_step
            self.state.tokens_seen += self.plan.tokens_per_step
            yield loss, grad_norm, lr, tally

    @torch.no_grad()
    def eval_sums(self, part: int, parts: int) -> torch.Tensor:
        """The task's evaluation sums ([nats, tokens, correct, bytes] for a causal LM) over this worker's part of the
        validation split (row i → part i mod parts)."""
        tc = self.tc
        self.model.eval()
        limit = tc.eval_batches * tc.batch_size if tc.eval_batches else None
        sums = self.device.zeros(self.task.eval_width, dtype=torch.float64)
        for rows in validation_rows(self.val_groups, seq_len=self.seq_len, rank=part, world=parts, limit=limit,
                                    storage=self.config.storage):
            for i in range(0, len(rows.input_ids), tc.batch_size):
                batch = self.device.put(self.task.batch(rows.take(slice(i, i + tc.batch_size))))
                with self.device.autocast():
                    sums += self.task.eval_sums(self.model, batch, self.byte_lengths)
        self.model.train()
        return sums

    def evaluate(self) -> dict:
        """Validation figures over the whole (or ``eval_batches`` of the) split, summed over the ranks."""
        if not self.val_groups:
            return {}
        sums = self.eval_sums(self.rank.rank, self.rank.world)
        if self.rank.world > 1:
            dist.all_reduce(sums)
        return self.task.figures(sums.tolist())

    def facts(self) -> dict:
        return {"params": param_count(self.model), "flops_per_token": self.task.flops_per_token(self.model, self.seq_len),
                "peak_flops": self.device.peak_flops(self.rank.threads), "dtype": self.device.dtype_name,
                "optimizer": self.optimizer_name,
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

    def record_eval(self, recorder: Recorder, figures: dict, *, snapshot: bool) -> None:
        """Record an evaluation of the current weights; on a new best, ``snapshot`` copies the trainable weights
        (train.keep_best), else the best weights are the current ones."""
        if recorder.evaluation(self.state.step, self.state.tokens_seen, figures) and self.tc.keep_best:
            self.best_weights = self.weights() if snapshot else None

    def wrap(self) -> None:
        """The network the steps run: DDP across the ranks, compiled where train.compile says."""
        if self.rank.world > 1:
            self.net = self.device.data_parallel(self.model)
        if self.tc.compile:
            self.net = torch.compile(self.net)

    def gather_peaks(self) -> list[float]:
        """Every rank's peak resident memory, in rank order: a collective, so every rank calls it at the same step."""
        mine = self.device.tensor([device.peak_rss_mb()])
        if self.rank.world == 1:
            return mine.tolist()
        gathered = [self.device.zeros(1, dtype=torch.float64) for _ in range(self.rank.world)]
        dist.all_gather(gathered, mine)
        return torch.cat(gathered).tolist()

    def global_mean(self, loss: torch.Tensor, tally: torch.Tensor) -> tuple[float, float]:
        """The step's loss averaged over the ranks and its training accuracy over all their predictions (one
        collective)."""
        both = torch.cat([loss.reshape(1), tally])
        if self.rank.world > 1:
            dist.all_reduce(both)
            both[0] /= self.rank.world
        mean, correct, counted = both.tolist()
        return mean, correct / counted if counted else float("nan")

    def progress(self, started: float) -> float:
        """How much of the run is done; with a time budget the ranks agree on the furthest (a collective)."""
        done = fraction(self.state.step, self.plan.total_steps, time.time() - started, self.tc.time_budget)
        if self.tc.time_budget and self.rank.world > 1:
            t = self.device.tensor([done])
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            done = float(t)
        return done

    def weights(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in self.task.trainable(self.model).items()}

    def export(self, run_dir: str, best: dict[str, torch.Tensor] | None = None) -> None:
        """model/ (HF format) and samples.txt: what a run leaves for generate, eval and export. With ``best``
        (trainable weights better than the current ones), model/ holds those and model-final/ the current ones."""
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
        self.task.artefacts(self.model, self.spec, run_dir, self.dataset, self.config)

    # -- checkpoints (DDP) --

    def save(self, run_dir: str) -> None:
        """A checkpoint of the weights, optimizer state and every rank's RNG (written by rank 0)."""
        rng = self.device.rng_state()
        states = [rng] * self.rank.world
        if self.rank.world > 1:
            gathered: list = [None] * self.rank.world
            dist.all_gather_object(gathered, rng)
            states = gathered
        if self.rank.rank == 0:
            opt, groups = checkpoint.optimizer_tensors(self.optimizer)
            s = self.state
            files = {"model": self.checkpoint_weights(), "optimizer": opt,
                     "rng": {f"torch.{r}": t for r, t in enumerate(states)},
                     **self.best.checkpoint_files(self.best_weights, s.step)}
            run = checkpoint.RunState(strategy=self.tc.strategy, world=self.rank.world, step=s.step,
                                      tokens_seen=s.tokens_seen, position=s.position, elapsed=s.elapsed,
                                      best=self.best.to_state(), extra={"param_groups": groups})
            checkpoint.save_run(join(run_dir, "checkpoints"), run, files, keep=self.tc.keep_checkpoints,
                                storage=self.config.storage)
        if self.rank.world > 1:
            dist.barrier()

    def restore(self, run_dir: str, warn: Callable[[str], None] | None = None) -> bool:
        """Continue from the newest readable checkpoint, if there is one (weights, optimizer, position, RNG);
        a damaged newest one is skipped with ``warn``."""
        found = checkpoint.restore_run(join(run_dir, "checkpoints"), world=self.rank.world, warn=warn,
                                       names=("model", "optimizer", "rng", "best"), storage=self.config.storage)
        if found is None:
            return False
        path, run, files = found
        self.load_checkpoint_weights(files["model"], path)
        checkpoint.load_optimizer(self.optimizer, files["optimizer"], run.extra["param_groups"])
        self.device.set_rng_state(files["rng"][f"torch.{self.rank.rank}"])
        self.state = TrainState(step=run.step, position=run.position, tokens_seen=run.tokens_seen, elapsed=run.elapsed)
        self.best, self.best_weights = Best.restore(run.best, files["best"], run.step, self.weights,
                                                    self.tc.keep_best, self.task.figure_set.loss)
        return True


def train(config: Config, dataset: PreparedDataset, spec: TokenizerSpec, run_dir: str, *, rank: Rank = Rank(),
          sink: Sink | None = None, on_step: Callable[[int], None] | None = None) -> RunResult:
    """A whole run on one rank (of ``rank.world``): train, evaluate, checkpoint; rank 0 exports ``model/`` and
    samples and sends its rows to ``sink``. ``on_step(step)`` runs after every step (a hook for fault
    injection and profiling). What is due after each step, the schedule says; what is recorded, the recorder."""
    torch.set_num_threads(rank.threads)
    device.set_allocator(config.train.allocator)
    trainer = Trainer(config, dataset, spec, rank=rank)
    tc, is_main = trainer.tc, rank.rank == 0
    epoch_tokens = dataset.manifest["splits"]["train"]["tokens"]
    rec = Recorder(sink if is_main else None, tc, strategy=tc.strategy, workers=rank.world, epoch_tokens=epoch_tokens,
                   figures=trainer.task.figure_set)
    # The launcher refuses a run directory that holds a run unless resuming, so a checkpoint found here is this
    # run's own: from --resume, or from an earlier attempt that Spark (a re-run barrier stage) or the driver
    # (train.ddp.max_restarts) restarted. Either way the run continues from it.
    trainer.restore(run_dir, warn=rec.warn)
    rec.rewind(trainer.state.step)  # rows an interrupted attempt wrote after its checkpoint come again
    rec.best = trainer.best  # the restored tracker: every rank decides early stopping from the same figures
    trainer.wrap()
    schedule = Schedule(trainer.plan.total_steps, tc.eval_every, tc.checkpoint_every, tc.time_budget)
    rec.info(trainer.facts() if is_main else {"peak_flops": 1.0}, schedule.total_steps, threads=rank.threads)
    started = time.time() - trainer.state.elapsed
    window = (time.time(), trainer.state.tokens_seen, trainer.state.step)  # the last train row's time, tokens, step
    remaining = (schedule.total_steps - trainer.state.step) if schedule.total_steps else 2**62
    steps = trainer.run_steps(trainer.batches(trainer.state.position), remaining, lambda _: trainer.progress(started))
    for loss, grad_norm, lr, tally in steps:
        step = trainer.state.step
        if on_step is not None:
            on_step(step)
        mean_loss, acc = trainer.global_mean(loss, tally)
        if step % tc.log_every == 0 or step == 1:  # the same on every rank
            window = _train_row(trainer, rec, window, started, loss=mean_loss, acc=acc, lr=lr,
                                grad_norm=float(grad_norm))
        if is_main and step == NOTE_STEP:  # by then the pace projects a time budget well enough
            pace = trainer.state.tokens_seen / max(time.time() - started, 1e-9)
            total = schedule.total_steps
            rec.epochs(total * trainer.plan.tokens_per_step if total else pace * tc.time_budget)
        if schedule.evaluate(step - 1, step):
            trainer.record_eval(rec, trainer.evaluate(), snapshot=is_main)
            if rec.should_stop(f"step {step}"):  # every rank saw the same all-reduced figures
                break
        if schedule.checkpoint(step - 1, step):
            trainer.state.elapsed = time.time() - started
            rec.flush()  # the rows of the steps it holds first: a resume from it must find them
            trainer.save(run_dir)
    return _finish(trainer, rec, run_dir, started)


def _train_row(trainer: Trainer, rec: Recorder, window: tuple[float, int, int], started: float, **figures
               ) -> tuple[float, int, int]:
    """A train row from the steps since the last one (``window``); returns the new window."""
    peaks = trainer.gather_peaks()  # a collective: every rank, at the same steps
    last_time, last_tokens, last_step = window
    s, now = trainer.state, time.time()
    tps = (s.tokens_seen - last_tokens) / max(now - last_time, 1e-9)
    rec.train(step=s.step, tokens=s.tokens_seen, tokens_per_s=tps, rss_mb=device.rss_mb(), peaks=peaks,
              ms_per_step=1000 * (now - last_time) / max(s.step - last_step, 1), elapsed=now - started, **figures)
    return now, s.tokens_seen, s.step


def _finish(trainer: Trainer, rec: Recorder, run_dir: str, started: float) -> RunResult:
    """The end of a rank's run: evaluate (unless it stopped right after evaluating these weights), checkpoint,
    rank 0 exports model/ and samples."""
    elapsed = trainer.state.elapsed = time.time() - started
    step = trainer.state.step
    if rec.evaluated_at != step:  # after the last step a new best is the current weights themselves: no copy
        trainer.record_eval(rec, trainer.evaluate(), snapshot=False)
    rec.flush()
    trainer.save(run_dir)
    if trainer.rank.rank == 0:
        trainer.export(run_dir, trainer.best.apart(trainer.best_weights, step))
    device.trim_memory()
    rec.note_peaks(trainer.gather_peaks())  # after rank 0's export, which may be its peak
    return rec.result(steps=step, tokens=trainer.state.tokens_seen, seconds=elapsed)
