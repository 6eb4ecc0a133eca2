"""One writer per run directory, on a local path: a second writer is refused naming the holder; a dead holder's
lock is taken over (at once on its own host, after the lease elsewhere). The S3 case: integration/test_s3.py."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
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
