"""One writer per run directory, on a local path: a second writer is refused naming the holder; a dead holder's
lock is taken over (at once on its own host, after the lease elsewhere). The S3 case: integration/test_runlock_s3.py."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time

import pytest

from sparklm.infra.errors import SparklmError
from sparklm.infra.runlock import LOCK, RunLock


def test_a_second_writer_is_refused_naming_the_holder_until_the_first_ends(tmp_path):
    run = str(tmp_path / "run")
    with RunLock(run):
        with pytest.raises(SparklmError, match=rf"run directory {run} is in use by another sparklm run \(host "
                                               rf"{socket.gethostname()}, pid \d+, started .*last heartbeat 0 s ago"):
            RunLock(run).acquire()
        assert json.loads((tmp_path / "run" / LOCK).read_text())["host"] == socket.gethostname()
    assert not (tmp_path / "run").exists()  # the lock made the directory; a run that wrote nothing leaves none
    with RunLock(run):  # free again
        (tmp_path / "run" / "config.json").write_text("{}")
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["config.json"]


def _holder(tmp_path, **fields) -> None:
    (tmp_path / LOCK).write_text(json.dumps({"host": socket.gethostname(), "pid": 1, "token": "x",
                                             "started": "then", "heartbeat": time.time(), **fields}))


@pytest.mark.parametrize("kind", ["run", "dataset"])
def test_an_output_where_nothing_can_be_written_is_one_line(tmp_path, kind):
    """Found in the sweep: `prepare -o /proc/out` (or any directory the user cannot write to) was a traceback from
    the lock file's os.open."""
    (tmp_path / "a-file").write_text("x")
    for output in (tmp_path / "a-file" / "out", "/proc/sparklm-cannot-write"):
        with pytest.raises(SparklmError, match=r"cannot write to .*: (Not a directory|No such file or directory)"):
            with RunLock(str(output), kind=kind):
                pass


def test_a_dead_holder_is_taken_over_at_once_on_its_host_and_after_the_lease_elsewhere(tmp_path):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    _holder(tmp_path, pid=gone.pid)  # its process has exited: the lock is stale on this host
    with RunLock(str(tmp_path)) as lock:
        assert json.loads((tmp_path / LOCK).read_text())["token"] == lock.me["token"]
    _holder(tmp_path, host="elsewhere", heartbeat=time.time() - 5)  # alive as far as anyone here can tell
    with pytest.raises(SparklmError, match="host elsewhere, pid 1"):
        RunLock(str(tmp_path), lease=60).acquire()
    _holder(tmp_path, host="elsewhere", heartbeat=time.time() - 61)  # silent for longer than the lease
    with RunLock(str(tmp_path), lease=60):
        pass
    assert not (tmp_path / LOCK).exists()


def test_the_holder_keeps_its_lock_fresh(tmp_path):
    with RunLock(str(tmp_path), lease=0.4):
        first = json.loads((tmp_path / LOCK).read_text())["heartbeat"]
        time.sleep(0.35)
        assert json.loads((tmp_path / LOCK).read_text())["heartbeat"] > first
        with pytest.raises(SparklmError):  # and so it is never taken for dead while it runs
            RunLock(str(tmp_path), lease=0.4).acquire()


# -- the review's findings (issue 56, item 4): each reproduced, then fixed ------------------------------------------


def _racing(locks: list[RunLock], slow: RunLock) -> list[str]:
    """Both locks take a dead holder's lock at once: each reads it (the barrier: both have read it before either
    goes on), then ``slow`` pauses before acting on what it read. What each got: "held" or the refusal."""
    barrier = threading.Barrier(len(locks))
    for lock in locks:
        read, first = lock.store.read, [True]

        def paused(read=read, first=first, lock=lock):
            seen = read()
            if first[0]:
                first[0] = False
                barrier.wait(timeout=5)
                if lock is slow:
                    time.sleep(0.3)  # a slower process: the other has taken the lock over meanwhile
            return seen

        lock.store.read = paused
    got: dict[int, str] = {}

    def take(i: int) -> None:
        try:
            locks[i].acquire()
            got[i] = "held"
        except SparklmError as e:
            got[i] = str(e)

    threads = [threading.Thread(target=take, args=(i,)) for i in range(len(locks))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=20)
    return [got[i] for i in range(len(locks))]


def _exited_pid() -> int:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    return gone.pid


def test_two_takers_of_a_dead_holders_lock_one_wins(tmp_path):
    """Takeover was read → delete → create: the slower taker deleted the winner's new lock and both held it."""
    _holder(tmp_path, pid=_exited_pid())
    fast, slow = RunLock(str(tmp_path)), RunLock(str(tmp_path))
    try:
        got = _racing([fast, slow], slow)
        assert got[0] == "held", got
        assert got[1].startswith(f"run directory {tmp_path} is in use by another sparklm run (host "), got
        assert json.loads((tmp_path / LOCK).read_text())["token"] == fast.me["token"]
    finally:
        fast.release()
        slow.release()
    assert not (tmp_path / LOCK).exists()


def _taken_over(path) -> None:
    """Another run takes the lock over (as after a lease run out), replacing the file whole."""
    other = path.with_name("other")
    other.write_text(json.dumps({"host": "elsewhere", "pid": 7, "token": "theirs", "started": "now",
                                 "heartbeat": time.time()}))
    other.replace(path)


def _until(condition, timeout: float = 10) -> None:
    deadline = time.time() + timeout
    while not condition() and time.time() < deadline:
        time.sleep(0.02)
    assert condition()


def test_a_holder_whose_lock_was_taken_over_stops_and_leaves_it(tmp_path):
    """Heartbeats were unconditional writes: a holder whose lock another run had taken over wrote it back, then
    deleted it at its end. Now its heartbeat finds the lock not its own: it stops beating, says so, and its end is
    one line (the run stops) that leaves the other's lock alone."""
    called = []
    lock = RunLock(str(tmp_path), lease=0.4)
    lock.on_lost = lambda: called.append(1)
    with pytest.raises(SparklmError, match=rf"lost the lock on run directory {tmp_path}: another sparklm run "
                                           r"\(host elsewhere, pid 7, .*\) took it over"):
        with lock:
            _taken_over(tmp_path / LOCK)
            time.sleep(0.35)  # three heartbeats' time
            assert json.loads((tmp_path / LOCK).read_text())["token"] == "theirs"
            _until(lambda: lock.lost)  # (a busy machine may delay the beat)
            assert called == [1]
            with pytest.raises(SparklmError, match="lost the lock"):
                lock.check()  # what a caller polls (before a checkpoint)
    assert json.loads((tmp_path / LOCK).read_text())["token"] == "theirs"


def test_a_reused_pid_does_not_keep_a_dead_holders_lock(tmp_path):
    """On its own host a holder counted alive while any process had its pid: a pid reused after a crash kept the
    lock forever. The lock records when its process started; another process with that pid is not the holder."""
    _holder(tmp_path, pid=os.getpid(), pid_start="a process that started at another time")
    with RunLock(str(tmp_path)) as lock:
        assert json.loads((tmp_path / LOCK).read_text())["token"] == lock.me["token"]
        assert lock.me["pid_start"]  # and this process's own start is recorded
        with pytest.raises(SparklmError, match=rf"pid {os.getpid()}"):  # the same pid and start: alive
            RunLock(str(tmp_path)).acquire()


def test_a_holder_with_our_hostname_on_another_machine_is_judged_by_its_lease(tmp_path):
    """Containers on two machines often share a hostname: a holder there was judged dead by a pid of this machine
    (none running here), and its live run's lock was taken over. The lock records the machine (boot and pid
    namespace); another machine's holder keeps its lock for the lease, as any remote holder does."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    _holder(tmp_path, pid=gone.pid, machine="another machine's boot id")
    with pytest.raises(SparklmError, match=rf"pid {gone.pid}"):
        RunLock(str(tmp_path), lease=60).acquire()
    _holder(tmp_path, pid=gone.pid, machine="another machine's boot id", heartbeat=time.time() - 61)
    with RunLock(str(tmp_path), lease=60) as lock:
        assert lock.me["machine"]  # and this machine's own is recorded (Linux)
    _holder(tmp_path, pid=gone.pid, machine=lock.me["machine"])  # this machine: its pid is gone, so is the holder
    with RunLock(str(tmp_path), lease=60):
        pass


def test_release_all_lets_go_of_every_lock_this_process_holds(tmp_path):
    """Ctrl-C ends a command with os._exit (no with-block ends): its run's lock stayed, and the next run was refused
    or had to take it over. The handler releases what this process holds first."""
    from sparklm.infra.runlock import release_all

    a, b = RunLock(str(tmp_path / "a")), RunLock(str(tmp_path / "b"), kind="dataset")
    a.acquire()
    b.acquire()
    assert (tmp_path / "a" / LOCK).exists() and (tmp_path / f".b{LOCK}").exists()
    release_all()
    assert not (tmp_path / "a" / LOCK).exists() and not (tmp_path / f".b{LOCK}").exists()
    RunLock(str(tmp_path / "a")).acquire()  # free at once
    release_all()


@pytest.mark.parametrize("uri", ["gs://bucket/run", "abfs://container@account.dfs.core.windows.net/run",
                                 "hdfs://namenode/run", "unknown://x/run"])
def test_a_scheme_other_than_s3_is_never_sent_to_boto3(uri, tmp_path, monkeypatch, capsys):
    """Every non-local URI went to boto3: gs://bucket/run became an S3 bucket named "bucket". Where sparklm has no
    conditional write for the scheme, the lock is one held on this host, and one line says so."""
    import tempfile

    import boto3

    def no_s3(*a, **k):
        raise AssertionError(f"boto3 used for {uri}")

    monkeypatch.setattr(boto3, "client", no_s3)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with RunLock(uri):
        with pytest.raises(SparklmError, match=rf"run directory {uri} is in use by another sparklm run"):
            RunLock(uri).acquire()
    err = capsys.readouterr()
    said = [line for line in (err.out + err.err).splitlines() if "local to this host" in line]
    assert len(said) == 2 and uri in said[0], err  # one line per lock


def test_a_second_prepare_to_one_output_is_refused_before_it_touches_the_firsts_staging(tmp_path, config):
    """prepare took no lock, and a second prepare removed the first one's staging as a stale leftover. Now the
    second is one line naming the first, and the staging stays."""
    from sparklm.launch.prepare import prepare

    (tmp_path / "in.txt").write_text("some text\n")
    out = tmp_path / "data"
    staging = tmp_path / ".data.sparklm-tmp-0123456789ab"
    staging.mkdir()
    os.utime(staging, (time.time() - 60, time.time() - 60))  # the first began a minute ago

    def no_spark():
        raise AssertionError("the second prepare went on to start Spark")

    with RunLock(str(out), kind="dataset"):  # what the first prepare holds while it writes
        with pytest.raises(SparklmError, match=rf"output {out} is being written by another sparklm prepare \(host "
                                               rf"{socket.gethostname()}, pid {os.getpid()}"):
            prepare([str(tmp_path / "in.txt")], output=str(out), config=config, spark=no_spark)
        assert staging.is_dir()
    assert sorted(p.name for p in tmp_path.iterdir()) == [".data.sparklm-tmp-0123456789ab", "in.txt"]
