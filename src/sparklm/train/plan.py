"""The run plan: everything decided about a run, made once on the driver and read by every worker.

The launcher settles the settings before Spark starts (resolve.settle: every "auto" decided, a fresh model fitted to
its time budget by budget.py), then, once Spark says how much memory a rank has, makes the frozen
:class:`RunPlan` (:func:`make`): the settings as they run (the memory plan's micro-batch, accumulation, gradient
checkpointing, allocator and LM-head loss applied), the device, the torch threads, the step plan and the round
codec, the optimizer and every world an elastic run may take. It is written whole to the run's config.json before any
worker starts and travels in the job; a rank or a round worker reads it and decides nothing (no resolver is
reachable from here). Torch-free.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, replace

from ..config import Config, TrainConfig, flatten, from_dict
from ..infra.errors import SparklmError
from . import device, memory
from .schedule import Steps, steps


@dataclass(frozen=True)
class OptimizerPlan:
    """The optimizer a worker builds (train/optim.build), all of it: which one, its peak learning rate and the
    schedule that scales it step by step (:meth:`lr_at`), betas and weight decay."""

    name: str = "adamw"
    lr: float = 3e-4
    betas: tuple[float, float] = (0.9, 0.95)
    weight_decay: float = 0.1
    warmup_steps: int = 0
    min_lr_ratio: float = 0.1

    @classmethod
    def of(cls, tc: TrainConfig) -> OptimizerPlan:
        return cls(name=tc.optimizer, lr=tc.lr, betas=(tc.beta1, tc.beta2), weight_decay=tc.weight_decay,
                   warmup_steps=tc.warmup_steps, min_lr_ratio=tc.min_lr_ratio)

    def lr_at(self, step: int, frac: float) -> float:
        """Linear warmup over ``warmup_steps``, then cosine from ``lr`` to ``lr·min_lr_ratio`` over the run (``frac``:
        how much of it is done)."""
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        floor = self.lr * self.min_lr_ratio
        return floor + 0.5 * (self.lr - floor) * (1 + math.cos(math.pi * min(frac, 1.0)))


@dataclass(frozen=True)
class World:
    """Each worker's share of a step on a world of a given size: micro-batch rows, micro-batches accumulated, and
    the micro-batches an evaluation scores (the same validation rows on any world)."""

    batch_size: int
    grad_accum: int
    eval_batches: int


@dataclass(frozen=True)
class RunPlan:
    config: Config  # every setting as it runs: autos decided, the model fitted, the memory plan applied
    threads: int  # torch threads per worker
    device: device.Device  # where a worker computes, its autocast dtype and collective backend
    steps: Steps  # rows and tokens per optimizer step, and the run's steps (None: the time budget ends it)
    memory: memory.MemoryPlan | None = None  # None: nothing planned (a worker driven directly)
    # average/DiLoCo: what a round's deltas (and the driver's steps) travel as (strategies/codec.Codec's fields)
    codec: dict | None = None
    optimizer: OptimizerPlan = OptimizerPlan()
    # every number of workers an elastic run may take (train.workers_min to train.workers) that splits the global
    # batch evenly, planned here on the driver; a run of fixed size has its own world only. A resize reads at().
    worlds: dict[int, World] = field(default_factory=dict)

    @property
    def workers(self) -> int:
        return self.config.train.workers

    def at(self, world: int) -> RunPlan:
        """This plan on ``world`` workers, as planned (:data:`worlds`): the same global batch, each worker's share
        of it; the step plan and the data order unchanged (a step reads the same global rows whatever the world)."""
        if world == self.workers:
            return self
        w = self.worlds.get(world)
        if w is None:
            raise SparklmError(f"the run plan has no world of {world} workers (it planned {sorted(self.worlds)})",
                               hint="a world splits the global batch evenly: choose train.workers_min and "
                                    "train.workers around a divisor of batch_size x grad_accum x workers")
        train = replace(self.config.train, workers=world, batch_size=w.batch_size, grad_accum=w.grad_accum,
                        eval_batches=w.eval_batches)
        return replace(self, config=self.config.replace(train=train))

    def to_dict(self) -> dict:
        return {"config": self.config.to_dict(), "threads": self.threads, "device": asdict(self.device),
                "steps": asdict(self.steps), "memory": asdict(self.memory) if self.memory else None,
                "codec": self.codec, "optimizer": asdict(self.optimizer),
                "worlds": {str(n): asdict(w) for n, w in sorted(self.worlds.items())}}

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    def record(self, settled: Config) -> dict:
        """What config.json keeps of the plan beside the settled settings it holds (which ``--resume`` starts from):
        all of it, the settings as ``runs``: those the plan changed (the memory plan's)."""
        raw = self.to_dict()
        del raw["config"]
        was, now = flatten(settled.to_dict()), flatten(self.config.to_dict())
        return {**raw, "runs": {k: v for k, v in now.items() if was.get(k) != v}}

    def check_resumable(self, saved: dict | None, where: str) -> None:
        """A resumed run's plan must step as the saved one did (``saved``: :meth:`record`'s; None: a run from
        before plans were recorded): the checkpoint's position counts its global batches."""
        if not saved:
            return
        for what, was, now in (("rows per step (the global batch)", saved["steps"]["rows_per_step"],
                                self.steps.rows_per_step),
                               ("compute dtype", saved["device"]["dtype_name"], self.device.dtype_name)):
            if was != now:
                raise SparklmError(f"cannot resume {where}: its plan had {what} {was}, this one {now}",
                                   hint="resume with the settings the run started with, or start a new run with "
                                        "another --output")

    @classmethod
    def from_dict(cls, raw: dict) -> RunPlan:
        mem, opt = raw.get("memory"), raw.get("optimizer")
        config = from_dict(raw["config"])
        return cls(config=config, threads=raw["threads"], device=device.Device(**raw["device"]),
                   steps=Steps(**raw["steps"]), memory=memory.MemoryPlan(**mem) if mem else None,
                   codec=raw.get("codec"),
                   optimizer=OptimizerPlan(**{**opt, "betas": tuple(opt["betas"])}) if opt else
                   OptimizerPlan.of(config.train),
                   worlds={int(n): World(**w) for n, w in (raw.get("worlds") or {}).items()})


def world_share(tc: TrainConfig, rows: int, world: int) -> World | None:
    """Each worker's share of a step of ``rows`` rows on ``world`` workers (pure), so that the optimizer sees the
    same global batch: the share split into the largest micro-batch, no larger than ``tc``'s, that divides it, and
    the rest accumulated. None where the rows do not split into ``world`` equal shares."""
    if world < 1 or rows % world:
        return None
    share = rows // world
    micro = max(b for b in range(1, min(tc.batch_size, share) + 1) if share % b == 0)
    accum = share // micro
    # an evaluation scores the same validation rows on any world (eval_batches counts a worker's micro-batches;
    # the workers' parts of the split interleave, so the same total is the same rows)
    evals = -(-tc.eval_batches * accum // tc.grad_accum) if tc.eval_batches else 0
    return World(micro, accum, evals)


def worlds(tc: TrainConfig, rows: int) -> dict[int, World]:
    """Every world an elastic run may take (``train.workers_min`` to ``train.workers``) with its share of a step's
    ``rows``; a run of fixed size, its own."""
    low = tc.workers_min or tc.workers
    found = {n: world_share(tc, rows, n) for n in range(max(1, min(low, tc.workers)), tc.workers + 1)}
    return {n: w for n, w in found.items() if w is not None}


def elastic_world(plan: RunPlan, slots: int) -> int | None:
    """The most workers the plan planned (:attr:`RunPlan.worlds`) that ``slots`` task slots run at once; None when
    there is none."""
    fits = [n for n in plan.worlds if n <= slots]
    return max(fits) if fits else None


def world_for(plan: RunPlan, slots: int) -> RunPlan:
    """``plan`` at :func:`elastic_world`'s number of workers for ``slots``; one line when there is none."""
    world = elastic_world(plan, slots)
    if world is None:
        tc = plan.config.train
        raise SparklmError(f"no number of workers between train.workers_min {tc.workers_min} and train.workers "
                           f"{tc.workers} that this Spark can run splits the global batch of "
                           f"{plan.steps.rows_per_step} rows evenly",
                           hint="choose a global batch (batch_size x grad_accum x workers) that the workers you "
                                "expect divide, e.g. a power of two")
    return plan.at(world)


def make(config: Config, *, train_rows: int, seq_len: int, mem: memory.MemoryPlan | None = None,
         peak: float | None = None) -> RunPlan:
    """The plan of a settled ``config`` (resolve.settle) with the memory plan ``mem`` (None: none known, the
    settings as they are); ``peak``: a CPU worker's matmul peak, measured by the driver (resolve.worker_peak)."""
    tc = config.train
    mem = mem or memory.unplanned(tc)
    runs = memory.apply(config, mem)
    rc = tc.rounds
    codec = {"name": rc.codec, "density": rc.density, "bits": rc.bits} if tc.strategy != "ddp" else None
    planned = steps(runs.train, train_rows=train_rows, seq_len=seq_len, workers=tc.workers)
    return RunPlan(config=runs, threads=tc.threads, device=device.select(tc.device, tc.dtype, peak), steps=planned,
                   memory=mem, codec=codec, optimizer=OptimizerPlan.of(runs.train),
                   worlds=worlds(runs.train, planned.rows_per_step))
