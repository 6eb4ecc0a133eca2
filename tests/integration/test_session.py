"""How sparklm joins Spark: settings made by spark-submit and spark-defaults.conf win over its defaults, the
CLI runs under spark-submit from its own entry file, and a Spark Connect session is one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import sparklm
from conftest import make_text

SHOW = """
import json, sys
from sparklm.config import SparkConfig
from sparklm.spark.session import get_session

spark = get_session(SparkConfig(ui=False, class_cache=False))
conf = spark.sparkContext.getConf()
keys = ["spark.master", "spark.app.name", "spark.driver.memory", "spark.sql.shuffle.partitions",
        "spark.barrier.sync.timeout"]
print(json.dumps({k: conf.get(k, None) for k in keys}))
spark.stop()
"""


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYSPARK", "SPARK_"))}
    return {**env, "SPARK_LOCAL_IP": "127.0.0.1", **extra}


def _spark_submit() -> str:
    import pyspark

    return str(Path(pyspark.__file__).parent / "bin" / "spark-submit")


def _last_json(out: str) -> dict:
    return json.loads([line for line in out.splitlines() if line.startswith("{")][-1])


def test_spark_submit_settings_win_and_sparklm_adds_only_what_is_unset(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(SHOW)
    r = subprocess.run([_spark_submit(), "--master", "local[1]", "--name", "submitted", "--driver-memory", "1g",
                        "--conf", "spark.sql.shuffle.partitions=7", str(script)],
                       capture_output=True, text=True, timeout=300,
                       env=_env(PYSPARK_PYTHON=sys.executable, PYSPARK_DRIVER_PYTHON=sys.executable))
    assert r.returncode == 0, r.stderr[-3000:]
    got = _last_json(r.stdout)
    assert got == {"spark.master": "local[1]", "spark.app.name": "submitted", "spark.driver.memory": "1g",
                   "spark.sql.shuffle.partitions": "7", "spark.barrier.sync.timeout": "600s"}


def test_spark_defaults_conf_wins_over_sparklm_defaults(tmp_path):
    (tmp_path / "spark-defaults.conf").write_text("spark.master local[1]\nspark.app.name from-defaults\n"
                                                   "spark.driver.memory 1g\n")
    script = tmp_path / "job.py"
    script.write_text(SHOW)
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                       env=_env(SPARK_CONF_DIR=str(tmp_path)))
    assert r.returncode == 0, r.stderr[-3000:]
    got = _last_json(r.stdout)
    assert (got["spark.master"], got["spark.app.name"], got["spark.driver.memory"]) == \
        ("local[1]", "from-defaults", "1g")
    assert got["spark.barrier.sync.timeout"] == "600s"


SECRET_JOB = """
import glob, json, os
from sparklm.config import SparkConfig
from sparklm.spark.session import get_session

secret = os.environ["THE_SECRET"]  # not on this script's own command line
spark = get_session(SparkConfig(master="local[1]", ui=False, class_cache=False, conf={
    "spark.hadoop.fs.s3a.secret.key": secret, "spark.sql.shuffle.partitions": "3", "spark.driver.memory": "1g"}))
seen = []
for path in glob.glob("/proc/[0-9]*/cmdline"):
    try:
        if secret.encode() in open(path, "rb").read():
            seen.append(path)
    except OSError:
        pass
conf = spark.sparkContext.getConf()
print(json.dumps({"seen": seen, "conf": conf.get("spark.hadoop.fs.s3a.secret.key") == secret,
                  "hadoop": spark.sparkContext._jsc.hadoopConfiguration().get("fs.s3a.secret.key") == secret,
                  "partitions": conf.get("spark.sql.shuffle.partitions"), "memory": conf.get("spark.driver.memory"),
                  "works": spark.range(10).count()}))
spark.stop()
"""


def test_a_secret_setting_reaches_spark_but_not_the_jvms_command_line(tmp_path):
    """pyspark passes settings to spark-submit on the command line, which `ps` shows to anyone on the host: a secret
    (an S3 key given with --conf) goes to the context over py4j instead, and Spark (and Hadoop) still get it."""
    script = tmp_path / "job.py"
    script.write_text(SECRET_JOB)
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                       env=_env(THE_SECRET="Sekr3t-b7f2e1"))
    assert r.returncode == 0, r.stderr[-3000:]
    assert _last_json(r.stdout) == {"seen": [], "conf": True, "hadoop": True, "partitions": "3", "memory": "1g",
                                    "works": 10}


@pytest.mark.slow
def test_the_cli_runs_under_spark_submit_from_its_entry_file(tmp_path):
    (tmp_path / "a.txt").write_text(make_text(80, seed=3))
    entry = Path(sparklm.__file__).with_name("__main__.py")
    r = subprocess.run([_spark_submit(), "--master", "local[1]", "--name", "prep", str(entry), "prepare",
                        str(tmp_path / "a.txt"), "--output", str(tmp_path / "data"), "--seq-len", "32",
                        "--vocab-size", "300"],
                       capture_output=True, text=True, timeout=300,
                       env=_env(PYSPARK_PYTHON=sys.executable, PYSPARK_DRIVER_PYTHON=sys.executable))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "(local[1])" in r.stderr + r.stdout, r.stderr[-2000:] + r.stdout[-2000:]
    assert (tmp_path / "data" / "manifest.json").is_file()


@pytest.mark.parametrize("how", [{"SPARK_REMOTE": "sc://127.0.0.1:15002"}, {"SPARK_CONNECT_MODE_ENABLED": "1"}])
def test_spark_connect_is_one_line_naming_what_needs_classic_spark(tmp_path, how):
    (tmp_path / "a.txt").write_text("some text\n")
    r = subprocess.run([sys.executable, "-m", "sparklm", "prepare", str(tmp_path / "a.txt"), "--output",
                        str(tmp_path / "data")], capture_output=True, text=True, timeout=120, env=_env(**how))
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: this is a Spark Connect session"), lines
    assert "barrier" in lines[0] and not (tmp_path / "data").exists()


def test_python_workers_import_the_installed_pyspark_not_sparks_zip(spark):
    """Compiled once, not in every worker (sparklm.spark.daemon): the first task of a command starts ~0.5 s sooner."""
    import pyspark

    def where(_):
        import pyspark as worker_pyspark

        yield worker_pyspark.__file__

    found = spark.sparkContext.parallelize(range(2), 2).mapPartitions(where).collect()
    assert found == [pyspark.__file__] * 2
