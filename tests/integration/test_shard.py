"""Sharded data parallelism (train.parallel shard, FSDP2 over gloo): the same training as a replicated run, on tiny
random models of real families (Llama, Qwen2, Gemma) saved as HF directories in the test."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import make_text, tiny_causal
from sparklm.config import from_dict
from sparklm.launch.train import train
from sparklm.metrics.sinks import read_metrics

# one test process takes the whole file: the module's models and datasets are made once
pytestmark = pytest.mark.xdist_group("shard")
TEXTS = [make_text(200, seed=s) for s in (31, 32)]


@pytest.fixture(scope="module")
def bases(spark, tmp_path_factory):
    """{family: (model dir, prepared dataset)}: each model's own tokenizer prepared the data."""
    from sparklm.launch.prepare import prepare

    root = tmp_path_factory.mktemp("shard")
    (root / "text.txt").write_text(TEXTS[0] + TEXTS[1])
    out = {}
    for family in ("llama", "qwen2", "gemma"):
        model = root / family
        tiny_causal(model, family, TEXTS)
        config = from_dict({"data": {"seq_len": 32, "val_fraction": 0.1}, "tokenizer": {"path": str(model)},
                            "output": {"row_group_mb": 1}})
        out[family] = (model, prepare([str(root / "text.txt")], output=str(root / f"data-{family}"), config=config,
                                      spark=spark).uri)
    return out


def config_for(model, *, lora: bool = False, **train):
    raw = {"model": {"init_from": str(model)},
           "train": {"batch_size": 2, "lr": 3e-3, "warmup_steps": 1, "eval_every": 0, "eval_batches": 0,
                     "log_every": 1, "dtype": "float32", "samples": 1, "sample_tokens": 6, "threads": 1,
                     "optimizer": "adamw", "max_steps": 20, "workers": 2, **train}}
    if lora:
        raw["lora"] = {"r": 4, "alpha": 8}
    return from_dict(raw)


def losses(run) -> list[float]:
    return [r["loss"] for r in read_metrics(run / "metrics.csv") if r["kind"] == "train"]


def logits(model_dir, ids):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits


def test_sharded_training_equals_replicated_and_exports_one_hf_model(spark, bases, tmp_path):
    """20 steps of a full fine-tune (Qwen2: tied embeddings) on 2 ranks, sharded and replicated: the same losses and
    evaluations within float32 tolerance, the plan's decision in config.json, the best weights kept (sharded: each
    rank its shards) and a model/ that transformers loads with the replicated run's logits."""
    model, data = bases["qwen2"]
    runs = {}
    for way in ("replicate", "shard"):
        runs[way] = tmp_path / way
        train(data, output=str(runs[way]), config=config_for(model, parallel=way, eval_every=7), spark=spark)
    a, b = losses(runs["replicate"]), losses(runs["shard"])
    assert len(a) == len(b) == 20 and b[-1] < b[0]
    assert b == pytest.approx(a, rel=1e-4, abs=1e-5)
    evals = [[r["val_loss"] for r in read_metrics(runs[w] / "metrics.csv") if r["kind"] == "eval"] for w in runs]
    assert len(evals[0]) >= 3 and evals[1] == pytest.approx(evals[0], rel=1e-4, abs=1e-5)
    saved = json.loads((runs["shard"] / "config.json").read_text())
    assert saved["config"]["train"]["parallel"] == "shard" and saved["plan"]["memory"]["parallel"] == "shard"
    ckpt = sorted((runs["shard"] / "checkpoints").glob("step-*"))[-1]
    assert sorted(p.name for p in (ckpt / "dcp").iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    ids = list(range(3, 20))
    for name in ("model", "model-final"):
        assert (runs["shard"] / name).is_dir() == (runs["replicate"] / name).is_dir()
        if (runs["shard"] / name).is_dir():
            torch.testing.assert_close(logits(runs["shard"] / name, ids), logits(runs["replicate"] / name, ids),
                                       rtol=1e-3, atol=1e-4)
    assert (runs["shard"] / "samples.txt").read_text().strip()


def test_a_sharded_run_resumes_bitwise_and_on_another_world_size(spark, bases, tmp_path):
    """A sharded checkpoint (torch.distributed.checkpoint, each rank its shards) resumed on the same 2 ranks ends
    bit for bit where the uninterrupted run ended (losses and exported weights); resumed on 1 rank
    with the same global batch (2 x 2 rows -> 1 x 4), its shards resharded, it trains the same steps within float32
    tolerance. Gemma: its embedding scaled by sqrt(hidden), its own MLP and norms."""
    from conftest import stopped_copy

    model, data = bases["gemma"]
    conf = config_for(model, parallel="shard", max_steps=6, checkpoint_every=3, samples=0)
    full = tmp_path / "full"
    train(data, output=str(full), config=conf, spark=spark)
    assert (full / "checkpoints" / "step-0000003" / "dcp" / ".metadata").is_file()
    same = tmp_path / "same"
    stopped_copy(full, same, after=3, last=6)
    train(None, output=str(same), resume=True, spark=spark)
    assert losses(same) == losses(full)
    assert (same / "model" / "model.safetensors").read_bytes() == (full / "model" / "model.safetensors").read_bytes()
    one = tmp_path / "one"
    stopped_copy(full, one, after=3, last=6)
    train(None, output=str(one), resume=True, spark=spark, changes={"train": {"workers": 1, "batch_size": 4}})
    assert losses(one) == pytest.approx(losses(full), rel=1e-4, abs=1e-5)
    ids = list(range(3, 20))
    torch.testing.assert_close(logits(one / "model", ids), logits(full / "model", ids), rtol=1e-3, atol=1e-4)


def test_sharded_lora_and_muon_with_accumulation_and_checkpointing(spark, bases, dataset, tmp_path):
    """LoRA adapters sharded with their frozen Llama base (the adapter exported in PEFT's format, loaded on its base);
    a model trained from scratch sharded with Muon (each matrix orthogonalized whole, each rank keeping its rows),
    two micro-batches accumulated and gradient checkpointing on: the replicated run's losses."""
    from conftest import cfg

    model, data = bases["llama"]
    lora = tmp_path / "lora"
    train(data, output=str(lora), config=config_for(model, lora=True, parallel="shard", max_steps=8), spark=spark)
    assert losses(lora)[-1] < losses(lora)[0]
    assert (lora / "model" / "adapter_model.safetensors").is_file()
    from sparklm.model.build import load_model

    assert load_model(str(lora / "model")) is not None
    runs = {}
    for way in ("replicate", "shard"):
        runs[way] = tmp_path / way
        train(dataset, output=str(runs[way]), spark=spark,
              config=cfg(max_steps=6, batch_size=2, grad_accum=2, workers=2, samples=0, optimizer="muon",
                         grad_checkpoint="on", parallel=way))
    a, b = losses(runs["replicate"]), losses(runs["shard"])
    assert b[-1] < b[0] and b == pytest.approx(a, rel=2e-3)


def test_lora_on_a_4_bit_base_trains_sharded_and_exports(spark, tmp_path):
    """lora.base_dtype nf4: the Llama base's block weights (published in bfloat16) held as torchao NF4 tensors
    (quantized as they are read), LoRA on top, sharded over 2 ranks: the loss falls, the adapter is PEFT's, generate
    loads base + adapter, and a merged export is a bfloat16 model, as the base was published."""
    from conftest import tiny_causal
    from sparklm.api import generate
    from sparklm.launch.prepare import prepare

    base = tmp_path / "base"
    tiny_causal(base, "llama", TEXTS, hidden=128, dtype="bfloat16")
    (tmp_path / "text.txt").write_text(TEXTS[0])
    data = prepare([str(tmp_path / "text.txt")], output=str(tmp_path / "data"), spark=spark,
                   config=from_dict({"data": {"seq_len": 32, "val_fraction": 0.1}, "tokenizer": {"path": str(base)},
                                     "output": {"row_group_mb": 1}})).uri
    run = tmp_path / "run"
    conf = config_for(base, lora=True, max_steps=12, parallel="shard", lr=1e-2)
    conf = conf.replace(lora=conf.lora.__class__(**{**conf.lora.__dict__, "base_dtype": "nf4"}))
    train(data, output=str(run), config=conf, spark=spark)
    got = losses(run)
    assert sum(got[-3:]) < sum(got[:3])
    assert json.loads((run / "config.json").read_text())["config"]["lora"]["base_dtype"] == "nf4"
    assert (run / "model" / "adapter_model.safetensors").is_file()
    assert isinstance(generate(str(run), "the", max_new_tokens=4), str)
    from safetensors import safe_open

    from sparklm.infer.export import export_hub

    export_hub(str(run), str(tmp_path / "merged"), merge=True)
    with safe_open(str(tmp_path / "merged" / "model.safetensors"), framework="pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}


def test_a_bad_parallel_value_and_a_model_that_fits_nowhere_are_one_line(spark, bases, tmp_path, capsys):
    from sparklm.cli import main

    model, data = bases["llama"]
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as e:
        main(["train", "--data", data, "--output", str(out), "--parallel", "sideways"])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and "--parallel: invalid choice: 'sideways'" in err[0]
    # 100 MB a rank holds no training process, sharded or not: one line naming what would fit, before anything is
    # written
    code = main(["train", "--data", data, "--output", str(out), "--init-from", str(model), "--workers", "2",
                 "--memory-limit", "100m", "--max-steps", "2"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err[-1].startswith("error: training does not fit in each rank's 0.10 GB"), err
    assert "sharded over 2 ranks" in err[-1] and "--lora-r 8" in err[-1]
    assert not out.exists()
