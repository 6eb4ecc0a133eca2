"""The rows a run emits, one dataclass per kind: what the sinks receive, what a DDP rank sends the driver (as a JSON
line, :func:`from_dict` on arrival) and what metrics.csv, rounds.csv and run_info.json hold (:meth:`to_dict`).

Kinds: ``info`` (the run's facts, once), ``train`` (a log step, or a round's steps: the same fields from every
strategy), ``eval`` (an evaluation: the task's named figures, model/figures.py), ``round`` (a round of average/
DiLoCo), ``epoch`` (a pass over the training split, made by the driver from train rows), ``note`` and ``warning``
(something the user should know). Torch-free.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar


@dataclass(frozen=True)
class Row:
    kind: ClassVar[str] = ""

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, **{f.name: getattr(self, f.name) for f in dataclasses.fields(self)}}


@dataclass(frozen=True)
class Info(Row):
    kind: ClassVar[str] = "info"
    strategy: str
    workers: int
    total_steps: int | None  # None: a time budget ends the run
    params: int | None = None
    trainable_params: int | None = None
    flops_per_token: float | None = None
    peak_flops: float | None = None  # the measured matmul peak of one worker (FLOP/s): what MFU is against
    dtype: str | None = None
    device: str | None = None  # where rank 0 (round worker 0) computed: "cpu", "cuda:0"
    optimizer: str | None = None
    threads: int | None = None  # DDP: torch threads per rank
    sync_every: int | None = None  # rounds: steps per round


@dataclass(frozen=True)
class Train(Row):
    kind: ClassVar[str] = "train"
    step: int
    epoch: float
    tokens: int
    loss: float
    lr: float
    grad_norm: float
    tokens_per_s: float
    ms_per_step: float
    mfu: float
    rss_mb: float
    peak_rss_mb: float
    rank_peak_rss_mb: str  # each worker's peak, "812/790" (sinks.rank_mb)
    elapsed: float
    acc: float = float("nan")  # next-token accuracy on the training batches: the logged step's (DDP), the round's
    workers: int = 0  # the workers that trained it (an elastic run's world size over time; 0: not recorded)


@dataclass(frozen=True)
class Eval(Row):
    kind: ClassVar[str] = "eval"
    step: int
    tokens: int
    figures: dict[str, float] = field(default_factory=dict)  # the task's named figures (val_loss, val_bpb, …)

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "step": self.step, "tokens": self.tokens, **self.figures}


@dataclass(frozen=True)
class Round(Row):
    kind: ClassVar[str] = "round"
    round: int
    step: int
    workers: int
    workers_done: int
    tokens: int
    loss: float
    inner_losses: str  # each worker's mean loss, ";"-separated
    attempts: str
    cold: str  # workers whose optimizer state restarted this round
    broadcast_bytes: int
    returned_bytes: int
    broadcast_s: float
    fetch_s: float
    compute_s: float
    aggregate_s: float
    round_s: float
    outer_update_norm: float
    delta_norm: float
    elapsed: float
    # for the progress line only (not in rounds.csv)
    total_steps: int | None = None
    tokens_per_s: float = 0.0
    eta_s: float = 0.0
    sent_mb: float = 0.0
    peak_rss_mb: float = 0.0


@dataclass(frozen=True)
class Epoch(Row):
    """A pass over the training split, done (train/epochs.py): the figures of the train rows it spans."""

    kind: ClassVar[str] = "epoch"
    epoch: int  # 1 for the first pass
    step: int  # the first logged step at or after the epoch's end
    tokens: int
    steps: int
    loss: float  # the train rows' losses, weighted by the steps each covers
    acc: float
    lr: float  # at the epoch's last row
    epoch_s: float
    tokens_per_s: float
    ms_per_step: float
    peak_rss_mb: float
    elapsed: float


@dataclass(frozen=True)
class Note(Row):
    kind: ClassVar[str] = "note"
    message: str


@dataclass(frozen=True)
class Warn(Row):
    kind: ClassVar[str] = "warning"
    message: str


# rounds.csv's columns: a round row's fields up to the ones only the progress line reads
_ROUND_FIELDS = [f.name for f in dataclasses.fields(Round)]
ROUND_COLUMNS = _ROUND_FIELDS[:_ROUND_FIELDS.index("total_steps")]
KINDS: dict[str, type[Row]] = {c.kind: c for c in (Info, Train, Eval, Round, Epoch, Note, Warn)}
EPOCH_COLUMNS = [f.name for f in dataclasses.fields(Epoch)]


def from_dict(raw: dict[str, Any]) -> Row:
    """The row :meth:`Row.to_dict` wrote (a rank's row arriving at the driver); ValueError for anything else."""
    cls = KINDS.get(raw.get("kind", ""))
    if cls is None:
        raise ValueError(f"not a row: kind {raw.get('kind')!r}")
    names = {f.name for f in dataclasses.fields(cls)}
    if cls is Eval:
        return Eval(step=raw["step"], tokens=raw["tokens"],
                    figures={k: v for k, v in raw.items() if k not in ("kind", "step", "tokens")})
    return cls(**{k: v for k, v in raw.items() if k in names})
