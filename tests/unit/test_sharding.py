"""The sharded run's pure parts: streamed safetensors files as save_pretrained writes them, the rows a rank keeps,
the 4-bit scale blocks."""

from __future__ import annotations

import json

import torch

from sparklm.model import nf4
from sparklm.train import shard


def _tiny(tied: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied))


def test_streamed_files_load_as_save_pretrained_writes_them(tmp_path):
    """One file, or files of at most max_file bytes with an index; a tied head saved once (under the embedding):
    transformers loads either to the same logits."""
    from transformers import AutoModelForCausalLM

    ids = torch.tensor([[1, 5, 9, 3]])
    for tied, max_file, files in ((True, shard.MAX_FILE, 1), (False, 20_000, None)):
        model = _tiny(tied)
        out = tmp_path / f"tied-{tied}"
        out.mkdir()
        model.config.save_pretrained(out)
        shard.save_streamed(out, model, max_file=max_file)
        written = sorted(p.name for p in out.glob("*.safetensors"))
        if files == 1:
            assert written == ["model.safetensors"]
        else:
            index = json.loads((out / "model.safetensors.index.json").read_text())
            assert len(written) > 2 and set(index["weight_map"].values()) == set(written)
            assert all((out / f).stat().st_size <= max_file + 4096 for f in written)  # (+ the header)
        loaded = AutoModelForCausalLM.from_pretrained(out)
        with torch.no_grad():
            torch.testing.assert_close(loaded(input_ids=ids).logits, model(input_ids=ids).logits, rtol=0, atol=0)
        names = [n for n, _ in shard.exported(model)]
        assert ("lm_head.weight" in names) != tied and len(names) == len(set(names))


def test_rows_of_a_plain_tensor_are_all_of_them():
    assert shard.rows(torch.zeros(7, 3)) == (0, 7)


def test_nf4_scale_blocks_split_evenly_over_the_ranks_where_they_can():
    assert nf4.scaler_block(4096 * 4096) == nf4.scaler_block(4096 * 4096, 8) == 256  # QLoRA's
    # SmolLM2-360M's attention: 14,400 blocks of 64, in 225 groups of 64 alone, 450 of 32 over 2 ranks, 900 of 16
    # over 4; 8 ranks: none (that weight stays in bfloat16)
    assert [nf4.scaler_block(960 * 960, n) for n in (1, 2, 4, 8)] == [64, 32, 16, 0]
    assert nf4.scaler_block(100) == 0  # not a multiple of 64: stays in bfloat16
