"""Delta Lake tables as inputs, without Spark's Delta jars: the ``deltalake`` package (delta-rs) reads the table's
transaction log and names the Parquet files of its current version, which sparklm reads as any Parquet input.

A Delta directory also holds files that later versions removed (until VACUUM), so it must never be read as plain
files; tables whose rows cannot be read from their files alone (deletion vectors, column mapping) are refused with
the way out (Spark's own Delta reader, then the DataFrame).
"""

from __future__ import annotations

from urllib.parse import urlparse

from ..config import StorageConfig
from ..infra.errors import SparklmError
from ..infra.fs import exists, join, storage_hint

LOG = "_delta_log"


def is_table(uri: str, storage: StorageConfig) -> bool:
    """``uri`` is a Delta table's root directory (it holds ``_delta_log/``)."""
    return "*" not in uri and "?" not in uri and exists(join(uri, LOG), storage)


def storage_options(uri: str, storage: StorageConfig) -> dict[str, str]:
    """delta-rs' object-store settings for ``uri``: the endpoint and region sparklm uses (credentials come from the
    environment, as for every other read)."""
    if not uri.startswith(("s3://", "s3a://", "s3n://")):
        return {}
    options = {"AWS_REGION": storage.region or "us-east-1"}
    if storage.endpoint_url:
        options["AWS_ENDPOINT_URL"] = storage.endpoint_url
        if urlparse(storage.endpoint_url).scheme == "http":
            options["AWS_ALLOW_HTTP"] = "true"
    if storage.anonymous:
        options["AWS_SKIP_SIGNATURE"] = "true"
    return options


def current_files(uri: str, storage: StorageConfig) -> tuple[int, list[str]]:
    """(version, URIs of the Parquet files that make up the table's current version)."""
    try:
        from deltalake import DeltaTable
    except ImportError:
        raise SparklmError(f"{uri} is a Delta table; reading one needs the deltalake package",
                           hint="pip install 'sparklm[delta]'") from None
    table_uri = "s3://" + uri.split("://", 1)[1] if uri.startswith(("s3a://", "s3n://")) else uri
    try:
        table = DeltaTable(table_uri, storage_options=storage_options(uri, storage))
        protocol, config = table.protocol(), table.metadata().configuration
        files = table.file_uris()
    except Exception as e:  # delta-rs raises its own errors, and OSError for storage
        raise SparklmError(f"cannot read the Delta table {uri}: {' '.join(str(e).split())[:300]}",
                           hint=storage_hint(uri)) from None
    unsupported = sorted({"deletionVectors", "columnMapping"} & set(protocol.reader_features or []))
    if config.get("delta.columnMapping.mode", "none") != "none" and "columnMapping" not in unsupported:
        unsupported.append("columnMapping")
    if unsupported:
        raise SparklmError(f"the Delta table {uri} uses {' and '.join(unsupported)}: its rows cannot be read from "
                           "its Parquet files alone", hint="read it with Spark's Delta reader and pass the DataFrame: "
                           "sparklm.prepare(spark.read.format('delta').load(...), ...)")
    if uri.startswith(("s3a://", "s3n://")):  # keep the scheme the user gave
        files = [uri.split("://", 1)[0] + "://" + f.split("://", 1)[1] if f.startswith("s3://") else f for f in files]
    return table.version(), files
