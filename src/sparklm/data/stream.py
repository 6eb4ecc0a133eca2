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

import numpy as np
import pyarrow.parquet as pq

from ..config import StorageConfig
from ..errors import SparklmError
from ..fs import resolve


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


def read_rows(group: RowGroup, seq_len: int, storage: StorageConfig | None = None) -> tuple[np.ndarray, np.ndarray | None]:
    """(input_ids [rows, seq_len] int64, attention_mask [rows, seq_len] int8 or None) of one row group."""
    fs, path = resolve(group.path, storage)
    try:
        with fs.open_input_file(path) as f:
            pf = pq.ParquetFile(f, page_checksum_verification=True)
            names = [n for n in ("input_ids", "attention_mask") if n in pf.schema_arrow.names]
            table = pf.read_row_group(group.index, columns=names)
    except Exception as e:
        raise unreadable(group.path, e) from None
    ids = np.asarray(table.column("input_ids").combine_chunks().flatten(), dtype=np.int64).reshape(-1, seq_len)
    mask = None
    if "attention_mask" in names:
        mask = np.asarray(table.column("attention_mask").combine_chunks().flatten(), dtype=np.int8).reshape(-1, seq_len)
    return ids, mask


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

    def __iter__(self) -> Iterator[tuple[np.ndarray, np.ndarray | None]]:
        global_batch = self.batch * self.world
        lo = self.rank * self.batch
        ids = np.zeros((0, self.seq_len), np.int64)  # this rank's rows not yet yielded
        masks: np.ndarray | None = None
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
                ids = np.concatenate([ids, np.concatenate([p[0] for p in parts])[mine]])
                if parts[0][1] is not None:
                    new = np.concatenate([p[1] for p in parts])[mine]
                    masks = new if masks is None else np.concatenate([masks, new])
                base += n
                k = 0
                while len(ids) - k >= self.batch:  # yield views; copy the short rest once per window
                    yield ids[k:k + self.batch], None if masks is None else masks[k:k + self.batch]
                    k += self.batch
                ids = ids[k:].copy()
                masks = None if masks is None else masks[k:].copy()
            epoch += 1


def validation_rows(groups: list[RowGroup], *, seq_len: int, rank: int, world: int, limit: int | None,
                    storage: StorageConfig | None = None) -> Iterator[tuple[np.ndarray, np.ndarray | None]]:
    """Validation rows of one rank in file order (row i goes to rank i mod world), up to ``limit`` rows."""
    index = 0
    taken = 0
    for g in groups:
        ids, mask = read_rows(g, seq_len, storage)
        pick = (np.arange(index, index + len(ids)) % world) == rank
        index += len(ids)
        ids = ids[pick]
        mask = None if mask is None else mask[pick]
        if limit is not None and taken + len(ids) > limit:
            ids = ids[: limit - taken]
            mask = None if mask is None else mask[: limit - taken]
        taken += len(ids)
        if len(ids):
            yield ids, mask
        if limit is not None and taken >= limit:
            return
