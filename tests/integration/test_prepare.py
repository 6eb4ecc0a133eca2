"""`prepare` end to end on a real local Spark session."""

from __future__ import annotations

import bz2
import dataclasses
import gzip
import json
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import MULTILINGUAL, make_text
from sparklm.config import from_dict
from sparklm.data.clean import clean_text
from sparklm.data.manifest import load_prepared
from sparklm.infra.errors import SparklmError
from sparklm.launch.prepare import prepare


def rows(dataset, split):
    """All rows of a split, in file order."""
    return [r for f in dataset.files(split) for r in pq.read_table(f).to_pylist()]


def docs_from(dataset, split, tok):
    """Decode a split back into documents: the unmasked token stream cut at BOS ... EOS."""
    spec = dataset.manifest["tokenizer"]
    stream = [t for r in rows(dataset, split)
              for t, m in zip(r["input_ids"], r.get("attention_mask") or [1] * len(r["input_ids"])) if m]
    out, cur = [], None
    for t in stream:
        if t == spec["bos_id"]:
            cur = []
        elif t == spec["eos_id"]:
            out.append(tok.decode(cur))
            cur = None
        else:
            cur.append(t)
    return out


def test_decode_reproduces_the_cleaned_text(spark, tmp_path, config):
    from transformers import AutoTokenizer

    paragraphs = [f"{i}: {p}" for i, p in enumerate(MULTILINGUAL * 3)]
    raw = "\ufeff" + "\r\n\r\n".join(p.replace("\n", "\r\n") for p in paragraphs) + "\r\n"
    (tmp_path / "in.txt").write_bytes(raw.encode())
    cfg = dataclasses.replace(config, data=dataclasses.replace(config.data, val_fraction=0.0, last_block="pad"))
    ds = prepare([str(tmp_path / "in.txt")], output=str(tmp_path / "out"), config=cfg, spark=spark)
    tok = AutoTokenizer.from_pretrained(ds.uri)  # transformers loads the saved tokenizer
    assert tok.bos_token == "<|bos|>" and tok.pad_token == "<|pad|>"
    assert docs_from(ds, "train", tok) == [clean_text(p) for p in paragraphs]
    m = ds.manifest
    assert m["splits"]["train"]["documents"] == len(paragraphs)
    assert m["splits"]["train"]["text_bytes"] == sum(len(clean_text(p).encode()) for p in paragraphs)
    assert m["splits"]["validation"]["documents"] == 0
    stream_tokens = m["splits"]["train"]["tokens"]
    assert m["splits"]["train"]["sequences"] * 32 - m["splits"]["train"]["pad_tokens"] == stream_tokens


def test_formats_dedup_binary_and_invalid_utf8(spark, tmp_path, config):
    d = tmp_path / "in"
    d.mkdir()
    (d / "a.txt").write_text("alpha one\n\nshared paragraph\n")
    (d / "b.txt.gz").write_bytes(gzip.compress(b"gamma two\n\nshared paragraph\n"))
    (d / "c.txt.bz2").write_bytes(bz2.compress(b"delta three \xff\xfe bad bytes\n"))
    (d / "d.jsonl").write_text('{"text": "epsilon four"}\n{broken\n{"text": ""}\n')
    (d / "e.csv").write_text('text,id\n"zeta, five\nwith newline",1\n')
    pq.write_table(pa.table({"text": ["eta six", "shared paragraph"]}), d / "f.parquet")
    (d / "g.bin").write_bytes(b"\x00\x01\x02" * 1000)
    (d / "_SUCCESS").write_text("")
    # each read task packs its own few tokens: a partial sequence is kept (padded), or no row would be written
    cfg = dataclasses.replace(config, data=dataclasses.replace(config.data, val_fraction=0.0, last_block="pad"))
    ds = prepare([str(d)], output=str(tmp_path / "out"), config=cfg, spark=spark)
    m = ds.manifest
    assert m["input"]["files"] == 7  # _SUCCESS is not data
    assert m["input"]["dropped"] == {"binary_file": 1, "duplicate": 2, "empty": 1, "malformed": 1}
    assert m["input"]["invalid_bytes_replaced"] == 2
    assert m["splits"]["train"]["documents"] == 7  # alpha, shared, gamma, delta, epsilon, zeta, eta


def test_with_and_without_dedup_agree_when_nothing_repeats(spark, tmp_path, config):
    (tmp_path / "a.txt").write_text(make_text(120, seed=8))
    (tmp_path / "b.jsonl").write_text('{"text": "x"}\n{"text": ""}\nbroken\n')
    a = prepare([str(tmp_path)], output=str(tmp_path / "a"), config=config, spark=spark).manifest
    cfg = dataclasses.replace(config, data=dataclasses.replace(config.data, dedup=False))
    b = prepare([str(tmp_path / "a.txt"), str(tmp_path / "b.jsonl")], output=str(tmp_path / "b"), config=cfg,
                spark=spark).manifest
    assert a["input"] == b["input"] and a["input"]["dropped"] == {"empty": 1, "malformed": 1}
    for split in ("train", "validation"):
        for key in ("documents", "text_bytes", "tokens", "sequences"):
            assert a["splits"][split][key] == b["splits"][split][key], (split, key)


def test_split_is_deterministic_and_independent_of_partitioning(spark, tmp_path, config):
    src = tmp_path / "big.txt"
    src.write_text(make_text(400, seed=1))

    def val_ids(out, **data):
        cfg = dataclasses.replace(config, data=dataclasses.replace(config.data, **data))
        ds = prepare([str(src)], output=str(tmp_path / out), config=cfg, spark=spark)
        return {r["doc_id"] for r in rows(ds, "validation")}, {r["doc_id"] for r in rows(ds, "train")}, ds

    v1, t1, ds1 = val_ids("o1")
    v2, t2, _ = val_ids("o2", split_mb=1, concat=False)  # other read units, one doc per sequence
    assert v1 and t1 and not (v1 & t1)
    v3, t3, ds3 = val_ids("o3", concat=False)
    assert v3 == v2 and t3 == t2  # same documents, whatever the read units
    assert v1 <= v3  # concat rows carry the first doc of each sequence: a subset of all doc ids


def test_chunked_reading_equals_whole_file(spark, tmp_path, config):
    from sparklm.data import sources

    src = tmp_path / "big.txt"
    src.write_text(make_text(22000, seed=2))
    assert src.stat().st_size > 2 * 1024 * 1024
    cfg = dataclasses.replace(config, data=dataclasses.replace(config.data, split_mb=1, concat=False))
    assert len(sources.plan_units([str(src)], group="auto", data=cfg.data, storage=cfg.storage)) >= 3
    a = prepare([str(src)], output=str(tmp_path / "a"), config=cfg, spark=spark).manifest
    b = prepare([str(src)], output=str(tmp_path / "b"), spark=spark,
                config=dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, split_mb=64))).manifest
    for split in ("train", "validation"):
        for key in ("documents", "text_bytes", "tokens", "sequences"):
            assert a["splits"][split][key] == b["splits"][split][key], (split, key)
    assert len(a["splits"]["train"]["files"]) >= 2  # byte ranges went to several write tasks


def test_the_tokenizer_read_ahead_while_spark_starts_is_the_spark_jobs(spark, tmp_path, config, monkeypatch):
    import subprocess
    import sys

    from sparklm.data import passes, sample_ahead, sources
    from sparklm.data.spark_engine import SparkSource

    inputs = tmp_path / "in"
    inputs.mkdir()
    for i in range(5):  # ~5 MB of 1 MB files, a 1 MB sample: some units read, a fraction of their documents
        (inputs / f"in{i}.txt").write_text(make_text(9000, seed=20 + i))
    cfg = dataclasses.replace(config, data=dataclasses.replace(config.data, dedup=False, split_mb=1),
                              tokenizer=dataclasses.replace(config.tokenizer, sample_mb=1))
    units = sources.plan_units([str(inputs)], group="auto", data=cfg.data, storage=cfg.storage)
    chosen = passes.sample_units([units], 1)
    assert 1 < len(chosen) < len(units)
    ours = sample_ahead.sample_of(chosen, cfg)
    theirs = SparkSource.of_files(spark, passes.bins(chosen, 2), cfg.data, cfg.storage).scan(cfg, sample_only=True).sample
    assert 0 < len(ours) < sum(1 for _ in sources.documents(chosen, cfg.data, cfg.storage))  # a fraction
    assert sorted(ours) == sorted(theirs)

    started = []
    real_start = sample_ahead.start
    monkeypatch.setattr(sample_ahead, "start", lambda *a: started.append(1) or real_start(*a))
    ahead = prepare([str(inputs)], output=str(tmp_path / "ahead"), config=cfg, spark=spark).manifest
    assert started == [1]
    monkeypatch.setenv("SPARKLM_SAMPLE_AHEAD", "0")
    on_spark = prepare([str(inputs)], output=str(tmp_path / "spark"), config=cfg, spark=spark).manifest
    assert started == [1]
    monkeypatch.delenv("SPARKLM_SAMPLE_AHEAD")
    failing = sample_ahead.Ahead(subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"], stdout=subprocess.PIPE,
                                                  text=True))
    monkeypatch.setattr(sample_ahead, "start", lambda *a: failing)  # a child that fails: the Spark job reads instead
    fallback = prepare([str(inputs)], output=str(tmp_path / "fallback"), config=cfg, spark=spark).manifest
    assert ahead["tokenizer"]["sha256"] == on_spark["tokenizer"]["sha256"] == fallback["tokenizer"]["sha256"]
    assert ahead["splits"] == on_spark["splits"] == fallback["splits"]


def test_the_write_tasks_tokenize_on_the_allocator_and_write_the_same_rows(spark, tmp_path, config):
    """tokenizer.allocator: the write pass's Python workers start on mimalloc (where the host has it; .ci/run
    installs it) and write the same bytes as on the system malloc; the session's other jobs keep their workers."""
    from sparklm.data import allocator

    (tmp_path / "in.txt").write_text(make_text(3000, seed=5))
    runs = {}
    for setting in ("auto", "system"):
        cfg = dataclasses.replace(config, tokenizer=dataclasses.replace(config.tokenizer, allocator=setting))
        runs[setting] = prepare([str(tmp_path / "in.txt")], output=str(tmp_path / setting), config=cfg, spark=spark)
    expected, got = allocator.library("auto", "local[2]"), runs["auto"].manifest["engine"]["allocator"]
    if expected:  # the soname (libmimalloc.so.2) names a file the workers mapped (libmimalloc.so.2.0)
        assert len(got) == 1 and got[0].startswith(expected)
    else:
        assert got == ["system"]
    assert runs["system"].manifest["engine"]["allocator"] == ["system"]
    for split in ("train", "validation"):
        assert rows(runs["auto"], split) == rows(runs["system"], split)
    assert runs["auto"].manifest["tokenizer"] == runs["system"].manifest["tokenizer"]
    other = spark.sparkContext.parallelize([0], 1).map(lambda _: allocator.loaded()).collect()
    assert other == ["system"]  # a job after the write pass runs on the session's own workers
    assert "LD_PRELOAD" not in spark.sparkContext.environment


def test_an_allocator_the_workers_cannot_load_is_a_warning_and_changes_nothing(spark, tmp_path, config, capsys):
    (tmp_path / "in.txt").write_text(make_text(800, seed=6))
    runs = []
    for setting in ("libnosuchmalloc.so.1", "system"):
        cfg = dataclasses.replace(config, tokenizer=dataclasses.replace(config.tokenizer, allocator=setting))
        runs.append(prepare([str(tmp_path / "in.txt")], output=str(tmp_path / setting), config=cfg, spark=spark))
    assert runs[0].manifest["engine"]["allocator"] == ["system"]
    assert rows(runs[0], "train") == rows(runs[1], "train")
    err = " ".join(capsys.readouterr().err.split())
    assert "tokenizer.allocator libnosuchmalloc.so.1 was not loaded where the write tasks ran" in err
    cfg = dataclasses.replace(config, tokenizer=dataclasses.replace(config.tokenizer, allocator=str(tmp_path / "no.so")))
    with pytest.raises(SparklmError, match="is not a file"):  # before any pass
        prepare([str(tmp_path / "in.txt")], output=str(tmp_path / "bad"), config=cfg, spark=spark)
    assert not (tmp_path / "bad").exists()


def test_one_long_line_trains_a_tokenizer_on_its_share(spark, tmp_path, config):
    """A file without a blank line is one document, here ~4x the tokenizer's sample: the sample took a document
    whole or not at all, and this one (by its hash) not, so the tokenizer knew bytes alone (1 token per byte)."""
    import random

    words = make_text(400, seed=5).split()
    (tmp_path / "line.txt").write_text(" ".join(random.Random(3).choice(words) for _ in range(500_000)))
    cfg = from_dict({"data": {"seq_len": 64, "val_fraction": 0.0}, "tokenizer": {"vocab_size": 1000, "sample_mb": 1}})
    ds = prepare([str(tmp_path / "line.txt")], output=str(tmp_path / "o"), config=cfg, spark=spark)
    assert ds.manifest["splits"]["train"]["bytes_per_token"] > 2.5


def test_explicit_validation_and_a_loaded_tokenizer(spark, tmp_path, config):
    import datasets

    (tmp_path / "train.txt").write_text(make_text(60, seed=3))
    (tmp_path / "val.txt").write_text("held out one\n\nheld out two\n")
    first = prepare([str(tmp_path / "train.txt")], output=str(tmp_path / "first"), config=config, spark=spark)
    cfg = from_dict({"data": {"seq_len": 16}, "tokenizer": {"path": str(tmp_path / "first" / "tokenizer.json")}})
    ds = prepare([str(tmp_path / "train.txt")], validation_inputs=[str(tmp_path / "val.txt")],
                 output=str(tmp_path / "second"), config=cfg, spark=spark)
    assert ds.manifest["splits"]["validation"]["documents"] == 2
    assert ds.manifest["splits"]["train"]["documents"] == 60
    assert ds.manifest["tokenizer"]["sha256"] == first.manifest["tokenizer"]["sha256"]
    assert ds.manifest["tokenizer"]["trained"] is False
    hf = datasets.Dataset.from_parquet(ds.files("train"))  # HF datasets reads the output as is
    assert len(hf) == ds.manifest["splits"]["train"]["sequences"] and len(hf[0]["input_ids"]) == 16


def test_errors_are_clear(spark, tmp_path, config):
    with pytest.raises(SparklmError, match="input not found"):
        prepare([str(tmp_path / "missing.txt")], output=str(tmp_path / "o"), config=config, spark=spark)
    (tmp_path / "blank.txt").write_text("\n\n   \n")
    with pytest.raises(SparklmError, match="no training documents left"):
        prepare([str(tmp_path / "blank.txt")], output=str(tmp_path / "o"), config=config, spark=spark)
    assert not (tmp_path / "o").exists()
    assert not list(tmp_path.glob(".o.sparklm-tmp-*"))  # nothing half-written is left behind
    (tmp_path / "t.csv").write_text("body\nhello\n")
    with pytest.raises(SparklmError, match="has no column 'text'"):
        prepare([str(tmp_path / "t.csv")], output=str(tmp_path / "o"), config=config, spark=spark)
    (tmp_path / "broken.txt.gz").write_bytes(b"\x1f\x8b\x08\x00not really gzip")
    with pytest.raises(SparklmError, match="cannot read .*broken.txt.gz"):
        prepare([str(tmp_path / "broken.txt.gz")], output=str(tmp_path / "o"), config=config, spark=spark)
    with pytest.raises(SparklmError, match="is not a prepared dataset|prepared dataset not found"):
        load_prepared(str(tmp_path / "o"))


def test_json_arrays_are_read_and_what_is_dropped_is_named(spark, tmp_path, config, capsys):
    d = tmp_path / "in"
    d.mkdir()
    records = [{"text": f"array record {i}: " + make_text(2, seed=i)} for i in range(6)] + [{"text": ["a list"]}]
    (d / "a.json").write_text(json.dumps(records, indent=2))  # as json.dump and pandas' to_json write records
    (d / "b.jsonl").write_text('{"text": "a line of its own"}\n{"body": "no text field"}\n'
                               '{"text": "half a pair \\ud800 escaped in JSON"}\n')  # was a TypeError in the task
    (d / "c.txt").write_bytes("UTF-16 text without its byte-order mark".encode("utf-16-le"))
    ds = prepare([str(d)], output=str(tmp_path / "out"), config=config, spark=spark)
    m = ds.manifest["input"]
    assert m["dropped"] == {"binary_file": 1, "malformed": 2}
    assert sum(ds.manifest["splits"][s]["documents"] for s in ("train", "validation")) == 8
    err = capsys.readouterr().err
    assert f"skipped 1 file(s) that look binary (NUL bytes in their first 8 kB): {d / 'c.txt'}; text in UTF-16" in err
    assert f"dropped 2 malformed record(s); the first: {d / 'a.json'} record 7: field 'text' holds a JSON array" in err

    (tmp_path / "fields.jsonl").write_text('{"content": "one", "id": 1}\n{"content": "two", "id": 2}\n')
    with pytest.raises(SparklmError, match=r"no training documents left after cleaning \(2 malformed; the first "
                       r"malformed: .*fields\.jsonl line 1 has no field 'text' \(its fields: content, id\)\)"):
        prepare([str(tmp_path / "fields.jsonl")], output=str(tmp_path / "o"), config=config, spark=spark)


def test_a_prepared_dataset_inside_the_input_directory_is_not_read_as_input(spark, tmp_path, config, capsys):
    """Tried as a new user would: `prepare data/ -o data/prepared` worked once, then failed on every run after
    ("data/prepared/train/part-00000.parquet has no column 'text'"): its own output was read as input."""
    d = tmp_path / "data"
    d.mkdir()
    (d / "a.txt").write_text(make_text(60, seed=3))
    first = prepare([str(d)], output=str(d / "prepared"), config=config, spark=spark).manifest
    capsys.readouterr()
    again = prepare([str(d)], output=str(d / "prepared"), config=config, spark=spark, overwrite=True).manifest
    other = prepare([str(d)], output=str(d / "other"), config=config, spark=spark).manifest
    assert first["input"] == again["input"] == other["input"] and first["input"]["files"] == 1
    assert first["splits"]["train"]["tokens"] == other["splits"]["train"]["tokens"]
    assert f"{d}: skipped the prepared dataset {d / 'prepared'} inside it" in capsys.readouterr().err
    with pytest.raises(SparklmError, match=r"prepared is a prepared dataset \(token ids, not text\)"):
        prepare([str(d / "prepared")], output=str(tmp_path / "o"), config=config, spark=spark)


def test_what_is_not_a_prepared_dataset_says_what_it_is(tmp_path):
    """Tried as a new user would: `train --data` of a text file was "cannot read x.txt/manifest.json: [Errno 20] ...
    Not a directory", and of a directory of text or of a dataset's train/ split "not a complete prepared dataset ...
    run `sparklm prepare` again with --overwrite", though prepare had never run there (its output appears whole)."""
    (tmp_path / "texts").mkdir()
    (tmp_path / "texts" / "a.txt").write_text("some text")
    (tmp_path / "ds" / "train").mkdir(parents=True)
    (tmp_path / "ds" / "manifest.json").write_text(json.dumps({"format": "sparklm.prepared/1"}))
    for given, what, hint in (
            ("texts/a.txt", "is a file, not a prepared dataset", "sparklm prepare .*texts/a.txt --output DIR"),
            ("texts", "is not a prepared dataset \\(no manifest.json\\)", "sparklm prepare .*texts --output DIR"),
            ("ds/train", "is a split of the prepared dataset .*ds, not the dataset", "--data .*ds")):
        with pytest.raises(SparklmError, match=f"{what}") as e:
            load_prepared(str(tmp_path / given))
        assert re.search(hint, e.value.hint), (given, e.value.hint)


def test_text_that_fills_no_sequence_is_refused_for_training_and_counted(spark, tmp_path, config, capsys):
    """Documents whose tokens are fewer than one sequence: prepare fails for the train split (before, it wrote a
    dataset of no rows and `train` failed on it) and warns for validation; their tokens are counted either way."""
    (tmp_path / "note.txt").write_text("A short note.\n\nAnother one.\n")
    with pytest.raises(SparklmError, match=r"the train split fills no sequence of 32 tokens: its 2 document\(s\) "
                                           r"hold \d+ tokens, and a last partial.*--last-block pad"):
        prepare([str(tmp_path / "note.txt")], output=str(tmp_path / "o"), config=config, spark=spark)
    assert not (tmp_path / "o").exists() and not list(tmp_path.glob(".o.sparklm-tmp-*"))
    padded = dataclasses.replace(config, data=dataclasses.replace(config.data, last_block="pad", val_fraction=0.0))
    ds = prepare([str(tmp_path / "note.txt")], output=str(tmp_path / "o"), config=padded, spark=spark)
    train = ds.manifest["splits"]["train"]
    assert train["sequences"] == 1 and train["tokens"] == 32 - train["pad_tokens"] > 4
    (tmp_path / "train.txt").write_text(make_text(60, seed=3))
    capsys.readouterr()
    ds = prepare([str(tmp_path / "train.txt")], validation_inputs=[str(tmp_path / "note.txt")],
                 output=str(tmp_path / "v"), config=config, spark=spark)
    held = ds.manifest["splits"]["validation"]
    assert held["sequences"] == 0 and held["tokens"] == held["dropped_tokens"] > 4  # was 0 and 0
    assert "the validation split fills no sequence of 32 tokens" in " ".join(capsys.readouterr().err.split())


def test_overwrite_is_required_and_keeps_the_old_output_until_done(spark, tmp_path, config):
    (tmp_path / "a.txt").write_text(make_text(30, seed=4))
    out = str(tmp_path / "out")
    first = prepare([str(tmp_path / "a.txt")], output=out, config=config, spark=spark)
    with pytest.raises(SparklmError, match="already exists"):
        prepare([str(tmp_path / "a.txt")], output=out, config=config, spark=spark)
    # a failing overwrite leaves the earlier dataset intact
    with pytest.raises(SparklmError):
        prepare([str(tmp_path / "missing")], output=out, config=config, spark=spark, overwrite=True)
    assert load_prepared(out).manifest["created_unix"] == first.manifest["created_unix"]
    again = prepare([str(tmp_path / "a.txt")], output=out, config=config, spark=spark, overwrite=True)
    assert again.manifest["created_unix"] > first.manifest["created_unix"]
    assert json.loads((tmp_path / "out" / "manifest.json").read_text())["format"] == "sparklm.prepared/1"


# -- instruction and chat records: the loss counts responses only ---------------------------------------


def stream_with_loss(dataset, split):
    """(token ids, loss mask) of a split's rows joined in file order, padding left out."""
    ids, loss = [], []
    for r in rows(dataset, split):
        keep = r.get("attention_mask") or [1] * len(r["input_ids"])
        ids += [t for t, k in zip(r["input_ids"], keep) if k]
        loss += [m for m, k in zip(r["loss_mask"], keep) if k]
    return ids, loss


def test_instruction_records_train_on_responses_only(spark, tmp_path, config):
    from transformers import AutoTokenizer

    pairs = [(f"Question {i}: {MULTILINGUAL[i % 10][:30]}?", f"Answer {i}: {MULTILINGUAL[(i + 3) % 10][:40]}")
             for i in range(30)]
    d = tmp_path / "in"
    d.mkdir()
    (d / "a.jsonl").write_text("".join(json.dumps({"question": q, "answer": a, "id": i}) + "\n"
                                       for i, (q, a) in enumerate(pairs[:12]))
                               + '{"question": "no answer", "answer": null}\n{broken\n')
    with (d / "b.csv").open("w", newline="") as f:
        import csv

        csv.writer(f).writerows([("answer", "question"), *((a, q) for q, a in pairs[12:20])])
    pq.write_table(pa.table({"question": [q for q, _ in pairs[20:]], "answer": [a for _, a in pairs[20:]]}),
                   d / "c.parquet")
    cfg = from_dict({"data": {"seq_len": 32, "val_fraction": 0.0, "last_block": "pad", "format": "instruction",
                              "prompt_field": "question", "response_field": "answer"},
                     "tokenizer": {"vocab_size": 300}})
    ds = prepare([str(d)], output=str(tmp_path / "out"), config=cfg, spark=spark)
    m = ds.manifest
    assert m["input"]["dropped"] == {"empty": 1, "malformed": 1}
    assert m["packing"]["loss_mask"] is True and "loss_mask" in m["columns"]
    ids, loss = stream_with_loss(ds, "train")
    tok = AutoTokenizer.from_pretrained(ds.uri)
    bos, eos = m["tokenizer"]["bos_id"], m["tokenizer"]["eos_id"]
    found, doc = [], None
    for t, k in zip(ids, loss):  # documents are BOS prompt response EOS, records cut across rows included
        if t == bos:
            assert k == 0
            doc = []
        elif t == eos:
            assert k == 1  # the model learns to stop after a response
            found.append((tok.decode([x for x, y in doc if not y]), tok.decode([x for x, y in doc if y])))
            assert [y for _, y in doc] == sorted(y for _, y in doc)  # prompt tokens, then response tokens
        else:
            doc.append((t, k))
    assert sorted(found) == sorted((clean_text(q), clean_text(a)) for q, a in pairs)  # NFC, as text is cleaned
    rows_ = rows(ds, "train")
    assert m["splits"]["train"]["loss_tokens"] == sum(sum(r["loss_mask"][1:]) for r in rows_)
    assert len(rows_) > 1 and rows_[0]["loss_mask"] != rows_[1]["loss_mask"]


CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}<|end|>{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def chat_tokenizer(directory, template=CHAT_TEMPLATE):
    """A small BPE with role and end-of-turn special tokens and a chat template, saved as an HF directory."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from sparklm.data.tokenizer import from_tokenizer

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|pad|>", "<|bos|>", "<|eos|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
    tok.train_from_iterator(MULTILINGUAL * 5, trainers.BpeTrainer(
        vocab_size=300, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    spec = from_tokenizer(tok, "<|bos|>", "<|eos|>", "<|pad|>", chat_template=template)
    spec.save(directory)
    return spec


def test_chat_records_train_only_assistant_turns(spark, tmp_path):
    from transformers import AutoTokenizer

    chat_tokenizer(tmp_path / "tok")
    convs = []
    for i in range(16):
        msgs = [{"role": "system", "content": f"Be brief {i}."}] if i % 2 else []
        for turn in range(1 + i % 3):
            msgs += [{"role": "user", "content": f"{MULTILINGUAL[(i + turn) % 10][:25]} {i}.{turn}"},
                     {"role": "assistant", "content": f"{MULTILINGUAL[(i + turn + 5) % 10][:20]} {i}/{turn}"}]
        convs.append(msgs)
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps({"messages": c}) + "\n" for c in convs))
    cfg = from_dict({"data": {"seq_len": 32, "val_fraction": 0.0, "last_block": "pad", "format": "chat"},
                     "tokenizer": {"path": str(tmp_path / "tok")}})
    ds = prepare([str(tmp_path / "chat.jsonl")], output=str(tmp_path / "out"), config=cfg, spark=spark)
    assert ds.manifest["packing"]["chat_template"] is True
    ids, loss = stream_with_loss(ds, "train")
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "tok"))
    runs, cur = [], []
    for t, k in zip(ids + [None], loss + [0]):  # the runs of trained tokens, each one assistant turn
        if k:
            cur.append(t)
        elif cur:
            runs.append(tok.decode(cur, skip_special_tokens=False))
            cur = []
    want = [f"{clean_text(m['content'])}<|end|>" for c in convs for m in c if m["role"] == "assistant"]
    assert sorted(runs) == sorted(want)  # the assistant's content and its end of turn; nothing else
    # the untrained rest is the template's rendering of everything else (no BOS or EOS added)
    assert tok.decode(ids, skip_special_tokens=False).count("<|user|>") == sum(len(c) - (c[0]["role"] == "system")
                                                                               for c in convs) // 2


def test_instruction_input_errors_are_one_line(spark, tmp_path, capsys):
    from sparklm.cli import main

    (tmp_path / "bad.jsonl").write_text('{"prompt": "a", "response": "b"}\n{"question": "c", "answer": "d"}\n')
    cfg = from_dict({"data": {"seq_len": 32, "format": "instruction"}, "tokenizer": {"vocab_size": 300}})
    # raised in a Spark task, surfaced on the driver as the same one line
    with pytest.raises(SparklmError, match=r"bad.jsonl line 2 has no 'prompt' field \(fields: question, answer\)"
                       ) as e:
        prepare([str(tmp_path / "bad.jsonl")], output=str(tmp_path / "o"), config=cfg, spark=spark)
    assert "--prompt-field" in e.value.hint
    assert main(["prepare", str(tmp_path / "bad.jsonl"), "-o", str(tmp_path / "o"), "--format", "instruction"]) == 2
    captured = capsys.readouterr().err
    err = [line for line in captured.splitlines() if line.startswith("error")]
    assert len(err) == 1 and "line 2 has no 'prompt' field" in err[0] and "--response-field" in err[0]
    assert "Traceback" not in captured
    (tmp_path / "t.txt").write_text("plain text\n")
    with pytest.raises(SparklmError, match="t.txt is plain text, and --format instruction reads records"):
        prepare([str(tmp_path / "t.txt")], output=str(tmp_path / "o"), config=cfg, spark=spark)
    (tmp_path / "chat.csv").write_text('messages\n"[{""role"": ""user"", ""content"": ""hi""}, {""role"": 1}]"\n')
    chat = from_dict({"data": {"format": "chat"}, "tokenizer": {"path": str(tmp_path / "tok")}})
    chat_tokenizer(tmp_path / "tok")
    with pytest.raises(SparklmError, match="chat.csv row 1 has a message 2 in 'messages' without a string"):
        prepare([str(tmp_path / "chat.csv")], output=str(tmp_path / "o"), config=chat, spark=spark)
    # a template that marks the last turn: prefixes of a conversation do not render as its start
    chat_tokenizer(tmp_path / "odd", "{% for m in messages %}{{ m.content }}{% if loop.last %}!{% endif %}{% endfor %}")
    (tmp_path / "two.jsonl").write_text('{"prompt": "a", "response": "b"}\n{"prompt": "c", "response": "d"}\n')
    odd = from_dict({"data": {"format": "instruction", "val_fraction": 0.0},
                     "tokenizer": {"path": str(tmp_path / "odd")}})
    with pytest.raises(SparklmError, match=r"two.jsonl line [12] cannot be cut into prompt and response") as e:
        prepare([str(tmp_path / "two.jsonl")], output=str(tmp_path / "o"), config=odd, spark=spark)
    assert "--no-chat-template" in e.value.hint
    with pytest.raises(SparklmError, match="a trained tokenizer has none"):
        prepare([str(tmp_path / "chat.csv")], output=str(tmp_path / "o"), spark=spark,
                config=from_dict({"data": {"format": "chat"}}))
    assert not (tmp_path / "o").exists()
