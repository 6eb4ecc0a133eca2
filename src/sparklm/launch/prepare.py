"""``sparklm prepare``: raw text → cleaned, deduplicated, split, tokenized and packed Parquet.

Two passes over the input, both jobs over bins of read units (Spark's, :mod:`.spark_engine`, or an Apache Beam
pipeline's, :mod:`.beam_engine`, running the same :mod:`.passes`), and no shuffle of text:

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

import pyarrow.fs as pafs

from ..config import Config, flatten
from ..data import allocator, beam_engine, labelled, passes, sample_ahead, sources
from ..data import tokenizer as tokenizers_mod
from ..data.manifest import FORMAT, MANIFEST, SPLITS, PreparedDataset, load_prepared
from ..data.packing import PackSpec
from ..data.spark_engine import SparkSource
from ..infra import progress, redact
from ..infra.errors import SparklmError, spark_errors
from ..infra.fs import effective, is_remote, remove_stale, resolve, staging_path, swap_in, uri_like
from ..infra.runlock import RunLock
from ..metrics import trackers
from ..spark.frames import field_column, field_type
from ..version import __version__


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
    manifest names a DataFrame source (e.g. ``table db.docs``). With ``data.engine = "beam"`` both passes run as an
    Apache Beam pipeline on ``beam.runner`` instead (paths only; ``spark`` is not used).
    """
    # one prepare per output: another's staging is not a stale leftover to remove
    with RunLock(output, effective((config or Config()).storage), kind="dataset"):
        return _prepare(inputs, output=output, config=config, validation_inputs=validation_inputs,
                        overwrite=overwrite, spark=spark, described=described)


def _prepare(inputs, *, output: str, config: Config | None, validation_inputs, overwrite: bool, spark,
             described: str | None) -> PreparedDataset:
    from ..spark.session import check_shared, check_workers_python, get_session, planned_master

    config = config or Config()
    config = config.replace(storage=effective(config.storage))
    data, storage = config.data, config.storage
    frame = is_dataframe(inputs) or is_dataframe(validation_inputs)
    if data.engine == "beam":
        beam_engine.check(config, frame)
    if frame:
        frames = _frames(inputs, validation_inputs, data)
        spark = frames[0][0].sparkSession  # the DataFrames' own session
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
    if labelled.encoded(data):
        labelled.check(data, config.tokenizer.path)
    if config.tokenizer.path:
        tokenizers_mod.check_found(config.tokenizer.path)
    trackers.check(config, "prepare")
    preload, master = None, ""
    if data.engine != "beam":  # the malloc resolved once, with the checks: a path that is no file fails before any work
        master = planned_master(config.spark, None if callable(spark) else spark)
        preload = allocator.library(config.tokenizer.allocator, master)
    started = time.time()
    fs, out_path = resolve(output, storage)
    _check_output(fs, out_path, output, overwrite)
    for name in remove_stale(output, storage, before=started):
        progress.info(f"[dim]removed {name}, left by an earlier prepare that did not finish[/dim]")
    ahead = None  # the tokenizer's sample read and trained in a child process while Spark starts
    try:
        if frame:
            spark_start = 0.0
            check_workers_python(spark)  # the user's session: its Python workers must import sparklm
            check_shared(spark, {"output": output})
            source = _frame_source(spark, frames, data, preload)
            name = described or "dataframe"
            inputs, validation_inputs = [name], [f"{name} (validation)"] if len(frames) > 1 else []
        else:
            units = sources.plan_units(inputs, group="train" if validation_inputs else "auto", data=data, storage=storage)
            units += sources.plan_units(list(validation_inputs), group="validation", data=data, storage=storage)
            if data.engine == "beam":
                source, spark_start = beam_engine.BeamSource(units, config), 0.0
            else:
                t_spark = time.time()
                if sample_ahead.wanted(config, master):
                    ahead = sample_ahead.start(units, config, preload)  # the tokenizer trained while the JVM starts
                spark = spark() if callable(spark) else get_session(config.spark, spark=spark)  # started after the checks
                check_shared(spark, {"input": str(inputs[0]), "output": output})
                spark_start = time.time() - t_spark
                tasks = passes.read_tasks(data, spark.sparkContext.defaultParallelism)
                source = SparkSource.of_files(spark, passes.bins(units, tasks), data, storage, preload)
        tracking = trackers.open_trackers(config, trackers.Context(
            command="prepare", run_dir=output, storage=storage, params={k: v for k, v in flatten(config.to_saved()).items() if k.split(".")[0] in ("data", "tokenizer")}))
        try:
            with trackers.failed_on_error(tracking):
                dataset = _run(source, config, inputs, list(validation_inputs), output, started, spark_start,
                               ahead)
        finally:
            source.release()
        trackers.finish_all(tracking, trackers.Outcome(ok=True, summary=trackers.manifest_figures(dataset.manifest)))
        return dataset
    finally:
        if ahead is not None:
            ahead.cancel()


def is_dataframe(value) -> bool:
    """A Spark DataFrame (classic or Spark Connect), told apart without importing pyspark for paths."""
    return type(value).__name__ == "DataFrame" and hasattr(value, "sparkSession")


def _frames(frame, validation, data) -> list[tuple[object, str]]:
    """(DataFrame, group) pairs to read — "auto" (split by hash), or "train" and "validation" — checked for the
    columns ``data`` reads, and for a Spark Connect session (whose DataFrames have no RDDs)."""
    from ..spark.session import CONNECT_HINT, CONNECT_MESSAGE, is_connect

    if not is_dataframe(frame) or not (is_dataframe(validation) or validation in ((), [], None)):
        raise SparklmError("the inputs and the validation inputs are of different kinds",
                           hint="pass DataFrames for both, or paths for both")
    held = validation if is_dataframe(validation) else None
    frames = [(frame, "auto" if held is None else "train"), *([(held, "validation")] if held is not None else [])]
    if is_connect(frame.sparkSession):
        raise SparklmError(CONNECT_MESSAGE, hint=CONNECT_HINT)
    for df, role in frames:
        missing = [c for c in sources.record_fields(data) if field_type(df, c) is None]
        if missing:
            flag = "text_col" if data.format == "text" else "the record fields (data.prompt_field, ...)"
            raise SparklmError(f"the {'validation ' if role == 'validation' else ''}DataFrame has no column "
                               f"{', '.join(map(repr, missing))} (columns: {', '.join(df.columns) or 'none'})",
                               hint=f"name its text column with {flag}, e.g. text_col='body'")
        kind = field_type(df, data.text_field).simpleString() if not sources.reads_records(data) else "string"
        if kind not in ("string", "binary"):  # found on the driver, not after a pass that drops every row
            raise SparklmError(f"the {'validation ' if role == 'validation' else ''}DataFrame's column "
                               f"{data.text_field!r} holds {kind}, not text",
                               hint=f"cast it: df.withColumn({data.text_field!r}, "
                                    f"F.col({data.text_field!r}).cast('string')), or name another with text_col")
    return frames


def _frame_source(spark, frames: list[tuple[object, str]], data, preload: str | None) -> SparkSource:
    """The rows of ``frames`` as one source: only the columns read, and each row's group beside them."""
    from pyspark.sql import functions as F

    cols = sources.record_fields(data)
    rows = None
    for df, role in frames:
        part = df.select(F.lit(role).alias("_group"), F.struct(*[field_column(df, c) for c in cols]).alias("_values"))
        rows = part if rows is None else rows.unionByName(part)
    with spark_errors():
        return SparkSource.of_frame(spark, rows, cols, data, len(frames), preload)


def _run(source: passes.Engine, config: Config, inputs: list[str], validation_inputs: list[str], output: str,
         started: float, spark_start: float, ahead: sample_ahead.Ahead | None = None) -> PreparedDataset:
    """Both passes over ``source`` (Spark's or Beam's), then the atomic commit of the dataset at ``output``."""
    data, storage = config.data, config.storage
    fs, out_path = resolve(output, storage)
    staged = staging_path(out_path)
    staging = uri_like(output, staged)
    try:
        fs.create_dir(staged, recursive=True)
        with source.errors():
            classes = None
            full_scan, ready = passes.full_scan(data), None
            if full_scan:
                scanned = source.scan(config, sample_only=False, staging=staging)
                stats = _stats(scanned.agg, source.count, config)
                if scanned.class_counts is not None:
                    classes = _classes(scanned.class_counts, scanned.cut, data)
            else:
                if ahead is not None:  # None back: the child failed, and the Spark job reads the sample instead
                    with source.stage(f"train tokenizer (vocab {config.tokenizer.vocab_size}, sampled while Spark "
                                      "started)"):
                        ready = ahead.result()
                scanned = passes.Scanned() if ready else _tokenizer_sample(source, config, staging)
            spec = ready or _tokenizer(source, scanned.sample, config)
            if data.format == "chat" and not spec.chat_template:
                raise SparklmError(f"tokenizer {config.tokenizer.path} has no chat template to render --format chat "
                                   "records with", hint="use a model's tokenizer directory whose tokenizer_config.json "
                                   "has a chat_template, or --format instruction for prompt/response records")
            pack = _pack_spec(config, spec)
            plan = passes.WritePlan(config, spec, pack, staging, classes)
            with source.stage("tokenize + pack + write" if full_scan else "read + clean + tokenize + pack + write"):
                files, write_agg, tokens = passes.gather(source.write(plan, scanned.losers))
            if not full_scan:  # one pass did it all: its counts are the statistics
                stats = _stats(write_agg, source.count, config)
        manifest = _manifest(config, inputs, validation_inputs, stats, files, tokens, spec, pack, started,
                             spark_start)
        _check_rows(manifest["splits"], tokens, pack)
        manifest["engine"] = source.describe()
        if labelled.encoded(data):
            manifest = _encoder_manifest(manifest, config, files, classes)
        _commit(fs, staged, out_path, files, spec, manifest)
    except BaseException:
        _remove(fs, staged)
        raise
    _summary(manifest)
    return load_prepared(output, storage)


# -- steps -----------------------------------------------------------------------------------


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

def _tokenizer_sample(source: passes.Engine, config: Config, staging: str) -> passes.Scanned:
    """Without dedup there is no full scan: read just enough units (chosen by hash) for the tokenizer's sample (all
    of a DataFrame)."""
    if config.tokenizer.path:
        return passes.Scanned()
    if source.bins is None:
        return source.scan(config, sample_only=True, staging=staging)
    chosen = passes.sample_units(source.bins, config.tokenizer.sample_mb)
    return source.subset(passes.bins(chosen, len(source.bins)), config).scan(config, sample_only=True, staging=staging)


def _stats(agg: list[dict], files: int, config: Config) -> dict:
    """Documents kept and dropped by reason, per split, from rows of :data:`passes.COUNT_COLUMNS`; the files skipped
    and the first malformed record are named."""
    encoding = config.data.encoding
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
        progress.warn(_binary_files(sorted({r["source"] for r in agg if r["status"] == sources.BINARY})))
    first_malformed = _first_malformed(agg, config) if dropped.get(sources.MALFORMED) else ""
    stats = {"files": files, "splits": splits, "dropped": dict(sorted(dropped.items())),
             "documents_read": sum(r["n"] for r in agg if r["status"] != sources.BINARY),
             "invalid_bytes_replaced": sum(invalid_by_file.values())}
    if splits["train"]["documents"] == 0:
        reasons = ", ".join(f"{n} {k}" for k, n in stats["dropped"].items()) or "the inputs hold no text"
        if first_malformed:
            reasons += f"; the first malformed: {first_malformed}"
        raise SparklmError(f"no training documents left after cleaning ({reasons})",
                           hint="check the inputs, data.text_field (and data.label_field), data.doc_mode and data.min_chars")
    if first_malformed:
        progress.warn(f"dropped {dropped[sources.MALFORMED]} malformed record(s); the first: {first_malformed}")
    if splits["validation"]["documents"] == 0:
        progress.warn("the validation split is empty: raise data.val_fraction or pass --validation-input")
    return stats


def _binary_files(names: list[str]) -> str:
    """The warning for files skipped as binary: which, and what they might be."""
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    kinds = {n.lower().rsplit(".", 1)[-1] for n in names}
    if kinds & {"zip", "7z", "tar", "rar", "tgz"}:
        why = "archives are not read: extract them"
    elif kinds & {"pdf", "doc", "docx", "xls", "xlsx", "ppt", "pptx", "odt", "epub"}:
        why = "documents such as PDF or Office files are not read: extract their text first"
    else:
        why = "text in UTF-16 or UTF-32 without a byte-order mark needs data.encoding (e.g. utf-16-le)"
    return f"skipped {len(names)} file(s) that look binary (NUL bytes in their first 8 kB): {shown}; {why}"


def _first_malformed(agg: list[dict], config: Config) -> str:
    """Where the first malformed record is and why, read again from its file."""
    source, pos = min((r["source"], r["first"]) for r in agg if r["status"] == sources.MALFORMED)
    return sources.malformed(source, pos, config.data, config.storage)


def _tokenizer(source: passes.Engine, sample: list[str], config: Config) -> tokenizers_mod.TokenizerSpec:
    tcfg = config.tokenizer
    if tcfg.path:
        from ..model.build import model_source

        # where the path's tokenizer is on this host: a .gguf converted once, a run's model/, or the path itself
        return tokenizers_mod.load(tcfg.path, None if is_remote(tcfg.path) else model_source(tcfg.path))
    with source.stage(f"train tokenizer (vocab {tcfg.vocab_size})"):
        # BPE training does not depend on document order (tested): no sort needed for determinism.
        return tokenizers_mod.train(sample, tcfg)


def _pack_spec(config: Config, spec: tokenizers_mod.TokenizerSpec) -> PackSpec:
    data = config.data
    pad_last = data.last_block == "pad" or (data.last_block == "auto" and not data.concat)
    return PackSpec(seq_len=data.seq_len, stride=data.stride or data.seq_len, pad_id=spec.pad_id,
                    concat=data.concat, pad_last=pad_last)


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


def _check_rows(splits: dict, tokens: dict, pack: PackSpec) -> None:
    """Documents that fill no row: refused for the train split (nothing would train), a warning for validation. Each
    read task packs its own documents, so small inputs spread over many tasks may fill none where one task would."""
    for split in SPLITS:
        entry, tasks = splits[split], tokens[split]["tasks"]
        if entry["sequences"] or not entry["documents"]:
            continue
        apart = f", packed by {tasks} read tasks apart" if tasks > 1 else ""
        what = (f"the {split} split fills no sequence of {pack.seq_len:,} tokens: its {entry['documents']:,} "
                f"document(s) hold {entry['tokens']:,} tokens{apart}, and a last partial sequence is dropped")
        hint = ("prepare more text, a shorter --seq-len, " + ("fewer read tasks (--set data.read_tasks=1), " if apart
                else "") + "or --last-block pad to keep the partial sequences (padded)")
        if split == "train":
            raise SparklmError(what, hint=hint)
        progress.warn(f"{what} ({hint})")


def _manifest(config, inputs, validation_inputs, stats, files, tokens, spec, pack: PackSpec, started,
              spark_start) -> dict:
    splits = {}
    for split in SPLITS:
        metas = files[split]
        entry = stats["splits"][split]
        splits[split] = {
            "documents": entry["documents"],
            "duplicates_dropped": entry["duplicates"],
            "text_bytes": entry["text_bytes"],
            "tokens": tokens[split]["tokens"],
            "sequences": sum(m["rows"] for m in metas),
            "pad_tokens": sum(m["pad_tokens"] for m in metas),
            "dropped_tokens": tokens[split]["dropped_tokens"],
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
        "inputs": [redact.value(i) for i in inputs],  # a credential inside a URI is never written
        "validation_inputs": [redact.value(i) for i in validation_inputs],
        "input": {"files": stats["files"], "documents_read": stats["documents_read"],
                  "dropped": stats["dropped"], "invalid_bytes_replaced": stats["invalid_bytes_replaced"]},
        "splits": splits,
        "packing": {"seq_len": pack.seq_len, "stride": pack.stride, "concat": pack.concat,
                    "last_block": "pad" if pack.pad_last else "drop", "has_attention_mask": pack.has_mask,
                    "targets": "inputs shifted by one (labels = input_ids)",
                    "bos_eos": _framing(config.data, spec), "format": config.data.format,
                    "chat_template": passes.templated(config.data, spec), "loss_mask": config.data.format != "text"},
        "tokenizer": {"file": "tokenizer.json", "sha256": spec.checksum, "vocab_size": spec.vocab_size,
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
    long, kind = labelled.windowing(data), labelled.labels_of(data)
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
            per = dict(kind.figures([m["tally"] or [] for m in metas]))
            rows[split] = {n: per.get(i, 0) for i, n in enumerate(classes["names"])}
        manifest["labels"] = {"field": data.label_field, "names": classes["names"],
                              "documents": classes["documents"], "rows": rows}
        columns["labels"] = kind.describe
    elif kind.labelled:
        manifest["labels"] = {"field": data.label_field, "values": {
            split: kind.figures([m["tally"] for m in metas if m["tally"]]) for split, metas in files.items()}}
        columns["labels"] = kind.describe
        if not manifest["labels"]["values"].get("train", {}).get("rows"):
            raise SparklmError(f"no training record has a number in the label column '{data.label_field}'",
                               hint="name the column of target values with --label-field; its cells must be numbers")
    columns["doc_id"] = "int64, stable id (content hash) of the record"
    manifest["columns"] = columns
    return manifest


def _framing(data, spec) -> str:
    """What one document is, in the manifest's words."""
    bos = "BOS " if spec.add_bos else ""
    if data.format == "text":
        return f"each document is {bos}tokens EOS" + ("" if spec.add_bos else " (the tokenizer's convention: no BOS)")
    if passes.templated(data, spec):
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
    for split, v in m.get("labels", {}).get("values", {}).items():
        if v["rows"]:
            rows.append((f"{split}: label mean ± std", f"{v['mean']:.4g} ± {v['std']:.3g}",
                         f"{v['min']:.4g} … {v['max']:.4g}"))
    if "names" in m.get("labels", {}):
        docs = m["labels"]["documents"]
        rows += [(f"class {name!r}: train / validation", f"{docs['train'][name]:,}", f"{docs['validation'][name]:,}")
                 for name in m["labels"]["names"][:20]]
    t = m["timing"]
    rows.append(("time / throughput", f"{t['seconds']:.1f}s", f"{t['tokens_per_second']:,.0f} tokens/s"))
    progress.table("prepare summary", rows, ("", "", ""))
