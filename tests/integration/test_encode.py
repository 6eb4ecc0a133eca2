"""Encoders scoring DataFrames (infer/encode.py): a tiny random BERT with its own WordPiece tokenizer, built here,
classifies and embeds rows on real Spark as HF's pipeline and a plain forward pass do, whatever the partitioning."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from conftest import LABELS, make_text, tiny_bert
from sparklm.infra.errors import SparklmError


def texts() -> list[str | None]:
    lines = [line for line in make_text(30, seed=11).splitlines() if line.strip()][:14]
    return [*lines, None, "   ", " ".join(lines) * 3]  # a null, a blank and a text longer than 48 positions


@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    return tiny_bert(tmp_path_factory.mktemp("bert") / "model")


def test_classify_dataframe_answers_as_the_pipeline_whatever_the_partitioning(spark, bert):
    from transformers import pipeline

    import sparklm

    rows = [(i, t) for i, t in enumerate(texts())]
    df = spark.createDataFrame(rows, "id long, text string")
    got = {}
    for parts in (1, 3):
        out = sparklm.classify_dataframe(df.repartition(parts), model=bert, probabilities_col="probs",
                                         batch_size=4).collect()
        assert set(out[0].asDict()) == {"id", "text", "label", "score", "truncated", "probs"}
        got[parts] = {r["id"]: r for r in out}
    clf = pipeline("text-classification", model=bert, tokenizer=bert, device="cpu")
    for i, text in rows:
        a, b = got[1][i], got[3][i]
        if text is None or not text.strip():
            assert a["label"] is None and a["score"] is None and a["probs"] is None
            continue
        assert a["label"] == b["label"] and a["score"] == pytest.approx(b["score"], abs=1e-5)
        want = clf(text, truncation=True, max_length=48)[0]
        assert a["label"] == want["label"] and a["score"] == pytest.approx(want["score"], abs=1e-5)
        assert sum(a["probs"]) == pytest.approx(1.0, abs=1e-5) and a["label"] in LABELS.values()
        assert a["truncated"] == (len(clf.tokenizer(text)["input_ids"]) > 48)
    assert got[1][len(rows) - 1]["truncated"] and not all(r["truncated"] for r in got[1].values() if r["label"])


def test_embed_dataframe_pools_as_a_plain_forward_pass(spark, bert):
    from transformers import AutoModel, AutoTokenizer

    import sparklm

    rows = [(i, t) for i, t in enumerate(texts()[:6])]
    df = spark.createDataFrame(rows, "id long, text string").repartition(2)
    model, tok = AutoModel.from_pretrained(bert).eval(), AutoTokenizer.from_pretrained(bert)
    for pooling in ("mean", "cls"):
        got = {r["id"]: r for r in sparklm.embed_dataframe(df, model=bert, pooling=pooling, batch_size=4).collect()}
        for i, text in rows:
            with torch.no_grad():
                hidden = model(**tok(text, truncation=True, max_length=48, return_tensors="pt")).last_hidden_state[0]
            want = hidden.mean(0) if pooling == "mean" else hidden[0]
            assert np.allclose(got[i]["embedding"], want.numpy(), atol=1e-5), (pooling, i)
    unit = sparklm.embed_dataframe(df, model=bert, normalize=True, output_col="v").collect()
    assert all(abs(np.linalg.norm(r["v"]) - 1) < 1e-5 for r in unit)


def test_scoring_mistakes_are_one_line_on_the_driver(spark, bert, tmp_path):
    import sparklm

    df = spark.createDataFrame([(1, "a b c")], "n long, body string")
    base = tiny_bert(tmp_path / "base", head=False)
    with pytest.raises(SparklmError, match="has no classification head"):
        sparklm.classify_dataframe(df, model=base, text_col="body")
    with pytest.raises(SparklmError, match="has no column 'text'"):
        sparklm.classify_dataframe(df, model=bert)
    with pytest.raises(SparklmError, match="holds bigint, not text"):
        sparklm.embed_dataframe(df, model=bert, text_col="n")
    with pytest.raises(SparklmError, match="pooling 'max' is not one of"):
        sparklm.embed_dataframe(df, model=bert, text_col="body", pooling="max")
    with pytest.raises(SparklmError, match="already has column"):
        sparklm.embed_dataframe(df, model=bert, text_col="body", output_col="n")
    with pytest.raises(SparklmError, match="not found"):
        sparklm.embed_dataframe(df, model=str(tmp_path / "nothing"), text_col="body")
    # was: a range() of step 0 failing in every task, and torch refusing -1 threads there
    with pytest.raises(SparklmError, match=r"--batch-size must be >= 1 \(got 0\)"):
        sparklm.classify_dataframe(df, model=bert, text_col="body", batch_size=0)
    with pytest.raises(SparklmError, match=r"--threads must be >= 0"):
        sparklm.embed_dataframe(df, model=bert, text_col="body", threads=-1)
    with pytest.raises(SparklmError, match=r"--batch-size must be >= 1"):
        sparklm.generate_dataframe(df.withColumnRenamed("body", "prompt"), model=bert, batch_size=0)


def test_a_batch_of_texts_all_null_or_blank_gets_nulls_not_a_traceback(spark, bert):
    """Found on the way: an Arrow batch whose texts were all null or blank (a partition of them) failed its task
    with IndexError inside the tokenizer, given no text."""
    import sparklm

    df = spark.createDataFrame([(None,), ("   ",)], "text string").coalesce(1)
    assert [r["embedding"] for r in sparklm.embed_dataframe(df, model=bert).collect()] == [None, None]
    assert [r["label"] for r in sparklm.classify_dataframe(df, model=bert).collect()] == [None, None]


def test_predict_reads_json_arrays_beside_json_lines(spark, bert, tmp_path):
    """Tried as a new user would: `predict --input texts.json` of a pretty-printed JSON array (json.dump(records,
    indent=2)) was "the DataFrame has no column 'text' (columns: _corrupt_record)"."""
    from sparklm.infer.predict import predict

    records = [{"text": f"sentence {i} is here"} for i in range(5)]
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "pretty.json").write_text(json.dumps(records[:3], indent=2))
    (tmp_path / "in" / "lines.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records[3:]))
    info = predict(spark, bert, [str(tmp_path / "in" / "pretty.json"), str(tmp_path / "in" / "lines.jsonl")],
                   str(tmp_path / "out"), embed=True)
    assert info["rows"] == 5
    (tmp_path / "nested.jsonl").write_text("".join(json.dumps({"meta": r}) + "\n" for r in records))
    assert predict(spark, bert, [str(tmp_path / "nested.jsonl")], str(tmp_path / "out3"), embed=True,
                   text_col="meta.text")["rows"] == 5  # a field inside a field, as --text-field meta.text
    with pytest.raises(SparklmError, match=r"nested\.jsonl has no column 'body' \(columns: meta\)"):
        predict(spark, bert, [str(tmp_path / "nested.jsonl")], str(tmp_path / "out4"), embed=True, text_col="body")
    (tmp_path / "broken.json").write_text('[{"text": "one"},\n {"text": ')
    with pytest.raises(SparklmError, match=r"broken\.json: no line or array of JSON objects Spark could read"):
        predict(spark, bert, [str(tmp_path / "broken.json")], str(tmp_path / "out2"), embed=True)


@pytest.mark.parametrize("quantize", ["none", "int8"])
def test_an_encoder_exports_to_onnx_and_answers_as_torch(bert, tmp_path, quantize):
    """The classifier's graph (and the head-less encoder's hidden states) run in onnxruntime as torch computes
    them: fp32 to float precision, int8 weights close enough to keep the probabilities."""
    import onnxruntime as ort
    from transformers import AutoModel, AutoModelForSequenceClassification, AutoTokenizer

    from sparklm.infer.export import export

    base = tiny_bert(tmp_path / "base", head=False)
    tok = AutoTokenizer.from_pretrained(bert)
    batch = tok([t for t in texts() if t and t.strip()][:5], padding=True, truncation=True, max_length=48,
                return_tensors="pt")
    feed = {"input_ids": batch["input_ids"].numpy(), "attention_mask": batch["attention_mask"].numpy()}
    for source, cls, output in ((bert, AutoModelForSequenceClassification, "logits"),
                                (base, AutoModel, "last_hidden_state")):
        out = tmp_path / f"onnx-{output}"
        info = export(source, str(out), quantize=quantize)
        assert info["outputs"] == [output] and (info["labels"] is not None) == (output == "logits")
        got = ort.InferenceSession(str(out / "model.onnx"), providers=["CPUExecutionProvider"]).run(None, feed)[0]
        with torch.no_grad():
            want = getattr(cls.from_pretrained(source).eval()(**batch), output).numpy()
        if output == "last_hidden_state":
            keep = batch["attention_mask"].numpy().astype(bool)  # padded positions are not compared
            got, want = got[keep], want[keep]
        tol = 1e-4 if quantize == "none" else 0.1
        assert np.abs(got - want).max() < tol, np.abs(got - want).max()
        if output == "logits":
            p, q = torch.softmax(torch.from_numpy(got), -1), torch.softmax(torch.from_numpy(want), -1)
            assert (p - q).abs().max() < (1e-5 if quantize == "none" else 0.02)


def test_an_encoder_decoder_embeds_and_exports_through_its_encoder(bert, tmp_path):
    """A T5 (or BART) given to --embed or export: its whole model wants decoder inputs too (a ValueError in every
    task, a torch.export traceback); its encoder embeds, as sentence-T5 does."""
    import onnxruntime as ort
    from transformers import AutoTokenizer, T5Config, T5EncoderModel, T5Model

    from sparklm.infer.encode import embed_texts, load_encoder
    from sparklm.infer.export import export

    tok = AutoTokenizer.from_pretrained(bert)
    torch.manual_seed(0)
    T5Model(T5Config(vocab_size=len(tok), d_model=32, d_ff=64, num_layers=1, num_heads=2, d_kv=16,
                     pad_token_id=tok.pad_token_id)).save_pretrained(str(tmp_path / "t5"))
    tok.save_pretrained(str(tmp_path / "t5"))
    lines = [t for t in texts() if t and t.strip()][:5]
    got, _ = embed_texts(load_encoder(str(tmp_path / "t5"), classify=False), lines, batch_size=2)
    encoder = T5EncoderModel.from_pretrained(str(tmp_path / "t5")).eval()
    batch = tok(lines, padding=True, truncation=True, max_length=48, return_tensors="pt")
    with torch.no_grad():
        hidden = encoder(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).float()
    assert np.allclose(got, ((hidden * mask).sum(1) / mask.sum(1)).numpy(), atol=1e-5)

    info = export(str(tmp_path / "t5"), str(tmp_path / "onnx"))
    assert info["outputs"] == ["last_hidden_state"]
    feed = {"input_ids": batch["input_ids"].numpy(), "attention_mask": batch["attention_mask"].numpy()}
    out = ort.InferenceSession(str(tmp_path / "onnx" / "model.onnx"), providers=["CPUExecutionProvider"]).run(
        None, feed)[0]
    keep = feed["attention_mask"].astype(bool)
    assert np.abs(out[keep] - hidden.numpy()[keep]).max() < 1e-4


def test_predict_scores_a_csv_into_parquet_with_its_columns_and_replaces_only_its_own(bert, tmp_path):
    """`sparklm predict` as a user runs it: a CSV with a header (quoted commas and newlines in the text), the labels
    and scores equal classify_dataframe's, embeddings with --embed; mistakes are one line with nothing written."""
    import csv
    import subprocess
    import sys

    import pyarrow.parquet as pq

    rows = [(i, t) for i, t in enumerate(texts()) if t is not None]
    rows.append((99, 'a "quoted", two-line\ntext'))
    with (tmp_path / "in.csv").open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["id", "body"])
        w.writerows(rows)

    def predict(*args):
        return subprocess.run([sys.executable, "-m", "sparklm", "predict", bert, "--input", str(tmp_path / "in.csv"),
                               "--text-field", "body", "--master", "local[2]", "--set", "spark.ui=false", *args],
                              capture_output=True, text=True, timeout=300)

    out = tmp_path / "scored"
    r = predict("--output", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"{len(rows)} rows → {out}" in r.stdout + r.stderr
    table = pq.read_table(str(out)).to_pylist()
    got = {int(t["id"]): t for t in table}
    assert set(got) == {i for i, _ in rows} and set(table[0]) == {"id", "body", "label", "score", "truncated"}
    assert got[99]["body"] == 'a "quoted", two-line\ntext'
    info = json.loads((out / "_sparklm_predict.json").read_text())
    assert info["rows"] == len(rows) and sum(info["labels"].values()) == len(rows) - 1  # the blank text: no label
    # again, embeddings, over the earlier prediction (ours: replaced); over a directory of someone else's: refused
    r = predict("--output", str(out), "--embed", "--overwrite")
    assert r.returncode == 0, r.stderr[-3000:]
    assert len(pq.read_table(str(out)).column("embedding")[0].as_py()) == 32
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "keep.txt").write_text("mine")
    r = predict("--output", str(theirs), "--overwrite")
    assert r.returncode != 0 and "refusing to --overwrite" in r.stderr and "Traceback" not in r.stderr
    assert (theirs / "keep.txt").read_text() == "mine"
    r = predict("--output", str(tmp_path / "x"), "--text-field", "nope")
    assert r.returncode != 0 and "has no column 'nope'" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "x").exists() and not list(tmp_path.glob(".x.sparklm-tmp-*"))
