"""Training in rounds on plain Spark tasks: parameter averaging (``average``) and DiLoCo (``diloco``).

A round: the driver broadcasts the global weights; N ordinary (non-barrier) tasks each run
``sync_every`` steps of the training core on their shard (rounds_task.py) and return their delta; a
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
import os
import re
import shutil
import tempfile
import time
from contextlib import nullcontext

from ... import progress
from ...config import Config
from ...errors import SparklmError, killed_note, spark_errors
from ...fs import delete, join
from .. import checkpoint
from ..sinks import CsvSink, Sink, Sinks, rank_mb
from .base import BEST, Job, RoundSpec, RunResult, WorkerResult

ROUND_COLUMNS = ["round", "step", "workers", "workers_done", "tokens", "loss", "inner_losses", "attempts", "cold",
                 "broadcast_bytes", "returned_bytes", "broadcast_s", "fetch_s", "compute_s", "aggregate_s", "round_s",
                 "outer_update_norm", "delta_norm", "elapsed"]
# A testing aid: "round=R,worker=W[,attempts=K][,at=start|end|crash]" fails that task's first K attempts
# (default 1) at its start, after its work (default end), or by killing its Python worker after its work.
FAULT_ENV = "SPARKLM_INJECT_FAULT"


class Rounds:
    """``average``: plain SGD on the averaged delta with lr 1 (the new weights are the workers' average);
    ``diloco``: Nesterov momentum with ``outer_lr`` and ``outer_momentum``."""

    def __init__(self, name: str):
        self.name = name

    def describe(self, config: Config) -> str:
        n = config.train.workers
        return f"{self.name}, {n} worker{'s' * (n > 1)}, sync every {config.train.rounds.sync_every} steps"

    def prestart(self, config: Config, master: str):
        return nullcontext(())  # a round's worker trains inside its Spark task: no process of its own

    def run(self, spark, job: Job, sink: Sink, shards: list[tuple[int, int]] | None = None) -> RunResult:
        """Train ``job`` in rounds; ``shards`` (tests) overrides which slice of the data each worker streams."""
        try:
            return self._train(spark, job, sink, shards)
        finally:  # the workers' inner states in the temporary directory (shared with the driver in local mode)
            shutil.rmtree(os.path.join(tempfile.gettempdir(), "sparklm-inner", job.uid), ignore_errors=True)
            from .rounds_task import shared_inner_dir

            shared = shared_inner_dir(job.run_dir)
            if shared:
                delete(shared, job.config.storage)

    def _train(self, spark, job: Job, sink: Sink, shards: list[tuple[int, int]] | None) -> RunResult:
        import torch
        from safetensors.torch import save as save_bytes

        from ...data.manifest import load_prepared, load_tokenizer
        from ...model.task import task_for
        from .. import core
        from . import outer

        config, workers = job.config, job.workers
        tc, rc = config.train, config.train.rounds
        storage = config.storage
        dataset = load_prepared(job.data, storage)
        seq_len = dataset.seq_len
        lr, mu = (1.0, 0.0) if self.name == "average" else (rc.outer_lr, rc.outer_momentum)
        plan = core.plan(tc, train_rows=dataset.manifest["splits"]["train"]["sequences"], seq_len=seq_len,
                         workers=workers)
        total_steps = plan.total_steps

        # The initial weights: the same seeded model every strategy starts from; only the trainable ones travel.
        task = task_for(config)
        model = task.build(config, load_tokenizer(dataset, storage), seq_len)
        params = {n: p.detach().clone() for n, p in task.trainable(model).items()}
        del model
        momentum = None
        step, tokens_seen, elapsed_before, rnd_index = 0, 0, 0.0, 0
        ckpt_dir = join(job.run_dir, "checkpoints")
        inner_from = ""
        found = None
        best, best_params = core.Best(), None  # best_params None: the best weights are the current ones
        if job.resume:
            def load(path: str):
                state = checkpoint.read_state(path, storage)
                if state.get("world") != workers:
                    raise SparklmError(f"checkpoint {path} was written by {state.get('world')} workers, not {workers}",
                                       hint="resume with the same --workers")
                for name in state.get("sha256", {}):  # the workers' inner states too: all verified here, once
                    if name.startswith("inner/"):
                        checkpoint.read_file(path, name, state, storage)
                return path, state, {n: checkpoint.read_tensors(path, n, storage, state) for n in ("model", "outer", "best")}

            found = checkpoint.newest_readable(ckpt_dir, load, storage, warn=progress.warn)
        if found is not None:
            last, state, files = found
            saved, saved_outer = files["model"], files["outer"]
            if set(params) - set(saved) or any(saved[n].shape != params[n].shape for n in params):
                raise SparklmError(f"checkpoint {last} does not fit the model", hint="resume with the same model config")
            params = {n: saved[n].float() for n in params}
            momentum = {n: saved_outer[n] for n in params} if saved_outer else None
            step, tokens_seen, elapsed_before, rnd_index = (state["step"], state["tokens_seen"], state["elapsed"],
                                                            state["round"])
            inner_from = last
            saved_best = {n: files["best"][n].float() for n in params} if files["best"] else {}
            best, best_params = core.Best.restore(state, saved_best, step, lambda: params, tc.keep_best)
        resumed_at = step

        fault = parse_fault(os.environ.get(FAULT_ENV, ""))
        max_failures = _max_failures(spark)
        rounds_csv = CsvSink(join(job.run_dir, "rounds.csv"), ROUND_COLUMNS, {"round"}, storage)
        out = Sinks([sink, rounds_csv])
        shards_t = tuple(tuple(s) for s in (shards or [(w, workers) for w in range(workers)]))
        facts: dict = {}
        comm = {"broadcast": 0, "returned": 0}
        rank_peak = [0.0] * workers  # each worker's peak resident memory over the rounds (task index order)
        epoch_tokens = max(dataset.manifest["splits"]["train"]["tokens"], 1)
        t_start = time.time() - elapsed_before
        per_step_s = None
        pending_eval = False
        last_eval: dict = {}
        dropped_last: list[int] = []  # workers left out of the last round: their optimizer state restarts

        def launch(steps: int, *, do_eval: bool, persist: str, finish: bool, also: dict | None = None
                   ) -> tuple[dict, float, float, int]:
            elapsed = time.time() - t_start
            frac0 = elapsed / tc.time_budget if tc.time_budget else None
            spec = RoundSpec(round=rnd_index, step0=step, steps=steps, total_steps=total_steps, eval=do_eval,
                             persist=persist, finish=finish, time_frac0=frac0,
                             time_frac_per_step=(per_step_s or 0.0) / tc.time_budget if tc.time_budget else 0.0,
                             shards=shards_t, inner_from=inner_from if step == resumed_at else "",
                             cold=tuple(dropped_last))
            t0 = time.time()
            payload = save_bytes({n: t.contiguous() for n, t in {**params, **(also or {})}.items()})
            bc = spark.sparkContext.broadcast(payload)
            broadcast_s = time.time() - t0
            try:
                partial = _round_job(spark, job, bc, spec, fault, max_failures)
            finally:
                bc.destroy()
            return partial, broadcast_s, time.time() - t0, len(payload)

        def note_peaks(results: list[WorkerResult]) -> list[float | None]:
            """The round's peak of each worker (None: it returned nothing), also kept in ``rank_peak``."""
            got = {r.worker: r.peak_rss_mb for r in results}
            peaks = [got.get(w) for w in range(workers)]
            rank_peak[:] = [max(a, b or 0.0) for a, b in zip(rank_peak, peaks)]
            return peaks

        def emit_eval(partial: dict) -> dict:
            nonlocal best_params
            figures = _eval(partial)
            if figures:
                out.write({"kind": "eval", "step": step, "tokens": tokens_seen, **figures})
            if best.update(step, figures) and tc.keep_best:
                best_params = params  # the weights just evaluated; outer steps make new tensors, never change these
            return figures

        while total_steps is None or step < total_steps:
            if tc.time_budget and time.time() - t_start >= tc.time_budget:
                break
            steps = rc.sync_every if total_steps is None else min(rc.sync_every, total_steps - step)
            end = step + steps
            ckpt_now = bool(tc.checkpoint_every) and end // tc.checkpoint_every > step // tc.checkpoint_every \
                and (total_steps is None or end < total_steps)
            persist = join(ckpt_dir, f".inner-step-{end:07d}") if ckpt_now else ""
            partial, broadcast_s, round_s, nbytes = launch(steps, do_eval=pending_eval, persist=persist, finish=False)
            t_agg = time.time()
            done: list[WorkerResult] = partial["results"]
            if not facts:
                facts = next((r.facts for r in done if r.facts), {})
                out.write({"kind": "info", **facts, "total_steps": total_steps, "workers": workers,
                           "strategy": self.name, "sync_every": rc.sync_every})
            stop = False
            if pending_eval:
                last_eval = emit_eval(partial)
                stop = best.should_stop(tc.early_stop)
            dropped: list[WorkerResult] = partial["errors"]
            dropped_last = sorted(e.worker for e in dropped)
            if not done:
                raise SparklmError(f"round {rnd_index}: every worker failed; first error: {dropped[0].error}",
                                   hint="see the Spark log (--debug shows more)")
            if dropped:
                progress.info(f"[yellow]round {rnd_index}: {len(done)} of {workers} workers returned a delta "
                              f"(worker {', '.join(str(e.worker) for e in dropped)} failed: {dropped[0].error}); "
                              f"averaging over those that arrived, weighted by tokens[/yellow]")
            weight = sum(r.weight for r in done)
            avg = {n: torch.from_numpy(a) / weight for n, a in partial["sum"].items()}
            new_params, momentum = outer.outer_step(params, avg, momentum, lr=lr, mu=mu)
            update_norm = outer.norm({n: new_params[n] - params[n] for n in params})
            params = new_params
            aggregate_s = time.time() - t_agg + max(round_s - broadcast_s - max(r.task_s for r in done), 0.0)
            step, rnd_index = end, rnd_index + 1
            round_tokens = sum(r.tokens for r in done)
            tokens_seen += steps * plan.tokens_per_step
            returned = sum(r.delta_bytes for r in done)
            comm["broadcast"] += nbytes * len(done)
            comm["returned"] += returned
            elapsed = time.time() - t_start
            wall = time.time() - t_agg + round_s
            per_step_s = wall / steps
            loss = sum(r.mean_loss * r.tokens for r in done) / max(round_tokens, 1)
            tps = round_tokens / max(wall, 1e-9)
            peak = facts.get("peak_flops") or 1.0
            peaks = note_peaks(done)
            round_peak = max(p for p in peaks if p is not None)
            out.write({"kind": "train", "step": step, "epoch": tokens_seen / epoch_tokens, "tokens": tokens_seen,
                       "loss": loss, "lr": sum(r.lr for r in done) / len(done),
                       "grad_norm": sum(r.grad_norm for r in done) / len(done), "tokens_per_s": tps,
                       "ms_per_step": 1000 * per_step_s, "mfu": tps * facts.get("flops_per_token", 0) / (peak * workers),
                       "rss_mb": max(r.rss_mb for r in done), "peak_rss_mb": round_peak,
                       "rank_peak_rss_mb": rank_mb(peaks), "elapsed": elapsed})
            left = (total_steps - step) * per_step_s if total_steps else max(tc.time_budget - elapsed, 0)
            out.write({
                "kind": "round", "round": rnd_index, "step": step, "workers": workers, "workers_done": len(done),
                "tokens": round_tokens, "loss": loss, "inner_losses": ";".join(f"{r.mean_loss:.5f}" for r in done),
                "attempts": ";".join(str(r.attempt) for r in done),
                "cold": ";".join(str(r.worker) for r in done if r.cold),
                "broadcast_bytes": nbytes * len(done), "returned_bytes": returned, "broadcast_s": broadcast_s,
                "fetch_s": max(r.load_s for r in done), "compute_s": max(r.compute_s for r in done),
                "aggregate_s": aggregate_s, "round_s": wall, "outer_update_norm": update_norm,
                "delta_norm": outer.norm(avg), "elapsed": elapsed,
                # for the progress line only
                "total_steps": total_steps, "tokens_per_s": tps, "eta_s": left,
                "sent_mb": (comm["broadcast"] + comm["returned"]) / 1e6, "peak_rss_mb": round_peak})
            if rnd_index == 1:  # the first round's pace projects a time budget
                planned = total_steps or (tc.time_budget / max(per_step_s, 1e-9))
                note = core.epochs_note(planned * plan.tokens_per_step / epoch_tokens, epoch_tokens)
                if note:
                    out.write({"kind": "note", "message": note})
            pending_eval = bool(tc.eval_every) and step // tc.eval_every > (step - steps) // tc.eval_every \
                and (total_steps is None or step < total_steps)
            if ckpt_now:
                _save(ckpt_dir, step, params, momentum, rnd_index, tokens_seen, elapsed, job, self.name,
                      persist, best, best_params)
            if stop:
                out.write({"kind": "note", "message": f"early stop at round {rnd_index}: no lower validation loss in "
                                                      f"{tc.early_stop} evaluations (best at step {best.step})"})
                break

        # -- the end: evaluate the final weights, checkpoint, export model/ (the best weights) and samples ------
        # With earlier best weights the final evaluation decides which weights model/ gets, so the export is a
        # second task; without them the final weights are exported by the evaluating task itself.
        elapsed = time.time() - t_start
        persist = join(ckpt_dir, f".inner-step-{step:07d}")
        earlier = best_params is not None
        partial, *_, nbytes = launch(0, do_eval=True, persist=persist, finish=not earlier)
        comm["broadcast"] += nbytes * len(partial["results"])
        note_peaks(partial["results"])  # the final evaluation and export count too, as a DDP rank's do
        if partial["results"]:
            last_eval = emit_eval(partial)
        _save(ckpt_dir, step, params, momentum, rnd_index, tokens_seen, elapsed, job, self.name, persist, best,
              best_params)
        if earlier:
            keep = best.apart(best_params, step) or {}
            partial, *_, nbytes = launch(0, do_eval=False, persist="", finish=True,
                                         also={f"{BEST}{n}": t for n, t in keep.items()})
            comm["broadcast"] += nbytes * len(partial["results"])
            note_peaks(partial["results"])
        if not any(r.worker == 0 for r in partial["results"]):
            raise SparklmError("the final task of worker 0 (export of model/ and samples) failed",
                               hint="see the Spark log; --resume runs it again")
        rounds_csv.close()
        return RunResult(steps=step, tokens=tokens_seen, seconds=elapsed, params=facts.get("params"),
                         flops_per_token=facts.get("flops_per_token"), final=last_eval, best=best.summary(),
                         peak_flops=facts.get("peak_flops"), dtype=facts.get("dtype"), rounds=rnd_index,
                         bytes_broadcast=comm["broadcast"], bytes_returned=comm["returned"],
                         bytes_communicated=comm["broadcast"] + comm["returned"], peak_rss_mb=max(rank_peak),
                         rank_peak_rss_mb=rank_peak, trainable_params=sum(t.numel() for t in params.values()))


def _round_job(spark, job: Job, bc, spec: RoundSpec, fault: dict | None, max_failures: int) -> dict:
    """One round: a task per worker, their deltas summed by a tree aggregation.

    A worker whose last attempt raises is reported by its task. One whose process dies (a crash, an
    out-of-memory kill, a lost executor) fails the Spark job instead: the round then runs again without
    it — the tasks are deterministic, so the others recompute exactly their deltas."""
    alive = list(range(job.workers))
    lost: list[WorkerResult] = []
    while alive:
        try:
            with spark_errors():
                partial = _aggregate(spark, job, bc, spec, alive, fault, max_failures)
        except SparklmError:
            raise
        except Exception as e:
            m = re.search(r"Task (\d+) in stage [\d.]+ failed", str(e))
            if m is None or int(m.group(1)) >= len(alive):
                raise SparklmError(f"round {spec.round}: the Spark job failed: {_first_line(e)}",
                                   hint="see the Spark log (--debug shows more)") from None
            worker = alive.pop(int(m.group(1)))
            note = killed_note(str(e))
            lost.append(WorkerResult(worker=worker, attempt=max_failures - 1,
                                     error=f"its task failed {max_failures} time(s): {_first_line(e)}"
                                           + (f" ({note})" if note else "")))
            continue
        return {**partial, "errors": partial["errors"] + lost}
    return {"sum": None, "results": [], "errors": lost}


def _aggregate(spark, job: Job, bc, spec: RoundSpec, workers: list[int], fault: dict | None, max_failures: int
               ) -> dict:
    def task(it):
        import signal

        from pyspark import TaskContext

        from ...errors import SparklmError
        from .rounds_task import run_worker

        attempt = TaskContext.get().attemptNumber()
        for worker in it:
            t0 = time.time()
            hit = fault and fault["round"] == spec.round and fault["worker"] == worker and attempt < fault["attempts"]
            try:
                if hit and fault["at"] == "start":
                    raise RuntimeError(f"injected fault (round {spec.round}, worker {worker}, attempt {attempt})")
                weights = bc.value
                fetch = time.time() - t0
                result, delta = run_worker(job, worker, weights, spec, attempt=attempt)
                result = dataclasses.replace(result, load_s=result.load_s + fetch)
                if hit and fault["at"] == "crash":  # the Python worker dies, as in an out-of-memory kill
                    os.kill(os.getpid(), signal.SIGKILL)
                if hit:  # after the inner steps and the state write: the retry must recompute the same delta
                    raise RuntimeError(f"injected fault (round {spec.round}, worker {worker}, attempt {attempt})")
            except SparklmError:
                raise
            except Exception as e:
                if attempt + 1 < max_failures:
                    raise  # Spark retries the task; it recomputes the same result
                yield {"sum": None, "results": [], "errors": [
                    WorkerResult(worker=worker, attempt=attempt, error=f"{type(e).__name__}: {e}"[:300])]}
                continue
            yield {"sum": delta, "results": [result], "errors": []}

    rdd = spark.sparkContext.parallelize(workers, len(workers)).mapPartitions(task)
    return rdd.treeAggregate(None, merge, merge, depth=2)


def _first_line(e: BaseException) -> str:
    for line in str(e).splitlines():
        if "failed" in line or "Error" in line:
            return " ".join(line.split())[:300]
    return " ".join(str(e).split())[:300]


def merge(a: dict | None, b: dict | None) -> dict | None:
    """Associative: adds weighted deltas and concatenates figures (the tree aggregation's combine)."""
    from .outer import weighted_sum

    if a is None or b is None:
        return b if a is None else a
    if a["sum"] is None or b["sum"] is None:
        total = b["sum"] if a["sum"] is None else a["sum"]
    else:  # the tasks already weighted their deltas by tokens
        total = weighted_sum([(a["sum"], 1.0), (b["sum"], 1.0)])
    return {"sum": total, "results": a["results"] + b["results"], "errors": a["errors"] + b["errors"]}


def _eval(partial: dict) -> dict:
    from ..core import eval_metrics

    sums = [0.0] * 4
    for r in partial["results"]:
        for i, v in enumerate(r.eval_sums or (0.0,) * 4):
            sums[i] += v
    return eval_metrics(sums)


def _save(ckpt_dir: str, step: int, params, momentum, rnd: int, tokens: int, elapsed: float, job: Job,
          strategy: str, inner: str, best, best_params) -> None:
    tc = job.config.train
    files = {"model": params}
    if momentum is not None:
        files["outer"] = momentum
    files.update(best.checkpoint_files(best_params, step))
    checkpoint.save(ckpt_dir, step, files=files, keep=tc.keep_checkpoints, storage=job.config.storage,
                    adopt={"inner": inner},
                    state={"strategy": strategy, "round": rnd, "tokens_seen": tokens, "elapsed": elapsed,
                           "world": job.workers, "sync_every": tc.rounds.sync_every, "best": best.to_state(),
                           "position": step * job.workers * tc.batch_size * tc.grad_accum})


def parse_fault(text: str) -> dict | None:
    """The fault ``SPARKLM_INJECT_FAULT`` asks for (a testing aid), or None."""
    if not text:
        return None
    try:
        spec = dict(part.split("=", 1) for part in text.split(","))
        fault = {"round": int(spec["round"]), "worker": int(spec["worker"]), "attempts": int(spec.get("attempts", 1)),
                 "at": spec.get("at", "end")}
    except (ValueError, KeyError):
        fault = None
    if fault is None or fault["at"] not in ("start", "end", "crash"):
        raise SparklmError(f"{FAULT_ENV}={text!r} is not round=R,worker=W[,attempts=K][,at=start|end|crash]")
    return fault


def _max_failures(spark) -> int:
    """Attempts Spark gives a task: local[N,F] → F, local[N] → 1, else spark.task.maxFailures (4)."""
    master = spark.sparkContext.master
    if master.startswith("local"):
        m = re.match(r"local\[[^,\]]+,\s*(\d+)\]", master)
        return int(m.group(1)) if m else 1
    return int(spark.sparkContext.getConf().get("spark.task.maxFailures", "4"))
