"""Filesystems behind paths and URLs: local paths and ``s3://`` via pyarrow, the same on every executor.

The pyspark package has no Hadoop S3A jars, so object stores are reached from Python (pyarrow's S3
client); the endpoint and credentials come from the standard AWS variables or ``[storage]``.
"""

from __future__ import annotations

import dataclasses
import os
import posixpath
import re
import shutil
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from functools import lru_cache
from pathlib import Path
from urllib.parse import urlparse

import pyarrow.fs as pafs

from ..config import StorageConfig
from .errors import SparklmError

_GLOB_CHARS = set("*?[{")


def is_remote(uri: str) -> bool:
    uri = os.fspath(uri)
    return "://" in uri and not uri.startswith("file://")


def resolve(uri: str, storage: StorageConfig | None = None) -> tuple[pafs.FileSystem, str]:
    """(filesystem, path inside it) for a local path, ``file://``, ``s3://``/``s3a://`` or other pyarrow URI."""
    storage = storage or StorageConfig()
    uri = os.fspath(uri)
    if uri.startswith(("s3://", "s3a://", "s3n://")):
        parsed = urlparse(uri)
        return _s3(storage.endpoint_url, storage.region, storage.anonymous), f"{parsed.netloc}{parsed.path}".rstrip("/")
    if uri.startswith("file://"):
        uri = urlparse(uri).path
    if "://" not in uri:
        return pafs.LocalFileSystem(), os.path.abspath(os.path.expanduser(uri))
    try:
        return pafs.FileSystem.from_uri(uri)  # gs://, hdfs://, abfs(s)://, ...
    except Exception as e:
        first = e
    try:  # a scheme an installed fsspec package knows (adlfs, ossfs, ...), wrapped as a pyarrow filesystem
        import fsspec

        fs, path = fsspec.core.url_to_fs(uri)
    except (ImportError, ValueError, OSError):  # OSError: a client library that is missing (HDFS's libhdfs)
        hint = ("pyarrow reaches HDFS through Hadoop's libhdfs: set HADOOP_HOME, JAVA_HOME and ARROW_LIBHDFS_DIR "
                "(and CLASSPATH from `hadoop classpath --glob`) on every host, or copy the data to an object store"
                if uri.startswith(("hdfs://", "viewfs://")) else
                "use a local path, an s3:// URL, or install the fsspec package for this scheme")
        raise SparklmError(f"cannot open {uri}: {_short(first)}", hint=hint) from None
    return pafs.PyFileSystem(pafs.FSSpecHandler(fs)), path


# -- whole files and directories, atomically, on local paths and object stores ---------------------
# Readers never see a half-written output: a local file or directory is written under a hidden
# temporary name beside it and renamed into place; an object store's PUT of one object is atomic, and
# a directory is complete when its marker file (written last) exists.


@contextmanager
def staged_file(target: Path) -> Iterator[Path]:
    """Fill the yielded path (a hidden sibling of the local ``target``); on success it replaces ``target`` in
    one rename, on an exception it is removed. For files a library writes by path (tar, JSON, scripts)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        yield tmp
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)


def adopt_file(finished: Path, target: Path) -> None:
    """Put a file that another process wrote to the end under a temporary name (a JVM's class-data archive, written
    as it exits) in ``target``'s place in one rename: readers see no file or the whole one."""
    os.replace(finished, target)


def write_bytes(uri: str, data: bytes, storage: StorageConfig | None = None) -> None:
    """Write ``uri`` whole: readers see the old content or the new, never a part."""
    fs, path = resolve(uri, storage)
    if isinstance(fs, pafs.LocalFileSystem):
        with staged_file(Path(path)) as tmp:
            tmp.write_bytes(data)
        return
    with fs.open_output_stream(path) as f:
        f.write(data)


def write_text(uri: str, text: str, storage: StorageConfig | None = None) -> None:
    write_bytes(uri, text.encode("utf-8"), storage)


def read_bytes(uri: str, storage: StorageConfig | None = None) -> bytes:
    fs, path = resolve(uri, storage)
    with fs.open_input_stream(path) as f:
        return f.read()


def read_text(uri: str, storage: StorageConfig | None = None) -> str:
    return read_bytes(uri, storage).decode("utf-8")


def exists(uri: str, storage: StorageConfig | None = None) -> bool:
    fs, path = resolve(uri, storage)
    return fs.get_file_info(path).type != pafs.FileType.NotFound


def list_names(uri: str, storage: StorageConfig | None = None) -> list[str]:
    """Names directly under directory ``uri`` (sorted; empty when it does not exist)."""
    fs, path = resolve(uri, storage)
    infos = fs.get_file_info(pafs.FileSelector(path, recursive=False, allow_not_found=True))
    return sorted(posixpath.basename(i.path.rstrip("/")) for i in infos)


def delete(uri: str, storage: StorageConfig | None = None) -> None:
    """Remove a file or a directory tree; a missing one is fine."""
    fs, path = resolve(uri, storage)
    info = fs.get_file_info(path)
    if info.type == pafs.FileType.Directory:
        fs.delete_dir(path)
    elif info.type == pafs.FileType.File:
        fs.delete_file(path)


def local_path(uri: str) -> Path | None:
    """The local path behind ``uri``, or None for an object store."""
    uri = os.fspath(uri)
    if is_remote(uri):
        return None
    return Path(os.path.abspath(os.path.expanduser(urlparse(uri).path if uri.startswith("file://") else uri)))


@contextmanager
def staged_dir(uri: str, storage: StorageConfig | None = None, *, marker: str | None = None) -> Iterator[Path]:
    """Fill the yielded local directory; on success it becomes ``uri`` as a whole, replacing what was there.

    Local: a hidden sibling renamed into place. Object store: the files are uploaded, ``marker`` (a file
    name inside the directory, e.g. ``state.json``) last, so a reader that checks it never takes a partial
    directory. On an exception nothing is published and the staging is removed.
    """
    target = local_path(uri)
    if target is not None:
        target.parent.mkdir(parents=True, exist_ok=True)
        stage = target.with_name(f".{target.name}.sparklm-tmp-{uuid.uuid4().hex[:12]}")
        stage.mkdir()
        try:
            yield stage
            old = None
            if target.exists():
                old = target.with_name(f".{target.name}.sparklm-old-{uuid.uuid4().hex[:12]}")
                target.rename(old)
            stage.rename(target)
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
        finally:
            shutil.rmtree(stage, ignore_errors=True)
        return
    stage = Path(tempfile.mkdtemp(prefix="sparklm-stage-"))
    try:
        yield stage
        delete(uri, storage)
        upload_tree(stage, uri, storage, last=marker)
    finally:
        shutil.rmtree(stage, ignore_errors=True)


def upload_tree(local: Path, uri: str, storage: StorageConfig | None = None, *, last: str | None = None) -> None:
    """The files under the local directory ``local`` written to directory ``uri`` at the same relative paths (in
    name order, a file named ``last`` after the others); symbolic links are not followed. No directory: nothing."""
    files = sorted(Path(root) / name for root, _, names in os.walk(local) for name in names
                   if not (Path(root) / name).is_symlink())
    files.sort(key=lambda p: p.name == last)
    for p in files:
        write_bytes(join(uri, *p.relative_to(local).parts), p.read_bytes(), storage)


def version(uri: str, storage: StorageConfig | None = None) -> str:
    """A fingerprint of directory ``uri``'s files (names, sizes, modification times), local or on an object store.

    A process that keeps a model loaded (a Spark worker serving task after task) keys it by this as well as by its
    path, so a model replaced at the same path (retrained with ``--overwrite``) is loaded again.
    """
    return _fingerprint(uri, _files(uri, storage))


def _fingerprint(uri: str, files: list[tuple[str, int, int]]) -> str:
    import hashlib
    import json

    return hashlib.sha256(json.dumps([uri, files]).encode()).hexdigest()[:20]


def _files(uri: str, storage: StorageConfig | None) -> list[tuple[str, int, int]]:
    """``(relative name, size, mtime in ns)`` of each file under directory ``uri``, sorted; [] where there is none."""
    local = local_path(uri)
    if local is not None:
        out = []
        for root, _, names in os.walk(local):
            for name in names:
                try:
                    st = os.stat(os.path.join(root, name))
                except FileNotFoundError:  # removed while listed (a directory being replaced)
                    continue
                out.append((Path(root, name).relative_to(local).as_posix(), st.st_size, st.st_mtime_ns))
        return sorted(out)
    fs, path = resolve(uri, storage)
    try:
        infos = [i for i in fs.get_file_info(pafs.FileSelector(path, recursive=True, allow_not_found=True))
                 if i.type == pafs.FileType.File]
    except OSError as e:
        raise SparklmError(f"cannot list {uri}: {_short(e)}", hint=storage_hint(uri)) from None
    return sorted((i.path[len(path):].lstrip("/"), i.size, i.mtime_ns or 0) for i in infos)


def local_copy(uri: str, storage: StorageConfig | None = None) -> Path:
    """A local directory holding the files of directory ``uri``: the path itself when local, else a copy in
    sparklm's cache, downloaded once per host and content listing (names, sizes, times) and reused after.

    Executors load models this way: torch and transformers read local files, and a model read by every
    task of a job is fetched from the object store once, not once a task. Concurrent downloads on one host
    each stage their own copy and rename it into place; the first wins.
    """
    from .cache import cache_dir

    local = local_path(uri)
    if local is not None:
        return local
    listing = _files(uri, storage)
    if not listing:
        raise SparklmError(f"{uri} not found (no files there)", hint=storage_hint(uri))
    for rel, _, _ in listing:
        inside(Path("."), rel, what=f"{uri}: an object")  # before anything is written
    target = cache_dir("remote", _fingerprint(uri, listing))
    if target.is_dir():
        return target
    fs, path = resolve(uri, storage)
    try:
        with staged_once(target) as stage:
            for rel, _, _ in listing:
                dest = inside(stage, rel, what=f"{uri}: an object")
                dest.parent.mkdir(parents=True, exist_ok=True)
                with fs.open_input_stream(f"{path}/{rel}") as src, open(dest, "wb") as out:
                    shutil.copyfileobj(src, out, 8 << 20)
    except OSError as e:
        raise SparklmError(f"cannot download {uri}: {_short(e)}", hint=storage_hint(uri)) from None
    return target


@contextmanager
def staged_once(target: Path, *, marker: str | None = None) -> Iterator[Path]:
    """Fill the yielded directory; on success it becomes the local ``target`` unless another process made
    ``target`` meanwhile (a per-host cache filled by concurrent tasks): then that one stays, and this copy is
    dropped. Unlike :func:`staged_dir` it never replaces a directory someone may be reading. ``marker``: the
    file whose presence says a ``target`` is complete (default: that it exists)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(prefix=f".{target.name}.sparklm-tmp-", dir=target.parent))
    try:
        yield stage
        try:
            stage.rename(target)  # atomic; fails when target is a non-empty directory
        except OSError:  # another process on this host finished first
            if not ((target / marker).is_file() if marker else target.is_dir()):
                raise
    finally:
        shutil.rmtree(stage, ignore_errors=True)


@contextmanager
def staged_cache(target: Path, *, marker: str | None = None) -> Iterator[Path]:
    """Fill the yielded directory as the per-host cache entry ``target``: one already there (stale, or left
    incomplete) is replaced whole (:func:`staged_dir`); a missing one is published once (:func:`staged_once`:
    a concurrent process's identical copy wins)."""
    publish = staged_dir(str(target)) if target.exists() else staged_once(target, marker=marker)
    with publish as stage:
        yield stage


def staging_path(path: str) -> str:
    """A hidden sibling of ``path`` (a filesystem path, no scheme) to build a directory in before :func:`swap_in`."""
    parent, _, name = path.rstrip("/").rpartition("/")
    return f"{parent}/.{name}.sparklm-tmp-{uuid.uuid4().hex[:12]}"


def check_replaceable(out: Path, overwrite: bool, *, marker: str, kind: str) -> None:
    """One line unless the local directory ``out`` is new, empty, or (with ``overwrite``) an earlier ``kind`` of
    sparklm's: its ``marker`` file lists the files it wrote (:func:`listing`) and the directory holds nothing else.
    --overwrite never replaces what sparklm did not write, even beside a marker copied into a user's directory."""
    if out.exists() and (out.is_file() or any(out.iterdir())):
        if not overwrite:
            raise SparklmError(f"{out} already exists", hint="pass --overwrite or another --output")
        if not (out / marker).is_file():
            raise SparklmError(f"refusing to --overwrite {out}: it is neither {kind} (no {marker}) nor empty",
                               hint="choose another --output")
        import json

        try:
            written = set(json.loads((out / marker).read_text()).get("files", ()))
        except (OSError, ValueError, AttributeError, TypeError):
            written = set()
        if not written and (out / CHECKSUMS).is_file():  # an import lists its files in its checksums
            written = set(json.loads((out / CHECKSUMS).read_text()))
        foreign = [n for n in listing(out) if n not in written and n not in (marker, CHECKSUMS)]
        if foreign:
            raise SparklmError(f"refusing to --overwrite {out}: it holds {foreign[0]}, which sparklm did not write there",
                               hint="move your own files out of it, or choose another --output")


def listing(directory: Path) -> list[str]:
    """The files under a local directory, as relative POSIX names (what a marker records of a directory it owns)."""
    return sorted(p.relative_to(directory).as_posix() for p in directory.rglob("*") if p.is_file() or p.is_symlink())


def swap_in(filesystem: pafs.FileSystem, staging: str, target: str, *, marker: str) -> None:
    """Make the complete directory ``staging`` become ``target`` on ``filesystem`` (what Spark tasks wrote there).

    Local: renames (the old directory stays whole until the new one is in place). An object store has no
    directory rename: ``target``'s ``marker`` goes first (readers stop accepting the old directory), then its
    objects are replaced, ``marker`` last."""
    if isinstance(filesystem, pafs.LocalFileSystem):
        old = None
        if filesystem.get_file_info(target).type != pafs.FileType.NotFound:
            old = staging_path(target).replace("sparklm-tmp", "sparklm-old")
            filesystem.move(target, old)
        filesystem.move(staging, target)
        if old:
            filesystem.delete_dir(old)
        return
    if filesystem.get_file_info(f"{target}/{marker}").type != pafs.FileType.NotFound:
        filesystem.delete_file(f"{target}/{marker}")
    if filesystem.get_file_info(target).type != pafs.FileType.NotFound:
        filesystem.delete_dir_contents(target, missing_dir_ok=True)
    infos = filesystem.get_file_info(pafs.FileSelector(staging, recursive=True))
    for info in sorted((i for i in infos if i.type == pafs.FileType.File), key=lambda i: i.path.endswith(marker)):
        filesystem.copy_file(info.path, target + info.path[len(staging):])
    filesystem.delete_dir(staging)


def remove_stale(uri: str, storage: StorageConfig | None = None, *, before: float) -> list[str]:
    """Remove the staging leftovers of ``uri`` (``.NAME.sparklm-tmp-*``, ``.NAME.sparklm-old-*`` beside it) that
    a killed earlier job left, i.e. last changed before ``before`` (a Unix time); return what was removed."""
    parent, name = posixpath.split(os.fspath(uri).rstrip("/")) if is_remote(uri) else os.path.split(
        os.path.abspath(os.fspath(uri)))
    fs, path = resolve(parent, storage)
    removed = []
    for info in fs.get_file_info(pafs.FileSelector(path, recursive=False, allow_not_found=True)):
        base = posixpath.basename(info.path.rstrip("/"))
        if not base.startswith((f".{name}.sparklm-tmp-", f".{name}.sparklm-old-")):
            continue
        mtime = info.mtime.timestamp() if info.mtime is not None else 0.0  # object-store "directories" have none
        if mtime < before:
            if info.type == pafs.FileType.Directory:
                fs.delete_dir(info.path)
            else:
                fs.delete_file(info.path)
            removed.append(base)
    return removed


CHECKSUMS = "sparklm_checksums.json"


def sha256(data: bytes) -> str:
    import hashlib

    return hashlib.sha256(data).hexdigest()


def file_sha256(path: Path) -> str:
    """The SHA-256 of a local file, read in chunks (a checkpoint's files can be larger than spare memory)."""
    import hashlib

    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            h.update(chunk)
    return h.hexdigest()


def read_config_json(directory: str, storage: StorageConfig | None = None) -> dict:
    """A model directory's ``config.json`` as a dict (a missing one raises as :func:`read_text` does); one line where
    it is not a JSON object, naming it damaged where it differs from the checksum sparklm recorded."""
    import json

    uri = join(directory, "config.json")
    try:
        value = json.loads(read_text(uri, storage))
    except ValueError as e:
        local = local_path(directory)
        if local is not None:
            verify_checksums(local)  # a model sparklm wrote: say that the file changed since
        why = f"{e.msg}, line {e.lineno}" if isinstance(e, json.JSONDecodeError) else "not UTF-8"
        raise SparklmError(f"{uri} is not valid JSON ({why})",
                           hint="restore it from a copy of the model, or save the model again") from None
    if not isinstance(value, dict):
        raise SparklmError(f"{uri} is not a JSON object", hint="restore it from a copy of the model")
    return value


def own_code_files(config: dict) -> list[str]:
    """The Python files a model's or tokenizer's config (``config.json``, ``tokenizer_config.json``) maps
    transformers' Auto classes to (``auto_map``: "file.Class", "repo--file.Class", or pairs for tokenizers). Pure."""
    def refs(value) -> list[str]:
        if isinstance(value, dict):
            return [x for v in value.values() for x in refs(v)]
        if isinstance(value, (list, tuple)):
            return [x for v in value for x in refs(v)]
        return [value.split("--")[-1]] if isinstance(value, str) else []

    return sorted({ref.split(".")[0] + ".py" for ref in refs(config.get("auto_map") or {})})


def write_checksums(directory: Path) -> None:
    """``sparklm_checksums.json``: the SHA-256 of every file in a local directory (written last, before publishing)."""
    import json

    files = sorted(p for p in directory.rglob("*") if p.is_file() and p.name != CHECKSUMS)
    sums = {str(p.relative_to(directory)): file_sha256(p) for p in files}
    (directory / CHECKSUMS).write_text(json.dumps(sums, indent=2))


def verify_checksums(directory: Path) -> None:
    """Check a local directory against its ``sparklm_checksums.json`` (if it has one); one line when a file differs.
    A file this user hashed before and found matching is not read again while it is unchanged (``Verified``)."""
    import json

    listing = directory / CHECKSUMS
    if not listing.is_file():
        return
    try:
        sums = json.loads(listing.read_text())
    except (OSError, ValueError):
        raise SparklmError(f"{listing} is unreadable", hint="export the model again") from None
    verified = Verified(directory)
    for name, want in sums.items():
        path = inside(directory, name, what=f"{listing}: an entry")
        stamp = file_stamp(path.stat(), time.time_ns()) if path.is_file() else None
        if not path.is_file() or not (verified.holds(name, stamp, want) or file_sha256(path) == want):
            raise SparklmError(f"{path} is damaged: it does not match the SHA-256 recorded when it was written",
                               hint="restore it from a copy or export the model again")
        verified.add(name, path, stamp, want)
    verified.save()


# how long a file must have been left alone before its stat may stand for its bytes: the kernel's clock for file
# times can be coarse, so a write within a few milliseconds of the last could leave both times as they were
SETTLED_NS = 2_000_000_000


def file_stamp(st: os.stat_result, now_ns: int) -> list[int] | None:
    """What any write to a file changes: its size, inode, device, modification and change times (the change time is
    the kernel's, set on every write and not settable by a user); None for a file written too recently to trust it
    (``SETTLED_NS``) or on a filesystem without the times. Pure."""
    if not st.st_mtime_ns or not st.st_ctime_ns or now_ns - max(st.st_mtime_ns, st.st_ctime_ns) < SETTLED_NS:
        return None
    return [st.st_size, st.st_ino, st.st_dev, st.st_mtime_ns, st.st_ctime_ns]


class Verified:
    """The files of one local model directory that this user has hashed and found matching their recorded SHA-256,
    each with its ``file_stamp`` then, kept under ``cache_dir("verified")``. Why: loading a model hashed every byte
    of it each time (SmolLM2-135M's 538 MB in float32: 0.43 s of the 5 s to a first token, more for a larger
    model), though it rarely changes. As git's index does, a file whose stamp differs is read again. The record is a convenience:
    one that cannot be read or written is ignored, and the model is hashed as before."""

    def __init__(self, directory: Path):
        import json

        from .cache import cache_dir

        self.file = cache_dir("verified", sha256(str(directory.resolve()).encode())[:32] + ".json")
        try:
            entries = json.loads(self.file.read_text())
        except (OSError, ValueError):
            entries = {}
        self.entries, self.changed = entries if isinstance(entries, dict) else {}, False

    def holds(self, name: str, stamp: list[int] | None, want: str) -> bool:
        """Whether ``name`` was found to hash to ``want`` when it had ``stamp``, as it has now."""
        return stamp is not None and self.entries.get(name) == {"sha256": want, "stamp": stamp}

    def add(self, name: str, path: Path, stamp: list[int] | None, want: str) -> None:
        """``name`` found to hash to ``want``, its ``stamp`` taken before it was read: recorded only if the file still
        has it, as a write while it was read would leave bytes that were never hashed."""
        entry = {"sha256": want, "stamp": stamp}
        if stamp is not None and self.entries.get(name) != entry and file_stamp(path.stat(), time.time_ns()) == stamp:
            self.entries[name], self.changed = entry, True

    def save(self) -> None:
        import json

        if not self.changed:
            return
        part = self.file.with_name(f"{self.file.name}.{uuid.uuid4().hex}.part")
        try:
            self.file.parent.mkdir(parents=True, exist_ok=True)
            part.write_text(json.dumps(self.entries))
            os.replace(part, self.file)  # whole or not at all: other processes may load the same model at once
        except OSError:
            with suppress(OSError):
                part.unlink(missing_ok=True)


def inside(root: Path, name: str, *, what: str = "a name") -> Path:
    """``root / name`` for a name read from elsewhere (an object store's listing, a checksum file, a run's list of
    files), refused in one line unless it stays inside ``root``: no absolute path, no ``..``, no empty part, no NUL.

    Object names are free text — ``a/../../x`` is a valid S3 key — and every place that turns one into a local
    path goes through here, so a listing cannot write or read outside the directory it is meant for.
    """
    parts = str(name).replace("\\", "/").split("/")
    if (not name or "\0" in name or str(name).startswith(("/", "\\")) or re.match(r"^[A-Za-z]:", str(name))
            or any(p in ("", ".", "..") for p in parts)):
        raise SparklmError(f"{what} is named {name!r}, a path that leaves its directory",
                           hint="rename or remove it: names must be relative paths without '..'")
    return root.joinpath(*parts)


def join(uri: str, *parts: str) -> str:
    """Join path parts onto a local path or URL."""
    uri = os.fspath(uri)
    if is_remote(uri):
        return posixpath.join(uri.rstrip("/"), *parts)
    return os.path.join(uri, *parts)


def uri_like(like: str, path: str) -> str:
    """A path inside a filesystem, as a URI of the same kind as ``like`` (s3://… or a local path)."""
    return f"{like.split('://', 1)[0]}://{path}" if is_remote(like) else path


def expand(uri: str, storage: StorageConfig | None = None) -> list[pafs.FileInfo]:
    """Files named by ``uri``: a file, every file under a directory, or a glob; hidden files skipped."""
    fs, path = resolve(uri, storage)
    root = path
    try:
        info = fs.get_file_info(path)  # a path that exists is itself, whatever characters its name holds
        if info.type == pafs.FileType.NotFound and _GLOB_CHARS & set(path):
            root = _glob_root(path)
            match = glob_regex(path).fullmatch
            found = [i for i in _files_below(fs, root) if match(i.path)]
        else:
            if info.type == pafs.FileType.File:
                return [info]
            if info.type == pafs.FileType.NotFound:
                raise SparklmError(f"input not found: {uri}", hint="check the path (globs like data/*.txt work)")
            found = _files_below(fs, path)
    except SparklmError:
        raise
    except (OSError, ValueError) as e:
        raise SparklmError(f"cannot list {uri}: {_short(e)}", hint=storage_hint(uri)) from None
    if any("_delta_log" in _relative_parts(i.path, root) for i in found):
        raise SparklmError(f"{uri} holds a Delta table (a _delta_log/ below it): its directory also holds files "
                           "that later versions deleted, so sparklm does not read it as plain files",
                           hint="pass the table's own directory (the one holding _delta_log/): sparklm reads its "
                                "current version")
    return sorted((i for i in found if not _hidden(_relative_parts(i.path, root))), key=lambda i: i.path)


def _files_below(fs, root: str) -> list[pafs.FileInfo]:
    """Every file below ``root`` (none if it does not exist). On a local disk links are followed once per real
    directory and file: pyarrow's recursive listing goes round a link back up the tree ~40 times, and lists a
    directory reached by two links twice, so each of those files would be read again each time."""
    if not isinstance(fs, pafs.LocalFileSystem):
        infos = fs.get_file_info(pafs.FileSelector(root, recursive=True, allow_not_found=True))
        return [i for i in infos if i.type == pafs.FileType.File]
    dirs, files, out = set(), set(), []
    for parent, subdirs, names in os.walk(root, followlinks=True):
        # the first path to a file, in this order, is the one kept; dot-directories (.git) are skipped unread, as
        # expand skips their files ("_" ones are listed: a _delta_log/ below is refused)
        subdirs[:] = sorted(d for d in subdirs if not d.startswith("."))
        real = os.path.realpath(parent)
        if real in dirs:
            subdirs.clear()
            continue
        dirs.add(real)
        for name in sorted(names):
            full = os.path.join(parent, name)
            real = os.path.realpath(full)
            if real not in files and os.path.isfile(full):  # not a dangling link, a socket or a fifo
                files.add(real)
                out.append(full)
    return fs.get_file_info(out) if out else []


def storage_hint(uri: str) -> str:
    if uri.startswith(("s3://", "s3a://", "s3n://")):
        return "check AWS_ENDPOINT_URL / [storage] endpoint_url, the bucket name and AWS credentials"
    return "check that the path exists and is readable"


def _short(e: BaseException) -> str:
    return " ".join(str(e).split())[:300]


def _relative_parts(path: str, root: str) -> list[str]:
    rel = path[len(root):] if path.startswith(root) else path.rsplit("/", 1)[-1]
    return [p for p in rel.split("/") if p]


def _hidden(parts: list[str]) -> bool:
    # Hadoop/Spark conventions: _SUCCESS, _temporary/, .crc files, dot-files and dot-directories are not
    # data — at any depth below the input given (a path the user names itself is read).
    return any(part.startswith((".", "_")) for part in parts)


def glob_regex(pattern: str) -> re.Pattern:
    """A path glob as the shell, Python's ``glob`` and Hadoop (Spark's paths) read it: ``*``, ``?`` and ``[...]``
    (``[!...]`` or ``[^...]`` negated) within one name, ``{a,b}`` alternatives, and a ``**`` name for zero or more
    directories (at the end: everything below). ``fnmatch``, whose ``*`` crosses '/', would read data/*.txt as
    every .txt file below data/."""
    parts = pattern.split("/")
    out = []
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        if part == "**":
            out.append("(?:[^/]+/)*[^/]+" if last else "(?:[^/]+/)*")
        else:
            out.append(_glob_name(part) + ("" if last else "/"))
    return re.compile("".join(out))


def _glob_name(name: str) -> str:
    """The regex of one path name's glob."""
    out, i = [], 0
    while i < len(name):
        c = name[i]
        close = name.find("]", i + 2) if c == "[" else name.find("}", i + 1) if c == "{" else -1
        if c == "*":
            out.append("[^/]*")
        elif c == "?":
            out.append("[^/]")
        elif c == "[" and close > 0:
            body = name[i + 1:close]
            negate = body[:1] in ("!", "^")
            body = body[1:] if negate else body
            out.append(f"[{'^/' if negate else ''}{body.replace(chr(92), chr(92) * 2)}]")
            i = close
        elif c == "{" and close > 0:
            out.append("(?:" + "|".join(_glob_name(alt) for alt in name[i + 1:close].split(",")) + ")")
            i = close
        else:
            out.append(re.escape(c))
        i += 1
    return "".join(out)


def _glob_root(path: str) -> str:
    parts = path.split("/")
    for i, part in enumerate(parts):
        if _GLOB_CHARS & set(part):
            return "/".join(parts[:i]) or "/"
    return path


def effective(storage: StorageConfig) -> StorageConfig:
    """Fill the endpoint and region from the standard AWS variables, on the driver, so that every
    executor talks to the same endpoint whatever its own environment says. Credentials are not
    shipped: executors take them from their environment or instance role, as AWS clients do."""
    return dataclasses.replace(
        storage,
        endpoint_url=storage.endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or "",
        region=storage.region or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "",
    )


@lru_cache(maxsize=8)
def _s3(endpoint_url: str, region: str, anonymous: bool) -> pafs.S3FileSystem:
    endpoint = endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or ""
    kwargs: dict = {
        "region": region or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1",
        "anonymous": anonymous,
        "connect_timeout": 10,
        "request_timeout": 60,
        "retry_strategy": pafs.AwsStandardS3RetryStrategy(max_attempts=3),
    }
    if endpoint:
        parsed = urlparse(endpoint if "://" in endpoint else f"https://{endpoint}")
        kwargs["endpoint_override"] = parsed.netloc
        kwargs["scheme"] = parsed.scheme
        kwargs["force_virtual_addressing"] = False
    return pafs.S3FileSystem(**kwargs)
