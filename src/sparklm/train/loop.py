"""The run loop: the one sequencing of a training run, whatever spreads it over Spark tasks.

A run advances in units: one optimizer step on a DDP rank (core.RankUnit: every rank runs this loop, its
collectives behind one object), one round of ``sync_every`` steps on the workers plus the outer step for the
average/DiLoCo driver (strategies/rounds.RoundsUnit) — torchtitan's shape, where DiLoCo wraps the same training
loop instead of being a second one. Around each unit this module alone decides, in this order: stop?, advance, the
train row, the epochs note, evaluate?, best model and early stop, checkpoint?; it restores at the start and
finishes at the end (final evaluation, checkpoint, export). When things are due, the schedule says (pure); what is
recorded, the recorder.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from ..infra.errors import SparklmError
from ..metrics.recorder import NOTE_STEP, Best, Recorder, RunResult
from .schedule import Schedule, crossed

__all__ = ["NOTE_STEP", "Advance", "Evaluation", "Position", "Restored", "Unit", "run"]


@dataclass(frozen=True)
class Evaluation:
    """Validation figures of some weights. One that does not ``counts`` (it scored only part of the split) is recorded
    and leaves the best model and early stopping alone; ``weights``: the trainable weights it scored when the unit
    has already moved on from them (the rounds driver), else the loop asks the unit for the current ones."""

    figures: dict
    counts: bool = True
    weights: dict | None = None
    warning: str | None = None


@dataclass(frozen=True)
class Advance:
    """What a unit reports after its steps: the figures of the train row, and what the loop records besides."""

    tokens: int  # tokens the steps trained on (the plan's count: padding included)
    loss: float
    acc: float
    lr: float
    grad_norm: float
    rss_mb: float
    peaks: list[float | None] | None = None  # each worker's peak memory; None: ask the unit (a collective)
    seconds: float | None = None  # the steps' wall time; None: since the last train row
    trained: int | None = None  # tokens trained on for the throughput (padding excluded); None: ``tokens``
    evaluation: Evaluation | None = None  # a deferred evaluation of the weights before these steps
    rows: tuple = ()  # the unit's own rows, after the train row (a round's row)
    warnings: tuple[str, ...] = ()
    halt: bool = False  # the driver asked the run to end now (a search pruned it): it ends as at its last step
    workers: int = 0  # the workers that trained these steps (a round's; 0: the run's)
    leave: bool = False  # every worker agreed to stop after these steps (an executor is leaving): checkpoint, stop


@dataclass(frozen=True)
class Position:
    """Where a run stands: what a checkpoint holds of the loop's own state."""

    step: int = 0
    tokens: int = 0
    elapsed: float = 0.0  # seconds trained, this process's and earlier ones'
    pending_eval: bool = False  # an evaluation of these weights is due and not made yet (a deferring unit)


@dataclass(frozen=True)
class Restored:
    position: Position
    best: dict | None  # Best.to_state()
    best_weights: dict  # the checkpoint's kept best weights ({}: none apart from its own)


class Unit(Protocol):
    """What advances a run. ``size``: steps per unit; ``log_every``: units per train row (in steps: crossed);
    ``note_at``: the step after which the epochs note is made; ``deferred_eval``: an evaluation rides along with
    the next advance (one Spark job less) instead of running at once."""

    size: int
    log_every: int
    note_at: int
    deferred_eval: bool

    def restore(self) -> Restored | None:
        """State from the newest readable checkpoint (None: start afresh)."""
        ...

    def facts(self) -> dict | None:
        """The run's facts for its info row (params, FLOPs per token, peak, dtype); None: not known yet."""
        ...

    def agree(self, done: float) -> float:
        """The progress every worker acts on (DDP ranks: the furthest of theirs)."""
        ...

    def advance(self, steps: int, *, done: float, evaluate: bool, checkpoint: bool) -> Advance: ...

    def evaluate(self) -> Evaluation: ...

    def snapshot(self) -> dict | None:
        """A copy of the trainable weights, kept as the best model's (None: this worker exports nothing)."""
        ...

    def peaks(self) -> list[float | None]:
        """Every worker's peak resident memory, in worker order."""
        ...

    def where(self) -> str:
        """The point the run is at, in words ("step 40", "round 3")."""
        ...

    def save(self, position: Position, best: Best, best_weights: dict | None) -> None: ...

    def final_evaluation(self, will_export: bool) -> Evaluation | None:
        """The last weights' evaluation; ``will_export``: no earlier best kept, so model/ gets these weights."""
        ...

    def finish(self, best: dict | None) -> dict[str, Any]:
        """Export model/ (``best``: the kept best weights when they are not the final ones) and the run's artefacts;
        returns the unit's own fields of the result."""
        ...


class Leaving(Exception):
    """The workers stopped after their checkpoint of ``step``, as asked: an executor of the run is leaving (Spark
    decommissions it), and the run goes on from that checkpoint on the executors that stay."""

    def __init__(self, step: int):
        super().__init__(f"leaving after the checkpoint of step {step} (an executor of the run is being "
                         "decommissioned)")
        self.step = step


@dataclass
class _Run:
    """The loop's state: its position, the best weights kept, and the last train row's time, tokens and step."""

    pos: Position
    started: float
    best_weights: dict | None = None
    window: tuple[float, int, int] = field(default=(0.0, 0, 0))
    nonfinite: tuple[int, int] = (0, 0)  # units in a row whose mean loss was inf or nan, and the step they began


# Units in a row with a non-finite mean loss before the run stops as diverged. Not 1: fp16's loss scaler skips a step
# whose gradients overflowed, and the run goes on; weights gone nan keep the loss nan at every step after.
DIVERGED_AFTER = 3


def run(unit: Unit, rec: Recorder, schedule: Schedule, *, keep_best: bool, info: dict[str, Any]) -> RunResult:
    """A whole run of ``unit``, recorded by ``rec``, its cadence from ``schedule``; ``info``: extra fields of the
    info row (threads, sync_every)."""
    r = _restore(unit, rec)
    if (facts := unit.facts()) is not None:
        rec.info(facts, schedule.total_steps, **info)
    while True:
        done = unit.agree(schedule.done(r.pos.step, time.time() - r.started))
        if done >= 1.0:
            break
        before = r.pos.step
        after = before + schedule.unit(before, unit.size)
        ckpt = schedule.checkpoint(before, after)
        adv = unit.advance(after - before, done=done, evaluate=r.pos.pending_eval, checkpoint=ckpt)
        _diverged(r, adv.loss, after, rec.tc.lr)
        ckpt = ckpt or adv.leave
        if not rec.has_facts:
            rec.info(unit.facts() or {}, schedule.total_steps, **info)
        stop = False
        if adv.evaluation is not None:  # the deferred evaluation of the weights before this unit
            _record(unit, rec, r, adv.evaluation, before, r.pos.tokens, keep_best)
            stop = rec.best.should_stop(rec.tc.early_stop)  # decided on this evaluation
        for w in adv.warnings:
            rec.warn(w)
        r.pos = Position(after, r.pos.tokens + adv.tokens, time.time() - r.started)
        _rows(unit, rec, r, adv, before, schedule)
        due = schedule.evaluate(before, after)
        r.pos = Position(r.pos.step, r.pos.tokens, r.pos.elapsed, pending_eval=due and unit.deferred_eval)
        if due and not unit.deferred_eval:
            _record(unit, rec, r, unit.evaluate(), after, r.pos.tokens, keep_best)
            if rec.should_stop(unit.where()):  # every worker saw the same figures
                break
        if ckpt:
            rec.flush()  # the rows of the units it holds first: a resume from it must find them
            unit.save(Position(after, r.pos.tokens, time.time() - r.started, r.pos.pending_eval), rec.best,
                      r.best_weights)
        if adv.leave:
            raise Leaving(after)
        if stop and rec.should_stop(unit.where()):
            break
        if adv.halt:
            rec.note(f"ended at {unit.where()}, as asked (a search pruned the run)")
            break
    return _finish(unit, rec, r, keep_best)


def _diverged(r: _Run, loss: float, step: int, lr: float) -> None:
    """Stop a run whose mean loss (the same figure on every worker) stayed inf or nan for :data:`DIVERGED_AFTER`
    units: it would train on to its end and export weights of nan."""
    count, since = r.nonfinite
    r.nonfinite = (0, 0) if math.isfinite(loss) else (count + 1, since or step)
    if r.nonfinite[0] >= DIVERGED_AFTER:
        raise SparklmError(f"training diverged: the mean loss is {loss} since step {r.nonfinite[1]}",
                           hint=f"lower train.lr (it is {lr:g}) or raise train.warmup_steps; keep train.grad_clip on "
                                "(1.0); the checkpoints written before stay in the run directory")


def _restore(unit: Unit, rec: Recorder) -> _Run:
    """Continue from the unit's newest checkpoint, if any: the position, the best evaluation and its weights; the
    rows an interrupted run wrote after that checkpoint come again (a pending evaluation's too)."""
    found = unit.restore()
    pos = found.position if found is not None else Position()
    r = _Run(pos, started=time.time() - pos.elapsed)
    if found is not None:
        rec.best, r.best_weights = Best.restore(found.best, found.best_weights, pos.step, unit.snapshot,
                                                rec.tc.keep_best, rec.best.key)
    rec.rewind(pos.step, evaluated=not pos.pending_eval)
    r.window = (time.time(), pos.tokens, pos.step)
    return r


def _record(unit: Unit, rec: Recorder, r: _Run, ev: Evaluation, step: int, tokens: int, keep_best: bool) -> None:
    """An evaluation's row; on a new best (train.keep_best) its weights are kept."""
    if ev.warning:
        rec.warn(ev.warning)
    if rec.evaluation(step, tokens, ev.figures, counts=ev.counts) and keep_best:
        r.best_weights = ev.weights if ev.weights is not None else unit.snapshot()


def _rows(unit: Unit, rec: Recorder, r: _Run, adv: Advance, before: int, schedule: Schedule) -> None:
    """The train row (every ``log_every`` steps, and after the first unit), the unit's own rows, the epochs note."""
    step, tokens, elapsed = r.pos.step, r.pos.tokens, r.pos.elapsed
    if crossed(unit.log_every, before, step) or before == 0:
        now = time.time()
        last_time, last_tokens, last_step = r.window
        seconds = adv.seconds if adv.seconds is not None else now - last_time
        trained = adv.trained if adv.trained is not None else tokens - last_tokens
        rec.train(step=step, tokens=tokens, tokens_per_s=trained / max(seconds, 1e-9),
                  ms_per_step=1000 * seconds / max(step - last_step, 1), rss_mb=adv.rss_mb,
                  peaks=adv.peaks if adv.peaks is not None else unit.peaks(), elapsed=elapsed, loss=adv.loss,
                  acc=adv.acc, lr=adv.lr, grad_norm=adv.grad_norm, workers=adv.workers)
        r.window = (now, tokens, step)
    for row in adv.rows:
        rec.write(row)
    if before < unit.note_at <= step:  # by then the pace projects a time budget well enough
        total = schedule.total_steps
        per_step = tokens / step if step else 0
        rec.epochs(total * per_step if total else tokens / max(elapsed, 1e-9) * schedule.time_budget)


def _finish(unit: Unit, rec: Recorder, r: _Run, keep_best: bool) -> RunResult:
    """Evaluate the final weights (unless the run stopped right after evaluating them), checkpoint, export."""
    step = r.pos.step
    elapsed = time.time() - r.started
    if rec.evaluated_at != step:
        ev = unit.final_evaluation(will_export=r.best_weights is None)
        if ev is not None:  # a new best now is the current weights themselves: no copy
            _record(unit, rec, r, Evaluation(ev.figures, ev.counts, warning=ev.warning), step, r.pos.tokens, False)
            if rec.best.step == step:
                r.best_weights = None
    rec.flush()
    unit.save(Position(step, r.pos.tokens, elapsed), rec.best, r.best_weights)
    extra = unit.finish(rec.best.apart(r.best_weights, step))
    rec.note_peaks(unit.peaks())  # after the export, which may be a worker's peak
    return rec.result(steps=step, tokens=r.pos.tokens, seconds=elapsed, **extra)
