"""Metrics sinks: the training core emits rows (rows.py: a dataclass per kind) and sinks record or show them.

Sinks here: ``CsvSink`` (metrics.csv, rounds.csv on any filesystem), ``JsonSink`` (run_info.json),
``ConsoleSink`` (progress lines); the experiment trackers (TensorBoard, MLflow, W&B) are sinks too, in
``sparklm.metrics.trackers``. DDP ranks run in other processes, maybe on other hosts: rank 0 sends its rows to the driver
over a TCP ``Channel`` (as TorchDistributor streams rank logs), and the driver feeds its own sinks —
no shared disk is assumed.
"""

from __future__ import annotations

import csv
import hmac
import io
import json
import secrets
import socket
import threading
import time
from collections.abc import Iterable
from typing import Protocol

from ..config import StorageConfig
from ..infra import progress, redact
from ..infra.fs import exists, local_path, read_text, write_text
from ..model.figures import FigureSet
from . import rows
from .rows import Row

TRAIN_COLUMNS = ["kind", "step", "epoch", "tokens", "loss", "lr", "grad_norm", "tokens_per_s", "ms_per_step", "mfu",
                 "rss_mb", "peak_rss_mb", "rank_peak_rss_mb", "elapsed", "acc", "workers"]


def metric_columns(figures: FigureSet) -> list[str]:
    """metrics.csv's columns: the train rows' fields, then the task's evaluation figures."""
    return TRAIN_COLUMNS + figures.keys()


class Sink(Protocol):
    def write(self, row: Row) -> None: ...

    def rewind(self, step: int, evaluated: bool = True) -> None:
        """Forget the rows after ``step``: the run continues from a checkpoint there and sends them again. With
        ``evaluated`` False the checkpoint precedes the evaluation of its own step's weights (rounds evaluate a round
        behind): the run makes that evaluation again, so its rows go too."""
        ...

    def flush(self) -> None:
        """Make every row written so far durable. A checkpoint is written only after this returns, so a run resumed
        from it (which forgets the rows after its step) never lacks a row of the steps before it."""
        ...

    def close(self) -> None: ...


class Sinks:
    """Fan-out to several sinks."""

    def __init__(self, sinks: Iterable[Sink]):
        self.sinks = list(sinks)

    def write(self, row: Row) -> None:
        for s in self.sinks:
            s.write(row)

    def rewind(self, step: int, evaluated: bool = True) -> None:
        """Forget rows after ``step`` (the run continues from a checkpoint there and emits them again)."""
        for s in self.sinks:
            s.rewind(step, evaluated)

    def flush(self) -> None:
        for s in self.sinks:
            s.flush()

    def close(self) -> None:
        for s in self.sinks:
            s.close()

    def halted(self) -> bool:
        """Whether a sink asks the run to end early (a search's pruner): see :func:`halted`."""
        return any(halted(s) for s in self.sinks)


def halted(sink) -> bool:
    """Whether ``sink`` asks the run to end at its next step (a sink may offer ``halted()``: a search pruning the
    run); the run then ends as at its last step, its model exported."""
    ask = getattr(sink, "halted", None)
    return bool(ask is not None and ask())


class CsvSink:
    """Rows of the given kinds appended to a CSV file on any filesystem (an existing file is continued,
    as on ``--resume``). A local file is appended and flushed row by row; an object-store file is
    rewritten whole (objects cannot be appended), at most every ``every`` seconds and at close."""

    def __init__(self, uri: str, columns: list[str], kinds: set[str], storage: StorageConfig | None = None,
                 every: float = 10.0):
        self.uri, self.columns, self.kinds, self.storage, self.every = uri, columns, kinds, storage, every
        self.path = local_path(uri)
        self.last_flush, self.dirty = 0.0, False  # object stores only: when it was last uploaded, and since then?
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fresh = not self.path.exists() or self.path.stat().st_size == 0
            self._attach(self.path.open("a", newline=""), fresh=fresh)
        else:
            buf = io.StringIO()
            buf.write(read_text(uri, storage) if exists(uri, storage) else "")
            self._attach(buf, fresh=not buf.tell())

    def _attach(self, file, *, fresh: bool) -> None:
        self.file = file
        self.writer = csv.DictWriter(file, fieldnames=self.columns, extrasaction="ignore")
        if fresh:
            self.writer.writeheader()
            file.flush()

    def write(self, row: Row) -> None:
        if row.kind not in self.kinds:
            return
        self.writer.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in row.to_dict().items()})
        if self.path is not None:
            self.file.flush()
            return
        self.dirty = True
        if time.monotonic() - self.last_flush >= self.every:
            self._upload()

    def rewind(self, step: int, evaluated: bool = True) -> None:
        """Drop the rows after ``step`` (and its evaluation's, unless ``evaluated``)."""
        if self.path is not None:
            self.file.close()
            text = self.path.read_text()
        else:
            text = self.file.getvalue()

        def kept(r: dict) -> bool:
            at = _num(r.get("step"))
            return at is None or at < step or (at == step and (evaluated or r.get("kind") != "eval"))

        rows = [r for r in csv.DictReader(io.StringIO(text)) if kept(r)]
        out = io.StringIO()
        self._attach(out, fresh=True)
        self.writer.writerows(rows)
        if self.path is not None:
            write_text(str(self.path), out.getvalue())
            self._attach(self.path.open("a", newline=""), fresh=False)
        else:
            self.dirty = True

    def flush(self) -> None:
        """A local file is flushed row by row; an object-store file is uploaded now if rows came since."""
        if self.path is None and self.dirty:
            self._upload()

    def _upload(self) -> None:
        write_text(self.uri, self.file.getvalue(), self.storage)
        self.last_flush, self.dirty = time.monotonic(), False

    def close(self) -> None:
        if self.path is None:
            if self.dirty:
                self._upload()
        else:
            self.file.close()


class StatelessSink:
    """A sink that keeps nothing per step and writes each row as it comes: no rewind, flush or close to do."""

    def rewind(self, step: int, evaluated: bool = True) -> None:
        pass

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


class JsonSink(StatelessSink):
    """The ``info`` row as a JSON file (run_info.json)."""

    def __init__(self, uri: str, storage: StorageConfig | None = None):
        self.uri, self.storage = uri, storage

    def write(self, row: Row) -> None:
        if isinstance(row, rows.Info):
            info = {k: v for k, v in row.to_dict().items() if k != "kind" and v is not None}
            write_text(self.uri, json.dumps(redact.mapping(info), indent=2), self.storage)


class ConsoleSink(StatelessSink):
    """Progress lines on the console: one per log step, evaluation (the task's figures) or round, with an ETA."""

    def __init__(self, figures: FigureSet):
        self.figures = figures
        self.total: int | None = None
        self.rounds = False  # in rounds, a round's line says what its train row says

    def write(self, row: Row) -> None:
        if isinstance(row, rows.Info):
            self.total = row.total_steps
            self.rounds = row.strategy != "ddp"
        elif isinstance(row, rows.Eval) and row.figures:
            progress.info(f"  eval step {row.step}: {self.figures.line(row.figures)}")
        elif isinstance(row, rows.Train) and not self.rounds:
            progress.info(train_line(row, self.total))
        elif isinstance(row, rows.Round):
            progress.info(round_line(row))
        elif isinstance(row, rows.Epoch):
            acc = "" if row.acc != row.acc else f" | accuracy {row.acc:.1%}"  # NaN: a task without one
            progress.info(f"  epoch {row.epoch} done at step {row.step}: loss {row.loss:.3f}{acc} | "
                          f"{row.epoch_s:.1f} s | {row.tokens_per_s:,.0f} tok/s | "
                          f"{row.ms_per_step:.0f} ms/step{_peak(row.peak_rss_mb)}")
        elif isinstance(row, rows.Warn):
            progress.warn(row.message)
        elif isinstance(row, rows.Note):
            progress.info(row.message)


def rank_mb(values: Iterable[float | None]) -> str:
    """Per-rank megabytes in rank order as one CSV cell, e.g. ``812/790`` (``-``: a rank that reported none)."""
    return "/".join("-" if v is None else f"{v:.0f}" for v in values)


def _peak(mb: float | None) -> str:
    """The progress line's peak memory (the largest of any rank's), when the row has it."""
    return f" | {mb / 1024:.2f} GB peak" if mb else ""


def train_line(r: rows.Train, total: int | None) -> str:
    of = f"/{total}" if total else ""
    eta = f" | ETA {progress.duration((total - r.step) * r.ms_per_step / 1000)}" if of and r.ms_per_step else ""
    return (f"step {r.step}{of} | loss {r.loss:.3f} | lr {r.lr:.2e} | {r.tokens_per_s:,.0f} tok/s | "
            f"{r.ms_per_step:.0f} ms/step | MFU {r.mfu:.0%}{_peak(r.peak_rss_mb)} | {r.elapsed:.0f}s{eta}")


def round_line(r: rows.Round) -> str:
    of = f"/{r.total_steps}" if r.total_steps else ""
    who = f" | {r.workers_done}/{r.workers} workers" if r.workers_done < r.workers else ""
    return (f"round {r.round} | step {r.step}{of} | loss {r.loss:.3f} | {r.tokens_per_s:,.0f} tok/s | "
            f"{r.round_s:.1f} s/round | outer step {r.outer_update_norm:.3g} | {r.sent_mb:,.1f} MB sent{who}"
            f"{_peak(r.peak_rss_mb)} | {r.elapsed:.0f}s | ETA {progress.duration(r.eta_s)}")


def read_metrics(uri: str, storage: StorageConfig | None = None) -> list[dict]:
    """The rows of a metrics.csv (numbers parsed; empty cells None); [] when there is none."""
    if not exists(uri, storage):
        return []
    return [{k: _num(v) for k, v in row.items()} for row in csv.DictReader(io.StringIO(read_text(uri, storage)))]


def _num(v: str):
    if v in ("", None):
        return None
    try:
        f = float(v)
    except ValueError:
        return v
    return int(f) if f.is_integer() and "." not in v and "e" not in v else f


# -- rows from ranks to the driver ----------------------------------------------------------------


class Channel:
    """The driver's end: a TCP listener that feeds rows sent by a rank into ``sink``.

    It binds to the driver's address (``host``), which the ranks can reach (Spark's executors already
    talk to the driver there); a random token authenticates the sender, so nothing else on the network
    can inject rows. A stranger can make the driver neither read nor wait much: a client's first
    ``len(token) + 1`` bytes must be the token and a newline, sent within ``hello_timeout`` seconds; a connection
    costs a reader thread only while fewer than ``pending`` clients are being checked (the next ones wait in the
    kernel's listen backlog of ``backlog``; beyond it the kernel drops attempts, which retry), and a line after the
    token is at most ``max_line`` characters (a longer one, or one not UTF-8, cuts that connection; the others go
    on). Only rank 0 connects, once per attempt: it waits only while strangers hold every slot, each for
    ``hello_timeout`` at most.
    """

    hello_timeout = 5.0  # seconds a client has to send the token (a rank sends it as it connects)
    close_grace = 30.0  # seconds close() waits for the ranks' readers, all together, before it cuts them
    pending = 8  # clients being checked at once, a reader thread each
    backlog = 8  # connections the kernel holds for the next check
    max_line = 1 << 20  # characters in a line after the token, its newline included (a row is a few hundred)

    def __init__(self, sink: Sink, host: str = "127.0.0.1"):
        self.sink, self.token = sink, secrets.token_hex(16)
        self._slots = threading.BoundedSemaphore(self.pending)
        self._holding: set[socket.socket] = set()  # accepted connections that hold a slot until checked
        self.server = socket.create_server((host, 0), backlog=self.backlog)
        self.server.settimeout(0.5)
        self.address = (host, self.server.getsockname()[1])
        self._stop = threading.Event()
        self.error: Exception | None = None  # the first failure of a sink (e.g. disk full), raised by the caller
        self.asked, self.left_at = False, None  # this attempt: asked the ranks to leave; the step they left after
        self._left = threading.Event()  # set when rank 0's LEFT arrives
        self._threads: list[threading.Thread] = []
        self._conns: dict[socket.socket, bool] = {}  # the open connections: whether each has sent the token
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()  # answers and LEAVE go to a rank from two threads: whole, one at a time
        self._accept = threading.Thread(target=self._serve, daemon=True)
        self._accept.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self._slots.acquire(timeout=0.5):
                continue  # every slot is held by a client yet to be checked: the next one waits in the backlog
            try:
                conn, _ = self.server.accept()
            except TimeoutError:
                self._slots.release()
                continue
            except OSError:
                self._slots.release()
                return
            self._holding.add(conn)
            self._start_reading(conn)

    def _start_reading(self, conn: socket.socket) -> None:
        self._conns[conn] = False
        self._threads = [t for t in self._threads if t.is_alive()]  # strangers' ended readers are not kept
        t = threading.Thread(target=self._read, args=(conn,), daemon=True)
        t.start()
        self._threads.append(t)

    def _read(self, conn: socket.socket) -> None:
        try:
            with conn:
                if self._welcome(conn):
                    if halted(self.sink):  # a restarted attempt of a run already pruned
                        self.ask_to_halt()
                    with conn.makefile("r", encoding="utf-8") as lines:
                        self._take(conn, lines)
        except OSError:  # silent too long, or cut by close(); a rank that is gone: the launcher reports why
            pass
        finally:
            self._conns.pop(conn, None)

    def _welcome(self, conn: socket.socket) -> bool:
        """Whether the client's first line is the token: never more than its length is read before the check."""
        try:
            return self._check_token(conn)
        finally:  # its slot is free once the token came or the client was refused
            if conn in self._holding:
                self._holding.discard(conn)
                self._slots.release()

    def _check_token(self, conn: socket.socket) -> bool:
        want = f"{self.token}\n".encode()
        got, deadline = b"", time.monotonic() + self.hello_timeout
        while len(got) < len(want):
            conn.settimeout(max(deadline - time.monotonic(), 1e-3))  # TimeoutError once the time is up
            chunk = conn.recv(len(want) - len(got))
            if not chunk:
                return False
            got += chunk
        if not hmac.compare_digest(got, want):
            return False
        conn.settimeout(None)
        self._conns[conn] = True
        return True

    def _bounded(self, lines):
        """``lines`` up to the first longer than ``max_line`` with its newline (never read whole), or one that is
        not UTF-8."""
        try:
            while line := lines.readline(self.max_line):
                if len(line) == self.max_line and not line.endswith("\n"):
                    return  # the connection closes as _read returns
                yield line
        except UnicodeDecodeError:
            return

    def _take(self, conn: socket.socket, lines) -> None:
        for line in self._bounded(lines):
            try:
                raw = json.loads(line)
                if raw.get("kind") == FLUSH:
                    answer = self._flush()
                    with self._send_lock:
                        conn.sendall(answer)
                    continue
                if raw.get("kind") == LEFT:
                    self.left_at = int(raw["step"])
                    self._left.set()
                    continue
                row = raw["step"] if raw.get("kind") == REWIND else rows.from_dict(raw)
            except (ValueError, TypeError, KeyError, AttributeError):
                continue
            with self._lock:
                if self.error is not None:
                    continue
                try:
                    self.sink.rewind(row) if isinstance(row, int) else self.sink.write(row)
                except Exception as e:  # never a traceback from this thread: the launcher reports it
                    self.error = e
            if isinstance(row, rows.Eval) and halted(self.sink):  # a search's pruner judged this evaluation
                self.ask_to_halt()

    def ask_to_leave(self) -> None:
        """Tell the ranks (rank 0, which tells the others at its next step) to checkpoint and stop: an executor of
        the run is being decommissioned, and the run restarts on the executors that stay (DDP.run)."""
        self.asked = True
        self._tell(LEAVE)

    def ask_to_halt(self) -> None:
        """Tell rank 0 (which tells the others at its next step) that the run is to end now, as at its last step."""
        self._tell(HALT)

    def _tell(self, word: bytes) -> None:
        for conn, member in self._conns.copy().items():
            if member:
                with self._send_lock:
                    try:
                        conn.sendall(word)
                    except OSError:
                        pass

    def attempt(self) -> None:
        """A new start of the ranks: nothing asked of them yet."""
        self.asked, self.left_at = False, None
        self._left.clear()

    def left(self, wait: float) -> int | None:
        """The step whose checkpoint the ranks stopped after, as asked (rank 0's LEFT), else None. Once they were
        asked, waits up to ``wait`` seconds for that word: Spark may report the leaving executor's loss first."""
        if self.asked:
            self._left.wait(wait)
        return self.left_at

    def _flush(self) -> bytes:
        """A rank asked before a checkpoint: are its rows so far durable? (the answer it waits for)"""
        with self._lock:
            if self.error is None:
                try:
                    self.sink.flush()
                except Exception as e:  # reported by the launcher, as a failed write is
                    self.error = e
            return FLUSHED if self.error is None else NOT_FLUSHED

    def close(self) -> None:
        """Stop listening, once every connected rank has closed its end (its rows are all in), or after
        ``close_grace`` seconds in all; a connection that never sent the token is cut at once."""
        self._stop.set()
        self._accept.join()
        # A rank that connected while the loop above was between two accepts waits in the backlog: take it too
        # (a fast rank can connect, send everything and close before the loop accepts it).
        self.server.setblocking(False)
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:  # BlockingIOError: the backlog is empty
                break
            self._start_reading(conn)
        self.server.close()
        self._join(time.monotonic() + 0.5)  # a rank accepted just now has its token waiting: a moment to read it
        self._cut(strangers_only=True)
        self._join(time.monotonic() + self.close_grace)
        self._cut(strangers_only=False)  # a rank's end still open (its executor vanished): no row comes any more

    def _join(self, until: float) -> None:
        for t in self._threads:
            t.join(max(until - time.monotonic(), 0.0))

    def _cut(self, strangers_only: bool) -> None:
        for conn, member in self._conns.copy().items():
            if not (member and strangers_only):
                try:
                    conn.shutdown(socket.SHUT_RDWR)  # its reader's recv returns: the thread ends
                except OSError:
                    pass


def _not_recorded(why: str):
    from ..infra.errors import SparklmError

    return SparklmError(f"the driver did not record this run's progress ({why})",
                        hint="the run can continue with --resume from its last checkpoint")


REWIND = "rewind"  # a channel message that is not a row: the driver's sinks forget the rows after its step
FLUSH = "flush"  # another: the driver makes the rows durable and answers FLUSHED (or NOT_FLUSHED)
FLUSHED, NOT_FLUSHED = b"flushed\n", b"not flushed\n"
LEAVE = b"leave\n"  # the driver to rank 0, unasked: an executor of the run is leaving (Spark decommissions it)
HALT = b"halt\n"  # the driver to rank 0, unasked: end the run now (a search pruned it)
LEFT = "left"  # rank 0 to the driver: the ranks checkpointed and stopped as asked (Spark may report the leaving
# executor's loss before the ranks' own failure: this says which it was)


class ChannelSink:
    """A rank's end: rows as JSON lines to the driver's :class:`Channel`."""

    def __init__(self, host: str, port: int, token: str):
        try:
            self.sock = socket.create_connection((host, port), timeout=30)
        except OSError as e:
            from ..infra.errors import SparklmError

            raise SparklmError(f"a training rank cannot reach the driver at {host}:{port} to report progress: {e}",
                               hint="the executors must reach the driver's address (spark.driver.host)") from None
        self.sock.settimeout(None)
        self.file = self.sock.makefile("w", encoding="utf-8")
        self.file.write(token + "\n")
        self.file.flush()
        self.inbox, self.heard = b"", set()  # what the driver sent that no call has read yet; the words it said

    def write(self, row: Row) -> None:
        self._send(row.to_dict())

    def rewind(self, step: int, evaluated: bool = True) -> None:
        """The driver's sinks rewind: the rank continues from its checkpoint of ``step`` (a rank evaluates before it
        checkpoints: ``evaluated`` is always true here)."""
        self._send({"kind": REWIND, "step": step})

    def flush(self) -> None:
        """Wait until the driver has made every row sent so far durable. A driver that died (its rank goes on until
        its executor is stopped) never answers: the rank then stops here instead of checkpointing steps whose rows
        were lost, which a resumed run would lack."""
        self._send({"kind": FLUSH})
        answer = self._line(block=True)
        if answer != FLUSHED:
            raise _not_recorded("it stopped answering" if not answer else "it could not write its files")

    def left(self, step: int) -> None:
        """Tell the driver that the ranks stopped, as it asked, after their checkpoint of ``step``."""
        self._send({"kind": LEFT, "step": step})

    def halted(self) -> bool:
        """Whether the driver has asked the run to end now (Channel.ask_to_halt); never waits."""
        return self._said(HALT)

    def leaving(self) -> bool:
        """Whether the driver has asked the ranks to checkpoint and stop (Channel.ask_to_leave); never waits."""
        return self._said(LEAVE)

    @property
    def asked_to_leave(self) -> bool:
        return LEAVE in self.heard

    def _said(self, word: bytes) -> bool:
        while word not in self.heard and self._line(block=False):
            pass
        return word in self.heard

    def _line(self, *, block: bool) -> bytes:
        """The driver's next answer (a line; b"" when none came: nothing waiting, or the driver is gone); a LEAVE on
        the way is noted and read past."""
        while True:
            if b"\n" in self.inbox:
                line, self.inbox = self.inbox.split(b"\n", 1)
                if line + b"\n" in (LEAVE, HALT):
                    self.heard.add(line + b"\n")
                    if not block:
                        return line + b"\n"
                    continue
                return line + b"\n"
            try:
                chunk = self.sock.recv(64, 0 if block else socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                return b""
            except OSError:
                return b""
            if not chunk:
                return b""
            self.inbox += chunk

    def _send(self, message: dict) -> None:
        try:
            self.file.write(json.dumps(message) + "\n")
            self.file.flush()
        except OSError:
            raise _not_recorded("it stopped answering") from None

    def close(self) -> None:
        try:
            self.file.close()
            self.sock.close()
        except OSError:
            pass
