"""What a run leaves for people: loss.png (train and validation loss against tokens) and samples.txt."""

from __future__ import annotations

import io

from ..config import StorageConfig
from ..infra.fs import join, write_bytes
from ..model.figures import FigureSet
from .sinks import read_metrics


def plot_loss(run_dir: str, figures: FigureSet, storage: StorageConfig | None = None) -> None:
    """loss.png from the run's metrics.csv: the train loss, and the task's evaluation loss (``figures.loss``)
    with its headline figure in the title."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(join(run_dir, "metrics.csv"), storage)
    train = [r for r in rows if r["kind"] == "train"]
    loss, head = figures.get(figures.loss), figures.main
    val = [r for r in rows if r["kind"] == "eval" and r.get(loss.key) is not None]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    ax.plot([r["tokens"] for r in train], [r["loss"] for r in train], label="train loss", lw=1)
    if val:
        ax.plot([r["tokens"] for r in val], [r[loss.key] for r in val], "o-", label="validation loss", ms=4)
    ax.set_xlabel("tokens seen")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend()
    if val:
        last = val[-1]
        ax.set_title(f"final validation: {loss.label} {last[loss.key]:{loss.fmt}}, {head.label} {last[head.key]:{head.fmt}}")
    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, format="png")
    plt.close(fig)
    write_bytes(join(run_dir, "loss.png"), png.getvalue(), storage)


