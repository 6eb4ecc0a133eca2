"""The command line: one clear line and a non-zero exit for foreseeable mistakes; atomic output."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import assert_one_line_interrupt, interrupt, make_text, run_sparklm, spark_started
from sparklm.cli import build_parser, main


@pytest.mark.parametrize(
    "args, message",
    [
        (["prepare", "no/such/file.txt", "-o", "x"], "error: input not found: no/such/file.txt"),
        (["prepare", "--set", "data.seq_len=1", "-o", "x"], "error: config key 'data.seq_len' is 1"),
        (["prepare", "--set", "data.nope=1", "-o", "x"], "error: unknown config key 'data.nope'"),
        (["prepare", "--config", "missing.toml"], "error: config file not found: missing.toml"),
        (["prepare", "--conf", "novalue"], "error: bad --conf 'novalue'"),
        (["prepare", "--encoding", "nope", "-o", "x"], "error: data.encoding 'nope' is not a text encoding"),
        # checked before Spark starts and the inputs are read (a later failure would print Spark's line first)
        (["prepare", ".", "--tokenizer", "no/such/tokenizer", "-o", "x"], "error: tokenizer not found: no/such/tokenizer"),
        (["prepare", "s3://corpus/a.txt", "-o", "x", "--endpoint-url", "http://127.0.0.1:9"],  # nothing listens
         "error: cannot reach the object store"),
        (["prepare", "hdfs://namenode:8020/corpus/a.txt", "-o", "x"], "error: cannot open hdfs://namenode:8020"),
    ],
)
def test_bad_input_is_one_line_without_traceback(tmp_path, args, message, capsys, monkeypatch):
    # A fresh process (a user's) for the first case and those that reach a filesystem library (HDFS's client could
    # start a JVM in this process); the others in this one, through main(), built to run in a caller's process:
    # a fresh process costs seconds of startup each.
    fresh = args[1].startswith(("no/", "s3:", "hdfs:"))
    if fresh:
        r = run_sparklm(*args, cwd=tmp_path)
        code, err = r.returncode, r.stderr
    else:
        monkeypatch.chdir(tmp_path)
        code = main(args)
        err = capsys.readouterr().err
    assert code == 2
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines == [lines[0]] and lines[0].startswith(message), err
    assert "Traceback" not in err


def test_a_run_is_not_written_into_a_prepared_dataset(tmp_path):
    """``--data d -o d``: the run's files would land among the dataset's, and a later ``prepare --overwrite`` of it
    would refuse to touch them."""
    data = tmp_path / "prepared"
    data.mkdir()
    manifest = '{"format": "sparklm.prepared/1"}'
    (data / "manifest.json").write_text(manifest)
    r = run_sparklm("train", "--data", str(data), "-o", str(data), cwd=tmp_path)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip().splitlines() == [r.stderr.strip()]
    assert r.stderr.startswith(f"error: --output {data} holds a prepared dataset"), r.stderr
    assert sorted(p.name for p in data.iterdir()) == ["manifest.json"]


def test_debug_shows_the_traceback(tmp_path):
    r = run_sparklm("prepare", "no/such/file.txt", "--debug", cwd=tmp_path)
    assert r.returncode != 0 and "Traceback" in r.stderr


@pytest.mark.slow
def test_prepare_cli_end_to_end_and_kill_midway(tmp_path):
    src = tmp_path / "in.txt"
    src.write_text(make_text(300, seed=6))
    out = tmp_path / "out"
    common = ["--set", "tokenizer.vocab_size=300", "--seq-len", "32", "--master", "local[2]", "--set", "spark.ui=false"]
    r = run_sparklm("prepare", str(src), "-o", str(out), *common)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == str(out) and "prepare summary" in r.stderr
    manifest = (out / "manifest.json").read_text()
    # Kill a second run (with --overwrite) once it has started writing: the first output stays intact
    # and no directory that later stages would accept appears.
    proc = subprocess.Popen([sys.executable, "-m", "sparklm", "prepare", str(src), "-o", str(out), "--overwrite",
                             *common], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + 120
    while time.time() < deadline and not list(tmp_path.glob(".out.sparklm-tmp-*")) and proc.poll() is None:
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert (out / "manifest.json").read_text() == manifest
    accepted = [p for p in tmp_path.iterdir() if (p / "manifest.json").exists()]
    assert accepted == [out]
    # Ctrl-C in a third one (a longer input), once its tasks run: one line, exit 130, the first output intact
    (tmp_path / "big.txt").write_text(make_text(6000, seed=7))
    r = interrupt(["prepare", str(tmp_path / "big.txt"), "-o", str(out), "--overwrite", *common],
                  spark_started)
    assert_one_line_interrupt(r)
    assert (out / "manifest.json").read_text() == manifest
    assert [p for p in tmp_path.iterdir() if (p / "manifest.json").exists()] == [out]


def test_main_returns_exit_code_in_process(tmp_path, capsys):
    assert main(["prepare", str(tmp_path / "missing"), "-o", str(tmp_path / "o")]) == 2
    assert "input not found" in capsys.readouterr().err


def _subcommands() -> dict:
    """Every subcommand's parser (argparse keeps them on its subparsers action)."""
    parser = build_parser()
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(action.choices)


@pytest.mark.parametrize("command", sorted(_subcommands()))
def test_every_subcommand_help_works_and_names_every_flag(command, capsys):
    if command == "train":  # one as a user runs it; the others through main() in this process (seconds each saved)
        r = run_sparklm(command, "--help", timeout=60)
        code, out, err = r.returncode, r.stdout, r.stderr
    else:
        with pytest.raises(SystemExit) as e:
            main([command, "--help"])
        got = capsys.readouterr()
        code, out, err = e.value.code, got.out, got.err
    assert code == 0 and "Traceback" not in err, err
    flags = {s for a in _subcommands()[command]._actions for s in a.option_strings}
    assert flags and not [f for f in flags if f not in out], out
