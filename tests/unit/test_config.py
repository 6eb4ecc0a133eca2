from pathlib import Path

import pytest

from sparklm.config import Config, describe, from_dict, load_config
from sparklm.infra.errors import SparklmError

ROOT = Path(__file__).resolve().parents[2]


def test_defaults_and_overrides(tmp_path):
    cfg_file = tmp_path / "c.toml"
    cfg_file.write_text('[data]\nseq_len = 64\ndoc_mode = "line"\n[spark]\nconf = { "spark.a" = "1" }\n')
    cfg = load_config(cfg_file, ["data.seq_len=128", "tokenizer.path=tok.json", "spark.conf.spark.b.c=x y"])
    assert cfg.data.seq_len == 128 and cfg.data.doc_mode == "line"
    assert cfg.tokenizer.path == "tok.json"
    assert cfg.spark.conf == {"spark.a": "1", "spark.b.c": "x y"}
    assert Config().data.seq_len == 256


@pytest.mark.parametrize(
    "override, words",
    [
        ("data.seq_lenn=3", ["unknown config key 'data.seq_lenn'", "seq_len"]),
        ("nope.x=1", ["unknown config section 'nope'"]),
        ("data.seq_len=abc", ["'data.seq_len' must be an integer"]),
        ("data.seq_len=1", ["'data.seq_len' is 1", ">= 2"]),
        ("data.val_fraction=1.5", ["<= 0.9"]),
        ("data.doc_mode=pages", ["allowed values", "'paragraph'"]),
        ("data.dedup=yes", ["true or false"]),
        ("seq_len=3", ["bad override"]),
        ("train.lr=nan", ["'train.lr' must be a finite number"]),
        ("train.grad_clip=inf", ["'train.grad_clip' must be a finite number"]),
        ("model.n_embd=90", ["model.n_embd (90) must be divisible by model.n_head (4)"]),
        ("train.strategy=allreduce", ["allowed values: 'ddp', 'average', 'diloco'"]),
        ("model.task=translation", ["allowed values: 'causal-lm'"]),
        ("model.n_head=256", ["each head gets n_embd / n_head = 1 dimensions", "RoPE", "even"]),
        ("data.encoding=nope", ["data.encoding 'nope' is not a text encoding Python knows", "latin-1"]),
        ("data.encoding=base64", ["data.encoding 'base64' is not a text encoding"]),
    ],
)
def test_bad_config_is_one_clear_message(override, words):
    with pytest.raises(SparklmError) as e:
        load_config(None, [override])
    line = e.value.one_line()
    assert "\n" not in line
    for w in words:
        assert w in line


def test_a_known_text_encoding_is_accepted_under_any_of_its_names():
    assert load_config(None, ["data.encoding=Latin-1"]).data.encoding == "Latin-1"
    assert load_config(None, ["data.encoding=cp1252"]).data.encoding == "cp1252"


def test_missing_and_invalid_files(tmp_path):
    with pytest.raises(SparklmError, match="config file not found"):
        load_config(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[data\nseq_len=")
    with pytest.raises(SparklmError, match="not valid TOML"):
        load_config(bad)


def test_resolved_config_round_trips():
    cfg = load_config(None, ["data.seq_len=77", "spark.conf.spark.x=1"])
    again = from_dict(cfg.to_dict())
    assert again == cfg


def test_default_toml_matches_the_code():
    """configs/default.toml is the generated description of every key; it must not drift."""
    assert (ROOT / "configs" / "default.toml").read_text() == describe()
    assert load_config(ROOT / "configs" / "default.toml") == Config()


def test_chunk_size_follows_the_vocabulary():
    from sparklm.config import chunk_size

    assert chunk_size(49152) == 512
    assert chunk_size(50) == 4096
    assert chunk_size(10**7) == 32
    assert chunk_size(49152, 100) == 100


def test_mlp_hidden_resolves_zero_by_the_architectures_rule():
    from sparklm.config import ModelConfig

    assert ModelConfig(n_embd=256).mlp_hidden == 704  # llama: 8/3 of the width, rounded up to 64
    assert ModelConfig(arch="gpt2", n_embd=256).mlp_hidden == 1024
    assert ModelConfig(n_embd=256, intermediate=300).mlp_hidden == 300


def test_sparklm_config_prints_the_defaults_as_toml_a_config_file_takes(tmp_path, capsys):
    """Installed from a wheel there is no configs/ directory: `sparklm config` prints the same text."""
    from sparklm.cli import main

    assert main(["config"]) == 0
    out = capsys.readouterr().out
    assert out == describe()
    (tmp_path / "mine.toml").write_text(out)
    assert load_config(tmp_path / "mine.toml") == Config()
