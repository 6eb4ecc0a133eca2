"""`prepare --engine beam`: the same dataset as Spark's, from an Apache Beam pipeline (the DirectRunner, one process
per worker, as a user runs it here)."""

from __future__ import annotations

import csv
import gzip
import json
import os

import pyarrow.parquet as pq
import pytest

from conftest import MULTILINGUAL, labelled_records, make_text, run_sparklm, tiny_bert, toy_corpus
from sparklm.config import from_dict
from sparklm.infra import progress
from sparklm.infra.errors import SparklmError
from sparklm.launch.prepare import prepare

pytestmark = pytest.mark.xdist_group("beam")
# what may differ between two prepares of the same inputs: when and how they ran
RUN_FIELDS = {"created_unix", "timing", "config", "engine"}
# the DirectRunner in this process (the pipeline's functions still go through Beam's pickling): the CLI tests below
# run it as users do, one worker process each
IN_PROCESS = {"options": {"direct_running_mode": "in_memory", "direct_num_workers": "1"}}


def mixed_corpus(root):
    """Text, JSONL, CSV and gzip'd text; a document repeated across files, an empty and a malformed record."""
    root.mkdir()
    (root / "book.txt").write_text(make_text(120, seed=1) + "\n\nThe same paragraph, twice.\n")
    with open(root / "posts.jsonl", "w") as f:
        for i, line in enumerate(make_text(80, seed=2).split("\n\n")):
            f.write(json.dumps({"text": line, "id": i}, ensure_ascii=False) + "\n")
        f.write('{"text": "The same paragraph, twice."}\n{"text": null}\n{"text": 7}\n')
    with open(root / "table.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["id", "text"])
        for i, text in enumerate(MULTILINGUAL * 4):
            w.writerow([i, f"{i} {text}"])
    with gzip.open(root / "more.txt.gz", "wt") as f:
        f.write(make_text(60, seed=3))
    return root


def splits(path) -> dict[str, list[tuple]]:
    """Each split's rows (every column), sorted: row order is the engines' own."""
    out = {}
    for split in ("train", "validation"):
        rows = [tuple(tuple(v) if isinstance(v, list) else v for v in r.values())
                for f in sorted((path / split).glob("*.parquet")) for r in pq.read_table(f).to_pylist()]
        out[split] = sorted(rows)
    return out


def same_dataset(a, b) -> None:
    ma, mb = (json.loads((p / "manifest.json").read_text()) for p in (a, b))
    assert {k: v for k, v in ma.items() if k not in RUN_FIELDS} == {k: v for k, v in mb.items() if k not in RUN_FIELDS}
    assert (a / "tokenizer.json").read_bytes() == (b / "tokenizer.json").read_bytes()
    ra, rb = splits(a), splits(b)
    assert ra == rb
    assert len(ra["train"]) > 20 and ra["validation"], "the comparison has rows in both splits"


def test_beam_writes_the_dataset_spark_writes(spark, tmp_path, capsys):
    corpus = mixed_corpus(tmp_path / "corpus")
    base = {"data": {"seq_len": 32, "val_fraction": 0.2, "read_tasks": 3}, "tokenizer": {"vocab_size": 300}}
    on_spark = prepare([str(corpus)], output=str(tmp_path / "spark"), config=from_dict(base), spark=spark)
    beam = from_dict({**base, "data": {**base["data"], "engine": "beam"}, "beam": IN_PROCESS})
    on_beam = prepare([str(corpus)], output=str(tmp_path / "beam"), config=beam)
    same_dataset(tmp_path / "spark", tmp_path / "beam")
    m = on_beam.manifest
    assert m["engine"] == {"name": "beam", "runner": "DirectRunner", "read_tasks": 3}
    assert on_spark.manifest["engine"]["name"] == "spark"
    dropped = m["input"]["dropped"]
    assert m["input"]["files"] == 4 and dropped["duplicate"] >= 1 and dropped["empty"] == dropped["malformed"] == 1
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir()), "no staging directory left behind"
    assert "_beam" not in json.dumps(m["contents"])
    capsys.readouterr()
    progress.info("still here")  # the console follows sys.stderr again once the pipelines are done
    assert "still here" in capsys.readouterr().err


def test_beam_cli_without_dedup_and_with_a_validation_file(spark, tmp_path):
    """The one-pass path (no dedup: the tokenizer's sample read from units chosen by hash), an explicit validation
    file, one padded document per sequence with a stride; the Beam run from the command line, with its flags."""
    corpus = mixed_corpus(tmp_path / "corpus")
    held = tmp_path / "held.txt"
    held.write_text(make_text(30, seed=9))
    data = {"seq_len": 24, "stride": 16, "concat": False, "dedup": False, "read_tasks": 4}
    prepare([str(corpus)], output=str(tmp_path / "spark"), validation_inputs=[str(held)], spark=spark,
            config=from_dict({"data": data, "tokenizer": {"vocab_size": 280, "sample_mb": 1}}))
    r = run_sparklm("prepare", str(corpus), "--validation-input", str(held), "-o", str(tmp_path / "beam"),
                    "--engine", "beam", "--runner", "DirectRunner", "--pipeline-option", "direct_num_workers=2",
                    "--seq-len", "24", "--stride", "16", "--no-concat", "--no-dedup", "--vocab-size", "280",
                    "--set", "tokenizer.sample_mb=1", "--set", "data.read_tasks=4")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "Spark" not in r.stderr, "the Beam engine starts no Spark"
    same_dataset(tmp_path / "spark", tmp_path / "beam")


def test_encoder_datasets_on_beam_are_spark_s_too(spark, tmp_path):
    """Labelled records (JSONL and CSV, a duplicate, records without label or text): the stratified split, the
    classes' counts and the encoder rows are the same on both engines; and masked-LM windows of a mixed corpus."""
    bert = tiny_bert(tmp_path / "bert", corpus=toy_corpus())
    records = labelled_records(160, seed=5, classes=("neg", "pos", "mid"))
    (tmp_path / "in").mkdir()
    with open(tmp_path / "in" / "a.jsonl", "w") as f:
        for r in records[:100] + [records[3], {"text": "no label"}, {"label": "pos"}]:
            f.write(json.dumps(r) + "\n")
    with open(tmp_path / "in" / "b.csv", "w", newline="") as f:
        w = csv.DictWriter(f, ["text", "label"])
        w.writeheader()
        w.writerows(records[100:])
    base = {"data": {"task": "classify", "seq_len": 32, "val_fraction": 0.2, "read_tasks": 2},
            "tokenizer": {"path": bert}}
    prepare([str(tmp_path / "in")], output=str(tmp_path / "spark"), config=from_dict(base), spark=spark)
    beam = from_dict({**base, "data": {**base["data"], "engine": "beam"}, "beam": IN_PROCESS})
    m = prepare([str(tmp_path / "in")], output=str(tmp_path / "beam"), config=beam).manifest
    same_dataset(tmp_path / "spark", tmp_path / "beam")
    assert m["labels"]["names"] == ["mid", "neg", "pos"] and all(m["labels"]["documents"]["validation"].values())
    assert m["input"]["dropped"] == {"duplicate": 1, "empty": 1, "no_label": 1}
    # a regression dataset (float targets, hash-split): the same rows and figures on both engines
    with open(tmp_path / "in" / "c.jsonl", "w") as f:
        for i, r in enumerate(records):
            f.write(json.dumps({"text": r["text"], "y": (i % 7) * 0.5 - 1 if i % 11 else "n/a"}) + "\n")
    reg = {"data": {"task": "regress", "label_field": "y", "seq_len": 32, "val_fraction": 0.2, "read_tasks": 2},
           "tokenizer": {"path": bert}}
    prepare([str(tmp_path / "in" / "c.jsonl")], output=str(tmp_path / "reg-spark"), config=from_dict(reg), spark=spark)
    r = prepare([str(tmp_path / "in" / "c.jsonl")], output=str(tmp_path / "reg-beam"),
                config=from_dict({**reg, "data": {**reg["data"], "engine": "beam"}, "beam": IN_PROCESS})).manifest
    same_dataset(tmp_path / "reg-spark", tmp_path / "reg-beam")
    assert r["labels"]["values"]["train"]["rows"] > 100 and r["input"]["dropped"]["no_label"] == 15
    # masked-LM documents, windowed by the encoder's tokenizer
    corpus = mixed_corpus(tmp_path / "corpus")
    mlm = {"data": {"task": "mlm", "seq_len": 24, "stride": 16, "val_fraction": 0.2, "read_tasks": 2},
           "tokenizer": {"path": bert}}
    prepare([str(corpus)], output=str(tmp_path / "mlm-spark"), config=from_dict(mlm), spark=spark)
    prepare([str(corpus)], output=str(tmp_path / "mlm-beam"),
            config=from_dict({**mlm, "data": {**mlm["data"], "engine": "beam"}, "beam": IN_PROCESS}))
    same_dataset(tmp_path / "mlm-spark", tmp_path / "mlm-beam")


def test_a_bad_input_on_beam_is_one_line_and_nothing_is_written(tmp_path):
    """An error raised inside a Beam worker (a CSV without the text column) comes back as sparklm's one line."""
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.csv").write_text("id,body\n1,hello there\n2,general kenobi\n")
    out = tmp_path / "out"
    r = run_sparklm("prepare", str(tmp_path / "in"), "-o", str(out), "--engine", "beam", "--vocab-size", "300")
    assert r.returncode == 2, r.stderr[-2000:]
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "'text'" in errors[0] and "a.csv" in errors[0], r.stderr[-2000:]
    assert "Traceback" not in r.stderr
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_beam_refuses_what_it_cannot_do(spark, tmp_path):
    cfg = from_dict({"data": {"engine": "beam"}})
    df = spark.createDataFrame([("some text here",)], "text string")
    with pytest.raises(SparklmError, match="not a Spark DataFrame"):
        prepare(df, output=str(tmp_path / "o"), config=cfg)
    (tmp_path / "a.txt").write_text("hello\n")
    with pytest.raises(SparklmError, match="direct_num_workers"):
        prepare([str(tmp_path / "a.txt")], output=str(tmp_path / "o"),
                config=from_dict({"data": {"engine": "beam"}, "beam": {"options": {"direct_num_workers": "two"}}}))
    with pytest.raises(SparklmError, match="DataflowRunner is missing pipeline options: .*project"):
        prepare([str(tmp_path / "a.txt")], output=str(tmp_path / "o"),
                config=from_dict({"data": {"engine": "beam"}, "beam": {"runner": "DataflowRunner"}}))
    assert not (tmp_path / "o").exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_without_apache_beam_the_engine_says_what_to_install(tmp_path):
    """A Python where apache_beam cannot be imported (a module of that name that fails as a missing one does)."""
    fake = tmp_path / "site"
    fake.mkdir()
    (fake / "apache_beam.py").write_text("raise ModuleNotFoundError(\"No module named 'apache_beam'\")\n")
    (tmp_path / "a.txt").write_text("hello world\n")
    env = {"PYTHONPATH": os.pathsep.join([str(fake), *filter(None, [os.environ.get("PYTHONPATH")])])}
    r = run_sparklm("prepare", str(tmp_path / "a.txt"), "-o", str(tmp_path / "o"), "--engine", "beam", env=env)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "sparklm[beam]" in r.stderr and not (tmp_path / "o").exists()
