"""Shared hosts and shared object stores (SECURITY.md): each test reproduces a finding of the security review first
(another user's planted files, a hostile object name, a secret key the old rule missed), then checks the fix."""

from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import tarfile
import time
from pathlib import Path

import pytest

from sparklm.config import expand
from sparklm.infra import redact
from sparklm.infra.errors import SparklmError
from sparklm.infra.fs import inside, local_copy, verify_checksums
from sparklm.spark import environment

NOBODY = 65534
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="planting another user's files needs root (CI runs as root)")


# -- the shipped environment's launcher --------------------------------------------------------------


def _shipment(work: Path, says: str = "shipped") -> Path:
    """An archive whose bin/python prints ``says``, and its launcher, as Spark puts them in an executor's directory."""
    work.mkdir(parents=True, exist_ok=True)
    pack = work / "sparklm-env-abc.pack"
    with tarfile.open(pack, "w:gz") as tar:
        body = f"#!/bin/sh\necho {says}\n".encode()
        info = tarfile.TarInfo("bin/python")
        info.size, info.mode = len(body), 0o755
        tar.addfile(info, io.BytesIO(body))
    script = work / "sparklm-env-abc.launch"
    script.write_text(environment.launcher("sparklm-env-abc", pack.name,
                                           hashlib.sha256(pack.read_bytes()).hexdigest()))
    script.chmod(0o755)
    return script


def _launch(script: Path, tmp: Path, home: Path, timeout: float = 30) -> subprocess.CompletedProcess:
    env = {"PATH": os.environ["PATH"], "TMPDIR": str(tmp), "HOME": str(home)}
    return subprocess.run([f"./{script.name}"], cwd=script.parent, env=env, capture_output=True, text=True,
                          timeout=timeout)


def _planted(directory: Path, owner: int = NOBODY) -> None:
    """What another user leaves at ``directory``: an unpacked-looking environment whose interpreter says PLANTED."""
    python = directory / "sparklm-env-abc" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text("#!/bin/sh\necho PLANTED\n")
    python.chmod(0o755)
    (python.parent.parent / ".unpacked").touch()
    (directory / "sparklm-env-abc.lock").mkdir()  # and a lock that would keep our executors waiting
    subprocess.run(["chown", "-R", str(owner), str(directory)], check=True)


def test_the_launcher_unpacks_once_into_a_directory_of_its_users_own(tmp_path):
    script = _shipment(tmp_path / "work")
    assert _launch(script, tmp_path / "tmp", tmp_path / "home").stdout.strip() == "shipped"
    mine = tmp_path / "tmp" / f"sparklm-{os.getuid()}"
    assert mine.is_dir() and oct(mine.stat().st_mode & 0o777) == "0o700"
    assert (mine / "sparklm-env-abc" / ".unpacked").read_text() == hashlib.sha256(
        (tmp_path / "work" / "sparklm-env-abc.pack").read_bytes()).hexdigest()
    assert _launch(script, tmp_path / "tmp", tmp_path / "home").stdout.strip() == "shipped"  # reused


@as_root
def test_another_users_directory_at_the_launchers_path_is_never_run_nor_waited_for(tmp_path):
    """The review's demonstration: a directory created first by another user, holding an interpreter and a lock."""
    _planted(tmp_path / "tmp" / f"sparklm-{os.getuid()}")
    script = _shipment(tmp_path / "work")
    r = _launch(script, tmp_path / "tmp", tmp_path / "home")  # neither runs PLANTED nor waits on the lock
    assert r.stdout.strip() == "shipped", r.stderr
    assert (tmp_path / "home" / ".cache" / "sparklm" / "env" / "sparklm-env-abc" / ".unpacked").is_file()
    # another user's directory at the fallback too: one line, exit 1, nothing run
    _planted(tmp_path / "home" / ".cache" / "sparklm" / "env2")
    (tmp_path / "home" / ".cache" / "sparklm" / "env").rename(tmp_path / "home" / ".cache" / "sparklm" / "mine")
    (tmp_path / "home" / ".cache" / "sparklm" / "env2").rename(tmp_path / "home" / ".cache" / "sparklm" / "env")
    r = _launch(script, tmp_path / "tmp", tmp_path / "home")
    assert r.returncode == 1 and "PLANTED" not in r.stdout and "no directory of this user's own" in r.stderr


def test_a_link_at_the_launchers_path_is_not_followed(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    _planted(elsewhere, owner=os.getuid())
    (tmp_path / "tmp").mkdir()
    (tmp_path / "tmp" / f"sparklm-{os.getuid()}").symlink_to(elsewhere)
    r = _launch(_shipment(tmp_path / "work"), tmp_path / "tmp", tmp_path / "home")
    assert r.stdout.strip() == "shipped", r.stderr  # from ~/.cache/sparklm/env, not through the link
    assert (tmp_path / "home" / ".cache" / "sparklm" / "env" / "sparklm-env-abc" / ".unpacked").is_file()


def test_an_unpacked_environment_of_another_archive_is_unpacked_again(tmp_path):
    script = _shipment(tmp_path / "work", says="first")
    assert _launch(script, tmp_path / "tmp", tmp_path / "home").stdout.strip() == "first"
    _shipment(tmp_path / "work", says="second")  # same name, other content (gzip's timestamps aside)
    assert _launch(script, tmp_path / "tmp", tmp_path / "home").stdout.strip() == "second"


# -- remote names as local paths -----------------------------------------------------------------------


@pytest.mark.parametrize("name", ["../x", "a/../../x", "/etc/passwd", "a//b", "./a", "a/..", "C:/x", "a\\..\\..\\x",
                                  "", "a\0b"])
def test_a_name_that_leaves_its_directory_is_refused(tmp_path, name):
    with pytest.raises(SparklmError, match="leaves its directory"):
        inside(tmp_path, name)


def test_a_name_inside_its_directory_maps_there(tmp_path):
    assert inside(tmp_path, "a/b.c") == tmp_path / "a" / "b.c"
    assert inside(tmp_path, "..hidden") == tmp_path / "..hidden"


def test_an_object_named_with_dots_does_not_write_outside_the_cache(tmp_path, monkeypatch):
    """The review's demonstration: ``model/../../x`` in an object store became ``cache/../../x`` on every host."""
    import fsspec

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    memory = fsspec.filesystem("memory")
    memory.pipe("/bucket-sec/model/ok.txt", b"fine")
    memory.pipe("/bucket-sec/model/../../escaped-sparklm.txt", b"written outside")
    try:
        with pytest.raises(SparklmError, match="leaves its directory"):
            local_copy("memory://bucket-sec/model")
    finally:
        memory.rm("/bucket-sec", recursive=True)
    assert not list(tmp_path.rglob("escaped-sparklm.txt"))


def _model_with_checksums(directory: Path) -> Path:
    from sparklm.infra.fs import write_checksums

    directory.mkdir(parents=True)
    (directory / "config.json").write_text('{"model_type": "llama"}')
    (directory / "model.safetensors").write_bytes(os.urandom(1 << 20))
    write_checksums(directory)
    return directory


def test_a_verified_file_is_hashed_again_only_once_it_changes(tmp_path, monkeypatch):
    """A model's files, hashed and found intact, are not read again on the next load while each keeps its stamp
    (size, inode, modification and change times); a write changes the change time, so bytes flipped in place, at
    the same size and with the modification time set back, are found."""
    from sparklm.infra import fs

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(fs, "SETTLED_NS", 0)  # the files here are milliseconds old
    model = _model_with_checksums(tmp_path / "model")
    hashed = []
    real = fs.file_sha256
    monkeypatch.setattr(fs, "file_sha256", lambda path: hashed.append(path.name) or real(path))
    verify_checksums(model)
    assert sorted(hashed) == ["config.json", "model.safetensors"]
    assert list((tmp_path / "cache" / "sparklm" / "verified").glob("*.json"))
    hashed.clear()
    verify_checksums(model)
    assert hashed == []
    weights = model / "model.safetensors"
    before, st = weights.read_bytes(), weights.stat()
    time.sleep(0.05)  # past the file clock's tick
    with open(weights, "r+b") as f:
        f.seek(1000)
        f.write(bytes([before[1000] ^ 0x55]))
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert weights.stat().st_size == st.st_size and weights.stat().st_mtime_ns == st.st_mtime_ns
    with pytest.raises(SparklmError, match="model.safetensors is damaged"):
        verify_checksums(model)
    assert hashed == ["model.safetensors"]
    weights.write_bytes(before)
    verify_checksums(model)  # restored: hashed, found intact, recorded again


def test_a_file_written_while_it_is_hashed_is_not_recorded_as_intact(tmp_path, monkeypatch):
    """The stamp is taken before the file is read and recorded only if the file still has it: bytes written after
    the hash read them would otherwise pass every later load unread."""
    from sparklm.infra import fs

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(fs, "SETTLED_NS", 0)
    model = _model_with_checksums(tmp_path / "model")
    weights = model / "model.safetensors"
    real = fs.file_sha256

    def hash_then_write(path):
        digest = real(path)
        if path == weights:  # another process writes the file just after its bytes were hashed
            time.sleep(0.05)
            with open(path, "r+b") as f:
                f.write(b"\0" * 16)
        return digest

    monkeypatch.setattr(fs, "file_sha256", hash_then_write)
    verify_checksums(model)  # what it hashed was intact
    monkeypatch.setattr(fs, "file_sha256", real)
    with pytest.raises(SparklmError, match="model.safetensors is damaged"):
        verify_checksums(model)


def test_a_file_written_moments_ago_is_hashed_every_time_and_an_unwritable_record_is_ignored(tmp_path, monkeypatch):
    from sparklm.infra import fs

    model = _model_with_checksums(tmp_path / "model")
    hashed = []
    real = fs.file_sha256
    monkeypatch.setattr(fs, "file_sha256", lambda path: hashed.append(path.name) or real(path))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    for _ in range(2):  # written moments ago: its times could still stay through a write
        verify_checksums(model)
    assert len(hashed) == 4 and not (tmp_path / "cache").exists()
    st = (model / "config.json").stat()
    assert fs.file_stamp(st, st.st_ctime_ns + fs.SETTLED_NS - 1) is None
    assert fs.file_stamp(st, st.st_ctime_ns + fs.SETTLED_NS) == [st.st_size, st.st_ino, st.st_dev, st.st_mtime_ns,
                                                                  st.st_ctime_ns]
    monkeypatch.setattr(fs, "SETTLED_NS", 0)
    (tmp_path / "cache").write_text("a file where the cache directory would be")
    hashed.clear()
    for _ in range(2):  # the record cannot be written: hashed as before, no error
        verify_checksums(model)
    assert len(hashed) == 4 and (tmp_path / "cache").is_file()


def test_a_checksum_list_cannot_point_outside_its_directory(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "sparklm_checksums.json").write_text('{"../outside.bin": "00"}')
    with pytest.raises(SparklmError, match="leaves its directory"):
        verify_checksums(tmp_path / "model")


# -- secrets ---------------------------------------------------------------------------------------------

# Real configuration names (Hadoop's S3A/ABFS/GCS connectors, Spark, Kubernetes, Kafka, trackers' variables)
SECRET_KEYS = [
    "spark.hadoop.fs.s3a.secret.key", "spark.hadoop.fs.s3a.access.key", "spark.hadoop.fs.s3a.session.token",
    "spark.hadoop.fs.s3a.encryption.key", "fs.s3a.server-side-encryption.key",
    "spark.hadoop.fs.azure.account.key.myacct.dfs.core.windows.net",
    "fs.azure.sas.mycontainer.myacct.blob.core.windows.net", "fs.azure.sas.fixed.token.myacct.dfs.core.windows.net",
    "fs.azure.account.oauth2.client.secret", "fs.azure.account.oauth2.refresh.token",
    "spark.hadoop.google.cloud.auth.service.account.private.key", "fs.gs.auth.access.token",
    "spark.executorEnv.WANDB_API_KEY", "spark.executorEnv.HF_TOKEN", "spark.executorEnv.MLFLOW_TRACKING_TOKEN",
    "my.service.api.key", "spark.kubernetes.authenticate.submission.oauthToken", "spark.authenticate.secret",
    "spark.ssl.keyStorePassword", "spark.databricks.token", "kafka.sasl.jaas.config", "fs.oss.accessKeySecret",
    "fs.cosn.userinfo.secretKey", "spark.executorEnv.AZURE_STORAGE_CONNECTION_STRING",
]
PLAIN_KEYS = ["spark.executor.memory", "spark.sql.shuffle.partitions", "tokenizer.pad_token", "tokenizer.bos_token",
              "train.max_tokens", "sampling.max_new_tokens", "spark.kryo.registrator", "data.text_column",
              "spark.hadoop.fs.s3a.endpoint", "spark.redaction.regex"]


@pytest.mark.parametrize("key", SECRET_KEYS)
def test_every_secret_key_family_is_masked_where_settings_are_written(key):
    saved = redact.mapping({"spark": {"conf": {key: "Val-u3-0f-a-secret", "spark.executor.memory": "4g"}}})
    assert saved == {"spark": {"conf": {key: "***", "spark.executor.memory": "4g"}}}
    assert "Val-u3" not in redact.text(f"--conf {key}=Val-u3-0f-a-secret")


@pytest.mark.parametrize("key", PLAIN_KEYS)
def test_settings_that_are_not_secrets_stay_readable(key):
    assert not redact.is_secret(key)


def test_a_secret_is_read_from_the_environment_where_it_is_used_and_saved_as_its_reference(monkeypatch):
    monkeypatch.setenv("SPARKLM_TEST_KEY", "from-the-environment-77")
    ref = "${env:SPARKLM_TEST_KEY}"
    assert redact.mapping({"fs.azure.account.key.a": ref}) == {"fs.azure.account.key.a": ref}  # resume reads it again
    assert expand(ref, "spark.conf x") == "from-the-environment-77"
    assert redact.text("the key from-the-environment-77 leaked") == "the key *** leaked"
    monkeypatch.delenv("SPARKLM_TEST_KEY")
    with pytest.raises(SparklmError, match="SPARKLM_TEST_KEY is not set"):
        expand(ref, "spark.conf x")


def test_a_resumed_run_never_hands_the_mask_to_spark():
    saved = {"spark": {"conf": {"spark.hadoop.fs.s3a.secret.key": "***", "spark.executor.memory": "4g"}},
             "tokenizer": {"pad_token": "***"}}  # a setting that merely reads *** is kept
    assert redact.unmasked(saved) == {"spark": {"conf": {"spark.executor.memory": "4g"}},
                                      "tokenizer": {"pad_token": "***"}}


def test_a_secret_typed_on_the_command_line_is_refused_before_anything_runs(capsys):
    """The review: ``--conf …secret…=X`` stayed in sparklm's own ``ps`` line."""
    from sparklm.cli import main

    code = main(["train", "--data", "data", "--output", "run", "--conf", "spark.hadoop.fs.azure.account.key.a=Sup3rSecretVal"])
    err = capsys.readouterr().err
    assert code != 0 and "given on the command line" in err and "${env:NAME}" in err and "Sup3rSecretVal" not in err
    assert redact.literal_secrets(["spark.conf.spark.hadoop.fs.s3a.secret.key=${env:S3_SECRET}"]) == []


# -- smaller findings ------------------------------------------------------------------------------------


def test_overwrite_replaces_only_a_directory_that_holds_nothing_but_what_sparklm_wrote(tmp_path):
    """The review: a directory that merely held the marker (copied there, or left by an export) lost every file."""
    from sparklm.infra.fs import check_replaceable, listing

    mine = tmp_path / "home"
    (mine / "notes").mkdir(parents=True)
    (mine / "notes" / "thesis.tex").write_text("years of work")
    (mine / "sparklm_export.json").write_text('{"format": "onnx"}')  # a marker copied in, or an old export's
    with pytest.raises(SparklmError, match="holds notes/thesis.tex, which sparklm did not write"):
        check_replaceable(mine, True, marker="sparklm_export.json", kind="a sparklm export")
    ours = tmp_path / "export"
    ours.mkdir()
    (ours / "model.onnx").write_bytes(b"x")
    (ours / "sparklm_export.json").write_text(json.dumps({"files": listing(ours)}))
    check_replaceable(ours, True, marker="sparklm_export.json", kind="a sparklm export")  # ours: replaceable
    (ours / "mine.txt").write_text("added later by the user")
    with pytest.raises(SparklmError, match="holds mine.txt"):
        check_replaceable(ours, True, marker="sparklm_export.json", kind="a sparklm export")


def test_a_class_label_that_reads_as_tex_draws_as_text(tmp_path):
    """The review: a label like ``$\\bogus$`` made the confusion plot raise after training (no report, trackers FAILED)."""
    from sparklm.tasks.classify import plot_confusion

    kept = {"val_confusion": {"labels": ["$\\bogus$", "$x^$", "plain"], "matrix": [[3, 1, 0], [0, 2, 1], [1, 0, 4]]}}
    plot_confusion(str(tmp_path), kept)
    assert (tmp_path / "confusion.png").read_bytes()[:4] == b"\x89PNG"


def test_a_flat_layout_projects_root_ships_only_what_python_imports(tmp_path):
    """The review: an editable install of a flat-layout project put its whole root (tests, data, runs, credentials)
    into the environment archive, readable by every user of the host."""
    root = tmp_path / "project"
    for d in ("mypkg", "tests", "runs", "data", "mypkg.egg-info"):
        (root / d).mkdir(parents=True)
    (root / "mypkg" / "__init__.py").touch()
    (root / "tests" / "__init__.py").touch()
    for f in ("helper.py", "setup.py", "secrets.toml", "README.md", "fast.cpython-311-x86_64-linux-gnu.so"):
        (root / f).touch()
    shipped = sorted(p.name for p in root.iterdir() if environment.importable(p))
    assert shipped == ["fast.cpython-311-x86_64-linux-gnu.so", "helper.py", "mypkg"]
