"""train.compile's blocks (train/compiling.py): the repeated layers of any HF model, found without naming them."""

from __future__ import annotations

import pytest
import torch

from sparklm.train.compiling import blocks


def test_the_blocks_are_a_models_layers_under_any_name_and_wrapper():
    from peft import LoraConfig, get_peft_model
    from transformers import BertConfig, BertModel, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    llama = LlamaForCausalLM(LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=3,
                                         num_attention_heads=2, vocab_size=64))
    assert blocks(llama) == list(llama.model.layers)
    gpt2 = GPT2LMHeadModel(GPT2Config(n_embd=16, n_layer=2, n_head=2, vocab_size=64, n_positions=32))
    assert blocks(gpt2) == list(gpt2.transformer.h)
    bert = BertModel(BertConfig(hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
                                vocab_size=64))
    assert blocks(bert) == list(bert.encoder.layer)
    wrapped = get_peft_model(llama, LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    assert blocks(wrapped) == list(llama.model.layers)  # the same layers, found under peft's wrapper


def test_a_model_without_repeated_blocks_has_none():
    mixed = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ModuleList([torch.nn.Linear(4, 4), torch.nn.ReLU()]))
    assert blocks(mixed) == [] and blocks(torch.nn.Linear(2, 2)) == []


def test_compiling_on_a_cpu_without_a_cxx_compiler_is_one_line():
    from torch._inductor import config as inductor

    from sparklm.infra.errors import SparklmError
    from sparklm.train.compiling import needs_compiler

    needs_compiler("cpu")  # this machine has g++
    with inductor.patch({"cpp.cxx": (None, "no-such-compiler++")}):
        with pytest.raises(SparklmError, match=r"no C\+\+ compiler \(no-such-compiler\+\+\)") as caught:
            needs_compiler("cpu")
        needs_compiler("cuda")  # on a GPU, Triton's kernels need no host C++ compiler
    assert "train.compile=off" in caught.value.hint
