"""One DDP training rank, started by a Spark barrier task (see ddp.py); reads its RankStart as JSON on stdin."""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta


def main() -> None:
    # Import the heavy parts before reading the job: the Spark task starts this process first and
    # sends the job once the ranks have found each other, so the two overlap.
    from transformers import PreTrainedModel  # noqa: F401  (transformers' model machinery: ~3 s)

    from ...data.manifest import load_prepared, load_tokenizer
    from ...errors import SparklmError
    from ..core import Rank, train
    from ..device import select
    from ..sinks import ChannelSink
    from .base import Job

    start = json.loads(sys.stdin.read())
    job = Job.from_json(start["job"])
    rank = Rank(rank=start["rank"], world=start["world"], threads=start["threads"])
    sink = None
    try:
        if rank.world > 1:
            import torch.distributed as dist

            os.environ.update(MASTER_ADDR=start["master_addr"], MASTER_PORT=str(start["master_port"]))
            backend = select(job.config.train.dtype, rank.threads).backend
            dist.init_process_group(backend, rank=rank.rank, world_size=rank.world, timeout=timedelta(minutes=10))
        config = job.config
        dataset = load_prepared(job.data, config.storage)
        spec = load_tokenizer(dataset, config.storage)
        if rank.rank == 0:
            sink = ChannelSink(*start["channel"])
        result = train(config, dataset, spec, job.run_dir, rank=rank, resume=job.resume, sink=sink)
    except SparklmError as e:
        print(e.one_line(), file=sys.stderr, flush=True)
        os._exit(2)
    if sink is not None:
        sink.close()
    print("SPARKLM-RESULT " + json.dumps(result.to_dict()), flush=True)
    if rank.world > 1:
        import torch.distributed as dist

        dist.barrier()
    # Skip interpreter teardown: gloo's threads can deadlock process-group destruction at exit.
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
