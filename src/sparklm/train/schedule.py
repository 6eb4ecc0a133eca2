"""When a run evaluates, checkpoints and stops: pure, the same for every strategy.

A run advances in units: one optimizer step for a DDP rank, one round of ``sync_every`` steps for average and
DiLoCo. After each unit the run loop asks the schedule what is due; the answers depend only on the step before
and after the unit, so a rank and a rounds driver evaluate and checkpoint at the same steps for the same settings.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Schedule:
    total_steps: int | None  # None: the time budget ends the run
    eval_every: int  # 0: only at the end
    checkpoint_every: int  # 0: only at the end
    time_budget: float = 0.0  # seconds; 0: unset

    @staticmethod
    def crossed(every: int, before: int, after: int) -> bool:
        """Whether a multiple of ``every`` lies in (before, after]."""
        return bool(every) and after // every > before // every

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

    def unit(self, step: int, size: int) -> int:
        """Steps in the next unit of ``size`` steps from ``step`` (the last one may be short)."""
        return size if self.total_steps is None else min(size, self.total_steps - step)
