"""Experiment trackers: metrics sinks (metrics/sinks.py's seam) that also open and close a run elsewhere.

Each tracker is one module here, registered in ``TRACKERS`` by the config switch that turns it on:
TensorBoard (event files under the run directory), MLflow (a tracking server or store) and Weights & Biases
(online, or offline and synced later). Only the driver opens them: DDP ranks send rows to the driver over
the channel, round workers return theirs, so a command makes one tracker run whatever the number of workers.

A tracker receives rows as every sink does; the rows since the last ``flush`` wait in a :class:`Pending`
buffer. ``flush`` comes before each checkpoint and at the end of a run, and ``rewind`` goes back to a
checkpoint, so rows sent to a tracker are never rows a restart or ``--resume`` runs again: the tracker keeps
one clean history, although neither MLflow nor W&B can delete a logged value. The price: a tracker shows a
run's progress up to its last checkpoint (``--checkpoint-every``). At the end, ``finish`` logs the run's
summary and files (and the model, where the tracker stores models) and closes the tracker's run.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

from ...config import Config, StorageConfig, TrackingConfig
from ...infra import progress
from ...infra.errors import SparklmError
from ..rows import Row
from ..sinks import Sink

# the run directory's files a tracker keeps beside its run (those that exist)
RUN_FILES = ("config.json", "summary.json", "metrics.csv", "rounds.csv", "run_info.json", "loss.png", "samples.txt",
             "report.html", "manifest.json", "eval_tasks.json", "eval_tasks.csv")
SEARCH_FILES = ("best.json", "report.html")  # what a search (sparklm tune) leaves besides its trials' runs
EVAL_FILES = ("results.json", "report.html")  # what `sparklm eval --tasks --output DIR` writes


@dataclass(frozen=True)
class Context:
    """What a tracker knows of the command it tracks."""

    command: str  # "train", "prepare", "tune" or "eval"
    run_dir: str  # the run directory or the prepared dataset's directory
    storage: StorageConfig
    params: dict[str, Any]  # the resolved settings, flattened ("train.lr": 0.001)
    resume: bool = False
    # the search this run is a trial of, per tracker (:func:`parents`): MLflow nests the run under it, W&B groups
    parent: dict[str, str] = field(default_factory=dict)

    @property
    def name(self) -> str:
        """The tracker run's display name: the directory's last part."""
        return self.run_dir.rstrip("/").rsplit("/", 1)[-1] or self.run_dir

    @property
    def task(self):
        """What the run trained (sparklm/tasks: its pipeline, the picture it leaves)."""
        from ...registry import DEFAULT_TASK, task

        return task(self.params.get("model.task", DEFAULT_TASK))

    def files(self) -> tuple[str, ...]:
        """The files of the run (or dataset) a tracker logs: :data:`RUN_FILES` and the task's own picture."""
        if self.command == "tune":
            return SEARCH_FILES
        if self.command == "eval":
            return EVAL_FILES
        shown = self.task.shows if self.command == "train" else None
        return RUN_FILES + ((shown,) if shown and shown not in RUN_FILES else ())


@dataclass
class Outcome:
    """How the command ended, for :meth:`Tracker.finish`."""

    ok: bool
    summary: dict = field(default_factory=dict)  # summary.json (train) or the manifest's figures (prepare)
    model_dir: str | None = None  # the trained model to log (an HF directory or a LoRA adapter directory)


class Tracker(Sink, Protocol):
    def finish(self, outcome: Outcome) -> None:
        """Log the outcome (figures, files, model) and end the tracker's run. Never raises: the command's own
        results are on disk whatever happens to a tracker."""
        ...


@dataclass(frozen=True)
class Registered:
    enabled: Callable[[TrackingConfig], bool]
    module: str  # sparklm.metrics.trackers.<module>, imported only when the tracker is on
    package: str  # what the tracker needs installed, and the extra that installs it
    extra: str


TRACKERS: dict[str, Registered] = {
    "tensorboard": Registered(lambda t: t.tensorboard, "tensorboard_tracker", "tensorboard", "tensorboard"),
    "mlflow": Registered(lambda t: bool(t.mlflow_uri), "mlflow_tracker", "mlflow", "mlflow"),
    "wandb": Registered(lambda t: bool(t.wandb_project), "wandb_tracker", "wandb", "wandb"),
}


def enabled(config: Config, command: str = "train") -> list[str]:
    """The trackers ``config`` turns on (for ``prepare``: those that track more than training curves)."""
    names = [n for n, r in TRACKERS.items() if r.enabled(config.tracking)]
    return [n for n in names if command == "train" or n != "tensorboard"]


def check(config: Config, command: str = "train") -> None:
    """Before anything is written: each tracker that is on has its package and sound settings (one line if not)."""
    for name in enabled(config, command):
        reg = TRACKERS[name]
        if importlib.util.find_spec(reg.package) is None:
            raise SparklmError(f"tracking to {name} needs the {reg.package} package",
                               hint=f"pip install 'sparklm[{reg.extra}]'")
        module = importlib.import_module(f"{__name__}.{reg.module}")
        if hasattr(module, "check"):
            module.check(config.tracking)


def open_trackers(config: Config, ctx: Context) -> list[Tracker]:
    """The trackers ``config`` turns on, each with its run opened; one that cannot open is closed again with the
    others before the error goes up."""
    out: list[Tracker] = []
    try:
        for name in enabled(config, ctx.command):
            module = importlib.import_module(f"{__name__}.{TRACKERS[name].module}")
            out.append(module.open_tracker(config.tracking, ctx))
    except BaseException:
        finish_all(out, Outcome(ok=False))
        raise
    return out


def parents(trackers: list[Tracker]) -> dict[str, str]:
    """What a search's trackers give its trials' runs (``Context.parent``): their run or group to go under."""
    out: dict[str, str] = {}
    for t in trackers:
        ref = getattr(t, "parent_ref", None)
        if ref is not None:
            out.update(ref())
    return out


def finish_all(trackers: list[Tracker], outcome: Outcome) -> None:
    for t in trackers:
        t.finish(outcome)


@contextmanager
def failed_on_error(trackers: list[Tracker]) -> Iterator[None]:
    """The block's exception, if any, ends every tracker's run as failed before it goes on up."""
    try:
        yield
    except BaseException:
        finish_all(trackers, Outcome(ok=False))
        raise


def numbers(row: Row) -> dict[str, float]:
    """A row's numeric figures under ``kind/name`` (``train/loss``, ``eval/val_bpb``, ``round/broadcast_bytes``), as
    every tracker names them; the step is the x-axis, not a figure."""
    return {f"{row.kind}/{name}": float(value) for name, value in row.to_dict().items()
            if name not in ("kind", "step") and isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value)}  # a figure a row could not measure (NaN) is left out, not logged as NaN


def summary_figures(summary: dict) -> dict[str, float]:
    """A run's closing figures for a tracker's summary: the final and best evaluation (``final/val_loss``...) and
    the run's numeric totals (tokens, tokens_per_s, mfu, peak_rss_mb...)."""
    out: dict[str, float] = {}
    for key, value in summary.items():
        if isinstance(value, dict):
            out.update({f"{key}/{k}": float(v) for k, v in value.items()
                        if isinstance(v, (int, float)) and not isinstance(v, bool)})
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out[key] = float(value)
    return out


def manifest_figures(manifest: dict) -> dict:
    """A prepared dataset's figures for a tracker, from its manifest: the input, each split (documents, tokens,
    sequences, duplicates and tokens dropped, bytes per token), the packing and the timing."""
    out: dict[str, dict[str, float]] = {}

    def walk(node: dict, prefix: str) -> None:
        for key, value in node.items():
            if isinstance(value, dict):
                walk(value, f"{prefix}{key}_")
            elif isinstance(value, (int, float)) and not isinstance(value, bool):
                out.setdefault(section, {})[f"{prefix}{key}"] = float(value)

    for section in ("input", "splits", "packing", "timing"):
        walk(manifest.get(section) or {}, "")
    return out


class Buffered:
    """What the MLflow and W&B trackers share: rows wait in :class:`Pending` until a flush; a failed call warns
    once and the run goes on without the tracker (metrics.csv keeps every row); ``finish`` sends what waits when
    the run ended well, then the summary, the run's files and the model, and ends the tracker's run. A tracker
    says how: ``_send``, ``_log_summary``, ``_log_files``, ``_log_model``, ``_end``."""

    label = ""  # the tracker's name in messages
    tc: TrackingConfig

    def __init__(self) -> None:
        self.pending = Pending()
        self.failed = False

    def write(self, row: Row) -> None:
        self.pending.add(row)

    def rewind(self, step: int, evaluated: bool = True) -> None:
        self.pending.rewind(step, evaluated)

    def flush(self) -> None:
        self._call("log metrics", lambda rows=self.pending.take(): self._send(rows))

    def close(self) -> None:
        pass  # unflushed rows wait for finish(): sent if the run ended well, else a resume sends them again

    def _call(self, what: str, fn: Callable[[], object]) -> None:
        if self.failed:
            return
        try:
            fn()
        except Exception as e:  # the run's own results are on disk: tracking must not end it
            self.failed = True
            progress.warn(f"{self.label}: could not {what} ({short(e)}); the run goes on without {self.label}")

    def finish(self, outcome: Outcome) -> None:
        rows = self.pending.take()
        if outcome.ok:
            self._call("log metrics", lambda: self._send(rows))
            self._call("log the summary", lambda: self._log_summary(outcome.summary))
            self._call("log the run's files", self._log_files)
            if self.tc.log_model and outcome.model_dir:
                self._call("log the model", lambda: self._log_model(outcome.model_dir))
        try:
            self._end(outcome.ok)
        except Exception as e:
            progress.warn(f"{self.label}: could not end its run ({short(e)})")

    def _send(self, rows: list[tuple[int, Row]]) -> None: ...

    def _log_summary(self, summary: dict) -> None: ...

    def _log_files(self) -> None: ...

    def _log_model(self, model_dir: str) -> None: ...

    def _end(self, ok: bool) -> None: ...


def short(e: BaseException) -> str:
    """An exception in one line of at most 240 characters."""
    return " ".join(str(e).split())[:240] or type(e).__name__


class Pending:
    """The rows since the last flush: what a rewind drops, and what the next flush sends (in step order)."""

    def __init__(self) -> None:
        self.rows: list[tuple[int, Row]] = []

    def add(self, row: Row) -> None:
        step = getattr(row, "step", None)
        if row.kind in ("train", "eval", "round") and step is not None:
            self.rows.append((int(step), row))

    def rewind(self, step: int, evaluated: bool = True) -> None:
        self.rows = [(s, r) for s, r in self.rows if s < step or (s == step and (evaluated or r.kind != "eval"))]

    def take(self) -> list[tuple[int, Row]]:
        rows, self.rows = sorted(self.rows, key=lambda sr: sr[0]), []
        return rows

    def clear(self) -> None:
        self.rows = []
