"""Fine-tuning pretrained HF causal LMs: full and LoRA, with every strategy, on tiny random Llama and GPT-2
models saved as HF directories in the test (nothing is downloaded)."""

from __future__ import annotations

import json

import pytest
import torch

import sparklm
from conftest import assert_same_figures, harness_reference, harness_toy, make_text, tiny_tokenizer
from sparklm.config import from_dict
from sparklm.infra.errors import SparklmError

# one test process takes the whole file: the module's models and datasets (`bases`) are made once
pytestmark = pytest.mark.xdist_group("finetune")
TEXTS = [make_text(300, seed=s) for s in (21, 22)]


def save_llama(directory):
    """A tiny random Llama (grouped-query attention) whose tokenizer adds BOS, as Llama's do."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from sparklm.data.tokenizer import from_tokenizer

    spec = from_tokenizer(tiny_tokenizer(TEXTS, ["<s>", "</s>", "<pad>"], "<s>"), "<s>", "</s>", "<pad>")
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=spec.vocab_size, hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=64, bos_token_id=spec.bos_id,
                                         eos_token_id=spec.eos_id, pad_token_id=spec.pad_id))
    model.save_pretrained(directory)
    spec.save(directory)
    return spec


def save_gpt2(directory):
    """A tiny random GPT-2 whose one special token is BOS, EOS and padding, and which adds no BOS."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from sparklm.data.tokenizer import from_tokenizer

    e = "<|endoftext|>"
    spec = from_tokenizer(tiny_tokenizer(TEXTS, [e], None), e, e, e)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=spec.vocab_size, n_embd=32, n_layer=2, n_head=2, n_positions=64,
                                       bos_token_id=spec.bos_id, eos_token_id=spec.eos_id))
    model.save_pretrained(directory)
    spec.save(directory)
    return spec


@pytest.fixture(scope="module")
def bases(spark, tmp_path_factory):
    """{arch: (model dir, prepared dataset)}: each model's own tokenizer prepared the data."""
    from sparklm.launch.prepare import prepare

    root = tmp_path_factory.mktemp("finetune")
    (root / "text.txt").write_text(TEXTS[0] + TEXTS[1])
    out = {}
    for arch, save in (("llama", save_llama), ("gpt2", save_gpt2)):
        model = root / arch
        save(model)
        config = from_dict({"data": {"seq_len": 32, "val_fraction": 0.1}, "tokenizer": {"path": str(model)},
                            "output": {"row_group_mb": 1}})
        data = prepare([str(root / "text.txt")], output=str(root / f"data-{arch}"), config=config, spark=spark)
        out[arch] = (model, data)
    return out


def finetune_config(model, strategy: str, lora: bool, **train):
    raw = {"model": {"init_from": str(model)},
           "train": {"batch_size": 4, "lr": 3e-3, "warmup_steps": 1, "eval_every": 0, "eval_batches": 2, "log_every": 1,
                     "dtype": "float32", "samples": 1, "sample_tokens": 6, "threads": 1, "optimizer": "adamw",
                     "max_steps": 4, "strategy": strategy, **train}}
    if strategy != "ddp":
        raw["train"]["workers"] = 2
        raw["train"]["rounds"] = {"sync_every": 2, **raw["train"].pop("rounds", {})}
    if lora:
        raw["lora"] = {"r": 4, "alpha": 8}
    return from_dict(raw)


def logits(model, ids):
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits


def test_prepare_follows_the_model_tokenizer_bos_convention(bases):
    import pyarrow.parquet as pq

    for arch, adds in (("llama", True), ("gpt2", False)):
        model, data = bases[arch]
        manifest = json.loads((model.parent / f"data-{arch}" / "manifest.json").read_text())
        assert manifest["tokenizer"]["add_bos"] is adds
        rows = pq.read_table(str(model.parent / f"data-{arch}" / "train")).column("input_ids").to_pylist()
        flat = [t for r in rows for t in r]
        bos = manifest["tokenizer"]["bos_id"]
        assert (bos in flat) is adds or arch == "gpt2"  # GPT-2's BOS is its EOS: it appears as the separator
        if arch == "gpt2":
            eos = manifest["tokenizer"]["eos_id"]
            assert all(flat[i + 1] != eos for i, t in enumerate(flat[:-1]) if t == eos)  # no BOS after EOS


@pytest.mark.parametrize("strategy,arch,lora", [
    ("ddp", "llama", False), ("ddp", "llama", True), ("ddp", "gpt2", True),
    ("average", "gpt2", False), ("average", "llama", True),
    ("diloco", "llama", False), ("diloco", "gpt2", True),
])
def test_finetune_with_every_strategy(spark, bases, tmp_path, strategy, arch, lora):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from sparklm.infer.generate import load
    from sparklm.launch.train import train

    model_dir, data = bases[arch]
    run = tmp_path / "run"
    s = train(data.uri, output=str(run), config=finetune_config(model_dir, strategy, lora), spark=spark)
    assert s["steps"] == 4 and s["final"]["val_loss"] > 0 and s["peak_rss_mb"] > 0
    base = AutoModelForCausalLM.from_pretrained(str(model_dir)).eval()
    ckpt = sorted((run / "checkpoints").glob("step-*"))[-1]
    saved = load_file(str(ckpt / "model.safetensors"))
    ids = [5, 17, 42, 99, 7, 3]
    if not lora:
        assert not (run / "model" / "adapter_config.json").exists()
        tuned = AutoModelForCausalLM.from_pretrained(str(run / "model")).eval()
        assert not torch.allclose(logits(tuned, ids), logits(base, ids))
        assert s["trainable_params"] == s["params"]
        return
    # LoRA: only the adapters train, are checkpointed and (rounds) travel
    from peft import PeftModel

    assert saved and all("lora_" in k for k in saved)
    assert s["trainable_params"] == sum(t.numel() for t in saved.values()) < s["params"] / 5
    if strategy != "ddp":  # the global weights broadcast each round and the workers' deltas: adapters only
        adapter_bytes = 4 * s["trainable_params"]
        if strategy == "average":  # fp32: exactly the adapters
            assert s["bytes_returned"] == s["rounds"] * 2 * adapter_bytes
        else:  # diloco's default codec, int4: 4.25 bits a value, plus each payload's header (names and shapes,
            # which weigh on an adapter this small: 4,096 values)
            assert s["rounds"] * 2 * adapter_bytes * 4.25 / 32 < s["bytes_returned"] < s["rounds"] * 2 * adapter_bytes / 3
    config = json.loads((run / "model" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(model_dir.resolve())
    assert (run / "model" / "adapter_model.safetensors").is_file() and not (run / "model" / "model.safetensors").exists()
    # the adapter loads in peft on its base, and gives sparklm's logits
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(model_dir)), str(run / "model")).eval()
    ours = load(str(run)).model
    torch.testing.assert_close(logits(peft_model, ids), logits(ours, ids), rtol=1e-4, atol=1e-5)
    assert not torch.allclose(logits(peft_model, ids), logits(base, ids))


def test_lora_adapters_travel_compressed(spark, bases, tmp_path):
    """Sparse DiLoCo over LoRA: only the adapters travel, and they travel as Top-k deltas and sparse updates."""
    from sparklm.launch.train import train

    model_dir, data = bases["llama"]
    rounds = {"codec": "topk", "density": 0.05, "outer_momentum": 0.0, "outer_lr": 1.0}
    s = train(data.uri, output=str(tmp_path / "run"), spark=spark,
              config=finetune_config(model_dir, "diloco", True, samples=0, rounds=rounds))
    adapter_bytes = 4 * s["trainable_params"]
    assert s["trainable_params"] < s["params"] / 5 and s["final"]["val_loss"] > 0
    # encoded adapter deltas, not fp32 ones (this adapter is 4K values: the payload's list of names weighs most)
    assert s["bytes_returned"] < s["rounds"] * 2 * adapter_bytes / 2


def test_merged_export_equals_base_plus_adapter(spark, bases, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from sparklm.cli import main
    from sparklm.launch.train import train

    model_dir, data = bases["llama"]
    run = tmp_path / "run"
    train(data.uri, output=str(run), config=finetune_config(model_dir, "ddp", True, max_steps=3, samples=0), spark=spark)
    assert main(["export", str(run), "--merge", "--output", str(tmp_path / "merged")]) == 0
    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged")).eval()
    assert not any("lora" in k for k in merged.state_dict())
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(model_dir)), str(run / "model")).eval()
    ids = [9, 8, 7, 6, 5]
    torch.testing.assert_close(logits(merged, ids), logits(peft_model, ids), rtol=1e-4, atol=1e-5)
    # the adapter's card names its base; for the Hub, the merged model with the card made a transformers one
    card = (run / "model" / "README.md").read_text()
    assert "library_name: peft" in card and f"base_model: {model_dir}" in card
    assert main(["export", str(run), "--format", "hub", "--merge", "--output", str(tmp_path / "hub")]) == 0
    hub = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hub")).eval()
    assert "library_name: transformers" in (tmp_path / "hub" / "README.md").read_text()
    assert not (tmp_path / "hub" / "adapter_config.json").exists()
    torch.testing.assert_close(logits(hub, ids), logits(merged, ids), rtol=0, atol=0)
    # GGUF: the adapter merged into its base, read back by transformers' GGUF reader (sparklm import)
    from sparklm.model import gguf as gguf_import

    assert main(["export", str(run), "--format", "gguf", "--output", str(tmp_path / "gguf")]) == 0
    gguf_import.convert(str(tmp_path / "gguf" / "model.gguf"), str(tmp_path / "gguf-back"))
    back = AutoModelForCausalLM.from_pretrained(str(tmp_path / "gguf-back")).eval()
    torch.testing.assert_close(logits(back, ids), logits(merged, ids), rtol=1e-4, atol=1e-5)
    # benchmark tasks on the LoRA run (adapter on its base) and on the GGUF file: the harness's figures for the
    # merged model and for the GGUF read back
    pytest.importorskip("lm_eval")
    toy = harness_toy(tmp_path / "toy")
    tasks = [str(toy / "tasks" / "mc.yaml")]
    for model, reference in ((run, tmp_path / "merged"), (tmp_path / "gguf" / "model.gguf", tmp_path / "gguf-back")):
        ours = sparklm.evaluate(str(model), tasks=tasks, limit=6, spark=spark)
        assert_same_figures(ours, harness_reference(toy, ["toy_mc"], model=reference, limit=6))


def test_bad_pretrained_models_are_one_line(spark, bases, tmp_path):
    from sparklm.launch.train import train

    model_dir, data = bases["llama"]
    # a LoRA target that names no module
    with pytest.raises(SparklmError, match="lora.targets names no module.*nope"):
        train(data.uri, output=str(tmp_path / "a"), spark=spark, config=from_dict(
            {**finetune_config(model_dir, "ddp", True).to_dict(), "lora": {"r": 4, "targets": "q_proj,nope"}}))
    # a model directory without weights, one without config
    for name, keep in (("noweights", "config.json"), ("noconfig", "model.safetensors")):
        broken = tmp_path / name
        broken.mkdir()
        (broken / keep).write_bytes((model_dir / keep).read_bytes())
        cfg = from_dict({**finetune_config(model_dir, "ddp", False).to_dict(), "model": {"init_from": str(broken)}})
        with pytest.raises(SparklmError, match="no safetensors weights" if keep == "config.json" else "no config.json"):
            train(data.uri, output=str(tmp_path / f"run-{name}"), config=cfg, spark=spark)
    # a tokenizer that does not match the model: the GPT-2 data on the Llama model
    gpt2_data = bases["gpt2"][1]
    with pytest.raises(SparklmError, match="tokenizer of .* differs from the dataset's"):
        train(gpt2_data.uri, output=str(tmp_path / "b"), config=finetune_config(model_dir, "ddp", True), spark=spark)
    # LoRA without a pretrained model
    with pytest.raises(SparklmError, match="LoRA adapts a pretrained model"):
        train(data.uri, output=str(tmp_path / "c"),
              config=from_dict({"lora": {"r": 4}, "train": {"max_steps": 1}}), spark=spark)


def test_gradient_checkpointing_and_a_bf16_base(bases):
    """Checkpointing recomputes activations: the same loss and adapter gradients; a bf16 base keeps the adapters
    (and so the optimizer state) in float32 and gives nearly the same loss."""
    from sparklm.data.tokenizer import load as load_tokenizer
    from sparklm.model.task import make_batch
    from sparklm.tasks.causal_lm import CausalLM

    model_dir, _ = bases["llama"]
    spec = load_tokenizer(str(model_dir))
    ids = torch.randint(3, spec.vocab_size, (2, 16)).numpy()

    def run(**lora):
        raw = {"model": {"init_from": str(model_dir)}, "lora": {"r": 4, **lora}}
        grad_checkpoint = lora.pop("grad_checkpoint", False)
        raw["lora"].pop("grad_checkpoint", None)
        raw["train"] = {"grad_checkpoint": "on" if grad_checkpoint else "off"}
        task = CausalLM()
        model = task.build(from_dict(raw), spec, 16)
        model.train()
        loss = task.loss(model, make_batch(ids, None))
        loss.backward()
        return model, loss.item(), {n: p.grad.clone() for n, p in task.trainable(model).items()}

    _, loss, grads = run()
    model, loss_ckpt, grads_ckpt = run(grad_checkpoint=True)
    assert model.base_model.model.model.gradient_checkpointing
    assert loss_ckpt == pytest.approx(loss, abs=1e-6)
    for n in grads:
        torch.testing.assert_close(grads_ckpt[n], grads[n], rtol=1e-4, atol=1e-6)
    model, loss_bf16, grads_bf16 = run(base_dtype="bfloat16")
    dtypes = {p.dtype for n, p in model.named_parameters() if "lora_" not in n}
    assert dtypes == {torch.bfloat16}
    assert all(p.dtype == torch.float32 for p in CausalLM().trainable(model).values())
    assert loss_bf16 == pytest.approx(loss, abs=0.05)
