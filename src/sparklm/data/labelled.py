"""Encoder datasets: labelled records for ``prepare --task classify``, documents for ``--task mlm``.

A labelled record is a text (or a pair of texts) and a label; it is read, cleaned, deduplicated and hashed by the
same code as every other record (sources.py), so CSV/TSV, JSONL and Parquet files, object stores and DataFrames
all work alike. What differs from a causal-LM dataset:

* the split is *stratified*: within each label, the records with the smallest content hashes go to validation
  (the same share of every class; stable: a record's split depends on the records, not on their order or on
  the partitioning), decided once on the small metadata table and sent to the writers as one threshold per label;
* a row is one record, not a packed stream: the encoder's tokenizer adds its own special tokens (CLS/SEP,
  ``<s>``/``</s>``, pairs as the model expects), and a text longer than ``seq_len`` is truncated or cut into
  windows (each a row with the record's label), padded to ``seq_len``;
* labels become ids in the order of :func:`ordered` (numbers numerically, other names alphabetically), recorded
  in the manifest with their counts per split.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from ..infra.errors import SparklmError
from ..registry import CLASSES, NO_LABELS, DataKind, LabelKind, data_kind
from .parts import PartFile, list_column

NO_LABEL = "no_label"  # a record dropped because it has no label (sources.py's statuses)


def kind(data) -> DataKind:
    """What ``prepare --task`` writes for ``data.task`` (the task's module says: registry.DataKind)."""
    return data_kind(data.task)


def encoded(data) -> bool:
    """Whether the dataset is one encoded record per row (an encoder's), not packed token streams."""
    return kind(data).rows == "encoded"


def labels_of(data) -> LabelKind:
    """The dataset's kind of labels (registry.LabelKind: none, classes or values): how they are read, split, written
    and counted."""
    return kind(data).labels


@dataclass(frozen=True)
class Record:
    """One labelled example: ``text`` (and ``pair``, for sentence-pair tasks) and its ``label`` (None: missing)."""

    text: str
    pair: str | None
    label: str | None

    @property
    def content(self) -> str:
        """The record's text (both texts of a pair): what its byte count measures."""
        return self.text if self.pair is None else f"{self.text}\n{self.pair}"

    def key(self) -> str:
        """What dedup and the split hash: the texts and the label."""
        return json.dumps([self.text, self.pair, self.label], ensure_ascii=False, separators=(",", ":"))

    @property
    def trains(self) -> bool:
        """Whether it has its text (and its pair's): a record without one is dropped as empty."""
        return bool(self.text) and (self.pair is None or bool(self.pair))

    def map(self, fn: Callable[[str], str]) -> Record:
        """The same record with ``fn`` applied to its texts (cleaning); the label is kept as it is."""
        return Record(fn(self.text), None if self.pair is None else fn(self.pair), self.label)


def _text(value: Any) -> str:
    if value is None:
        return ""
    return value if isinstance(value, str) else str(value)


def record(values: Mapping[str, Any], text_field: str, pair_field: str, label_field: str,
           labels: LabelKind = CLASSES) -> Record:
    """A record from a row's values (missing fields give an empty text or no label: dropped and counted); its
    label read as ``labels`` reads a cell (a class name, or a number)."""
    pair = _text(values.get(pair_field)) if pair_field else None
    return Record(_text(values.get(text_field)), pair, labels.read(values.get(label_field)))


def fields(data) -> list[str]:
    """The columns a labelled record reads: the text, the pair's second text, the label."""
    return [data.text_field, *([data.pair_field] if data.pair_field else []), data.label_field]


def ordered(names) -> list[str]:
    """Class names in id order: integers numerically ("2" before "10"), anything else alphabetically."""
    names = sorted(set(names))
    try:
        return sorted(names, key=int)
    except ValueError:
        return names


def windowing(data) -> str:
    """``data.long`` decided: the task's default (truncate a labelled record, window a document), unless set."""
    if data.long != "auto":
        return data.long
    return kind(data).long


def check(data, tokenizer_path: str) -> None:
    """The settings an encoder dataset needs, checked before Spark starts (one line each)."""
    if not tokenizer_path:
        raise SparklmError(f"--task {data.task} needs the encoder's tokenizer (its CLS/SEP conventions)",
                           hint="pass --tokenizer MODEL_DIR: the model you will train, e.g. a BERT directory")
    if data.format != "text":
        raise SparklmError(f"--task {data.task} reads texts (and labels), not --format {data.format} records",
                           hint="drop --format; name the columns with --text-field and --label-field")
    if not labels_of(data).labelled and data.pair_field:
        raise SparklmError("--pair-field is for labelled records", hint=f"drop --pair-field for --task {data.task}")
    if data.pair_field and windowing(data) == "window":
        raise SparklmError("--long window cuts single texts; text pairs are truncated",
                           hint="drop --long window, or prepare single texts")


# -- the stratified split (driver side, on the scan's metadata) ---------------------------------------------------


def validation_count(n: int, fraction: float) -> int:
    """How many of a class's ``n`` records go to validation: the fraction, rounded, and at least one when the class
    has two or more and any fraction is asked for (every class is then scored)."""
    if n < 2 or fraction <= 0:
        return 0
    return min(n - 1, max(1, round(fraction * n)))


def split_key(dig: bytes) -> int:
    """The hash a record's split is decided by (signed 64 bits, as Spark's ``long`` holds it)."""
    return int.from_bytes(dig[8:16], "big", signed=True)


def thresholds(keys_by_label: Mapping[str, list[int]], fraction: float) -> dict[str, int]:
    """Per label, the largest split key that goes to validation (pure: the Spark job computes the same with a
    window; tests compare them)."""
    out = {}
    for label, keys in keys_by_label.items():
        k = validation_count(len(keys), fraction)
        if k:
            out[label] = sorted(keys)[k - 1]
    return out


def stratify(meta, fraction: float):
    """The scan's metadata with ``split`` decided per label for the hash-split records (``auto`` units; explicit
    validation inputs keep theirs): returns (meta, {label: threshold}). Each label's kept records are ranked by
    split key in one window: a class of many millions is sorted in one task, which its small rows afford."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    kept = meta.where(F.col("auto") & (F.col("status") == "ok") & (F.col("copy") == 1))
    # how many of each class go to validation: validation_count's rule, on one small row per class
    take = {r["label"]: validation_count(r["count"], fraction) for r in kept.groupBy("label").count().collect()}
    take = {label: k for label, k in take.items() if k}
    cut = {}
    if take:
        quota = F.create_map(*[F.lit(x) for label, k in take.items() for x in (label, k)])
        ranked = kept.where(F.col("label").isin(list(take))).withColumn(
            "rank", F.row_number().over(Window.partitionBy("label").orderBy("split_key")))
        chosen = ranked.where(F.col("rank") <= F.element_at(quota, F.col("label")))
        cut = {r["label"]: int(r["t"]) for r in chosen.groupBy("label").agg(F.max("split_key").alias("t")).collect()}
    # split_of's rule, with one map of thresholds (a class without one stays in train)
    is_val = F.lit(False)
    if cut:
        limits = F.create_map(*[c for label, t in cut.items() for c in (F.lit(label), F.lit(t).cast("long"))])
        is_val = F.coalesce(F.col("split_key") <= F.element_at(limits, F.col("label")), F.lit(False))
    split = F.when(F.col("auto") & (F.col("status") == "ok"), F.when(is_val, "validation").otherwise("train"))
    return meta.withColumn("split", split.otherwise(F.col("split"))), cut


def split_of(group: str, key: int, label: str | None, cut: Mapping[str, int]) -> str:
    """A record's split on the executors: its unit's group, or validation when its key is within its label's
    threshold (the same rule :func:`stratify` applied on the driver)."""
    if group != "auto":
        return group
    t = cut.get(label)
    return "validation" if t is not None and key <= t else "train"


# -- rows ----------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Encoded:
    """Rows of encoded texts: ``input_ids`` [n, seq_len], ``attention_mask``, ``token_type_ids`` (pairs only),
    ``source``: the index of the text each row came from; ``truncated``: texts cut; ``dropped``: tokens not in any
    row."""

    input_ids: np.ndarray
    attention_mask: np.ndarray
    token_type_ids: np.ndarray | None
    source: np.ndarray
    truncated: int
    dropped: int


def encode(tok, texts: list[str], pairs: list[str] | None, *, seq_len: int, window: bool, overlap: int,
           pad_id: int) -> Encoded:
    """Encode texts (or pairs) with the tokenizer's own special tokens, each truncated to ``seq_len`` or cut into
    windows that overlap by ``overlap`` tokens; padded with ``pad_id``. ``tok`` is a ``tokenizers.Tokenizer``
    (its truncation and padding are set here)."""
    tok.no_padding()
    specials = tok.num_special_tokens_to_add(pairs is not None)
    room = seq_len - specials
    if room < 1:
        raise SparklmError(f"data.seq_len ({seq_len}) leaves no room beside the tokenizer's {specials} special tokens",
                           hint="raise --seq-len")
    tok.enable_truncation(max_length=seq_len, stride=min(overlap, room - 1) if window else 0,
                          strategy="longest_first")
    batch = list(zip(texts, pairs)) if pairs is not None else texts
    encodings = tok.encode_batch_fast(batch, add_special_tokens=True)
    rows, source, truncated, dropped = [], [], 0, 0
    for i, e in enumerate(encodings):
        rest = e.overflowing
        if rest:
            truncated += 1
        parts = [e, *rest] if window else [e]
        if not window:
            dropped += sum(max(0, len(o.ids) - specials) for o in rest)
        rows += parts
        source += [i] * len(parts)
    n = len(rows)
    ids = np.full((n, seq_len), pad_id, dtype=np.int32)
    mask = np.zeros((n, seq_len), dtype=np.int8)
    types = np.zeros((n, seq_len), dtype=np.int8) if pairs is not None else None
    for r, e in enumerate(rows):
        k = min(len(e.ids), seq_len)
        ids[r, :k] = e.ids[:k]
        mask[r, :k] = 1
        if types is not None:
            types[r, :k] = e.type_ids[:k]
    return Encoded(ids, mask, types, np.asarray(source, dtype=np.int64), truncated, dropped)


def schema(pairs: bool, labels: LabelKind) -> pa.Schema:
    cols = [("input_ids", pa.list_(pa.int32())), ("attention_mask", pa.list_(pa.int8()))]
    if pairs:
        cols.append(("token_type_ids", pa.list_(pa.int8())))
    if labels.column is not None:
        cols.append(("labels", pa.type_for_alias(labels.column)))
    cols.append(("doc_id", pa.int64()))
    return pa.schema(cols)


class Writer:
    """Executor side: one split's records (or documents) of a task → one Parquet file of encoder rows, written in
    row groups; the same interface as prepare's packing writer (``add``, ``close``)."""

    def __init__(self, split: str, name: str, staging: str, storage, *, seq_len: int, rows_per_group: int,
                 pad_id: int, window: bool, overlap: int, pairs: bool, labels: LabelKind = NO_LABELS,
                 label_ids: Mapping[str, int] | None = None):
        self.split = split
        self.seq_len, self.rows_per_group, self.pad_id = seq_len, rows_per_group, pad_id
        self.window, self.overlap, self.pairs = window, overlap, pairs
        self.labels, self.label_ids = labels, label_ids  # the labels' kind; class names → ids (classes only)
        self.file = PartFile(staging, storage, f"{split}/{name}", schema(pairs, labels))
        self.pending: list[pa.Table] = []
        self.counts = {"documents": 0, "pad_tokens": 0, "tokens": 0, "truncated": 0, "dropped_tokens": 0}
        self.tally = None  # the labels' figures so far (LabelKind.tally: rows per class id, or a value's moments)

    def add(self, tok, docs: list, ids: list[int]) -> None:
        if not docs:
            return
        labelled = self.labels.labelled
        texts = [d.text if labelled else d for d in docs]
        pairs = [d.pair for d in docs] if self.pairs else None
        enc = encode(tok, texts, pairs, seq_len=self.seq_len, window=self.window, overlap=self.overlap,
                     pad_id=self.pad_id)
        c = self.counts
        c["documents"] += len(docs)
        c["truncated"] += enc.truncated
        c["dropped_tokens"] += enc.dropped
        real = int(enc.attention_mask.sum())
        c["tokens"] += real
        c["pad_tokens"] += enc.attention_mask.size - real
        cols = [list_column(enc.input_ids), list_column(enc.attention_mask)]
        if enc.token_type_ids is not None:
            cols.append(list_column(enc.token_type_ids))
        if labelled:
            values = np.asarray(self.labels.encode([d.label for d in docs], self.label_ids),
                                dtype=self.labels.column)[enc.source]
            self.tally = self.labels.tally(self.tally, values.tolist())
            cols.append(pa.array(values))
        cols.append(pa.array(np.asarray(ids, dtype=np.int64)[enc.source]))
        self.pending.append(pa.Table.from_arrays(cols, schema=self.file.schema))
        self._flush(final=False)

    def close(self) -> dict:
        self._flush(final=True)
        nbytes = self.file.close()
        return {"split": self.split, "path": self.file.path, "bytes": nbytes, "rows": self.file.rows,
                "row_groups": self.file.row_groups, **self.counts,
                "tally": self.tally}

    def _flush(self, final: bool) -> None:
        table = pa.concat_tables(self.pending) if self.pending else None
        self.pending = []
        while table is not None and len(table) and (final or len(table) >= self.rows_per_group):
            take = len(table) if final else self.rows_per_group
            self.file.write(table.slice(0, take))
            table = table.slice(take)
        if table is not None and len(table):
            self.pending = [table]
