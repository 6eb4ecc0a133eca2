"""The Python API a notebook uses: prepare from a DataFrame or a table equals prepare from files of the same text,
mistakes are one line, and the top-level functions run in a fresh interpreter on the user's own session."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from conftest import MULTILINGUAL, make_text
from sparklm.config import from_dict
from sparklm.infra.errors import SparklmError

SMALL = {"data": {"seq_len": 32, "val_fraction": 0.2}, "tokenizer": {"vocab_size": 300}}


def documents(n: int = 60, seed: int = 5) -> list[str]:
    # repeated documents (deduplicated), blank ones (dropped) and every script of MULTILINGUAL
    texts = make_text(n, seed=seed).split("\n\n")
    return [*texts, texts[3], "   ", *MULTILINGUAL]


def sequences(ds, split: str) -> list[list[int]]:
    return [r["input_ids"] for f in ds.files(split) for r in pq.read_table(f).to_pylist()]


def figures(ds) -> dict:
    """The manifest's counts: documents read, dropped by reason, and per split documents, bytes and tokens."""
    m = ds.manifest
    return {"input": m["input"], "splits": {s: {k: v for k, v in e.items() if k != "files"}
                                            for s, e in m["splits"].items()}}


def test_a_dataframe_or_a_table_prepares_as_the_same_text_in_files(spark, tmp_path):
    import sparklm

    docs = documents()
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text("".join(json.dumps({"body": t}, ensure_ascii=False) + "\n" for t in docs), encoding="utf-8")
    df = spark.createDataFrame([(t, i) for i, t in enumerate(docs)], "body string, n long").coalesce(1)

    # one partition each way, documents in the same order: the same packed sequences, tokenizer and figures
    from_files = sparklm.prepare(str(jsonl), output=str(tmp_path / "files"), text_col="body", config=SMALL,
                                 spark=spark)
    from_frame = sparklm.prepare(df, output=str(tmp_path / "frame"), text_col="body", config=SMALL)
    for split in ("train", "validation"):
        assert sequences(from_frame, split) == sequences(from_files, split) != []
    assert (tmp_path / "frame" / "tokenizer.json").read_bytes() == (tmp_path / "files" / "tokenizer.json").read_bytes()
    assert figures(from_frame) == figures(from_files)
    assert from_frame.manifest["inputs"] == ["dataframe"]

    # any partitioning, one document per sequence: the same set of sequences (the split is by content)
    one_each = {"data": {**SMALL["data"], "concat": False}, "tokenizer": {"vocab_size": 300}}
    a = sparklm.prepare(str(jsonl), output=str(tmp_path / "f2"), text_col="body", config=one_each, spark=spark)
    df.repartition(3).createOrReplaceTempView("api_docs")  # (not "docs": the repository has a docs/ folder, and a path wins)
    b = sparklm.prepare("api_docs", output=str(tmp_path / "t2"), text_col="body", config=one_each, spark=spark)
    for split in ("train", "validation"):
        assert sorted(sequences(b, split)) == sorted(sequences(a, split))
    assert b.manifest["inputs"] == ["table api_docs"]

    # an explicit validation DataFrame: its rows are the validation split, none of them in train
    held = spark.createDataFrame([(t,) for t in MULTILINGUAL[:4]], "body string")
    c = sparklm.prepare(df, validation=held, output=str(tmp_path / "v"), text_col="body", config=SMALL)
    assert c.manifest["splits"]["validation"]["documents"] == 4  # kept there, though train holds them too
    assert c.manifest["input"]["files"] == 2 and c.manifest["validation_inputs"] == ["dataframe (validation)"]


def test_a_field_inside_a_struct_column_is_the_text_as_spark_names_it(spark, tmp_path):
    """`text_col="meta.body"`, as Spark's col("meta.body"): a struct column's field is the text (it was "the
    DataFrame has no column 'meta.body'"); a column whose own name holds the dot is still itself."""
    import sparklm

    docs = documents()
    nested = spark.createDataFrame([({"body": t, "n": i},) for i, t in enumerate(docs)],
                                   "meta struct<body: string, n: long>").coalesce(1)
    flat = spark.createDataFrame([(t,) for t in docs], "body string").coalesce(1)
    dotted = flat.withColumnRenamed("body", "a.b")
    a = sparklm.prepare(flat, output=str(tmp_path / "flat"), text_col="body", config=SMALL)
    b = sparklm.prepare(nested, output=str(tmp_path / "nested"), text_col="meta.body", config=SMALL)
    c = sparklm.prepare(dotted, output=str(tmp_path / "dotted"), text_col="a.b", config=SMALL)
    for split in ("train", "validation"):
        assert sequences(b, split) == sequences(a, split) == sequences(c, split) != []
    with pytest.raises(SparklmError, match=r"the DataFrame's column 'meta.n' holds bigint, not text"):
        sparklm.prepare(nested, output=str(tmp_path / "n"), text_col="meta.n", config=SMALL)
    with pytest.raises(SparklmError, match=r"the DataFrame has no column 'meta.nope' \(columns: meta\)"):
        sparklm.prepare(nested, output=str(tmp_path / "nope"), text_col="meta.nope", config=SMALL)


def test_pandas_arrow_and_hugging_face_datasets_are_sources_too(spark, tmp_path):
    """Tried as a Hugging Face user would: `sparklm.prepare(dataset)` of a `datasets.Dataset` (or a pandas
    DataFrame, a pyarrow Table) was "the source is a Dataset". Each becomes a Spark DataFrame of the same rows."""
    import datasets
    import pandas as pd
    import pyarrow as pa

    import sparklm

    docs = documents()
    one_each = {"data": {**SMALL["data"], "concat": False}, "tokenizer": {"vocab_size": 300}}
    frame = spark.createDataFrame([(t,) for t in docs], "text string")
    want = sparklm.prepare(frame, output=str(tmp_path / "spark"), config=one_each)
    hf = datasets.Dataset.from_dict({"text": ["left out", *docs]}).select(range(1, len(docs) + 1))  # an index map
    for name, source in (("pandas", pd.DataFrame({"text": docs})), ("arrow", pa.table({"text": docs})),
                         ("hf", hf)):
        got = sparklm.prepare(source, output=str(tmp_path / name), config=one_each, spark=spark)
        for split in ("train", "validation"):
            assert sorted(sequences(got, split)) == sorted(sequences(want, split)) != [], (name, split)
    assert got.manifest["inputs"] == ["datasets.Dataset"]
    held = sparklm.prepare(hf, validation=datasets.Dataset.from_dict({"text": MULTILINGUAL[:3]}),
                           output=str(tmp_path / "held"), config=SMALL, spark=spark)
    assert held.manifest["splits"]["validation"]["documents"] == 3
    with pytest.raises(SparklmError, match=r"the source is a DatasetDict"):
        sparklm.prepare(datasets.DatasetDict({"train": hf}), output=str(tmp_path / "dd"), config=SMALL, spark=spark)


def test_a_delta_tables_current_version_is_prepared(spark, tmp_path):
    """Read through the deltalake package (no jars): the current version's files only, not those an overwrite
    removed, whose files stay in the directory; the same as a Parquet file of that version's rows."""
    import pyarrow as pa
    from deltalake import write_deltalake

    import sparklm

    table = tmp_path / "table"
    write_deltalake(str(table), pa.table({"text": documents(40, seed=1)}))
    current = documents(50, seed=2)
    write_deltalake(str(table), pa.table({"text": current}), mode="overwrite")
    assert len(list(table.glob("*.parquet"))) == 2  # version 0's file is still there
    pq.write_table(pa.table({"text": current}), tmp_path / "current.parquet")
    ds = sparklm.prepare(str(table), output=str(tmp_path / "from-delta"), config=SMALL, spark=spark)
    ref = sparklm.prepare(str(tmp_path / "current.parquet"), output=str(tmp_path / "ref"), config=SMALL, spark=spark)
    for split in ("train", "validation"):
        assert sequences(ds, split) == sequences(ref, split) != []
    assert figures(ds) == figures(ref)
    # a directory above the table is not read as plain files
    with pytest.raises(SparklmError, match="holds a Delta table"):
        sparklm.prepare(str(tmp_path), output=str(tmp_path / "no"), config=SMALL, spark=spark)


def test_dataframe_mistakes_are_one_line_and_write_nothing(spark, tmp_path):
    import sparklm

    df = spark.createDataFrame([("some text here", 1)], "text string, n long")
    cases = [
        (df, {"text_col": "body"}, "the DataFrame has no column 'body' (columns: text, n)"),
        # was a whole read pass, then "no training documents left (1 malformed ... does not hold strings)"
        (df, {"text_col": "n"}, "the DataFrame's column 'n' holds bigint, not text"),
        (df.limit(0), {}, "no training documents left after cleaning"),
        (spark.createDataFrame([(None,), ("   ",)], "text string"), {}, "no training documents left after cleaning"),
        (df, {"validation": [str(tmp_path)]}, "of different kinds"),
        (42, {}, "the source is a int"),
        ("no_such_table_or_file", {}, "no_such_table_or_file is neither a file nor a table"),
        (str(tmp_path / "missing" / "*.txt"), {}, "no files match"),
        (df, {"settings": {"data.nope": 1}}, "unknown config key 'data.nope'"),
    ]
    for i, (source, kwargs, message) in enumerate(cases):
        out = tmp_path / f"out{i}"
        with pytest.raises(SparklmError, match=message.replace("(", r"\(").replace(")", r"\)")):
            sparklm.prepare(source, output=str(out), config=SMALL, spark=spark, **kwargs)
        assert not out.exists(), message


def test_a_model_fitted_from_python_on_the_users_session(tmp_path):
    """A fresh interpreter, as a notebook: `import sparklm` loads neither torch nor pyspark; the user's own session
    prepares a DataFrame, fits, generates (in process and over a DataFrame of prompts, keeping its columns), and is
    still running afterwards, with its log level as it was."""
    script = tmp_path / "notebook.py"
    script.write_text(f"""
import json, sys
import sparklm
assert "torch" not in sys.modules and "pyspark" not in sys.modules, "import sparklm is heavy"
from pyspark.sql import SparkSession
spark = (SparkSession.builder.master("local[2]").config("spark.ui.enabled", "false")
         .config("spark.ui.showConsoleProgress", "true").getOrCreate())  # the pyspark shell's console bar
spark.sparkContext.setLogLevel("ERROR")
from pyspark.sql import functions as F
slowly = F.udf(lambda t: (__import__("time").sleep(0.03), t)[1], "string")  # stages that last over 500 ms
texts = {make_text(80, seed=9).split(chr(10) * 2)!r}
df = spark.createDataFrame([(t, i) for i, t in enumerate(texts)], "body string, n long").repartition(2)
df = df.withColumn("body", slowly("body"))
def mark(word):
    print(word, file=sys.stderr, flush=True)
def own_job():  # the user's own job, over 500 ms: Spark draws its bar
    df.agg(F.sum(F.length("body"))).collect()
own_job()
mark("<<sparklm>>")
ds = sparklm.prepare(df, output={str(tmp_path / "data")!r}, text_col="body", config={SMALL!r})
result = sparklm.fit(data=ds, output={str(tmp_path / "run")!r},
                     settings={{"model.n_layer": 1, "model.n_head": 2, "model.n_embd": 32, "train.max_steps": 2,
                               "train.batch_size": 4, "train.samples": 0, "train.dtype": "float32"}})
text = result.generate("The", max_new_tokens=4, temperature=0)
assert text == sparklm.generate(result.run_dir, "The", max_new_tokens=4, temperature=0)
assert text == sparklm.generate(result.run_dir, "The", max_new_tokens=4, temperature=0, backend="llama.cpp")
mark("<</sparklm>>")
own_job()  # the bar is the user's again
prompts = spark.createDataFrame([("a", "The"), ("b", "Москва")], "tag string, prompt string")
rows = sparklm.generate_dataframe(prompts, model=result.run_dir,
                                  sampling=sparklm.Sampling(temperature=0, max_new_tokens=4)).collect()
assert sorted(r.tag for r in rows) == ["a", "b"] and [r.generated for r in rows if r.tag == "a"] == [text]
assert spark.range(3).count() == 3  # the session is still the user's, running
print(json.dumps({{"steps": result.summary["steps"], "text": text,
                   "level": spark.sparkContext._jvm.org.apache.logging.log4j.LogManager.getRootLogger().getLevel()
                   .toString()}}))
""")
    # the project's environment activated, as a notebook kernel's is: Spark's Python workers run its python3
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600,
                       env={**os.environ, "SPARK_LOCAL_IP": "127.0.0.1", "PATH": path})
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["steps"] == 2 and out["level"] == "ERROR"
    before, rest = r.stderr.split("<<sparklm>>")
    during, after = rest.split("<</sparklm>>")
    assert "[Stage " in before and "[Stage " in after, r.stderr[-2000:]  # the user's bar, left on
    assert "[Stage " not in during, during[-2000:]  # held back while sparklm reports
    assert "read + clean + deduplicate the DataFrame" in during


def test_settings_of_takes_a_config_a_dict_a_file_or_nothing(tmp_path):
    from sparklm.api import settings_of

    toml = tmp_path / "c.toml"
    toml.write_text("[train]\nmax_steps = 7\n")
    assert settings_of(None).train.max_steps == from_dict({}).train.max_steps
    assert settings_of(str(toml)).train.max_steps == 7
    assert settings_of({"train": {"max_steps": 5}}, {"train.lr": 0.01}).train.lr == 0.01
    assert settings_of(from_dict({"train": {"max_steps": 3}})).train.max_steps == 3
    with pytest.raises(SparklmError, match="unknown config key 'train.nope'"):
        settings_of(None, {"train.nope": 1})
    with pytest.raises(SparklmError, match="config= is a int"):
        settings_of(3)


TINY_LM = {"model.n_layer": 1, "model.n_head": 2, "model.n_embd": 32, "train.max_steps": 2, "train.batch_size": 4,
           "train.samples": 0, "train.dtype": "float32", "train.threads": 1, "data.seq_len": 32,
           "tokenizer.vocab_size": 300}


def test_a_pipeline_fits_saves_loads_and_transforms(spark, tmp_path):
    import shutil

    from pyspark.ml import Pipeline, PipelineModel

    from sparklm.ml import CausalLM, CausalLMModel

    docs = spark.createDataFrame([(t,) for t in documents()], "body string")
    work = tmp_path / "work"
    lm = CausalLM(textCol="body", workDir=str(work), settings=TINY_LM, sampling={"temperature": 0, "max_new_tokens": 4})
    model = Pipeline(stages=[lm]).fit(docs)
    (fitted,) = model.stages
    assert isinstance(fitted, CausalLMModel) and fitted.getOrDefault("sampling")["max_new_tokens"] == 4
    assert len(list(work.glob("data-*"))) == 1 and len(list(work.glob("run-*"))) == 1
    prompts = spark.createDataFrame([("a", "The"), ("b", "Москва")], "tag string, prompt string")
    first = model.transform(prompts)
    assert first.columns == ["tag", "prompt", "sample", "generated", "prompt_tokens", "new_tokens", "truncated"]
    before = sorted((r.tag, r.generated) for r in first.collect())

    # saved with a copy of its model: it loads and transforms the same once the run directory is gone
    model.write().save(str(tmp_path / "saved"))
    lm.write().save(str(tmp_path / "estimator"))
    # a stage saved over an existing path: one line, as Spark's JVM stages say it (was a Py4J error, and written
    # over a file's path, "Parent path is not a directory"); overwrite() replaces it
    fitted.write().save(str(tmp_path / "stage"))
    (tmp_path / "notes.txt").write_text("mine\n")
    for taken in ("stage", "notes.txt"):
        with pytest.raises(SparklmError, match=r"already exists.*write\(\)\.overwrite\(\)\.save"):
            fitted.write().save(str(tmp_path / taken))
    assert (tmp_path / "notes.txt").read_text() == "mine\n"
    fitted.write().overwrite().save(str(tmp_path / "stage"))
    shutil.rmtree(work)
    after = sorted((r.tag, r.generated) for r in PipelineModel.load(str(tmp_path / "saved")).transform(prompts).collect())
    assert after == before and all(text is not None for _, text in after)
    again = CausalLM.load(str(tmp_path / "estimator"))
    assert again.getOrDefault("settings") == TINY_LM and again.getOrDefault("textCol") == "body"

    with pytest.raises(SparklmError, match="CausalLM needs workDir="):
        CausalLM(textCol="body").fit(docs)
    with pytest.raises(SparklmError, match="has no column 'body'"):
        CausalLM(textCol="body", workDir=str(work)).fit(prompts)
