"""Training in rounds on plain Spark tasks: parameter averaging (``average``) and DiLoCo (``diloco``).

A round: the driver broadcasts the global weights; N ordinary (non-barrier) tasks each run
``sync_every`` inner AdamW steps on their shard (train/inner.py) and return their delta; a tree
aggregation sums the deltas; the driver takes one outer step (strategies/outer.py). Nothing needs
all workers up at once: Spark schedules the tasks as slots free up, retries a lost task (which
recomputes the same delta, tasks being deterministic), and a worker that fails its last attempt
is left out of that round's average (weighted by tokens) instead of failing the run.

The driver keeps the global weights and the outer momentum, writes metrics.csv, rounds.csv and a
checkpoint every ``checkpoint_every`` steps (weights, outer momentum, the workers' inner
optimizer states), from which ``--resume`` continues exactly.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import time
import uuid
from pathlib import Path

from ... import progress
from ...errors import SparklmError, from_spark

ROUND_COLUMNS = ["round", "step", "workers", "workers_done", "tokens", "loss", "inner_losses", "attempts", "cold",
                 "broadcast_bytes", "returned_bytes", "broadcast_s", "fetch_s", "compute_s", "aggregate_s", "round_s",
                 "outer_update_norm", "delta_norm", "elapsed"]
# A testing aid: "round=R,worker=W[,attempts=K][,at=start|end]" fails that task's first K attempts (default 1)
# at its start or after its work (default end).
FAULT_ENV = "SPARKLM_INJECT_FAULT"


def run(spark, job: dict, *, workers: int, threads: int, run_dir: Path, shards: list[tuple[int, int]] | None = None
        ) -> dict:
    """Train ``job`` in rounds on ``workers`` Spark tasks; return the run's result (as ``ddp.run`` does)."""
    import torch
    from safetensors.torch import save as save_bytes

    from ...config import from_dict
    from ...data.manifest import load_prepared
    from .. import checkpoint
    from ..loop import _model, _total_steps
    from ..metrics import CsvLog, MetricsWriter
    from ..run import _line, dataset_tokenizer
    from . import outer

    config = from_dict(job["config"])
    tc = config.train
    dataset = load_prepared(job["data"], config.storage)
    seq_len = dataset.seq_len
    sync_every = tc.sync_every
    lr, mu = (1.0, 0.0) if tc.strategy == "average" else (tc.outer_lr, tc.outer_momentum)

    # The initial weights: the same seeded model every strategy starts from.
    model = _model(config, dataset_tokenizer(dataset, config.storage), seq_len)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    del model
    momentum = None
    rows_per_step = tc.batch_size * workers * tc.grad_accum
    train_rows = dataset.manifest["splits"]["train"]["sequences"]
    if train_rows < tc.batch_size * workers:
        raise SparklmError(f"the training split has {train_rows} sequences, fewer than one global batch "
                           f"({tc.batch_size} x {workers} workers)",
                           hint="lower train.batch_size or --workers, or prepare more text / a shorter --seq-len")
    total_steps = _total_steps(config, dataset, rows_per_step, seq_len)
    step, tokens_seen, elapsed_before, rnd_index = 0, 0, 0.0, 0
    ckpt_dir = run_dir / "checkpoints"
    job = {**job, "uid": uuid.uuid4().hex, "world": workers, "threads": threads,
           "shards": shards or [(w, workers) for w in range(workers)]}
    if job["resume"] and (last := checkpoint.latest(ckpt_dir)) is not None:
        state, files = checkpoint.load_files(last, ["model", "outer"])
        if state.get("world") != workers:
            raise SparklmError(f"checkpoint {last} was written by {state.get('world')} workers, not {workers}",
                               hint="resume with the same --workers")
        missing = set(params) - set(files["model"])
        if missing or any(files["model"][n].shape != params[n].shape for n in params):
            raise SparklmError(f"checkpoint {last} does not fit the model", hint="resume with the same model config")
        params = {n: files["model"][n].float() for n in params}
        momentum = {n: files["outer"][n] for n in params} if files["outer"] else None
        step, tokens_seen, elapsed_before, rnd_index = (state["step"], state["tokens_seen"], state["elapsed"],
                                                        state["round"])
        job.update(inner_from=str(last), inner_from_step=step)

    fault = _fault(os.environ.get(FAULT_ENV, ""))
    max_failures = _max_failures(spark)
    metrics = MetricsWriter(run_dir / "metrics.csv")
    rounds = CsvLog(run_dir / "rounds.csv", ROUND_COLUMNS)
    facts: dict = {}
    comm = {"broadcast": 0, "returned": 0}
    epoch_tokens = max(dataset.manifest["splits"]["train"]["tokens"], 1)
    t_start = time.time() - elapsed_before
    per_step_s = None
    pending_eval = False
    last_eval: dict = {}

    def launch(steps: int, *, do_eval: bool, persist: str, finish: bool) -> tuple[dict, float, float, int]:
        elapsed = time.time() - t_start
        spec = {"round": rnd_index, "step0": step, "steps": steps, "total_steps": total_steps, "eval": do_eval,
                "persist": persist, "finish": finish, "time_frac0": None, "time_frac_per_step": 0.0}
        if tc.time_budget:
            spec["time_frac0"] = elapsed / tc.time_budget
            spec["time_frac_per_step"] = (per_step_s or 0.0) / tc.time_budget
        t0 = time.time()
        payload = save_bytes({n: t.contiguous() for n, t in params.items()})
        bc = spark.sparkContext.broadcast(payload)
        broadcast_s = time.time() - t0
        try:
            partial = _round_job(spark, job, bc, spec, workers, fault, max_failures)
        finally:
            bc.destroy()
        return partial, broadcast_s, time.time() - t0, len(payload)

    while step < total_steps:
        if tc.time_budget and time.time() - t_start >= tc.time_budget:
            break
        steps = min(sync_every, total_steps - step)
        end = step + steps
        ckpt_now = bool(tc.checkpoint_every) and end // tc.checkpoint_every > step // tc.checkpoint_every \
            and end < total_steps
        persist = str(ckpt_dir / f".inner-step-{end:07d}") if ckpt_now else ""
        partial, broadcast_s, round_s, nbytes = launch(steps, do_eval=pending_eval, persist=persist, finish=False)
        t_agg = time.time()
        done = partial["results"]
        facts = facts or next((r["facts"] for r in done if "facts" in r), {})
        if pending_eval:
            last_eval = _eval(partial)
            metrics.evaluation(step=step, tokens=tokens_seen, **last_eval)
            if last_eval:
                progress.info(_line({"kind": "eval", "step": step, **last_eval}, {}))
        dropped = partial["errors"]
        if not done:
            raise SparklmError(f"round {rnd_index}: every worker failed; first error: {dropped[0]['error']}",
                               hint="see the Spark log (--debug shows more)")
        if dropped:
            progress.info(f"[yellow]round {rnd_index}: {len(done)} of {workers} workers returned a delta "
                          f"(worker {', '.join(str(e['worker']) for e in dropped)} failed: {dropped[0]['error']}); "
                          f"averaging over those that arrived, weighted by tokens[/yellow]")
        weight = sum(r["weight"] for r in done)
        avg = {n: torch.from_numpy(a) / weight for n, a in partial["sum"].items()}
        new_params, momentum = outer.outer_step(params, avg, momentum, lr=lr, mu=mu)
        update_norm = outer.norm({n: new_params[n] - params[n] for n in params})
        params = new_params
        aggregate_s = time.time() - t_agg + max(round_s - broadcast_s - max(r["task_s"] for r in done), 0.0)
        step, rnd_index = end, rnd_index + 1
        round_tokens = sum(r["tokens"] for r in done)
        tokens_seen += steps * rows_per_step * seq_len
        returned = sum(r["delta_bytes"] for r in done)
        comm["broadcast"] += nbytes * len(done)
        comm["returned"] += returned
        elapsed = time.time() - t_start
        wall = time.time() - t_agg + round_s
        per_step_s = wall / steps
        loss = sum(sum(r["losses"]) / len(r["losses"]) * r["tokens"] for r in done) / max(round_tokens, 1)
        tps = round_tokens / max(wall, 1e-9)
        peak = facts.get("peak_flops") or 1.0
        metrics.train(step=step, epoch=tokens_seen / epoch_tokens, tokens=tokens_seen, loss=loss,
                      lr=sum(r["lr"] for r in done) / len(done),
                      grad_norm=sum(r["grad_norm"] for r in done) / len(done), tokens_per_s=tps,
                      ms_per_step=1000 * per_step_s, mfu=tps * facts.get("flops_per_token", 0) / (peak * workers),
                      rss_mb=max(r["rss_mb"] for r in done), elapsed=elapsed)
        rounds.write({
            "round": rnd_index, "step": step, "workers": workers, "workers_done": len(done), "tokens": round_tokens,
            "loss": loss, "inner_losses": ";".join(f"{sum(r['losses']) / len(r['losses']):.5f}" for r in done),
            "attempts": ";".join(str(r["attempt"]) for r in done),
            "cold": ";".join(str(r["worker"]) for r in done if r["cold"]),
            "broadcast_bytes": nbytes * len(done), "returned_bytes": returned, "broadcast_s": broadcast_s,
            "fetch_s": max(r["load_s"] for r in done), "compute_s": max(r["compute_s"] for r in done),
            "aggregate_s": aggregate_s, "round_s": wall, "outer_update_norm": update_norm,
            "delta_norm": outer.norm(avg), "elapsed": elapsed})
        if rnd_index == 1:
            metrics.info(**facts, total_steps=total_steps, workers=workers, strategy=tc.strategy,
                         sync_every=sync_every)
        progress.info(_round_line(rnd_index, step, total_steps, loss, tps, wall, comm, update_norm, len(done),
                                  workers, elapsed, per_step_s, tc.time_budget))
        pending_eval = bool(tc.eval_every) and step // tc.eval_every > (step - steps) // tc.eval_every \
            and step < total_steps
        if ckpt_now:
            _save(checkpoint, ckpt_dir, step, params, momentum, rnd_index, tokens_seen, elapsed, workers, tc,
                  Path(persist))

    # -- the end: evaluate the final weights, export model/ and samples, checkpoint ----------------
    elapsed = time.time() - t_start
    persist = str(ckpt_dir / f".inner-step-{step:07d}")
    partial, *_, nbytes = launch(0, do_eval=True, persist=persist, finish=True)
    comm["broadcast"] += nbytes * len(partial["results"])
    if partial["results"]:
        last_eval = _eval(partial)
        metrics.evaluation(step=step, tokens=tokens_seen, **last_eval)
    if not any(r["worker"] == 0 for r in partial["results"]):
        raise SparklmError("the final task of worker 0 (export of model/ and samples) failed",
                           hint="see the Spark log; --resume runs it again")
    _save(checkpoint, ckpt_dir, step, params, momentum, rnd_index, tokens_seen, elapsed, workers, tc, Path(persist))
    metrics.close()
    rounds.close()
    shutil.rmtree(Path(tempfile.gettempdir()) / "sparklm-inner" / job["uid"], ignore_errors=True)
    return {"steps": step, "tokens": tokens_seen, "seconds": elapsed, "params": facts.get("params"),
            "flops_per_token": facts.get("flops_per_token"), "final": last_eval,
            "peak_flops": facts.get("peak_flops"), "dtype": facts.get("dtype"), "rounds": rnd_index,
            "bytes_broadcast": comm["broadcast"], "bytes_returned": comm["returned"],
            "bytes_communicated": comm["broadcast"] + comm["returned"]}


def _round_job(spark, job: dict, bc, spec: dict, workers: int, fault: dict | None, max_failures: int) -> dict:
    """One Spark job: a task per worker, their deltas summed by a tree aggregation."""
    def task(it):
        from pyspark import TaskContext

        from ...errors import SparklmError
        from ..inner import run_worker

        attempt = TaskContext.get().attemptNumber()
        for worker in it:
            t0 = time.time()
            hit = fault and fault["round"] == spec["round"] and fault["worker"] == worker and attempt < fault["attempts"]
            try:
                if hit and fault["at"] == "start":
                    raise RuntimeError(f"injected fault (round {spec['round']}, worker {worker}, attempt {attempt})")
                weights = bc.value
                fetch = time.time() - t0
                result = run_worker(job, worker, weights, spec, attempt=attempt)
                result["load_s"] += fetch
                if hit:  # after the inner steps and the state write: the retry must recompute the same delta
                    raise RuntimeError(f"injected fault (round {spec['round']}, worker {worker}, attempt {attempt})")
            except SparklmError:
                raise
            except Exception as e:
                if attempt + 1 < max_failures:
                    raise  # Spark retries the task; it recomputes the same result
                result = {"worker": worker, "error": f"{type(e).__name__}: {e}"[:300]}
            yield _partial(result)

    rdd = spark.sparkContext.parallelize(range(workers), workers).mapPartitions(task)
    try:
        return rdd.treeAggregate(None, _merge, _merge, depth=2)
    except Exception as e:
        found = from_spark(e)
        if found is not None:
            raise found from None
        raise


def _partial(result: dict) -> dict:
    """A task's contribution to the tree aggregation: its weighted delta and its figures."""
    if "error" in result:
        return {"sum": None, "results": [], "errors": [result]}
    delta = result.pop("delta", None)
    return {"sum": delta, "results": [result], "errors": []}


def _merge(a: dict | None, b: dict | None) -> dict | None:
    """Associative: adds weighted deltas and concatenates figures (the tree aggregation's combine)."""
    if a is None or b is None:
        return b if a is None else a
    if a["sum"] is None or b["sum"] is None:
        total = b["sum"] if a["sum"] is None else a["sum"]
    else:  # the tasks already weighted their deltas by tokens
        from .outer import weighted_sum

        total = weighted_sum([(a["sum"], 1.0), (b["sum"], 1.0)])
    return {"sum": total, "results": a["results"] + b["results"], "errors": a["errors"] + b["errors"]}


def _eval(partial: dict) -> dict:
    from ..loop import eval_metrics

    sums = [0.0] * 4
    for r in partial["results"]:
        for i, v in enumerate(r.get("eval_sums", [0.0] * 4)):
            sums[i] += v
    return eval_metrics(sums)


def _save(checkpoint, ckpt_dir: Path, step: int, params, momentum, rnd: int, tokens: int, elapsed: float,
          workers: int, tc, inner: Path) -> None:
    files = {"model": params}
    if momentum is not None:
        files["outer"] = momentum
    checkpoint.save_files(ckpt_dir, step, files=files, keep=tc.keep_checkpoints, adopt={"inner": inner},
                          state={"strategy": tc.strategy, "round": rnd, "tokens_seen": tokens, "elapsed": elapsed,
                                 "world": workers, "sync_every": tc.sync_every, "position": step * workers *
                                 tc.batch_size * tc.grad_accum})
    shutil.rmtree(inner, ignore_errors=True)


def _fault(text: str) -> dict | None:
    if not text:
        return None
    try:
        spec = dict(part.split("=", 1) for part in text.split(","))
        fault = {"round": int(spec["round"]), "worker": int(spec["worker"]), "attempts": int(spec.get("attempts", 1)),
                 "at": spec.get("at", "end")}
    except (ValueError, KeyError):
        fault = None
    if fault is None or fault["at"] not in ("start", "end"):
        raise SparklmError(f"{FAULT_ENV}={text!r} is not round=R,worker=W[,attempts=K][,at=start|end]")
    return fault


def _max_failures(spark) -> int:
    """Attempts Spark gives a task: local[N,F] → F, local[N] → 1, else spark.task.maxFailures (4)."""
    master = spark.sparkContext.master
    if master.startswith("local"):
        m = re.match(r"local\[[^,\]]+,\s*(\d+)\]", master)
        return int(m.group(1)) if m else 1
    return int(spark.sparkContext.getConf().get("spark.task.maxFailures", "4"))


def default_threads(spark, workers: int) -> int:
    """Torch threads per task: local mode shares the machine's cores; on a cluster, spark.task.cpus."""
    if spark.sparkContext.master.startswith("local"):
        return max(1, (os.cpu_count() or 1) // workers)
    return int(spark.sparkContext.getConf().get("spark.task.cpus", "1"))


def _round_line(rnd, step, total, loss, tps, wall, comm, update_norm, done, workers, elapsed, per_step, budget) -> str:
    from ..run import _hms

    of = f"/{total}" if total < 10**12 else ""
    left = (total - step) * per_step if of else max(budget - elapsed, 0) if budget else 0
    mb = (comm["broadcast"] + comm["returned"]) / 1e6
    who = f" | {done}/{workers} workers" if done < workers else ""
    return (f"round {rnd} | step {step}{of} | loss {loss:.3f} | {tps:,.0f} tok/s | {wall:.1f} s/round | "
            f"outer step {update_norm:.3g} | {mb:,.1f} MB sent{who} | {elapsed:.0f}s | ETA {_hms(left)}")
