"""Spark's Python daemon (``spark.python.daemon.module``), with pyspark imported from its installed package.

Spark puts ``pyspark.zip`` and ``py4j-*.zip`` first on its Python workers' path. Python keeps no compiled
bytecode for modules imported from a zip, so every worker process compiles pyspark again: 1.2 s here against
0.2 s from the installed package, paid before the first task of every command and by every Python worker
Spark starts later. Where the installed pyspark is the zip's own version, this moves the zips behind it and
runs pyspark's daemon unchanged (its workers are forked from it and inherit the path); anywhere else it
changes nothing. Set by :mod:`sparklm.spark.session` where the workers run sparklm's own environment.
"""

from __future__ import annotations

import importlib.machinery
import os
import re
import runpy
import sys
import zipfile

VERSION = re.compile(r"""__version__(?:\s*:\s*str)?\s*=\s*["']([^"']+)["']""")


def _version(text: str) -> str | None:
    m = VERSION.search(text)
    return m.group(1) if m else None


def installed_first(path: list[str]) -> list[str]:
    """``path`` with Spark's pyspark and py4j zips moved behind the rest, when the rest holds the same pyspark
    version as the zip; else ``path`` unchanged."""
    zips = [p for p in path if p.endswith(".zip") and os.path.basename(p).startswith(("pyspark", "py4j"))]
    zipped = next((p for p in zips if os.path.basename(p).startswith("pyspark")), None)
    if zipped is None:
        return path
    rest = [p for p in path if p not in zips]
    spec = importlib.machinery.PathFinder.find_spec("pyspark", rest)
    if spec is None or not spec.submodule_search_locations:
        return path
    try:
        with open(os.path.join(spec.submodule_search_locations[0], "version.py"), encoding="utf-8") as f:
            installed = _version(f.read())
        with zipfile.ZipFile(zipped) as z:
            packed = _version(z.read("pyspark/version.py").decode("utf-8"))
    except (OSError, KeyError, zipfile.BadZipFile, UnicodeDecodeError):
        return path
    return rest + zips if installed is not None and installed == packed else path


if __name__ == "__main__":
    sys.path[:] = installed_first(sys.path)
    runpy.run_module("pyspark.daemon", run_name="__main__", alter_sys=True)
