"""Console output: stage progress from Spark's status tracker, and summary tables (rich)."""

from __future__ import annotations

import os
import sys
import threading
import time
from contextlib import contextmanager

from rich.console import Console
from rich.table import Table

from . import redact

console = Console(stderr=True, highlight=False)
# Every line goes out under this lock, so last_words() can be the last line even while other threads (the sink
# that prints ranks' progress) are printing. Reentrant: a signal handler runs on the main thread, maybe mid-print.
_out = threading.RLock()


def _print(*objects, **kwargs) -> None:
    with _out:
        console.print(*objects, **kwargs)


def last_words(line: str) -> None:
    """Write ``line`` as the console's last line (before ``os._exit``): no other thread prints after it."""
    _out.acquire(timeout=2)  # a thread stuck mid-write must not keep us from exiting; never released on purpose
    console.quiet = True
    sys.stderr.flush()
    os.write(2, (line + "\n").encode())


@contextmanager
def written_to(file):
    """The console writes to ``file`` for the block, then to ``sys.stderr`` again, looked up at each write as
    always (pytest's capture and notebooks replace it)."""
    console.file = file
    try:
        yield
    finally:
        console.file = None  # rich's Console: no file of its own means the current sys.stderr


@contextmanager
def stage(spark, name: str, *, quiet: bool = False):
    """Show ``name`` with live Spark task counts while the block runs; print its time when done."""
    sc = spark.sparkContext if spark is not None else None
    if sc is not None:
        sc.setJobDescription(name)
    start = time.monotonic()
    stop = threading.Event()
    status = None
    if not quiet and console.is_terminal:
        status = console.status(f"{name} …")
        status.start()

        def poll() -> None:
            while not stop.wait(0.5):
                status.update(f"{name} … {_tasks(sc)} ({time.monotonic() - start:.0f}s)")

        threading.Thread(target=poll, daemon=True).start()
    try:
        yield
    finally:
        stop.set()
        if status is not None:
            status.stop()
        if sc is not None:
            try:
                sc.setJobDescription(None)
            except Exception:  # the JVM is gone (its failure is what is being reported): nothing to reset
                pass
    if not quiet:
        _print(f"[green]✓[/green] {name} [dim]{time.monotonic() - start:.1f}s[/dim]")


@contextmanager
def spark_bar_paused(spark):
    """Keep Spark's own console progress bar from drawing over sparklm's lines while the block runs.

    A caller's session may draw one (``spark.ui.showConsoleProgress``, as the pyspark shell does). Its
    ``ConsoleProgressBar.finishAll()`` clears the bar and holds it back for its first delay (500 ms), and Spark itself
    calls it after every job; calling it every 200 ms suspends the bar. Nothing is changed: the caller's jobs
    afterwards draw it again."""
    bar = _console_bar(spark)
    if bar is None:
        yield
        return
    stop = threading.Event()

    def hold_back() -> None:
        while True:
            try:
                bar.finishAll()
            except Exception:  # the JVM is gone: nothing left to hold back
                return
            if stop.wait(0.2):
                return

    thread = threading.Thread(target=hold_back, name="sparklm-spark-bar", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=2)


def _console_bar(spark):
    """The JVM's ConsoleProgressBar of ``spark``'s context, or None (no session, or the bar is off)."""
    if spark is None:
        return None
    try:
        option = spark.sparkContext._jsc.sc().progressBar()  # Option[ConsoleProgressBar]
        return option.get() if option.isDefined() else None
    except Exception:  # Spark Connect or a context without the method: no bar to hold back
        return None


def _tasks(sc) -> str:
    if sc is None:
        return ""
    try:
        tracker = sc.statusTracker()
        done = total = 0
        for sid in tracker.getActiveStageIds():
            info = tracker.getStageInfo(sid)
            if info:
                done += info.numCompletedTasks
                total += info.numTasks
        return f"tasks {done}/{total}" if total else ""
    except Exception:  # the tracker is best effort: never let progress break the job
        return ""


def table(title: str, rows: list[tuple[str, ...]], header: tuple[str, ...]) -> None:
    t = Table(title=title, title_justify="left", show_edge=False)
    for i, h in enumerate(header):
        t.add_column(h, justify="left" if i == 0 else "right")
    for row in rows:
        t.add_row(*(redact.text(str(c)) for c in row))
    _print(t)


def warn(message: str) -> None:
    _print(f"[yellow]warning:[/yellow] {redact.text(message)}", soft_wrap=True)


def info(message: str) -> None:
    _print(redact.text(message), soft_wrap=True)


def plain(message: str) -> None:
    """Results on stdout (paths, figures) so scripts can capture them."""
    print(redact.text(message), file=sys.stdout, flush=True)


def duration(seconds: float) -> str:
    """``1m05s`` or ``42s``: how long something took or will take."""
    m, s = divmod(int(seconds), 60)
    return f"{m}m{s:02d}s" if m else f"{s}s"
