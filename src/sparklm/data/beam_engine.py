"""``prepare --engine beam``: the same two passes as an Apache Beam pipeline, for teams on Dataflow or Flink.

The driver plans the read units and their bins exactly as for Spark (:func:`passes.bins`), and each pipeline step
runs the functions the Spark tasks run (:mod:`.passes`): the scan's rows, the copy kept of a duplicated document
(:func:`passes.copy_order`, by a ``GroupByKey`` on content hashes instead of Spark's window), a labelled dataset's
stratified split (:func:`labelled.thresholds` per class, by a ``GroupByKey`` on labels), and
:func:`passes.write_part`. The driver then trains the tokenizer, writes the manifest and commits, as on Spark.

A Beam pipeline hands nothing back to the program that launched it, so the small results the driver needs (counts,
the duplicates to skip, the tokenizer's sample, the write tasks' reports) are written as JSON under the staging
directory's ``_beam/`` (which the runner's workers must reach: a local path for the DirectRunner, an object store
for Dataflow and Flink) and read back; our own files, so no pickle. Needs ``pip install 'sparklm[beam]'``.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import uuid
from contextlib import contextmanager, nullcontext
from functools import partial

from ..config import Config, expand
from ..infra import progress
from ..infra.cache import log_file, process_local
from ..infra.errors import SparklmError, spark_errors
from ..infra.fs import delete, join, read_bytes, write_bytes
from . import labelled, passes, sources

INSTALL = "pip install 'sparklm[beam]' (Apache Beam), or leave out --engine beam to prepare on Spark"
_SCRATCH = "_beam"
# positions in a scan row (passes.SCAN_COLUMNS)
_SOURCE, _POS, _STATUS, _SPLIT, _BYTES, _INVALID, _DIGEST, _SAMPLE, _LABEL, _KEY, _AUTO = (
    passes.SCAN_COLUMNS.index(c) for c in ("source", "pos", "status", "split", "n_bytes", "n_invalid", "digest",
                                           "sample", "label", "split_key", "auto"))
# the pipeline options that say how many workers a runner has (the read tasks are 4 per worker, as on Spark)
_WORKER_OPTIONS = ("direct_num_workers", "num_workers", "max_num_workers", "parallelism")


def check(config: Config, frame: bool) -> None:
    """Refuse, in one line and before any work, what the Beam engine cannot do."""
    if frame:
        raise SparklmError("--engine beam reads files (local paths, globs or object-store URLs), not a Spark DataFrame",
                           hint="pass paths, or prepare the DataFrame on Spark (the default engine)")
    _beam()
    for key in _WORKER_OPTIONS:
        value = config.beam.options.get(key)
        if value is not None and not (value.isdigit() and int(value) > 0):
            raise SparklmError(f"beam.options.{key} is {value!r}", hint="give a whole number of workers, e.g. 2")


_FETCH_HINTS = {"PrismRunner": "give its binary with --pipeline-option prism_location=PATH",
                "FlinkRunner": "give the job server jar with --pipeline-option flink_job_server_jar=PATH"}


def _start_failure(runner: str, e: Exception) -> SparklmError | None:
    """The one line for a runner that could not start, else None."""
    text = " ".join(str(e).split())
    if isinstance(e, ImportError):
        return SparklmError(f"the {runner} needs a package that is not installed ({text[:200]})",
                            hint="for Dataflow: pip install 'apache-beam[gcp]'" if runner == "DataflowRunner" else
                            f"install what the {runner} needs, or use --runner DirectRunner")
    if "validations errors" in text:  # Beam's own check of the options a runner requires
        missing = text.split(":", 1)[-1].strip()
        return SparklmError(f"the {runner} is missing pipeline options: {missing}",
                            hint="give each with --pipeline-option KEY=VALUE (docs/beam.md)")
    if "Unable to fetch remote" in text:  # a runner's binary or jar downloaded at start, and no internet
        return SparklmError(f"the {runner} could not be started: {text[:400]}",
                            hint=f"{_FETCH_HINTS.get(runner, 'allow the download')}, or use --runner DirectRunner")
    return None


def _beam():
    """``apache_beam``, imported quietly (it logs a warning about Google Cloud clients it does not find)."""
    logging.disable(logging.WARNING)
    try:
        import apache_beam
    except ImportError:
        raise SparklmError("--engine beam needs Apache Beam, which is not installed", hint=INSTALL) from None
    finally:
        logging.disable(logging.NOTSET)
    logging.getLogger("apache_beam").setLevel(logging.CRITICAL)  # a failure comes back as the error it raised
    return apache_beam


def workers(config: Config) -> int:
    """How many workers the pipeline has: the option that says so, else this machine's cores (DirectRunner)."""
    for key in _WORKER_OPTIONS:
        if key in config.beam.options:
            return int(config.beam.options[key])
    return os.cpu_count() or 1


def pipeline_args(config: Config) -> list[str]:
    """The runner and options as Beam's command-line flags; the DirectRunner runs one process per worker (its default,
    one thread in this process, would hold Python's lock through the cleaning)."""
    options = {k: expand(v, f"beam.options.{k}") for k, v in config.beam.options.items()}
    if config.beam.runner == "DirectRunner":
        options.setdefault("direct_running_mode", "multi_processing")
        options.setdefault("direct_num_workers", str(workers(config)))
    options.setdefault("default_sdk_harness_log_level", "CRITICAL")  # failures come back as errors
    return [f"--runner={config.beam.runner}", *(f"--{k}={v}" for k, v in options.items())]


class BeamSource:
    """The read units of a ``prepare``, binned as on Spark, and the two passes as Beam pipelines over those bins."""

    def __init__(self, units: list[sources.ReadUnit], config: Config, *, bins: list | None = None):
        self.config = config
        self.bins = bins if bins is not None else passes.bins(units, passes.read_tasks(config.data, workers(config)))
        self.planned_bytes = passes.planned_bytes(self.bins)
        self.count = len({u.uri for b in self.bins for u in b})
        self.label = f"{self.count} files"

    def subset(self, bins: list[list[sources.ReadUnit]], config: Config) -> BeamSource:
        return BeamSource([], config, bins=bins)

    def describe(self) -> dict:
        return {"name": "beam", "runner": self.config.beam.runner, "read_tasks": len(self.bins)}

    def stage(self, name: str):
        return progress.stage(None, name)

    def errors(self):
        """A :class:`SparklmError` raised in a worker comes back as itself (its text travels inside the runner's
        error); a runner that cannot start (options missing, its binary or jar not found, a missing package) is one
        line."""
        return spark_errors("a Beam worker", partial(_start_failure, self.config.beam.runner))

    def release(self) -> None:
        pass

    def _run(self, build, label: str | None = None) -> None:
        """Build a pipeline with ``build(pipeline, beam)`` and run it to the end (in a stage named ``label``)."""
        beam = _beam()
        from apache_beam.options.pipeline_options import PipelineOptions

        with self.stage(f"{label} (Beam, {self.config.beam.runner})") if label else nullcontext(), _workers_log():
            with beam.Pipeline(options=PipelineOptions(pipeline_args(self.config))) as p:
                build(p, beam)

    def _bins(self, p, beam):
        # Reshuffle: the bins spread over the workers instead of staying in the one bundle Create makes
        return p | "bins" >> beam.Create(list(enumerate(self.bins))) | "spread" >> beam.Reshuffle()

    def scan(self, config: Config, *, sample_only: bool, staging: str) -> passes.Scanned:
        """Pass 1: the scan's rows, each duplicate's copy number, and the small results for the driver."""
        data, storage = config.data, config.storage
        fraction = passes.sample_fraction(config, self.planned_bytes)
        scratch = join(staging, _SCRATCH)
        dedup = data.dedup and not sample_only
        classify = labelled.labels_of(data).stratified and not sample_only

        def build(p, beam):
            rows = self._bins(p, beam) | "read + clean" >> beam.FlatMap(_scan_bin, data, storage, fraction)
            if dedup:
                hashed = (rows | "documents" >> beam.Filter(lambda r: r[_DIGEST] is not None)
                          | "by hash" >> beam.Map(lambda r: (r[_DIGEST], r)) | "copies" >> beam.GroupByKey()
                          | "number" >> beam.FlatMap(_numbered))
                rest = rows | "dropped" >> beam.Filter(lambda r: r[_DIGEST] is None) | "once" >> beam.Map(lambda r: (r, 1))
                meta = (hashed, rest) | "all" >> beam.Flatten()
            else:
                meta = rows | "first copies" >> beam.Map(lambda r: (r, 1))
            if classify:
                meta = _stratify(beam, meta, data.val_fraction, scratch, storage)
            if not sample_only:
                (meta | "count key" >> beam.Map(_count_key) | "count" >> beam.CombinePerKey(_add)
                 | "count rows" >> beam.combiners.ToList() | "save counts" >> beam.Map(_save, scratch, "agg", storage))
                (meta | "duplicates" >> beam.Filter(lambda m: m[1] > 1) | "where" >> beam.Map(lambda m: (m[0][_SOURCE], m[0][_POS]))
                 | "duplicate list" >> beam.combiners.ToList()
                 | "save duplicates" >> beam.Map(_save, scratch, "losers", storage))
            (meta | "sampled" >> beam.Filter(lambda m: m[1] == 1 and m[0][_SAMPLE] is not None)
             | "text" >> beam.Map(lambda m: m[0][_SAMPLE]) | "sample" >> beam.combiners.ToList()
             | "save sample" >> beam.Map(_save, scratch, "sample", storage))

        try:
            self._run(build, f"read {self.label} for the tokenizer's sample" if sample_only else
                      f"read + clean + {'split by label + ' if classify else ''}deduplicate {self.label}")
            out = passes.Scanned(sample=_load(scratch, "sample", storage))
            if not sample_only:
                out.agg = [dict(zip(passes.COUNT_COLUMNS, (*k, *v))) for k, v in _load(scratch, "agg", storage)]
                losers: dict[str, set[int]] = {}
                for source, pos in _load(scratch, "losers", storage):
                    losers.setdefault(source, set()).add(pos)
                out.losers = {k: frozenset(v) for k, v in losers.items()}
            if classify:
                out.cut = _load(scratch, "cut", storage)
                out.class_counts = [{"split": k[0], "label": k[1], "count": n} for k, n in _load(scratch, "classes",
                                                                                                 storage)]
            return out
        finally:
            delete(scratch, storage)

    def write(self, plan: passes.WritePlan, losers: dict) -> list[dict]:
        """Pass 2: :func:`passes.write_part` for each bin; the reports come back through a file."""
        storage = plan.config.storage
        scratch = join(plan.staging, _SCRATCH)
        _save({k: sorted(v) for k, v in losers.items()}, scratch, "skip", storage)

        def build(p, beam):
            (self._bins(p, beam) | "tokenize + pack + write" >> beam.FlatMap(_write_bin, plan, scratch)
             | "reports" >> beam.combiners.ToList() | "save reports" >> beam.Map(_save, scratch, "reports", storage))

        try:
            self._run(build)  # inside prepare's stage
            return _load(scratch, "reports", storage)
        finally:
            delete(scratch, storage)


_LOG: list = []  # this process's log file for the workers' output


@contextmanager
def _workers_log():
    """The DirectRunner's worker processes write to the stderr they inherit (start-up notes, and each failure's
    traceback, which comes back here as the error it raised): while a pipeline runs, that is a log file under the
    user's cache directory, as Spark's JVM output is; the progress line stays on the terminal."""
    if not _LOG:
        _LOG.append(log_file("beam"))
        progress.info(f"[dim]Beam workers' log: {_LOG[0]}[/dim]")
    path = _LOG[0]
    sys.stderr.flush()
    saved = os.dup(2)
    with open(path, "ab") as log:
        os.dup2(log.fileno(), 2)
    # the console keeps the terminal when it wrote there through fd 2 (not in a notebook or under pytest's capture)
    terminal = os.fdopen(os.dup(saved), "w") if _on_fd2(sys.stderr) else None
    try:
        with progress.written_to(terminal) if terminal else nullcontext():
            yield path
    finally:
        if terminal:
            terminal.close()
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)


def _on_fd2(stream) -> bool:
    try:
        return stream.fileno() == 2
    except (AttributeError, OSError, ValueError):  # a notebook's stream, a test's capture
        return False


# -- what the workers run (module-level functions: Beam pickles them by reference) -----------------------------------


def _scan_bin(element, data, storage, fraction):
    _, bin_ = element
    yield from passes.scan_rows(sources.documents(bin_, data, storage), data, fraction)


def _numbered(element):
    """The copies of one document, numbered in :func:`passes.copy_order` (1: the one kept)."""
    _, rows = element
    ranked = sorted(rows, key=lambda r: passes.copy_order(r[_SPLIT], r[_SOURCE], r[_POS]))
    return [(r, i + 1) for i, r in enumerate(ranked)]


def _stratify(beam, meta, fraction: float, scratch: str, storage):
    """A labelled dataset's split, as on Spark (:func:`labelled.stratify`): each class's first copies of hash-split
    records, ranked by split key, give its validation threshold (:func:`labelled.thresholds`); every such record then
    takes its split from its class's threshold. Saves the thresholds and the (split, label) counts."""
    keys = (meta | "labelled" >> beam.Filter(lambda m: m[1] == 1 and m[0][_AUTO] and m[0][_STATUS] == sources.OK)
            | "by label" >> beam.Map(lambda m: (m[0][_LABEL], m[0][_KEY])) | "classes" >> beam.GroupByKey()
            | "keys" >> beam.MapTuple(lambda label, ks: (label, list(ks))) | "all classes" >> beam.combiners.ToList()
            | "thresholds" >> beam.Map(lambda pairs: labelled.thresholds(dict(pairs), fraction)))
    keys | "save thresholds" >> beam.Map(_save, scratch, "cut", storage)
    meta = meta | "split by label" >> beam.Map(_stratified, beam.pvalue.AsSingleton(keys))
    (meta | "kept records" >> beam.Filter(lambda m: m[1] == 1 and m[0][_STATUS] == sources.OK)
     | "class key" >> beam.Map(lambda m: ((m[0][_SPLIT], m[0][_LABEL]), 1)) | "per class" >> beam.CombinePerKey(sum)
     | "class rows" >> beam.combiners.ToList() | "save classes" >> beam.Map(_save, scratch, "classes", storage))
    return meta


def _stratified(m, cut: dict):
    r, copy = m
    if not (r[_AUTO] and r[_STATUS] == sources.OK):
        return m
    split = labelled.split_of("auto", r[_KEY], r[_LABEL], cut)
    return (*r[:_SPLIT], split, *r[_SPLIT + 1:]), copy


def _count_key(m):
    """(source, status, split, kept) → (documents, text bytes, invalid bytes, first position), as Spark's group-by
    counts them."""
    r, copy = m
    return (r[_SOURCE], r[_STATUS], r[_SPLIT], copy == 1), (1, r[_BYTES], r[_INVALID], r[_POS])


def _add(values):
    n = b = bad = 0
    first = None
    for x, y, z, p in values:
        n, b, bad, first = n + x, b + y, bad + z, p if first is None else min(first, p)
    return n, b, bad, first


def _save(value, scratch: str, name: str, storage) -> None:
    # numpy's integers (a writer's counts) as plain numbers
    write_bytes(join(scratch, f"{name}.json"), json.dumps(value, default=lambda o: o.item()).encode(), storage)


def _load(scratch: str, name: str, storage):
    return json.loads(read_bytes(join(scratch, f"{name}.json"), storage))


def _write_bin(element, plan: passes.WritePlan, scratch: str):
    """One bin's part files; the duplicates to skip are read once per worker process."""
    task, bin_ = element
    losers = process_local(("beam-skip", scratch), lambda: {
        k: frozenset(v) for k, v in _load(scratch, "skip", plan.config.storage).items()})
    name = passes.part_name(task, uuid.uuid4().hex)  # a retried bundle writes beside its failed try, never over it
    yield from passes.write_part(sources.documents(bin_, plan.config.data, plan.config.storage), name, plan, losers)
