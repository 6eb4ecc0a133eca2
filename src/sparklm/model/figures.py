"""The figures a task's evaluation reports, torch-free: their keys, names and how people read them, and the pure
functions that make them from summed counts.

The driver, the sinks, the console, summary.json, loss.png and ``sparklm eval`` read a task's figures from its
:class:`FigureSet` (the task's module in sparklm/tasks/ names it) and never spell a figure's name themselves.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Figure:
    key: str  # in metric rows, metrics.csv and summary.json ("val_bpb")
    name: str  # in ``sparklm eval``'s figures ("bits_per_byte")
    label: str  # how the console says it ("bits/byte")
    fmt: str  # how the console writes it (a format spec)
    shown: bool = True  # in the console's line (a count such as val_tokens is recorded, not shown)


@dataclass(frozen=True)
class FigureSet:
    """The figures a task's evaluation reports. ``loss``: the key the best model and early stopping minimise;
    ``headline``: the key a run is summed up by (the last line ``sparklm run`` prints)."""

    figures: tuple[Figure, ...]
    loss: str
    headline: str

    def keys(self) -> list[str]:
        return [f.key for f in self.figures]

    def get(self, key: str) -> Figure:
        return next(f for f in self.figures if f.key == key)

    @property
    def main(self) -> Figure:
        """The headline figure."""
        return self.get(self.headline)

    def named(self, values: dict) -> dict:
        """Figures keyed by ``name`` (as ``sparklm eval`` gives them) → keyed by ``key`` (as a run records them)."""
        return {f.key: values[f.name] for f in self.figures if f.name in values}

    def line(self, values: dict, *, by: str = "key") -> str:
        """The figures as one line ("loss 2.1234 | perplexity 8.362 | …"); ``by``: values keyed by key or by name."""
        return " | ".join(f"{f.label} {values[getattr(f, by)]:{f.fmt}}" for f in self.figures
                          if f.shown and values.get(getattr(f, by)) is not None)


def lm_figures(nats: float, tokens: float, correct: float, nbytes: float) -> dict:
    """Loss (nats/token), perplexity, bits per byte, accuracy and the count from summed counts; {} when nothing
    counted."""
    if tokens == 0:
        return {}
    loss = nats / tokens
    return {"loss": loss, "perplexity": math.exp(min(loss, 700)), "bits_per_byte": nats / max(nbytes, 1) / math.log(2),
            "accuracy": correct / tokens, "tokens": int(tokens)}


LM_FIGURES = FigureSet((
    Figure("val_loss", "loss", "loss", ".4f"),
    Figure("val_ppl", "perplexity", "perplexity", ".3f"),
    Figure("val_bpb", "bits_per_byte", "bits/byte", ".4f"),
    Figure("val_acc", "accuracy", "accuracy", ".2%"),
    Figure("val_tokens", "tokens", "tokens", ",d", shown=False),
), loss="val_loss", headline="val_bpb")


