"""One writer per run directory: a lock file that a run creates exclusively, keeps fresh while it runs and removes
at the end.

Two commands, two notebooks or a retried driver on another host must not write one run directory at once (rows
twice, a config.json that does not describe model/). The lock is created only if absent — ``O_CREAT | O_EXCL`` on
a local path, a conditional PUT (``If-None-Match: *``) on S3, which pyarrow's filesystem does not offer, hence
boto3 — and holds who took it. Its holder rewrites it every ``LEASE / 4`` seconds (a heartbeat), so a holder that
died is recognised: on its own host at once (its process is gone), elsewhere once the lease has run out; then the
next run (``--resume`` after a crash) takes the lock over.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid
from pathlib import Path

from ..config import StorageConfig
from .errors import SparklmError
from .fs import join, local_path, write_text

LOCK = ".sparklm.lock"
LEASE = 120.0  # seconds without a heartbeat after which a holder on another host counts as dead


class RunLock:
    """``with RunLock(run_dir, storage):`` — the run directory is this process's until the block ends."""

    def __init__(self, run_dir: str, storage: StorageConfig | None = None, *, lease: float = LEASE):
        self.uri, self.storage, self.lease = join(run_dir, LOCK), storage or StorageConfig(), lease
        self.me = {"host": socket.gethostname(), "pid": os.getpid(), "token": uuid.uuid4().hex,
                   "started": time.strftime("%Y-%m-%d %H:%M:%S")}
        self.store = _Local(local_path(self.uri)) if local_path(self.uri) is not None else _S3(self.uri, self.storage)
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None

    def __enter__(self) -> RunLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def acquire(self) -> None:
        """Take the lock, or raise one line naming its holder; a dead holder's lock is taken over."""
        holder = None
        for _ in range(3):
            if self.store.create(self._text()):
                self._beat = threading.Thread(target=self._heartbeat, daemon=True)
                self._beat.start()
                return
            holder = self.store.read()
            if holder is None:  # released this instant (try again), or created and not written yet (busy)
                time.sleep(0.5)
                holder = self.store.read()
                if holder is None and not self.store.exists():
                    continue
            if holder is None or not self._dead(holder):
                break
            self.store.remove()  # its holder died: take it over (the exclusive create decides a race)
        raise self._busy(holder)

    def release(self) -> None:
        self._stop.set()
        if self._beat is not None:
            self._beat.join(timeout=5)
            holder = self.store.read()
            if holder is not None and holder.get("token") == self.me["token"]:
                self.store.remove()
            self._beat = None

    def _text(self) -> str:
        return json.dumps({**self.me, "heartbeat": time.time()})

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.lease / 4):
            try:
                self.store.write(self._text())
            except Exception:  # noqa: BLE001 - a missed beat only shortens the lease; the run goes on
                pass

    def _dead(self, holder: dict) -> bool:
        if holder.get("host") == self.me["host"] and isinstance(holder.get("pid"), int):
            return not _alive(holder["pid"])
        return time.time() - float(holder.get("heartbeat", 0)) > self.lease

    def _busy(self, holder: dict | None) -> SparklmError:
        where = self.uri.rsplit("/", 1)[0]
        if holder is None:
            who = "another sparklm run (starting now)"
        else:
            ago = max(0, round(time.time() - float(holder.get("heartbeat", 0))))
            who = (f"another sparklm run (host {holder.get('host')}, pid {holder.get('pid')}, started "
                   f"{holder.get('started')}, last heartbeat {ago} s ago)")
        return SparklmError(f"run directory {where} is in use by {who}",
                            hint=f"wait for it to end, or choose another --output; a run that died frees it at once "
                                 f"on its own host, after {self.lease:.0f} s without a heartbeat elsewhere "
                                 f"(or delete {self.uri} if you know it is dead)")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _parse(text: str) -> dict | None:
    try:
        holder = json.loads(text)
    except ValueError:
        return None
    return holder if isinstance(holder, dict) else None


class _Local:
    def __init__(self, path: Path):
        self.path = path
        self.made: Path | None = None

    def create(self, text: str) -> bool:
        if not self.path.parent.exists():
            self.path.parent.mkdir(parents=True)
            self.made = self.path.parent  # removed again at the end if the run left nothing in it
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as f:
            f.write(text)
        return True

    def read(self) -> dict | None:
        try:
            return _parse(self.path.read_text())
        except OSError:
            return None

    def write(self, text: str) -> None:
        write_text(str(self.path), text)  # whole: a reader never sees half a heartbeat

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)
        if self.made is not None and not any(self.made.iterdir()):  # a refused run leaves no empty directory
            self.made.rmdir()

    def exists(self) -> bool:
        return self.path.exists()


class _S3:
    def __init__(self, uri: str, storage: StorageConfig):
        import boto3
        from botocore import UNSIGNED
        from botocore.config import Config as BotoConfig

        self.bucket, _, self.key = uri.split("://", 1)[1].partition("/")
        endpoint = storage.endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        region = storage.region or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"
        self.client = boto3.client("s3", endpoint_url=endpoint or None, region_name=region,
                                   config=BotoConfig(signature_version=UNSIGNED) if storage.anonymous else None)

    def create(self, text: str) -> bool:
        from botocore.exceptions import ClientError

        try:
            self.client.put_object(Bucket=self.bucket, Key=self.key, Body=text.encode(), IfNoneMatch="*")
        except ClientError as e:
            if e.response.get("Error", {}).get("Code") in ("PreconditionFailed", "ConditionalRequestConflict") or \
                    e.response.get("ResponseMetadata", {}).get("HTTPStatusCode") in (409, 412):
                return False
            raise SparklmError(f"cannot create the run's lock {self.bucket}/{self.key}: {e}") from None
        return True

    def read(self) -> dict | None:
        try:
            body = self.client.get_object(Bucket=self.bucket, Key=self.key)["Body"].read()
        except Exception:  # noqa: BLE001 - gone (released meanwhile) or unreadable: treated as just created
            return None
        return _parse(body.decode(errors="replace"))

    def write(self, text: str) -> None:
        self.client.put_object(Bucket=self.bucket, Key=self.key, Body=text.encode())

    def remove(self) -> None:
        self.client.delete_object(Bucket=self.bucket, Key=self.key)

    def exists(self) -> bool:
        try:
            self.client.head_object(Bucket=self.bucket, Key=self.key)
        except Exception:  # noqa: BLE001 - absent (404) or unreadable: the create that follows decides
            return False
        return True
