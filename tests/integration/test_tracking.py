"""Experiment trackers against real ones: an `mlflow server` on 127.0.0.1 (and MLflow's local store), W&B
offline (its run file read back with W&B's own protobuf records), one tracker run per command."""

from __future__ import annotations

import glob
import json
import os
import struct
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

import sparklm
from conftest import cfg, free_port, harness_toy, make_text, run_sparklm
from sparklm.config import TrackingConfig, flatten
from sparklm.infra.errors import SparklmError
from sparklm.launch.train import train
from sparklm.metrics.sinks import read_metrics


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("mlflow")
    port = free_port()
    mlflow = Path(sys.executable).parent / "mlflow"
    proc = subprocess.Popen([str(mlflow), "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
                             "--backend-store-uri", f"sqlite:///{root}/mlflow.db",
                             "--artifacts-destination", str(root / "artifacts")],
                            stdout=subprocess.DEVNULL, stderr=open(root / "server.log", "wb"), start_new_session=True)
    uri = f"http://127.0.0.1:{port}"
    deadline = time.time() + 90
    while True:
        try:
            urllib.request.urlopen(f"{uri}/health", timeout=2)
            break
        except OSError:
            if time.time() > deadline or proc.poll() is not None:
                proc.kill()
                pytest.fail(f"mlflow server did not start: {(root / 'server.log').read_text()[-2000:]}")
            time.sleep(0.5)
    yield uri
    os.killpg(proc.pid, 15)
    proc.wait(timeout=30)


def _tracking(**kw) -> TrackingConfig:
    return TrackingConfig(**kw)


def test_one_mlflow_run_per_command_with_params_metrics_files_and_a_model_spark_scores(
        spark, dataset, tmp_path, mlflow_server):
    import mlflow
    from mlflow import MlflowClient

    run_dir, toy = tmp_path / "run", harness_toy(tmp_path / "toy")
    tasks = [str(toy / "tasks" / "mc.yaml"), str(toy / "tasks" / "roll.yaml")]  # scored when the run ends
    config = cfg(max_steps=12, workers=2, eval_every=6, checkpoint_every=6, eval_tasks=tasks, eval_tasks_limit=4.0
                 ).replace(tracking=_tracking(mlflow_uri=mlflow_server, mlflow_experiment="tiny",
                                              mlflow_register="sparklm-tiny"))
    summary = train(dataset, output=str(run_dir), config=config, spark=spark)
    client = MlflowClient(tracking_uri=mlflow_server)
    exp = client.get_experiment_by_name("tiny")
    runs = client.search_runs([exp.experiment_id])
    assert len(runs) == 1  # two DDP ranks, one MLflow run
    run = runs[0]
    assert run.info.status == "FINISHED" and run.info.run_name == "run"
    saved = json.loads((run_dir / "config.json").read_text())["config"]
    assert {k: run.data.params.get(k) for k in flatten(saved)} == {k: str(v) for k, v in flatten(saved).items()}
    rows = read_metrics(run_dir / "metrics.csv")
    train_rows = [r for r in rows if r["kind"] == "train"]
    history = client.get_metric_history(run.info.run_id, "train/loss")
    assert [m.step for m in history] == [r["step"] for r in train_rows]  # each step once
    assert [m.value for m in history] == pytest.approx([r["loss"] for r in train_rows], rel=1e-5)
    evals = client.get_metric_history(run.info.run_id, "eval/val_loss")
    assert [m.step for m in evals] == [r["step"] for r in rows if r["kind"] == "eval"]
    for system in ("train/tokens_per_s", "train/mfu", "train/rss_mb"):
        assert client.get_metric_history(run.info.run_id, system), system
    assert run.data.metrics["summary/final/val_bpb"] == pytest.approx(summary["final"]["val_bpb"])
    files = {f.path for f in client.list_artifacts(run.info.run_id)}
    assert {"summary.json", "metrics.csv", "config.json", "loss.png", "samples.txt", "report.html",
            "eval_tasks.json", "eval_tasks.csv"} <= files
    # train.eval_tasks: the exported model's benchmark figures in the summary, a row each, the report and MLflow
    scored = json.loads((run_dir / "eval_tasks.json").read_text())
    assert scored["n-samples"]["toy_mc"]["effective"] == 4 and scored["n-shot"]["toy_mc"] == 2
    assert summary["tasks"]["toy_mc/acc"] == scored["results"]["toy_mc"]["acc,none"]
    assert run.data.metrics["summary/tasks/toy_roll/bits_per_byte"] == pytest.approx(
        scored["results"]["toy_roll"]["bits_per_byte,none"])
    table = (run_dir / "eval_tasks.csv").read_text().splitlines()
    assert table[0] == "step,tokens,task,metric,filter,value,stderr" and len(table) == 1 + 5
    assert all(line.startswith(f"12,{summary['tokens']},") for line in table[1:])
    assert "<h2>Benchmark tasks</h2>" in (run_dir / "report.html").read_text()
    # `sparklm eval --tasks` on the run directory: one MLflow run of its own with the figures and files
    sparklm.evaluate(str(run_dir), tasks=tasks[:1], limit=4, output=str(tmp_path / "bench"), spark=spark,
                     settings={"tracking.mlflow_uri": mlflow_server, "tracking.mlflow_experiment": "bench"})
    (bench,) = client.search_runs([client.get_experiment_by_name("bench").experiment_id])
    assert bench.data.tags["sparklm.command"] == "eval" and bench.data.params["eval.limit"] == "4"
    assert bench.data.metrics["summary/toy_mc/acc"] == summary["tasks"]["toy_mc/acc"]
    assert {"results.json", "report.html"} <= {f.path for f in client.list_artifacts(bench.info.run_id)}

    # the logged model: registered, and a Spark UDF with it continues 3 prompts
    (version,) = client.search_model_versions("name = 'sparklm-tiny'")
    assert version.run_id == run.info.run_id
    mlflow.set_tracking_uri(mlflow_server)
    udf = mlflow.pyfunc.spark_udf(spark, "models:/sparklm-tiny/1", result_type="string", env_manager="local")
    out = spark.createDataFrame([("To be",), ("Москва",), ("The",)], ["prompt"]).withColumn("text", udf("prompt"))
    texts = [r.text for r in out.collect()]
    assert len(texts) == 3 and all(isinstance(t, str) and t for t in texts)


def test_prepare_logs_its_manifest_to_mlflow_and_a_failed_run_is_marked_failed(spark, tmp_path, mlflow_server,
                                                                              monkeypatch):
    from mlflow import MlflowClient

    from sparklm import api

    settings = {"data.seq_len": 16, "tokenizer.vocab_size": 280, "tracking.mlflow_uri": mlflow_server,
                "tracking.mlflow_experiment": "prep"}
    (tmp_path / "a.txt").write_text(make_text(60, seed=3))
    with pytest.raises(SparklmError, match="no training documents"):  # all too short: the run is marked failed
        api.prepare(str(tmp_path / "a.txt"), output=str(tmp_path / "bad"), spark=spark,
                    settings={**settings, "data.min_chars": 100_000})
    ds = api.prepare(str(tmp_path / "a.txt"), output=str(tmp_path / "prep"), spark=spark,
                     settings=settings)
    client = MlflowClient(tracking_uri=mlflow_server)
    failed, run = client.search_runs([client.get_experiment_by_name("prep").experiment_id],
                                     order_by=["attributes.start_time ASC"])
    assert failed.info.status == "FAILED" and not (tmp_path / "bad").exists()
    assert run.data.tags["sparklm.command"] == "prepare" and run.info.status == "FINISHED"
    assert run.data.params["data.seq_len"] == "16"
    assert run.data.metrics["summary/splits/train_tokens"] == ds.manifest["splits"]["train"]["tokens"]
    assert "manifest.json" in {f.path for f in client.list_artifacts(run.info.run_id)}

    # MLflow's local store, no server: a SQLite file (MLflow 3's local default; its older directory store refuses new
    # runs now), its artifacts in ./mlruns
    monkeypatch.chdir(tmp_path)
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    api.prepare(str(tmp_path / "a.txt"), output=str(tmp_path / "prep2"), spark=spark,
                settings={"data.seq_len": 16, "tokenizer.vocab_size": 280, "tracking.mlflow_uri": store})
    local = MlflowClient(tracking_uri=store)
    (run,) = local.search_runs([local.get_experiment_by_name("sparklm").experiment_id])
    assert run.info.status == "FINISHED" and "manifest.json" in {f.path for f in local.list_artifacts(run.info.run_id)}


def test_mlflow_mistakes_are_one_line_before_anything_is_written(dataset, tmp_path):
    port = free_port()  # nothing listens there
    r = run_sparklm("train", "--data", dataset, "--output", str(tmp_path / "run"), "--max-steps", "2",
                    "--mlflow", f"http://127.0.0.1:{port}", timeout=300)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert "cannot open an MLflow run" in r.stderr, r.stderr[-2000:]
    assert not (tmp_path / "run" / "config.json").exists()
    r = run_sparklm("train", "--data", dataset, "--output", str(tmp_path / "run2"), "--max-steps", "2",
                    "--mlflow", "https://me:hunter2@mlflow.example.com")
    assert r.returncode != 0 and "holds a password" in r.stderr and "hunter2" not in r.stderr + r.stdout
    assert not (tmp_path / "run2").exists()


def wandb_records(run_dir: Path) -> list:
    """The records of an offline W&B run file. The file is a LevelDB-style log (32 KiB blocks of chunks, each with
    a 7-byte header: CRC, length, type) of W&B's protobuf ``Record`` messages, after a 7-byte file header."""
    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = glob.glob(str(run_dir / "wandb" / "offline-run-*" / "run-*.wandb"))
    data = Path(path).read_bytes()
    assert data[:4] == b":W&B"
    block, pos, chunk, out = 32768, 7, b"", []
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        pos += 7
        if kind == 0 and length == 0:
            pos += left - 7
            continue
        chunk += data[pos:pos + length]
        pos += length
        if kind in (1, 4):  # FULL, or LAST of FIRST/MIDDLE/LAST
            record = pb.Record()
            record.ParseFromString(chunk)
            out.append(record)
            chunk = b""
    return out


def test_wandb_offline_run_has_the_config_history_summary_and_artifacts(spark, dataset, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run_dir = tmp_path / "run"
    summary = train(dataset, output=str(run_dir), spark=spark,
                    config=cfg(max_steps=10, eval_every=5, strategy="diloco", workers=2, sync_every=5).replace(
                        tracking=_tracking(wandb_project="sparklm-test")))
    records = wandb_records(run_dir)
    kinds = [r.WhichOneof("record_type") for r in records]
    config = {}
    for r in records:
        kind = r.WhichOneof("record_type")
        if kind in ("run", "config"):
            config.update({i.key: json.loads(i.value_json) for i in (r.run.config if kind == "run" else r.config).update})
    saved = flatten(json.loads((run_dir / "config.json").read_text())["config"])
    assert config["train.strategy"] == "diloco" and config["train.lr"] == saved["train.lr"]
    history = [{i.nested_key[0] if i.nested_key else i.key: json.loads(i.value_json) for i in r.history.item}
               for r in records if r.WhichOneof("record_type") == "history"]
    rows = read_metrics(run_dir / "metrics.csv")
    assert [h["step"] for h in history if "train/loss" in h] == [r["step"] for r in rows if r["kind"] == "train"]
    assert [h["step"] for h in history if "eval/val_bpb" in h] == [r["step"] for r in rows if r["kind"] == "eval"]
    assert [h["round/returned_bytes"] for h in history if "round/returned_bytes" in h]  # rounds too
    final = {}
    for r in records:
        if r.WhichOneof("record_type") == "summary":
            final.update({(u.nested_key[0] if u.nested_key else u.key): json.loads(u.value_json) for u in r.summary.update})
    assert final["final/val_bpb"] == pytest.approx(summary["final"]["val_bpb"])
    artifacts = {r.artifact.type for r in records if r.WhichOneof("record_type") == "artifact"}
    assert {"model", "sparklm-train"} <= artifacts, kinds


def _train_row(step: int, loss: float):
    from sparklm.metrics import rows

    return rows.Train(step=step, epoch=0.0, tokens=step * 10, loss=loss, lr=1e-3, grad_norm=1.0, tokens_per_s=1.0,
                      ms_per_step=1.0, mfu=0.0, rss_mb=1.0, peak_rss_mb=1.0, rank_peak_rss_mb="1", elapsed=1.0)


def test_a_restart_leaves_one_clean_history_in_mlflow_and_wandb(tmp_path, mlflow_server, monkeypatch):
    """A DDP restart rewinds to its checkpoint (step 4) and sends steps 5-6 again: each tracker shows every step
    once, with the second attempt's values, though neither can delete a logged value."""
    from mlflow import MlflowClient

    from sparklm.config import Config, StorageConfig
    from sparklm.metrics import trackers

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    config = Config().replace(tracking=_tracking(mlflow_uri=mlflow_server, mlflow_experiment="rewind",
                                                 wandb_project="rewind"))
    ctx = trackers.Context(command="train", run_dir=str(tmp_path / "run"), storage=StorageConfig(),
                           params={"train.lr": 0.001})
    opened = trackers.open_trackers(config, ctx)
    for t in opened:
        for step in range(1, 7):
            t.write(_train_row(step, 10.0 - step))  # the first attempt
            if step == 4:
                t.flush()  # before the checkpoint of step 4
        t.rewind(4)
        for step in range(5, 9):
            t.write(_train_row(step, 100.0 - step))  # the second attempt
        t.flush()
        t.close()
    trackers.finish_all(opened, trackers.Outcome(ok=True, summary={"steps": 8}))
    want = [(s, 10.0 - s) for s in range(1, 5)] + [(s, 100.0 - s) for s in range(5, 9)]
    client = MlflowClient(tracking_uri=mlflow_server)
    (run,) = client.search_runs([client.get_experiment_by_name("rewind").experiment_id])
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "train/loss")] == want
    history = [{i.nested_key[0] if i.nested_key else i.key: json.loads(i.value_json) for i in r.history.item}
               for r in wandb_records(tmp_path / "run") if r.WhichOneof("record_type") == "history"]
    assert [(h["step"], h["train/loss"]) for h in history] == want


def test_a_regressor_is_tracked_through_the_task_seam(spark, tmp_path, mlflow_server):
    """A task added as one module (text regression) reaches MLflow as every task does: its figures, its picture
    (scatter.png) and its model as the pipeline the task names, which pyfunc scores."""
    import mlflow
    from mlflow import MlflowClient

    import sparklm
    from conftest import labelled_records, tiny_bert, toy_corpus

    bert = tiny_bert(tmp_path / "bert", corpus=toy_corpus())
    records = [{"text": r["text"], "y": 2.0 if r["label"] == "pos" else 0.0} for r in labelled_records(200, seed=3)]
    path = tmp_path / "toy.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    data = sparklm.prepare([str(path)], output=str(tmp_path / "data"), spark=spark,
                           settings={"data.task": "regress", "data.label_field": "y", "data.seq_len": 32,
                                     "tokenizer.path": bert})
    sparklm.fit(data=data, output=str(tmp_path / "run"), spark=spark,
                settings={"model.task": "regress", "model.init_from": bert, "train.max_steps": 20,
                          "train.batch_size": 8, "train.dtype": "float32", "train.threads": 1,
                          "tracking.mlflow_uri": mlflow_server, "tracking.mlflow_experiment": "regress",
                          "tracking.mlflow_register": "sparklm-regress"})
    client = MlflowClient(tracking_uri=mlflow_server)
    (run,) = client.search_runs([client.get_experiment_by_name("regress").experiment_id])
    assert run.info.status == "FINISHED" and client.get_metric_history(run.info.run_id, "eval/val_rmse")
    assert "scatter.png" in {f.path for f in client.list_artifacts(run.info.run_id)}
    mlflow.set_tracking_uri(mlflow_server)
    model = mlflow.pyfunc.load_model("models:/sparklm-regress/1")
    out = model.predict(["good good fine", "bad awful"])
    assert len(out) == 2 and all(isinstance(float(s), float) for s in out["score"])


def test_a_search_is_one_mlflow_run_with_a_child_run_per_trial(spark, dataset, tmp_path, mlflow_server):
    """`sparklm tune` (issue 82): the study's run holds its settings, best figure and report; each trial's run is its
    child (MLflow's parentRunId), with the trial's own settings."""
    from mlflow import MlflowClient

    from sparklm.launch.tune import tune

    config = cfg(max_steps=2).replace(tracking=_tracking(mlflow_uri=mlflow_server, mlflow_experiment="search",
                                                         log_model=False))
    s = tune(dataset, output=str(tmp_path / "search"), space=["train.lr=choice(0.001,0.003)"], trials=2,
             sampler="grid", config=config, spark=spark)
    client = MlflowClient(tracking_uri=mlflow_server)
    exp = client.get_experiment_by_name("search")
    runs = client.search_runs([exp.experiment_id])
    (parent,) = [r for r in runs if r.data.tags.get("sparklm.command") == "tune"]
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert sorted(float(r.data.params["train.lr"]) for r in children) == [0.001, 0.003]
    assert parent.data.params["search.space.train.lr"] == "train.lr=choice(0.001,0.003)"
    assert parent.data.metrics["summary/best/val_bpb"] == pytest.approx(s["best"]["value"])
    assert parent.data.metrics["summary/trials/complete"] == 2
    assert parent.info.status == "FINISHED"
    assert {a.path for a in client.list_artifacts(parent.info.run_id)} >= {"best.json", "report.html"}


def test_a_searchs_trials_join_its_wandb_group(spark, dataset, tmp_path, monkeypatch):
    from sparklm.launch.tune import tune

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = tmp_path / "search"
    tune(dataset, output=str(out), space=["train.lr=choice(0.003)"], trials=1, spark=spark,
         config=cfg(max_steps=2).replace(tracking=_tracking(wandb_project="sparklm-test", log_model=False)))
    study = [r.run for r in wandb_records(out) if r.WhichOneof("record_type") == "run"]
    trial = [r.run for r in wandb_records(out / "trials" / "trial-0000") if r.WhichOneof("record_type") == "run"]
    assert study[0].run_group == "search" and trial[0].run_group == "search", (study[0].run_group, trial[0].run_group)
    assert study[0].job_type == "tune" and trial[0].job_type == "train"
