"""The strategy seam: how a run is spread over Spark tasks, behind one small interface.

A strategy gets the job (what to train, where) and a metrics sink, runs the workers on Spark and
returns the run's result. It never knows the task (what is trained) and the launcher (launch/train.py)
knows nothing of training. Messages between the driver and its workers are these frozen dataclasses.
"""

from __future__ import annotations

import json
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass
from typing import Any, Protocol

from ..config import Config
from ..metrics.recorder import RunResult
from ..metrics.sinks import Sink
from ..train.plan import RunPlan

# Names in the weights the last round task gets that are the best evaluation's weights, not the final ones.
BEST = "best/"

__all__ = ["BEST", "Job", "RankStart", "RoundSpec", "RunResult", "Strategy", "WorkerResult"]  # RunResult: recorder.py's


@dataclass(frozen=True)
class Job:
    """One training run, as every worker sees it: what runs is its ``plan``, made on the driver (plan.py), the only
    source of its settings; the rest says where."""

    plan: RunPlan
    data: str  # the prepared dataset's URI
    run_dir: str  # the run directory's URI
    resume: bool
    uid: str  # unique per launch: keys per-process caches and executor-side state
    warm: tuple[str, ...] = ()  # processes the strategy started before Spark (local mode), one per worker
    halts: bool = False  # the driver may end the run early (a search pruning it): the ranks agree at every step

    @property
    def config(self) -> Config:
        return self.plan.config

    @property
    def workers(self) -> int:
        return self.plan.workers

    @property
    def threads(self) -> int:
        """torch threads per worker, decided on the driver (resolve.threads)."""
        return self.plan.threads

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "plan": self.plan.to_dict()})

    @classmethod
    def from_json(cls, text: str) -> Job:
        raw = json.loads(text)
        return cls(**{**raw, "plan": RunPlan.from_dict(raw["plan"]), "warm": tuple(raw.get("warm", ()))})


@dataclass(frozen=True)
class RankStart:
    """What a DDP rank process reads on stdin once the ranks have found each other."""

    job: str  # Job.to_json()
    rank: int
    world: int
    threads: int
    master_addr: str
    master_port: int
    channel: tuple[str, int, str]  # the driver's metrics channel: host, port, token
    gpu: str | None = None  # the GPU address Spark assigned this rank's task (None: none assigned)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> RankStart:
        raw = json.loads(text)
        return cls(**{**raw, "channel": tuple(raw["channel"])})


@dataclass(frozen=True)
class RoundSpec:
    """What every worker does in one round of average/DiLoCo."""

    round: int
    step0: int  # the global step the round starts at
    steps: int  # inner steps (0: only evaluate / finish)
    total_steps: int | None  # None: the time budget ends the run
    eval: bool  # evaluate the incoming global weights first
    persist: str  # where to copy the inner optimizer state (a checkpoint round), or ""
    finish: bool  # the last task: worker 0 exports model/ and samples; the workers drop their state
    time_frac0: float | None  # the run's time fraction at the round's start, as the driver projects it
    time_frac_per_step: float
    shards: tuple[tuple[int, int], ...]  # worker w streams slice shards[w][0] of shards[w][1] of each global batch
    inner_from: str = ""  # a checkpoint to take inner optimizer states from (the first round after --resume)
    base_step: int | None = None  # the round's update applies to the weights of this step (None: no update sent)
    initial_digest: str = ""  # round 0 of a lossy codec: the digest of the seeded weights every worker builds itself
    cold: tuple[int, ...] = ()  # workers left out of the last round: their state holds steps that were dropped
    world: int | None = None  # an elastic round's number of workers: each runs the plan at it (RunPlan.at, its
    # share of the global batch and of the validation rows); None: the plan's

    def fraction(self, i: int) -> float:
        """The run's progress at the round's i-th step (schedule.fraction), its time as the driver projects it: the
        time fractions are seconds of a budget of 1."""
        from ..train.schedule import fraction

        if self.time_frac0 is None:
            return fraction(self.step0 + i, self.total_steps, 0.0, 0.0)
        return fraction(self.step0 + i, self.total_steps, self.time_frac0 + i * self.time_frac_per_step, 1.0)


@dataclass(frozen=True)
class WorkerResult:
    """One worker's figures for one round (its delta travels beside it, summed by the tree aggregation)."""

    worker: int
    attempt: int
    tokens: int = 0  # tokens trained on, padding excluded
    weight: float = 0.0  # tokens / the tokens of a full, unpadded round: the worker's weight in the average
    losses: tuple[float, ...] = ()
    correct: float = 0.0  # next-token predictions right over the round's steps, and those counted: the accuracy
    counted: float = 0.0
    cold: bool = False  # started from a fresh optimizer state
    lr: float = 0.0
    grad_norm: float = 0.0
    load_s: float = 0.0
    compute_s: float = 0.0
    task_s: float = 0.0
    rss_mb: float = 0.0
    peak_rss_mb: float = 0.0
    delta_bytes: int = 0  # what the worker sent back (its encoded delta)
    eval_sums: tuple[float, ...] | None = None
    facts: dict[str, Any] | None = None  # worker 0, first round: params, FLOPs/token, peak, dtype
    error: str | None = None  # set when the worker's last attempt failed
    stale: bool = False  # it held neither the weights the round's update applies to nor its own last payload, and
    # was given no whole weights: it did nothing, and the driver runs it again with them

    @property
    def mean_loss(self) -> float:
        return sum(self.losses) / len(self.losses) if self.losses else float("nan")


@dataclass(frozen=True)
class Partial:
    """What a round's tasks return, combined pairwise by the tree aggregation (rounds.merge): the sum of the
    workers' token-weighted deltas (name → array; None when no worker returned one), the results of the workers
    that finished and those of the workers whose last attempt failed."""

    sum: dict | None = None
    packed: tuple[bytes, ...] = ()  # deltas a lossy codec encoded: decoded where they are summed (the driver)
    results: tuple[WorkerResult, ...] = ()
    errors: tuple[WorkerResult, ...] = ()


class Strategy(Protocol):
    name: str

    def describe(self, config: Config) -> str:
        """A few words for the progress line, e.g. ``ddp, 2 workers``."""
        ...

    def prestart(self, config: Config, master: str) -> AbstractContextManager[tuple[str, ...]]:
        """Worker processes started before Spark starts (where ``master`` allows: local mode), so that their
        imports overlap Spark's start; yields what ``Job.warm`` carries to them, and stops the unused ones."""
        ...

    def check(self, spark, plan: RunPlan) -> None:
        """One line, before anything of the run is written, if ``spark`` cannot run ``plan`` (DDP: task slots and
        GPUs for every rank at once)."""
        ...

    def run(self, spark, job: Job, sink: Sink) -> RunResult: ...
