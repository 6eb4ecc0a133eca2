"""The memory allocator that prepare's tokenizing processes run on (``tokenizer.allocator``).

``tokenizers`` allocates and frees a few small blocks for every word it splits and every token it names. Under
glibc's malloc that bookkeeping is about a quarter of a write task. mimalloc serves the same calls much faster.
Measured on one write task of 144 MB (2-core EPYC, BENCHMARKS.md): 40.6 s against 53.9 s, 1.33x, with a lower peak
RSS (683 against 732 MB); BPE training on an 18 MB sample 1.3x. jemalloc gains about half as much.

The ids do not change: an allocator decides where blocks live, not what is computed (tested).

Only the processes that tokenize get it. torch's training step measured 8-20% *slower* on mimalloc, which hands
large blocks back to the OS where sparklm's glibc settings keep them (:func:`sparklm.train.device.keep_freed_memory`).
A library must be loaded before a process starts (``LD_PRELOAD``), so prepare starts those processes with it:

* the write pass's Python workers. Spark keeps one pool of Python workers per environment, so the write job, run
  with ``LD_PRELOAD`` in its environment, gets workers of its own. Training jobs in the same session keep theirs.
* the child that reads the tokenizer's sample and trains the BPE while Spark starts (:mod:`.sample_ahead`).

``auto`` uses the library only where it knows the workers' host: on a local master, if mimalloc (else jemalloc) is
installed there. On a cluster, name the library the executors have (``tokenizer.allocator = "libmimalloc.so.2"``).
``system`` keeps the C library's malloc. Linux only: elsewhere every setting is ``system``.
"""

from __future__ import annotations

import ctypes.util
import functools
import os
import sys
from contextlib import contextmanager

from ..infra.errors import SparklmError

# the allocators auto looks for, best first, as ctypes.util.find_library names them (Debian/Ubuntu packages:
# libmimalloc2.0, libjemalloc2)
CANDIDATES = ("mimalloc", "jemalloc")


@functools.cache
def _installed(name: str) -> str | None:
    return ctypes.util.find_library(name)  # the soname (e.g. libmimalloc.so.2), found the way ld.so finds it


def library(setting: str, master: str) -> str | None:
    """What ``tokenizer.allocator`` preloads into the tokenizing processes on ``master``: a shared library's soname
    or path, or None for the C library's own malloc."""
    if setting in ("system", "") or not sys.platform.startswith("linux"):
        return None
    if setting == "auto":
        if not master.startswith("local"):  # the executors' libraries are not known here
            return None
        return next((lib for name in CANDIDATES if (lib := _installed(name))), None)
    if "/" in setting and master.startswith("local") and not os.path.isfile(setting):
        raise SparklmError(f"tokenizer.allocator {setting} is not a file",
                           hint="name an installed allocator library (e.g. libmimalloc.so.2), or set it to auto or "
                                "system")
    return setting


def environment(lib: str | None) -> dict[str, str]:
    """The environment variables that start a process on ``lib`` (none for the system allocator); a preload the
    environment already names is kept, after ours."""
    if lib is None:
        return {}
    present = os.environ.get("LD_PRELOAD", "")
    return {"LD_PRELOAD": f"{lib} {present}".strip() if lib not in present.split() else present}


@contextmanager
def workers_on(sc, lib: str | None):
    """Spark jobs started inside run their Python workers on ``lib``: its preload is in the environment that
    ``sc`` gives Python workers (``SparkContext.environment``), read when a job's functions are built."""
    env = environment(lib)
    before = {k: sc.environment.get(k) for k in env}
    sc.environment.update(env)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                sc.environment.pop(k, None)
            else:
                sc.environment[k] = v


def loaded() -> str:
    """The allocator this process runs on: the file name of a preloaded mimalloc or jemalloc mapped into it, else
    "system" (what a write task reports, so that the manifest says what tokenized)."""
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
            for line in f:
                name = os.path.basename(line.rstrip("\n").split(" ")[-1])
                if name.startswith(tuple(f"lib{n}" for n in CANDIDATES)):
                    return name
    except OSError:
        pass
    return "system"
