"""Two users of one host (issue 83): what sparklm keeps in the shared temp directory is each user's alone, and a
prepared dataset's manifest cannot make a run read files outside the dataset.

The second users are uids 1001 (who gets there first) and 1002 (whose run it is), taken by a forked child of this
(root) process: the interpreter is already loaded, so the child needs no access to where it is installed. Skipped
where the suite does not run as root (CI does).
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path

import pytest

from sparklm.data.manifest import MANIFEST, PreparedDataset, load_tokenizer
from sparklm.data.tokenizer import from_tokenizer
from sparklm.infra.errors import SparklmError
from sparklm.infra.private import host_dir
from sparklm.infra.runlock import RunLock
from sparklm.spark.environment import launcher
from sparklm.strategies.ddp import rank_log_dir
from sparklm.strategies.round_worker import inner_dir

FIRST, VICTIM = 1001, 1002
as_root = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"), reason="needs root to be other users")


@pytest.fixture
def shared():
    """A temp directory as /tmp is: world-writable and sticky (outside pytest's own, which only root may enter)."""
    base = Path(tempfile.mkdtemp(prefix="shared-"))
    base.chmod(0o1777)
    for uid in (FIRST, VICTIM):
        home = base / f"home-{uid}"
        home.mkdir()
        os.chown(home, uid, uid)
    yield base
    shutil.rmtree(base, ignore_errors=True)


def as_user(uid: int, shared: Path, fn, *args):
    """``fn(*args)`` run as ``uid`` (its HOME and TMPDIR under ``shared``): its result, or ``{"error": line}``."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            os.close(r)
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            os.environ.update(HOME=str(shared / f"home-{uid}"), TMPDIR=str(shared))
            tempfile.tempdir = str(shared)
            payload = {"ok": fn(*args)}
        except BaseException as e:  # noqa: BLE001 - reported to the parent
            payload = {"error": f"{type(e).__name__}: {e}"}
        os.write(w, json.dumps(payload, default=str).encode())
        os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        data = f.read()
    os.waitpid(pid, 0)
    return json.loads(data)


def _squat(shared: str) -> list[str]:
    """What another user does first: the fixed names of earlier versions, open to all or closed, and the name a
    directory of uid 1002's would have, open to all, with a file planted in it."""
    base = Path(shared)
    (base / "sparklm-inner" / "job").mkdir(parents=True)
    for d in (base / "sparklm-inner", base / "sparklm-inner" / "job"):
        d.chmod(0o777)
    (base / "sparklm-logs").mkdir(mode=0o755)
    (base / "sparklm-locks").mkdir(mode=0o755)
    theirs = base / f"sparklm-{VICTIM}"
    (theirs / "inner" / "job").mkdir(parents=True)
    for d in (theirs, theirs / "inner", theirs / "inner" / "job"):
        d.chmod(0o777)
    (theirs / "inner" / "job" / "held-step1.safetensors").write_bytes(b"planted")
    return [str(base / n) for n in ("sparklm-inner", "sparklm-logs", "sparklm-locks", f"sparklm-{VICTIM}")]


def _inner() -> str:
    d = inner_dir("job")
    d.mkdir(parents=True, exist_ok=True)
    (d / "held-step1.safetensors").write_bytes(b"mine")
    return str(d)


def _logs() -> str:
    d = rank_log_dir("job")
    (d / "rank-0.log").write_text("a log line\n")
    return str(d)


def _locks() -> str:
    lock = RunLock("gs://bucket/run")
    lock.acquire()
    try:
        return str(lock.store.path)
    finally:
        lock.release()


def _read(path: str) -> str:
    return sorted(os.listdir(path))


@as_root
@pytest.mark.parametrize("place", [_inner, _logs, _locks], ids=["round-worker-weights", "rank-logs", "host-locks"])
def test_each_directory_sparklm_keeps_on_a_host_is_the_users_alone(shared, place):
    """Earlier: fixed names in the shared temp dir. Another user who made `sparklm-inner` open to all could swap the
    weights this user's next round loads; one who made `sparklm-logs` or `sparklm-locks` first made this user's
    runs fail with a PermissionError traceback. Now each lives in a directory of this user's alone, and one another
    user made under that directory's name is passed over."""
    planted = as_user(FIRST, shared, _squat, str(shared))["ok"]
    got = as_user(VICTIM, shared, place)
    assert "ok" in got, got
    where = Path(got["ok"])
    assert not any(str(where).startswith(p) for p in planted), where  # nowhere another user made
    root = next(p for p in [where, *where.parents] if p.name == f"sparklm-{VICTIM}")
    st = root.lstat()
    assert stat.S_ISDIR(st.st_mode) and st.st_uid == VICTIM and stat.S_IMODE(st.st_mode) == 0o700
    assert str(root).startswith(str(shared / f"home-{VICTIM}"))  # the temp dir's name was taken: ~/.cache then
    assert "error" in as_user(FIRST, shared, _read, str(where.parent))  # closed to the other user
    assert (shared / f"sparklm-{VICTIM}" / "inner" / "job" / "held-step1.safetensors").read_bytes() == b"planted"


@as_root
def test_the_temp_directory_is_used_where_no_one_took_the_name(shared):
    got = as_user(VICTIM, shared, _inner)["ok"]
    assert got == str(shared / f"sparklm-{VICTIM}" / "inner" / "job")
    assert stat.S_IMODE((shared / f"sparklm-{VICTIM}").stat().st_mode) == 0o700


def _refused(base: str) -> str:
    return str(host_dir("x", base=base))


@as_root
def test_a_link_an_open_parent_or_no_place_at_all(shared):
    """A link to a directory of the user's own is still a link (its target can change); a parent others may write
    without the sticky bit lets them rename the entry; with neither place usable, one line."""
    mine = shared / "home-1002" / "elsewhere"
    mine.mkdir()
    os.chown(mine, VICTIM, VICTIM)
    (shared / f"sparklm-{VICTIM}").symlink_to(mine)
    assert as_user(VICTIM, shared, _refused, str(shared))["ok"].startswith(str(shared / "home-1002" / ".cache"))
    open_parent = shared / "open"
    open_parent.mkdir(mode=0o777)
    open_parent.chmod(0o777)
    assert as_user(VICTIM, shared, _refused, str(open_parent))["ok"].startswith(str(shared / "home-1002"))
    shutil.rmtree(shared / "home-1002" / ".cache")
    (shared / "home-1002").chmod(0o500)  # the fallback cannot be made either
    try:
        err = as_user(VICTIM, shared, _refused, str(shared))["error"]
    finally:
        (shared / "home-1002").chmod(0o755)
    assert err.startswith("SparklmError: no directory of this user's own") and "\n" not in err


@as_root
def test_the_env_launchers_directory_check_loses_no_race_to_a_link_swap(shared):
    """The launcher tested its directory with -L, -d and -O, each looking the path up again: another user swapping
    a directory and a link to one of this user's directories won 4 of 3,000 tries. One lstat decides now."""
    private = re.search(r"private\(\) \{.*?\n\}\n", launcher("n", "a.pack", "0" * 64), re.S).group(0)
    target = shared / f"sparklm-{VICTIM}"
    victims = shared / "home-1002" / "own"
    victims.mkdir()
    os.chown(victims, VICTIM, VICTIM)
    attacker = os.fork()
    if attacker == 0:  # pragma: no cover - the other user: the name is always theirs, a directory or a link in turn
        os.setgroups([])
        os.setgid(FIRST)
        os.setuid(FIRST)
        target.mkdir(mode=0o777)
        (shared / "link").symlink_to(victims)
        exchange = ctypes.CDLL(None, use_errno=True).renameat2
        while True:  # renameat2(RENAME_EXCHANGE): the two names trade places atomically
            exchange(-100, bytes(target), -100, bytes(shared / "link"), 2)
    try:
        script = (f"uid={VICTIM}\n{private}n=0; i=0\nwhile [ $i -lt 600 ]; do\n"
                  f"  if private {target}; then n=$((n+1)); fi; i=$((i+1))\ndone\necho $n\n")
        out = subprocess.run(["setpriv", f"--reuid={VICTIM}", f"--regid={VICTIM}", "--clear-groups", "sh", "-c", script],
                             capture_output=True, text=True, timeout=120)
    finally:
        os.kill(attacker, 9)
        os.waitpid(attacker, 0)
    assert out.stdout.strip() == "0", (out.stdout, out.stderr[-500:])


# -- a prepared dataset's manifest -----------------------------------------------------------------------------------


@pytest.mark.parametrize("uri", ["/data/ds", "s3://bucket/ds"])
@pytest.mark.parametrize("name", ["/etc/passwd", "../other/train.parquet", "train/../../x.parquet", ""])
def test_a_manifest_cannot_name_a_file_outside_its_dataset(uri, name):
    """posixpath.join("s3://b/ds", "/abs") is "/abs": a remote dataset's manifest made training read this host's
    files."""
    ds = PreparedDataset(uri=uri, manifest={"splits": {"train": {"files": [{"path": name}]}}})
    with pytest.raises(SparklmError, match="leaves its directory"):
        ds.files("train")
    ok = PreparedDataset(uri=uri, manifest={"splits": {"train": {"files": [{"path": "train/part-0.parquet"}]}}})
    assert ok.files("train") == [f"{uri}/train/part-0.parquet"]


def _dataset_with_template(tmp_path: Path) -> PreparedDataset:
    from conftest import tiny_tokenizer

    tok = tiny_tokenizer(["some text to learn from"] * 4, ["<eos>"], None)
    spec = from_tokenizer(tok, "<eos>", "<eos>", "<eos>", add_bos=False,
                          chat_template="{% for m in messages %}{{ m['content'] }}{% endfor %}")
    (tmp_path / "tokenizer.json").write_text(spec.json)
    (tmp_path / "chat_template.jinja").write_text(spec.chat_template)
    manifest = {"tokenizer": {"file": "tokenizer.json", "sha256": spec.checksum, "bos_id": spec.bos_id,
                              "eos_id": spec.eos_id, "pad_id": spec.pad_id, "add_bos": False,
                              "chat_template": "chat_template.jinja"}}
    (tmp_path / MANIFEST).write_text(json.dumps(manifest))
    return PreparedDataset(uri=str(tmp_path), manifest=manifest)


def test_the_chat_template_is_part_of_the_tokenizers_checksum(tmp_path):
    """The template was read from wherever the manifest pointed and no checksum covered it; it renders the training
    text and travels into model/ and the trackers' artifacts."""
    ds = _dataset_with_template(tmp_path)
    assert load_tokenizer(ds).chat_template == (tmp_path / "chat_template.jinja").read_text()
    (tmp_path / "chat_template.jinja").write_text("{{ 'something else' }}")
    with pytest.raises(SparklmError, match="chat template does not match its manifest"):
        load_tokenizer(ds)
    outside = PreparedDataset(uri=ds.uri, manifest={**ds.manifest, "tokenizer": {
        **ds.manifest["tokenizer"], "chat_template": "../elsewhere.jinja"}})
    with pytest.raises(SparklmError, match="leaves its directory"):
        load_tokenizer(outside)
