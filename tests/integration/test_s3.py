"""Input read from and output written to a real S3 endpoint (moto server on 127.0.0.1)."""

import boto3
import pyarrow.parquet as pq
import pytest

from conftest import make_text
from sparklm.data.manifest import load_prepared
from sparklm.infra.errors import SparklmError
from sparklm.infra.fs import exists, list_names, resolve, staged_dir
from sparklm.launch.prepare import prepare
from sparklm.metrics.rows import Train
from sparklm.metrics.sinks import TRAIN_COLUMNS, CsvSink, read_metrics


def test_prepare_from_and_to_s3(spark, s3_server, config):
    s3 = boto3.client("s3", endpoint_url=s3_server)
    s3.create_bucket(Bucket="corpus")
    s3.put_object(Bucket="corpus", Key="books/a.txt", Body=make_text(50, seed=5).encode())
    s3.put_object(Bucket="corpus", Key="books/b.jsonl", Body=b'{"text": "from jsonl on s3"}\n')
    ds = prepare(["s3://corpus/books/"], output="s3://corpus/prepared/v1", config=config, spark=spark)
    assert ds.manifest["input"]["files"] == 2
    assert ds.manifest["splits"]["train"]["documents"] + ds.manifest["splits"]["validation"]["documents"] == 51
    keys = {o["Key"] for o in s3.list_objects_v2(Bucket="corpus", Prefix="prepared/v1/")["Contents"]}
    assert "prepared/v1/manifest.json" in keys and "prepared/v1/tokenizer.json" in keys
    assert not any(".sparklm-tmp" in k for k in s3.list_objects_v2(Bucket="corpus")["Contents"][0]["Key"])
    again = load_prepared("s3://corpus/prepared/v1")
    fs, path = resolve(again.files("train")[0])
    assert pq.read_table(path, filesystem=fs).num_rows > 0
    # overwrite on S3 replaces the dataset and still ends with a manifest
    prepare(["s3://corpus/books/a.txt"], output="s3://corpus/prepared/v1", config=config, spark=spark, overwrite=True)
    assert load_prepared("s3://corpus/prepared/v1").manifest["input"]["files"] == 1

    # a Delta table on S3: its current version only, through deltalake with sparklm's endpoint
    import pyarrow as pa
    from deltalake import write_deltalake

    from sparklm.config import StorageConfig
    from sparklm.data.delta_lake import storage_options

    options = storage_options("s3://corpus/delta", StorageConfig(endpoint_url=s3_server))
    write_deltalake("s3://corpus/delta", pa.table({"text": ["an old document"] * 3}), storage_options=options)
    current = make_text(30, seed=8).split("\n\n")
    write_deltalake("s3://corpus/delta", pa.table({"text": current}), mode="overwrite", storage_options=options)
    ds = prepare(["s3://corpus/delta"], output="s3://corpus/prepared/delta", config=config, spark=spark)
    splits = ds.manifest["splits"]
    assert splits["train"]["documents"] + splits["validation"]["documents"] == len(set(current))


def test_prompts_are_read_from_s3(s3_server):
    """`generate --input s3://...` said "prompt file s3://... not found": prompts were read as local files only."""
    from sparklm.infer.batch import read_prompts

    s3 = boto3.client("s3", endpoint_url=s3_server)
    s3.create_bucket(Bucket="prompts")
    s3.put_object(Bucket="prompts", Key="p.jsonl", Body=b'{"id": 7, "prompt": "Once upon a time"}\n')
    assert read_prompts("s3://prompts/p.jsonl") == [(7, "Once upon a time")]
    with pytest.raises(SparklmError, match="prompt file s3://prompts/missing.txt not found"):
        read_prompts("s3://prompts/missing.txt")


def test_unreachable_or_missing_object_store_is_one_line(spark, s3_server, config, monkeypatch):
    import boto3

    with pytest.raises(SparklmError, match="bucket nobucket-here not found"):  # the output's, at its lock
        prepare(["s3://corpus/a.txt"], output="s3://nobucket-here/x", config=config, spark=spark)
    s3 = boto3.client("s3", endpoint_url=s3_server)
    if "corpus" not in [b["Name"] for b in s3.list_buckets()["Buckets"]]:
        s3.create_bucket(Bucket="corpus")
    with pytest.raises(SparklmError, match="input not found: s3://corpus/nothing-here"):
        prepare(["s3://corpus/nothing-here"], output="s3://corpus/x", config=config, spark=spark)
    from sparklm.config import StorageConfig

    dead = StorageConfig(endpoint_url="http://127.0.0.1:9")  # nothing listens on the discard port
    with pytest.raises(SparklmError, match="cannot list s3://corpus/books"):
        from sparklm.infra.fs import expand

        expand("s3://corpus/books", dead)


@pytest.mark.slow
def test_run_directory_on_s3(spark, dataset, s3_server, tmp_path):
    """A run written to S3 by the rounds strategy; a stopped run resumed there; models read from there."""
    import pyarrow.fs as pafs
    import torch
    from safetensors.torch import load as load_tensors

    from conftest import cfg, stopped_copy, weights
    from sparklm.config import StorageConfig
    from sparklm.infer.batch import generate_dataframe
    from sparklm.infer.evaluate import evaluate
    from sparklm.infer.export import export
    from sparklm.infer.generate import generate, load
    from sparklm.infer.sampling import Sampling
    from sparklm.launch.train import train

    s3 = boto3.client("s3", endpoint_url=s3_server)
    s3.create_bucket(Bucket="runs")
    from sparklm.config import TrackingConfig

    train(dataset, output="s3://runs/avg", config=cfg(max_steps=4, strategy="average", workers=2, sync_every=2,
                                                      checkpoint_every=2).replace(
        tracking=TrackingConfig(tensorboard=True)), spark=spark)
    keys = {o["Key"][4:] for o in s3.list_objects_v2(Bucket="runs", Prefix="avg/")["Contents"]}
    assert any(k.startswith("tensorboard/events.out.tfevents.") for k in keys), keys  # uploaded from a local dir
    assert {"config.json", "metrics.csv", "rounds.csv", "summary.json", "loss.png", "report.html", "samples.txt", "run_info.json",
            "model/model.safetensors", "model/tokenizer.json", "checkpoints/step-0000004/state.json"} <= keys, keys
    assert not any(k.startswith(".inner") for k in keys)  # the rounds' shared inner state is gone at the end

    # a run stopped after its step-4 checkpoint, on S3, resumes there to the same weights as the whole run
    full = tmp_path / "full"
    train(dataset, output=str(full), config=cfg(max_steps=8, checkpoint_every=4, samples=0), spark=spark)
    stopped = tmp_path / "stopped"
    stopped_copy(full, stopped, after=4, last=8)
    fs, _ = resolve("s3://runs/")
    pafs.copy_files(str(stopped), "runs/stopped", destination_filesystem=fs)
    train(None, output="s3://runs/stopped", resume=True, spark=spark)
    resumed = load_tensors(s3.get_object(Bucket="runs", Key="stopped/checkpoints/step-0000008/model.safetensors")
                           ["Body"].read())
    for name, tensor in weights(full).items():
        assert torch.equal(tensor, resumed[name]), name
    on_s3 = read_metrics("s3://runs/stopped/metrics.csv", StorageConfig(endpoint_url=s3_server))
    assert [(r["kind"], r["step"], r["loss"]) for r in on_s3] == \
           [(r["kind"], r["step"], r["loss"]) for r in read_metrics(str(full / "metrics.csv"))]  # rewound on S3 too

    # generate, batch generation, eval and export read the model from S3 as from a local run directory
    storage = StorageConfig(endpoint_url=s3_server)
    greedy = Sampling(temperature=0, max_new_tokens=6)
    here, there = load(str(full)), load("s3://runs/stopped", storage=storage)
    assert [g.text for g in generate(here, ["The"], sampling=greedy)] == \
           [g.text for g in generate(there, ["The"], sampling=greedy)]
    df = spark.createDataFrame([(1, "The"), (2, "Москва")], "id long, prompt string")
    texts = sorted((r.id, r.generated) for r in generate_dataframe(df, model="s3://runs/stopped", sampling=greedy,
                                                               storage=storage).collect())
    assert texts == sorted((i, generate(here, [p], sampling=greedy)[0].text) for i, p in [(1, "The"), (2, "Москва")])
    (tmp_path / "t.txt").write_text(make_text(5, seed=2))
    a = evaluate(str(full), [str(tmp_path / "t.txt")], spark=spark)
    b = evaluate("s3://runs/stopped", [str(tmp_path / "t.txt")], spark=spark)
    assert a["loss"] == pytest.approx(b["loss"], abs=1e-6) and a["tokens"] == b["tokens"]
    info = export("s3://runs/stopped", str(tmp_path / "onnx"), storage=storage)
    assert (tmp_path / "onnx" / "model.onnx").is_file(), info


# -- fs and sinks on an object store (moved from the unit tests: they need the S3 server) ----------------------


def test_a_run_directory_on_s3_has_one_writer(s3_server):
    """The lock on S3 is a conditional PUT: a second writer is refused naming the first, a dead one's lock (its lease
    run out) is taken over, and the lock is gone at the end."""
    import json
    import time

    from sparklm.config import StorageConfig
    from sparklm.infra.runlock import LOCK, RunLock

    s3 = boto3.client("s3", endpoint_url=s3_server)
    s3.create_bucket(Bucket="locked")
    storage = StorageConfig(endpoint_url=s3_server)
    with RunLock("s3://locked/run", storage) as holder:
        with pytest.raises(SparklmError, match=rf"s3://locked/run is in use by another sparklm run \(host .*pid "
                                               rf"{holder.me['pid']}"):
            RunLock("s3://locked/run", storage).acquire()
    assert "Contents" not in s3.list_objects_v2(Bucket="locked")
    dead = {"host": "elsewhere", "pid": 1, "token": "t", "started": "then", "heartbeat": time.time() - 600}
    s3.put_object(Bucket="locked", Key=f"run/{LOCK}", Body=json.dumps(dead).encode())
    time.sleep(3.1)  # a holder's age is read on the store's clock (LastModified, 1 s resolution), not from the file
    with RunLock("s3://locked/run", storage, lease=2) as taker:
        got = json.loads(s3.get_object(Bucket="locked", Key=f"run/{LOCK}")["Body"].read())
        assert got["token"] == taker.me["token"]


def test_staged_dir_on_an_object_store_writes_its_marker_last(s3_server):
    import boto3

    from sparklm.config import StorageConfig

    boto3.client("s3", endpoint_url=s3_server).create_bucket(Bucket="runs")
    storage = StorageConfig(endpoint_url=s3_server)
    with staged_dir("s3://runs/ckpt", storage, marker="state.json") as d:
        (d / "state.json").write_text("{}")
        (d / "model.safetensors").write_bytes(b"x")
    assert list_names("s3://runs/ckpt", storage) == ["model.safetensors", "state.json"]
    assert exists("s3://runs/ckpt/state.json", storage)


def test_stale_staging_is_removed_on_an_object_store_too(s3_server):
    import time

    import boto3

    from sparklm.config import StorageConfig
    from sparklm.infra.fs import remove_stale

    s3 = boto3.client("s3", endpoint_url=s3_server)
    s3.create_bucket(Bucket="stale")
    for key in (".out.sparklm-tmp-0123/train/part-0.parquet", ".other.sparklm-tmp-9/x", "out/manifest.json"):
        s3.put_object(Bucket="stale", Key=key, Body=b"x")
    storage = StorageConfig(endpoint_url=s3_server)
    assert remove_stale("s3://stale/out", storage, before=time.time()) == [".out.sparklm-tmp-0123"]
    assert list_names("s3://stale", storage) == [".other.sparklm-tmp-9", "out"]


def test_csv_sink_on_an_object_store_continues_and_rewinds(s3_server):
    import boto3

    from sparklm.config import StorageConfig

    boto3.client("s3", endpoint_url=s3_server).create_bucket(Bucket="metrics")
    storage = StorageConfig(endpoint_url=s3_server)
    uri = "s3://metrics/run/metrics.csv"
    sink = CsvSink(uri, TRAIN_COLUMNS, {"train"}, storage)
    for step in (1, 2, 3):
        sink.write(_train(step, 1.0 / step))
    sink.close()
    again = CsvSink(uri, TRAIN_COLUMNS, {"train"}, storage)  # a resumed run continues the file
    again.write(_train(4, 0.25))
    again.rewind(2)
    again.write(_train(3, 0.3))
    again.close()
    assert [(r["step"], r["loss"]) for r in read_metrics(uri, storage)] == [(1, 1.0), (2, 0.5), (3, 0.3)]


def _train(step: int, loss: float) -> Train:
    return Train(step=step, epoch=0.0, tokens=step, loss=loss, lr=0.0, grad_norm=0.0, tokens_per_s=0.0, ms_per_step=0.0,
                 mfu=0.0, rss_mb=0.0, peak_rss_mb=0.0, rank_peak_rss_mb="", elapsed=0.0)


def test_sparse_diloco_on_s3_keeps_its_residuals_there(spark, dataset, s3_server):
    """Hosts that share nothing: a worker's inner state and error-feedback residual go to the run directory's
    shared .inner/ on S3 between rounds and into the checkpoint, and are gone at the end."""
    import boto3
    from safetensors.numpy import load

    from conftest import cfg
    from sparklm.launch.train import train

    s3 = boto3.client("s3", endpoint_url=s3_server)
    s3.create_bucket(Bucket="sparse")
    s = train(dataset, output="s3://sparse/run", spark=spark,
              config=cfg(max_steps=4, strategy="diloco", workers=2, sync_every=2, checkpoint_every=2, samples=0,
                         codec="topk", density=0.05, outer_momentum=0.0, outer_lr=1.0))
    keys = {o["Key"][4:] for o in s3.list_objects_v2(Bucket="sparse", Prefix="run/")["Contents"]}
    assert not any(k.startswith(".inner") for k in keys)
    inner = s3.get_object(Bucket="sparse", Key="run/checkpoints/step-0000002/inner/w1.safetensors")["Body"].read()
    assert any(k.startswith("residual/") for k in load(inner))
    assert s["bytes_returned"] < s["rounds"] * 2 * 4 * s["trainable_params"] / 8
