"""Text (pair) regression: a number per text, learned from a float label column.

``prepare --task regress`` reads labelled records as classify does (CSV/TSV, JSONL, Parquet, a DataFrame; the label
a number: a record whose label does not read as a finite number is dropped and counted), hash-splits them and writes
one encoded record per row with its target as float32. ``train --task regress`` fine-tunes any model that
transformers' ``AutoModelForSequenceClassification`` loads (``--init-from``: BERT, RoBERTa, MiniLM, or a decoder),
with one output (``problem_type = "regression"``), full or LoRA, under every strategy: the loss is the mean squared
error; the figures MSE, MAE, RMSE and R² of the validation split. model/ is a plain HF directory, so
``pipeline("text-classification", function_to_apply="none")``, ``sparklm predict`` (its ``score``) and ``sparklm
export`` read it as any regressor; the run leaves scatter.png (predicted against true values of the validation
split) beside report.html, which shows it.

The whole task is this module: torch and transformers are imported where a model is built.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass

from ..model.encoders import EncoderTask
from ..model.figures import Figure, FigureSet
from ..registry import VALUES, DataKind, TaskInfo

FIGURES = FigureSet((
    Figure("val_loss", "loss", "MSE", ".4f"),
    Figure("val_mae", "mae", "MAE", ".4f"),
    Figure("val_rmse", "rmse", "RMSE", ".4f"),
    Figure("val_r2", "r2", "R²", ".4f"),
    Figure("val_examples", "examples", "examples", ",d", shown=False),
), loss="val_loss", headline="val_r2")
SCATTER = "scatter.png"
SCATTER_ROWS = 2000  # validation rows the scatter plot shows at most


def regression_figures(sse: float, n: float, abs_err: float, total: float, squares: float) -> dict:
    """MSE, MAE, RMSE, R² and the count from summed [squared errors, examples, absolute errors, targets, squared
    targets] (pure); {} when nothing was scored. R² is 1 − SSE/SST, NaN when the targets do not vary."""
    if n == 0:
        return {}
    mse = sse / n
    sst = squares - total * total / n
    return {"loss": mse, "mae": abs_err / n, "rmse": math.sqrt(mse),
            "r2": 1.0 - sse / sst if sst > 1e-12 * max(squares, 1.0) else float("nan"), "examples": int(n)}


@dataclass(frozen=True)
class Regressor(EncoderTask):
    """The task object the training core and the strategies use (model/task.py's ``Task``): parameters, decay,
    FLOPs and the merged HF export as every encoder task's."""

    name = "regress"
    figure_set = FIGURES
    eval_width = 5  # squared errors, examples, absolute errors, targets, squared targets

    @classmethod
    def from_config(cls, config) -> Regressor:
        return cls()

    def build(self, config, spec, context: int):
        from transformers import AutoModelForSequenceClassification

        from ..model.encoders import load_pretrained, uses_types, wrap_encoder

        model = load_pretrained(config, AutoModelForSequenceClassification, "a regressor", **hf_config(config))
        if model.config.pad_token_id is None:  # decoders pool their last real token: they must know the padding
            model.config.pad_token_id = spec.pad_id
        model.sparklm_types = uses_types(model)
        return wrap_encoder(model, config, "SEQ_CLS")  # peft's SEQ_CLS trains the new head beside the adapters

    def batch(self, rows):
        from ..model.encoders import encoder_batch

        return encoder_batch(rows)

    def _predict(self, net, batch):
        from ..model.encoders import forward

        return forward(net, batch).logits.float().squeeze(-1), batch.labels.float()

    def loss(self, net, batch, total: int | None = None, tally=None):
        """The batch's summed squared error over ``total`` examples (micro-batches weigh by rows). No accuracy:
        ``tally`` stays untouched, so the train rows' acc is empty."""
        import torch.nn.functional as F

        pred, target = self._predict(net, batch)
        return F.mse_loss(pred, target, reduction="sum") / (total or target.numel())

    def eval_sums(self, model, batch, byte_lengths):
        import torch

        pred, target = self._predict(model, batch)
        err = (pred - target).double()
        t = target.double()
        return torch.stack([(err * err).sum(), torch.tensor(float(t.numel()), dtype=torch.float64, device=t.device),
                            err.abs().sum(), t.sum(), (t * t).sum()])

    def figures(self, sums: list[float]) -> dict:
        return self.figure_set.named(regression_figures(*sums))

    def artefacts(self, model, spec, run_dir: str, dataset, config) -> None:
        """scatter.png: model/'s predictions against the true values of (up to SCATTER_ROWS of) the validation
        split."""
        import numpy as np
        import torch

        from ..data.manifest import checked_row_groups
        from ..data.stream import validation_rows
        from ..infra.fs import join, write_bytes

        groups = checked_row_groups(dataset, "validation", config.storage)
        if not groups:
            return
        preds, targets = [], []
        model.eval()
        with torch.no_grad():
            for rows in validation_rows(groups, seq_len=dataset.seq_len, rank=0, world=1, limit=SCATTER_ROWS,
                                        storage=config.storage):
                for i in range(0, len(rows.input_ids), 32):
                    pred, target = self._predict(model, self.batch(rows.take(slice(i, i + 32))))
                    preds.append(pred.cpu().numpy())
                    targets.append(target.cpu().numpy())
        if preds:
            write_bytes(join(run_dir, SCATTER), scatter_png(np.concatenate(targets), np.concatenate(preds)),
                        config.storage)


def scatter_png(true, pred) -> bytes:
    """The scatter plot of predicted against true values, the diagonal where they agree, and its figures."""
    import matplotlib
    import numpy as np

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    f = regression_figures(float(((pred - true) ** 2).sum()), len(true), float(np.abs(pred - true).sum()),
                           float(true.sum()), float((true.astype(np.float64) ** 2).sum()))
    fig, ax = plt.subplots(figsize=(5.5, 5), dpi=120)
    ax.scatter(true, pred, s=8, alpha=0.5)
    lo, hi = float(min(true.min(), pred.min())), float(max(true.max(), pred.max()))
    ax.plot([lo, hi], [lo, hi], color="gray", lw=1, ls="--", label="predicted = true")
    ax.set_xlabel("true value")
    ax.set_ylabel("predicted value")
    ax.set_title(f"model/ on {len(true):,} validation rows: R² {f['r2']:.3f}, MAE {f['mae']:.4g}", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, format="png")
    plt.close(fig)
    return png.getvalue()


def hf_config(config) -> dict:
    """One output, read by transformers (and its pipelines) as a regression."""
    return {"id2label": {0: "value"}, "label2id": {"value": 0}, "problem_type": "regression"}


def section(run) -> list[str]:
    """report.html: the kept evaluation's figures and the scatter plot beside the page."""
    from ..metrics.html_report import esc, table

    kept = run.summary.get("best") or run.summary.get("final") or {}
    if not kept:
        return []
    rows = [(f.label, f"{kept[f.key]:{f.fmt}}") for f in FIGURES.figures if kept.get(f.key) is not None]
    return ["<h2>Predictions (model/, validation split)</h2>", table(rows, ("figure", "value")),
            f"<p><img src={esc(SCATTER)} alt='predicted against true values' style='max-width:520px'></p>"]


def make(config) -> Regressor:
    return Regressor.from_config(config)


INFO = TaskInfo(name="regress", figures=FIGURES, make=make, data=("regress",),
                prepares=DataKind(rows="encoded", labels=VALUES, long="truncate"), pretrained=True,
                auto="AutoModelForSequenceClassification", peft="SEQ_CLS", pipeline="text-classification",
                hf_config=hf_config, shows=SCATTER,
                section=section)
