"""Fault injection against real processes: each fault ends either bitwise equal to the fault-free run (where the
docs promise it) or in exactly one ``error:`` line and a non-zero exit, with no partial output and no leftovers.
The table of these cases is RELIABILITY.md."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import assert_one_line_interrupt, cfg, figures, interrupt, make_text, weights
from sparklm.infra.errors import SparklmError
from sparklm.infra.private import host_dir
from sparklm.launch.train import train
from sparklm.metrics.sinks import read_metrics

TINY_FLAGS = ["--master", "local[2]", "--set", "spark.ui=false", "--set", "model.n_layer=1", "--set", "model.n_head=2",
              "--set", "model.n_embd=32", "--set", "train.eval_batches=2", "--set", "train.samples=0",
              "--set", 'train.dtype="float32"', "--threads", "1", "--set", "train.batch_size=4"]


def cli(*args, env=None, timeout=300):
    return subprocess.run([sys.executable, "-m", "sparklm", *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "SPARK_LOCAL_IP": "127.0.0.1", **(env or {})})


def one_error_line(r) -> str:
    """The process failed with exactly one line on stderr that starts with ``error:``, and no traceback."""
    lines = [line for line in r.stderr.splitlines() if line.strip() and not line.startswith(("warning:", "Spark "))]
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr[-3000:]
    errors = [line for line in lines if line.startswith("error: ")]
    assert len(errors) == 1 and errors == lines[-1:], r.stderr[-3000:]
    return errors[0]


@pytest.fixture
def tiny_fs(tmp_path):
    """A 64 kB tmpfs (disk full on demand); needs root and mount, else the test is skipped with the reason."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)], capture_output=True, text=True)
    if r.returncode:
        pytest.skip(f"cannot mount a small tmpfs here ({r.stderr.strip() or 'not root'})")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


# -- data loss --------------------------------------------------------------------------------------


def test_overwrite_replaces_only_sparklm_outputs(tmp_path):
    victim = tmp_path / "etc"
    victim.mkdir()
    (victim / "passwd").write_text("root:x:0:0")
    (tmp_path / "in.txt").write_text(make_text(20))
    r = cli("prepare", str(tmp_path / "in.txt"), "-o", str(victim), "--overwrite", "--master", "local[1]")
    assert "refusing to --overwrite" in one_error_line(r)
    assert (victim / "passwd").read_text() == "root:x:0:0"
    from sparklm.infer.export import export

    with pytest.raises(SparklmError, match="refusing to --overwrite"):
        export("no-such-model", str(victim), overwrite=True)
    assert sorted(p.name for p in victim.iterdir()) == ["passwd"]


def test_overwrite_of_a_dataset_refuses_files_it_did_not_write(spark, dataset, tmp_path):
    """A sparklm manifest beside a user's own file: --overwrite must not take the file with the dataset."""
    from sparklm.config import from_dict
    from sparklm.launch.prepare import prepare

    mixed = tmp_path / "mixed"
    mixed.mkdir()
    shutil.copy(Path(dataset) / "manifest.json", mixed / "manifest.json")
    (mixed / "thesis.docx").write_text("keep")
    (tmp_path / "in.txt").write_text(make_text(60))
    conf = from_dict({"data": {"seq_len": 32}, "tokenizer": {"vocab_size": 300}})
    with pytest.raises(SparklmError, match=r"sparklm did not write \(thesis.docx\)"):
        prepare([str(tmp_path / "in.txt")], output=str(mixed), config=conf, overwrite=True, spark=spark)
    assert (mixed / "thesis.docx").read_text() == "keep"
    # a dataset holding only its own files is replaced; it then lists them, and a stray file added later is refused
    own = tmp_path / "own"
    prepare([str(tmp_path / "in.txt")], output=str(own), config=conf, spark=spark)
    prepare([str(tmp_path / "in.txt")], output=str(own), config=conf, overwrite=True, spark=spark)
    listed = json.loads((own / "manifest.json").read_text())["contents"]
    assert sorted(str(p.relative_to(own)) for p in own.rglob("*") if p.is_file()) == listed
    (own / "train" / "notes.txt").write_text("mine")
    with pytest.raises(SparklmError, match="notes.txt"):
        prepare([str(tmp_path / "in.txt")], output=str(own), config=conf, overwrite=True, spark=spark)


def test_stale_staging_of_a_killed_prepare_is_removed(spark, tmp_path):
    from sparklm.config import from_dict
    from sparklm.launch.prepare import prepare

    (tmp_path / "in.txt").write_text(make_text(60))
    stale = tmp_path / ".out.sparklm-tmp-0123456789ab"
    (stale / "train").mkdir(parents=True)
    (stale / "train" / "part-0.parquet").write_bytes(b"half")
    old = time.time() - 3600
    os.utime(stale, (old, old))
    prepare([str(tmp_path / "in.txt")], output=str(tmp_path / "out"), spark=spark,
            config=from_dict({"data": {"seq_len": 32}, "tokenizer": {"vocab_size": 300}}))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.txt", "out"]


# -- rounds survive any failure of a worker --------------------------------------------------------


def test_a_retried_round_with_a_lossy_codec_is_bitwise_the_uninterrupted_one(dataset, tmp_path):
    """local[2,2] gives a task two attempts: worker 1's first attempt of round 2 fails after its inner steps and its
    state write; the retry recomputes the same int4 delta and residual, so the run ends bit for bit where the run
    without the fault does."""
    flags = [f if f != "local[2]" else "local[2,2]" for f in TINY_FLAGS]
    runs = {}
    for name, fault in (("clean", ""), ("retried", "round=1,worker=1,attempts=1,at=end")):
        runs[name] = tmp_path / name
        r = cli("train", "--data", dataset, "-o", str(runs[name]), "--strategy", "diloco", "--workers", "2",
                "--max-steps", "6", "--sync-every", "2", "--codec", "int4", *flags,
                env={"SPARKLM_INJECT_FAULT": fault} if fault else None)
        assert r.returncode == 0, r.stderr[-3000:]
    import csv

    with (runs["retried"] / "rounds.csv").open() as f:
        assert [r["attempts"] for r in csv.DictReader(f)] == ["0;0", "0;1", "0;0"]
    a, b = weights(runs["clean"]), weights(runs["retried"])
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_crashed_worker_is_left_out_of_its_round_and_nothing_leaks(spark, dataset, tmp_path, monkeypatch, capfd):
    inner = host_dir("inner")
    before = set(inner.iterdir()) if inner.exists() else set()
    # local[2] gives a task one attempt: worker 1's Python process is SIGKILLed after its steps of the second round
    # (which also evaluates the weights of step 2)
    monkeypatch.setenv("SPARKLM_INJECT_FAULT", "round=1,worker=1,at=crash")
    run = tmp_path / "crash"
    s = train(dataset, output=str(run), config=cfg(max_steps=6, samples=0, strategy="average", sync_every=2,
                                                   workers=2, eval_every=2), spark=spark)
    err = capfd.readouterr().err
    # one line in the run's own numbering (the progress line's "round 2"), the cause in words, not cut mid-word
    assert ("round 2: 1 of 2 workers returned a delta (worker 1 failed: its task failed 1 time(s): its Python worker "
            "exited unexpectedly") in err, err[-3000:]
    # the evaluation of step 2 scored only worker 0's validation rows: said, recorded, not used to pick the best
    assert "the evaluation at step 2 covers the validation rows of 1 of 2 workers" in err
    assert s["best"]["step"] in (4, 6)
    import csv

    with (run / "rounds.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [r["workers_done"] for r in rows] == ["2", "1", "2"]
    assert rows[2]["cold"] == "1"  # its state held the steps of the dropped round: it restarts fresh
    assert s["steps"] == 6 and s["final"]["val_loss"] > 0
    assert (set(inner.iterdir()) if inner.exists() else set()) == before  # no optimizer state left behind


# -- DDP: rank loss, slots, stuck collectives -------------------------------------------------------


@pytest.mark.slow
def test_kill_campaign_short_form(dataset, tmp_path):
    """benchmarks/kill_campaign.py's short form (its full form, N >= 50 random points on local mode and a standalone
    cluster, is in RELIABILITY.md): seed 12 draws DDP rank 1 SIGKILLed after step 5 (the ranks restart from the
    checkpoint of step 4) and the DiLoCo driver SIGKILLed after step 7, then `--resume`; both end with the weights
    of the uninterrupted run, bitwise, the same metrics.csv step for step, and no process left behind."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import kill_campaign

    outcomes = kill_campaign.campaign(2, 12, ["local"], ["ddp", "diloco"], tmp_path, report=print, data=dataset)
    by = {o.point.strategy: o for o in outcomes}
    assert (by["ddp"].point.target, by["ddp"].point.rank, by["diloco"].point.target) == ("rank", 1, "driver")
    for o in outcomes:
        assert o.passed and o.killed_at is not None, (o, o.stderr)
    rank = by["ddp"].stderr
    assert "restarting the ranks from the checkpoint of step 4" in rank, rank
    assert "warning: training rank 1 on " in rank  # the rank that died is named, not the one that lost it


@pytest.mark.slow
def test_a_stuck_rank_fails_within_the_collective_timeout_naming_rank_and_host(dataset, tmp_path):
    t0 = time.time()
    r = cli("train", "--data", dataset, "-o", str(tmp_path / "hang"), "--max-steps", "8", "--workers", "2",
            "--set", "train.ddp.collective_timeout=10", "--set", "train.ddp.max_restarts=0", *TINY_FLAGS,
            env={"SPARKLM_INJECT_RANK_FAULT": "rank=1,step=2,at=hang"})
    line = one_error_line(r)
    assert "training rank 0 on " in line and "a peer rank stopped answering" in line, line
    assert time.time() - t0 < 120


def test_too_few_slots_is_one_line_before_submitting(spark, dataset, tmp_path):
    t0 = time.time()
    with pytest.raises(SparklmError, match="needs 3 free Spark task slots at once; this Spark has 2"):
        train(dataset, output=str(tmp_path / "r"), config=cfg(max_steps=2, workers=3), spark=spark)
    assert time.time() - t0 < 30
    assert not (tmp_path / "r").exists()  # nothing written: the same --output works once there are slots


@pytest.mark.parametrize("strategy", ["ddp", "average"])
def test_a_diverged_run_stops_with_one_line_not_a_nan_model(spark, dataset, tmp_path, strategy):
    """An lr a million times too large: the loss went nan by the second step, and the run trained on to its end,
    exported a model of nan weights and exited 0. It stops once the mean loss stays non-finite (a few steps: fp16's
    scaler skips a step of inf gradients, and a run recovers from it), and says what to change."""
    rounds = {"sync_every": 2} if strategy != "ddp" else {}
    config = cfg(max_steps=40, lr=1e6, warmup_steps=0, strategy=strategy, workers=2 if rounds else 1, **rounds)
    with pytest.raises(SparklmError, match=r"training diverged: the mean loss is nan since step \d+ .*lower train.lr "
                                           r"\(it is 1e\+06\)"):
        train(dataset, output=str(tmp_path / "r"), config=config, spark=spark)
    assert not (tmp_path / "r" / "model").exists()


def test_an_elastic_run_starts_on_the_slots_there_are_between_min_and_max(spark, dataset, tmp_path):
    """--workers MIN:MAX on local[2]: 2:4 runs on 2 ranks with the global batch of 4 (twice the accumulation);
    3:4 is the one slots line, before anything is written."""
    with pytest.raises(SparklmError, match="needs 3 free Spark task slots at once; this Spark has 2"):
        train(dataset, output=str(tmp_path / "r"), config=cfg(max_steps=2, workers=4, workers_min=3), spark=spark)
    assert not (tmp_path / "r").exists()
    summary = train(dataset, output=str(tmp_path / "e"), spark=spark,
                    config=cfg(max_steps=3, workers=4, workers_min=2, batch_size=2))
    assert summary["steps"] == 3
    got = [r for r in read_metrics(str(tmp_path / "e" / "metrics.csv")) if r["kind"] == "train"]
    assert {r["workers"] for r in got} == {2}
    assert got[-1]["tokens"] == 3 * 4 * 2 * 32  # 3 steps of the global batch the plan made for 4 workers


# -- secrets ---------------------------------------------------------------------------------------


@pytest.mark.slow
def test_secrets_reach_neither_disk_nor_console(tmp_path):
    """Secrets given the three ways (a config file, an environment variable named on the command line, AWS's own
    variables), among them the Azure key the old rule missed, are in no file, no line and no command line; a resumed
    run reads the variable again."""
    secret = "SuperSecretValue-8c1f"
    (tmp_path / "in.txt").write_text(make_text(200))
    (tmp_path / "secret.toml").write_text(f'[spark.conf]\n"spark.my.password" = "{secret}2"\n'
                                          f'"spark.hadoop.fs.azure.account.key.acct.dfs.core.windows.net" = "{secret}4"\n')
    run = tmp_path / "run"
    env = {"AWS_SECRET_ACCESS_KEY": secret + "3", "SPARKLM_S3_SECRET": secret}
    r = cli("run", str(tmp_path / "in.txt"), "-o", str(run), "--max-steps", "2", "--seq-len", "32", "--vocab-size",
            "300", "--config", str(tmp_path / "secret.toml"),
            "--conf", "spark.hadoop.fs.s3a.secret.key=${env:SPARKLM_S3_SECRET}", *TINY_FLAGS, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    saved = json.loads((run / "config.json").read_text())["config"]["spark"]["conf"]
    assert saved["spark.my.password"] == "***" and saved["spark.hadoop.fs.s3a.secret.key"] == "${env:SPARKLM_S3_SECRET}"
    assert saved["spark.hadoop.fs.azure.account.key.acct.dfs.core.windows.net"] == "***"
    meta = json.loads((run / "config.json").read_text())  # a writer of the run directory points the upload elsewhere
    meta["config"]["tracking"]["mlflow_uri"] = "http://127.0.0.1:9/elsewhere"
    (run / "config.json").write_text(json.dumps(meta))
    r2 = cli("train", "-o", str(run), "--resume", "--max-steps", "3", env=env)  # without the file: said, not ***
    assert r2.returncode == 0, r2.stderr[-3000:]
    assert "spark.my.password" in r2.stderr and "give them again" in r2.stderr
    assert "tracking.mlflow_uri" in r2.stderr and "does not take from the run directory" in r2.stderr
    resumed = json.loads((run / "config.json").read_text())["config"]["spark"]["conf"]
    assert "spark.my.password" not in resumed and resumed["spark.hadoop.fs.s3a.secret.key"].startswith("${env:")
    assert secret not in r.stdout + r.stderr + r2.stdout + r2.stderr
    for f in run.rglob("*"):
        if f.is_file():
            assert secret.encode() not in f.read_bytes(), f
    typed = cli("train", "-o", str(tmp_path / "r2"), "--conf", f"spark.hadoop.fs.s3a.secret.key={secret}")
    assert typed.returncode != 0 and "given on the command line" in typed.stderr and secret not in typed.stderr


# -- damaged inputs: one line, or the previous intact checkpoint -------------------------------------


def test_resume_skips_a_damaged_checkpoint_and_ends_bitwise_equal(spark, dataset, tmp_path):
    full = tmp_path / "full"
    conf = cfg(max_steps=8, checkpoint_every=2, keep_checkpoints=3, samples=0)
    train(dataset, output=str(full), config=conf, spark=spark)
    stopped = tmp_path / "stopped"
    shutil.copytree(full, stopped)
    shutil.rmtree(stopped / "checkpoints" / "step-0000008")
    shutil.rmtree(stopped / "model")
    newest = stopped / "checkpoints" / "step-0000006" / "model.safetensors"
    newest.write_bytes(newest.read_bytes()[:-100])  # truncated, as by a crash mid-copy
    train(None, output=str(stopped), resume=True, spark=spark)
    a, b = weights(full), weights(stopped)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    # the rows the stopped run wrote after the checkpoint it resumed from (step 4) are not there twice: the resumed
    # run rewound metrics.csv to step 4 and wrote them again, as the uninterrupted run has them
    assert figures(stopped) == figures(full)
    # a garbled run config is one line
    (stopped / "config.json").write_text("{not json")
    with pytest.raises(SparklmError, match="is not a sparklm run configuration"):
        train(None, output=str(stopped), resume=True, spark=spark)


def test_damaged_parquet_and_a_lying_manifest_are_one_line(spark, dataset, tmp_path):
    flipped = tmp_path / "flipped"
    shutil.copytree(dataset, flipped)
    part = sorted((flipped / "train").glob("*.parquet"))[0]
    data = bytearray(part.read_bytes())
    for i in range(len(data) // 3, len(data) // 3 + 64):  # inside the first pages: the CRC no longer matches
        data[i] ^= 0xFF
    part.write_bytes(bytes(data))
    with pytest.raises(SparklmError, match="damaged or truncated Parquet"):
        train(str(flipped), output=str(tmp_path / "r1"), config=cfg(max_steps=2, samples=0), spark=spark)
    lying = tmp_path / "lying"
    shutil.copytree(dataset, lying)
    manifest = json.loads((lying / "manifest.json").read_text())
    manifest["splits"]["train"]["files"][0]["rows"] = 99_999
    (lying / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(SparklmError, match="its manifest says 99,999"):
        train(str(lying), output=str(tmp_path / "r2"), config=cfg(max_steps=2, samples=0), spark=spark)


def test_flipped_bytes_in_model_weights_are_found(spark, dataset, tmp_path):
    from sparklm.infer.generate import load

    run = tmp_path / "run"
    train(dataset, output=str(run), config=cfg(max_steps=2, samples=0), spark=spark)
    load(str(run))  # intact: loads
    weights_file = run / "model" / "model.safetensors"
    data = bytearray(weights_file.read_bytes())
    for i in range(len(data) - 3000, len(data) - 1000):
        data[i] ^= 0x55
    weights_file.write_bytes(bytes(data))
    with pytest.raises(SparklmError, match="is damaged: it does not match the SHA-256"):
        load(str(run))


# -- Ctrl-C ----------------------------------------------------------------------------------------


@pytest.mark.slow
def test_one_writer_per_run_directory_ctrl_c_is_one_line_and_the_run_resumes(dataset, tmp_path):
    """Two `sparklm train --output X` at once: the second stops with one line naming the first (host, pid). Ctrl-C
    (SIGINT to the command's process group, as a terminal sends it) then ends the first with one line, exit 130 and
    no process left; `--resume` takes the dead run's lock over, continues from its last checkpoint, and each step's
    row is in metrics.csv once."""
    run = tmp_path / "run"
    flags = ["--set", "train.checkpoint_every=10", "--set", "train.keep_checkpoints=100", "--set", "train.log_every=1",
             *TINY_FLAGS]
    args = ["train", "--data", dataset, "-o", str(run), "--max-steps", "100000", *flags]
    refused = []

    def second_writer():
        refused.append(cli(*args[:-len(TINY_FLAGS)], "--set", "train.seed=7", *TINY_FLAGS))

    r = interrupt(args, lambda err: len(list((run / "checkpoints").glob("step-*"))) >= 2, during=second_writer)
    line = one_error_line(refused[0])
    assert f"is in use by another sparklm run (host {os.uname().nodename}, pid {r.pid}" in line, line
    assert_one_line_interrupt(r)
    assert not (run / ".sparklm.lock").exists()  # let go on Ctrl-C: the next run needs no take-over
    last = max(int(p.name.split("-")[1]) for p in (run / "checkpoints").glob("step-*"))
    resumed = cli("train", "-o", str(run), "--resume", "--max-steps", str(last + 5), *flags)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    steps = [row["step"] for row in read_metrics(str(run / "metrics.csv")) if row["kind"] == "train"]
    assert steps == list(range(1, last + 6))
    assert json.loads((run / "config.json").read_text())["config"]["train"]["seed"] != 7
    assert not (run / ".sparklm.lock").exists()


# -- disk full -------------------------------------------------------------------------------------


def test_disk_full_during_prepare_is_one_line_and_leaves_nothing(tiny_fs, tmp_path):
    (tmp_path / "big.txt").write_text(make_text(6000, seed=3))
    r = cli("prepare", str(tmp_path / "big.txt"), "-o", str(tiny_fs / "out"), "--seq-len", "32", "--vocab-size", "300",
            "--master", "local[2]", "--set", "spark.ui=false")
    assert "no space left on device" in one_error_line(r)
    assert list(tiny_fs.iterdir()) == []  # no partial dataset, no staging


@pytest.mark.parametrize("workers", [1, 2])
def test_disk_full_during_training_is_one_line(tiny_fs, dataset, workers):
    """With two ranks the other one first reports a peer that stopped answering: the run still stops at once with
    the cause (no restart: it cannot cure a full disk)."""
    r = cli("train", "--data", dataset, "-o", str(tiny_fs / "run"), "--max-steps", "2", "--workers", str(workers),
            *TINY_FLAGS)
    assert "no space left on device" in one_error_line(r) and "restarting" not in r.stderr
