"""Text regression (issue 51): a task added as one module (sparklm/tasks/regress.py) and a registry line, through
every seam: prepare (a float label column), train under ddp/average/diloco and LoRA, the report and its scatter plot,
predict on files and on a DataFrame, ONNX export, and the mistakes a user makes."""

from __future__ import annotations

import csv
import json
import math
import random
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pyarrow.parquet as pq
import pytest

from conftest import labelled_records, run_sparklm, tiny_bert, toy_corpus
from sparklm.infra.errors import SparklmError

pytestmark = pytest.mark.xdist_group("classify")  # the tiny BERT and its dataset, built once per process

SETTINGS = {"train.lr": 3e-3, "train.batch_size": 16, "train.warmup_steps": 5, "train.dtype": "float32",
            "train.threads": 1, "train.log_every": 20, "train.eval_batches": 0}


def scored(n: int, seed: int) -> list[dict]:
    """Records whose target is a number the text tells: 3.0 for the toy records' "pos" class, -1.0 for "neg", with a
    little noise (so R² is high but below 1)."""
    rng = random.Random(seed)
    return [{"text": r["text"], "y": (3.0 if r["label"] == "pos" else -1.0) + rng.gauss(0, 0.2)}
            for r in labelled_records(n, seed=seed)]


def _prepare(spark, inputs, output, tokenizer, **data):
    from sparklm.config import from_dict
    from sparklm.launch.prepare import prepare

    cfg = from_dict({"data": {"task": "regress", "seq_len": 32, "val_fraction": 0.2, "label_field": "y", **data},
                     "tokenizer": {"path": tokenizer}, "output": {"row_group_mb": 1}})
    return prepare(inputs, output=str(output), config=cfg, spark=spark)


@pytest.fixture(scope="module")
def toy(spark, tmp_path_factory):
    root = tmp_path_factory.mktemp("regress")
    bert = tiny_bert(root / "bert", corpus=toy_corpus())
    records = scored(300, seed=0)
    broken = [{"text": "no value"}, {"text": "a word", "y": "many"}, {"text": "inf", "y": float("inf")},
              {"text": "", "y": 1.0}]
    path = root / "toy.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records + broken).replace("Infinity", '"inf"'))
    data = _prepare(spark, [str(path)], root / "data", bert)
    return SimpleNamespace(root=root, bert=bert, data=data.uri, manifest=data.manifest, records=records)


def _fit(data, out, **settings):
    import sparklm

    return sparklm.fit(data=data, output=str(out), settings={**SETTINGS, "model.task": "regress", **settings}).summary


def test_a_float_label_column_becomes_a_hash_split_dataset_of_targets(spark, toy):
    m = toy.manifest
    assert m["task"] == "regress" and m["input"]["dropped"] == {"empty": 1, "no_label": 3}
    values = m["labels"]["values"]
    assert values["train"]["rows"] + values["validation"]["rows"] == 300 and values["validation"]["rows"] > 30
    ys = [r["y"] for r in toy.records]
    assert min(ys) == pytest.approx(min(values["train"]["min"], values["validation"]["min"]), abs=1e-5)
    assert m["columns"]["labels"].startswith("float32")
    rows = pq.read_table(sorted(Path(toy.data, "validation").glob("*.parquet"))).to_pylist()
    got = sorted(r["labels"] for r in rows)
    assert np.mean(got) == pytest.approx(values["validation"]["mean"], abs=1e-4)
    # the same records as CSV (numbers as text): the same rows
    path = toy.root / "toy.csv"
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, ["y", "text"])
        w.writeheader()
        w.writerows(reversed(toy.records))
    again = _prepare(spark, [str(path)], toy.root / "again", toy.bert)
    other = pq.read_table(sorted(Path(again.uri, "validation").glob("*.parquet"))).to_pylist()
    assert sorted(r["labels"] for r in other) == pytest.approx(got)


@pytest.mark.parametrize("strategy,workers,extra", [
    ("ddp", 2, {}),
    ("average", 2, {"train.rounds.sync_every": 20}),
    ("diloco", 2, {"train.rounds.sync_every": 20}),
    ("ddp", 1, {"lora.r": 8, "train.lr": 3e-3, "train.max_steps": 500, "train.eval_every": 100}),
], ids=["ddp", "average", "diloco", "lora"])
def test_a_regressor_learns_with_each_strategy(spark, toy, tmp_path, strategy, workers, extra):
    s = _fit(toy.data, tmp_path / "run", **{"model.init_from": toy.bert, "train.strategy": strategy,
                                           "train.workers": workers, "train.max_steps": 120, "train.eval_every": 60,
                                           **extra})
    best = s["best"]
    assert s["task"] == "regress" and best["val_examples"] == toy.manifest["labels"]["values"]["validation"]["rows"]
    # LoRA adapts a random 2-layer model through rank-8 updates: it learns more slowly and its R² varies with the seed
    # and the machine's float rounding (at 300 steps 0.14 on CI, 0.44-0.98 here; at 500 steps 0.73-0.91 over four
    # seeds here). With a trained WordPiece vocabulary it also varied from run to run on one machine (best 0.08 once in
    # seven runs): the fixture's vocabulary is now learnt the same way on every run, and its best is 0.95 here. Full
    # fine-tuning reaches 0.97 in 120 steps
    bar = 0.3 if "lora.r" in extra else 0.6
    assert best["val_r2"] >= bar and best["val_rmse"] == pytest.approx(math.sqrt(best["val_loss"])), best
    assert best["val_mae"] <= best["val_rmse"]
    run = tmp_path / "run"
    config = json.loads((run / "model" / "config.json").read_text())
    assert config["problem_type"] == "regression" and len(config["id2label"]) == 1
    assert not (run / "model" / "adapter_config.json").exists()  # LoRA exports merged weights
    assert (run / "scatter.png").stat().st_size > 5000
    page = (run / "report.html").read_text()
    assert "Predictions (model/, validation split)" in page and "scatter.png" in page and "No samples.txt" not in page


def test_predict_and_the_pipeline_read_the_regressor_and_export_runs_it_in_onnx(spark, toy, tmp_path):
    import onnxruntime as ort
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer, pipeline

    import sparklm
    from sparklm.infer.export import export
    from sparklm.infer.predict import predict

    _fit(toy.data, tmp_path / "run", **{"model.init_from": toy.bert, "train.max_steps": 60})
    model = str(tmp_path / "run" / "model")
    gold = scored(40, seed=7)
    path = tmp_path / "gold.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in gold))
    info = predict(spark, model, [str(path)], str(tmp_path / "out"), label_field="y")
    assert info["task"] == "regression" and info["scored_against"]["rows"] == 40
    assert 0 <= info["scored_against"]["mae"] <= info["scored_against"]["rmse"] < 2.0
    got = {r["text"]: r for r in pq.read_table(str(tmp_path / "out")).to_pylist()}
    assert all(r["label"] is None for r in got.values())
    # transformers' pipeline reads the head as a regression too: the same values
    reg = pipeline("text-classification", model=model, device="cpu", function_to_apply="none")
    texts = [r["text"] for r in gold]
    for text, want in zip(texts, reg(texts, truncation=True)):
        assert got[text]["score"] == pytest.approx(want["score"], abs=1e-4)
    # on a DataFrame: the input's columns kept, a score per text
    df = spark.createDataFrame([(t, i) for i, t in enumerate(texts)], "text string, i int")
    rows = sparklm.classify_dataframe(df, model=model).orderBy("i").collect()
    assert [r["score"] for r in rows] == pytest.approx([got[t]["score"] for t in texts], abs=1e-5)
    # ONNX: the graph's one output per text is torch's
    out = tmp_path / "onnx"
    export(model, str(out))
    tok = AutoTokenizer.from_pretrained(model)
    batch = tok(texts[:5], padding=True, truncation=True, max_length=32, return_tensors="pt")
    feed = {"input_ids": batch["input_ids"].numpy(), "attention_mask": batch["attention_mask"].numpy()}
    onnx = ort.InferenceSession(str(out / "model.onnx"), providers=["CPUExecutionProvider"]).run(None, feed)[0]
    with torch.no_grad():
        want = AutoModelForSequenceClassification.from_pretrained(model).eval()(**batch).logits.numpy()
    assert onnx.shape == (5, 1) and np.abs(onnx - want).max() < 1e-4


def test_regression_mistakes_are_one_line(spark, toy, tmp_path):
    path = tmp_path / "words.csv"
    path.write_text("text,y\nhello there,lots\nbye now,few\n")
    r = run_sparklm("prepare", str(path), "-o", str(tmp_path / "out"), "--task", "regress", "--tokenizer", toy.bert,
                    "--label-field", "y")
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert r.returncode == 2 and len(errors) == 1 and "(2 no_label)" in errors[0], r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "out").exists()
    with pytest.raises(SparklmError, match="--task regress trains a pretrained model"):
        _fit(toy.data, tmp_path / "nobase")
    with pytest.raises(SparklmError, match="prepared for --task regress, and this run trains --task classify"):
        _fit(toy.data, tmp_path / "wrong", **{"model.task": "classify", "model.init_from": toy.bert})
