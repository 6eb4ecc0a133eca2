"""Per-epoch figures: the driver watches the train rows every strategy sends and, when a row's ``epoch`` passes
a whole number, adds an ``epoch`` row (rows.Epoch) that sums up the rows of that pass: loss and training
accuracy weighted by the steps each row covers, the learning rate at its end, its time, tokens/s, ms/step and
peak memory. It goes to epochs.csv, the console and the trackers.

An epoch ends at the first logged step at or after its last token (``train.log_every``; a round's row in
average/DiLoCo), so its figures are those of whole rows. A rewind (DDP restart, ``--resume``) forgets the rows
after the checkpoint and the epochs they ended; a resumed run starts from metrics.csv's rows, so an epoch that
spans the resume is summed whole.
"""

from __future__ import annotations

import math

from . import rows
from .rows import Row
from .sinks import Sink, halted

FIELDS = ("step", "epoch", "tokens", "loss", "acc", "lr", "elapsed", "peak_rss_mb")


def epoch_rows(train: list[dict]) -> list[rows.Epoch]:
    """The epochs completed by ``train`` rows (dicts with :data:`FIELDS`, in step order), one row each."""
    out, start, prev = [], 0, None  # start: the index of the epoch's first row; prev: the row before it
    for i, row in enumerate(train):
        before = train[i - 1]["epoch"] if i else 0.0
        done = whole(row["epoch"])
        if done <= whole(before):
            continue
        span = train[start:i + 1]
        out.append(_summed(whole(before) + 1, span, prev))
        # a row that ends several epochs at once (a tiny split) ends each with the same figures
        out += [_summed(k, span, prev) for k in range(out[-1].epoch + 1, done + 1)]
        start, prev = i + 1, row
    return out


def whole(epoch: float) -> int:
    """The passes completed at ``epoch`` (tokens ÷ epoch tokens; a hair of tolerance for float division)."""
    return math.floor(epoch + 1e-9)


def _summed(epoch: int, span: list[dict], prev: dict | None) -> rows.Epoch:
    last = span[-1]
    first_step = prev["step"] if prev else 0
    weights = [r["step"] - (span[j - 1]["step"] if j else first_step) for j, r in enumerate(span)]
    loss = _weighted([r["loss"] for r in span], weights)
    acc = _weighted([r.get("acc") for r in span], weights)
    seconds = last["elapsed"] - (prev["elapsed"] if prev else 0.0)
    tokens = last["tokens"] - (prev["tokens"] if prev else 0)
    steps = last["step"] - first_step
    return rows.Epoch(epoch=epoch, step=last["step"], tokens=last["tokens"], steps=steps, loss=loss, acc=acc,
                      lr=last["lr"], epoch_s=seconds, tokens_per_s=tokens / seconds if seconds > 0 else float("nan"),
                      ms_per_step=1000 * seconds / steps if steps else float("nan"),
                      peak_rss_mb=max((r.get("peak_rss_mb") or 0.0) for r in span), elapsed=last["elapsed"])


def _weighted(values: list, weights: list[int]) -> float:
    pairs = [(v, w) for v, w in zip(values, weights) if v is not None and not math.isnan(v) and w > 0]
    total = sum(w for _, w in pairs)
    return sum(v * w for v, w in pairs) / total if total else float("nan")


class EpochRows:
    """A sink in front of ``out`` (the run's other sinks): everything passes through, and each epoch that a train
    row completes follows it as an ``epoch`` row. ``earlier``: metrics.csv's train rows of a resumed run."""

    def __init__(self, out: Sink, earlier: list[dict] = ()):
        self.out = out
        self.train = [{k: r.get(k) for k in FIELDS} for r in earlier]
        self.sent = len(epoch_rows(self.train))

    def write(self, row: Row) -> None:
        self.out.write(row)
        if isinstance(row, rows.Train):
            self.train.append({k: getattr(row, k) for k in FIELDS})
            if len(self.train) > 1 and whole(row.epoch) <= whole(self.train[-2]["epoch"]):
                return  # no epoch ended at this row (the common case: no recount)
            for epoch in epoch_rows(self.train)[self.sent:]:
                self.out.write(epoch)
                self.sent += 1

    def rewind(self, step: int, evaluated: bool = True) -> None:
        self.train = [r for r in self.train if r["step"] <= step]
        self.sent = len(epoch_rows(self.train))
        self.out.rewind(step, evaluated)

    def flush(self) -> None:
        self.out.flush()

    def close(self) -> None:
        self.out.close()

    def halted(self) -> bool:
        return halted(self.out)
