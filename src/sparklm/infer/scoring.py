"""A harness's requests scored in a Spark task: log-likelihoods of continuations and greedy generations, computed the
way lm-evaluation-harness's HF backend computes them, so that its metrics come out the same.

The driver (:mod:`sparklm.infer.harness`) turns the harness's requests into token ids; a task here gets a share of
them, loads the model once per Python worker, sorts its share by length (longest first, as the harness does: padding
stays small and a batch that runs out of memory does so at once), batches, and answers each request by its index.
Nothing here imports lm-evaluation-harness: executors need only torch and transformers.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Backend:
    """What a task needs to load the model: its directory (or object-store URL) and how to run it."""

    source: str
    fingerprint: str  # the directory's version: a model replaced at the same path is loaded again
    storage: object  # StorageConfig
    threads: int  # torch threads; 0: the cores Spark gives the task
    batch_size: int


def loaded(backend: Backend):
    """This worker's model (loaded on first use, kept for the next task and the next request type)."""
    from ..infra.cache import process_local
    from ..spark.resources import task_device
    from .generate import load

    where = task_device()
    threads = backend.threads or _task_cpus()
    return process_local(("harness", backend.source, backend.fingerprint, threads, where), lambda: load(
        backend.source, threads=threads, storage=backend.storage, device=where, pack=True))


def _task_cpus() -> int:
    """The cores Spark gave this task (spark.task.cpus; local[N] gives each task one), 0 outside a task."""
    from pyspark import TaskContext

    ctx = TaskContext.get()
    return int(ctx.cpus()) if ctx is not None else 0


# -- log-likelihoods ----------------------------------------------------------------------------------------------

def loglikelihood_rows(backend: Backend, rows: Iterable[tuple]) -> Iterator[tuple[int, float, bool]]:
    """``rows``: (input ids, [(request index, continuation ids), ...]); every request sharing an input is answered
    from one forward pass. Yields (request index, log-likelihood, whether greedy decoding gives the continuation)."""
    lm = loaded(backend)
    rows = sorted(rows, key=lambda r: (-len(r[0]), r[0]))
    for start in range(0, len(rows), backend.batch_size):
        yield from score_batch(lm.model, rows[start:start + backend.batch_size])


@torch.no_grad()
def score_batch(model, rows: list[tuple]) -> list[tuple[int, float, bool]]:
    """One forward pass over right-padded inputs (causal attention never sees the padding, so no mask is needed:
    the harness calls its model the same way). Only the positions that predict a continuation are turned into
    logits (``logits_to_keep``) and then into float32 log-probabilities."""
    width = max(len(ids) for ids, _ in rows)
    x = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (ids, _) in enumerate(rows):
        x[i, :len(ids)] = torch.tensor(ids, dtype=torch.long)
    lo = max(0, min(len(ids) - max(len(c) for _, c in conts) for ids, conts in rows))
    dev = _device(model)
    keep = torch.arange(lo, width, device=dev)
    try:
        logits = model(x.to(dev), logits_to_keep=keep).logits
    except TypeError:  # a model whose forward has no logits_to_keep: every position, as the harness computes
        logits = model(x.to(dev)).logits[:, lo:]
    if logits.shape[1] != width - lo:  # kept a different span than asked (an older forward): take the whole
        logits = model(x.to(dev)).logits[:, lo:]
    out = []
    for i, (ids, conts) in enumerate(rows):
        end = len(ids) - lo  # the last input position (exclusive), relative to lo
        for index, cont in conts:
            span = logits[i, end - len(cont):end].float()
            logp = torch.log_softmax(span, dim=-1)
            target = torch.tensor(cont, dtype=torch.long, device=dev)
            greedy = bool((span.argmax(dim=-1) == target).all())
            out.append((index, float(logp.gather(1, target[:, None]).sum()), greedy))
    return out


def _device(model) -> torch.device:
    return getattr(model, "device", None) or next(model.parameters()).device


# -- generation ---------------------------------------------------------------------------------------------------

def generation_rows(backend: Backend, rows: Iterable[tuple], pad_id: int | None) -> Iterator[tuple[int, list[int]]]:
    """``rows``: (request index, context ids, stop strings, max new tokens, generate()'s other keyword arguments as a
    sorted tuple). Yields (request index, the new token ids, up to the first stop string or later)."""
    lm = loaded(backend)
    groups: dict[str, list[tuple]] = {}
    for row in rows:  # one batch never mixes settings: the row's last three fields
        groups.setdefault(repr(row[2:]), []).append(row)  # repr: a setting's value may be a list
    for group in groups.values():
        group.sort(key=lambda r: (-len(r[1]), r[1]))
        for start in range(0, len(group), backend.batch_size):
            yield from generate_batch(lm, group[start:start + backend.batch_size], pad_id)


@torch.no_grad()
def generate_batch(lm, rows: list[tuple], pad_id: int | None) -> list[tuple[int, list[int]]]:
    """Greedy (or as the task asks) generation for left-padded contexts, as the harness's HF backend runs it:
    transformers' ``generate`` with the model's own generation settings, stopping a row once its new text holds a
    stop string (the driver cuts the text at the first one, so stopping later changes nothing)."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    _, _, stops, max_new, extra = rows[0]
    width = max(len(r[1]) for r in rows)
    pad = pad_id if pad_id is not None else 0
    x = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        x[i, width - len(r[1]):] = torch.tensor(r[1], dtype=torch.long)
        mask[i, width - len(r[1]):] = 1
    tok = lm.tokenizer

    class Stop(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            new = input_ids[:, width:]
            return torch.tensor([any(s in tok.decode(row) for s in stops) for row in new.tolist()],
                                dtype=torch.bool, device=input_ids.device)

    settings = dict(extra)
    if settings.get("temperature", 0.0) == 0.0 and settings.get("do_sample") is None:
        settings["do_sample"] = False  # temperature 0 means greedy, as the harness reads it
    if settings.get("do_sample") is False:
        settings.pop("temperature", None)
    dev = _device(lm.model)
    out = lm.model.generate(input_ids=x.to(dev), attention_mask=mask.to(dev), max_length=width + max_new,
                            stopping_criteria=StoppingCriteriaList([Stop()]), pad_token_id=pad_id, use_cache=True,
                            **settings)
    return [(r[0], out[i, width:].tolist()) for i, r in enumerate(rows)]
