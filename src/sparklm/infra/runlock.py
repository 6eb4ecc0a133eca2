"""One writer per run directory: a lock file that a run creates exclusively, keeps fresh while it runs and removes
at the end.

Two commands, two notebooks or a retried driver on another host must not write one run directory at once (rows
twice, a config.json that does not describe model/). The lock is created only if absent — ``O_CREAT | O_EXCL`` on
a local path, a conditional PUT (``If-None-Match: *``) on S3, which pyarrow's filesystem does not offer, hence
boto3 — and holds who took it. Its holder rewrites it every ``LEASE / 4`` seconds (a heartbeat), so a holder that
died is recognised: on its own host at once (its process is gone, or its pid now belongs to a process that started
at another time), elsewhere once the lease has run out (on S3 by the store's clock: the object's LastModified
against the response's Date); then the next run (``--resume`` after a crash) takes the lock over.

Every rewrite is conditional on what was last read — S3's ``If-Match`` on the ETag; on a local path, under
``flock`` of the file still at its path, if it still holds what was read — so of two runs taking over a dead
holder's lock one wins, and a holder whose lock was taken over (its heartbeats stalled for the lease) learns it:
``lost`` is set, ``on_lost`` is called, ``check()`` and the end of the ``with`` block raise one line. Schemes
with no conditional write here (gs://, abfs://, hdfs://, ...) get a lock on this host only, and one line says so.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import socket
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from ..config import StorageConfig
from . import progress
from .errors import SparklmError
from .fs import join, local_path
from .private import host_dir

LOCK = ".sparklm.lock"
LEASE = 120.0  # seconds without a heartbeat after which a holder on another host counts as dead
# what the lock guards, in the words of its messages: (the directory, how it is busy, the other process)
_HELD: set[RunLock] = set()  # the locks this process holds, for release_all
_WORDS = {"run": ("run directory", "is in use by", "another sparklm run"),
          "dataset": ("output", "is being written by", "another sparklm prepare")}


@dataclass
class Seen:
    """A lock as read: its holder, the store's version of that content (S3's ETag) and its age in seconds (by the
    store's clock where it has one, else since the heartbeat it holds)."""

    holder: dict
    version: str | None = None
    age: float = 0.0


class RunLock:
    """``with RunLock(run_dir, storage):`` — the run directory is this process's until the block ends.

    ``kind="dataset"``: the lock of ``sparklm prepare``'s output, beside the directory (prepare swaps the
    directory in whole, lock file and all). ``on_lost`` (settable) is called from the heartbeat thread if another
    process takes the lock over; ``lost`` then is true and ``check()`` raises.
    """

    def __init__(self, run_dir: str, storage: StorageConfig | None = None, *, lease: float = LEASE,
                 kind: str = "run"):
        self.where, self.kind = os.fspath(run_dir).rstrip("/") or os.fspath(run_dir), kind
        self.uri = join(run_dir, LOCK) if kind == "run" else _beside(self.where)
        self.storage, self.lease = storage or StorageConfig(), lease
        self.me = {"host": socket.gethostname(), "machine": _machine(), "pid": os.getpid(),
                   "pid_start": _process_start(os.getpid()),
                   "token": uuid.uuid4().hex, "started": time.strftime("%Y-%m-%d %H:%M:%S")}
        self.store = _store(self.uri, self.storage, self.where)
        self.on_lost: Callable[[], None] | None = None
        self.lost = False
        self._taker: Seen | None = None
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None

    def __enter__(self) -> RunLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()
        self.check()  # a lost lock ends the block with its one line (in place of what on_lost's stop raised)

    def acquire(self) -> None:
        """Take the lock, or raise one line naming its holder; a dead holder's lock is taken over."""
        seen = None
        for _ in range(3):
            if self.store.create(self._text()):
                return self._start()
            seen = self.store.read()
            if seen is None:  # released this instant (try again), or created and not written yet (busy)
                time.sleep(0.5)
                seen = self.store.read()
                if seen is None and not self.store.exists():
                    continue
            if seen is None or not self._dead(seen):
                break
            if self.store.replace(seen, self._text()):  # only if it still holds what was read: one taker wins
                return self._start()
        raise self._busy(seen)

    def release(self) -> None:
        _HELD.discard(self)
        self._stop.set()
        if self._beat is not None:
            self._beat.join(timeout=5)
            self._beat = None
            if not self.lost:
                self.store.remove()  # conditional too: never another run's lock

    def check(self) -> None:
        """Raise the one line of a lost lock: for a caller to poll where stopping is cheap (before a checkpoint)."""
        if self.lost:
            raise self._lost()

    def _start(self) -> None:
        _HELD.add(self)
        self._beat = threading.Thread(target=self._heartbeat, daemon=True)
        self._beat.start()

    def _text(self) -> str:
        return json.dumps({**self.me, "heartbeat": time.time()})

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.lease / 4):
            try:
                if self.store.replace(self.store.mine, self._text()):
                    continue
                seen = self.store.read()
            except Exception:  # noqa: BLE001 - a missed beat only shortens the lease; the run goes on
                continue
            if seen is not None and seen.holder.get("token") == self.me["token"]:
                self.store.mine = seen  # our last beat landed and its answer was lost: go on from it
                continue
            self._taker, self.lost = seen, True
            progress.warn(str(self._lost()))  # at once: the caller may check only later
            if self.on_lost is not None:
                try:
                    self.on_lost()
                except Exception:  # noqa: BLE001 - stopping is the caller's; the lock stays lost either way
                    pass
            return

    def _lost(self) -> SparklmError:
        by = f"{self._who(self._taker)} took it over" if self._taker else f"{self.store.name} was removed"
        return SparklmError(f"lost the lock on {_WORDS[self.kind][0]} {self.where}: {by}",
                            hint=f"another process counted this one dead: its heartbeats had not reached the store "
                                 f"for {self.lease:.0f} s (a paused or disconnected driver?); check what the other "
                                 "process wrote before you resume")

    def _dead(self, seen: Seen) -> bool:
        holder = seen.holder
        # a pid says something only on this machine, in this pid namespace: containers elsewhere share hostnames
        # (a lock written before "machine" was recorded is judged by its host, as then)
        here = holder.get("host") == self.me["host"] and holder.get("machine", self.me["machine"]) == self.me["machine"]
        if here and isinstance(holder.get("pid"), int):
            return not _running(holder["pid"], holder.get("pid_start"))
        return seen.age > self.lease

    def _who(self, seen: Seen) -> str:
        h = seen.holder
        return (f"{_WORDS[self.kind][2]} (host {h.get('host')}, pid {h.get('pid')}, started {h.get('started')}, "
                f"last heartbeat {max(0, round(seen.age))} s ago)")

    def _busy(self, seen: Seen | None) -> SparklmError:
        what, busy, other = _WORDS[self.kind]
        who = f"{other} (starting now)" if seen is None else self._who(seen)
        return SparklmError(f"{what} {self.where} {busy} {who}",
                            hint=f"wait for it to end, or choose another --output; a run that died frees it at once "
                                 f"on its own host, after {self.lease:.0f} s without a heartbeat elsewhere "
                                 f"(or delete {self.store.name} if you know it is dead)")


def _beside(directory: str) -> str:
    """The lock of a directory that is replaced whole: a hidden sibling, ``.NAME.sparklm.lock``."""
    path = local_path(directory)
    if path is not None:
        return str(path.parent / f".{path.name}{LOCK}")
    head, _, name = directory.rpartition("/")
    return f"{head}/.{name}{LOCK}"


def _store(uri: str, storage: StorageConfig, where: str):
    path = local_path(uri)
    if path is not None:
        return _Local(path)
    scheme = uri.split("://", 1)[0].lower()
    if scheme in ("s3", "s3a", "s3n"):
        return _S3(uri, storage)
    progress.warn(f"the lock on {where} is local to this host: sparklm has no conditional write for {scheme}:// "
                  "(only for local paths and s3://), so make sure no run on another host writes there at once")
    # this user's own directory: a shared one could be made first by another user, closed to every other
    return _Local(host_dir("locks") / (hashlib.sha256(uri.encode()).hexdigest()[:16] + LOCK))


def release_all() -> None:
    """Release every lock this process holds: for an exit that skips ``with`` blocks (Ctrl-C's ``os._exit``)."""
    for lock in list(_HELD):
        try:
            lock.release()
        except Exception:  # noqa: BLE001 - exiting anyway; a lock left behind is taken over by the next run
            pass


def _machine() -> str | None:
    """This machine's boot and pid namespace (Linux), or None: what makes a pid comparable with ours."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None
    try:
        return f"{boot} {os.readlink('/proc/self/ns/pid')}"
    except OSError:
        return boot


def _process_start(pid: int) -> str | None:
    """When process ``pid`` started (a pid reused by a later process has another), or None where it is unknown."""
    try:  # Linux: clock ticks since boot, field 22 of /proc/PID/stat (its name, field 2, may hold spaces)
        return "ticks " + Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        pass
    try:  # macOS and others: ps, to the second
        out = subprocess.run(["ps", "-o", "lstart=", "-p", str(pid)], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    started = out.stdout.strip() if out.returncode == 0 else ""
    return started or None


def _running(pid: int, start: str | None) -> bool:
    """Whether a holder's process still runs: its pid exists and, where the lock says when it started, that
    process started then."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return start is None or _process_start(pid) in (None, start)


def _parse(text: str) -> dict | None:
    try:
        holder = json.loads(text)
    except ValueError:
        return None
    return holder if isinstance(holder, dict) else None


class _Local:
    """The lock file. Replaced (a takeover, a heartbeat) and removed only while ``flock``-ed, if it is still the file
    at its path and holds what was read: a rename puts the new one in place, so two takers of one dead holder's lock
    cannot both win, and a holder never writes over the lock of the run that took it over."""

    def __init__(self, path: Path):
        self.path, self.name = path, str(path)
        self.made: Path | None = None
        self.mine: Seen | None = None  # what this process last wrote

    def create(self, text: str) -> bool:
        try:
            if not self.path.parent.exists():
                self.made = next(p for p in reversed(self.path.parents) if not p.exists())  # the first one missing
                self.path.parent.mkdir(parents=True, exist_ok=True)  # removed at the end, where the run left nothing
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        except OSError as e:  # read-only, not a directory, no permission: the output cannot be written at all
            where = e.filename or self.path.parent
            raise SparklmError(f"cannot write to {where}: {e.strerror}",
                               hint="choose an --output in a directory you can write to") from None
        with os.fdopen(fd, "w") as f:
            f.write(text)
        self.mine = Seen(json.loads(text))
        return True

    def read(self) -> Seen | None:
        try:
            holder = _parse(self.path.read_text())
        except OSError:
            return None
        return None if holder is None else Seen(holder, age=time.time() - float(holder.get("heartbeat", 0)))

    def replace(self, seen: Seen | None, text: str) -> bool:
        with self._pinned() as now:
            if seen is None or now != seen.holder:
                return False
            new = self.path.with_name(f"{self.path.name}.{uuid.uuid4().hex[:12]}")
            try:
                new.write_text(text)
                os.replace(new, self.path)  # whole: a reader never sees half a heartbeat
            finally:
                new.unlink(missing_ok=True)  # (a full disk leaves no half-written copy)
        self.mine = Seen(json.loads(text))
        return True

    def remove(self) -> None:
        with self._pinned() as now:
            if now is not None and self.mine is not None and now.get("token") == self.mine.holder.get("token"):
                self.path.unlink()
        for made in [self.path.parent, *self.path.parent.parents] if self.made is not None else []:
            if not made.is_dir() or any(made.iterdir()):
                break
            made.rmdir()  # a refused run leaves no empty directory
            if made == self.made:
                break

    def exists(self) -> bool:
        return self.path.exists()

    @contextmanager
    def _pinned(self) -> Iterator[dict | None]:
        """What the lock file holds (None: no file), with that file locked and still the one at its path."""
        while True:
            try:
                fd = os.open(self.path, os.O_RDWR)  # for writing: NFS lends exclusive locks only then
            except FileNotFoundError:
                yield None
                return
            try:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX)
                except OSError:  # a filesystem without flock (some FUSE mounts): the checks below alone
                    pass
                try:
                    here = os.stat(self.path)
                except FileNotFoundError:
                    continue
                if (here.st_dev, here.st_ino) == (os.fstat(fd).st_dev, os.fstat(fd).st_ino):
                    with open(fd, closefd=False) as f:
                        now = _parse(f.read())
                    yield now
                    return
            finally:
                os.close(fd)  # and with it the flock


class _S3:
    """The lock as an S3 object: created with ``If-None-Match: *``, replaced with ``If-Match`` on the ETag read
    and removed with ``If-Match`` on this process's own; its age by the store's clock (LastModified, to the second,
    against the response's Date), so a host whose clock is off neither keeps nor takes a lock early."""

    def __init__(self, uri: str, storage: StorageConfig):
        import boto3
        from botocore import UNSIGNED
        from botocore.config import Config as BotoConfig

        self.bucket, _, self.key = uri.split("://", 1)[1].partition("/")
        self.name = f"s3://{self.bucket}/{self.key}"
        self.mine: Seen | None = None
        endpoint = storage.endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        region = storage.region or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"
        self.client = boto3.client("s3", endpoint_url=endpoint or None, region_name=region,
                                   config=BotoConfig(signature_version=UNSIGNED) if storage.anonymous else None)

    def create(self, text: str) -> bool:
        from botocore.exceptions import ClientError

        try:
            put = self.client.put_object(Bucket=self.bucket, Key=self.key, Body=text.encode(), IfNoneMatch="*")
        except ClientError as e:
            if e.response.get("Error", {}).get("Code") == "NoSuchBucket":  # not a lock someone holds: no bucket
                raise SparklmError(f"bucket {self.bucket} not found (for {self.name})",
                                   hint="create the bucket, or check the output path and --endpoint-url") from None
            if _refused(e):
                return False
            raise SparklmError(f"cannot create the run's lock {self.name}: {e}") from None
        self.mine = Seen(json.loads(text), put["ETag"])
        return True

    def read(self) -> Seen | None:
        from email.utils import parsedate_to_datetime

        try:
            got = self.client.get_object(Bucket=self.bucket, Key=self.key)
            holder = _parse(got["Body"].read().decode(errors="replace"))
        except Exception:  # noqa: BLE001 - gone (released meanwhile) or unreadable: treated as just created
            return None
        date = got["ResponseMetadata"].get("HTTPHeaders", {}).get("date")
        now = parsedate_to_datetime(date).timestamp() if date else time.time()
        return None if holder is None else Seen(holder, got["ETag"], now - got["LastModified"].timestamp())

    def replace(self, seen: Seen | None, text: str) -> bool:
        if seen is None:
            return False
        from botocore.exceptions import ClientError

        try:
            put = self.client.put_object(Bucket=self.bucket, Key=self.key, Body=text.encode(), IfMatch=seen.version)
        except ClientError as e:
            if _refused(e):
                return False
            raise
        self.mine = Seen(json.loads(text), put["ETag"])
        return True

    def remove(self) -> None:
        from botocore.exceptions import ClientError

        seen = self.mine
        for _ in range(2):
            if seen is None or self.mine is None or seen.holder.get("token") != self.mine.holder.get("token"):
                return
            try:
                self.client.delete_object(Bucket=self.bucket, Key=self.key, IfMatch=seen.version)
                return
            except ClientError as e:
                if not _refused(e):
                    raise
            seen = self.read()  # our last heartbeat landed and its answer was lost: its ETag is another

    def exists(self) -> bool:
        try:
            self.client.head_object(Bucket=self.bucket, Key=self.key)
        except Exception:  # noqa: BLE001 - absent (404) or unreadable: the create that follows decides
            return False
        return True


def _refused(e) -> bool:
    """A conditional request of S3's that did not hold (the object changed, or is absent), not a failure."""
    response = e.response
    return response.get("Error", {}).get("Code") in ("PreconditionFailed", "ConditionalRequestConflict",
                                                     "NoSuchKey") or \
        response.get("ResponseMetadata", {}).get("HTTPStatusCode") in (404, 409, 412)
