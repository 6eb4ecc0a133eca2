"""DDP's network (the security reviews, issue 56 item 5 and issue 83 item 4): each test reproduces a finding first,
then checks the fix.

The ranks' store, their gathers of checkpoint state, and the driver's metrics channel: what a stranger on the
network or the host (or a compromised peer) could reach, take, and make the driver wait for or hold."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time

import psutil
import pytest

from sparklm.metrics import rows
from sparklm.metrics.sinks import Channel, ChannelSink
from sparklm.strategies.ddp import STORE_FD, store_listener

# -- the ranks' store and their gathers: two real processes ---------------------------------------------------------

# Rank 1 plays a compromised peer: it answers the checkpoint's gather with a pickle that runs code where it is
# unpickled. "torch" is what a rank did before the review (torch's env:// store, all_gather_object); "sparklm" what
# it does now (ddp_rank.join_group, Group.gather_tensors).
TWO_RANKS = """
import os, sys, pickle
from datetime import timedelta
import psutil, torch, torch.distributed as dist
from sparklm.train.collective import Group

how, rank, port, marker = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
timeout = timedelta(seconds=60)
if how == "torch":
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timeout)
else:
    from sparklm.strategies.ddp import STORE_FD
    from sparklm.strategies.ddp_rank import join_group
    held = os.environ.get(STORE_FD)  # rank 0: the socket its task bound (as ddp.launch hands it)
    join_group("gloo", rank, 2, "127.0.0.1", port, timeout, listen_fd=int(held) if held else None)
listening = sorted({c.laddr.ip for c in psutil.Process().net_connections("tcp") if c.status == "LISTEN"})
print("listening", rank, *listening, flush=True)

class Payload:
    def __reduce__(self):
        return (os.mkdir, (marker,))

torch.manual_seed(rank)
state = torch.get_rng_state()
if rank == 1:  # all_gather_object's two gathers (sizes, then padded bytes), without unpickling anything itself
    data = torch.frombuffer(bytearray(pickle.dumps(Payload())), dtype=torch.uint8)
    sizes = [torch.zeros(1, dtype=torch.long) for _ in range(2)]
    dist.all_gather(sizes, torch.tensor([data.numel()]))
    padded = torch.zeros(int(max(sizes)), dtype=torch.uint8)
    padded[:data.numel()] = data
    dist.all_gather([torch.empty_like(padded) for _ in range(2)], padded)
elif how == "torch":
    got = [None, None]
    dist.all_gather_object(got, state)
else:
    got = Group(0, 2).gather_tensors(state)
    assert torch.equal(got[0], state) and got[1].dtype == torch.uint8, got
if how == "sparklm":  # tensors of different lengths come back whole, in rank order
    got = Group(rank, 2).gather_tensors(torch.arange(3 + rank, dtype=torch.uint8))
    assert [t.tolist() for t in got] == [[0, 1, 2], [0, 1, 2, 3]], got
    print("gathered", rank, flush=True)
dist.barrier()
os._exit(0)
"""


def _two_ranks(how: str, tmp_path) -> tuple[str, bool]:
    script = tmp_path / "ranks.py"
    script.write_text(TWO_RANKS)
    marker = tmp_path / "ran-a-peers-code"
    if how == "torch":  # a free port, released: torch binds it again
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        store = None
    else:  # bound and listening until rank 0's store closes it (ddp.launch)
        store = store_listener("127.0.0.1")
        port = store.getsockname()[1]
    fds = [(store.fileno(),) if store and r == 0 else () for r in (0, 1)]
    procs = [subprocess.Popen([sys.executable, str(script), how, str(r), str(port), str(marker)],
                              env={**os.environ, STORE_FD: str(store.fileno())} if fds[r] else None, pass_fds=fds[r],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in (0, 1)]
    if store:
        store.close()
        with pytest.raises(OSError):  # held by rank 0 from its start: no other process can serve the ranks' store
            socket.create_server(("127.0.0.1", port))
    out = ""
    for p in procs:
        text, _ = p.communicate(timeout=120)
        out += text
        assert p.returncode == 0, out
    return out, marker.exists()


def _listening(out: str) -> set[str]:
    return {ip for line in out.splitlines() if line.startswith("listening ") for ip in line.split()[2:]}


def test_torchs_own_rendezvous_listens_everywhere_and_unpickles_what_a_peer_sends(tmp_path):
    """The finding, as torch behaves: its store listens on every interface though MASTER_ADDR is 127.0.0.1, and
    all_gather_object runs a peer's pickle."""
    out, ran = _two_ranks("torch", tmp_path)
    assert _listening(out) & {"::", "0.0.0.0"}, out
    assert ran


@pytest.mark.parametrize("warm", [False, True], ids=["fresh", "warm"])
def test_rank_0s_process_serves_on_the_socket_its_task_bound(tmp_path, warm):
    """The fix: the task binds port 0, publishes the port it got and hands the listening socket to its rank's process:
    by inheritance (a fresh process) or over the warm process's Unix socket with the header (SCM_RIGHTS)."""
    from sparklm.config import Config, TrainConfig
    from sparklm.strategies.ddp import DDP, _start_rank

    store = store_listener("127.0.0.1")
    port = store.getsockname()[1]
    with DDP().prestart(Config(train=TrainConfig(workers=1, threads=1)), "local[1]") as paths:
        assert paths
        proc, _ = _start_rank(str(tmp_path), 0, 1, paths[0] if warm else "", store=store)
        store.close()
        try:
            assert type(proc).__name__ == ("WarmRank" if warm else "Popen")
            held = {c.laddr.port for c in psutil.Process(proc.pid).net_connections("tcp") if c.status == "LISTEN"}
            assert port in held
            with pytest.raises(OSError):
                socket.create_server(("127.0.0.1", port))
        finally:
            proc.kill()
            proc.wait()


def test_the_ranks_listen_on_loopback_in_local_mode_and_gather_tensors_only(tmp_path):
    out, ran = _two_ranks("sparklm", tmp_path)
    assert _listening(out) == {"127.0.0.1"}, out  # the store and gloo's own sockets
    assert out.count("gathered ") == 2, out
    assert not ran  # the peer's pickle arrived as bytes, never unpickled


# -- the driver's metrics channel ------------------------------------------------------------------------------------


class _Rows:
    def __init__(self):
        self.rows = []

    def write(self, row):
        self.rows.append(row)

    def rewind(self, step, evaluated=True):
        pass

    def flush(self):
        pass

    def close(self):
        pass


def _train(step: int) -> rows.Train:
    return rows.Train(step=step, epoch=0.1, tokens=64 * step, loss=3.0, lr=1e-3, grad_norm=0.5, tokens_per_s=100.0,
                      ms_per_step=10.0, mfu=0.5, rss_mb=100.0, peak_rss_mb=120.0, rank_peak_rss_mb="120", elapsed=1.0)


def _dropped_within(sock: socket.socket, seconds: float) -> bool:
    """Whether the channel closes ``sock``'s connection within ``seconds``."""
    sock.settimeout(seconds)
    try:
        while sock.recv(4096):
            pass
        return True  # end of stream: the channel closed it
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False


def _a_rank(channel: Channel, steps=(1, 2)) -> None:
    sink = ChannelSink(*channel.address, channel.token)
    for step in steps:
        sink.write(_train(step))
    sink.close()


CHANNELS = pytest.mark.parametrize("kind", [Channel], ids=["Channel"])


@CHANNELS
def test_a_first_line_without_end_is_cut_off_at_the_length_of_a_token(kind):
    """Before: the channel read the first line whole, however long, before it checked the token."""
    channel = kind(_Rows())
    sock = socket.create_connection(channel.address)

    def flood():
        try:
            sock.sendall(b"x" * (64 << 20))  # 64 MiB and no newline
        except OSError:
            pass  # the channel closed the connection: what the test wants

    t = threading.Thread(target=flood, daemon=True)
    t.start()
    try:
        assert _dropped_within(sock, 3.0)
    finally:
        sock.close()
        channel.close()


@CHANNELS
def test_a_silent_client_is_dropped_after_the_timeout_and_others_get_through(monkeypatch, kind):
    """Before: a client that connected and said nothing held its reader forever (and close() 30 s)."""
    monkeypatch.setattr(kind, "hello_timeout", 0.5, raising=False)
    sink = _Rows()
    channel = kind(sink)
    silent = socket.create_connection(channel.address)
    try:
        _a_rank(channel)  # a rank that connects after it is read at once
        assert _dropped_within(silent, 3.0)
    finally:
        silent.close()
        channel.close()
    assert [r.step for r in sink.rows] == [1, 2]


@CHANNELS
def test_a_wrong_token_is_refused_and_its_rows_never_read(kind):
    sink = _Rows()
    channel = kind(sink)
    try:
        for token in ("0" * len(channel.token), channel.token[:-1], " " + channel.token, channel.token + "0"):
            stranger = socket.create_connection(channel.address)
            stranger.sendall(f"{token}\n".encode() + b'{"kind": "rewind", "step": 0}\n')
            assert _dropped_within(stranger, 3.0), token
            stranger.close()
        _a_rank(channel, steps=(7,))
    finally:
        channel.close()
    assert [r.step for r in sink.rows] == [7]


@CHANNELS
def test_close_does_not_wait_for_idle_connections(monkeypatch, kind):
    """Before: close() waited up to 30 s for each connection whose reader had not ended (a silent stranger, a rank
    whose executor vanished). Now strangers are cut at once and the ranks' readers share one short grace."""
    monkeypatch.setattr(kind, "close_grace", 0.5, raising=False)
    sink = _Rows()
    channel = kind(sink)
    idle = [socket.create_connection(channel.address) for _ in range(3)]  # strangers that never send their token
    members = [socket.create_connection(channel.address) for _ in range(2)]  # ranks that stay connected
    for m in members:
        m.sendall(f"{channel.token}\n".encode())
    _a_rank(channel)
    time.sleep(0.3)  # every connection accepted and read up to where it waits
    t0 = time.monotonic()
    channel.close()
    took = time.monotonic() - t0
    try:
        assert took < 2.0, took
        assert all(_dropped_within(s, 1.0) for s in idle + members)
    finally:
        for s in idle + members:
            s.close()
    assert [r.step for r in sink.rows] == [1, 2]


@CHANNELS
def test_close_still_takes_the_rows_a_rank_sent_just_before(kind):
    sink = _Rows()
    channel = kind(sink)
    _a_rank(channel, steps=range(1, 201))
    channel.close()
    assert [r.step for r in sink.rows] == list(range(1, 201))



# -- the channel's bounds (issue 83): threads for clients yet to send the token, time to send it, line length -------


def _silent_clients(address, n: int) -> list[socket.socket]:
    """``n`` connections that never send anything (non-blocking: the ones the kernel holds back do not stop here)."""
    out = []
    for _ in range(n):
        s = socket.socket()
        s.setblocking(False)
        s.connect_ex(address)
        out.append(s)
    return out


def _most_threads(seconds: float) -> int:
    most, until = threading.active_count(), time.monotonic() + seconds
    while time.monotonic() < until:
        most = max(most, threading.active_count())
        time.sleep(0.02)
    return most


def test_silent_clients_hold_at_most_pending_readers_and_a_rank_still_gets_through(monkeypatch):
    monkeypatch.setattr(Channel, "hello_timeout", 0.5)
    sink = _Rows()
    channel = Channel(sink)
    before = threading.active_count()
    clients = _silent_clients(channel.address, 40)
    try:
        assert _most_threads(1.0) - before <= Channel.pending
        t0 = time.monotonic()
        _a_rank(channel)  # waits in the backlog (or the kernel's retries) while strangers are checked
        took = time.monotonic() - t0
    finally:
        for c in clients:
            c.close()
        channel.close()
    assert [r.step for r in sink.rows] == [1, 2]
    assert took < 20, took


def test_a_silent_client_has_a_few_seconds_to_send_the_token():
    assert Channel.hello_timeout <= 5.0
    channel = Channel(_Rows())
    silent = socket.create_connection(channel.address)
    t0 = time.monotonic()
    try:
        assert _dropped_within(silent, Channel.hello_timeout + 2.0)
        assert time.monotonic() - t0 >= Channel.hello_timeout - 0.5
    finally:
        silent.close()
        channel.close()


def _send_after_token(channel: Channel, data: bytes) -> socket.socket:
    sock = socket.create_connection(channel.address)
    sock.sendall(f"{channel.token}\n".encode())

    def flood():
        try:
            sock.sendall(data)
        except OSError:
            pass  # the channel closed the connection

    threading.Thread(target=flood, daemon=True).start()
    return sock


def test_a_line_longer_than_the_bound_cuts_its_connection_and_the_ranks_go_on():
    sink = _Rows()
    channel = Channel(sink)
    long = _send_after_token(channel, b"x" * (64 << 20))
    not_utf8 = _send_after_token(channel, b"\xff\xfe\n" + b'{"kind": "rewind", "step": 0}\n')
    try:
        assert _dropped_within(long, 3.0)
        assert _dropped_within(not_utf8, 3.0)
        _a_rank(channel, steps=(1, 2, 3))
    finally:
        long.close()
        not_utf8.close()
        channel.close()
    assert [r.step for r in sink.rows] == [1, 2, 3]
