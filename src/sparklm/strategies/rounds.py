"""Training in rounds on plain Spark tasks: parameter averaging (``average``) and DiLoCo (``diloco``).

A round: the driver broadcasts the global weights; N ordinary (non-barrier) tasks each run
``sync_every`` steps of the training core on their shard (round_worker.py) and return their delta; a
tree aggregation sums the deltas; the driver takes one outer step (outer.py) — torchtitan's choice:
DiLoCo wraps the same steps a DDP rank runs. Nothing needs all workers up at once: Spark schedules
the tasks as slots free up, retries a lost task (which recomputes the same delta, tasks being
deterministic), and a worker that fails its last attempt is left out of that round's average
(weighted by tokens) instead of failing the run.

The driver keeps the global weights and the outer momentum, emits metrics and round rows, and writes
a checkpoint every ``checkpoint_every`` steps (weights, outer momentum, the workers' inner optimizer
states), from which ``--resume`` continues exactly.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import shutil
import time
from contextlib import nullcontext
from dataclasses import dataclass

from ..config import Config
from ..infra.errors import SparklmError, killed_note, spark_errors
from ..infra.fs import delete, join
from ..metrics import rows
from ..metrics.recorder import Best, Recorder
from ..metrics.sinks import CsvSink, Sink, Sinks, halted
from ..train import checkpoint, loop
from ..train.schedule import Schedule
from .base import BEST, Job, Partial, RoundSpec, RunResult, WorkerResult
from .codec import Codec, apply_update, decode, digest, encode_forward, encode_update, forward_without, sparse_mean

# A testing aid: "round=R,worker=W[,attempts=K][,at=start|end|crash]" fails that task's first K attempts
# (default 1) at its start, after its work (default end), or by killing its Python worker after its work.
FAULT_ENV = "SPARKLM_INJECT_FAULT"


class Rounds:
    """``average``: plain SGD on the averaged delta with lr 1 (the new weights are the workers' average);
    ``diloco``: Nesterov momentum with ``outer_lr`` and ``outer_momentum``."""

    def __init__(self, name: str):
        self.name = name

    def check(self, spark, plan) -> None:
        """Rounds need no slots at once: a worker's task waits for a free one like any Spark task."""

    def describe(self, config: Config) -> str:
        """(``config``: as the driver settled it, its codec chosen)"""
        n = config.train.workers
        rc = config.train.rounds
        return (f"{self.name}, {n} worker{'s' * (n > 1)}, sync every {rc.sync_every} steps"
                + (f", {rc.codec} both ways" if rc.codec != "fp32" and rc.downlink == "codec" else
                   f", {rc.codec} deltas" if rc.codec != "fp32" else ""))

    def prestart(self, config: Config, master: str):
        return nullcontext(())  # a round's worker trains inside its Spark task: no process of its own

    def run(self, spark, job: Job, sink: Sink, shards: list[tuple[int, int]] | None = None) -> RunResult:
        """Train ``job`` in rounds; ``shards`` (tests) overrides which slice of the data each worker streams."""
        try:
            unit = RoundsUnit(spark, job, sink, self.name, shards)
            return loop.run(unit, unit.rec, unit.schedule, keep_best=unit.tc.keep_best,
                            info={"sync_every": unit.tc.rounds.sync_every})
        finally:  # the workers' inner states in the temporary directory (shared with the driver in local mode)
            from .round_worker import inner_dir, shared_inner_dir

            shutil.rmtree(inner_dir(job.uid), ignore_errors=True)

            shared = shared_inner_dir(job.run_dir)
            if shared:
                delete(shared, job.config.storage)


class RoundsUnit:
    """The driver's side of a rounds run as the run loop's unit: one round of ``sync_every`` steps on every worker
    and the outer step. It holds the global weights, the outer momentum and the round's own records (rounds.csv).

    An evaluation rides along with the next round's job (``deferred_eval``): its workers score the weights they
    receive before training on them, so an evaluation costs no Spark job of its own."""

    deferred_eval = True
    log_every = 1  # a train row per round

    def __init__(self, spark, job: Job, sink: Sink, name: str, shards: list[tuple[int, int]] | None):
        from ..data.manifest import load_prepared, load_tokenizer
        from ..registry import make_task

        self.spark, self.job, self.name, self.sink = spark, job, name, sink
        plan = job.plan
        config = plan.config
        self.tc, self.storage = config.train, config.storage
        rc = self.tc.rounds
        self.size = rc.sync_every
        self.dataset = load_prepared(job.data, self.storage)
        self.lr, self.mu = (1.0, 0.0) if name == "average" else (rc.outer_lr, rc.outer_momentum)
        self.steps = plan.steps
        self.schedule = Schedule(self.steps.total_steps, self.tc.eval_every, self.tc.checkpoint_every,
                                 self.tc.time_budget)
        self.note_at = self.schedule.unit(0, self.size)  # the first round's end: its pace projects a time budget
        # The initial weights: the same seeded model every strategy starts from; only the trainable ones travel.
        self.task = task = make_task(config)
        model = task.build(config, load_tokenizer(self.dataset, self.storage), self.dataset.seq_len)
        self.params = {n: p.detach().clone() for n, p in task.trainable(model).items()}
        del model
        self.momentum = None
        self.step, self.tokens_seen, self.rnd = 0, 0, 0
        self.started = time.time()
        self.ckpt_dir = join(job.run_dir, "checkpoints")
        self.inner_from, self.resumed_at, self.persist = "", 0, ""
        self.rounds_csv = CsvSink(join(job.run_dir, "rounds.csv"), rows.ROUND_COLUMNS, {"round"}, self.storage)
        self.rec = Recorder(Sinks([sink, self.rounds_csv]), self.tc, strategy=name, workers=job.workers,
                            epoch_tokens=self.dataset.manifest["splits"]["train"]["tokens"], figures=task.figure_set)
        self.fault = parse_fault(os.environ.get(FAULT_ENV, ""))
        self.max_failures = _max_failures(spark)
        self.shards = tuple(tuple(s) for s in (shards or [(w, job.workers) for w in range(job.workers)]))
        # elastic (train.workers_min): each round runs on the workers Spark has slots for, sharing the same global
        # batch (RunPlan.at); fixed shards (a test's) are never resized
        self.elastic = bool(self.tc.workers_min) and self.tc.workers_min < job.workers and not shards
        self.present = job.workers  # the workers of the round in flight
        self.comm = {"broadcast": 0, "returned": 0}
        self.codec = Codec(**plan.codec)
        # With a lossy codec: ``params`` are the weights the workers hold (what they train from, evaluate and export),
        # ``exact`` the outer optimizer's own weights when the driver's step travels encoded (params + what the codec
        # has not delivered yet), ``update`` the encoded step from the weights of step ``update[0]`` to ``params``,
        # and ``sent_step`` the step whose weights the workers received last.
        self.exact: dict | None = None
        self.update: tuple[int, bytes] | None = None
        self.sent_step: int | None = None
        self.per_step_s: float | None = None
        self.dropped_last: list[int] = []  # workers left out of the last round: their optimizer state restarts
        self.worker_facts: dict | None = None
        self.final: Partial | None = None  # the final evaluation's job, when it exported model/ too
        self.final_peaks: list[float | None] = [None] * job.workers

    def restore(self) -> loop.Restored | None:
        """With --resume: the newest readable checkpoint's weights, momentum, counters and best evaluation."""
        found = None
        if self.job.resume:  # the workers' inner states too are verified here, once
            found = checkpoint.restore_run(self.ckpt_dir, world=None if self.elastic else self.job.workers,
                                           names=("model", "outer", "best", "exact"),
                                           storage=self.storage, warn=self.rec.warn, verify="inner/")
        if found is None:
            return None
        last, run, files = found
        saved, saved_outer = files["model"], files["outer"]
        params = self.params
        if set(params) - set(saved) or any(saved[n].shape != params[n].shape for n in params):
            raise SparklmError(f"checkpoint {last} does not fit the model", hint="resume with the same model config")
        self.params = {n: saved[n].float() for n in params}
        self.momentum = {n: saved_outer[n] for n in params} if saved_outer else None
        self.exact = {n: files["exact"][n].float() for n in params} if files["exact"] else None
        self.step, self.tokens_seen, self.rnd = run.step, run.tokens_seen, run.extra["round"]
        self.started = time.time() - run.elapsed
        self.inner_from, self.resumed_at = last, self.step
        best = {n: files["best"][n].float() for n in params} if files["best"] else {}
        # the schedule asked for an evaluation of these weights, which the next round was to make: it still must
        position = loop.Position(run.step, run.tokens_seen, run.elapsed, bool(run.extra.get("pending_eval", False)))
        return loop.Restored(position, run.best, best)

    def facts(self) -> dict | None:
        return self.worker_facts  # worker 0's, from the first round

    def agree(self, done: float) -> float:
        return done  # one driver decides

    def snapshot(self) -> dict:
        return self.params  # outer steps make new tensors, never change these

    def peaks(self) -> list[float | None]:
        return self.final_peaks

    def where(self) -> str:
        return f"round {self.rnd}"

    def launch(self, steps: int, *, do_eval: bool, persist: str, finish: bool, also: dict | None = None
               ) -> tuple[Partial, float, float, int]:
        """One round's Spark job: (its aggregated partial, broadcast seconds, round seconds, bytes sent to the
        workers).

        The bytes are what Spark ships: a task carries its own data, and an executor fetches every broadcast its
        task's closure names, read or not. So the whole weights are named only where they must travel (a lossless
        codec, or a worker that holds neither the seeded weights nor the last round's); other workers get the update
        to the copy they hold (a broadcast), or, with a forward downlink, the other workers' payloads in their task's
        own data."""
        from safetensors.torch import save as save_bytes

        tc = self.tc
        elapsed = time.time() - self.started
        shards, world = self.sized()
        spec = RoundSpec(round=self.rnd, step0=self.step, steps=steps, total_steps=self.schedule.total_steps,
                         eval=do_eval, persist=persist, finish=finish,
                         time_frac0=elapsed / tc.time_budget if tc.time_budget else None,
                         time_frac_per_step=(self.per_step_s or 0.0) / tc.time_budget if tc.time_budget else 0.0,
                         shards=shards, inner_from=self.inner_from if self.step == self.resumed_at else "",
                         cold=tuple(self.dropped_last), world=world)
        t0 = time.time()
        weights = {**self.params, **(also or {})}
        # the whole weights, serialised only for a job that sends them (most rounds of a lossy codec send none)
        whole = functools.cache(lambda: save_bytes({n: t.contiguous() for n, t in weights.items()}))
        sc = self.spark.sparkContext
        workers = list(range(len(shards)))
        down: dict[int, bytes] | None = None
        bu = None
        if not self.codec.lossless and not also:
            if self.sent_step is None and self.step == 0:
                # round 0: every worker builds the same seeded model the driver did (as DDP's ranks do); the
                # weights go only to a worker whose own differ from this digest
                spec = dataclasses.replace(spec, initial_digest=digest(self.params))
            elif self.update is not None and self.update[0] == self.sent_step:
                if tc.rounds.downlink == "forward":  # an all-gather: each worker gets the others' payloads
                    down = {w: forward_without(self.update[1], w) for w in workers}
                    spec = dataclasses.replace(spec, base_step=self.sent_step)
                elif len(self.update[1]) < sum(t.numel() * t.element_size() for t in weights.values()):
                    bu, spec = sc.broadcast(self.update[1]), dataclasses.replace(spec, base_step=self.sent_step)
            self.sent_step = self.step
        broadcast_s = time.time() - t0
        run = functools.partial(_round_job, self.spark, self.job, fault=self.fault, max_failures=self.max_failures)
        try:
            if spec.initial_digest or spec.base_step is not None:
                partial = run(None, bu, spec, workers, down)
                sent = sum(map(len, down.values())) if down else len(self.update[1]) * len(workers) if bu else 0
                stale = sorted(r.worker for r in partial.results if r.stale)
                if stale:  # a new process holds no weights: these workers run again, given the whole weights
                    bc = sc.broadcast(whole())
                    try:  # (an injected fault was spent on the first job)
                        again = run(bc, None, dataclasses.replace(spec, initial_digest="", base_step=None), stale,
                                    None, fault=None)
                    finally:
                        bc.destroy()
                    kept = dataclasses.replace(partial, results=tuple(r for r in partial.results if not r.stale))
                    partial, sent = merge(kept, again), sent + len(whole()) * len(stale)
            else:
                bc = sc.broadcast(whole())
                try:
                    partial, sent = run(bc, None, spec, workers, None), len(whole()) * len(workers)
                finally:
                    bc.destroy()
        finally:
            if bu is not None:
                bu.destroy()
        return partial, broadcast_s, time.time() - t0, sent

    def sized(self) -> tuple[tuple[tuple[int, int], ...], int | None]:
        """The round's (shards, world): an elastic run counts Spark's slots now and runs the round on the most
        workers it has slots for (at least ``workers_min``: more tasks than slots queue), each streaming its slice of
        the same global batches as the plan at that world says; a run of fixed size, its shards and None."""
        if not self.elastic:
            self.present = len(self.shards)
            return self.shards, None
        from ..train.plan import world_for
        from .ddp import available

        full = self.job.plan
        train = world_for(full, max(available(self.spark, full.device), self.tc.workers_min)).config.train
        if train.workers != self.present:
            self.rec.note(f"round {self.rnd + 1}: {train.workers} workers (Spark has slots for them now; was "
                          f"{self.present})")
        self.present = train.workers
        return tuple((w, train.workers) for w in range(train.workers)), train.workers

    def evaluation(self, partial: Partial) -> loop.Evaluation:
        """The evaluation the round's workers made of the weights they received (those of ``self.step``). Each worker
        scores its part of the validation split: when a worker failed, the figures cover only the others' parts,
        so they are recorded with a warning and do not choose the best model or stop the run early."""
        evaluated = sorted(r.worker for r in partial.results if r.eval_sums)
        whole = len(evaluated) == self.present
        warning = None
        if not whole and evaluated:
            warning = (f"the evaluation at step {self.step} covers the validation rows of {len(evaluated)} of "
                       f"{self.present} workers (a worker failed): recorded, not used to choose the best "
                       "model or to stop early")
        sums = [sum(v) for v in zip(*(r.eval_sums for r in partial.results if r.eval_sums))]
        return loop.Evaluation(self.task.figures(sums) if sums else {}, counts=whole, weights=self.params,
                               warning=warning)

    def worker_peaks(self, results: tuple[WorkerResult, ...]) -> list[float | None]:
        got = {r.worker: r.peak_rss_mb for r in results}
        return [got.get(w) for w in range(self.job.workers)]

    def advance(self, steps: int, *, done: float, evaluate: bool, checkpoint: bool) -> loop.Advance:
        """One round: the workers' steps (after scoring the weights they receive, when ``evaluate``), the outer
        step, and the round's figures."""
        import torch

        from . import outer

        begin = self.step
        end = begin + steps
        self.persist = join(self.ckpt_dir, f".inner-step-{end:07d}") if checkpoint else ""
        partial, broadcast_s, round_s, sent = self.launch(steps, do_eval=evaluate, persist=self.persist,
                                                          finish=False)
        t_agg = time.time()
        done_ = partial.results
        if self.worker_facts is None:
            self.worker_facts = next((r.facts for r in done_ if r.facts), None)
        evaluation = self.evaluation(partial) if evaluate else None
        warnings = self._dropped(partial, done_)
        rc = self.tc.rounds
        before = self.exact if self.exact is not None else self.params
        if rc.downlink == "forward":  # every side takes the same step from the workers' own payloads
            self.update = (begin, encode_forward(*by_worker(partial), workers=sorted(r.worker for r in done_),
                                                 lr=self.lr, senders=rc.average_over == "senders"))
            held = {n: t.numpy() for n, t in self.params.items()}
            new_params = {n: torch.from_numpy(a) for n, a in apply_update(held, self.update[1]).items()}
            avg = {n: (before[n] - new_params[n]) / self.lr for n in before} if self.lr else dict(before)
        else:
            avg = self.average(partial)
            new_params, self.momentum = outer.outer_step(before, avg, self.momentum, lr=self.lr, mu=self.mu)
        update_norm = outer.norm({n: new_params[n] - before[n] for n in before})
        if rc.downlink == "forward":
            self.params, self.exact = new_params, None
        else:
            self.publish(new_params, begin)
        aggregate_s = time.time() - t_agg + max(round_s - broadcast_s - max(r.task_s for r in done_), 0.0)
        self.step, self.rnd = end, self.rnd + 1
        self.tokens_seen += steps * self.steps.tokens_per_step
        wall = time.time() - t_agg + round_s
        self.per_step_s = wall / steps
        return self._advance(done_, steps, wall, sent, broadcast_s, aggregate_s, update_norm, outer.norm(avg),
                             evaluation, warnings)

    def _advance(self, done: tuple[WorkerResult, ...], steps: int, wall: float, fetched: int, broadcast_s: float,
                 aggregate_s: float, update_norm: float, delta_norm: float, evaluation: loop.Evaluation | None,
                 warnings: tuple[str, ...]) -> loop.Advance:
        """The round's train-row figures (the same keys as a DDP step's) and its round row (``fetched``: the bytes
        sent to the workers)."""
        round_tokens = sum(r.tokens for r in done)
        returned = sum(r.delta_bytes for r in done)
        self.comm["broadcast"] += fetched
        self.comm["returned"] += returned
        elapsed = time.time() - self.started
        loss = sum(r.mean_loss * r.tokens for r in done) / max(round_tokens, 1)
        tps = round_tokens / max(wall, 1e-9)
        counted = sum(r.counted for r in done)
        peaks = self.worker_peaks(done)
        total = self.schedule.total_steps
        left = (total - self.step) * self.per_step_s if total else max(self.tc.time_budget - elapsed, 0)
        row = rows.Round(
            round=self.rnd, step=self.step, workers=self.present, workers_done=len(done), tokens=round_tokens,
            loss=loss, inner_losses=";".join(f"{r.mean_loss:.5f}" for r in done),
            attempts=";".join(str(r.attempt) for r in done), cold=";".join(str(r.worker) for r in done if r.cold),
            broadcast_bytes=fetched, returned_bytes=returned, broadcast_s=broadcast_s,
            fetch_s=max(r.load_s for r in done), compute_s=max(r.compute_s for r in done), aggregate_s=aggregate_s,
            round_s=wall, outer_update_norm=update_norm, delta_norm=delta_norm, elapsed=elapsed,
            total_steps=total, tokens_per_s=tps, eta_s=left,
            sent_mb=(self.comm["broadcast"] + self.comm["returned"]) / 1e6,
            peak_rss_mb=max(p for p in peaks if p is not None))
        return loop.Advance(tokens=steps * self.steps.tokens_per_step, loss=loss,
                            acc=sum(r.correct for r in done) / counted if counted else float("nan"),
                            lr=sum(r.lr for r in done) / len(done), grad_norm=sum(r.grad_norm for r in done) / len(done),
                            rss_mb=max(r.rss_mb for r in done), peaks=peaks, seconds=wall, trained=round_tokens,
                            evaluation=evaluation, rows=(row,), warnings=warnings, workers=len(done),
                            halt=halted(self.sink))

    def average(self, partial: Partial) -> dict:
        """The workers' deltas averaged by tokens: a topk codec's value by value over the workers that sent it
        (``average_over = senders``), everything else over all the workers that returned one."""
        import torch

        if self.codec.name == "topk" and partial.sum is None:
            mean = sparse_mean(*by_worker(partial), senders=self.tc.rounds.average_over == "senders")
            return {n: torch.from_numpy(a) for n, a in mean.items()}
        return {n: torch.from_numpy(a) / sum(r.weight for r in partial.results) for n, a in summed(partial).items()}

    def evaluate(self) -> loop.Evaluation:
        partial, *_ = self.launch(0, do_eval=True, persist="", finish=False)
        return self.evaluation(partial)

    def publish(self, new: dict, base: int) -> None:
        """The outer step's weights ``new`` become the next round's. With a lossy codec the step from the weights
        the workers hold (those of step ``base``) is encoded now: with ``downlink = codec`` by the codec itself, the
        workers' weights moving by what it delivers and the driver keeping ``new`` as its exact weights (error
        feedback on the driver's side: what one step does not deliver, the next one carries); with ``exact``, the
        weights that changed."""
        import torch

        self.update, self.exact = None, None  # (a run resumed with another codec may have held exact weights)
        if self.codec.lossless:
            self.params = new
            return
        held = {n: t.numpy() for n, t in self.params.items()}
        if self.tc.rounds.downlink == "codec":
            payload = self.codec.encode({n: (new[n] - self.params[n]).numpy() for n in new})
            self.params = {n: torch.from_numpy(a) for n, a in apply_update(held, payload).items()}
            self.exact = new
        else:
            payload = encode_update(held, {n: t.numpy() for n, t in new.items()})
            self.params = new
        self.update = (base, payload)

    def _dropped(self, partial: Partial, done: tuple[WorkerResult, ...]) -> tuple[str, ...]:
        dropped = partial.errors
        self.dropped_last = sorted(e.worker for e in dropped)
        if not done:
            raise SparklmError(f"round {self.rnd + 1}: every worker failed; first error: {dropped[0].error}",
                               hint="see the Spark log (--debug shows more)")
        if not dropped:
            return ()
        return (f"round {self.rnd + 1}: {len(done)} of {self.present} workers returned a delta (worker "
                f"{', '.join(str(e.worker) for e in dropped)} failed: {dropped[0].error}); averaging "
                "over those that arrived, weighted by tokens",)

    def save(self, position: loop.Position, best: Best, best_weights: dict | None) -> None:
        tc, step = self.tc, self.step
        files = {"model": self.params}
        if self.momentum is not None:
            files["outer"] = self.momentum
        if self.exact is not None:
            files["exact"] = self.exact
        files.update(best.checkpoint_files(best_weights, step))
        run = checkpoint.RunState(strategy=self.name, world=self.job.workers, step=step, tokens_seen=self.tokens_seen,
                                  position=step * self.steps.rows_per_step, elapsed=position.elapsed,
                                  best=best.to_state(),
                                  extra={"round": self.rnd, "sync_every": tc.rounds.sync_every,
                                         "pending_eval": position.pending_eval})
        checkpoint.save_run(self.ckpt_dir, run, files, keep=tc.keep_checkpoints, storage=self.storage,
                            adopt={"inner": self.persist})

    def _final_job(self, partial: Partial, sent: int) -> None:
        self.comm["broadcast"] += sent
        self.final_peaks = [max(a or 0.0, b or 0.0) if a is not None or b is not None else None
                            for a, b in zip(self.final_peaks, self.worker_peaks(partial.results))]

    def final_evaluation(self, will_export: bool) -> loop.Evaluation | None:
        """The final weights evaluated; with no earlier best kept (``will_export``) the same task exports them, else
        the evaluation decides which weights model/ gets, and :meth:`finish` exports in a second job."""
        self.persist = join(self.ckpt_dir, f".inner-step-{self.step:07d}")
        partial, _, _, sent = self.launch(0, do_eval=True, persist=self.persist, finish=will_export)
        self._final_job(partial, sent)
        self.final = partial if will_export else None
        return self.evaluation(partial) if partial.results else None

    def finish(self, best: dict | None) -> dict:
        partial = self.final
        if partial is None:
            partial, _, _, sent = self.launch(0, do_eval=False, persist="", finish=True,
                                              also={f"{BEST}{n}": t for n, t in (best or {}).items()})
            self._final_job(partial, sent)
        if not any(r.worker == 0 for r in partial.results):
            raise SparklmError("the final task of worker 0 (export of model/ and samples) failed",
                               hint="see the Spark log; --resume runs it again")
        self.rounds_csv.close()
        comm = self.comm
        return {"rounds": self.rnd, "trainable_params": sum(t.numel() for t in self.params.values()),
                "bytes_broadcast": comm["broadcast"], "bytes_returned": comm["returned"],
                "bytes_communicated": comm["broadcast"] + comm["returned"]}


def _round_job(spark, job: Job, bc, bu, spec: RoundSpec, workers: list[int], down: dict[int, bytes] | None, *,
               fault: FaultSpec | None, max_failures: int) -> Partial:
    """One round of ``workers``: a task each (``bc``: the whole weights; ``bu``: the update to the last ones;
    ``down``: a task's own downlink, by worker), their deltas summed by a tree aggregation.

    A worker whose last attempt raises is reported by its task. One whose process dies (a crash, an
    out-of-memory kill, a lost executor) fails the Spark job instead: the round then runs again without
    it — the tasks are deterministic, so the others recompute exactly their deltas."""
    alive = list(workers)
    lost: list[WorkerResult] = []
    while alive:
        try:
            with spark_errors():
                partial = _aggregate(spark, job, bc, bu, spec, [(w, (down or {}).get(w)) for w in alive], fault,
                                     max_failures)
        except SparklmError:
            raise
        except Exception as e:
            m = re.search(r"Task (\d+) in stage [\d.]+ failed", str(e))
            if m is None or int(m.group(1)) >= len(alive):
                raise SparklmError(f"round {spec.round + 1}: the Spark job failed: {_first_line(e)}",
                                   hint="see the Spark log (--debug shows more)") from None
            worker = alive.pop(int(m.group(1)))
            note = killed_note(str(e))
            lost.append(WorkerResult(worker=worker, attempt=max_failures - 1,
                                     error=f"its task failed {max_failures} time(s): {_task_cause(str(e))}"
                                           + (f" ({note})" if note else "")))
            continue
        return dataclasses.replace(partial, errors=partial.errors + tuple(lost))
    return Partial(errors=tuple(lost))


def _aggregate(spark, job: Job, bc, bu, spec: RoundSpec, workers: list[tuple[int, bytes | None]],
               fault: FaultSpec | None, max_failures: int) -> Partial:
    def task(it):
        import signal

        from pyspark import TaskContext

        from ..infra.errors import SparklmError
        from ..spark.resources import task_gpu
        from .round_worker import run_worker

        attempt = TaskContext.get().attemptNumber()
        gpu = task_gpu(TaskContext.get())
        for worker, own_down in it:
            hit = fault is not None and fault.hits(spec.round, worker, attempt)
            update = (lambda d=own_down: d) if own_down is not None else None if bu is None else (lambda: bu.value)
            try:
                if hit and fault.at == "start":
                    raise RuntimeError(f"injected fault (round {spec.round}, worker {worker}, attempt {attempt})")
                result, delta = run_worker(job, worker, None if bc is None else (lambda: bc.value), spec,
                                           attempt=attempt, update=update, gpu=gpu)
                if hit and fault.at == "crash":  # the Python worker dies, as in an out-of-memory kill
                    os.kill(os.getpid(), signal.SIGKILL)
                if hit:  # after the inner steps and the state write: the retry must recompute the same delta
                    raise RuntimeError(f"injected fault (round {spec.round}, worker {worker}, attempt {attempt})")
            except SparklmError:
                raise
            except Exception as e:
                if attempt + 1 < max_failures:
                    raise  # Spark retries the task; it recomputes the same result
                yield Partial(errors=(WorkerResult(worker=worker, attempt=attempt,
                                                   error=f"{type(e).__name__}: {e}"[:300]),))
                continue
            if isinstance(delta, bytes):  # a lossy codec's encoding: decoded where the deltas are summed
                yield Partial(packed=(delta,), results=(result,))
            else:
                yield Partial(sum=delta, results=(result,))

    rdd = spark.sparkContext.parallelize(workers, len(workers)).mapPartitions(task)  # a task's data: its own
    return rdd.treeAggregate(None, merge, merge, depth=2)


def _first_line(e: BaseException) -> str:
    for line in str(e).splitlines():
        if "failed" in line or "Error" in line:
            return clip(" ".join(line.split()))
    return clip(" ".join(str(e).split()))


def _task_cause(text: str) -> str:
    """What happened to a task whose process died, in words (Spark's own line is a stage and task dump)."""
    if "Python worker exited unexpectedly" in text:
        return "its Python worker exited unexpectedly"
    if "ExecutorLostFailure" in text:
        return "its executor was lost"
    m = re.search(r"most recent failure: (.*)", text)
    return clip(" ".join((m.group(1) if m else text).split()))


def clip(text: str, limit: int = 300) -> str:
    """``text`` cut to ``limit`` characters at a word's end, with an ellipsis when cut."""
    if len(text) <= limit:
        return text
    return text[:limit].rsplit(" ", 1)[0] + " …"


def merge(a: Partial | None, b: Partial | None) -> Partial | None:
    """Associative: adds weighted deltas and concatenates figures (the tree aggregation's combine)."""
    from .outer import weighted_sum

    if a is None or b is None:
        return b if a is None else a
    if a.sum is None or b.sum is None:
        total = b.sum if a.sum is None else a.sum
    else:  # the tasks already weighted their deltas by tokens
        total = weighted_sum([(a.sum, 1.0), (b.sum, 1.0)])
    # encoded deltas travel encoded up the tree (the smaller message) and are decoded by summed() at the driver
    return Partial(sum=total, packed=a.packed + b.packed, results=a.results + b.results, errors=a.errors + b.errors)


def by_worker(partial: Partial) -> tuple[list[bytes], list[float]]:
    """A round's encoded deltas and their workers' weights, in worker order (the tree aggregation's order varies;
    float sums over them must not)."""
    ordered = sorted(zip(partial.results, partial.packed), key=lambda rp: rp[0].worker)
    return [p for _, p in ordered], [r.weight for r, _ in ordered]


def summed(partial: Partial) -> dict:
    """The sum of a round's weighted deltas: the dense ones' running sum plus the encoded ones, decoded."""
    from .outer import weighted_sum

    parts = [(decode(p), 1.0) for p in partial.packed] + ([(partial.sum, 1.0)] if partial.sum is not None else [])
    return weighted_sum(parts) if len(parts) > 1 else parts[0][0]


@dataclass(frozen=True)
class FaultSpec:
    """A fault to inject (a testing aid, ``SPARKLM_INJECT_FAULT``): worker ``worker``'s task of round ``round`` fails
    its first ``attempts`` attempts, at its start, after its work (end), or by killing its Python worker (crash)."""

    round: int
    worker: int
    attempts: int = 1
    at: str = "end"

    def hits(self, round: int, worker: int, attempt: int) -> bool:
        return self.round == round and self.worker == worker and attempt < self.attempts


def parse_fault(text: str) -> FaultSpec | None:
    """The fault ``SPARKLM_INJECT_FAULT`` asks for, or None."""
    if not text:
        return None
    try:
        spec = dict(part.split("=", 1) for part in text.split(","))
        fault = FaultSpec(round=int(spec["round"]), worker=int(spec["worker"]), attempts=int(spec.get("attempts", 1)),
                          at=spec.get("at", "end"))
    except (ValueError, KeyError):
        fault = None
    if fault is None or fault.at not in ("start", "end", "crash"):
        raise SparklmError(f"{FAULT_ENV}={text!r} is not round=R,worker=W[,attempts=K][,at=start|end|crash]")
    return fault


def _max_failures(spark) -> int:
    """Attempts Spark gives a task: local[N,F] → F, local[N] → 1, else spark.task.maxFailures (4)."""
    master = spark.sparkContext.master
    if master.startswith("local"):
        m = re.match(r"local\[[^,\]]+,\s*(\d+)\]", master)
        return int(m.group(1)) if m else 1
    return int(spark.sparkContext.getConf().get("spark.task.maxFailures", "4"))
