"""The run directory's lock on S3 (moto server on 127.0.0.1): a takeover and every heartbeat conditional on the ETag
read (``If-Match``), and a holder's age by the store's clock (LastModified against the response's Date)."""

from __future__ import annotations

import json
import threading
import time

import boto3
import pytest

from sparklm.config import StorageConfig
from sparklm.infra.errors import SparklmError
from sparklm.infra.runlock import LOCK, RunLock

LEASE = 2.0  # the store's clock counts whole seconds: a live holder's lock is up to LEASE / 4 + 1 s old


@pytest.fixture
def bucket(s3_server, request):
    name = request.node.name.replace("_", "-")[:50].strip("-")
    boto3.client("s3", endpoint_url=s3_server).create_bucket(Bucket=name)
    return boto3.client("s3", endpoint_url=s3_server), name, StorageConfig(endpoint_url=s3_server)


def _put(s3, name: str, **fields) -> None:
    holder = {"host": "elsewhere", "pid": 1, "token": "theirs", "started": "then", "heartbeat": time.time(), **fields}
    s3.put_object(Bucket=name, Key=f"run/{LOCK}", Body=json.dumps(holder).encode())


def _token(s3, name: str) -> str:
    return json.loads(s3.get_object(Bucket=name, Key=f"run/{LOCK}")["Body"].read())["token"]


def test_two_takers_of_a_dead_holders_lock_on_s3_one_wins(bucket):
    """Takeover was GET → DELETE → PUT: the slower taker deleted the winner's new lock and both held it."""
    s3, name, storage = bucket
    _put(s3, name, heartbeat=time.time() - 600)
    time.sleep(LEASE + 1.1)  # dead by the store's clock too
    fast, slow = RunLock(f"s3://{name}/run", storage, lease=LEASE), RunLock(f"s3://{name}/run", storage, lease=LEASE)
    barrier, got = threading.Barrier(2), {}
    for lock in (fast, slow):
        read, first = lock.store.read, [True]

        def paused(read=read, first=first, lock=lock):
            seen = read()
            if first[0]:
                first[0] = False
                barrier.wait(timeout=10)  # both have read the dead holder's lock
                if lock is slow:
                    time.sleep(0.3)  # and the slower acts on it after the other took it over
            return seen

        lock.store.read = paused

    def take(lock):
        try:
            lock.acquire()
            got[lock.me["token"]] = "held"
        except SparklmError as e:
            got[lock.me["token"]] = str(e)

    threads = [threading.Thread(target=take, args=(lock,)) for lock in (fast, slow)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    try:
        assert got[fast.me["token"]] == "held", got
        assert got[slow.me["token"]].startswith(f"run directory s3://{name}/run is in use by another sparklm run"), got
        assert _token(s3, name) == fast.me["token"]
    finally:
        fast.release()
        slow.release()
    assert "Contents" not in s3.list_objects_v2(Bucket=name)


def test_a_holder_on_s3_whose_lock_was_taken_over_stops_and_leaves_it(bucket):
    """Heartbeats were unconditional PUTs and the end an unconditional DELETE: a holder whose lock was taken over
    wrote it back, then deleted it."""
    s3, name, storage = bucket
    lock = RunLock(f"s3://{name}/run", storage, lease=LEASE)
    with pytest.raises(SparklmError, match=rf"lost the lock on run directory s3://{name}/run: another sparklm run "
                                           r"\(host elsewhere"):
        with lock:
            _put(s3, name)  # another run took it over
            time.sleep(LEASE / 4 * 2.5)
            assert _token(s3, name) == "theirs"
            deadline = time.time() + 10  # (a busy machine may delay the beat)
            while not lock.lost and time.time() < deadline:
                time.sleep(0.05)
            assert lock.lost
    assert _token(s3, name) == "theirs"


def test_a_holders_age_on_s3_is_the_stores_clock(bucket):
    """A holder counted dead by its heartbeat's time, in its host's clock against ours: a lock just written by a
    host whose clock is behind was taken over at once. Now the age is the object's, by the store's clock."""
    s3, name, storage = bucket
    _put(s3, name, heartbeat=time.time() - 600)  # written now, by a clock ten minutes behind
    with pytest.raises(SparklmError, match=r"host elsewhere, pid 1, started then, last heartbeat [01] s ago"):
        RunLock(f"s3://{name}/run", storage, lease=LEASE).acquire()
    time.sleep(LEASE + 1.1)  # no heartbeat since, by the store's clock
    with RunLock(f"s3://{name}/run", storage, lease=LEASE) as lock:
        assert _token(s3, name) == lock.me["token"]
    assert "Contents" not in s3.list_objects_v2(Bucket=name)


def test_a_heartbeat_on_s3_keeps_the_lock_and_its_end_removes_only_its_own(bucket):
    s3, name, storage = bucket
    with RunLock(f"s3://{name}/run", storage, lease=LEASE) as lock:
        first = s3.head_object(Bucket=name, Key=f"run/{LOCK}")["ETag"]
        time.sleep(LEASE / 4 * 2.5)
        assert s3.head_object(Bucket=name, Key=f"run/{LOCK}")["ETag"] != first and not lock.lost
        lock.store.mine.version = first  # as if the answer to the last beat had been lost: the end finds its own
    assert "Contents" not in s3.list_objects_v2(Bucket=name)
