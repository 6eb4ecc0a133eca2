"""One DDP training rank, started by a Spark barrier task (see ddp.py); reads its RankStart as JSON on stdin."""

from __future__ import annotations

import json
import os
import socket
import sys
import traceback
from datetime import timedelta


def main() -> None:
    # Import the heavy parts before reading the job: the Spark task starts this process first and
    # sends the job once the ranks have found each other, so the two overlap.
    from transformers import PreTrainedModel  # noqa: F401  (transformers' model machinery: ~3 s)

    from ..data.manifest import load_prepared, load_tokenizer
    from ..infra.errors import SparklmError, known_cause
    from ..metrics.sinks import ChannelSink
    from ..train import collective
    from ..train.core import Rank, train
    from ..train.loop import Leaving
    from .base import Job, RankStart
    from .ddp import STORE_FD

    if sys.argv[1:2] == ["--warm"]:  # started before Spark (ddp.DDP.prestart): wait for the task that takes it
        _serve_once(int(sys.argv[2]))
    start = RankStart.from_json(sys.stdin.read())
    job = Job.from_json(start.job)
    rank = Rank(rank=start.rank, world=start.world, threads=start.threads, gpu=start.gpu)
    sink = None
    where = f"training rank {rank.rank} on {socket.gethostname()}"
    plan = job.plan  # what runs, decided on the driver: a rank reads it and decides nothing
    try:
        shard = plan.config.train.parallel == "shard"
        listener = os.environ.pop(STORE_FD, None)  # rank 0: the store's socket, bound by its Spark task
        if rank.world > 1 or shard:  # the ranks find each other: their collectives from here on
            join_group(plan.device.backend, rank.rank, rank.world, start.master_addr, start.master_port,
                       timedelta(seconds=plan.config.train.ddp.collective_timeout),
                       listen_fd=int(listener) if listener else None)
        comm = collective.of(rank.rank, rank.world, shard=shard)
        dataset = load_prepared(job.data, plan.config.storage)
        spec = load_tokenizer(dataset, plan.config.storage)
        if rank.rank == 0:
            sink = ChannelSink(*start.channel)
        result = train(plan, dataset, spec, job.run_dir, rank=rank, sink=sink, comm=comm,
                       on_step=_fault_hook(rank.rank, job.resume), halts=job.halts)
    except SparklmError as e:
        print(e.one_line(), file=sys.stderr, flush=True)
        os._exit(2)
    except Leaving as e:  # checkpointed as the driver asked: the run restarts on the executors that stay
        if sink is not None:
            try:
                sink.left(e.step)
            except SparklmError:  # the driver is gone: nobody to tell
                pass
        print(SparklmError(f"{where}: {e}").one_line(), file=sys.stderr, flush=True)
        os._exit(3)
    except BaseException as e:  # the traceback stays in this rank's log; the driver shows one line
        traceback.print_exc()
        cause = known_cause(f"{type(e).__name__}: {e}")
        what = cause[0] if cause else f"{type(e).__name__}: {' '.join(str(e).split())[:200]}"
        error = SparklmError(f"{where}: {what}", hint=cause[1] if cause else None)
        if cause and cause[0] == "out of memory":
            from ..train.memory import out_of_memory

            error = out_of_memory(where)
        print(error.one_line(), file=sys.stderr, flush=True)
        os._exit(1)
    if sink is not None:
        sink.close()
    print("SPARKLM-RESULT " + result.to_json(), flush=True)
    comm.barrier()
    # Skip interpreter teardown: gloo's threads can deadlock process-group destruction at exit.
    sys.stderr.flush()
    os._exit(0)


def join_group(backend: str, rank: int, world: int, addr: str, port: int, timeout: timedelta, *,
               listen_fd: int | None = None) -> None:
    """Join the ranks' process group, whose store rank 0 serves on ``addr:port``.

    torch's own rendezvous (MASTER_ADDR) listens on every interface, whatever the address; rank 0 serves the store
    on a socket bound to ``addr`` instead, which is 127.0.0.1 in local mode and its executor's address on a cluster:
    ``listen_fd``, bound to port 0 and listening before ``port`` was published (ddp.launch), so that no other
    process can take the port between its choice and its use; without it, rank 0 binds ``addr:port`` itself.
    With a loopback store every rank is on this host, so gloo's and NCCL's own sockets stay on loopback too (unless
    GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME say otherwise); elsewhere gloo binds the address of the host's name.
    """
    import ipaddress

    import torch.distributed as dist

    if ipaddress.ip_address(socket.gethostbyname(addr)).is_loopback:
        loopback = "lo0" if sys.platform == "darwin" else "lo"
        os.environ.setdefault("GLOO_SOCKET_IFNAME", loopback)
        os.environ.setdefault("NCCL_SOCKET_IFNAME", loopback)
    # the listening socket goes to the store (detach: torch owns and closes it)
    fd = None
    if rank == 0:
        fd = listen_fd if listen_fd is not None else socket.create_server((addr, port)).detach()
    store = dist.TCPStore(addr, port, world, rank == 0, timeout, master_listen_fd=fd)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)


def _serve_once(fd: int) -> None:
    """Wait on the listening socket ``fd`` for the one Spark task that takes this process, then fork the rank for
    it. The child returns, with the task's connection as stdin and stdout and the task's log as stderr, to run as
    any rank; this process waits for it, sends the task its exit status (ddp.WarmRank) and exits."""
    from .ddp import STORE_FD, WARM_EXIT, WARM_PID, die_with_parent

    listener = socket.socket(fileno=fd)
    conn, _ = listener.accept()
    listener.close()  # one task only: a later attempt finds nobody listening and starts a fresh process
    # the header's first byte brings the store's listening socket where the task is rank 0's (ddp.WarmRank.take)
    header, store, _, _ = socket.recv_fds(conn, 1, 1)
    while not header.endswith(b"\n"):  # byte by byte: what follows is the rank's own stdin
        byte = conn.recv(1)
        if not byte or len(header) > 4096:  # (a path in JSON: a longer header is no task's)
            os._exit(0)  # the task went away before asking
        header += byte
    log = os.open(json.loads(header)["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    pid = os.fork()
    if pid == 0:
        die_with_parent()
        os.dup2(log, 2)
        os.dup2(conn.fileno(), 0)
        os.dup2(conn.fileno(), 1)
        os.close(log)
        conn.close()
        if store:
            os.environ[STORE_FD] = str(store[0])
        os.write(1, WARM_PID + f"{os.getpid()}\n".encode())
        return
    os.close(log)
    for f in store:  # the rank holds its own copy
        os.close(f)
    _, status = os.waitpid(pid, 0)
    try:
        conn.sendall(WARM_EXIT + f"{os.waitstatus_to_exitcode(status)}\n".encode())
    except OSError:
        pass
    os._exit(0)


FAULT_ENV = "SPARKLM_INJECT_RANK_FAULT"  # a testing aid: "rank=R,step=S[,at=crash|hang]" (first launch only)


def _fault_hook(rank: int, resumed: bool):
    """The step hook that makes rank R crash (SIGKILL, as an out-of-memory kill) or hang after step S."""
    import signal
    import time

    text = os.environ.get(FAULT_ENV, "")
    if not text or resumed:
        return None
    spec = dict(part.split("=", 1) for part in text.split(","))
    if int(spec["rank"]) != rank:
        return None
    at, when = spec.get("at", "crash"), int(spec["step"])

    def hook(step: int) -> None:
        if step == when:
            if at == "hang":
                time.sleep(10**6)
            os.kill(os.getpid(), signal.SIGKILL)

    return hook


if __name__ == "__main__":
    main()
