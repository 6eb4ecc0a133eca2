"""Plumbing written once: atomic files and directories (fs), per-process caches, the rank → driver channel."""

from __future__ import annotations

import dataclasses
import threading
from pathlib import Path

import pytest

from sparklm.infra.cache import process_local
from sparklm.infra.fs import exists, list_names, read_text, staged_dir, write_text
from sparklm.metrics import rows
from sparklm.metrics.sinks import (
    TRAIN_COLUMNS,
    Channel,
    ChannelSink,
    ConsoleSink,
    CsvSink,
    Sinks,
    metric_columns,
    rank_mb,
    read_metrics,
    round_line,
    train_line,
)
from sparklm.model.figures import LM_FIGURES


def test_write_text_replaces_whole_and_leaves_no_temporary(tmp_path):
    f = tmp_path / "sub" / "a.json"
    write_text(str(f), "one")
    write_text(str(f), "two")
    assert read_text(str(f)) == "two" and list_names(str(f.parent)) == ["a.json"]


def test_staged_dir_appears_whole_or_not_at_all(tmp_path):
    target = tmp_path / "model"
    with staged_dir(str(target)) as d:
        (d / "config.json").write_text("{}")
        assert not target.exists()  # invisible until complete
    assert (target / "config.json").read_text() == "{}"
    with pytest.raises(RuntimeError):
        with staged_dir(str(target)) as d:
            (d / "other").write_text("x")
            raise RuntimeError("killed midway")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]  # the old one intact, no staging left
    assert list_names(str(target)) == ["config.json"]
    with staged_dir(str(target)) as d:
        (d / "new").write_text("x")
    assert list_names(str(target)) == ["new"]


def test_process_local_builds_once_per_key_and_keeps_the_latest():
    built = []

    def make(tag):
        built.append(tag)
        return object()

    a = process_local(("t", 1), lambda: make(1))
    assert process_local(("t", 1), lambda: make(1)) is a
    process_local(("t", 2), lambda: make(2))
    process_local(("t", 1), lambda: make(1))
    assert built == [1, 2, 1]


def test_rows_travel_from_a_rank_to_the_driver_sinks(tmp_path, capsys):
    csv_path = tmp_path / "metrics.csv"
    sinks = Sinks([CsvSink(str(csv_path), metric_columns(LM_FIGURES), {"train", "eval"}), ConsoleSink(LM_FIGURES)])
    channel = Channel(sinks)
    # a stranger without the token is ignored
    stranger = ChannelSink(*channel.address, "not-the-token")
    stranger.write(_train(99))
    stranger.close()

    def rank():
        sink = ChannelSink(*channel.address, channel.token)
        sink.write(rows.Info(strategy="ddp", workers=1, total_steps=4))
        for step in (1, 2):
            sink.write(_train(step, loss=3.0 / step, elapsed=step))
        sink.write(rows.Eval(step=2, tokens=64, figures={"val_loss": 2.0, "val_ppl": 7.4, "val_bpb": 1.5,
                                                         "val_acc": 0.25}))
        sink.close()

    t = threading.Thread(target=rank)
    t.start()
    t.join()
    channel.close()
    sinks.close()
    got = read_metrics(str(csv_path))
    assert [(r["kind"], r["step"]) for r in got] == [("train", 1), ("train", 2), ("eval", 2)]
    assert got[-1]["val_bpb"] == 1.5
    err = capsys.readouterr().err
    assert "step 1/4" in err and "eval step 2: loss 2.0000 | perplexity 7.400 | bits/byte 1.5000" in err
    assert "step 99" not in err


def test_the_driver_asks_rank_0_to_leave_without_disturbing_its_flushes(tmp_path):
    """Graceful decommission: the driver's unasked LEAVE reaches rank 0, which never waits to look for it, and a
    flush answer behind it is still read as the answer."""
    import time

    channel = Channel(CsvSink(str(tmp_path / "metrics.csv"), metric_columns(LM_FIGURES), {"train", "eval"}))
    sink = ChannelSink(*channel.address, channel.token)
    sink.write(_train(1))
    sink.flush()  # the driver knows this rank now
    t0 = time.monotonic()
    assert not sink.leaving() and time.monotonic() - t0 < 0.5  # nothing sent: no wait
    channel.ask_to_leave()
    sink.write(_train(2))
    sink.flush()  # LEAVE arrives first, then the answer
    assert sink.asked_to_leave and sink.leaving()
    sink.close()
    channel.close()
    assert [r["step"] for r in read_metrics(str(tmp_path / "metrics.csv"))] == [1, 2]


def test_rank_0_tells_the_driver_the_ranks_left_as_asked(tmp_path):
    """Spark may report the decommissioned executor's loss before the ranks' own stop: rank 0's word that they
    checkpointed and left is what the driver goes by; it waits for that word only once it has asked."""
    import time

    channel = Channel(CsvSink(str(tmp_path / "metrics.csv"), metric_columns(LM_FIGURES), {"train", "eval"}))
    sink = ChannelSink(*channel.address, channel.token)
    sink.write(_train(1))
    sink.flush()
    t0 = time.monotonic()
    assert channel.left(wait=5.0) is None and time.monotonic() - t0 < 0.5  # never asked: no wait
    channel.ask_to_leave()
    sink.left(7)
    assert channel.left(wait=5.0) == 7
    channel.attempt()  # the ranks start again: nothing asked, nobody left
    assert channel.left(wait=5.0) is None
    sink.close()
    channel.close()


def test_rewind_keeps_the_rows_up_to_the_checkpoint_and_its_evaluation_only_if_the_checkpoint_holds_it(tmp_path):
    """DDP evaluates before it checkpoints; rounds evaluate a step's weights in the next round, after the checkpoint:
    a run resumed there evaluates them again, so the eval row of the checkpoint's own step goes with the later ones
    (found by benchmarks/kill_campaign.py: the DiLoCo driver killed between the two lost the eval row)."""
    csv_path = tmp_path / "metrics.csv"
    sink = CsvSink(str(csv_path), metric_columns(LM_FIGURES), {"train", "eval"})
    for step in (1, 2, 3):
        sink.write(_train(step))
        sink.write(rows.Eval(step=step, tokens=32 * step, figures={"val_loss": 2.0}))
    sink.rewind(3)
    assert [(r["kind"], r["step"]) for r in read_metrics(str(csv_path))][-2:] == [("train", 3), ("eval", 3)]
    sink.rewind(2, evaluated=False)
    sink.write(rows.Eval(step=2, tokens=64, figures={"val_loss": 1.5}))
    sink.close()
    assert [(r["kind"], r["step"], r["val_loss"]) for r in read_metrics(str(csv_path))] == [
        ("train", 1, None), ("eval", 1, 2), ("train", 2, None), ("eval", 2, 1.5)]


class _Uploads:
    """A sink that counts flushes and can fail one (a full disk on the driver)."""

    def __init__(self, fail: bool = False):
        self.rows, self.flushed, self.fail = [], [], fail

    def write(self, row):
        self.rows.append(row)

    def rewind(self, step, evaluated=True):
        pass

    def flush(self):
        if self.fail:
            raise OSError(28, "No space left on device")
        self.flushed.append(len(self.rows))

    def close(self):
        pass


def test_a_rank_checkpoints_only_after_the_driver_made_its_rows_durable():
    """Before each checkpoint a rank asks the driver to flush its sinks and waits for the answer; a driver that
    cannot write makes the rank stop there (found by benchmarks/kill_campaign.py: see the next test)."""
    from sparklm.infra.errors import SparklmError

    sink = _Uploads()
    channel = Channel(sink)
    rank = ChannelSink(*channel.address, channel.token)
    for step in (1, 2, 3):
        rank.write(_train(step))
    rank.flush()  # returns once the driver's sinks were flushed after the three rows
    assert sink.flushed == [3] and [r.step for r in sink.rows] == [1, 2, 3]
    rank.close()
    channel.close()
    failing = _Uploads(fail=True)
    broken = Channel(failing)
    other = ChannelSink(*broken.address, broken.token)
    other.write(_train(1))
    with pytest.raises(SparklmError, match="could not write its files"):
        other.flush()
    other.close()
    broken.close()
    assert isinstance(broken.error, OSError)  # the launcher raises the driver's own cause


def test_a_rank_whose_driver_died_does_not_checkpoint():
    """A rank on a cluster runs on after its driver died, until its executor is stopped: it must not checkpoint steps
    whose rows were lost with the driver, since a run resumed from that checkpoint would lack them."""
    import socket

    from sparklm.infra.errors import SparklmError

    driver = socket.create_server(("127.0.0.1", 0))
    rank = ChannelSink(*driver.getsockname(), "token")
    conn, _ = driver.accept()
    conn.close()  # the driver process is gone: the kernel closes its sockets
    driver.close()
    with pytest.raises(SparklmError, match="stopped answering"):  # at the write, or at the latest at the flush
        rank.write(_train(1))
        rank.flush()
    rank.close()


def test_peak_memory_per_rank_in_a_csv_cell_and_the_progress_lines(tmp_path):
    assert rank_mb([812.4, 790.6]) == "812/791" and rank_mb([812.0, None]) == "812/-"
    csv_path = tmp_path / "metrics.csv"
    sink = CsvSink(str(csv_path), TRAIN_COLUMNS, {"train"})
    sink.write(_train(1, peak_rss_mb=812.4, rank_peak_rss_mb=rank_mb([812.4, 790.6])))
    sink.close()
    assert read_metrics(str(csv_path))[0]["rank_peak_rss_mb"] == "812/791"
    row = _train(3, loss=2.0, elapsed=1.0, peak_rss_mb=1260.0)
    assert "| 1.23 GB peak |" in train_line(row, 4)
    assert "GB peak" not in train_line(dataclasses.replace(row, peak_rss_mb=0.0), 4)  # none measured: no figure
    a_round = rows.Round(round=1, step=3, workers=2, workers_done=2, tokens=64, loss=2.0, inner_losses="", attempts="",
                         cold="", broadcast_bytes=0, returned_bytes=0, broadcast_s=0.0, fetch_s=0.0, compute_s=0.0,
                         aggregate_s=0.0, round_s=1.0, outer_update_norm=0.1, delta_norm=0.1, elapsed=1.0,
                         tokens_per_s=100.0, sent_mb=1.0, eta_s=3.0, peak_rss_mb=1260.0)
    assert "| 1.23 GB peak |" in round_line(a_round)


def _train(step: int, **fields) -> rows.Train:
    row = dict(epoch=0.1, tokens=64 * step, loss=3.0, lr=1e-3, grad_norm=0.5, tokens_per_s=100.0, ms_per_step=10.0,
               mfu=0.5, rss_mb=100.0, peak_rss_mb=120.0, rank_peak_rss_mb="120", elapsed=1.0)
    return rows.Train(step=step, **{**row, **fields})


def test_secret_values_are_masked_in_files_and_lines():
    from sparklm.infra import redact

    saved = redact.mapping({"spark": {"conf": {"spark.hadoop.fs.s3a.secret.key": "s3cr3t-value",
                                               "spark.hadoop.fs.s3a.access.key": "AKIAEXAMPLE", "spark.x": "1"}},
                            "train": {"max_tokens": 5, "sample_tokens": 80}, "auth_token": "tok-123456"})
    assert saved == {"spark": {"conf": {"spark.hadoop.fs.s3a.secret.key": "***", "spark.hadoop.fs.s3a.access.key": "***",
                                        "spark.x": "1"}},
                     "train": {"max_tokens": 5, "sample_tokens": 80}, "auth_token": "***"}
    # remembered values and key=value pairs never reach a printed line
    assert redact.text("could not connect with s3cr3t-value") == "could not connect with ***"
    assert redact.text("--conf spark.my.password=hunter22") == "--conf spark.my.password=***"


def test_hidden_directories_are_skipped_and_a_delta_table_is_refused(tmp_path):
    from sparklm.infra.errors import SparklmError
    from sparklm.infra.fs import expand

    data = tmp_path / "data"
    for rel in ("a.txt", "sub/b.txt", "_temporary/0/part-0.txt", ".cache/c.txt", "sub/_SUCCESS", "sub/.d.txt"):
        (data / rel).parent.mkdir(parents=True, exist_ok=True)
        (data / rel).write_text("x")
    assert [i.path.rsplit("data/", 1)[1] for i in expand(str(data))] == ["a.txt", "sub/b.txt"]
    assert [i.path.rsplit("data/", 1)[1] for i in expand(str(data / "*" / "*.txt"))] == ["sub/b.txt"]
    table = tmp_path / "table"
    (table / "_delta_log").mkdir(parents=True)
    (table / "_delta_log" / "00000000000000000000.json").write_text("{}")
    (table / "part-0.parquet").write_text("x")
    with pytest.raises(SparklmError, match="holds a Delta table"):  # as plain files: data/ prepare reads its version
        expand(str(table))


def test_globs_match_as_the_shell_python_and_spark_match_them(tmp_path):
    """Tried as a new user would: `prepare 'data/*.txt'` also read data/old/x.txt and data/a/b/y.txt (fnmatch's
    `*` crosses '/'); `{a,b}` (Hadoop's and Spark's alternatives) matched nothing."""
    from sparklm.infra.fs import expand

    data = tmp_path / "data"
    for rel in ("a.txt", "b.md", "old/x.txt", "2024/c.txt", "2025/d.txt", "2026/e.txt", "deep/er/y.txt",
                "odd[1].txt"):
        (data / rel).parent.mkdir(parents=True, exist_ok=True)
        (data / rel).write_text("x")

    def names(pattern):
        return [i.path.rsplit("data/", 1)[1] for i in expand(str(data / pattern))]

    assert names("*.txt") == ["a.txt", "odd[1].txt"]
    assert names("*/*.txt") == ["2024/c.txt", "2025/d.txt", "2026/e.txt", "old/x.txt"]
    assert names("**/*.txt") == ["2024/c.txt", "2025/d.txt", "2026/e.txt", "a.txt", "deep/er/y.txt", "odd[1].txt",
                                 "old/x.txt"]  # ** is zero or more directories, as Python's glob(recursive=True)
    assert names("deep/**") == ["deep/er/y.txt"]
    assert names("{2024,2026}/*.txt") == ["2024/c.txt", "2026/e.txt"]
    assert names("202[!5]/?.txt") == ["2024/c.txt", "2026/e.txt"] == names("202[^5]/?.txt")
    assert names("*.{txt,md}") == ["a.txt", "b.md", "odd[1].txt"]
    assert names("odd[1].txt") == ["odd[1].txt"]  # a file that exists is itself, whatever its name holds


def test_a_directory_read_through_links_lists_each_file_once(tmp_path):
    """Found in the sweep: a link back up the tree (sub/up -> ..) made the listing go round it ~40 times, each file
    read again each time (40 copies of every document with --no-dedup); a second link to a directory read its files
    twice. Links are followed, once per real directory and file."""
    import os

    from sparklm.infra.fs import expand

    data = tmp_path / "data"
    (data / "sub").mkdir(parents=True)
    (data / "2024").mkdir()
    (data / "a.txt").write_text("x")
    (data / "2024" / "b.txt").write_text("y")
    os.symlink("..", data / "sub" / "up")
    os.symlink("2024", data / "latest")
    os.symlink(tmp_path / "nowhere.txt", data / "dangling.txt")
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "c.txt").write_text("z")
    os.symlink(outside, data / "linked")  # a link to a directory outside is followed, as before
    assert [i.path.rsplit("data/", 1)[1] for i in expand(str(data))] == ["2024/b.txt", "a.txt", "linked/c.txt"]
    assert [i.path.rsplit("data/", 1)[1] for i in expand(str(data / "**" / "*.txt"))] == [
        "2024/b.txt", "a.txt", "linked/c.txt"]


def test_spark_defaults_file_is_read_as_spark_reads_it(tmp_path):
    from sparklm.spark.session import read_defaults

    f = tmp_path / "spark-defaults.conf"
    f.write_text("# comment\n! also a comment\nspark.master   yarn\nspark.app.name=mine\n"
                 "spark.driver.memory: 6g\n  spark.executor.extraJavaOptions  -Da=1 -Db=2  \n\nbare.key\n")
    assert read_defaults(str(f)) == {"spark.master": "yarn", "spark.app.name": "mine", "spark.driver.memory": "6g",
                                     "spark.executor.extraJavaOptions": "-Da=1 -Db=2", "bare.key": ""}
    assert read_defaults(str(tmp_path / "missing.conf")) == {}


def test_settings_made_before_sparklm_win_over_its_defaults():
    from sparklm.spark.session import session_conf

    defaults = {"spark.app.name": "sparklm", "spark.driver.memory": "4g", "spark.barrier.sync.timeout": "600s",
                "spark.driver.extraJavaOptions": "-Dlog4j2.configurationFile=x"}
    preset = {"spark.driver.memory": "1g", "spark.app.name": "submitted", "spark.master": "yarn"}
    user = {"spark.sql.shuffle.partitions": "7", "spark.driver.extraJavaOptions": "-Dmine=1"}
    got = session_conf(defaults, preset, user)
    # spark-submit's values are already in the JVM's conf: sparklm neither repeats nor overrides them
    assert "spark.driver.memory" not in got and "spark.app.name" not in got and "spark.master" not in got
    assert got["spark.barrier.sync.timeout"] == "600s" and got["spark.sql.shuffle.partitions"] == "7"
    assert got["spark.driver.extraJavaOptions"] == "-Dlog4j2.configurationFile=x -Dmine=1"
    # what the user gave sparklm itself (--conf, app name) counts as set
    assert session_conf(defaults, preset, {"spark.app.name": "flag"})["spark.app.name"] == "flag"
    assert session_conf(defaults, {}, {})["spark.driver.memory"] == "4g"


def test_fsspec_filesystems_are_reached_through_pyarrow():
    from sparklm.infra.fs import read_bytes, resolve

    fs, path = resolve("memory://bucket/dir/a.txt")
    write_text("memory://bucket/dir/a.txt", "through fsspec")
    assert read_bytes("memory://bucket/dir/a.txt") == b"through fsspec"
    assert exists("memory://bucket/dir/a.txt") and list_names("memory://bucket/dir") == ["a.txt"]
    assert fs.type_name.startswith("py::fsspec") and path.endswith("bucket/dir/a.txt")


def test_the_bundled_corpus_is_the_books_its_provenance_names():
    """Four public-domain novels, each byte for byte the file whose SHA-256 SOURCE.md records."""
    import hashlib
    import re

    from sparklm.cli import default_corpus

    books = default_corpus()
    assert [Path(b).name for b in books] == ["emma.txt", "persuasion.txt", "pride_and_prejudice.txt",
                                             "sense_and_sensibility.txt"]
    source = (Path(books[0]).parent / "SOURCE.md").read_text()
    recorded = set(re.findall(r"`([0-9a-f]{64})`", source))
    for book in books:
        assert hashlib.sha256(Path(book).read_bytes()).hexdigest() in recorded, book


def _zip_with_version(path: Path, version: str) -> str:
    import zipfile

    with zipfile.ZipFile(path, "w") as z:
        z.writestr("pyspark/__init__.py", "")
        z.writestr("pyspark/version.py", f'__version__: str = "{version}"\n')
    return str(path)


def test_the_daemon_path_puts_the_installed_pyspark_first_only_at_the_zips_version(tmp_path):
    import pyspark

    from sparklm.spark.daemon import installed_first

    site = str(Path(pyspark.__file__).parents[1])
    same = _zip_with_version(tmp_path / "pyspark.zip", pyspark.__version__)
    py4j = _zip_with_version(tmp_path / "py4j-0.10.9.9-src.zip", "0")
    path = ["/cwd", same, py4j, site]
    assert installed_first(path) == ["/cwd", site, same, py4j]
    (tmp_path / "other").mkdir()
    other = _zip_with_version(tmp_path / "other" / "pyspark.zip", "0.0.1")
    assert installed_first(["/cwd", other, py4j, site]) == ["/cwd", other, py4j, site]  # another Spark's zip
    assert installed_first(["/cwd", same, py4j, str(tmp_path)]) == ["/cwd", same, py4j, str(tmp_path)]  # none
    assert installed_first(["/cwd", site]) == ["/cwd", site]  # no zip: nothing to move


LAST_WORDS = """
import os, threading, time
from sparklm.infra import progress

def spam():
    i = 0
    while True:
        progress.info(f"step {i}")
        i += 1

for _ in range(3):
    threading.Thread(target=spam, daemon=True).start()
time.sleep(0.2)
progress.last_words("interrupted")
time.sleep(0.3)  # the other threads keep trying to print
os._exit(130)
"""


def test_last_words_are_the_last_line_while_other_threads_print():
    """Ctrl-C's one line stays last although the sink's thread prints ranks' progress at the same moment."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", LAST_WORDS], capture_output=True, text=True, timeout=60)
    lines = r.stderr.splitlines()
    assert r.returncode == 130 and lines[-1] == "interrupted", lines[-5:]
    assert len(lines) > 2 and lines[0] == "step 0"


def test_model_card_front_matter_and_the_base_models_licence(tmp_path):
    from sparklm.model.card import base_license, model_card

    base = tmp_path / "base"
    base.mkdir()
    assert base_license(str(base)) is None  # no card: no licence guessed
    (base / "README.md").write_text("---\nlanguage: en\nlicense: apache-2.0\n---\n# Base\nlicense: not-this-one\n")
    assert base_license(str(base)) == "apache-2.0"
    summary = {"steps": 12, "tokens": 3072, "epochs": 0.5, "params": 1000, "trainable_params": 40,
               "strategy": "ddp", "workers": 2, "best": {"val_bpb": 1.25, "val_loss": 2.0, "val_ppl": None}}
    card = model_card(name="runs/x/model", summary=summary, data="s3://b/data", base=str(base), license="apache-2.0",
                      adapter=True)
    front = card.split("---\n")[1]
    assert front.splitlines() == ["library_name: peft", "pipeline_tag: text-generation", "tags:", "- sparklm",
                                  "- apache-spark", f"base_model: {base}", "license: apache-2.0"]
    assert "| validation bits per byte | 1.2500 |" in card and "perplexity" not in card  # None figures left out
    assert "AutoPeftModelForCausalLM.from_pretrained(\"runs/x/model\")" in card and "| steps | 12 |" in card
    scratch = model_card(name="m", summary=summary, data="d")
    assert "library_name: transformers" in scratch and "base_model" not in scratch and "license" not in scratch


def test_tensorboard_sink_keeps_one_history_across_a_rewind(tmp_path):
    """A DDP restart rewinds the run to a checkpoint: tensorboard's reader shows each step once, with the values
    written after the restart, as metrics.csv does."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from sparklm.metrics import rows
    from sparklm.metrics.trackers.tensorboard_tracker import TensorBoardSink

    def train_row(step: int, loss: float) -> rows.Train:
        return rows.Train(step=step, epoch=step / 10, tokens=step * 64, loss=loss, lr=1e-3, grad_norm=1.0,
                          tokens_per_s=100.0, ms_per_step=10.0, mfu=0.1, rss_mb=1.0, peak_rss_mb=1.0,
                          rank_peak_rss_mb="1/1", elapsed=float(step))

    sink = TensorBoardSink(str(tmp_path / "tb"))
    for step in range(1, 6):
        sink.write(train_row(step, 10.0 + step))
    sink.write(rows.Eval(step=3, tokens=192, figures={"val_loss": 9.0, "val_bpb": 2.5}))
    sink.rewind(3)  # the ranks restart from the checkpoint of step 3
    for step in range(4, 7):
        sink.write(train_row(step, 20.0 + step))
    sink.write(rows.Info(**{f.name: None for f in __import__("dataclasses").fields(rows.Info)}))  # not a scalar row
    sink.close()
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    loss = [(e.step, e.value) for e in events.Scalars("train/loss")]
    assert loss == [(1, 11.0), (2, 12.0), (3, 13.0), (4, 24.0), (5, 25.0), (6, 26.0)]
    assert [(e.step, e.value) for e in events.Scalars("eval/val_bpb")] == [(3, 2.5)]
    assert "train/rank_peak_rss_mb" not in events.Tags()["scalars"]  # text, not a figure


def test_an_error_reads_as_its_one_line_and_crosses_a_worker():
    """Outside a Spark task a SparklmError's text is its message and hint (what a notebook shows); the driver finds
    it again in a worker's failure: marked (a Spark task), among the causes (an in-process runner), or as the
    traceback's last line (another worker process)."""
    from sparklm.infra.errors import SparklmError, from_spark

    e = SparklmError("no such run: x", hint="check the path")
    assert str(e) == "no such run: x (hint: check the path)" and str(SparklmError("plain")) == "plain"
    marked = RuntimeError("Traceback ... SPARKLM-ERROR<<bad input|fix it>> at ...")
    assert (from_spark(marked).message, from_spark(marked).hint) == ("bad input", "fix it")
    try:
        try:
            raise e
        except SparklmError as inner:
            raise RuntimeError("a runner failed") from inner
    except RuntimeError as outer:
        assert from_spark(outer).message == "no such run: x"
    text = RuntimeError("Traceback (most recent call last):\n  File ...\nsparklm.infra.errors.SparklmError: "
                        "a bad record in f.jsonl (hint: fix line 3)\n")
    got = from_spark(text)
    assert (got.message, got.hint) == ("a bad record in f.jsonl", "fix line 3")
    assert from_spark(RuntimeError("something else")) is None


@pytest.mark.parametrize("text, what", [
    ("When getting information for key 'a.txt' in bucket 'b': AWS Error NETWORK_CONNECTION during HeadObject "
     "operation: curlCode: 7, Could not connect to server", "cannot reach the object store"),
    ("When listing objects under key 'x' in bucket 'b': AWS Error ACCESS_DENIED during ListObjectsV2 operation: "
     "Access Denied", "the object store refused access"),
    ("When reading information for key 'a' in bucket 'b': AWS Error UNKNOWN (HTTP status 403) during HeadObject "
     "operation: No response body.", "the object store refused access"),
    ("AWS Error INVALID_ACCESS_KEY_ID during ListObjectsV2 operation: The AWS Access Key Id you provided does not "
     "exist in our records.", "the object store refused access"),
])
def test_object_store_failures_are_named_with_what_to_check(text, what):
    from sparklm.infra.errors import known_cause

    cause = known_cause(text)
    assert cause is not None and cause[0] == what
    assert "AWS_ENDPOINT_URL" in cause[1] or "credentials" in cause[1]


def test_a_binary_file_is_not_read_as_prompts(tmp_path):
    from sparklm.infer.batch import read_prompts
    from sparklm.infra.errors import SparklmError

    blob = tmp_path / "weights.txt"
    blob.write_bytes(b"GGUF\x03\x00\x00\x00" + bytes(range(256)) * 4)
    for name in ("weights.txt", "weights.jsonl"):
        (tmp_path / name).write_bytes(blob.read_bytes())
        with pytest.raises(SparklmError, match=f"{name} looks binary, not text"):
            read_prompts(str(tmp_path / name))
    (tmp_path / "ok.txt").write_text("caf\u00e9 au lait\n\nOnce upon\n", encoding="utf-8")
    assert read_prompts(str(tmp_path / "ok.txt")) == [(0, "caf\u00e9 au lait"), (1, "Once upon")]


def test_prompts_are_read_from_json_arrays_and_csv_as_records(tmp_path):
    """Tried as a new user would: a prompts.json holding an array was read as lines of text, so "[", "  {" and
    '"prompt": "Once upon a time"' were each a prompt; a prompts.csv gave its header row as the first prompt."""
    import json

    from sparklm.infer.batch import read_prompts
    from sparklm.infra.errors import SparklmError

    (tmp_path / "p.json").write_text(json.dumps([{"id": 5, "prompt": "Once upon"}, {"prompt": "Twice"}], indent=2))
    assert read_prompts(str(tmp_path / "p.json")) == [(5, "Once upon"), (1, "Twice")]
    (tmp_path / "lines.json").write_text('{"text": "a"}\n{"text": "b"}\n')  # JSON Lines named .json
    assert read_prompts(str(tmp_path / "lines.json")) == [(0, "a"), (1, "b")]
    (tmp_path / "p.csv").write_text('id,prompt\n3,"Hello, world"\n4,"two\nlines"\n')
    assert read_prompts(str(tmp_path / "p.csv")) == [(3, "Hello, world"), (4, "two\nlines")]
    (tmp_path / "t.tsv").write_text("text\nfirst\n")
    assert read_prompts(str(tmp_path / "t.tsv")) == [(0, "first")]
    (tmp_path / "bad.csv").write_text("body\nx\n")
    with pytest.raises(SparklmError, match=r"bad\.csv has no 'prompt' or 'text' column \(columns: body\)"):
        read_prompts(str(tmp_path / "bad.csv"))
    (tmp_path / "bad.json").write_text('[{"prompt": "a"}, 3]')
    with pytest.raises(SparklmError, match=r"bad\.json record 2: not a JSON object with a 'prompt' \(or 'text'\)"):
        read_prompts(str(tmp_path / "bad.json"))
    (tmp_path / "null.jsonl").write_text('{"prompt": null}\n')  # was the prompt "None"
    with pytest.raises(SparklmError, match=r"null\.jsonl: prompt 0 is empty"):
        read_prompts(str(tmp_path / "null.jsonl"))
    (tmp_path / "cut.json").write_text('[{"prompt": "a"}, {"prompt"')
    with pytest.raises(SparklmError, match=r"cannot read .*cut\.json: the JSON array breaks at line 1"):
        read_prompts(str(tmp_path / "cut.json"))


def test_the_default_generation_length_fits_the_model():
    from sparklm.infer.sampling import Sampling

    assert Sampling().fitted(64).max_new_tokens == 32  # the default, half a small context
    assert Sampling().fitted(2048).max_new_tokens == 64
    assert Sampling(max_new_tokens=64).fitted(64).max_new_tokens == 64  # the user's choice: checked, not changed
    assert Sampling().fitted(None).max_new_tokens == 64
