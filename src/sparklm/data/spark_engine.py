"""``prepare`` on Spark (the default engine): both passes as Spark jobs over bins of read units (or a DataFrame's
partitions), and no shuffle of text. The scan's small metadata table is a DataFrame, so duplicates are decided by a
window over content hashes and a labelled dataset's classes are split by a window per label; the write pass is one
``mapPartitions`` of :func:`passes.write_part`.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from ..config import Config
from ..infra import progress
from ..infra.errors import spark_errors
from . import allocator, labelled, passes, sources


@dataclass
class SparkSource:
    """What both passes read, as an RDD whose partitions the executor-side ``read(partition)`` turns into
    :func:`sources.documents`' tuples: bins of file read units, or a DataFrame's rows (persisted, so that both
    passes see the same rows in the same partitions)."""

    spark: object
    rdd: object
    partitions: int
    read: object  # Iterator of the RDD's partition -> Iterator of documents' tuples
    planned_bytes: int  # a rough size of the text, to bound the tokenizer's sample
    label: str  # "3 files", "the DataFrame"
    count: int  # input files (DataFrames)
    bins: list | None = None  # files only: the read units, by task
    cached: object = None
    preload: str | None = None  # the malloc the write pass's workers start on (allocator.library), None: the system's
    allocators: list[str] = field(default_factory=list)  # what the write tasks tokenized on (allocator.loaded)

    @classmethod
    def of_files(cls, spark, bins: list[list[sources.ReadUnit]], data, storage, preload: str | None = None
                 ) -> SparkSource:
        def read(it):
            for bin_ in it:
                yield from sources.documents(bin_, data, storage)

        n = len({u.uri for b in bins for u in b})
        return cls(spark, spark.sparkContext.parallelize(bins, len(bins)), len(bins), read, passes.planned_bytes(bins),
                   f"{n} files", n, bins, preload=preload)

    @classmethod
    def of_frame(cls, spark, rows, cols: list[str], data, count: int, preload: str | None = None) -> SparkSource:
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
        return cls(spark, rows.rdd, parts, read, planned, "the DataFrame" if count == 1 else f"{count} DataFrames",
                   count, None, rows, preload=preload)

    def subset(self, bins: list[list[sources.ReadUnit]], config: Config) -> SparkSource:
        """The same engine over other bins (the units the tokenizer's sample is read from)."""
        return SparkSource.of_files(self.spark, bins, config.data, config.storage)

    def stage(self, name: str):
        return progress.stage(self.spark, name)

    def errors(self):
        return spark_errors()

    def release(self) -> None:
        if self.cached is not None:
            self.cached.unpersist()

    def describe(self) -> dict:
        out = {"name": "spark", "master": self.spark.sparkContext.master, "read_tasks": self.partitions}
        return {**out, "allocator": self.allocators} if self.allocators else out

    def scan(self, config: Config, *, sample_only: bool, staging: str = "") -> passes.Scanned:
        """Read and clean, keeping only metadata and a bounded text sample for the tokenizer; decide duplicates (and
        a labelled dataset's split) on that small table."""
        from pyspark import StorageLevel
        from pyspark.sql import Window
        from pyspark.sql import functions as F

        data = config.data
        fraction = passes.sample_fraction(config, self.planned_bytes)
        read = self.read

        def scan(it):
            yield from passes.scan_rows(read(it), data, fraction)

        meta = self.spark.createDataFrame(self.rdd.mapPartitions(scan), passes.SCAN_DDL)
        if data.dedup and not sample_only:  # passes.copy_order, as a window over each content hash
            # as many partitions as scan tasks, not spark.sql.shuffle.partitions (200): the rows are small, and the
            # persisted frame keeps its partitioning for each of the jobs below (adaptive execution cannot coalesce it)
            meta = meta.repartition(self.partitions, "digest")
            order = Window.partitionBy("digest").orderBy(F.coalesce(F.col("split") == "train", F.lit(False)).asc(),
                                                         "source", "pos")
            meta = meta.withColumn("copy", F.when(F.col("digest").isNull(), 1).otherwise(F.row_number().over(order)))
        else:
            meta = meta.withColumn("copy", F.lit(1))
        persisted = meta = meta.persist(StorageLevel.MEMORY_AND_DISK)
        try:
            out = passes.Scanned()
            if labelled.labels_of(data).stratified and not sample_only:
                with self.stage(f"read + clean + split {self.label} by label"):
                    meta, out.cut = labelled.stratify(meta, data.val_fraction)
                    out.class_counts = [r.asDict() for r in meta.where((F.col("status") == sources.OK) & (F.col("copy") == 1))
                                        .groupBy("split", "label").count().collect()]
            if not sample_only:
                with self.stage(f"read + clean + deduplicate {self.label}"):
                    out.agg = [r.asDict() for r in meta.groupBy("source", "status", "split",
                                                                (F.col("copy") == 1).alias("kept"))
                               .agg(F.count("*").alias("n"), F.sum("n_bytes").alias("bytes"),
                                    F.sum("n_invalid").alias("invalid"), F.min("pos").alias("first")).collect()]
                    # collect(), not toLocalIterator(): that runs one Spark job per shuffle partition (200)
                    losers: dict[str, list[int]] = defaultdict(list)
                    for r in meta.where(F.col("copy") > 1).select("source", "pos").collect():
                        losers[r["source"]].append(r["pos"])
                    out.losers = {k: frozenset(v) for k, v in losers.items()}
            # bounded by tokenizer.sample_mb, so collecting it is safe for the driver
            out.sample = [r["sample"] for r in meta.where((F.col("copy") == 1) & F.col("sample").isNotNull())
                          .select("sample").collect()]
            return out
        finally:
            persisted.unpersist()

    def write(self, plan: passes.WritePlan, losers: dict) -> list[dict]:
        """Pass 2: :func:`passes.write_part` in each task, its Python workers on ``tokenizer.allocator``'s malloc
        (:mod:`.allocator`); the reports come back to the driver."""
        sc = self.spark.sparkContext
        plan_bc, losers_bc = sc.broadcast(plan), sc.broadcast(losers)
        read = self.read

        def write(it):
            from pyspark import TaskContext

            ctx = TaskContext.get()
            passes.share_cpus(ctx.cpus())
            name = passes.part_name(ctx.partitionId(), str(ctx.attemptNumber()))
            yield from passes.write_part(read(it), name, plan_bc.value, losers_bc.value)

        with allocator.workers_on(sc, self.preload):
            reports = self.rdd.mapPartitions(write).collect()
        self.allocators = sorted({r["allocator"] for r in reports if r["split"] == ""})
        if self.preload is not None and "system" in self.allocators:  # ld.so could not find it where some task ran
            progress.warn(f"tokenizer.allocator {self.preload} was not loaded where {'some' if len(self.allocators) > 1 else 'the'}"
                          " write tasks ran (they tokenized on the system malloc): install it on every host, or set "
                          "tokenizer.allocator to auto or system")
        return reports

