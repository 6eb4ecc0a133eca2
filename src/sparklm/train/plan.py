"""The run plan: everything decided about a run, made once on the driver and read by every worker.

The launcher settles the settings before Spark starts (:func:`settle`: every "auto" decided by resolve.py, a fresh
model fitted to its time budget by budget.py), then, once Spark says how much memory a rank has, makes the frozen
:class:`RunPlan` (:func:`make`): the settings as they run (the memory plan's micro-batch, accumulation, gradient
checkpointing, allocator and LM-head loss applied), the device, the torch threads, the step plan and the round
codec. It is written whole to the run's config.json before any worker starts and travels in the job; a rank or a
round worker reads it and decides nothing. Torch-free.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace

from ..config import Config, flatten, from_dict
from ..infra.errors import SparklmError
from . import budget, device, memory, resolve
from .schedule import Steps, steps


@dataclass(frozen=True)
class RunPlan:
    config: Config  # every setting as it runs: autos decided, the model fitted, the memory plan applied
    threads: int  # torch threads per worker
    device: device.Device  # where a worker computes, its autocast dtype and collective backend
    steps: Steps  # rows and tokens per optimizer step, and the run's steps (None: the time budget ends it)
    memory: memory.MemoryPlan | None = None  # None: nothing planned (a worker driven directly)
    # average/DiLoCo: what a round's deltas (and the driver's steps) travel as (strategies/codec.Codec's fields)
    codec: dict | None = None

    @property
    def workers(self) -> int:
        return self.config.train.workers

    def to_dict(self) -> dict:
        return {"config": self.config.to_dict(), "threads": self.threads, "device": asdict(self.device),
                "steps": asdict(self.steps), "memory": asdict(self.memory) if self.memory else None,
                "codec": self.codec}

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
        mem = raw.get("memory")
        return cls(config=from_dict(raw["config"]), threads=raw["threads"], device=device.Device(**raw["device"]),
                   steps=Steps(**raw["steps"]), memory=memory.MemoryPlan(**mem) if mem else None,
                   codec=raw.get("codec"))


def resized(plan: RunPlan, world: int) -> RunPlan | None:
    """``plan`` on ``world`` workers with the same global batch, so that the optimizer sees the same batch: each
    worker's share of a step's rows split into the largest micro-batch, no larger than the plan's, that divides it,
    and the rest accumulated. None where the rows of a step do not split into ``world`` equal shares. The step plan
    (rows, tokens and steps of the run) is unchanged, and so is the data order: a step reads the same global rows
    whatever the world (data/stream.TokenStream)."""
    tc = plan.config.train
    rows = plan.steps.rows_per_step
    if world < 1 or rows % world:
        return None
    share = rows // world
    micro = max(b for b in range(1, min(tc.batch_size, share) + 1) if share % b == 0)
    accum = share // micro
    # an evaluation scores the same validation rows on any world (eval_batches counts a worker's micro-batches;
    # the workers' parts of the split interleave, so the same total is the same rows)
    evals = -(-tc.eval_batches * accum // tc.grad_accum) if tc.eval_batches else 0
    train = replace(tc, workers=world, batch_size=micro, grad_accum=accum, eval_batches=evals)
    return replace(plan, config=plan.config.replace(train=train))


def elastic_world(plan: RunPlan, slots: int) -> int | None:
    """The most workers, between ``train.workers_min`` and ``train.workers``, that ``slots`` task slots run at once
    and the global batch splits evenly among; None when there is no such number."""
    tc = plan.config.train
    for world in range(min(tc.workers, slots), (tc.workers_min or tc.workers) - 1, -1):
        if plan.steps.rows_per_step % world == 0:
            return world
    return None


def world_for(plan: RunPlan, slots: int) -> RunPlan:
    """``plan`` resized to :func:`elastic_world`'s number of workers for ``slots``; one line when there is none."""
    world = elastic_world(plan, slots)
    if world is None:
        tc = plan.config.train
        raise SparklmError(f"no number of workers between train.workers_min {tc.workers_min} and train.workers "
                           f"{tc.workers} that this Spark can run splits the global batch of "
                           f"{plan.steps.rows_per_step} rows evenly",
                           hint="choose a global batch (batch_size x grad_accum x workers) that the workers you "
                                "expect divide, e.g. a power of two")
    return resized(plan, world)


def settle(config: Config, *, threads: int, vocab: int, context: int, train_tokens: int, master: str,
           resume: bool, spark=None) -> tuple[Config, str | None]:
    """``config`` with every automatic setting decided — the device for ``master`` (and ``spark``, a running
    session), then the rest for workers of ``threads`` torch threads — and, for a new run, a fresh model fitted to
    its time budget (a resumed run builds the model its checkpoints hold); and a line saying what the fit changed
    (None: nothing). Before Spark starts."""
    config = resolve.settings(resolve.with_device(config, master, spark), threads, context)
    if resume:
        return config, None
    return budget.apply(config, vocab=vocab, context=context, train_tokens=train_tokens, master=master)


def make(config: Config, *, train_rows: int, seq_len: int, mem: memory.MemoryPlan | None = None) -> RunPlan:
    """The plan of a settled ``config`` (:func:`settle`) with the memory plan ``mem`` (None: none known, the
    settings as they are)."""
    tc = config.train
    mem = mem or memory.unplanned(tc)
    runs = memory.apply(config, mem)
    rc = tc.rounds
    codec = {"name": rc.codec, "density": rc.density, "bits": rc.bits} if tc.strategy != "ddp" else None
    return RunPlan(config=runs, threads=tc.threads, device=device.select(tc.device, tc.dtype),
                   steps=steps(runs.train, train_rows=train_rows, seq_len=seq_len, workers=tc.workers), memory=mem,
                   codec=codec)


def local(config: Config, dataset, threads: int = 1, workers: int | None = None) -> RunPlan:
    """The plan of a worker driven directly in this process (a test, a benchmark), which is then its own driver:
    settled for ``threads`` (unless ``train.threads`` says) with no memory limit and no budget fit."""
    split = dataset.manifest["splits"]["train"]
    if workers is not None:
        config = config.replace(train=replace(config.train, workers=workers))
    config = resolve.settings(config, config.train.threads or threads, dataset.seq_len)
    return make(config, train_rows=split["sequences"], seq_len=dataset.seq_len)
