"""The SparkSession: local by default, any master URL otherwise, or the caller's own session."""

from __future__ import annotations

import os
import sys
import time
from contextlib import contextmanager
from importlib import resources

from .cache import cache_dir
from .config import SparkConfig
from .errors import SparklmError
from .java import class_cache_flags, find_java_home, note_class_cache_writer


def get_session(config: SparkConfig | None = None, *, spark=None, jvm_log: str | None = None):
    """Return ``spark`` if given, else the active session, else a new one built from ``config``.

    Python workers run on this interpreter (``PYSPARK_PYTHON``) unless the environment or
    ``spark.pyspark.python`` says otherwise: without it executors start the system ``python3``,
    which lacks this project's packages. With ``jvm_log``, the JVM's own output (start-up banner,
    Spark logs, Python worker stderr) goes to that file instead of the console.
    """
    from pyspark.sql import SparkSession

    if spark is not None:
        return spark
    active = SparkSession.getActiveSession()
    if active is not None:
        return active
    config = config or SparkConfig()
    java_home = os.environ["JAVA_HOME"] = find_java_home()
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    if config.master.startswith("local"):
        # The host name may resolve to an unreachable address; local mode needs only loopback.
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    log4j = resources.files("sparklm") / "log4j2.properties"
    cds, pending = class_cache_flags(java_home, config.conf) if config.class_cache else ([], None)
    confs = {
        "spark.ui.enabled": "true" if config.ui else "false",
        "spark.ui.showConsoleProgress": "false",  # sparklm draws its own progress
        "spark.driver.memory": "4g",
        "spark.sql.execution.arrow.pyspark.enabled": "true",
        # DDP's barrier stage: fail in seconds, not minutes, when there are too few slots (Spark retries its
        # check 40 times every 15 s by default), and never wait forever for a rank that does not arrive
        "spark.scheduler.barrier.maxConcurrentTasksCheck.maxFailures": "3",
        "spark.scheduler.barrier.maxConcurrentTasksCheck.interval": "5s",
        "spark.barrier.sync.timeout": "600s",
        "spark.driver.extraJavaOptions": " ".join([f"-Dlog4j2.configurationFile=file:{log4j}", *cds]),
    }
    for key, value in config.conf.items():
        if key == "spark.driver.extraJavaOptions":
            value = f"{confs[key]} {value}"
        confs[key] = value
    builder = SparkSession.builder.master(config.master).appName(config.app_name)
    for key, value in confs.items():
        builder = builder.config(key, value)
    try:
        with _stderr_to(jvm_log):
            spark = builder.getOrCreate()
    except Exception as e:  # the JVM did not start or the master is unreachable
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise SparklmError(
            f"could not start Spark with master '{config.master}': {first}",
            hint=f"check --master and --conf values{f'; Spark log: {jvm_log}' if jvm_log else ''}; --debug shows more",
        ) from e
    if pending is not None:  # spark-class execs the JVM: the launched process is the driver JVM
        note_class_cache_writer(pending, getattr(getattr(spark.sparkContext._gateway, "proc", None), "pid", None))
    spark.sparkContext.setLogLevel(config.log_level)
    return spark


def default_jvm_log() -> str:
    """Where the CLI sends the JVM's output: a fresh file under the user's cache directory."""
    logs = cache_dir("logs")
    logs.mkdir(parents=True, exist_ok=True)
    return str(logs / f"spark-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log")


@contextmanager
def _stderr_to(path: str | None):
    """Point file descriptor 2 at ``path`` while the JVM starts: the child keeps it, we get ours back."""
    if path is None:
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    with open(path, "ab") as log:
        os.dup2(log.fileno(), 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
