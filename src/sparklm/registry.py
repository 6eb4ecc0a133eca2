"""The registries: sparklm's tasks and strategies by name, what each task's dataset is, and its kind of labels.

The bottom layer: this module imports nothing of sparklm, so the configuration, the data pipeline, the memory plan,
the report and the trackers all consult it from below. A task's or a strategy's module is found by name when it is
first asked for (a plugin), never imported from here: a task module (``sparklm/tasks/NAME.py``) holds everything
that depends on what is trained (its model class, dataset checks, figures, report sections, CLI choices) and
exports its :class:`TaskInfo` as ``INFO``. Code outside a task module never tests a task's name: it asks the
capability the task declares here. Torch-free.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# -- labels: how a dataset's labels are read, split and summed up; both prepare engines consult them ------------


class LabelKind:
    """Labels of no kind: a dataset of documents (a causal LM's, a masked LM's). The base of the label kinds: each
    says its Parquet column's type, the split rule and the figures the manifest records."""

    column: str | None = None  # the labels column's Arrow type (pyarrow.type_for_alias); None: no column
    stratified: bool = False  # split per label (each class's share of validation), else by the record's hash
    describe: str = ""  # the manifest's description of the labels column

    @property
    def labelled(self) -> bool:
        """Whether records carry a label (read from a column, written as one)."""
        return self.column is not None

    def read(self, cell: Any) -> str | None:
        """A label cell as the text kept for the record (None: no label, the record is dropped and counted)."""
        return None

    def encode(self, labels: list[str], ids: dict[str, int] | None) -> list:
        """The column's values for records' labels (as :meth:`read` kept them); ``ids``: class names → ids."""
        return []

    def tally(self, acc: list | None, values: list) -> list:
        """``acc`` (None: nothing yet) with a written part's column ``values`` added (pure, mergeable)."""
        return acc or []

    def figures(self, parts: list[list]):
        """The manifest's figures of a split from the tallies of its parts."""
        return {}


class ClassLabels(LabelKind):
    """Class names → ids, a stratified split: within each class the records with the smallest split keys go to
    validation, so every class has its share there."""

    column, stratified = "int64", True
    describe = "int64, the class id (labels.names[id])"

    def read(self, cell: Any) -> str | None:
        """Strings stripped, integers and booleans as written, floats that are whole numbers as integers (CSV's "1"
        and Parquet's 1 and 1.0 are one class); empty or missing: None."""
        if cell is None or isinstance(cell, (list, dict)):
            return None
        if isinstance(cell, bool):
            return str(cell).lower()
        if isinstance(cell, float):
            if cell != cell:  # NaN: pandas' missing value
                return None
            return str(int(cell)) if cell.is_integer() else repr(cell)
        name = str(cell).strip()
        return name or None

    def encode(self, labels: list[str], ids: dict[str, int] | None) -> list:
        return [ids[label] for label in labels]

    def tally(self, acc: list | None, values: list) -> list:
        """Rows per class id, as [[id, rows], ...]."""
        return self.figures([acc or [], [[v, 1] for v in values]])

    def figures(self, parts: list[list]) -> list:
        """The parts' rows per class id merged, as [[id, rows], ...] by id."""
        counts: dict = {}
        for part in parts:
            for k, n in part:
                counts[k] = counts.get(k, 0) + n
        return sorted([k, n] for k, n in counts.items())


class ValueLabels(LabelKind):
    """A number per record (a float32 target), hash-split as documents are."""

    column = "float32"
    describe = "float32, the record's target value"

    def read(self, cell: Any) -> str | None:
        """A finite number (or a string that reads as one), written as Python writes the float; anything else
        (missing, text, NaN, infinity): None."""
        if isinstance(cell, bool) or cell is None or isinstance(cell, (list, dict)):
            return None
        try:
            x = float(str(cell).strip()) if isinstance(cell, str) else float(cell)
        except (TypeError, ValueError, OverflowError):
            return None
        return repr(x) if math.isfinite(x) else None

    def encode(self, labels: list[str], ids: dict[str, int] | None) -> list:
        return [float(label) for label in labels]

    def tally(self, acc: list | None, values: list) -> list:
        """[rows, sum, sum of squares, min, max]."""
        n, total, squares, lo, hi = acc or [0, 0.0, 0.0, math.inf, -math.inf]
        if not values:
            return [n, total, squares, lo, hi]
        return [n + len(values), total + sum(values), squares + sum(v * v for v in values), min(lo, min(values)),
                max(hi, max(values))]

    def figures(self, parts: list[list]) -> dict:
        """Rows, mean, standard deviation, min and max of the split's values."""
        n = sum(p[0] for p in parts)
        if not n:
            return {"rows": 0}
        total, squares = sum(p[1] for p in parts), sum(p[2] for p in parts)
        mean = total / n
        return {"rows": n, "mean": mean, "std": max(squares / n - mean * mean, 0.0) ** 0.5,
                "min": min(p[3] for p in parts), "max": max(p[4] for p in parts)}


NO_LABELS, CLASSES, VALUES = LabelKind(), ClassLabels(), ValueLabels()


@dataclass(frozen=True)
class DataKind:
    """What ``prepare --task NAME`` writes for a task: packed token streams (``packed``), or one record per row
    encoded with the encoder tokenizer's own special tokens (``encoded``); its ``labels`` (a :class:`LabelKind`);
    ``long``: what a record longer than seq_len becomes by default (``truncate`` or ``window``)."""

    rows: str = "packed"
    labels: LabelKind = NO_LABELS
    long: str = "window"


# -- tasks -------------------------------------------------------------------------------------------------------

# name → (its module in sparklm.tasks, what it trains, in a few words: `--task`'s help)
TASKS: dict[str, tuple[str, str]] = {
    "causal-lm": ("causal_lm", "next-token prediction with a decoder (built from [model], or --init-from a "
                               "pretrained one)"),
    "classify": ("classify", "text (pair) classification: --init-from any model AutoModelForSequenceClassification "
                             "loads (BERT, RoBERTa, DistilBERT, MiniLM, XLM-R, or a decoder), on data prepared with "
                             "--task classify"),
    "mlm": ("mlm", "masked-LM continued pretraining of an encoder (--init-from; 15% of tokens, 80/10/10), on data "
                   "prepared with --task mlm or classify"),
    "regress": ("regress", "text (pair) regression: a float label column, MSE loss, MAE/RMSE/R^2 (--init-from an "
                           "encoder or a decoder), on data prepared with --task regress"),
}
TASK_NAMES: tuple[str, ...] = tuple(TASKS)
DEFAULT_TASK = "causal-lm"  # what a run, a dataset or a report without a task names was made for


@dataclass(frozen=True)
class TaskInfo:
    """What the driver, the data pipeline, the report and the CLI know of a task (torch-free)."""

    name: str
    figures: Any  # the named figures its evaluation reports (a model/figures.FigureSet)
    make: Callable[[Any], Any]  # (a Config →) the task object for a run (model/task.py's Task), from the run's settings
    data: tuple[str, ...] = ("causal-lm",)  # the datasets (their manifest's "task") it trains on
    prepares: DataKind | None = None  # what `prepare --task NAME` writes; None: no dataset of its own
    pretrained: bool = False  # it trains an --init-from model only (else it can build a fresh one from [model])
    generates: bool = False  # a decoder that writes text (train.compile and matmul attention pay for it)
    auto: str = "AutoModelForCausalLM"  # the transformers Auto class its model loads with (the memory plan's shapes)
    peft: str | None = "CAUSAL_LM"  # peft's task type for its LoRA adapters
    hf_config: Callable[[Any], dict] | None = None  # overrides of the model's HF config (a classifier's labels)
    settle: Callable[[Any, dict, str], Any] | None = None  # (config, manifest, data URI): what the data fixes
    pipeline: str = "text-generation"  # the transformers pipeline that reads its model/ (trackers log it as one)
    shows: str | None = None  # the file a finished run points people to besides report.html
    report: Callable[[str, dict, Any], None] | None = None  # (run dir, kept figures, storage): driver-side pictures
    section: Callable[[Any], list[str]] | None = None  # report.html's section for the task (a RunData → HTML parts)

    @property
    def help(self) -> str:
        return TASKS[self.name][1]


_INFOS: dict[str, TaskInfo] = {}


def task(name: str) -> TaskInfo:
    """The task called ``name`` (one of :data:`TASK_NAMES`), its module imported on first use."""
    if name not in _INFOS:
        _INFOS[name] = importlib.import_module(f"sparklm.tasks.{TASKS[name][0]}").INFO
    return _INFOS[name]


def make_task(config: Any):
    """The task object a run trains (``config.model.task``), made from its settings."""
    return task(config.model.task).make(config)


def data_kind(name: str) -> DataKind:
    """What ``prepare --task name`` writes (packed token streams for a task without a dataset of its own)."""
    return task(name).prepares or DataKind()


def preparing() -> list[str]:
    """The tasks ``prepare --task`` makes datasets for."""
    return [n for n in TASK_NAMES if task(n).prepares is not None]


def generators() -> list[str]:
    """The tasks whose models write text (those ``generate`` and ``--init-from`` a decoder serve)."""
    return [n for n in TASK_NAMES if task(n).generates]


# -- strategies ------------------------------------------------------------------------------------------------

# name → (its module in sparklm.strategies, its class, the arguments it is made with)
STRATEGIES: dict[str, tuple[str, str, tuple]] = {
    "ddp": ("ddp", "DDP", ()),
    "average": ("rounds", "Rounds", ("average",)),
    "diloco": ("rounds", "Rounds", ("diloco",)),
}
STRATEGY_NAMES: tuple[str, ...] = tuple(STRATEGIES)


def strategy(name: str):
    """The strategy (strategies/base.Strategy) called ``name``, one of :data:`STRATEGY_NAMES`."""
    module, cls, args = STRATEGIES[name]
    return getattr(importlib.import_module(f"sparklm.strategies.{module}"), cls)(*args)

