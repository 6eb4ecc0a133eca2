"""What each read task of ``prepare`` does, on any engine (Spark tasks or a Beam pipeline's workers): pure
functions of a task's documents and the plan the driver decided, so that both engines write the same dataset.

* :func:`bins` groups the read units into tasks (the packed rows depend on that grouping, so both engines use it);
* :func:`scan_rows` turns documents into the scan's metadata rows (status, split, size, hash, sample text);
* :func:`copy_order` is the rule that picks which copy of a duplicated document is kept;
* :func:`write_part` cleans, tokenizes, packs (or encodes) and writes one task's part files, and
  :func:`gather` turns the tasks' reports into the files and counts the manifest is made of.
"""

from __future__ import annotations

import hashlib
import os
import re
import sys
from collections import defaultdict
from collections.abc import Iterable, Iterator, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import pyarrow as pa

from ..config import Config
from ..infra.errors import SparklmError
from . import allocator, clean, instruct, labelled, sources
from . import tokenizer as tokenizers_mod
from .manifest import SPLITS
from .packing import Packed, Packer, PackSpec
from .parts import PartFile, list_column

# the scan's metadata rows, as :func:`scan_rows` yields them: (column, Spark type)
_SCAN_SCHEMA = (("source", "string"), ("pos", "long"), ("status", "string"), ("split", "string"), ("n_bytes", "long"),
                ("n_invalid", "long"), ("doc_id", "long"), ("digest", "binary"), ("sample", "string"),
                ("label", "string"), ("split_key", "long"), ("auto", "boolean"))
SCAN_COLUMNS = tuple(name for name, _ in _SCAN_SCHEMA)
SCAN_DDL = ", ".join(f"{name} {kind}" for name, kind in _SCAN_SCHEMA)
# the counts a write task reports per (source, status, split, kept), and the scan's aggregate rows; "first": the
# position of the group's first document in its source (to name a malformed record)
COUNT_COLUMNS = ("source", "status", "split", "kept", "n", "bytes", "invalid", "first")


def bins(units: list[sources.ReadUnit], n: int) -> list[list[sources.ReadUnit]]:
    """Group read units into at most ``n`` tasks of similar size; each keeps (file, offset) order. A task packs its
    documents into its own part files, so the same ``n`` gives the same rows on any engine."""
    out: list[list[sources.ReadUnit]] = [[] for _ in range(max(1, min(n, len(units))))]
    load = [0] * len(out)
    for u in sorted(units, key=lambda u: (-u.nbytes, u.uri, u.start)):  # largest first into the lightest bin
        i = load.index(min(load))
        out[i].append(u)
        load[i] += u.nbytes
    return [sorted(b, key=lambda u: (u.uri, u.start)) for b in out]


def planned_bytes(bins: list[list[sources.ReadUnit]]) -> int:
    """A rough size of the text: compressed files hold about 3x their size, enough to bound the sample."""
    return sum(u.nbytes * (3 if u.compression else 1) for b in bins for u in b)


def sample_units(bins: list[list[sources.ReadUnit]], sample_mb: int) -> list[sources.ReadUnit]:
    """Without a full scan, the units (chosen by hash) read for the tokenizer's sample: twice its size, since the
    split and the hash thin it out."""
    units = sorted((u for b in bins for u in b), key=lambda u: clean.digest(f"{u.uri}@{u.start}"))
    budget = 2 * sample_mb * 2**20
    chosen, total = [], 0
    for u in units:
        if total >= budget:
            break
        chosen.append(u)
        total += u.nbytes * (3 if u.compression else 1)
    return chosen


def read_tasks(data, workers: int) -> int:
    """How many read tasks a pass has: ``data.read_tasks``, else 4 per worker (the engine's parallelism)."""
    return data.read_tasks or 4 * workers


def hash_split(unit: sources.ReadUnit, dig: bytes, val_fraction: float) -> str:
    """A document's split: its unit's group, or by its content hash for inputs split by hash."""
    if unit.group != "auto":
        return unit.group
    return "validation" if clean.is_validation(dig, val_fraction) else "train"


def full_scan(data) -> bool:
    """Whether prepare reads everything once before writing: duplicates and a class split are known only after a
    look at all (else one pass writes, after a sample for the tokenizer)."""
    return data.dedup or labelled.labels_of(data).stratified


def sample_fraction(config: Config, planned_bytes: int) -> float:
    """The share of training documents (by content hash) that the tokenizer is trained on."""
    if config.tokenizer.path:
        return 0.0
    return min(1.0, config.tokenizer.sample_mb * 2**20 / (planned_bytes or 1))


class Engine(Protocol):
    """What runs the two passes (``data.engine``): :class:`spark_engine.SparkSource` or
    :class:`beam_engine.BeamSource`. The driver (``prepare._run``) calls only these."""

    bins: list[list[sources.ReadUnit]] | None  # the read tasks' units (None: a DataFrame's partitions)
    count: int  # input files (DataFrames), for the manifest
    label: str  # how progress names the input: "3 files"
    planned_bytes: int  # a rough size of the text, to bound the tokenizer's sample

    def scan(self, config: Config, *, sample_only: bool, staging: str) -> Scanned: ...
    def write(self, plan: WritePlan, losers: dict) -> list[dict]: ...  # the write tasks' reports
    def subset(self, bins: list[list[sources.ReadUnit]], config: Config) -> Engine: ...
    def stage(self, name: str) -> AbstractContextManager: ...
    def errors(self) -> AbstractContextManager: ...  # failures inside tasks as one-line errors
    def describe(self) -> dict: ...  # manifest["engine"]
    def release(self) -> None: ...


@dataclass
class Scanned:
    """What the scan tells the driver: count rows of :data:`COUNT_COLUMNS` (``kept`` meaning "first copy"), the
    duplicates to skip ({source: positions}), the tokenizer's sample, and for a labelled dataset its (split, label,
    count) rows and each label's validation threshold."""

    agg: list[dict] = field(default_factory=list)
    losers: dict[str, frozenset] = field(default_factory=dict)
    sample: list[str] = field(default_factory=list)
    class_counts: list[dict] | None = None
    cut: dict[str, int] | None = None


def scan_rows(docs: Iterable[tuple], data, fraction: float) -> Iterator[tuple]:
    """The scan's metadata row (:data:`SCAN_COLUMNS`) of each of :func:`sources.documents`' tuples: no text but the
    sample's, chosen by content hash (``fraction`` of the training documents)."""
    classify = labelled.labels_of(data).stratified  # split per label
    for unit, pos, status, text, invalid, dig in docs:
        ok = status == sources.OK
        # labelled records of hash-split inputs get their split from their class's threshold (stratified)
        split = None if not ok or (classify and unit.group == "auto") else hash_split(unit, dig, data.val_fraction)
        doc = clean.doc_id(dig) if ok else None
        label = text.label if ok and classify else None
        text = sources.text_of(text) if ok else None
        sample = sample_of(text, doc, fraction) if fraction > 0 and ok and split == "train" else None
        yield (unit.uri, pos, status, split, len(text.encode("utf-8", "surrogatepass")) if ok else 0,
               invalid, doc, dig, sample, label,
               labelled.split_key(dig) if ok and classify else None, unit.group == "auto")


# Characters: a document longer than this is sampled piece by piece, not whole or not at all (one long line, a file
# in doc_mode file); the paragraphs of ordinary text are shorter, and sampled as before.
SAMPLE_PIECE = 1 << 18
_CUT_SEARCH = 1024  # how far a piece's edge moves to the next white space (text without any is cut where it is)
_SPACE = re.compile(r"\s")


def sample_of(text: str, doc: int, fraction: float) -> str | None:
    """A training document's share of the tokenizer's sample, ``fraction`` of its text on average: a short one whole
    or not at all (by its id, a content hash), a longer one as the pieces of :data:`SAMPLE_PIECE` characters that its
    id and their index pick (joined by newlines), each cut at white space so words stay whole. A function of the
    content alone, so every engine and partitioning trains the same tokenizer."""
    if fraction >= 1.0:
        return text
    if len(text) <= SAMPLE_PIECE:
        return text if (doc & 0xFFFFFF) < fraction * 2**24 else None
    cuts = [0, *(_cut(text, at) for at in range(SAMPLE_PIECE, len(text), SAMPLE_PIECE)), len(text)]
    key = doc.to_bytes(8, "little", signed=True)
    picked = [text[a:b].strip() for i, (a, b) in enumerate(zip(cuts, cuts[1:]))
              if int.from_bytes(hashlib.blake2b(key + i.to_bytes(4, "little"), digest_size=4).digest(), "little")
              < fraction * 2**32]
    return "\n".join(p for p in picked if p) or None


def _cut(text: str, at: int) -> int:
    """The first white space at or after ``at`` (within :data:`_CUT_SEARCH`), else ``at``."""
    found = _SPACE.search(text, at, at + _CUT_SEARCH)
    return found.start() if found else at


def copy_order(split: str | None, source: str, pos: int) -> tuple:
    """Among the copies of one document (same content hash), the first in this order is kept: the validation one
    (a document held out stays held out), then the first by (source, position)."""
    return (split == "train", source, pos)


@dataclass(frozen=True)
class WritePlan:
    """What every write task needs besides its documents and the duplicates to skip."""

    config: Config
    spec: tokenizers_mod.TokenizerSpec
    pack: PackSpec
    staging: str  # the staging directory's URI
    classes: dict | None = None  # a labelled dataset's class names and validation thresholds

    @property
    def rows_per_group(self) -> int:
        return max(16, self.config.output.row_group_mb * 1024 * 1024 // (self.pack.seq_len * 4))


def write_part(docs: Iterable[tuple], name: str, plan: WritePlan, losers: Mapping[str, frozenset]) -> list[dict]:
    """Pass 2 of one task: skip duplicates, tokenize, pack (or encode, for an encoder) and write each split's part
    file ``SPLIT/name``. Returns one report per split (its file and figures) and one of counts per (source, status,
    split, kept), with the allocator the task tokenized on."""
    data, spec, classes = plan.config.data, plan.spec, plan.classes
    # text inside a document is text, even "<|eos|>"; a chat template's rendering holds real special tokens
    tok = tokenizer_for(spec, specials=templated(data, spec), encoder=labelled.encoded(data))
    render = renderer_for(spec) if templated(data, spec) else None
    writers = {s: _writer(plan, s, name) for s in SPLITS}
    batch: dict[str, tuple[list, list]] = {s: ([], []) for s in SPLITS}
    # (source, status, split, kept) -> n, bytes, invalid, first position
    counts: dict[tuple, list[int]] = defaultdict(lambda: [0, 0, 0, sys.maxsize])
    cut = classes["cut"] if classes else None
    size = 0
    for unit, pos, status, doc, invalid, dig in docs:
        split = None
        if status == sources.OK:
            split = (hash_split(unit, dig, data.val_fraction) if cut is None else
                     labelled.split_of(unit.group, labelled.split_key(dig), doc.label, cut))
        kept = status == sources.OK and pos not in losers.get(unit.uri, ())
        c = counts[(unit.uri, status, split, kept or status != sources.OK)]
        c[0] += 1
        c[2] += invalid
        c[3] = min(c[3], pos)
        if not kept:
            continue
        nbytes = len(sources.text_of(doc).encode("utf-8", "surrogatepass"))
        c[1] += nbytes
        if isinstance(doc, instruct.Record):  # → (piece, trains) pairs
            doc = _segments(doc, render, data, unit, pos, plan.config.storage)
        texts, ids = batch[split]
        texts.append(doc)
        ids.append(clean.doc_id(dig))
        size += nbytes
        if size > 4 * 2**20:  # tokenize in batches of a few MB: the tokenizer parallelises inside
            for s, (texts, ids) in batch.items():
                writers[s].add(tok, texts, ids)
            batch, size = {s: ([], []) for s in SPLITS}, 0
    for s, (texts, ids) in batch.items():
        writers[s].add(tok, texts, ids)
    return [*(w.close() for w in writers.values()),
            {"split": "", "counts": [(*k, *v) for k, v in counts.items()], "allocator": allocator.loaded()}]


def _writer(plan: WritePlan, split: str, name: str):
    data, classes = plan.config.data, plan.classes
    if not labelled.encoded(data):
        return _SplitWriter(split, name, plan.staging, plan.config.storage, plan.pack, plan.spec, plan.rows_per_group,
                            data)
    return labelled.Writer(split, name, plan.staging, plan.config.storage, seq_len=data.seq_len,
                           rows_per_group=plan.rows_per_group, pad_id=plan.spec.pad_id,
                           window=labelled.windowing(data) == "window",
                           overlap=data.seq_len - data.stride if data.stride else 0, pairs=bool(data.pair_field),
                           labels=labelled.labels_of(data),
                           label_ids={n: i for i, n in enumerate(classes["names"])} if classes else None)


def part_name(task: int, attempt: str) -> str:
    """A task's part file name; the commit drops the attempt (the text after the last "-")."""
    return f"part-{task:05d}-{attempt}.parquet"


def gather(reports: Iterable[dict]) -> tuple[dict[str, list[dict]], list[dict], dict[str, dict[str, int]]]:
    """The write tasks' reports → (each split's non-empty files in path order, count rows of :data:`COUNT_COLUMNS`,
    each split's tokens and dropped tokens over every task, a task whose tokens filled no row too, and the number
    of tasks that had tokens)."""
    reports = list(reports)
    files = {s: sorted((m for m in reports if m["split"] == s and m["rows"] > 0), key=lambda m: m["path"])
             for s in SPLITS}
    agg = [dict(zip(COUNT_COLUMNS, c)) for m in reports if m["split"] == "" for c in m["counts"]]
    tokens = {s: {"tokens": sum(m["tokens"] for m in reports if m["split"] == s),
                  "dropped_tokens": sum(m["dropped_tokens"] for m in reports if m["split"] == s),
                  "tasks": sum(1 for m in reports if m["split"] == s and m["tokens"])} for s in SPLITS}
    return files, agg, tokens


# Both caches are keyed by what their objects are built from, the whole spec or its JSON: TokenizerSpec.sha256 keeps
# only what decides token ids, and a Spark worker reused by the next prepare must not serve an earlier tokenizer's
# post-processor (an encoder's [CLS] and [SEP]) or chat template.
_TOKENIZERS: dict[tuple, object] = {}


def share_cpus(cpus: int) -> None:
    """Tokenize on ``cpus`` threads (a Spark task's CPUs) in this worker process. ``tokenizers`` parallelises a batch
    over a rayon pool as large as the host by default, so tasks running side by side oversubscribe it: on local[2],
    two workers of one thread each tokenized 5-8% faster than two of two threads (BENCHMARKS.md). The pool reads
    the setting when this process first tokenizes; one the user set is kept."""
    os.environ.setdefault("RAYON_NUM_THREADS", str(max(1, cpus)))


def tokenizer_for(spec: tokenizers_mod.TokenizerSpec, *, specials: bool = False, encoder: bool = False):
    """The worker's tokenizer; ``specials``: special tokens written in the text are special tokens (a chat
    template's rendering), else they are text ("<|eos|>" inside a document is not the end of it). ``encoder``: one
    of its own, whose truncation the encoder writer sets."""
    key = (spec.json, specials, encoder)
    tok = _TOKENIZERS.get(key)
    if tok is None:  # once per Python worker, not once per task
        tok = _TOKENIZERS[key] = spec.tokenizer()
        tok.encode_special_tokens = not specials
    return tok


def templated(data, spec: tokenizers_mod.TokenizerSpec) -> bool:
    """Whether records are rendered with the tokenizer's chat template (else their contents are joined as they are)."""
    return data.format != "text" and data.chat_template and bool(spec.chat_template)


_RENDERERS: dict[tokenizers_mod.TokenizerSpec, instruct.Render] = {}


def renderer_for(spec: tokenizers_mod.TokenizerSpec) -> instruct.Render:
    """The chat template as :mod:`transformers` renders it (``apply_chat_template``), once per Python worker."""
    render = _RENDERERS.get(spec)
    if render is None:
        hf = spec.hf()

        def render(messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
            try:
                return hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
            except Exception as e:  # the template's own raise_exception(), or jinja's errors
                raise instruct.TemplateError(f"makes the chat template fail: {' '.join(str(e).split())[:200]}") from None

        _RENDERERS[spec] = render
    return render


def _segments(record: instruct.Record, render, data, unit: sources.ReadUnit, pos: int, storage) -> list:
    """A record's (piece, trains) pairs, or one line naming the record the chat template cannot cut."""
    try:
        return instruct.segments(record, render)
    except instruct.TemplateError as e:
        fix = ("--no-chat-template joins prompt and response as they are" if data.format == "instruction" else
               "fix the record")
        raise SparklmError(f"{sources.where(unit, pos, storage)} {e}",
                           hint=f"{fix}, or use a tokenizer whose chat template renders each turn the same "
                                "whatever follows it") from None


class _SplitWriter:
    """Executor side: packs one split's documents and writes them to one Parquet file in row groups."""

    def __init__(self, split, name, staging, storage, pack: PackSpec, spec, rows_per_group: int, data):
        self.split = split
        self.pack, self.rows_per_group = pack, rows_per_group
        bos = spec.bos_id if spec.add_bos else None
        self.packer = Packer(pack, bos_id=bos, eos_id=spec.eos_id)
        self.records = data.format != "text"  # documents come as (piece, trains) pairs; rows get a loss mask
        # a chat template's rendering holds its own special tokens; contents joined as they are get BOS and EOS
        self.specials = (None, None) if templated(data, spec) else (bos, spec.eos_id)
        self.schema = data_schema(pack.has_mask, self.records)
        self.file = PartFile(staging, storage, f"{split}/{name}", self.schema)
        self.pending: list[Packed] = []
        self.counts = {"documents": 0, "pad_tokens": 0}
        if self.records:
            self.counts["loss_tokens"] = 0

    def add(self, tok, docs: list, ids: list[int]) -> None:
        """Tokenize and pack documents: texts, or records' (piece, trains) pairs (see :mod:`.instruct`)."""
        if not docs:
            return
        self.counts["documents"] += len(docs)
        if not self.records:
            encodings = tok.encode_batch_fast(docs, add_special_tokens=False)
            self.pending.extend(self.packer.feed([e.ids for e in encodings], ids))
        else:
            # Pieces are tokenized apart: a prompt's tokens are those the model sees at inference, before it answers.
            pieces = tok.encode_batch_fast([piece for doc in docs for piece, _ in doc], add_special_tokens=False)
            seqs, masks, k = [], [], 0
            for doc in docs:
                seq, mask = instruct.frame([e.ids for e in pieces[k:k + len(doc)]], [t for _, t in doc],
                                           bos_id=self.specials[0], eos_id=self.specials[1])
                seqs.append(seq)
                masks.append(mask)
                k += len(doc)
            self.pending.extend(self.packer.feed(seqs, ids, masks))
        self._flush(final=False)

    def close(self) -> dict:
        self.pending.extend(self.packer.finish())
        self._flush(final=True)
        nbytes = self.file.close()
        return {"split": self.split, "path": self.file.path, "bytes": nbytes, "rows": self.file.rows,
                "row_groups": self.file.row_groups, "tokens": self.packer.tokens_in,
                "dropped_tokens": self.packer.tokens_dropped, **self.counts}

    def _flush(self, final: bool) -> None:
        while self.pending and (final or sum(len(p) for p in self.pending) >= self.rows_per_group):
            ids = np.concatenate([p.input_ids for p in self.pending])
            mask = np.concatenate([p.attention_mask for p in self.pending]) if self.pack.has_mask else None
            loss = np.concatenate([p.loss_mask for p in self.pending]) if self.records else None
            doc = np.concatenate([p.doc_id for p in self.pending])
            take = len(ids) if final else self.rows_per_group
            self.file.write(to_table(ids[:take], None if mask is None else mask[:take], doc[:take], self.schema,
                                      None if loss is None else loss[:take]))
            if mask is not None:
                self.counts["pad_tokens"] += int(take * self.pack.seq_len - mask[:take].sum())
            if loss is not None:  # targets that count: a row's first token is never one
                self.counts["loss_tokens"] += int(loss[:take, 1:].sum())
            rest = Packed(ids[take:], None if mask is None else mask[take:], doc[take:],
                          None if loss is None else loss[take:])
            self.pending = [rest] if len(rest) else []


def data_schema(has_mask: bool, has_loss_mask: bool = False) -> pa.Schema:
    fields = [("input_ids", pa.list_(pa.int32()))]
    if has_mask:
        fields.append(("attention_mask", pa.list_(pa.int8())))
    if has_loss_mask:
        fields.append(("loss_mask", pa.list_(pa.int8())))
    fields.append(("doc_id", pa.int64()))
    return pa.schema(fields)


def to_table(ids: np.ndarray, mask: np.ndarray | None, doc: np.ndarray, schema: pa.Schema,
              loss: np.ndarray | None = None) -> pa.Table:
    cols = [list_column(ids)] + [list_column(a) for a in (mask, loss) if a is not None] + [pa.array(doc)]
    return pa.Table.from_arrays(cols, schema=schema)
