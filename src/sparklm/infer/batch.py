"""Batch generation over a Spark DataFrame of prompts: the model is loaded once per Python worker.

``generate_dataframe`` is a lazy DataFrame transformation for notebook users; ``read_prompts`` and
``write_generations`` are what ``sparklm generate --input/--output`` wraps around it.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..config import StorageConfig
from ..data.clean import BINARY_SNIFF_BYTES, looks_binary
from ..infra.cache import process_local
from ..infra.errors import SparklmError
from ..infra.fs import effective, version, write_bytes
from ..spark.frames import check_columns
from ..spark.resources import check_batching, task_device
from ..spark.session import check_workers_python
from .sampling import Sampling

OUTPUT_SCHEMA = "id long, sample int, prompt string, text string, prompt_tokens int, new_tokens int, truncated boolean"
OUTPUT_COLUMNS = [c.split()[0] for c in OUTPUT_SCHEMA.split(", ")]


def row_key(id_value, prompt: str | None) -> int:
    """The integer that seeds a row's generators: an integer id itself (as ``sparklm generate --input`` keys its
    prompts), any other id by a stable hash of its text, no id by the prompt's. It depends on the row only, so the
    result does not depend on partitioning, batching or retries."""
    if isinstance(id_value, int) and not isinstance(id_value, bool):
        return id_value
    import hashlib

    material = prompt if id_value is None else id_value if isinstance(id_value, (str, bytes)) else repr(id_value)
    if isinstance(material, str):
        material = material.encode("utf-8", "surrogatepass")
    return int.from_bytes(hashlib.blake2b(material or b"", digest_size=8).digest(), "big") >> 1


def generate_dataframe(df, *, model: str, prompt_col: str = "prompt", id_col: str | None = None,
                       output_col: str = "generated", sampling: Sampling = Sampling(), batch_size: int = 8,
                       threads: int = 0, storage: StorageConfig | None = None, backend: str = "torch",
                       quantize: str = "none"):
    """``df`` with its columns kept and, per row and sample: ``sample``, ``output_col`` (the continuation),
    ``prompt_tokens``, ``new_tokens`` and ``truncated``; ``sampling.num_samples`` rows per input row.

    ``model`` is a sparklm run directory or an HF model directory on an object store (each executor copies it
    once into its cache) or on a path every executor can read. Each output row draws from its own generator
    seeded by (seed, the row's key, sample): the key is ``id_col``'s value (any type; by default the ``id``
    column if there is one), else the prompt, so the result does not depend on partitioning, batching or
    retries. A null or blank prompt gets a null continuation. Lazy: nothing runs until an action.

    ``backend="llama.cpp"`` decodes on each executor's CPU with llama.cpp (``quantize`` none, f16, bf16, q8_0, q4_0 or
    q4_1; each host exports the model to GGUF once, into its cache); "torch" (``quantize`` none, bf16, int8 or int4) runs
    on the GPU Spark assigns a task, if any (int8 and int4 on the CPU). Seeds give the same rows on either backend
    where the weights are the same.
    """
    from pyspark.sql import types as T

    from .generate import model_uri

    fields = {f.name: f.dataType for f in df.schema.fields}
    if id_col is not None and id_col not in fields:
        raise SparklmError(f"the DataFrame has no column {id_col!r} (columns: {', '.join(df.columns) or 'none'})",
                           hint="name the id column with id_col=, or leave it out to key rows by their prompt")
    id_col = id_col if id_col is not None else "id" if "id" in fields else None
    added = [T.StructField("sample", T.IntegerType()), T.StructField(output_col, T.StringType()),
             T.StructField("prompt_tokens", T.IntegerType()), T.StructField("new_tokens", T.IntegerType()),
             T.StructField("truncated", T.BooleanType())]
    check_columns(df, prompt_col, "prompt_col", added, "generate_dataframe")
    check_batching(batch_size, threads)
    if backend not in ("torch", "llama.cpp"):
        raise SparklmError(f"backend {backend!r}: generate_dataframe runs on torch or llama.cpp")
    from .backends import check_quantize

    check_quantize(backend, quantize)  # a bad value fails here, not in every task
    check_workers_python(df.sparkSession)
    storage = effective(storage or StorageConfig())
    model_path = model_uri(model, storage)  # a missing model fails here, not in a task
    context = _context(model_path, storage)
    sampling = sampling.fitted(context)  # a default fits the model; a value the user chose may not
    if context and sampling.max_new_tokens >= context:  # else every task would fail with it
        raise SparklmError(f"max_new_tokens {sampling.max_new_tokens} does not fit the model's context of {context} "
                           "tokens", hint=f"use at most {context - 1}")
    samples = sampling.num_samples

    def run(batches):
        import pyarrow as pa

        from . import backends
        from .generate import generate

        where = "cpu" if backend == "llama.cpp" else task_device()  # the GPU Spark handed this task, if any
        lm = process_local(("model", model_path, version(model_path, storage), threads, where, backend, quantize,
                            batch_size),
                           lambda: backends.load(model_path, backend=backend, quantize=quantize, threads=threads,
                                                storage=storage, device=where, batch_size=batch_size))
        for rb in batches:
            prompts = rb.column(prompt_col).to_pylist()
            ids = rb.column(id_col).to_pylist() if id_col else [None] * rb.num_rows
            todo = [i for i, p in enumerate(prompts) if p is not None and p.strip()]
            gens = generate(lm, [prompts[i] for i in todo], keys=[row_key(ids[i], prompts[i]) for i in todo],
                            sampling=sampling, batch_size=batch_size, warn=False) if todo else []
            done = {(todo[j // samples], g.sample): g for j, g in enumerate(gens)}
            out = [(i, s, done.get((i, s))) for i in range(rb.num_rows) for s in range(samples)]
            table = rb.take(pa.array([i for i, _, _ in out], pa.int64()))
            extra = {"sample": pa.array([s for _, s, _ in out], pa.int32()),
                     output_col: pa.array([g.text if g else None for *_, g in out], pa.string()),
                     "prompt_tokens": pa.array([g.prompt_tokens if g else 0 for *_, g in out], pa.int32()),
                     "new_tokens": pa.array([len(g.token_ids) if g else 0 for *_, g in out], pa.int32()),
                     "truncated": pa.array([g.truncated if g else False for *_, g in out], pa.bool_())}
            yield pa.RecordBatch.from_arrays([*table.columns, *extra.values()], [*table.schema.names, *extra])

    return df.mapInArrow(run, T.StructType([*df.schema.fields, *added]))


def _context(model_path: str, storage: StorageConfig) -> int | None:
    """The context length a model directory's config.json gives (None for an adapter's, or an unreadable one)."""
    from ..infra.fs import join, read_text
    from ..model.build import context_length

    try:
        return context_length(json.loads(read_text(join(model_path, "config.json"), storage)))
    except (OSError, ValueError, SparklmError):  # an adapter has no config.json: its base's context applies
        return None


def read_prompts(path: str, *, field: str = "prompt", storage: StorageConfig | None = None) -> list[tuple[int, str]]:
    """(id, prompt) pairs from .txt (one prompt per non-empty line), .jsonl or .json (a record a line, or one array
    of records), .csv/.tsv (a header row) or .parquet: each record's ``field`` (else ``text``) and optional ``id``;
    local or on an object store, compressed as ``prepare`` reads it."""
    import pyarrow as pa

    from ..data.sources import detect_format, open_stream
    from ..infra.fs import resolve, storage_hint

    fmt, compression = detect_format(path)
    try:
        fs, where = resolve(path, storage)
        if fs.get_file_info(where).type != pa.fs.FileType.File:
            raise SparklmError(f"prompt file {path} not found",
                               hint="pass a .txt, .jsonl, .json, .csv or .parquet file")
        with open_stream(fs, where, compression) as f:
            data = f.read()
        if fmt != "parquet" and looks_binary(data[:BINARY_SNIFF_BYTES], "utf-8"):  # a model or archive by mistake
            raise SparklmError(f"{path} looks binary, not text",
                               hint="pass a UTF-8 .txt file (one prompt per line), a .jsonl, .json, .csv or "
                                    ".parquet file")
        rows = _prompt_rows(path, fmt, data, field)
    except SparklmError:
        raise
    except (OSError, ValueError, EOFError, pa.ArrowException) as e:
        raise SparklmError(f"cannot read {path}: {' '.join(str(e).split())[:200]}", hint=storage_hint(path)) from None
    if not rows:
        raise SparklmError(f"{path} holds no prompts")
    ids = [i for i, _ in rows]
    if len(set(ids)) != len(ids):
        raise SparklmError(f"{path} repeats prompt ids", hint="give every prompt a distinct integer id")
    for i, text in rows:
        if not text.strip():
            raise SparklmError(f"{path}: prompt {i} is empty", hint="remove it or give it text")
    return rows


def _prompt_rows(path: str, fmt: str, data: bytes, field: str) -> list[tuple[int, str]]:
    """The (id, prompt) pairs of a prompt file's bytes, by its format."""
    import csv
    import io

    from ..data.sources import json_array

    if fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        table = pq.read_table(pa.BufferReader(data))
        col = field if field in table.column_names else "text" if "text" in table.column_names else None
        if col is None:
            raise SparklmError(f"{path} has no {field!r} or 'text' column (columns: {', '.join(table.column_names)})",
                               hint="name the prompt's column with --prompt-field")
        ids = table.column("id").to_pylist() if "id" in table.column_names else range(table.num_rows)
        return [(int(i), str(t)) for i, t in zip(ids, table.column(col).to_pylist())]
    text = data.decode("utf-8-sig", errors="replace")
    if fmt in ("csv", "tsv"):
        reader = csv.DictReader(io.StringIO(text, newline=""), delimiter="\t" if fmt == "tsv" else ",")
        columns = [c.strip() for c in reader.fieldnames or []]
        if field not in columns and "text" not in columns:
            raise SparklmError(f"{path} has no {field!r} or 'text' column (columns: {', '.join(columns)})",
                               hint="name the prompt's column with --prompt-field")
        return [_prompt(path, f"row {n}", {k.strip(): v for k, v in r.items() if k}, field, n - 1)
                for n, r in enumerate(reader, 1)]
    if fmt == "jsonl":
        if text.lstrip().startswith("["):
            return [_prompt(path, f"record {n + 1}", r, field, n) for n, r in json_array(io.StringIO(text))]
        lines = [(n, line) for n, line in enumerate(text.splitlines(), 1) if line.strip()]
        return [_prompt(path, f"line {n}", _json(line), field, k) for k, (n, line) in enumerate(lines)]
    return list(enumerate(line.rstrip("\r\n") for line in text.splitlines() if line.strip()))


def _json(line: str):
    try:
        return json.loads(line)
    except ValueError:
        return None


def _prompt(path: str, where: str, record, field: str, n: int) -> tuple[int, str]:
    """One record's (id, prompt): its ``field`` (else ``text``) and its ``id`` (else its position)."""
    if not isinstance(record, dict) or (field not in record and "text" not in record):
        raise SparklmError(f"{path} {where}: not a JSON object with a {field!r} (or 'text') field",
                           hint="name the prompt's field with --prompt-field (its fields: "
                                f"{', '.join(map(str, list(record)[:20]))})" if isinstance(record, dict) else
                                'one object per record, e.g. {"id": 1, "prompt": "Once upon a time"}')
    try:
        pid = int(record.get("id", n))
    except (TypeError, ValueError):
        raise SparklmError(f"{path} {where}: its id {record['id']!r} is not an integer") from None
    text = record[field] if field in record else record["text"]
    return pid, "" if text is None else str(text)  # a null prompt is empty (refused below), not the text "None"


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
