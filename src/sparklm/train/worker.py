"""One training rank, started by a Spark task (see strategies/ddp.py); reads its job as JSON on stdin."""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta
from pathlib import Path


def main() -> None:
    # Import the heavy parts before reading the job: the Spark task starts this process first and
    # sends the job once the ranks have found each other, so the two overlap.
    from transformers import PreTrainedModel  # noqa: F401  (transformers' model machinery: ~3 s)

    from ..config import from_dict
    from ..data.manifest import load_prepared
    from ..errors import SparklmError
    from .loop import Rank, train
    from .run import dataset_tokenizer

    job = json.loads(sys.stdin.read())

    rank = Rank(rank=job["rank"], world=job["world"], threads=job["threads"])
    try:
        if rank.world > 1:
            import torch.distributed as dist

            os.environ.update(MASTER_ADDR=job["master_addr"], MASTER_PORT=str(job["master_port"]))
            dist.init_process_group("gloo", rank=rank.rank, world_size=rank.world, timeout=timedelta(minutes=10))
        config = from_dict(job["config"])
        dataset = load_prepared(job["data"], config.storage)
        result = train(config, dataset, dataset_tokenizer(dataset, config.storage), Path(job["run_dir"]),
                       rank=rank, resume=job["resume"])
    except SparklmError as e:
        print(e.one_line(), file=sys.stderr, flush=True)
        os._exit(2)
    print("SPARKLM-RESULT " + json.dumps(result), flush=True)
    if rank.world > 1:
        import torch.distributed as dist

        dist.barrier()
    # Skip interpreter teardown: gloo's threads can deadlock process-group destruction at exit.
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
