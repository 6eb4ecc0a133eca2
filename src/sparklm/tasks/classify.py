"""Text (pair) classification with a pretrained model (``--init-from``): any model that transformers'
``AutoModelForSequenceClassification`` loads, full or LoRA; the classes come from the dataset. The model's math is
model/encoders.py's ``SequenceClassifier``; the run's report shows each class's figures and the confusion matrix."""

from __future__ import annotations

from dataclasses import replace

from ..infra.errors import SparklmError
from ..model.figures import CLASSIFY_FIGURES
from . import DataKind, TaskInfo


def make(config):
    from ..model.encoders import SequenceClassifier

    return SequenceClassifier.from_config(config)


def hf_config(config) -> dict:
    """The classifier head's labels, as the dataset names them."""
    names = dict(enumerate(config.model.labels or ["0", "1"]))
    return {"id2label": names, "label2id": {v: k for k, v in names.items()}}


def settle(config, manifest: dict, data: str):
    """The classes come from the dataset's manifest (a resumed run's must be the same)."""
    names = list(manifest["labels"]["names"])
    if config.model.labels and list(config.model.labels) != names:
        raise SparklmError(f"{data} has the classes {names}, and the run was trained on {list(config.model.labels)}",
                           hint="resume on the dataset the run started with")
    return config.replace(model=replace(config.model, labels=names))


def report(run_dir: str, kept: dict, storage) -> None:
    from ..metrics.report import plot_confusion

    plot_confusion(run_dir, kept, storage)


def section(run) -> list[str]:
    from ..metrics.html_report import classes_section

    kept = run.summary.get("best") or run.summary.get("final") or {}
    if not kept.get("val_confusion"):
        return []
    return ["<h2>Classes (model/, validation split)</h2>", classes_section(kept)]


INFO = TaskInfo(name="classify", figures=CLASSIFY_FIGURES, make=make, data=("classify",),
                prepares=DataKind(rows="encoded", labels="class", long="truncate"), pretrained=True,
                auto="AutoModelForSequenceClassification", peft="SEQ_CLS", pipeline="text-classification",
                hf_config=hf_config, settle=settle,
                shows="confusion.png", report=report, section=section)
