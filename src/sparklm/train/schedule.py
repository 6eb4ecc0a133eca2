"""When a run evaluates, checkpoints and stops: pure, the same for every strategy.

A run advances in units: one optimizer step for a DDP rank, one round of ``sync_every`` steps for average and
DiLoCo. After each unit the run loop asks the schedule what is due; the answers depend only on the step before
and after the unit, so a rank and a rounds driver evaluate and checkpoint at the same steps for the same settings.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..config import TrainConfig
from ..infra.errors import SparklmError


@dataclass(frozen=True)
class Steps:
    """How many rows a step takes and how many steps the run has (None: the time budget ends it)."""

    rows_per_step: int  # global rows of one optimizer step (all workers, all micro-batches)
    tokens_per_step: int
    total_steps: int | None


def steps(tc: TrainConfig, *, train_rows: int, seq_len: int, workers: int) -> Steps:
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
    return Steps(rows_per_step=rows, tokens_per_step=rows * seq_len,
                 total_steps=max(1, min(candidates)) if candidates else None)


def fraction(step: int, total_steps: int | None, elapsed: float, budget: float) -> float:
    """How much of the run is done: by steps, or by time when there is a time budget (whichever is further). The
    only measure of progress: the run loop stops at 1.0 and the learning rate follows it, on a rank and on a round's
    worker alike (which projects ``elapsed`` from the driver's pace)."""
    frac = step / total_steps if total_steps else 0.0
    return max(frac, elapsed / budget) if budget else frac


def crossed(every: int, before: int, after: int) -> bool:
    """Whether a multiple of ``every`` lies in (before, after]."""
    return bool(every) and after // every > before // every


@dataclass(frozen=True)
class Schedule:
    total_steps: int | None  # None: the time budget ends the run
    eval_every: int  # 0: only at the end
    checkpoint_every: int  # 0: only at the end
    time_budget: float = 0.0  # seconds; 0: unset

    crossed = staticmethod(crossed)

    def finished(self, step: int) -> bool:
        return self.total_steps is not None and step >= self.total_steps

    def evaluate(self, before: int, after: int) -> bool:
        """An evaluation after the unit from step ``before`` to ``after`` (the run's end evaluates anyway)."""
        return self.crossed(self.eval_every, before, after) and not self.finished(after)

    def checkpoint(self, before: int, after: int) -> bool:
        """A checkpoint after the unit from step ``before`` to ``after`` (the run's end writes one anyway)."""
        return self.crossed(self.checkpoint_every, before, after) and not self.finished(after)

    def out_of_time(self, elapsed: float) -> bool:
        return bool(self.time_budget) and elapsed >= self.time_budget

    def done(self, step: int, elapsed: float) -> float:
        """How much of the run is done after ``step`` steps and ``elapsed`` seconds (:func:`fraction`)."""
        return fraction(step, self.total_steps, elapsed, self.time_budget)

    def unit(self, step: int, size: int) -> int:
        """Steps in the next unit of ``size`` steps from ``step`` (the last one may be short)."""
        return size if self.total_steps is None else min(size, self.total_steps - step)
