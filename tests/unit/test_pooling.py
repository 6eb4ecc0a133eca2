"""The pure parts of encoder scoring (infer/encode.py): pooling, length order, the model's input limit."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from sparklm.infer.encode import length_order, max_positions, pool


def test_pooling_reads_only_real_tokens_whichever_side_is_padded():
    hidden = torch.arange(2 * 4 * 3, dtype=torch.float32).reshape(2, 4, 3)
    right = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]])
    left = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])
    assert torch.equal(pool(hidden, right, "mean")[0], hidden[0, :2].mean(0))
    assert torch.equal(pool(hidden, left, "mean")[0], hidden[0, 2:].mean(0))
    assert torch.equal(pool(hidden, right, "cls"), hidden[:, 0])
    assert torch.equal(pool(hidden, right, "last"), torch.stack([hidden[0, 1], hidden[1, 3]]))
    assert torch.equal(pool(hidden, left, "last"), torch.stack([hidden[0, 3], hidden[1, 3]]))
    with pytest.raises(ValueError, match="pooling 'max'"):
        pool(hidden, right, "max")


@given(st.lists(st.integers(0, 50), max_size=40))
def test_length_order_is_a_stable_permutation_longest_first(lengths):
    order = length_order(lengths)
    assert sorted(order) == list(range(len(lengths)))
    assert all(lengths[a] > lengths[b] or (lengths[a] == lengths[b] and a < b) for a, b in zip(order, order[1:]))


def test_the_input_limit_is_the_position_table_or_a_smaller_sane_tokenizer_limit():
    class C:
        def __init__(self, kind, n):
            self.model_type, self.max_position_embeddings = kind, n

        def to_dict(self):
            return {"model_type": self.model_type, "max_position_embeddings": self.max_position_embeddings,
                    "pad_token_id": 1}

    class T:
        def __init__(self, n):
            self.model_max_length = n

    assert max_positions(C("bert", 512), T(10**30)) == 512  # an unset tokenizer limit (HF's huge sentinel)
    assert max_positions(C("roberta", 514), T(10**30)) == 512  # RoBERTa's positions start after the padding index
    assert max_positions(C("bert", 512), T(128)) == 128


# model types whose position ids start after the padding index, and two that count from 0
OFFSET = {"roberta": "RobertaConfig", "xlm-roberta": "XLMRobertaConfig", "camembert": "CamembertConfig",
          "mpnet": "MPNetConfig", "data2vec-text": "Data2VecTextConfig", "ibert": "IBertConfig",
          "roberta-prelayernorm": "RobertaPreLayerNormConfig", "esm": "EsmConfig", "luke": "LukeConfig"}
PLAIN = {"bert": "BertConfig", "electra": "ElectraConfig", "distilbert": "DistilBertConfig", "albert": "AlbertConfig"}


@pytest.mark.parametrize("kind", sorted(OFFSET) + sorted(PLAIN))
def test_the_position_limit_is_what_the_model_itself_takes(kind):
    """The limit sparklm checks a dataset's rows and a scoring batch against is the longest input transformers' own
    model of that type runs: one token more fails inside it (in every task: "index out of range")."""
    import transformers

    from sparklm.model.encoders import positions

    cls = getattr(transformers, {**OFFSET, **PLAIN}[kind])
    small = dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32, vocab_size=40,
                 max_position_embeddings=24, pad_token_id=3)
    if kind == "distilbert":
        small = dict(dim=16, n_layers=1, n_heads=2, hidden_dim=32, vocab_size=40, max_position_embeddings=24,
                     pad_token_id=3)
    if kind == "esm":
        small.update(position_embedding_type="absolute", mask_token_id=4)
    config = cls(**small)
    model = transformers.AutoModel.from_config(config).eval()
    limit = positions(config.to_dict())
    assert limit == max_positions(config, None)
    ids = torch.full((1, limit + 1), 7)
    with torch.no_grad():
        model(input_ids=ids[:, :limit])
        with pytest.raises((IndexError, RuntimeError)):
            model(input_ids=ids)
