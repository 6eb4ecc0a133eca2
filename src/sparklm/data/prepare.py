"""``sparklm prepare``: raw text → cleaned, deduplicated, split, tokenized and packed Parquet.

Two passes over the input, both Spark jobs over bins of read units, and no shuffle of text:

1. *scan*: read and clean every document, keep only metadata (position, status, size, content
   hash, split) and a bounded sample of text for the tokenizer; duplicates and splits are decided
   on that small table;
2. *write*: read and clean again, skip the duplicates, tokenize, pack and write each split's
   Parquet file straight into a staging directory beside the output (local or s3://).

The driver keeps the files of successful task attempts, writes the tokenizer and, last,
``manifest.json``, then swaps the staging directory into place. Reading twice costs far less than
moving all text through Spark's shuffle and cache (tokenization dominates).
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs

from .. import progress, trackers
from ..config import Config, flatten
from ..errors import SparklmError, spark_errors
from ..fs import effective, remove_stale, resolve, staging_path, swap_in, uri_like
from ..version import __version__
from . import clean, instruct, labelled, sources
from . import tokenizer as tokenizers_mod
from .manifest import FORMAT, MANIFEST, SPLITS, PreparedDataset, load_prepared
from .packing import Packed, Packer, PackSpec
from .parts import PartFile, list_column


def prepare(
    inputs,
    *,
    output: str,
    config: Config | None = None,
    validation_inputs=(),
    overwrite: bool = False,
    spark=None,
    described: str | None = None,
) -> PreparedDataset:
    """Prepare ``inputs`` into a dataset at ``output`` and return it (see the README for the format).

    ``inputs`` are paths (files, directories, globs; local or on an object store) or a Spark DataFrame with a
    ``data.text_field`` column (or the record fields of ``data.format``), each row a document; its text is read by
    the executors, never collected to the driver. ``validation_inputs`` are paths, or a DataFrame when ``inputs``
    is one. ``spark`` is a SparkSession, a function that starts one (called once the inputs are checked),
    or None for the active session or a new local one (a DataFrame brings its own). ``described``: how the
    manifest names a DataFrame source (e.g. ``table db.docs``).
    """
    from ..spark import check_shared, get_session

    config = config or Config()
    config = config.replace(storage=effective(config.storage))
    data, storage = config.data, config.storage
    frame = is_dataframe(inputs) or is_dataframe(validation_inputs)
    if frame:
        frames = _frames(inputs, validation_inputs, data)
    else:
        inputs = [inputs] if isinstance(inputs, str) else list(inputs)
        if not inputs:
            raise SparklmError("no input given", hint="pass text files, directories or globs")
    if data.stride > data.seq_len:
        raise SparklmError(f"data.stride ({data.stride}) is larger than data.seq_len ({data.seq_len})",
                           hint="use a stride between 1 and seq_len (0 means seq_len)")
    if data.format == "chat" and not (data.chat_template and config.tokenizer.path):
        raise SparklmError("--format chat renders each conversation with the tokenizer's chat template, and "
                           + ("data.chat_template is false" if not data.chat_template else "a trained tokenizer has none"),
                           hint="pass --tokenizer with a model's tokenizer directory that has a chat template, or "
                                "use --format instruction for prompt/response records")
    if data.task in labelled.ENCODER_TASKS:
        labelled.check(data, config.tokenizer.path)
    trackers.check(config, "prepare")
    started = time.time()
    fs, out_path = resolve(output, storage)
    _check_output(fs, out_path, output, overwrite)
    for name in remove_stale(output, storage, before=started):
        progress.info(f"[dim]removed {name}, left by an earlier prepare that did not finish[/dim]")
    if frame:
        spark, spark_start = frames[0][0].sparkSession, 0.0
        check_shared(spark, {"output": output})
        source = _frame_source(spark, frames, data)
        name = described or "dataframe"
        inputs, validation_inputs = [name], [f"{name} (validation)"] if len(frames) > 1 else []
    else:
        units = sources.plan_units(inputs, group="train" if validation_inputs else "auto", data=data, storage=storage)
        units += sources.plan_units(list(validation_inputs), group="validation", data=data, storage=storage)
        t_spark = time.time()
        spark = spark() if callable(spark) else get_session(config.spark, spark=spark)  # started after the checks
        check_shared(spark, {"input": str(inputs[0]), "output": output})
        spark_start = time.time() - t_spark
        source = Source.of_files(spark, _bins(units, spark.sparkContext.defaultParallelism * 4), data, storage)
    tracking = trackers.open_trackers(config, trackers.Context(
        command="prepare", run_dir=output, storage=storage, params={k: v for k, v in flatten(config.to_saved()).items() if k.split(".")[0] in ("data", "tokenizer")}))
    try:
        with trackers.failed_on_error(tracking):
            dataset = _run(spark, source, config, inputs, list(validation_inputs), output, started, spark_start)
    finally:
        source.release()
    trackers.finish_all(tracking, trackers.Outcome(ok=True, summary=trackers.manifest_figures(dataset.manifest)))
    return dataset


def is_dataframe(value) -> bool:
    """A Spark DataFrame (classic or Spark Connect), told apart without importing pyspark for paths."""
    return type(value).__name__ == "DataFrame" and hasattr(value, "sparkSession")


def _frames(frame, validation, data) -> list[tuple[object, str]]:
    """(DataFrame, group) pairs to read — "auto" (split by hash), or "train" and "validation" — checked for the
    columns ``data`` reads, and for a Spark Connect session (whose DataFrames have no RDDs)."""
    from ..spark import CONNECT_HINT, CONNECT_MESSAGE, is_connect

    if not is_dataframe(frame) or not (is_dataframe(validation) or validation in ((), [], None)):
        raise SparklmError("the inputs and the validation inputs are of different kinds",
                           hint="pass DataFrames for both, or paths for both")
    held = validation if is_dataframe(validation) else None
    frames = [(frame, "auto" if held is None else "train"), *([(held, "validation")] if held is not None else [])]
    if is_connect(frame.sparkSession):
        raise SparklmError(CONNECT_MESSAGE, hint=CONNECT_HINT)
    for df, role in frames:
        missing = [c for c in sources.record_fields(data) if c not in df.columns]
        if missing:
            flag = "text_col" if data.format == "text" else "the record fields (data.prompt_field, ...)"
            raise SparklmError(f"the {'validation ' if role == 'validation' else ''}DataFrame has no column "
                               f"{', '.join(map(repr, missing))} (columns: {', '.join(df.columns) or 'none'})",
                               hint=f"name its text column with {flag}, e.g. text_col='body'")
    return frames


def _frame_source(spark, frames: list[tuple[object, str]], data) -> Source:
    """The rows of ``frames`` as one source: only the columns read, and each row's group beside them."""
    from pyspark.sql import functions as F

    cols = sources.record_fields(data)
    rows = None
    for df, role in frames:
        part = df.select(F.lit(role).alias("_group"), F.struct(*[F.col(c) for c in cols]).alias("_values"))
        rows = part if rows is None else rows.unionByName(part)
    with spark_errors():
        return Source.of_frame(spark, rows, cols, data, len(frames))


@dataclass
class Source:
    """What both passes read, as an RDD whose partitions the executor-side ``read(partition)`` turns into
    :func:`sources.documents`' tuples: bins of file read units, or a DataFrame's rows (persisted, so that both
    passes see the same rows in the same partitions)."""

    rdd: object
    partitions: int
    read: object  # Iterator of the RDD's partition -> Iterator of documents' tuples
    planned_bytes: int  # a rough size of the text, to bound the tokenizer's sample
    label: str  # "3 files", "the DataFrame"
    count: int  # input files (DataFrames)
    bins: list | None = None  # files only: the read units, by task
    cached: object = None

    @classmethod
    def of_files(cls, spark, bins: list[list[sources.ReadUnit]], data, storage) -> Source:
        def read(it):
            for bin_ in it:
                yield from sources.documents(bin_, data, storage)

        n = len({u.uri for b in bins for u in b})
        # Compressed files hold about 3x their size in text: a rough guess is enough to bound the sample.
        planned = sum(u.nbytes * (3 if u.compression else 1) for b in bins for u in b)
        return cls(spark.sparkContext.parallelize(bins, len(bins)), len(bins), read, planned, f"{n} files", n, bins)

    @classmethod
    def of_frame(cls, spark, rows, cols: list[str], data, count: int) -> Source:
        from pyspark import StorageLevel
        from pyspark.sql import functions as F

        rows = rows.persist(StorageLevel.MEMORY_AND_DISK)
        sizes = [F.coalesce(F.octet_length(F.col("_values").getField(c).cast("string")), F.lit(0)) for c in cols]
        planned = rows.select(sum(sizes[1:], sizes[0]).alias("n")).agg(F.sum("n")).first()[0] or 0

        def read(it):
            from pyspark import TaskContext

            yield from sources.frame_documents(((r[0], r[1].asDict()) for r in it), TaskContext.get().partitionId(),
                                               data)

        parts = max(1, rows.rdd.getNumPartitions())  # an empty DataFrame may have none
        return cls(rows.rdd, parts, read, planned, "the DataFrame" if count == 1 else f"{count} DataFrames", count,
                   None, rows)

    def release(self) -> None:
        if self.cached is not None:
            self.cached.unpersist()


def _run(spark, source: Source, config: Config, inputs: list[str], validation_inputs: list[str], output: str,
         started: float, spark_start: float) -> PreparedDataset:
    """Both passes over ``source``, then the atomic commit of the dataset at ``output``."""
    data, storage = config.data, config.storage
    fs, out_path = resolve(output, storage)
    n_files = source.count
    staged = staging_path(out_path)
    staging = uri_like(output, staged)
    try:
        with spark_errors():
            classes = None
            if data.dedup or data.task == "classify":  # duplicates and classes are known after a look at everything
                agg, losers, sample, cached, classes = _scan(spark, source, config, sample_only=False)
                stats = _stats(agg, n_files, data.encoding)
            else:
                agg, losers = None, {}
                sample, cached = _tokenizer_sample(spark, source, config)
            spec = _tokenizer(spark, sample, config)
            if data.format == "chat" and not spec.chat_template:
                raise SparklmError(f"tokenizer {config.tokenizer.path} has no chat template to render --format chat "
                                   "records with", hint="use a model's tokenizer directory whose tokenizer_config.json "
                                   "has a chat_template, or --format instruction for prompt/response records")
            if cached is not None:
                cached.unpersist()
            pack = _pack_spec(config, spec)
            fs.create_dir(staged, recursive=True)
            with progress.stage(spark, "read + clean + tokenize + pack + write" if agg is None else
                                "tokenize + pack + write"):
                files, write_agg = _write(spark, source, config, spec, pack, losers, staging, classes)
            if agg is None:  # one pass did it all: its counts are the statistics
                stats = _stats(write_agg, n_files, data.encoding)
        manifest = _manifest(config, inputs, validation_inputs, stats, files, spec, pack, started, spark_start)
        if data.task in labelled.ENCODER_TASKS:
            manifest = _encoder_manifest(manifest, config, files, classes)
        _commit(fs, staged, out_path, files, spec, manifest)
    except BaseException:
        _remove(fs, staged)
        raise
    _summary(manifest)
    return load_prepared(output, storage)


# -- steps -----------------------------------------------------------------------------------


def _bins(units: list[sources.ReadUnit], n: int) -> list[list[sources.ReadUnit]]:
    """Group read units into at most ``n`` tasks of similar size; each keeps (file, offset) order."""
    bins: list[list[sources.ReadUnit]] = [[] for _ in range(max(1, min(n, len(units))))]
    load = [0] * len(bins)
    for u in sorted(units, key=lambda u: (-u.nbytes, u.uri, u.start)):  # largest first into the lightest bin
        i = load.index(min(load))
        bins[i].append(u)
        load[i] += u.nbytes
    return [sorted(b, key=lambda u: (u.uri, u.start)) for b in bins]


def _split_of(unit: sources.ReadUnit, dig: bytes, val_fraction: float) -> str:
    if unit.group != "auto":
        return unit.group
    return "validation" if clean.is_validation(dig, val_fraction) else "train"


def _scan(spark, source: Source, config: Config, *, sample_only: bool):
    """Read and clean, keeping only metadata and a bounded text sample for the tokenizer; decide
    duplicates on that small table. Returns (counts, duplicates to skip, tokenizer sample)."""
    from pyspark import StorageLevel
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    data = config.data
    planned = source.planned_bytes or 1
    sample_fraction = 1.0 if config.tokenizer.path else min(1.0, config.tokenizer.sample_mb * 2**20 / planned)
    want_sample = not config.tokenizer.path
    read = source.read

    classify = data.task == "classify"

    def scan(it):
        for unit, pos, status, text, invalid, dig in read(it):
            ok = status == sources.OK
            # labelled records of hash-split inputs get their split from their class's threshold (stratify, below)
            split = None if not ok or (classify and unit.group == "auto") else _split_of(unit, dig, data.val_fraction)
            doc = clean.doc_id(dig) if ok else None
            # A deterministic sample by content hash; its size is bounded for the driver.
            sampled = want_sample and ok and split == "train" and (doc & 0xFFFFFF) < sample_fraction * 2**24
            label = text.label if ok and classify else None
            text = sources.text_of(text) if ok else None
            yield (unit.uri, pos, status, split, len(text.encode("utf-8", "surrogatepass")) if ok else 0,
                   invalid, doc, dig, text if sampled else None, label,
                   labelled.split_key(dig) if ok and classify else None, unit.group == "auto")

    ddl = ("source string, pos long, status string, split string, n_bytes long, n_invalid long, doc_id long, "
           "digest binary, sample string, label string, split_key long, auto boolean")
    meta = spark.createDataFrame(source.rdd.mapPartitions(scan), ddl)
    if config.data.dedup and not sample_only:  # keep one copy per content hash: the validation one, then the first by (source, pos)
        # as many partitions as scan tasks, not spark.sql.shuffle.partitions (200): the rows are small, and the
        # persisted frame keeps its partitioning for each of the jobs below (adaptive execution cannot coalesce it)
        meta = meta.repartition(source.partitions, "digest")
        order = Window.partitionBy("digest").orderBy((F.col("split") == "train").asc(), "source", "pos")
        meta = meta.withColumn("copy", F.when(F.col("digest").isNull(), 1).otherwise(F.row_number().over(order)))
    else:
        meta = meta.withColumn("copy", F.lit(1))
    meta = persisted = meta.persist(StorageLevel.MEMORY_AND_DISK)
    classes = None
    if classify and not sample_only:
        with progress.stage(spark, f"read + clean + split {source.label} by label"):
            meta, cut = labelled.stratify(meta, data.val_fraction)
            counts = (meta.where((F.col("status") == sources.OK) & (F.col("copy") == 1))
                      .groupBy("split", "label").count().collect())
        classes = _classes(counts, cut, data)
    losers: dict[str, list[int]] = defaultdict(list)
    agg = []
    if not sample_only:
        with progress.stage(spark, f"read + clean + deduplicate {source.label}"):
            agg = [r.asDict() for r in meta.groupBy("source", "status", "split", (F.col("copy") == 1).alias("kept"))
                   .agg(F.count("*").alias("n"), F.sum("n_bytes").alias("bytes"), F.sum("n_invalid").alias("invalid"))
                   .collect()]
            # collect(), not toLocalIterator(): that runs one Spark job per shuffle partition (200)
            for r in meta.where(F.col("copy") > 1).select("source", "pos").collect():
                losers[r["source"]].append(r["pos"])
    sample = meta.where((F.col("copy") == 1) & F.col("sample").isNotNull()).select("source", "pos", "sample")
    return agg, {k: frozenset(v) for k, v in losers.items()}, sample, persisted, classes


def _classes(counts, cut: dict, data) -> dict:
    """The classes of a labelled dataset from (split, label, count) rows: names in id order, documents per split,
    and each label's validation threshold; one class only is refused (there would be nothing to tell apart)."""
    per: dict[str, dict[str, int]] = {s: {} for s in SPLITS}
    for r in counts:
        per[r["split"]][r["label"]] = r["count"]
    names = labelled.ordered(set(per["train"]) | set(per["validation"]))
    if len(names) == 1:
        raise SparklmError(f"the label column '{data.label_field}' holds one class only ({names[0]!r})",
                           hint="a classifier needs examples of two or more classes: check --label-field and the inputs")
    return {"names": names, "documents": {s: {n: per[s].get(n, 0) for n in names} for s in SPLITS}, "cut": cut}

def _tokenizer_sample(spark, source: Source, config: Config):
    """Without dedup there is no full scan: read just enough units (chosen by hash) for the sample (all of a
    DataFrame). Returns (sample, the frame to unpersist once the tokenizer is trained)."""
    if config.tokenizer.path:
        return None, None
    if source.bins is None:
        return _scan(spark, source, config, sample_only=True)[2:4]
    bins = source.bins
    units = sorted((u for b in bins for u in b), key=lambda u: clean.digest(f"{u.uri}@{u.start}"))
    budget = 2 * config.tokenizer.sample_mb * 2**20  # twice the sample: the split and hashing thin it out
    chosen, total = [], 0
    for u in units:
        if total >= budget:
            break
        chosen.append(u)
        total += u.nbytes * (3 if u.compression else 1)
    return _scan(spark, Source.of_files(spark, _bins(chosen, len(bins)), config.data, config.storage), config,
                 sample_only=True)[2:4]


def _stats(agg: list[dict], files: int, encoding: str) -> dict:
    """Documents kept and dropped by reason, per split, from rows of (source, status, split, kept, n, bytes, invalid)."""
    dropped: dict[str, int] = defaultdict(int)
    invalid_by_file: dict[str, int] = defaultdict(int)
    splits = {s: {"documents": 0, "text_bytes": 0, "duplicates": 0} for s in SPLITS}
    for r in agg:
        invalid_by_file[r["source"]] += r["invalid"] or 0
        if r["status"] != sources.OK:
            dropped[r["status"]] += r["n"]
        elif r["kept"]:
            splits[r["split"]]["documents"] += r["n"]
            splits[r["split"]]["text_bytes"] += r["bytes"]
        else:
            splits[r["split"]]["duplicates"] += r["n"]
            dropped[sources.DUPLICATE] += r["n"]
    for uri, bad in sorted(invalid_by_file.items(), key=lambda kv: -kv[1])[:5]:
        if bad:
            progress.warn(f"{uri}: {bad} bytes invalid in {encoding} were replaced with U+FFFD "
                          f"(set data.encoding if the file uses another encoding)")
    if dropped.get(sources.BINARY):
        progress.warn(f"skipped {dropped[sources.BINARY]} file(s) that look binary")
    stats = {"files": files, "splits": splits, "dropped": dict(sorted(dropped.items())),
             "documents_read": sum(r["n"] for r in agg if r["status"] != sources.BINARY),
             "invalid_bytes_replaced": sum(invalid_by_file.values())}
    if splits["train"]["documents"] == 0:
        reasons = ", ".join(f"{n} {k}" for k, n in stats["dropped"].items()) or "the inputs hold no text"
        raise SparklmError(f"no training documents left after cleaning ({reasons})",
                           hint="check the inputs, data.text_field (and data.label_field), data.doc_mode and data.min_chars")
    if splits["validation"]["documents"] == 0:
        progress.warn("the validation split is empty: raise data.val_fraction or pass --validation-input")
    return stats


def _tokenizer(spark, sample, config: Config) -> tokenizers_mod.TokenizerSpec:
    tcfg = config.tokenizer
    if tcfg.path:
        return tokenizers_mod.load(tcfg.path)
    with progress.stage(spark, f"train tokenizer (vocab {tcfg.vocab_size})"):
        # BPE training does not depend on document order (tested): no sort needed for determinism.
        # The sample is bounded by tokenizer.sample_mb, so collecting it is safe for the driver.
        return tokenizers_mod.train((row["sample"] for row in sample.collect()), tcfg)


def _pack_spec(config: Config, spec: tokenizers_mod.TokenizerSpec) -> PackSpec:
    data = config.data
    pad_last = data.last_block == "pad" or (data.last_block == "auto" and not data.concat)
    return PackSpec(seq_len=data.seq_len, stride=data.stride or data.seq_len, pad_id=spec.pad_id,
                    concat=data.concat, pad_last=pad_last)


def _write(spark, source: Source, config: Config, spec, pack: PackSpec, losers: dict, staging: str,
           classes: dict | None = None) -> dict[str, list[dict]]:
    """Pass 2: read and clean again, skip duplicates, tokenize, pack (or encode, for an encoder) and write each
    split's file."""
    sc = spark.sparkContext
    spec_bc, losers_bc = sc.broadcast(spec), sc.broadcast(losers)
    rows_per_group = max(16, config.output.row_group_mb * 1024 * 1024 // (pack.seq_len * 4))
    data, storage = config.data, config.storage
    templated = _templated(data, spec)
    read = source.read
    cut = classes["cut"] if classes else None

    def split_of(unit, dig, doc) -> str:
        if cut is None:
            return _split_of(unit, dig, data.val_fraction)
        return labelled.split_of(unit.group, labelled.split_key(dig), doc.label, cut)

    def writer(split: str, name: str):
        if data.task not in labelled.ENCODER_TASKS:
            return _SplitWriter(split, name, staging, storage, pack, spec_bc.value, rows_per_group, data)
        return labelled.Writer(split, name, staging, storage, seq_len=data.seq_len,
                               rows_per_group=rows_per_group, pad_id=spec_bc.value.pad_id,
                               window=labelled.windowing(data) == "window",
                               overlap=data.seq_len - data.stride if data.stride else 0, pairs=bool(data.pair_field),
                               label_ids={n: i for i, n in enumerate(classes["names"])} if classes else None)

    def write(it):
        from pyspark import TaskContext

        ctx = TaskContext.get()
        # text inside a document is text, even "<|eos|>"; a chat template's rendering holds real special tokens
        tok = _tokenizer_for(spec_bc.value, specials=templated, encoder=data.task in labelled.ENCODER_TASKS)
        render = _renderer_for(spec_bc.value) if templated else None
        drop = losers_bc.value
        writers = {s: writer(s, f"part-{ctx.partitionId():05d}-{ctx.attemptNumber()}.parquet") for s in SPLITS}
        batch: dict[str, tuple[list, list]] = {s: ([], []) for s in SPLITS}
        counts: dict[tuple, list[int]] = defaultdict(lambda: [0, 0, 0])  # (source, status, split, kept) -> n, bytes, invalid
        size = 0
        for unit, pos, status, doc, invalid, dig in read(it):
            split = split_of(unit, dig, doc) if status == sources.OK else None
            kept = status == sources.OK and pos not in drop.get(unit.uri, ())
            c = counts[(unit.uri, status, split, kept or status != sources.OK)]
            c[0] += 1
            c[2] += invalid
            if not kept:
                continue
            nbytes = len(sources.text_of(doc).encode("utf-8", "surrogatepass"))
            c[1] += nbytes
            if isinstance(doc, instruct.Record):  # → (piece, trains) pairs
                doc = _segments(doc, render, data, unit, pos, storage)
            docs, ids = batch[split]
            docs.append(doc)
            ids.append(clean.doc_id(dig))
            size += nbytes
            if size > 4 * 2**20:  # tokenize in batches of a few MB: the tokenizer parallelises inside
                for s, (docs, ids) in batch.items():
                    writers[s].add(tok, docs, ids)
                batch, size = {s: ([], []) for s in SPLITS}, 0
        for s, (docs, ids) in batch.items():
            writers[s].add(tok, docs, ids)
        yield from (w.close() for w in writers.values())
        yield {"split": "", "counts": [(*k, *v) for k, v in counts.items()]}

    metas = source.rdd.mapPartitions(write).collect()
    files = {s: sorted((m for m in metas if m["split"] == s and m["rows"] > 0), key=lambda m: m["path"])
             for s in SPLITS}
    agg = [dict(zip(("source", "status", "split", "kept", "n", "bytes", "invalid"), c))
           for m in metas if m["split"] == "" for c in m["counts"]]
    return files, agg


_TOKENIZERS: dict[tuple, object] = {}


def _tokenizer_for(spec: tokenizers_mod.TokenizerSpec, *, specials: bool = False, encoder: bool = False):
    """The worker's tokenizer; ``specials``: special tokens written in the text are special tokens (a chat
    template's rendering), else they are text ("<|eos|>" inside a document is not the end of it). ``encoder``: one
    of its own, whose truncation the encoder writer sets."""
    key = (spec.sha256, specials, encoder)
    tok = _TOKENIZERS.get(key)
    if tok is None:  # once per Python worker, not once per task
        tok = _TOKENIZERS[key] = spec.tokenizer()
        tok.encode_special_tokens = not specials
    return tok


def _templated(data, spec: tokenizers_mod.TokenizerSpec) -> bool:
    """Whether records are rendered with the tokenizer's chat template (else their contents are joined as they are)."""
    return data.format != "text" and data.chat_template and bool(spec.chat_template)


_RENDERERS: dict[str, instruct.Render] = {}


def _renderer_for(spec: tokenizers_mod.TokenizerSpec) -> instruct.Render:
    """The chat template as :mod:`transformers` renders it (``apply_chat_template``), once per Python worker."""
    render = _RENDERERS.get(spec.sha256)
    if render is None:
        hf = spec.hf()

        def render(messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
            try:
                return hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
            except Exception as e:  # the template's own raise_exception(), or jinja's errors
                raise instruct.TemplateError(f"makes the chat template fail: {' '.join(str(e).split())[:200]}") from None

        _RENDERERS[spec.sha256] = render
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
        self.specials = (None, None) if _templated(data, spec) else (bos, spec.eos_id)
        self.schema = _data_schema(pack.has_mask, self.records)
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
            self.file.write(_to_table(ids[:take], None if mask is None else mask[:take], doc[:take], self.schema,
                                      None if loss is None else loss[:take]))
            if mask is not None:
                self.counts["pad_tokens"] += int(take * self.pack.seq_len - mask[:take].sum())
            if loss is not None:  # targets that count: a row's first token is never one
                self.counts["loss_tokens"] += int(loss[:take, 1:].sum())
            rest = Packed(ids[take:], None if mask is None else mask[take:], doc[take:],
                          None if loss is None else loss[take:])
            self.pending = [rest] if len(rest) else []


def _data_schema(has_mask: bool, has_loss_mask: bool = False) -> pa.Schema:
    fields = [("input_ids", pa.list_(pa.int32()))]
    if has_mask:
        fields.append(("attention_mask", pa.list_(pa.int8())))
    if has_loss_mask:
        fields.append(("loss_mask", pa.list_(pa.int8())))
    fields.append(("doc_id", pa.int64()))
    return pa.schema(fields)


def _to_table(ids: np.ndarray, mask: np.ndarray | None, doc: np.ndarray, schema: pa.Schema,
              loss: np.ndarray | None = None) -> pa.Table:
    cols = [list_column(ids)] + [list_column(a) for a in (mask, loss) if a is not None] + [pa.array(doc)]
    return pa.Table.from_arrays(cols, schema=schema)


# -- commit ----------------------------------------------------------------------------------


def _check_output(fs, path: str, uri: str, overwrite: bool) -> None:
    info = fs.get_file_info(path)
    if info.type.name == "NotFound":
        return
    if info.type.name == "File":
        raise SparklmError(f"output {uri} is a file", hint="give a directory path to --output")
    if not fs.get_file_info(_selector(path)):
        return  # an empty directory
    if not overwrite:
        raise SparklmError(f"output {uri} already exists", hint="pass --overwrite to replace it, or choose another --output")
    # --overwrite replaces a prepared dataset, never anything else a user pointed it at by mistake
    try:
        with fs.open_input_stream(f"{path}/{MANIFEST}") as f:
            manifest = json.loads(f.read().decode("utf-8"))
        ours = manifest.get("format") == FORMAT
    except (OSError, ValueError, AttributeError):
        ours = False
    if not ours:
        raise SparklmError(f"refusing to --overwrite {uri}: it is neither a sparklm dataset (no {MANIFEST} of format "
                           f"{FORMAT}) nor empty", hint="choose another --output, or empty it yourself if it is yours")
    present = [i.path[len(path) + 1:] for i in fs.get_file_info(pafs.FileSelector(path, recursive=True))
               if i.type == pafs.FileType.File]
    foreign = sorted(set(present) - _own_files(manifest))
    if foreign:
        raise SparklmError(f"refusing to --overwrite {uri}: besides a sparklm dataset it holds {len(foreign)} file(s) "
                           f"sparklm did not write ({', '.join(foreign[:3])}{', …' if len(foreign) > 3 else ''})",
                           hint="move them elsewhere first, or choose another --output")


# what save_pretrained writes beside tokenizer.json: the files of datasets whose manifest lists no "contents"
_TOKENIZER_FILES = {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"}


def _own_files(manifest: dict) -> set[str]:
    """The files (relative paths) a prepared dataset's manifest says prepare wrote there."""
    if isinstance(manifest.get("contents"), list):
        return set(manifest["contents"])
    splits = manifest.get("splits", {})
    data = {f["path"] for s in splits.values() if isinstance(s, dict) for f in s.get("files", [])}
    return data | _TOKENIZER_FILES | {MANIFEST}


def _selector(path: str):
    import pyarrow.fs as pafs

    return pafs.FileSelector(path, recursive=False, allow_not_found=True)


def _commit(fs, staging: str, out_path: str, files: dict, spec, manifest: dict) -> None:
    """Keep only successful attempts' files under their final names, write manifest last, swap in."""
    for split, metas in files.items():
        keep = set()
        for m in metas:
            final = m["path"].rsplit("-", 1)[0] + ".parquet"  # drop the attempt number
            fs.move(f"{staging}/{m['path']}", f"{staging}/{final}")
            keep.add(f"{staging}/{final}")
        for info in fs.get_file_info(_selector(f"{staging}/{split}")):
            if info.path not in keep:  # leftovers of failed or speculative attempts
                fs.delete_file(info.path)
    tokenizers_mod.save_to(spec, fs, staging)
    # every file of the dataset, so that --overwrite later replaces only these
    written = [i.path[len(staging) + 1:] for i in fs.get_file_info(pafs.FileSelector(staging, recursive=True))
               if i.type == pafs.FileType.File]
    manifest = {**manifest, "contents": sorted([*written, MANIFEST])}
    with fs.open_output_stream(f"{staging}/{MANIFEST}") as f:
        f.write(json.dumps(manifest, indent=2).encode())
    swap_in(fs, staging, out_path, marker=MANIFEST)


def _remove(fs, path: str) -> None:
    try:
        fs.delete_dir(path)
    except Exception:  # best effort: the staging name is hidden and never accepted as a dataset
        pass


# -- manifest and summary --------------------------------------------------------------------


def _manifest(config, inputs, validation_inputs, stats, files, spec, pack: PackSpec, started, spark_start) -> dict:
    splits = {}
    for split in SPLITS:
        metas = files[split]
        entry = stats["splits"][split]
        splits[split] = {
            "documents": entry["documents"],
            "duplicates_dropped": entry["duplicates"],
            "text_bytes": entry["text_bytes"],
            "tokens": sum(m["tokens"] for m in metas),
            "sequences": sum(m["rows"] for m in metas),
            "pad_tokens": sum(m["pad_tokens"] for m in metas),
            "dropped_tokens": sum(m["dropped_tokens"] for m in metas),
            "files": [{"path": m["path"].rsplit("-", 1)[0] + ".parquet", "rows": m["rows"], "bytes": m["bytes"],
                       "row_groups": m["row_groups"]} for m in sorted(metas, key=lambda m: m["path"])],
        }
        splits[split]["bytes_per_token"] = (
            entry["text_bytes"] / splits[split]["tokens"] if splits[split]["tokens"] else None
        )
        if config.data.format != "text":  # the targets the loss counts, per epoch
            splits[split]["loss_tokens"] = sum(m["loss_tokens"] for m in metas)
    seconds = time.time() - started
    total_tokens = sum(s["tokens"] for s in splits.values())
    return {
        "format": FORMAT,
        "task": config.data.task,
        "sparklm_version": __version__,
        "created_unix": round(time.time(), 3),
        "inputs": list(inputs),
        "validation_inputs": list(validation_inputs),
        "input": {"files": stats["files"], "documents_read": stats["documents_read"],
                  "dropped": stats["dropped"], "invalid_bytes_replaced": stats["invalid_bytes_replaced"]},
        "splits": splits,
        "packing": {"seq_len": pack.seq_len, "stride": pack.stride, "concat": pack.concat,
                    "last_block": "pad" if pack.pad_last else "drop", "has_attention_mask": pack.has_mask,
                    "targets": "inputs shifted by one (labels = input_ids)",
                    "bos_eos": _framing(config.data, spec), "format": config.data.format,
                    "chat_template": _templated(config.data, spec), "loss_mask": config.data.format != "text"},
        "tokenizer": {"file": "tokenizer.json", "sha256": spec.sha256, "vocab_size": spec.vocab_size,
                      "bos_id": spec.bos_id, "eos_id": spec.eos_id, "pad_id": spec.pad_id, "add_bos": spec.add_bos,
                      "chat_template": "chat_template.jinja" if spec.chat_template else None,
                      "trained": not config.tokenizer.path},
        "columns": {"input_ids": "list<int32>, seq_len token ids",
                    "attention_mask": "list<int8>, 0 on padding (present when sequences may be padded)",
                    **({"loss_mask": "list<int8>, 1 on the tokens whose prediction counts in the loss (responses, "
                                     "assistant turns and their end), 0 on prompts, specials and padding"}
                       if config.data.format != "text" else {}),
                    "doc_id": "int64, stable id (content hash) of the document at the sequence's first token"},
        "timing": {"seconds": round(seconds, 3), "spark_start_seconds": round(spark_start, 3),
                   "tokens_per_second": round(total_tokens / max(seconds, 1e-9), 1),
                   "tokens_per_second_after_spark_start": round(total_tokens / max(seconds - spark_start, 1e-9), 1)},
        "config": config.to_saved(),
    }


def _encoder_manifest(manifest: dict, config, files: dict, classes: dict | None) -> dict:
    """A causal manifest turned into an encoder dataset's: rows are records (or windows of documents), each with the
    tokenizer's own special tokens; a labelled one names its classes and counts them per split."""
    data = config.data
    long = labelled.windowing(data)
    for split, metas in files.items():
        manifest["splits"][split]["truncated"] = sum(m["truncated"] for m in metas)
    manifest["packing"] = {
        "seq_len": data.seq_len, "long": long, "stride": (data.stride or data.seq_len) if long == "window" else None,
        "has_attention_mask": True, "pairs": bool(data.pair_field),
        "rows": "one record per row" if long == "truncate" else "each document's windows, one per row",
        "special_tokens": "the tokenizer's own (its post-processor: CLS/SEP, <s>/</s>, pairs as the model expects)"}
    columns = {"input_ids": "list<int32>, seq_len token ids, padded", "attention_mask": "list<int8>, 0 on padding"}
    if data.pair_field:
        columns["token_type_ids"] = "list<int8>, 0 on the first text, 1 on the second"
    if classes:
        rows: dict[str, dict[str, int]] = {}
        for split, metas in files.items():
            per: dict[str, int] = defaultdict(int)
            for m in metas:
                for k, v in m["labels"].items():
                    per[classes["names"][int(k)]] += v
            rows[split] = {n: per.get(n, 0) for n in classes["names"]}
        manifest["labels"] = {"field": data.label_field, "names": classes["names"],
                              "documents": classes["documents"], "rows": rows}
        columns["labels"] = "int64, the class id (labels.names[id])"
    columns["doc_id"] = "int64, stable id (content hash) of the record"
    manifest["columns"] = columns
    return manifest


def _framing(data, spec) -> str:
    """What one document is, in the manifest's words."""
    bos = "BOS " if spec.add_bos else ""
    if data.format == "text":
        return f"each document is {bos}tokens EOS" + ("" if spec.add_bos else " (the tokenizer's convention: no BOS)")
    if _templated(data, spec):
        return "each record is its chat-template rendering, special tokens as the template writes them (none added)"
    return f"each record is {bos}prompt response EOS (contents joined as they are)"


def _summary(m: dict) -> None:
    inp = m["input"]
    rows = [("files", str(inp["files"]), ""), ("documents read", f"{inp['documents_read']:,}", "")]
    rows += [(f"dropped: {k}", f"{v:,}", "") for k, v in inp["dropped"].items()]
    if inp["invalid_bytes_replaced"]:
        rows.append(("invalid bytes replaced", f"{inp['invalid_bytes_replaced']:,}", ""))
    for split, s in m["splits"].items():
        rows.append((f"{split}: documents / bytes", f"{s['documents']:,}", f"{s['text_bytes']:,}"))
        rows.append((f"{split}: tokens / sequences", f"{s['tokens']:,}", f"{s['sequences']:,}"))
        if "loss_tokens" in s:
            rows.append((f"{split}: tokens in the loss", f"{s['loss_tokens']:,}", ""))
        if s.get("truncated"):
            rows.append((f"{split}: texts longer than seq_len", f"{s['truncated']:,}", m["packing"]["long"] + "d"))
    if "labels" in m:
        docs = m["labels"]["documents"]
        rows += [(f"class {name!r}: train / validation", f"{docs['train'][name]:,}", f"{docs['validation'][name]:,}")
                 for name in m["labels"]["names"][:20]]
    t = m["timing"]
    rows.append(("time / throughput", f"{t['seconds']:.1f}s", f"{t['tokens_per_second']:,.0f} tokens/s"))
    progress.table("prepare summary", rows, ("", "", ""))
