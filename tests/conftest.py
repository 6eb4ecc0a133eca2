"""Shared fixtures: one real local Spark session per test run, corpora made on the fly, a moto S3 server."""

from __future__ import annotations

import os
import socket

import pytest

from sparklm.config import Config, SparkConfig

# A few scripts and shapes the product must handle, not just the shared English corpora.
MULTILINGUAL = [
    "The quick brown fox jumps over the lazy dog.\nIt was the best of times.",
    "Le cœur a ses raisons que la raison ne connaît point.",
    "Ünïcödé: e\u0301 (combining) becomes é after NFC.",
    "東京は日本の首都です。吾輩は猫である。名前はまだ無い。",
    "Москва — столица России.\nВ начале было Слово.",
    "مرحبا بالعالم. هذه جملة عربية.",
    "नमस्ते दुनिया। यह हिंदी में एक वाक्य है।",
    "Emoji 🚀✨ and symbols ∑ ∫ ≠ and tabs\tinside.",
    "Ελληνικά: Γνῶθι σεαυτόν.",
    "한국어 문장입니다. 감사합니다.",
]


def make_text(n_paragraphs: int = 40, seed: int = 0) -> str:
    """Paragraphs of mixed scripts separated by blank lines; each paragraph distinct."""
    import random

    rng = random.Random(seed)
    paras = []
    for i in range(n_paragraphs):
        words = " ".join(" ".join(rng.choice(MULTILINGUAL).split()[: rng.randint(3, 12)])
                         for _ in range(rng.randint(1, 3)))
        paras.append(f"{i}. {words}")
    return "\n\n".join(paras) + "\n"


@pytest.fixture(scope="session")
def spark(s3_server):
    # The S3 server starts first so its variables are in the environment Python workers inherit.
    from sparklm.spark import get_session

    session = get_session(SparkConfig(master="local[2]", ui=False, conf={"spark.sql.shuffle.partitions": "4"}))
    yield session
    session.stop()


@pytest.fixture
def config() -> Config:
    """A small config for tests: small vocabulary and sequences."""
    from sparklm.config import from_dict

    return from_dict({"data": {"seq_len": 32, "val_fraction": 0.2}, "tokenizer": {"vocab_size": 300}})


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def s3_server():
    """A real S3 endpoint (moto in server mode) on 127.0.0.1 for the whole run."""
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    server.start()
    env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_REGION": "us-east-1",
           "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    yield env["AWS_ENDPOINT_URL"]
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    server.stop()
