"""Checks of a user's DataFrame shared by the transformations that add columns to it (generation, classification,
embedding): one line naming the column and the fix, before any job runs."""

from __future__ import annotations

from ..infra.errors import SparklmError


def check_columns(df, text_col: str, flag: str, added: list, adder: str) -> None:
    """One line unless ``df`` has a string column ``text_col`` (named by the argument ``flag``) and none of the
    ``added`` fields (StructFields) that ``adder`` appends."""
    from pyspark.sql import types as T

    fields = {f.name: f.dataType for f in df.schema.fields}
    if text_col not in fields:
        raise SparklmError(f"the DataFrame has no column {text_col!r} (columns: {', '.join(df.columns) or 'none'})",
                           hint=f"name the column with {flag}=")
    if not isinstance(fields[text_col], T.StringType):
        raise SparklmError(f"column {text_col!r} holds {fields[text_col].simpleString()}, not text",
                           hint=f"cast it: df.withColumn({text_col!r}, F.col({text_col!r}).cast('string'))")
    clash = [f.name for f in added if f.name in fields]
    if clash:
        raise SparklmError(f"the DataFrame already has column(s) {', '.join(map(repr, clash))}, which {adder} adds",
                           hint="rename or drop them, or choose other output column names")


def field_type(df, name: str):
    """The Spark type of column ``name`` of ``df``, or None. A dotted name is a field inside struct columns, as
    ``col("meta.body")`` reads it, unless a column has that very name."""
    from pyspark.sql import types as T

    if name in df.columns:
        return df.schema[name].dataType
    kind = T.StructType(df.schema.fields)
    for part in name.split("."):
        if not isinstance(kind, T.StructType) or part not in kind.fieldNames():
            return None
        kind = kind[part].dataType
    return kind


def field_column(df, name: str):
    """The Column of :func:`field_type`'s ``name``, named ``name``."""
    from pyspark.sql import functions as F

    return (F.col(f"`{name}`") if name in df.columns else F.col(name)).alias(name)
