"""Hosts that share nothing but object storage: a standalone cluster whose workers see neither the driver's
files nor its Python environment, with every dataset and run on a real S3 endpoint (moto on 127.0.0.1).

Each worker runs in its own mount namespace (``unshare -m``) with private tmpfs mounts over the temp dir,
HOME, the project's ``.venv`` and its ``src/``; it starts from a Spark home outside them (bind mounts of the
pyspark package's ``bin/`` and ``jars/``, as a cluster host has its own Spark install) and has AWS
credentials but no endpoint: the driver's settings travel with the job. Executors can run sparklm only
through the environment the driver ships (``spark.ship_env``).
"""

from __future__ import annotations

import csv
import io
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import boto3
import pytest

from conftest import labelled_records, make_text, spark_master, stop_processes, tiny_bert, toy_corpus, wait_for_workers
from sparklm.config import from_dict
from sparklm.launch.train import train
from sparklm.metrics.sinks import read_metrics
from sparklm.spark.java import find_java_home

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.xdist_group("hosts")]
ROOT = Path(__file__).resolve().parents[2]
SETTINGS = {"model": {"n_layer": 2, "n_head": 2, "n_embd": 32},
            "train": {"batch_size": 4, "max_steps": 6, "log_every": 1, "eval_every": 3, "eval_batches": 2,
                      "checkpoint_every": 3, "dtype": "float32", "samples": 1, "sample_tokens": 4, "threads": 1,
                      "workers": 2}}
DILOCO = {"train": {"strategy": "diloco", "rounds": {"sync_every": 2}}}


def _unshare_reason() -> str | None:
    if sys.platform != "linux" or shutil.which("unshare") is None:
        return "needs Linux with unshare(1)"
    if os.geteuid() != 0:
        return "needs root to make mount namespaces (CI runs as root)"
    probe = subprocess.run(["unshare", "-m", "sh", "-c", "mount -t tmpfs none /mnt"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"unshare -m is not permitted here: {probe.stderr.strip()[:200]}"
    return None


# One worker host: everything private is mounted in its own namespace before the worker starts.
HOST = r"""set -e
mkdir -p /mnt
mount -t tmpfs -o size=12g none /mnt
mkdir -p /mnt/spark/bin /mnt/spark/jars /mnt/java /mnt/work
mount --bind "$PYSPARK_DIR/bin" /mnt/spark/bin
mount --bind "$PYSPARK_DIR/jars" /mnt/spark/jars
mount --bind "$HOST_JAVA" /mnt/java
# deepest first: a checkout under /tmp or $HOME would be out of reach once its parent is hidden
for hidden in "$VENV" "$SRC" "$HOME" /tmp; do mount -t tmpfs none "$hidden"; done
exec /mnt/spark/bin/spark-class org.apache.spark.deploy.worker.Worker --host 127.0.0.1 --cores 1 \
  --memory 4g --work-dir /mnt/work --webui-port 0 "$MASTER"
"""


@pytest.fixture(scope="module")
def isolated_cluster(tmp_path_factory, s3_server):
    reason = _unshare_reason()
    if reason:
        pytest.skip(reason)
    import pyspark

    pyspark_dir = Path(pyspark.__file__).parent
    work = tmp_path_factory.mktemp("hosts")
    java = find_java_home()
    base = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "PYSPARK", "SPARK"))}
    env = {**base, "JAVA_HOME": java, "SPARK_HOME": str(pyspark_dir), "SPARK_LOCAL_IP": "127.0.0.1"}
    proc, master, ui = spark_master(work, env)
    procs = [proc]
    host_env = {**base, "PYSPARK_DIR": str(pyspark_dir), "HOST_JAVA": java, "JAVA_HOME": "/mnt/java",
                "SPARK_HOME": "/mnt/spark", "SPARK_LOCAL_IP": "127.0.0.1", "MASTER": master,
                "VENV": sys.prefix, "SRC": str(ROOT / "src"), "HOME": os.path.expanduser("~"), "TMPDIR": "/tmp",
                # each application's executors fetch the ~0.5 GB environment archive into their work dirs,
                # here in memory: drop finished applications' dirs at once, as a long-lived cluster would
                "SPARK_WORKER_OPTS": "-Dspark.worker.cleanup.enabled=true -Dspark.worker.cleanup.interval=5 "
                                     "-Dspark.worker.cleanup.appDataTtl=1",
                # credentials as an instance role would give them; no endpoint: the job carries the driver's
                "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_REGION": "us-east-1"}
    for i in range(2):
        procs.append(subprocess.Popen(["unshare", "-m", "sh", "-c", HOST], env=host_env,
                                      stdout=open(work / f"worker{i}.log", "wb"), stderr=subprocess.STDOUT))
    try:
        wait_for_workers(ui, 2, procs, f"isolated cluster (logs in {work})")
        yield master, work
    finally:
        stop_processes(procs)


def _sparklm(args: list[str], master: str, log: Path, **env) -> subprocess.CompletedProcess:
    # Both "hosts" have the address 127.0.0.1, so Spark would read the other executor's shuffle files straight
    # from disk as on one host; each worker's private /mnt hides them, as separate hosts would.
    r = subprocess.run([sys.executable, "-m", "sparklm", *args, "--master", master, "--conf",
                        "spark.executor.memory=2g", "--conf", "spark.ui.enabled=false",
                        "--conf", "spark.shuffle.readHostLocalDisk=false"],
                       capture_output=True, text=True, timeout=900,
                       env={**os.environ, "SPARK_LOCAL_IP": "127.0.0.1", **env})
    log.write_text(r.stderr)
    return r


def _sets(settings: dict, prefix: str = "") -> list[str]:
    out = []
    for key, value in settings.items():
        if isinstance(value, dict):
            out += _sets(value, f"{prefix}{key}.")
        else:
            out += ["--set", f"{prefix}{key}={json.dumps(value)}"]
    return out


def _merge(a: dict, b: dict) -> dict:
    out = json.loads(json.dumps(a))
    for k, v in b.items():
        out[k] = _merge(out.get(k, {}), v) if isinstance(v, dict) else v
    return out


def _losses(run: str) -> list[float]:
    return [r["loss"] for r in read_metrics(f"{run}/metrics.csv") if r["kind"] == "train"]


def stages(tmp: Path) -> list[tuple[str, list[str], dict]]:
    """The work, as CLI commands on s3://hosts (text/a.txt uploaded): (name, arguments, environment).
    benchmarks/cluster_stages.py runs the same in local mode."""
    (tmp / "prompts.txt").write_text("The\n東京\nMoscow\n")
    return [
        ("prepare", ["prepare", "s3://hosts/text/", "--output", "s3://hosts/data", "--seq-len", "32",
                     "--vocab-size", "300"], {}),
        ("train-ddp", ["train", "--data", "s3://hosts/data", "--output", "s3://hosts/runs/ddp", *_sets(SETTINGS)], {}),
        ("train-diloco", ["train", "--data", "s3://hosts/data", "--output", "s3://hosts/runs/diloco",
                          *_sets(_merge(SETTINGS, DILOCO))], {"SPARKLM_INJECT_FAULT": "round=1,worker=1,attempts=1"}),
        ("eval", ["eval", "s3://hosts/runs/ddp", "--input", "s3://hosts/text/", "--output", str(tmp / "eval.json")],
         {}),
        ("generate", ["generate", "s3://hosts/runs/diloco", "--input", str(tmp / "prompts.txt"), "--output",
                      str(tmp / "gen.jsonl"), "--max-new-tokens", "6"], {}),
    ]


def _encoder_on_hosts(stage, s3, tmp: Path) -> None:
    """An encoder fine-tuned on the same hosts (issue 35): labelled JSONL and a BERT directory on S3 only, the
    tokenizer read by the driver; DiLoCo with its default int4 codec; the classifier lands on S3 with its labels."""
    bert = Path(tiny_bert(tmp / "bert", corpus=toy_corpus()))
    for f in bert.iterdir():
        s3.put_object(Bucket="hosts", Key=f"bert/{f.name}", Body=f.read_bytes())
    s3.put_object(Bucket="hosts", Key="labelled/a.jsonl",
                  Body="".join(json.dumps(r) + "\n" for r in labelled_records(240, seed=3)).encode())
    r = stage("prepare-classify", ["prepare", "s3://hosts/labelled/", "--output", "s3://hosts/clf-data", "--task",
                                   "classify", "--tokenizer", str(bert), "--seq-len", "32", "--val-fraction", "0.25"])
    assert r.returncode == 0, r.stderr[-3000:]
    r = stage("train-classify", ["train", "--data", "s3://hosts/clf-data", "--output", "s3://hosts/runs/clf", "--task",
                                 "classify", "--init-from", "s3://hosts/bert", "--strategy", "diloco", "--workers", "2",
                                 "--max-steps", "80", *_sets({"train": {"lr": 3e-3, "batch_size": 16, "threads": 1,
                                                                       "dtype": "float32", "eval_every": 40,
                                                                       "rounds": {"sync_every": 10}}})])
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads(s3.get_object(Bucket="hosts", Key="runs/clf/summary.json")["Body"].read())
    assert summary["best"]["val_acc"] >= 0.8 and summary["rounds"] == 8, summary["best"]
    config = json.loads(s3.get_object(Bucket="hosts", Key="runs/clf/model/config.json")["Body"].read())
    assert config["id2label"] == {"0": "neg", "1": "pos"}


def test_hosts_that_share_only_object_storage(isolated_cluster, s3_server, spark, tmp_path):
    master, work = isolated_cluster
    s3 = boto3.client("s3", endpoint_url=s3_server)
    s3.create_bucket(Bucket="hosts")
    s3.put_object(Bucket="hosts", Key="text/a.txt", Body=make_text(300, seed=21).encode())
    figures: dict = {}

    def stage(name: str, args: list[str], ship: str = "on", **env) -> subprocess.CompletedProcess:
        # the first stages find out that the executors lack sparklm (spark.ship_env = "auto"); later ones
        # say so up front, as a user would once they know, and skip that probe
        t0 = time.time()
        r = _sparklm([*args, "--set", f"spark.ship_env={json.dumps(ship)}"], master, work / f"{name}.log", **env)
        figures[name] = round(time.time() - t0, 1)
        return r

    # a local path of the driver is refused before any work, naming the way out (shipping the environment
    # straight away: the prepare stage below is the one that finds out with "auto", which costs a second start)
    r = stage("refused", ["prepare", "s3://hosts/text/", "--output", str(tmp_path / "data")])
    assert r.returncode == 2 and "is a local path of the driver that the executors do not see" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "data").exists()
    packed = [line for line in r.stderr.splitlines() if line.startswith("packed ")]
    figures["pack"] = packed[0] if packed else "cached"

    for name, args, env in stages(tmp_path):
        r = stage(name, args, ship="auto" if name == "prepare" else "on", **env)
        assert r.returncode == 0, r.stderr[-3000:]

    # the run directories are complete on S3
    for run, extra in (("ddp", {"logs/rank-0.log", "logs/rank-1.log"}), ("diloco", {"rounds.csv"})):
        keys = {o["Key"][len(f"runs/{run}/"):] for o in
                s3.list_objects_v2(Bucket="hosts", Prefix=f"runs/{run}/")["Contents"]}
        want = {"config.json", "metrics.csv", "summary.json", "loss.png", "samples.txt", "run_info.json",
                "model/model.safetensors", "model/config.json", "model/tokenizer.json",
                "checkpoints/step-0000006/state.json", *extra}
        assert want <= keys, (run, want - keys)
        summary = json.loads(s3.get_object(Bucket="hosts", Key=f"runs/{run}/summary.json")["Body"].read())
        assert summary["spark_master"] == master and summary["steps"] == 6
    rounds = s3.get_object(Bucket="hosts", Key="runs/diloco/rounds.csv")["Body"].read().decode()
    assert ";1" in rounds or "1;" in rounds  # the injected failure was retried
    # DiLoCo's defaults: int4 both ways, the workers' residuals beside their inner states on S3 (hosts share no disk)
    ran = json.loads(s3.get_object(Bucket="hosts", Key="runs/diloco/config.json")["Body"].read())["config"]
    assert (ran["train"]["rounds"]["codec"], ran["train"]["rounds"]["downlink"]) == ("int4", "codec")
    params = json.loads(s3.get_object(Bucket="hosts", Key="runs/diloco/summary.json")["Body"].read())["params"]
    sent = [int(r["returned_bytes"]) for r in csv.DictReader(io.StringIO(rounds))]
    assert sent and all(b < 2 * 4 * params / 6 for b in sent)  # two int4 deltas a round, not two fp32 ones
    assert json.loads((tmp_path / "eval.json").read_text())["tokens"] > 0
    assert len((tmp_path / "gen.jsonl").read_text().splitlines()) == 3

    # the same runs in local mode, on the same dataset, give the same losses
    for run, settings in (("ddp", SETTINGS), ("diloco", _merge(SETTINGS, DILOCO))):
        train("s3://hosts/data", output=f"s3://hosts/local/{run}", config=from_dict(settings), spark=spark)
        assert _losses(f"s3://hosts/local/{run}") == pytest.approx(_losses(f"s3://hosts/runs/{run}"), abs=1e-4)
    _encoder_on_hosts(stage, s3, tmp_path)
    (work / "figures.json").write_text(json.dumps(figures, indent=2))
    if os.environ.get("SPARKLM_HOSTS_FIGURES"):  # benchmarks/cluster_stages.py
        Path(os.environ["SPARKLM_HOSTS_FIGURES"]).write_text(json.dumps(figures, indent=2))
    print("stage wall seconds:", figures)
