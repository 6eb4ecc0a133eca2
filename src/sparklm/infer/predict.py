"""``sparklm predict``: score a table of texts with an encoder on Spark and write the rows back with the answers.

The input is read by Spark's own readers (CSV/TSV with a header row, JSON lines, Parquet; any path Spark reads),
scored by :func:`encode.classify_dataframe` or :func:`encode.embed_dataframe` (every input column kept), and
written by Spark as Parquet into a hidden sibling of ``--output`` that replaces it only once complete; a
``_sparklm_predict.json`` inside says what was written (so ``--overwrite`` replaces only an earlier prediction).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pyarrow.fs as pafs

from ..infra import redact
from ..infra.errors import SparklmError, spark_errors
from ..infra.fs import check_replaceable, listing, staging_path, swap_in

MARKER = "_sparklm_predict.json"  # "_": Spark and pyarrow readers of the directory skip it
FORMATS = {".csv": "csv", ".tsv": "tsv", ".json": "json", ".jsonl": "json", ".parquet": "parquet"}


def input_format(paths: list[str], given: str = "auto") -> str:
    """The reader for ``paths``: ``given``, or their common extension (a directory: Parquet, as Spark writes)."""
    if given != "auto":
        return given
    kinds = set()
    for p in paths:
        name = p.rstrip("/").lower().removesuffix(".gz")
        suffix = Path(name).suffix
        kinds.add(FORMATS.get(suffix, "parquet" if not suffix else "?"))
    if len(kinds) != 1 or "?" in kinds:
        raise SparklmError(f"cannot tell the format of {', '.join(paths)} from the extension(s)",
                           hint="use .csv, .tsv, .jsonl or .parquet files (one kind), or pass --input-format")
    return kinds.pop()


def read(spark, paths: list[str], fmt: str):
    if fmt in ("csv", "tsv"):
        return spark.read.csv(paths, header=True, sep="\t" if fmt == "tsv" else ",", multiLine=True, escape='"')
    if fmt != "json":
        return spark.read.parquet(paths)
    lines, arrays = _json_layouts(paths)
    # a pretty-printed array needs Spark's multiLine, which would read a JSON Lines file's first record only
    frames = [*([spark.read.json(lines)] if lines else []),
              *([spark.read.json(arrays, multiLine=True)] if arrays else [])]
    df = frames[0] if len(frames) == 1 else frames[0].unionByName(frames[1], allowMissingColumns=True)
    if df.columns == ["_corrupt_record"]:
        raise SparklmError(f"{', '.join(paths)}: no line or array of JSON objects Spark could read",
                           hint="one JSON object per line (JSON Lines), or one array of objects per file")
    return df


def _text_column(df, text_col: str, inputs: list[str]):
    """``df`` with ``text_col`` as a column of its own: a field inside a struct (``meta.body``, as ``--text-field``
    names it) is copied out under that name; one that is not there at all is one line naming the flag."""
    from ..spark.frames import field_column, field_type

    if text_col in df.columns:
        return df
    if field_type(df, text_col) is None:
        raise SparklmError(f"{', '.join(inputs)} has no column {text_col!r} (columns: {', '.join(df.columns)})",
                           hint="name the text's column with --text-field (a field inside one: meta.body)")
    return df.withColumn(text_col, field_column(df, text_col))


def _json_layouts(paths: list[str]) -> tuple[list[str], list[str]]:
    """The JSON files behind ``paths`` as (JSON Lines, files holding one array); a path this process cannot list
    (one only Spark reads) goes to Spark as JSON Lines, as before."""
    from ..data.sources import is_json_array
    from ..infra.fs import expand, uri_like

    lines, arrays = [], []
    for p in paths:
        try:
            files = [uri_like(p, i.path) for i in expand(p)]
        except SparklmError:
            lines.append(p)
            continue
        for f in files:
            (arrays if is_json_array(f) else lines).append(f)
    return lines, arrays


def predict(spark, model: str, inputs: list[str], output: str, *, text_col: str = "text", embed: bool = False,
            pooling: str = "mean", normalize: bool = False, probabilities: bool = False, input_format_: str = "auto",
            batch_size: int = 32, threads: int = 0, overwrite: bool = False, storage=None,
            label_field: str | None = None) -> dict:
    """Score ``inputs`` and write ``output`` (a Parquet directory); returns what ``_sparklm_predict.json`` says.
    ``label_field``: a column of true labels, scored against (accuracy) after a check that the model knows them."""
    from .encode import classify_dataframe, embed_dataframe

    out = Path(output).expanduser().resolve()
    check_output(out, overwrite)
    fmt = input_format(inputs, input_format_)
    started = time.time()
    with spark_errors():
        try:
            df = read(spark, inputs, fmt)
        except Exception as e:  # AnalysisException: a path that does not exist, an unreadable file
            raise SparklmError(f"cannot read {', '.join(inputs)} as {fmt}: {_first_line(e)}",
                               hint="check the paths, or pass --input-format") from None
        df = _text_column(df, text_col, inputs)
        values = not embed and regression(model, storage)  # the model answers a value, not a class
        if label_field and not embed:
            check_labels(df, label_field, model, storage, values=values)
        # an input that holds its true labels in "label" keeps them: the answers get other names
        label_col = "label" if "label" not in df.columns else "predicted_label"
        score_col = "score" if "score" not in df.columns else "predicted_score"
        if embed:
            scored = embed_dataframe(df, model=model, text_col=text_col, pooling=pooling, normalize=normalize,
                                     batch_size=batch_size, threads=threads, storage=storage)
        else:
            scored = classify_dataframe(df, model=model, text_col=text_col, batch_size=batch_size, threads=threads,
                                        label_col=label_col, score_col=score_col,
                                        probabilities_col="probabilities" if probabilities else None, storage=storage)
        staging = Path(staging_path(str(out)))
        scored.write.parquet(str(staging))
        written = scored.sparkSession.read.parquet(str(staging))
        counts = {"rows": written.count(), "truncated": written.filter("truncated").count()}
        if not embed:
            counts["label_col"] = label_col
            counts["labels"] = {r[0]: r[1] for r in written.groupBy(label_col).count().collect() if r[0] is not None}
        if label_field and not embed:
            counts["scored_against"] = (scored_values if values else scored_labels)(written, label_field, label_col,
                                                                                    score_col)
    info = {"model": model, "inputs": inputs, "format": fmt,
            "task": "embed" if embed else "regression" if values else "classify",
            "text_col": text_col, **counts, "seconds": round(time.time() - started, 3)}
    (staging / MARKER).write_text(json.dumps(redact.mapping({**info, "files": listing(staging)}), indent=2))
    swap_in(pafs.LocalFileSystem(), str(staging), str(out), marker=MARKER)  # the old one stays whole till then
    return {**info, "path": str(out)}


def regression(model: str, storage) -> bool:
    """Whether ``model``'s head answers values (its config's problem_type is "regression", as transformers reads it)."""
    from ..infra.fs import join, read_text
    from .generate import model_uri

    try:
        return json.loads(read_text(join(model_uri(model, storage), "config.json"), storage)).get(
            "problem_type") == "regression"
    except (OSError, ValueError):
        return False  # the loader says what is wrong with the model


def scored_labels(written, field: str, label_col: str, score_col: str) -> dict:
    """Accuracy of the predicted labels against the true ones."""
    from pyspark.sql import functions as F

    gold = written.where(F.col(field).isNotNull() & F.col(label_col).isNotNull())
    n = gold.count()
    right = gold.where(F.col(field).cast("string") == F.col(label_col)).count()
    return {"field": field, "rows": n, "accuracy": right / n if n else None}


def scored_values(written, field: str, label_col: str, score_col: str) -> dict:
    """Mean absolute and root mean squared error of the predicted values against the true ones."""
    from pyspark.sql import functions as F

    err = F.col(field).cast("double") - F.col(score_col)
    row = (written.where(F.col(field).cast("double").isNotNull() & F.col(score_col).isNotNull())
           .agg(F.count(F.lit(1)).alias("n"), F.avg(F.abs(err)).alias("mae"), F.avg(err * err).alias("mse")).first())
    return {"field": field, "rows": row["n"], "mae": row["mae"],
            "rmse": row["mse"] ** 0.5 if row["mse"] is not None else None}


def check_labels(df, field: str, model: str, storage, *, values: bool = False) -> None:
    """The column of true labels exists and holds only labels the model knows (one line naming the others); a
    regression model's true values need only be there."""
    from pyspark.sql import functions as F

    from ..infra.fs import join, read_text
    from .generate import model_uri

    if field not in df.columns:
        raise SparklmError(f"the input has no column {field!r} (columns: {', '.join(df.columns)})",
                           hint="name the column of true labels with --label-field")
    if values:
        return
    known = set(json.loads(read_text(join(model_uri(model, storage), "config.json"), storage))
                .get("id2label", {}).values())
    seen = {r[0] for r in df.select(F.col(field).cast("string")).distinct().limit(10_000).collect() if r[0] is not None}
    unknown = sorted(seen - known)
    if unknown:
        raise SparklmError(f"column {field!r} holds {len(unknown)} label(s) the model does not know: "
                           f"{', '.join(map(repr, unknown[:5]))}{', …' if len(unknown) > 5 else ''} "
                           f"(the model's: {', '.join(map(repr, sorted(known)[:10]))})",
                           hint="score against the labels the model was trained on, or drop --label-field")


def check_output(out: Path, overwrite: bool) -> None:
    check_replaceable(out, overwrite, marker=MARKER, kind="a sparklm prediction")


def _first_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return text.split(" JVM stacktrace")[0][:300]
