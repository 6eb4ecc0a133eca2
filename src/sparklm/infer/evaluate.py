"""``sparklm eval``: loss, perplexity, bits per byte and accuracy of any causal LM on any text, on Spark.

Documents are read and cleaned by prepare's readers (same formats, same handling of bad input),
tokenized with the model's own tokenizer and scored with a sliding window: windows of
``max_length`` tokens that start every ``stride`` tokens, each token scored once, with up to
``max_length - stride`` tokens of context carried over (the method of the HF perplexity guide).
Bits per byte divide the summed nats by the documents' UTF-8 bytes: comparable across tokenizers.
"""

from __future__ import annotations

import dataclasses

import torch

from ..config import Config
from ..infra import progress
from ..infra.cache import process_local
from ..infra.errors import SparklmError, spark_errors
from ..infra.fs import effective, version
from ..model import lm_head
from ..model.figures import lm_figures
from ..spark.resources import check_batching, task_device


def windows(n_tokens: int, max_length: int, stride: int) -> list[tuple[int, int, int]]:
    """(begin, end, targets) for a document of ``n_tokens`` (pure; the HF perplexity guide's loop).

    The window is ids[begin:end]; its last ``targets`` positions are targets, each predicted from
    the window's tokens before it. A window's first token has nothing before it, so it is never
    scored: with ``stride < max_length`` that only affects the document's first token; with
    ``stride == max_length`` (no overlap) every window's first token goes unscored.
    """
    out, prev_end, begin = [], 0, 0
    while True:
        end = min(begin + max_length, n_tokens)
        out.append((begin, end, end - prev_end))
        prev_end = end
        if end >= n_tokens:
            return out
        begin += stride


def _loaded(lm) -> tuple:
    """A loaded model and whether its head may score in chunks (:func:`lm_head.supports` runs the model once, so it is
    asked once per load, kept beside the model)."""
    return lm, lm_head.supports(lm.model)


@torch.no_grad()
def score(lm, batch: list[tuple[list[int], int]], chunked: bool) -> torch.Tensor:
    """Sums (nats, tokens, correct) over windows ``(ids, targets)`` (see :func:`windows`); ``chunked``: the head
    scores a chunk of tokens at a time, never holding every logit (where :func:`_loaded` found it equal)."""
    pad = lm.tokenizer.pad_token_id if lm.tokenizer.pad_token_id is not None else 0
    width = max(len(ids) for ids, _ in batch)
    x = torch.full((len(batch), width), pad, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    target_mask = torch.zeros((len(batch), width), dtype=torch.bool)
    for i, (ids, scored) in enumerate(batch):  # right padding: causal attention never sees it
        x[i, :len(ids)] = torch.tensor(ids)
        mask[i, :len(ids)] = 1
        target_mask[i, len(ids) - scored:len(ids)] = True
    dev = getattr(lm.model, "device", None) or torch.device("cpu")
    return lm_head.score(lm.model, x.to(dev), mask.to(dev), target_mask[:, 1:].to(dev), chunked=chunked)[:3].cpu()


def _check_settings(max_length: int, stride: int, batch_size: int, threads: int) -> None:
    """The settings a task would fail on (or take as another), refused before the model loads and Spark starts."""
    check_batching(batch_size, threads)
    if max_length < 0 or stride < 0:
        raise SparklmError("--max-length and --stride must be >= 0 (0: the default)")
    if max_length == 1:
        raise SparklmError("--max-length 1 leaves no token to predict: a window scores each token after its first",
                           hint="use 2 or more (0: the model's context)")


def evaluate(model: str, inputs: list[str], *, config: Config | None = None, max_length: int = 0, stride: int = 0,
             batch_size: int = 8, threads: int = 0, spark=None) -> dict:
    """Evaluate ``model`` (run directory or HF directory) on ``inputs``; returns the figures."""
    import os

    from ..data.sources import MALFORMED, OK, documents, malformed, plan_units
    from ..spark.session import check_shared, get_session
    from .generate import load, model_uri, token_ids

    _check_settings(max_length, stride, batch_size, threads)
    config = config or Config()
    # eval scores text; instruction records are scored through the prepared dataset's validation split instead
    config = config.replace(data=dataclasses.replace(config.data, format="text"))
    storage = effective(config.storage)
    source = model_uri(model, storage)  # a local path or an object-store URL each executor copies once
    lm = load(source, storage=storage, device="cpu")  # on the driver too: fail early on a bad model, and learn its context
    length = max_length or lm.context
    if length > lm.context:
        raise SparklmError(f"--max-length {length} exceeds the model's context of {lm.context} tokens")
    step = stride or length
    if not 1 <= step <= length:
        raise SparklmError(f"--stride {step} must be between 1 and --max-length ({length})")
    units = plan_units(inputs, group="auto", data=config.data, storage=storage)
    spark = get_session(config.spark, spark=spark() if callable(spark) else spark)
    check_shared(spark, {"model": source, "input": inputs[0]})
    data = config.data
    env_threads = threads

    def run(part):
        where = task_device()  # the GPU Spark handed this task, if any
        lm, chunked = process_local(("model", source, version(source, storage), env_threads, where), lambda: _loaded(
            load(source, threads=env_threads, storage=storage, device=where, pack=True)))
        sums = torch.zeros(6, dtype=torch.float64)  # nats, tokens, correct, bytes, documents, dropped
        pending: list[tuple[list[int], int]] = []
        first = None  # (source, position) of the task's first malformed record
        for unit, pos, status, text, _invalid, _digest in documents(list(part), data, storage):
            if status != OK:
                sums[5] += 1
                if status == MALFORMED and first is None:
                    first = (unit.uri, pos)
                continue
            ids = token_ids(lm, text)
            sums[3] += len(text.encode("utf-8"))
            sums[4] += 1
            if len(ids) < 2:  # nothing to predict
                continue
            for begin, end, scored in windows(len(ids), length, step):
                pending.append((ids[begin:end], scored))
                if len(pending) >= batch_size:
                    sums[:3] += score(lm, pending, chunked)
                    pending = []
        if pending:
            sums[:3] += score(lm, pending, chunked)
        yield sums.tolist(), first

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    rdd = spark.sparkContext.parallelize(units, max(1, len(units))).mapPartitions(run)
    with spark_errors():
        parts = rdd.collect()
    nats, tokens, correct, nbytes, docs, dropped = [sum(sums[i] for sums, _ in parts) for i in range(6)]
    firsts = [first for _, first in parts if first is not None]
    why = f"the first malformed: {malformed(*min(firsts), data, storage)}" if firsts else ""
    if tokens == 0:
        dropped_part = f"{int(dropped)} records dropped; {why}" if why else ""
        raise SparklmError(f"no tokens to score in the input{f' ({dropped_part})' if dropped_part else ''}",
                           hint="check --input and --text-field (empty, or every record dropped)")
    if why:
        progress.warn(f"dropped {int(dropped)} record(s) it could not read; {why}")
    return {**lm_figures(nats, tokens, correct, nbytes), "tokens": int(tokens), "bytes": int(nbytes), "documents": int(docs),
            "dropped_records": int(dropped), "max_length": length, "stride": step, "model": source}
