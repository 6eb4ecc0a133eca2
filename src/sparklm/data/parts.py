"""One split's Parquet part file, as a prepare task writes it into the staging directory (local or an object
store): opened with its first row group, so a task with nothing for a split leaves no file; page checksums
(CRC32), so a damaged file fails its read with a clear error instead of training on garbage. Both kinds of
rows use it: packed token streams (prepare.py) and encoder rows (labelled.py)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from ..config import StorageConfig
from ..infra.fs import resolve


def list_column(a: np.ndarray) -> pa.Array:
    """A [rows, width] array as an Arrow list column (one list of ``width`` values per row)."""
    offsets = np.arange(0, a.size + 1, a.shape[1], dtype=np.int32)
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(a.reshape(-1)))


class PartFile:
    """``split/part-….parquet`` under ``staging``, written a row group at a time; ``close`` returns its size."""

    def __init__(self, staging: str, storage: StorageConfig | None, name: str, schema: pa.Schema):
        self.staging, self.storage, self.name, self.schema = staging, storage, name, schema
        self.writer = self.sink = None
        self.rows = self.row_groups = 0

    @property
    def path(self) -> str:
        """Its name inside the staging directory, or "" when nothing was written."""
        return self.name if self.writer is not None else ""

    def write(self, table: pa.Table) -> None:
        """``table`` as one row group."""
        if self.writer is None:
            fs, staging = resolve(self.staging, self.storage)
            fs.create_dir(f"{staging}/{self.name.rsplit('/', 1)[0]}", recursive=True)
            self.sink = fs.open_output_stream(f"{staging}/{self.name}")
            self.writer = pq.ParquetWriter(self.sink, self.schema, compression="zstd", write_page_checksum=True)
        self.writer.write_table(table, row_group_size=len(table))
        self.rows += len(table)
        self.row_groups += 1

    def close(self) -> int:
        """Finish the file (an object-store upload completes here); its bytes, 0 when nothing was written."""
        if self.writer is None:
            return 0
        self.writer.close()
        nbytes = self.sink.tell()
        self.sink.close()
        return nbytes
