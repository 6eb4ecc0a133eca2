"""What a run records, the same for every strategy: its rows, the best evaluation, early stopping, the epochs
note, every worker's peak memory, and the one :class:`RunResult`.

The run loop (train/loop.py), for a DDP rank and for the rounds driver alike, hands their figures to a
:class:`Recorder`; the row a sink receives does not depend on which strategy trained. Torch-free.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from typing import Any

from ..config import TrainConfig
from ..model.figures import FigureSet
from . import rows
from .sinks import Sink, rank_mb

NOTE_STEP = 20  # the step after which a DDP run says whether its plan covers many epochs (rounds: the first round)
MANY_EPOCHS = 8  # past this many passes, a model of the default size learns a text by heart (BENCHMARKS.md)


def epochs_note(epochs: float, epoch_tokens: int) -> str | None:
    """What to say when a run's plan covers many epochs of its training split (None: nothing to say)."""
    if epochs <= MANY_EPOCHS:
        return None
    return (f"the budget covers ~{epochs:.0f} epochs of the {epoch_tokens:,} training tokens: the model will learn "
            f"them by heart and validation loss will stop falling; model/ keeps the best evaluation, and more "
            f"text helps most (docs/train.md, defaults that fit the data)")


@dataclass
class Best:
    """The evaluation with the lowest validation loss so far (the figure ``key`` names: the task's loss), and how
    many evaluations have not beaten it."""

    step: int | None = None
    figures: dict = field(default_factory=dict)
    stale: int = 0
    key: str = "val_loss"

    def update(self, step: int, figures: dict) -> bool:
        """Record an evaluation; True when it is the new best."""
        if not figures:
            return False
        if self.step is None or figures[self.key] < self.figures[self.key]:
            self.step, self.figures, self.stale = step, dict(figures), 0
            return True
        self.stale += 1
        return False

    def should_stop(self, patience: int) -> bool:
        """Early stopping: ``patience`` evaluations in a row without a new best (0: never)."""
        return patience > 0 and self.stale >= patience

    def summary(self) -> dict:
        return {"step": self.step, **self.figures} if self.step is not None else {}

    def to_state(self) -> dict:
        return {"step": self.step, "figures": self.figures, "stale": self.stale}

    @classmethod
    def from_state(cls, state: dict | None, key: str = "val_loss") -> Best:
        return cls(**state, key=key) if state else cls(key=key)

    def apart(self, weights: dict | None, step: int) -> dict | None:
        """The best ``weights`` when they are not those of step ``step`` (what model/ gets instead of them)."""
        return weights if weights is not None and self.step != step else None

    def checkpoint_files(self, weights: dict | None, step: int) -> dict:
        """The checkpoint file of the best ``weights``, when they are not the checkpoint's own."""
        kept = self.apart(weights, step)
        return {"best": kept} if kept is not None else {}

    @classmethod
    def restore(cls, state: dict, saved: dict, step: int, current, keep: bool, key: str = "val_loss"
                ) -> tuple[Best, dict | None]:
        """The tracker (``state``: :meth:`to_state`'s) and best weights a checkpoint of step ``step`` holds: its
        ``best`` file, else (when the best evaluation is the checkpoint's own step) ``current()``; a best whose
        weights were not kept starts anew."""
        best = cls.from_state(state, key)
        if saved:
            return best, saved
        if keep and best.step == step:
            return best, current()
        return (cls(key=key), None) if best.step is not None else (best, None)


@dataclass(frozen=True)
class RunResult:
    """A run's outcome, from every strategy alike; ``summary.json`` is made from it."""

    steps: int
    tokens: int
    seconds: float
    params: int | None
    flops_per_token: float | None
    peak_flops: float | None
    dtype: str | None
    final: dict = field(default_factory=dict)  # the last evaluation's figures
    best: dict = field(default_factory=dict)  # the best evaluation: its step and figures (model/ holds its weights)
    bytes_communicated: int = 0
    peak_rss_mb: float = 0.0  # the largest resident memory of a training process
    trainable_params: int | None = None
    rank_peak_rss_mb: list[float] = field(default_factory=list)  # each rank's (round worker's) peak, in rank order
    rounds: int | None = None
    bytes_broadcast: int | None = None
    bytes_returned: int | None = None
    device: str | None = None  # rank 0's (round worker 0's): "cpu", "cuda:0"
    gpus: list[str] = field(default_factory=list)  # the GPU address Spark assigned each rank's task, in rank order

    def to_json(self) -> str:
        return json.dumps({f.name: getattr(self, f.name) for f in fields(self)})

    @classmethod
    def from_json(cls, text: str) -> RunResult:
        """From :meth:`to_json`'s output (a DDP rank's result, sent to its Spark task and on to the driver)."""
        raw = json.loads(text)
        return cls(**{f.name: raw[f.name] for f in fields(cls) if f.name in raw})


class Recorder:
    """Rows to ``sink`` (None: a rank that records nothing, but tracks the best evaluation like the others), the
    best evaluation and early stopping, the epochs note, each worker's peak memory, and the run's result."""

    def __init__(self, sink: Sink | None, tc: TrainConfig, *, strategy: str, workers: int, epoch_tokens: int,
                 figures: FigureSet):
        self.sink, self.tc, self.strategy, self.workers = sink, tc, strategy, workers
        self.epoch_tokens = max(epoch_tokens, 1)
        self.best = Best(key=figures.loss)
        self.facts = rows.Info(strategy=strategy, workers=workers, total_steps=None)  # until info() is called
        self.has_facts = False
        self.peak_warned = False
        self.peaks = [0.0] * workers  # each worker's peak resident memory so far, in rank order
        self.last_eval: dict = {}  # the figures of the last evaluation
        self.evaluated_at: int | None = None  # its step

    def write(self, row: rows.Row) -> None:
        if self.sink is not None:
            self.sink.write(row)

    def info(self, facts: dict, total_steps: int | None, **extra: Any) -> None:
        """The run's facts (params, FLOPs per token, peak FLOP/s, dtype, optimizer; a worker's ``facts``), once."""
        self.facts = rows.Info(strategy=self.strategy, workers=self.workers, total_steps=total_steps, **facts, **extra)
        self.has_facts = True
        self.write(self.facts)

    def rewind(self, step: int, evaluated: bool = True) -> None:
        """The run continues from its checkpoint of ``step`` (0: from the start): every sink forgets the rows after
        it, which the run now writes again (a resumed run, a restarted one); ``evaluated`` False: and the rows of
        the evaluation of ``step``'s weights, which that checkpoint precedes."""
        if self.sink is not None:
            self.sink.rewind(step, evaluated)

    def flush(self) -> None:
        """Every row so far made durable: called before each checkpoint (see ``Sink.flush``)."""
        if self.sink is not None:
            self.sink.flush()

    def note(self, message: str) -> None:
        self.write(rows.Note(message))

    def warn(self, message: str) -> None:
        self.write(rows.Warn(message))

    def note_peaks(self, peaks: list[float | None]) -> None:
        """Each worker's peak resident memory now (None: a worker that reported nothing)."""
        self.peaks = [max(a, b or 0.0) for a, b in zip(self.peaks, peaks)]

    def train(self, *, step: int, tokens: int, loss: float, lr: float, grad_norm: float, tokens_per_s: float,
              ms_per_step: float, rss_mb: float, peaks: list[float | None], elapsed: float,
              acc: float = float("nan"), workers: int = 0) -> rows.Train:
        """A train row (the same fields from every strategy); ``peaks``: each worker's peak memory at this row;
        ``workers``: those that trained it (0: the run's)."""
        self.note_peaks(peaks)
        f = self.facts
        row = rows.Train(step=step, epoch=tokens / self.epoch_tokens, tokens=tokens, loss=loss, acc=acc, lr=lr,
                         grad_norm=grad_norm, tokens_per_s=tokens_per_s, ms_per_step=ms_per_step,
                         mfu=tokens_per_s * (f.flops_per_token or 0.0) / (f.peak_flops * self.workers)
                         if f.peak_flops else float("nan"),
                         rss_mb=rss_mb, peak_rss_mb=max(p for p in peaks if p is not None),
                         rank_peak_rss_mb=rank_mb(peaks), elapsed=elapsed, workers=workers or self.workers)
        self.write(row)
        if row.mfu > 1.0 and (f.peak_flops or 0) > 1.0 and not self.peak_warned:  # the peak is wrong, not the run
            self.peak_warned = True
            self.warn(f"MFU {row.mfu:.0%} is above 100%: the matmul peak it is measured against "
                      f"({(f.peak_flops or 0) / 1e9:.1f} GFLOP/s) is too low, measured while the host was busy; "
                      "delete peak.json in sparklm's cache on the workers' hosts (~/.cache/sparklm) to measure it again")
        return row

    def evaluation(self, step: int, tokens: int, figures: dict, *, counts: bool = True) -> bool:
        """An evaluation's row, and the best one so far; True when this one is the new best. One that does not
        ``counts`` (it scored only part of the split) is recorded and leaves the best and early stopping alone."""
        if figures:
            self.write(rows.Eval(step=step, tokens=tokens, figures=figures))
        self.last_eval, self.evaluated_at = figures, step
        return self.best.update(step, figures) if counts else False

    def should_stop(self, where: str) -> bool:
        """Early stopping (train.early_stop), with its note; ``where`` names the point (``step 40``, ``round 3``)."""
        if not self.best.should_stop(self.tc.early_stop):
            return False
        self.note(f"early stop at {where}: no lower validation loss in {self.tc.early_stop} evaluations "
                  f"(best at step {self.best.step})")
        return True

    def epochs(self, planned_tokens: float) -> None:
        """The note for a plan of many epochs, once the run's pace projects it."""
        note = epochs_note(planned_tokens / self.epoch_tokens, self.epoch_tokens)
        if note:
            self.note(note)

    def result(self, *, steps: int, tokens: int, seconds: float, **extra: Any) -> RunResult:
        f = self.facts
        return RunResult(steps=steps, tokens=tokens, seconds=seconds, params=f.params,
                         flops_per_token=f.flops_per_token, peak_flops=f.peak_flops,
                         dtype=f.dtype, device=f.device, final=self.last_eval, best=self.best.summary(),
                         peak_rss_mb=max(self.peaks, default=0.0), rank_peak_rss_mb=list(self.peaks),
                         **{"trainable_params": f.trainable_params, **extra})
