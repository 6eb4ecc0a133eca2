"""Batch generation over a Spark DataFrame of prompts: the model is loaded once per Python worker.

``generate_dataframe`` is a lazy DataFrame transformation for notebook users; ``read_prompts`` and
``write_generations`` are what ``sparklm generate --input/--output`` wraps around it.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..cache import process_local
from ..config import StorageConfig
from ..errors import SparklmError
from ..fs import effective, write_bytes
from .sampling import Sampling

OUTPUT_SCHEMA = "id long, sample int, prompt string, text string, prompt_tokens int, new_tokens int, truncated boolean"
OUTPUT_COLUMNS = [c.split()[0] for c in OUTPUT_SCHEMA.split(", ")]


def generate_dataframe(df, *, model: str, prompt_col: str = "prompt", id_col: str = "id",
                       sampling: Sampling = Sampling(), batch_size: int = 8, threads: int = 0,
                       storage: StorageConfig | None = None):
    """One output row per (prompt, sample): ``id, sample, prompt, text, prompt_tokens, new_tokens, truncated``.

    ``model`` is a sparklm run directory or an HF model directory on an object store (each executor copies it
    once into its cache) or on a path every executor can read.
    Ids must be integers; each row's text depends only on (seed, id, sample), so the result does not
    depend on partitioning, batching or retries.
    """
    from pyspark.sql import functions as F

    for name in (prompt_col, id_col):
        if name not in df.columns:
            raise SparklmError(f"the prompts have no column {name!r} (columns: {', '.join(df.columns)})",
                               hint="name the prompt and id columns with prompt_col= / id_col=")
    from .generate import model_uri

    storage = effective(storage or StorageConfig())
    model_path = model_uri(model, storage)

    def run(frames):
        import pandas as pd

        from .generate import generate, load

        lm = process_local(("model", model_path, threads), lambda: load(model_path, threads=threads, storage=storage))
        for frame in frames:
            if frame.empty:
                continue
            gens = generate(lm, [str(p) for p in frame["prompt"]], keys=[int(i) for i in frame["id"]],
                            sampling=sampling, batch_size=batch_size, warn=False)
            yield pd.DataFrame([g.record() for g in gens], columns=OUTPUT_COLUMNS)

    prompts = df.select(F.col(id_col).cast("long").alias("id"), F.col(prompt_col).cast("string").alias("prompt"))
    return prompts.mapInPandas(run, OUTPUT_SCHEMA)


def read_prompts(path: str, *, field: str = "prompt") -> list[tuple[int, str]]:
    """(id, prompt) pairs from .txt (one prompt per non-empty line), .jsonl or .parquet (``id`` optional)."""
    p = Path(path)
    if not p.is_file():
        raise SparklmError(f"prompt file {path} not found", hint="pass a .txt, .jsonl or .parquet file")
    name = p.name.lower()
    rows: list[tuple[int, str]] = []
    if name.endswith(".parquet"):
        import pyarrow.parquet as pq

        try:
            table = pq.read_table(p)
        except Exception as e:
            raise SparklmError(f"cannot read {path}: {' '.join(str(e).split())[:200]}") from None
        col = field if field in table.column_names else "text" if "text" in table.column_names else None
        if col is None:
            raise SparklmError(f"{path} has no {field!r} or 'text' column", hint="name the prompt column 'prompt'")
        ids = table.column("id").to_pylist() if "id" in table.column_names else range(table.num_rows)
        rows = [(int(i), str(t)) for i, t in zip(ids, table.column(col).to_pylist())]
    elif name.endswith((".jsonl", ".ndjson")):
        with open(p, encoding="utf-8", errors="replace") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                    text = record[field] if field in record else record["text"]
                    rows.append((int(record.get("id", len(rows))), str(text)))
                except (ValueError, KeyError, TypeError, AttributeError):
                    raise SparklmError(f"{path} line {n}: not a JSON object with a {field!r} (or 'text') field",
                                       hint='one object per line, e.g. {"id": 1, "prompt": "Once upon a time"}') from None
    else:
        with open(p, encoding="utf-8", errors="replace") as f:
            rows = [(i, line.rstrip("\r\n")) for i, line in enumerate(x for x in f if x.strip())]
    if not rows:
        raise SparklmError(f"{path} holds no prompts")
    ids = [i for i, _ in rows]
    if len(set(ids)) != len(ids):
        raise SparklmError(f"{path} repeats prompt ids", hint="give every prompt a distinct integer id")
    for i, text in rows:
        if not text.strip():
            raise SparklmError(f"{path}: prompt {i} is empty", hint="remove it or give it text")
    return rows


def check_output(output: str, overwrite: bool) -> None:
    """A results file may replace an existing file only with ``overwrite``; never a directory."""
    out = Path(output)
    if not out.name.lower().endswith((".parquet", ".jsonl")):
        raise SparklmError(f"--output {output}: use a .parquet or .jsonl file name")
    if out.is_dir():
        raise SparklmError(f"--output {output} is a directory", hint="name a .jsonl or .parquet file")
    if out.exists() and not overwrite:
        raise SparklmError(f"{output} already exists", hint="pass --overwrite to replace it, or another --output")


def write_generations(rows: list[dict], output: str) -> None:
    """Write results to .parquet or .jsonl atomically (a hidden temporary file, then a rename)."""
    out = Path(output)
    if not out.name.lower().endswith((".parquet", ".jsonl")):
        raise SparklmError(f"--output {output}: use a .parquet or .jsonl file name")
    if out.name.lower().endswith(".parquet"):
        import pyarrow as pa
        import pyarrow.parquet as pq

        buf = pa.BufferOutputStream()
        pq.write_table(pa.Table.from_pylist(rows), buf)
        data = buf.getvalue().to_pybytes()
    else:
        data = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode("utf-8")
    write_bytes(str(out), data)
