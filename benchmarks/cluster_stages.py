"""Benchmark: each stage's wall time on a simulated cluster of hosts that share nothing vs local mode.

    .venv/bin/python benchmarks/cluster_stages.py        # needs root and unshare(1), like the test

The cluster side is the test `tests/integration/test_hosts.py` (a standalone master and two workers, each
in its own mount namespace, data and runs on a moto S3 server; the environment shipped): it writes its
stage figures where SPARKLM_HOSTS_FIGURES says. The local side runs the same commands (the test's
`stages()`) with `--master local[2]` against a moto S3 server started here, one after the other, and
the time to pack the environment is measured cold (cache emptied) and warm, each in a fresh process.
One run of each (the cluster side takes ~6 minutes); figures go to BENCHMARKS.md.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "integration")]

PACK = ("import time; t = time.time(); from sparklm.spark import environment; p, built = environment.archive(); "
        "print(round(time.time() - t, 1), built, p.stat().st_size)")


def pack_figures() -> dict:
    from sparklm.infra.cache import cache_dir

    shutil.rmtree(cache_dir("env"), ignore_errors=True)
    out = {}
    for label in ("cold", "cached"):
        r = subprocess.run([sys.executable, "-c", PACK], capture_output=True, text=True, check=True)
        seconds, built, size = r.stdout.split()
        out[label] = {"seconds": float(seconds), "built": built == "True", "mb": int(size) / 1e6}
    return out


def local_stages(work: Path) -> dict:
    import boto3
    from moto.server import ThreadedMotoServer
    from test_hosts import stages

    from conftest import make_text

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    server.start()
    env = {**os.environ, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
           "AWS_REGION": "us-east-1", "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "SPARK_LOCAL_IP": "127.0.0.1"}
    s3 = boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"], region_name="us-east-1",
                      aws_access_key_id="testing", aws_secret_access_key="testing")
    s3.create_bucket(Bucket="hosts")
    s3.put_object(Bucket="hosts", Key="text/a.txt", Body=make_text(300, seed=21).encode())
    figures = {}
    try:
        for name, args, extra in stages(work):
            t0 = time.time()
            r = subprocess.run([sys.executable, "-m", "sparklm", *args, "--master", "local[2]", "--conf",
                                "spark.ui.enabled=false"], capture_output=True, text=True, env={**env, **extra})
            figures[name] = round(time.time() - t0, 1)
            if r.returncode:
                raise SystemExit(f"local {name} failed:\n{r.stderr[-3000:]}")
            print(f"local {name}: {figures[name]} s", flush=True)
    finally:
        server.stop()
    return figures


def main() -> None:
    work = Path(tempfile.mkdtemp(prefix="cluster-stages-"))
    pack = pack_figures()
    print("pack:", pack, flush=True)
    local = local_stages(work)
    figures_file = work / "cluster.json"
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        str(ROOT / "tests" / "integration" / "test_hosts.py")],
                       env={**os.environ, "SPARKLM_HOSTS_FIGURES": str(figures_file), "CI": "true"}, cwd=ROOT)
    if r.returncode or not figures_file.is_file():
        raise SystemExit("the simulated-cluster test failed or was skipped")
    cluster = json.loads(figures_file.read_text())
    print("\n| stage | simulated cluster, 2 workers (s) | local[2] (s) |\n|---|---|---|")
    for name in local:
        print(f"| {name} | {cluster[name]} | {local[name]} |")
    print(f"| refused (a driver-local output; the first command: probe, restart with the environment) | "
          f"{cluster['refused']} | – |")
    print(f"\npack: {json.dumps(pack)}; in the cluster's first command: {cluster['pack']}")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
