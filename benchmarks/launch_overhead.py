"""Benchmark: launching 2 torch.distributed ranks on Spark — plain barrier stage vs pyspark's TorchDistributor.

    .venv/bin/python benchmarks/launch_overhead.py --repeats 3

Both run the same tiny job (gloo init, one all-reduce, return rank 0's value) on one warm local[2]
session. "barrier + child" is how sparklm launches ranks (strategies/ddp.py: a barrier stage,
rank 0's address through allGather, each rank a child process); TorchDistributor is run with
local_mode=True and local_mode=False.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import textwrap
import time


def job() -> float:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    value = float(t)
    dist.barrier()
    return value


CHILD = textwrap.dedent("""
    import json, os, sys, torch, torch.distributed as dist
    spec = json.loads(sys.stdin.read())
    os.environ.update(MASTER_ADDR=spec["addr"], MASTER_PORT=str(spec["port"]))
    dist.init_process_group("gloo", rank=spec["rank"], world_size=spec["world"])
    t = torch.tensor([float(spec["rank"] + 1)]); dist.all_reduce(t); dist.barrier()
    print(json.dumps(float(t)), flush=True); os._exit(0)
""")


def barrier_child(spark, world: int) -> float:
    def task(_):
        import json
        import socket
        import subprocess

        from pyspark import BarrierTaskContext

        ctx = BarrierTaskContext.get()
        rank = ctx.partitionId()
        port = 0
        if rank == 0:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
        peers = [json.loads(m) for m in ctx.allGather(json.dumps({"port": port}))]
        spec = {"rank": rank, "world": world, "addr": "127.0.0.1", "port": peers[0]["port"]}
        out = subprocess.run([sys.executable, "-c", CHILD], input=json.dumps(spec), capture_output=True, text=True)
        yield (rank, json.loads(out.stdout.strip().splitlines()[-1]))

    results = spark.sparkContext.parallelize(range(world), world).barrier().mapPartitions(task).collect()
    return dict(results)[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    from pyspark.ml.torch.distributor import TorchDistributor

    from sparklm.config import SparkConfig
    from sparklm.spark.session import get_session

    spark = get_session(SparkConfig(master="local[2]", ui=False), jvm_log="/dev/null")
    ways = {
        "barrier stage + child ranks (sparklm)": lambda: barrier_child(spark, 2),
        "TorchDistributor(local_mode=True)": lambda: TorchDistributor(num_processes=2, local_mode=True,
                                                                     use_gpu=False).run(job),
        "TorchDistributor(local_mode=False)": lambda: TorchDistributor(num_processes=2, local_mode=False,
                                                                      use_gpu=False).run(job),
    }
    result = {}
    for name, run in ways.items():
        run()  # warm: Python workers, imports
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            value = run()
            times.append(time.perf_counter() - t0)
        result[name] = {"median_s": statistics.median(times), "runs_s": times, "rank0_value": value}
        print(f"{name}: median {statistics.median(times):.2f}s over {args.repeats} (value {value})", flush=True)
    print(json.dumps(result, indent=2))
    spark.stop()


if __name__ == "__main__":
    main()
