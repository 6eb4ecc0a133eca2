"""The engine-neutral pieces of ``prepare`` (``data/passes.py``) and the Beam engine's option handling, as pure
functions."""

from __future__ import annotations

import os

import pytest

from sparklm.config import from_dict
from sparklm.data import beam_engine, passes
from sparklm.data.sources import ReadUnit
from sparklm.infra.errors import SparklmError


def test_the_copy_kept_is_the_validation_one_then_the_first_by_source_and_position():
    copies = [("train", "b.txt", 3), ("train", "a.txt", 9), ("validation", "z.txt", 0), ("train", "a.txt", 2)]
    assert sorted(copies, key=lambda c: passes.copy_order(*c)) == [
        ("validation", "z.txt", 0), ("train", "a.txt", 2), ("train", "a.txt", 9), ("train", "b.txt", 3)]


def test_bins_are_balanced_ordered_and_a_function_of_the_units_and_their_number():
    units = [ReadUnit(f"f{i}.txt", "text", "", size=s) for i, s in enumerate([900, 100, 500, 400, 300, 200])]
    got = passes.bins(units, 3)
    assert passes.bins(list(reversed(units)), 3) == got  # the order units are planned in does not matter
    assert [sum(u.nbytes for u in b) for b in got] == [900, 800, 700]
    assert all(b == sorted(b, key=lambda u: (u.uri, u.start)) for b in got)
    assert len(passes.bins(units, 10)) == 6 and len(passes.bins([], 4)) == 1


def test_a_long_document_gives_the_tokenizer_its_share_piece_by_piece():
    """A document is sampled whole or not at all by its hash; one longer than a piece (a file without blank lines,
    doc_mode file) gave the tokenizer all of it or nothing: one 100 MB line trained a tokenizer of bytes alone."""
    import random

    rng = random.Random(0)
    words = ["the", "cat", "sat", "on", "a", "mat", "and", "looked", "out", "at", "rain"]
    text = " ".join(rng.choice(words) for _ in range(6 * passes.SAMPLE_PIECE // 4))  # ~6 pieces
    for fraction in (0.25, 0.5):  # 240 pieces drawn each: within half of the share either way
        got = [passes.sample_of(text, doc, fraction) for doc in range(-20, 20)]
        sizes = [len(g or "") for g in got]
        assert 0.5 * fraction * len(text) * 40 < sum(sizes) < 1.5 * fraction * len(text) * 40
        assert sum(s == 0 for s in sizes) < 40  # not all or nothing any more
        for g in filter(None, got):
            for piece in g.split("\n"):
                assert piece in text and not piece.startswith(" ")  # cut at white space, so words stay whole
    assert passes.sample_of(text, 7, 0.34) == passes.sample_of(text, 7, 0.34)  # a function of content and fraction
    assert passes.sample_of(text, 7, 1.0) == text
    short = "a short paragraph"
    picked = [passes.sample_of(short, doc, 0.5) for doc in (-5, 3, 2**40, 17 << 20)]
    assert all(p in (None, short) for p in picked)  # whole or not at all, by the hash, as before
    assert picked == [short if (d & 0xFFFFFF) < 0.5 * 2**24 else None for d in (-5, 3, 2**40, 17 << 20)]


def test_reports_gather_into_files_and_counts():
    reports = [{"split": "train", "path": "train/part-00001-0.parquet", "rows": 2, "tokens": 70, "dropped_tokens": 6},
               {"split": "validation", "path": "validation/part-00001-0.parquet", "rows": 0, "tokens": 9,
                "dropped_tokens": 9},
               {"split": "train", "path": "train/part-00000-7.parquet", "rows": 5, "tokens": 170, "dropped_tokens": 10},
               {"split": "", "counts": [("a.txt", "ok", "train", True, 3, 30, 0, 12)]}]
    files, agg, tokens = passes.gather(reports)
    assert [m["path"] for m in files["train"]] == ["train/part-00000-7.parquet", "train/part-00001-0.parquet"]
    assert files["validation"] == []  # a task with nothing for a split leaves no file
    assert tokens == {"train": {"tokens": 240, "dropped_tokens": 16, "tasks": 2},  # but its tokens count
                      "validation": {"tokens": 9, "dropped_tokens": 9, "tasks": 1}}
    assert agg == [{"source": "a.txt", "status": "ok", "split": "train", "kept": True, "n": 3, "bytes": 30,
                    "invalid": 0, "first": 12}]
    assert passes.part_name(7, "ab12").rsplit("-", 1)[0] == "part-00007"


def test_beam_options_become_flags_and_the_direct_runner_gets_one_process_per_worker():
    direct = from_dict({"beam": {"options": {"direct_num_workers": "3"}}})
    assert beam_engine.workers(direct) == 3
    args = beam_engine.pipeline_args(direct)
    assert args[0] == "--runner=DirectRunner"
    assert "--direct_num_workers=3" in args and "--direct_running_mode=multi_processing" in args
    flink = from_dict({"beam": {"runner": "FlinkRunner", "options": {"parallelism": "8", "flink_master": "h:8081"}}})
    args = beam_engine.pipeline_args(flink)
    assert "--flink_master=h:8081" in args and not any("direct_" in a for a in args)
    assert beam_engine.workers(flink) == 8


def test_the_beam_engine_checks_its_options_before_any_work():
    with pytest.raises(SparklmError, match="num_workers"):
        beam_engine.check(from_dict({"beam": {"options": {"num_workers": "0"}}}), frame=False)
    with pytest.raises(SparklmError, match="DataFrame"):
        beam_engine.check(from_dict({}), frame=True)


def test_a_write_task_tokenizes_on_its_share_of_the_cpus(monkeypatch):
    """The tokenizer's thread pool is sized to the task's CPUs (spark.task.cpus), unless the user sized it."""
    monkeypatch.delenv("RAYON_NUM_THREADS", raising=False)
    passes.share_cpus(1)
    assert os.environ["RAYON_NUM_THREADS"] == "1"
    monkeypatch.setenv("RAYON_NUM_THREADS", "6")
    passes.share_cpus(2)
    assert os.environ["RAYON_NUM_THREADS"] == "6"


def test_the_tokenizing_processes_allocator_is_chosen_where_its_host_is_known(monkeypatch, tmp_path):
    """tokenizer.allocator: system preloads nothing; auto only on a local master (the executors' libraries are not
    known on a cluster); a named library is taken as it is, and a path that is no file is one line."""
    from sparklm.data import allocator

    preloaded = os.environ.get("LD_PRELOAD", "")  # what this test process was started with
    assert allocator.library("system", "local[2]") is None
    assert allocator.library("auto", "spark://10.0.0.1:7077") is None
    found = allocator.library("auto", "local[2]")
    assert found is None or found.startswith(("libmimalloc", "libjemalloc"))
    assert allocator.library("libmimalloc.so.2", "yarn") == "libmimalloc.so.2"
    with pytest.raises(SparklmError, match="is not a file"):
        allocator.library(str(tmp_path / "libnone.so"), "local[*]")
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    assert allocator.environment(None) == {}
    assert allocator.environment("libmimalloc.so.2") == {"LD_PRELOAD": "libmimalloc.so.2"}
    monkeypatch.setenv("LD_PRELOAD", "libtheirs.so")  # the user's preload is kept
    assert allocator.environment("libmimalloc.so.2") == {"LD_PRELOAD": "libmimalloc.so.2 libtheirs.so"}
    if "malloc" not in preloaded:  # a test process started on the C library's malloc says so
        assert allocator.loaded() == "system"


def test_a_worker_renders_and_encodes_with_each_tokenizers_own_template_and_post_processor():
    """Two tokenizers with the same token-id fingerprint but different chat templates (or special tokens the template
    reads, or post-processors) render and encode differently in one Python worker: a Spark worker reused by the next
    prepare must not keep the first one's (CI saw a template check pass on a stale template)."""
    import dataclasses
    import json

    from sparklm.config import TokenizerConfig
    from sparklm.data import tokenizer

    spec = tokenizer.train(["abc abd"] * 20, TokenizerConfig(vocab_size=270))
    msgs = [{"role": "user", "content": "hi"}]
    plain = dataclasses.replace(spec, chat_template="{% for m in messages %}{{ m.content }}{% endfor %}")
    marked = dataclasses.replace(plain, chat_template="{% for m in messages %}{{ m.content }}!{% endfor %}")
    eos = dataclasses.replace(plain, chat_template="{% for m in messages %}{{ m.content }}{{ eos_token }}{% endfor %}")
    renamed = dataclasses.replace(eos, eos_token="<|bos|>")
    assert plain.sha256 == marked.sha256 == eos.sha256  # the same tokenization, so the same token-id fingerprint
    assert [passes.renderer_for(s)(msgs, False) for s in (plain, marked, eos, renamed, plain)] == [
        "hi", "hi!", "hi<|eos|>", "hi<|bos|>", "hi"]
    bare = dataclasses.replace(spec, json=json.dumps({**json.loads(spec.json), "post_processor": None}))
    assert bare.sha256 == spec.sha256
    firsts = [passes.tokenizer_for(s, encoder=True).encode("abc").ids[0] for s in (spec, bare)]
    assert firsts[0] == spec.bos_id != firsts[1]  # the trained post-processor starts with BOS; the bare one does not
