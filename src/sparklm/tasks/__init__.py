"""Tasks: what is trained. Each task is one module of this package and one line of :data:`REGISTRY`.

A task module holds everything that depends on what is trained, torch-free at import (torch is imported where a
model is built): its :class:`TaskInfo` (``INFO``: the figures its evaluation reports, the datasets it trains on and
what ``prepare --task`` writes for it, the Auto class its model loads with, its report's section) and the task object
the training core and every strategy talk to (``INFO.make(config)``: model/task.py's ``Task`` interface). Nothing
outside a task's module names it: the data pipeline, the memory plan, the launcher, the report and the CLI ask the
registry. This package's ``__init__`` imports nothing of sparklm, so the configuration can read the names; a task's
module is imported when its info is first asked for.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# name → (its module in this package, what it trains, in a few words: `--task`'s help)
REGISTRY: dict[str, tuple[str, str]] = {
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
NAMES: tuple[str, ...] = tuple(REGISTRY)


@dataclass(frozen=True)
class DataKind:
    """What ``prepare --task NAME`` writes for a task: packed token streams (``packed``), or one record per row
    encoded with the encoder tokenizer's own special tokens (``encoded``); ``labels``: None, ``class`` (names →
    ids, a stratified split) or ``value`` (a float, a hash split); ``long``: what a record longer than seq_len
    becomes by default (``truncate`` or ``window``)."""

    rows: str = "packed"
    labels: str | None = None
    long: str = "window"


@dataclass(frozen=True)
class TaskInfo:
    """What the driver, the data pipeline, the report and the CLI know of a task (torch-free)."""

    name: str
    figures: Any  # the named figures its evaluation reports (a model/tasks.FigureSet)
    make: Callable[[Any], Any]  # (a Config →) the task object for a run (model/task.py's Task), from the run's settings
    data: tuple[str, ...] = ("causal-lm",)  # the datasets (their manifest's "task") it trains on
    prepares: DataKind | None = None  # what `prepare --task NAME` writes; None: no dataset of its own
    pretrained: bool = False  # it trains an --init-from model only
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
        return REGISTRY[self.name][1]


_INFOS: dict[str, TaskInfo] = {}


def info(name: str) -> TaskInfo:
    """The task called ``name`` (one of :data:`NAMES`), its module imported on first use."""
    if name not in _INFOS:
        _INFOS[name] = importlib.import_module(f"{__name__}.{REGISTRY[name][0]}").INFO
    return _INFOS[name]


def make(config: Any):
    """The task object a run trains (``config.model.task``), made from its settings."""
    return info(config.model.task).make(config)


def figures_for(name: str) -> Any:
    """The figures task ``name`` reports."""
    return info(name).figures


def data_kind(name: str) -> DataKind:
    """What ``prepare --task name`` writes (packed token streams for a task without a dataset of its own)."""
    return info(name).prepares or DataKind()


def preparing() -> list[str]:
    """The tasks ``prepare --task`` makes datasets for."""
    return [n for n in NAMES if info(n).prepares is not None]
