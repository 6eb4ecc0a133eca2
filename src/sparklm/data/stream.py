"""Prepared Parquet → shuffled token batches for one rank, from an exact, resumable position.

The global order of training rows is a pure function of ``(seed, epoch)``: row groups are
permuted, cut into windows of ``window`` row groups, and the rows of each window permuted. A
global micro-batch is ``batch_size × world`` consecutive rows of that order; rank ``r`` takes its
``r``-th slice. So N workers see exactly the rows one process would see with an N-times larger
batch, and the position to resume from is one number: the global rows consumed. Memory holds
one window, whatever the dataset's size.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from ..config import StorageConfig
from ..infra.errors import SparklmError
from ..infra.fs import resolve


@dataclass(frozen=True)
class RowGroup:
    path: str
    index: int
    rows: int


def row_groups(files: list[str], storage: StorageConfig | None = None) -> list[RowGroup]:
    """Every row group of the given Parquet files, in file order (metadata only)."""
    out = []
    for uri in files:
        fs, path = resolve(uri, storage)
        try:
            with fs.open_input_file(path) as f:
                meta = pq.ParquetFile(f).metadata
        except Exception as e:  # pyarrow raises ArrowInvalid, OSError, …: a missing, damaged or foreign file
            raise unreadable(uri, e) from None
        out += [RowGroup(uri, i, meta.row_group(i).num_rows) for i in range(meta.num_row_groups)]
    return out


def unreadable(uri: str, e: BaseException) -> SparklmError:
    why = " ".join(str(e).split())[:200]
    return SparklmError(f"cannot read {uri}: {why} (a damaged or truncated Parquet file)",
                        hint="prepare the dataset again (`sparklm prepare … --overwrite`)")


class Rows(NamedTuple):
    """Rows of a prepared split: ``input_ids`` [rows, seq_len] int64; ``attention_mask`` [rows, seq_len] int8,
    None when nothing is padded; ``loss_mask`` [rows, seq_len] int8, 1 where predicting the token counts in
    the loss (instruction data), None when every real token does; an encoder dataset's ``labels`` [rows] int64
    (classify: the class ids) and ``token_type_ids`` [rows, seq_len] int8 (text pairs)."""

    input_ids: np.ndarray
    attention_mask: np.ndarray | None = None
    loss_mask: np.ndarray | None = None
    labels: np.ndarray | None = None
    token_type_ids: np.ndarray | None = None

    def take(self, index) -> Rows:
        """The rows at ``index`` (a slice, a boolean mask or positions) of every array."""
        return Rows(*(None if a is None else a[index] for a in self))


def to_numpy(values: pa.Array, dtype) -> np.ndarray:
    """An Arrow array's values as a new numpy array of ``dtype``. Integers without nulls (what prepare writes) are
    read from the values buffer: pyarrow's own conversion imports pandas, 0.25 s before a new rank's first batch."""
    if pa.types.is_integer(values.type) and values.null_count == 0:
        width = values.type.byte_width
        kind = "i" if pa.types.is_signed_integer(values.type) else "u"
        raw = np.frombuffer(values.buffers()[1], dtype=f"={kind}{width}", count=len(values),
                            offset=values.offset * width)
        return raw.astype(dtype)
    return np.asarray(values, dtype=dtype)


def read_rows(group: RowGroup, seq_len: int, storage: StorageConfig | None = None) -> Rows:
    """The rows of one row group."""
    fs, path = resolve(group.path, storage)
    try:
        with fs.open_input_file(path) as f:
            pf = pq.ParquetFile(f, page_checksum_verification=True)
            names = [n for n in Rows._fields if n in pf.schema_arrow.names]
            table = pf.read_row_group(group.index, columns=names)
    except Exception as e:
        raise unreadable(group.path, e) from None

    def column(name: str, dtype) -> np.ndarray | None:
        if name not in names:
            return None
        return to_numpy(table.column(name).combine_chunks().flatten(), dtype).reshape(-1, seq_len)

    labels = None
    if "labels" in names:  # class ids, or target values (float32)
        col = table.column("labels").combine_chunks()
        labels = to_numpy(col, np.float32 if pa.types.is_floating(col.type) else np.int64)
    return Rows(column("input_ids", np.int64), column("attention_mask", np.int8), column("loss_mask", np.int8),
                labels, column("token_type_ids", np.int8))


class TokenStream:
    """Micro-batches of one rank, starting at global row ``start`` (a multiple of batch × world)."""

    def __init__(self, groups: list[RowGroup], *, seq_len: int, batch_size: int, rank: int = 0, world: int = 1,
                 seed: int = 0, window: int = 8, start: int = 0, storage: StorageConfig | None = None):
        if not groups or sum(g.rows for g in groups) == 0:
            raise ValueError("no rows to stream")
        self.groups, self.seq_len, self.batch, self.rank, self.world = groups, seq_len, batch_size, rank, world
        self.seed, self.window, self.start, self.storage = seed, window, start, storage
        self.rows_per_epoch = sum(g.rows for g in groups)

    def windows(self, epoch: int) -> list[list[RowGroup]]:
        order = np.random.default_rng([self.seed, epoch]).permutation(len(self.groups))
        return [[self.groups[i] for i in order[k:k + self.window]] for k in range(0, len(order), self.window)]

    def __iter__(self) -> Iterator[Rows]:
        global_batch = self.batch * self.world
        lo = self.rank * self.batch
        rest: Rows | None = None  # this rank's rows not yet yielded
        epoch = self.start // self.rows_per_epoch
        base = epoch * self.rows_per_epoch  # global position of the next window's first row
        while True:
            for w, window in enumerate(self.windows(epoch)):
                n = sum(g.rows for g in window)
                if base + n <= self.start:  # wholly before the resume point: skip without reading
                    base += n
                    continue
                parts = [read_rows(g, self.seq_len, self.storage) for g in window]
                perm = np.random.default_rng([self.seed, epoch, w]).permutation(n)
                pos = base + np.arange(n)
                slot = pos % global_batch
                mine = perm[(slot >= lo) & (slot < lo + self.batch) & (pos >= self.start)]
                rows = _concat(([] if rest is None else [rest]) + [_concat(parts).take(mine)])
                base += n
                k = 0
                while len(rows.input_ids) - k >= self.batch:  # yield views; copy the short rest once per window
                    yield rows.take(slice(k, k + self.batch))
                    k += self.batch
                rest = Rows(*(None if a is None else a[k:].copy() for a in rows))
            epoch += 1


def _concat(parts: list[Rows]) -> Rows:
    return Rows(*(None if arrays[0] is None else np.concatenate(arrays) for arrays in zip(*parts)))


def validation_rows(groups: list[RowGroup], *, seq_len: int, rank: int, world: int, limit: int | None,
                    storage: StorageConfig | None = None) -> Iterator[Rows]:
    """Validation rows of one rank in file order (row i goes to rank i mod world), up to ``limit`` rows."""
    index = 0
    taken = 0
    for g in groups:
        rows = read_rows(g, seq_len, storage)
        n = len(rows.input_ids)
        rows = rows.take((np.arange(index, index + n) % world) == rank)
        index += n
        if limit is not None:
            rows = rows.take(slice(0, limit - taken))
        taken += len(rows.input_ids)
        if len(rows.input_ids):
            yield rows
        if limit is not None and taken >= limit:
            return
