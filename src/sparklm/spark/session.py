"""The SparkSession: local by default, any master URL otherwise, or the caller's own session."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from contextlib import contextmanager
from importlib import resources

from ..config import SparkConfig, expand
from ..infra import progress, redact
from ..infra.cache import log_file
from ..infra.errors import SparklmError, spark_errors
from ..version import __version__
from . import environment
from .java import class_cache_flags, find_java_home, note_class_cache_writer

# Which commands run on what: shown when a Spark Connect session (no RDDs, no barrier tasks) is found.
CONNECT_MESSAGE = ("this is a Spark Connect session (Databricks shared/serverless compute, or SPARK_REMOTE / "
                   "spark.remote set): sparklm's prepare, train, eval and batch generation run Python on the executors "
                   "through RDDs and barrier tasks, which Spark Connect does not offer")
CONNECT_HINT = ("use a classic cluster (Databricks: single-user/dedicated access mode), or unset SPARK_REMOTE; "
                "`sparklm generate --prompt` and `export` need no Spark")


def get_session(config: SparkConfig | None = None, *, spark=None, jvm_log: str | None = None):
    """Return ``spark`` if given, else the active session, else a new one built from ``config``.

    Settings already made win over sparklm's defaults: spark-submit's (``--master``, ``--name``, ``--conf``,
    ``--driver-memory``), ``spark-defaults.conf``, an active session's. sparklm adds only what is unset; what
    the user gave sparklm itself (``--master``, ``--conf``) counts as set. Python workers run on this
    interpreter (``PYSPARK_PYTHON``) unless the environment says otherwise, or, on a cluster whose executors
    cannot import sparklm, on this environment shipped as an archive (``spark.ship_env``). With ``jvm_log``,
    the JVM's own output goes to that file instead of the console.
    """
    config = config or SparkConfig()
    if spark is None:
        refuse_connect()

    if spark is None:
        spark = active_session()
    if spark is not None:
        if is_connect(spark):
            raise SparklmError(CONNECT_MESSAGE, hint=CONNECT_HINT)
        check_workers_python(spark)
        return spark
    java_home = os.environ["JAVA_HOME"] = find_java_home()
    preset = preset_conf()
    master = config.master or preset.get("spark.master") or "local[*]"
    # an interpreter the user chose for the executors (not the one sparklm would choose) is theirs to provide
    chosen = os.environ.get("PYSPARK_PYTHON", sys.executable)
    if environment.is_shipped(chosen):  # left by an earlier session of this process
        del os.environ["PYSPARK_PYTHON"]
    user_python = (chosen != sys.executable and not environment.is_shipped(chosen)) or \
        "spark.pyspark.python" in {**preset, **config.conf}
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    if master.startswith("local"):
        # The host name may resolve to an unreachable address; local mode needs only loopback.
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    log4j = resources.files("sparklm") / "log4j2.properties"
    cds, pending = class_cache_flags(java_home, config.conf) if config.class_cache else ([], None)
    defaults = {
        "spark.app.name": "sparklm",
        "spark.ui.enabled": "true" if config.ui else "false",
        "spark.ui.showConsoleProgress": "false",  # sparklm draws its own progress
        "spark.driver.memory": "4g",
        # rounds return each worker's weight delta as a task result: a full 135M-parameter model's is 538 MB, past
        # the 1 GiB default for two workers; the driver's memory is the real bound (its exhaustion is one line)
        "spark.driver.maxResultSize": "0",
        "spark.sql.execution.arrow.pyspark.enabled": "true",
        # DDP's barrier stage: fail in seconds, not minutes, when there are too few slots (Spark retries its
        # check 40 times every 15 s by default), and never wait forever for a rank that does not arrive
        "spark.scheduler.barrier.maxConcurrentTasksCheck.maxFailures": "3",
        "spark.scheduler.barrier.maxConcurrentTasksCheck.interval": "5s",
        "spark.barrier.sync.timeout": "600s",
        "spark.driver.extraJavaOptions": " ".join([f"-Dlog4j2.configurationFile=file:{log4j}", *cds]),
    }
    if master.startswith("local") and not user_python:  # the workers run this environment: see sparklm.spark.daemon
        defaults["spark.python.daemon.module"] = "sparklm.spark.daemon"
    user = {k: expand(v, f"spark.conf {k}") for k, v in config.conf.items()}  # ${env:NAME} read here only
    confs = session_conf(defaults, preset, {**user, **({"spark.app.name": config.app_name} if config.app_name else {})})
    confs.update(redaction_conf({**preset, **confs}))
    ship = config.ship_env == "on" and not master.startswith("local")
    spark = _start(master, confs, pending, config, jvm_log, ship)
    if (config.ship_env == "auto" and not master.startswith("local") and not user_python
            and not executors_have_sparklm(spark)):
        # The executors' hosts lack this environment (a cluster without the packages): start again with it shipped.
        spark.stop()
        spark = _start(master, confs, pending, config, jvm_log, True)
    return spark


def redaction_conf(settings: dict[str, str]) -> dict[str, str]:
    """Spark's redaction settings from sparklm's rule, so that its UI and event logs mask what sparklm masks: the key
    rule, and the credentials inside values (Spark also tests its key regex on each value, and masks the whole value:
    ``spark.hadoop.fs.defaultFS=abfss://:KEY@...`` on the environment page). A regex the user set (``--conf``,
    spark-defaults.conf) is kept and ours added to it: Spark then masks what either masks."""
    out = {}
    for key, ours in (("spark.redaction.regex", f"{redact.KEY_RULE}|{redact.VALUE_RULE}"),
                      ("spark.redaction.string.regex", redact.VALUE_RULE)):
        theirs = settings.get(key, "")
        out[key] = theirs if ours in theirs else f"(?:{theirs})|{ours}" if theirs else ours
    return out


def active_session():
    """The session this process runs, if any: the active one, or one started in another thread (the active session
    is per thread; a notebook kernel may run each cell in a thread of its own, while the SparkContext is one per
    process)."""
    from pyspark import SparkContext
    from pyspark.sql import SparkSession

    active = SparkSession.getActiveSession()
    if active is None and SparkContext._active_spark_context is not None:
        active = SparkSession.builder.getOrCreate()  # the running context's session: nothing new is started
    return active


def session_conf(defaults: dict[str, str], preset: dict[str, str], user: dict[str, str]) -> dict[str, str]:
    """The settings sparklm passes to a new session: its defaults where nothing set them already (``preset``:
    spark-submit's or spark-defaults.conf's), then the user's own sparklm settings on top. Java options are
    joined, not replaced: sparklm's (logging, class cache) stay in front of the user's."""
    confs = {k: v for k, v in defaults.items() if k not in preset}
    for key, value in user.items():
        if key == "spark.driver.extraJavaOptions" and key in confs:
            value = f"{confs[key]} {value}"
        confs[key] = value
    return confs


def planned_master(config: SparkConfig | None = None, spark=None) -> str:
    """The master a run will use, known before its session starts: ``spark``'s or the active session's, else the
    one :func:`get_session` would choose (sparklm's setting, spark-submit's or spark-defaults.conf's, local[*])."""
    if spark is not None:
        return spark.sparkContext.master
    if "pyspark" in sys.modules:  # a session can only be active where pyspark was imported

        active = active_session()
        if active is not None:
            return active.sparkContext.master
    config = config or SparkConfig()
    return config.master or preset_conf().get("spark.master") or "local[*]"


def planned_conf(config: SparkConfig | None, key: str, spark=None) -> str | None:
    """The value Spark setting ``key`` will have, known before the session starts (as :func:`planned_master`):
    ``spark``'s or the active session's, else sparklm's own setting over spark-submit's or spark-defaults.conf's."""
    if spark is None and "pyspark" in sys.modules:

        spark = active_session()
    if spark is not None:
        return spark.sparkContext.getConf().get(key)
    return (config or SparkConfig()).conf.get(key) or preset_conf().get(key)


def preset_conf() -> dict[str, str]:
    """Spark settings made before sparklm runs: under spark-submit (the JVM is already up), its whole
    configuration; otherwise ``spark-defaults.conf`` (``$SPARK_CONF_DIR`` or ``$SPARK_HOME/conf``)."""
    if "PYSPARK_GATEWAY_PORT" in os.environ:  # spark-submit started this Python and its JVM
        from pyspark import SparkConf, SparkContext

        SparkContext._ensure_initialized()
        return dict(SparkConf().getAll())
    conf_dir = os.environ.get("SPARK_CONF_DIR") or (os.path.join(os.environ["SPARK_HOME"], "conf")
                                                    if os.environ.get("SPARK_HOME") else None)
    if conf_dir is None:
        return {}
    return read_defaults(os.path.join(conf_dir, "spark-defaults.conf"))


def read_defaults(path: str) -> dict[str, str]:
    """``key value`` lines of a spark-defaults.conf (``=`` or ``:`` also separate, as in Java properties)."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError:
        return {}
    out = {}
    for line in lines:
        m = re.match(r"\s*([^#!\s=:][^\s=:]*)(?:\s*[\s=:]\s*(.*?))?\s*$", line)
        if m:
            out[m.group(1)] = m.group(2) or ""  # a key alone has the empty value, as in Java properties
    return out


def check_shared(spark, paths: dict[str, str]) -> None:
    """Stop with one line when a local path the job needs on the executors is not visible there.

    ``paths``: {what it is: path}. Object-store URLs and local mode need no check. For each local path the
    driver writes a probe file beside it and one task per executor host looks for it; a cluster whose hosts
    share nothing but object storage fails here, before any work, rather than writing a run to whichever
    host ran rank 0.
    """
    import uuid

    from ..infra.fs import is_remote

    if spark.sparkContext.master.startswith("local"):
        return
    probes = {}
    for what, path in paths.items():
        if is_remote(path):
            continue
        path = os.path.abspath(os.path.expanduser(path))
        directory = path
        while not os.path.isdir(directory) and os.path.dirname(directory) != directory:
            directory = os.path.dirname(directory)  # a new output: its nearest existing parent
        probe = os.path.join(directory, f".sparklm-probe-{uuid.uuid4().hex[:12]}")
        try:
            open(probe, "w").close()
        except OSError:
            continue  # unwritable here: the command's own checks say so
        probes[what] = (path, probe)
    if not probes:
        return
    files = [p for _, p in probes.values()]

    def look(_):
        yield [os.path.exists(p) for p in files]

    sc = spark.sparkContext
    n = max(1, sc.defaultParallelism)
    sc.setJobDescription("sparklm: do the executors see the driver's paths?")
    try:
        with spark_errors():
            seen = sc.parallelize(range(n), n).mapPartitions(look).collect()
    finally:
        sc.setJobDescription(None)
        for p in files:
            try:
                os.unlink(p)
            except OSError:
                pass
    for i, (what, (path, _)) in enumerate(probes.items()):
        if not all(s[i] for s in seen):
            raise SparklmError(f"{what} {path} is a local path of the driver that the executors do not see",
                               hint="put it where every host reads it: an object store (s3://bucket/...) or a "
                                    "shared mount (NFS, /dbfs/...)")


def is_connect(spark) -> bool:
    """A Spark Connect session: a client of a remote server, without SparkContext, RDDs or barrier tasks."""
    return type(spark).__module__.startswith("pyspark.sql.connect")


def refuse_connect() -> None:
    """Stop with one line when the environment asks for Spark Connect (``SPARK_REMOTE``, or the
    ``SPARK_CONNECT_MODE_ENABLED`` that Databricks sets): checked before pyspark.sql picks a client."""
    if os.environ.get("SPARK_REMOTE") or os.environ.get("SPARK_CONNECT_MODE_ENABLED"):
        raise SparklmError(CONNECT_MESSAGE, hint=CONNECT_HINT)


_CHECKED: set[str] = set()  # applications whose Python workers were checked


def check_workers_python(spark) -> None:
    """A session sparklm did not start (a notebook's, spark-submit's) runs its Python workers with the interpreter
    it chose (PYSPARK_PYTHON when it started, else ``python3`` from PATH), which may lack sparklm — a kernel
    started by path has its environment's interpreter but not its ``bin/`` on PATH. In local mode the workers run
    on this host, so where that interpreter cannot import sparklm they run this one instead; on a cluster, one
    line before any job. Once per application."""
    sc = spark.sparkContext
    python = getattr(sc, "pythonExec", None) or "python3"
    if sc.applicationId in _CHECKED or environment.is_shipped(python):
        return
    found = shutil.which(python) or python
    # paths compared as they are: a virtual environment's python is a link to the base interpreter, which has
    # the same real path and none of the environment's packages
    if os.path.abspath(found) != os.path.abspath(sys.executable):
        if sc.master.startswith("local"):  # local[N] and local-cluster: the workers run on this host
            if not _imports_sparklm(found):
                sc.pythonExec = sys.executable  # read by every Python function Spark ships from now on
        elif not executors_have_sparklm(spark):
            raise SparklmError(f"this Spark session's executors run {python}, which cannot import sparklm (or torch)",
                               hint="start the session with spark.pyspark.python set to an interpreter that has "
                                    "sparklm on every host, or let sparklm start it (spark.ship_env sends this "
                                    "environment with the job)")
    _CHECKED.add(sc.applicationId)


def _imports_sparklm(python: str) -> bool:
    try:
        return subprocess.run([python, "-c", "import sparklm.version, torch"], capture_output=True,
                              timeout=120).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def executors_have_sparklm(spark) -> bool:
    """Whether a task on an executor imports this sparklm version (and torch): a cluster whose hosts have
    the packages needs nothing shipped."""
    want = __version__

    def probe(_):
        try:
            import torch  # noqa: F401

            from sparklm.version import __version__ as have
        except Exception:
            have = None
        yield have

    sc = spark.sparkContext
    sc.setJobDescription("sparklm: can the executors import sparklm?")
    try:
        found = sc.parallelize([0], 1).mapPartitions(probe).collect()
    except Exception:  # the interpreter itself is missing on the executors' hosts
        return False
    finally:
        sc.setJobDescription(None)
    return found == [want]


def _start(master: str, confs: dict[str, str], pending, config: SparkConfig, jvm_log: str | None, ship: bool):
    from pyspark.sql import SparkSession

    confs = dict(confs)
    if ship:
        files, python = environment.ship(log=progress.info)
        listed = [f for f in confs.get("spark.files", "").split(",") if f]
        confs["spark.files"] = ",".join([*listed, *(f"file://{f}" for f in files)])
        os.environ["PYSPARK_PYTHON"] = python
    if confs.get("spark.executor.pyspark.memory"):  # an address-space limit on the Python workers: reserve less

        for key, value in LEAN_ADDRESS_SPACE.items():
            confs.setdefault(f"spark.executorEnv.{key}", value)
    builder = SparkSession.builder.master(master)
    for key, value in confs.items():
        builder = builder.config(key, value)
    try:
        with _stderr_to(jvm_log):
            _context_with_secrets_off_the_command_line(master, confs)
            spark = builder.getOrCreate()
    except Exception as e:  # the JVM did not start or the master is unreachable
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise SparklmError(
            f"could not start Spark with master '{master}': {first}",
            hint=f"check --master and --conf values{f'; Spark log: {jvm_log}' if jvm_log else ''}; --debug shows more",
        ) from e
    if pending is not None:  # spark-class execs the JVM: the launched process is the driver JVM
        note_class_cache_writer(pending, getattr(getattr(spark.sparkContext._gateway, "proc", None), "pid", None))
    spark.sparkContext.setLogLevel(config.log_level)
    return spark


def _context_with_secrets_off_the_command_line(master: str, confs: dict[str, str]) -> None:
    """pyspark hands every setting to spark-submit as ``--conf KEY=VALUE``: on the JVM's command line, which anyone
    on the host reads with ``ps``. With a secret among them (an S3 key given with ``--conf``), the JVM starts with
    the other settings only, and the context gets the whole configuration over py4j (``SparkContext``'s public
    ``gateway`` parameter); the session then takes that context over."""
    from pyspark import SparkConf, SparkContext

    secret = {k for k in confs if redact.is_secret(k)}
    if not secret or SparkContext._active_spark_context is not None:  # a running context: getOrCreate takes it
        return
    from pyspark.java_gateway import launch_gateway

    public = [(k, v) for k, v in confs.items() if k not in secret]
    running = SparkContext._gateway  # a JVM this process started before (a session stopped and started again)
    gateway = running or launch_gateway(SparkConf(loadDefaults=False).setMaster(master).setAll(public))
    SparkContext(conf=SparkConf(loadDefaults=False).setMaster(master).setAll(list(confs.items())), gateway=gateway)


def default_jvm_log() -> str:
    """Where the CLI sends the JVM's output: a fresh file under the user's cache directory."""
    return str(log_file("spark"))


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


# Under an address-space limit (RLIMIT_AS, which spark.executor.pyspark.memory sets on Python workers) a process
# must reserve less: measured here, a training process held 1.9 GB more address space than resident memory, mostly
# pyarrow's jemalloc pool and glibc's per-thread arenas; with Arrow on the system allocator and two arenas, 0.6 GB
# (same speed, same resident memory). Both are read at process start: set for the Python workers (executorEnv)
# and the DDP ranks' processes.
LEAN_ADDRESS_SPACE = {"ARROW_DEFAULT_MEMORY_POOL": "system", "MALLOC_ARENA_MAX": "2"}


def process_limit() -> int | None:
    """This process's own address-space limit (RLIMIT_AS: what spark.executor.pyspark.memory sets), if any."""
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_AS)[0]
    except (ImportError, OSError, ValueError):
        return None
    return None if soft == resource.RLIM_INFINITY else soft
