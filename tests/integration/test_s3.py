"""Input read from and output written to a real S3 endpoint (moto server on 127.0.0.1)."""

import boto3
import pyarrow.parquet as pq
import pytest

from conftest import make_text
from sparklm.data.manifest import load_prepared
from sparklm.data.prepare import prepare
from sparklm.errors import SparklmError
from sparklm.fs import resolve


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


def test_unreachable_or_missing_object_store_is_one_line(spark, s3_server, config, monkeypatch):
    with pytest.raises(SparklmError, match="input not found: s3://corpus/nothing-here"):
        prepare(["s3://corpus/nothing-here"], output="s3://corpus/x", config=config, spark=spark)
    from sparklm.config import StorageConfig

    dead = StorageConfig(endpoint_url="http://127.0.0.1:9")  # nothing listens on the discard port
    with pytest.raises(SparklmError, match="cannot list s3://corpus/books"):
        from sparklm.fs import expand

        expand("s3://corpus/books", dead)
