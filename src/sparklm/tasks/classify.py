"""Text (pair) classification with a pretrained model (``--init-from``): any model that transformers'
``AutoModelForSequenceClassification`` loads, full or LoRA; the classes come from the dataset, whose labels are
registry.CLASSES (names → ids, a stratified split).

The whole task is this module: its model on the encoder building blocks (model/encoders.py: loading, LoRA, the
merged export), its figures (loss, accuracy, macro-F1, each class's precision and recall, the confusion matrix), the
picture it leaves (confusion.png) and its section of report.html. torch is imported where a model is built.
"""

from __future__ import annotations

import io
import re
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from ..config import Config, StorageConfig
from ..data.tokenizer import TokenizerSpec
from ..infra.errors import SparklmError
from ..infra.fs import join, write_bytes
from ..model.encoders import EncoderBatch, EncoderTask
from ..model.figures import Figure, FigureSet
from ..registry import CLASSES, DataKind, TaskInfo

if TYPE_CHECKING:
    import torch

FIGURES = FigureSet((
    Figure("val_loss", "loss", "loss", ".4f"),
    Figure("val_acc", "accuracy", "accuracy", ".2%"),
    Figure("val_f1", "macro_f1", "macro-F1", ".4f"),
    Figure("val_examples", "examples", "examples", ",d", shown=False),
), loss="val_loss", headline="val_acc")


def safe_name(label: str) -> str:
    """A class name as part of a figure's key (``val_recall/<name>``): characters trackers accept in metric names."""
    return re.sub(r"[^A-Za-z0-9_.\- ]", "_", label)[:64] or "_"


def classify_figures(sums: list[float], labels: list[str]) -> dict:
    """Loss, accuracy, macro-F1, per-class precision/recall and the confusion matrix from summed
    [nats, examples, correct, confusion (true class-major, K×K)]; {} when nothing was scored. A class the split
    never holds nor predicts has no precision/recall and is left out of the macro average (as scikit-learn's
    ``labels=`` present-only convention: its F1 would be 0/0)."""
    nats, n, correct = sums[:3]
    if n == 0:
        return {}
    k = len(labels)
    cm = [[int(round(v)) for v in sums[3 + i * k:3 + (i + 1) * k]] for i in range(k)]
    per, f1s = {}, []
    for c, name in enumerate(labels):
        tp = cm[c][c]
        actual, predicted = sum(cm[c]), sum(cm[r][c] for r in range(k))
        if actual == 0 and predicted == 0:
            continue
        precision = tp / predicted if predicted else 0.0
        recall = tp / actual if actual else 0.0
        f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
        per[name] = {"precision": precision, "recall": recall, "f1": f1, "support": actual}
        f1s.append(f1)
    return {"loss": nats / n, "accuracy": correct / n, "macro_f1": sum(f1s) / len(f1s), "examples": int(n),
            "per_class": per, "confusion": {"labels": list(labels), "matrix": cm}}


@dataclass(frozen=True)
class SequenceClassifier(EncoderTask):
    """Text (pair) classification into ``labels`` (the dataset's classes, in id order)."""

    name = "classify"
    figure_set = FIGURES
    labels: tuple[str, ...] = ()

    @classmethod
    def from_config(cls, config: Config) -> SequenceClassifier:
        return cls(labels=tuple(config.model.labels))

    @property
    def eval_width(self) -> int:
        return 3 + len(self.labels) ** 2

    def build(self, config: Config, spec: TokenizerSpec, context: int) -> torch.nn.Module:
        from transformers import AutoModelForSequenceClassification

        from ..model.encoders import load_pretrained, uses_types, wrap_encoder

        if len(self.labels) < 2:
            raise SparklmError("--task classify needs the dataset's classes (model.labels), and has "
                               f"{len(self.labels)}", hint="train on data prepared with `sparklm prepare --task classify`")
        names = dict(enumerate(self.labels))
        model = load_pretrained(config, AutoModelForSequenceClassification, "a sequence classifier",
                                id2label=names,
                                label2id={v: k for k, v in names.items()})
        if model.config.pad_token_id is None:  # decoders pool their last real token: they must know the padding
            model.config.pad_token_id = spec.pad_id
        model.sparklm_types = uses_types(model)
        return wrap_encoder(model, config, "SEQ_CLS")

    def batch(self, rows) -> EncoderBatch:
        from ..model.encoders import encoder_batch

        return encoder_batch(rows)

    def loss(self, net: torch.nn.Module, batch: EncoderBatch, total: int | None = None,
             tally: torch.Tensor | None = None) -> torch.Tensor:
        import torch
        import torch.nn.functional as F

        from ..model.encoders import forward

        logits = forward(net, batch).logits.float()
        if tally is not None:
            with torch.no_grad():
                tally[0] += (logits.argmax(-1) == batch.labels).sum()
                tally[1] += batch.labels.numel()
        return F.cross_entropy(logits, batch.labels, reduction="sum") / (total or batch.labels.numel())

    def eval_sums(self, model: torch.nn.Module, batch: EncoderBatch, byte_lengths: torch.Tensor) -> torch.Tensor:
        """[nats, examples, correct, confusion matrix K×K (true class-major)]."""
        import torch
        import torch.nn.functional as F

        from ..model.encoders import forward

        logits = forward(model, batch).logits.float()
        k = len(self.labels)
        pred = logits.argmax(-1)
        confusion = torch.bincount(batch.labels * k + pred, minlength=k * k).double()
        head = torch.stack([F.cross_entropy(logits, batch.labels, reduction="sum").double(),
                            torch.tensor(float(batch.labels.numel()), dtype=torch.float64, device=logits.device),
                            (pred == batch.labels).sum().double()])
        return torch.cat([head, confusion])

    def figures(self, sums: list[float]) -> dict:
        """The figure set's figures, each class's precision and recall (``val_precision/NAME``: trackers log them),
        and ``val_per_class`` and ``val_confusion`` (summary.json)."""
        values = classify_figures(sums, list(self.labels))
        if not values:
            return {}
        out = self.figure_set.named(values)
        for name, v in values["per_class"].items():
            out[f"val_precision/{safe_name(name)}"] = v["precision"]
            out[f"val_recall/{safe_name(name)}"] = v["recall"]
        out["val_per_class"] = values["per_class"]
        out["val_confusion"] = values["confusion"]
        return out


def make(config: Config) -> SequenceClassifier:
    return SequenceClassifier.from_config(config)


def hf_config(config: Config) -> dict:
    """The classifier head's labels, as the dataset names them."""
    names = dict(enumerate(config.model.labels or ["0", "1"]))
    return {"id2label": names, "label2id": {v: k for k, v in names.items()}}


def settle(config: Config, manifest: dict, data: str) -> Config:
    """The classes come from the dataset's manifest (a resumed run's must be the same)."""
    names = list(manifest["labels"]["names"])
    if config.model.labels and list(config.model.labels) != names:
        raise SparklmError(f"{data} has the classes {names}, and the run was trained on {list(config.model.labels)}",
                           hint="resume on the dataset the run started with")
    return config.replace(model=replace(config.model, labels=names))


def plot_confusion(run_dir: str, kept: dict, storage: StorageConfig | None = None) -> None:
    """confusion.png: the confusion matrix of a classifier's kept evaluation (``kept``: summary.json's best, else
    final: model/'s weights; rows the true class, columns the predicted one), each cell its count and its share
    of the row. Nothing for a run whose figures hold none."""
    confusion = kept.get("val_confusion")
    if not confusion:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    labels, cm = confusion["labels"], np.asarray(confusion["matrix"], dtype=float)
    k = len(labels)
    share = cm / np.maximum(cm.sum(axis=1, keepdims=True), 1)
    size = min(12, 4.5 + 0.5 * k)
    fig, ax = plt.subplots(figsize=(size, size * 0.85), dpi=120)
    im = ax.imshow(share, cmap="Blues", vmin=0, vmax=1)
    ax.set_xticks(range(k), [str(x)[:16] for x in labels], rotation=45, ha="right", parse_math=False)
    ax.set_yticks(range(k), [str(x)[:16] for x in labels], parse_math=False)  # a label is text, never TeX
    ax.set_xlabel("predicted")
    ax.set_ylabel("true")
    if k <= 20:
        for i in range(k):
            for j in range(k):
                ax.text(j, i, f"{int(cm[i, j])}\n{share[i, j]:.0%}", ha="center", va="center", fontsize=8,
                        color="white" if share[i, j] > 0.5 else "black")
    acc = np.trace(cm) / max(cm.sum(), 1)
    ax.set_title(f"model/ on the validation split: accuracy {acc:.1%} of {int(cm.sum()):,}", fontsize=9)
    fig.colorbar(im, ax=ax, fraction=0.046, label="share of the true class")
    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, format="png")
    plt.close(fig)
    write_bytes(join(run_dir, "confusion.png"), png.getvalue(), storage)


def classes_table(figures: dict) -> str:
    """A classifier's evaluation: each class's precision, recall, F1 and support, then the confusion matrix
    (rows: the true class)."""
    per = figures.get("val_per_class", {})
    rows = [(name, f"{v['precision']:.3f}", f"{v['recall']:.3f}", f"{v['f1']:.3f}", f"{v['support']:,}")
            for name, v in per.items()]
    cm = figures["val_confusion"]
    labels = [str(x) for x in cm["labels"]]
    matrix = [(f"true {name}", *(f"{n:,}" for n in row)) for name, row in zip(labels, cm["matrix"])]
    from ..metrics.html_report import table

    return (table(rows, ("class", "precision", "recall", "F1", "support"))
            + "<p class=sub>Confusion matrix (rows: the true class; columns: the predicted one)</p>"
            + table(matrix, ("", *labels)))


def section(run) -> list[str]:
    """report.html: the kept evaluation's classes (model/'s weights)."""
    kept = run.summary.get("best") or run.summary.get("final") or {}
    if not kept.get("val_confusion"):
        return []
    return ["<h2>Classes (model/, validation split)</h2>", classes_table(kept)]


INFO = TaskInfo(name="classify", figures=FIGURES, make=make, data=("classify",),
                prepares=DataKind(rows="encoded", labels=CLASSES, long="truncate"), pretrained=True,
                auto="AutoModelForSequenceClassification", peft="SEQ_CLS", pipeline="text-classification",
                hf_config=hf_config, settle=settle,
                shows="confusion.png", report=plot_confusion, section=section)
