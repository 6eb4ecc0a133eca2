"""Masked-LM masking as a pure function (model/masking.py), checked on its properties over many draws."""

from __future__ import annotations

import pytest
import torch

from sparklm.model import masking

MASK, PAD, CLS, SEP = 4, 0, 1, 2


def _batch(seed: int, rows: int = 64, length: int = 48):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(10, 100, (rows, length), generator=g)
    lengths = torch.randint(5, length + 1, (rows,), generator=g)
    real = torch.arange(length)[None, :] < lengths[:, None]
    ids[:, 0] = CLS
    ids[torch.arange(rows), lengths - 1] = SEP
    ids[~real] = PAD
    special = (ids == CLS) | (ids == SEP) | (ids == PAD)
    return ids, real & ~special


@pytest.mark.parametrize("seed", range(5))
def test_masking_chooses_15_percent_of_real_tokens_and_replaces_80_10_10(seed):
    ids, maskable = _batch(seed, rows=256)
    g = torch.Generator().manual_seed(seed + 100)
    inputs, labels = masking.mask_tokens(ids, maskable, mask_id=MASK, replacements=torch.arange(10, 100), generator=g)
    chosen = labels != masking.IGNORE
    assert not (chosen & ~maskable).any()  # specials and padding are never chosen
    assert torch.equal(labels[chosen], ids[chosen])  # the targets are the original tokens
    assert torch.equal(inputs[~chosen], ids[~chosen])  # nothing else changes
    n = int(chosen.sum())
    assert abs(n / int(maskable.sum()) - 0.15) < 0.02
    masked = (inputs[chosen] == MASK).float().mean()
    kept = (inputs[chosen] == ids[chosen]).float().mean()
    assert abs(masked - 0.8) < 0.04 and abs(kept - 0.1) < 0.03 + 0.01  # kept includes random draws of the same id
    assert ((inputs[chosen] >= 10) | (inputs[chosen] == MASK)).all()  # random tokens come from the replacements


def test_the_same_generator_seed_masks_the_same_way():
    ids, maskable = _batch(0)
    a = masking.mask_tokens(ids, maskable, mask_id=MASK, replacements=torch.arange(10, 100),
                            generator=torch.Generator().manual_seed(3))
    b = masking.mask_tokens(ids, maskable, mask_id=MASK, replacements=torch.arange(10, 100),
                            generator=torch.Generator().manual_seed(3))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_whole_words_are_chosen_with_all_their_pieces():
    vocab = {"[PAD]": 0, "[CLS]": 1, "[SEP]": 2, "x": 3, "[MASK]": 4, **{f"w{i}": 10 + i for i in range(20)},
             **{f"##p{i}": 30 + i for i in range(20)}}
    table = masking.word_start_table(vocab, {0, 1, 2, 4})
    g = torch.Generator().manual_seed(0)
    ids = torch.where(torch.rand(128, 40, generator=g) < 0.5, torch.randint(10, 30, (128, 40), generator=g),
                      torch.randint(30, 50, (128, 40), generator=g))
    ids[:, 0], ids[:, -1] = 1, 2
    special = (ids <= 2) | (ids == 4)
    starts = masking.word_starts(ids, table, special)
    inputs, labels = masking.mask_tokens(ids, ~special, mask_id=MASK, replacements=torch.arange(10, 50),
                                         word_starts=starts, generator=g)
    chosen = labels != masking.IGNORE
    word = torch.cumsum(starts.long(), 1)
    for r in range(ids.shape[0]):
        for w in word[r].unique():
            at = (word[r] == w) & ~special[r]
            if at.any():
                assert chosen[r][at].all() or not chosen[r][at].any()  # all of a word's pieces, or none
    assert 0.08 < chosen.float().sum() / (~special).float().sum() < 0.25


def test_word_start_tables_follow_each_tokenizer_family():
    bpe = masking.word_start_table({"Ġthe": 0, "cat": 1, "Ġdog": 2, "<s>": 3}, {3})
    assert bpe.tolist() == [True, False, True, True]
    sp = masking.word_start_table({"▁the": 0, "re": 1}, set())
    assert sp.tolist() == [True, False]
    # the first word after CLS has no mark in byte-level BPE: it starts a word anyway
    starts = masking.word_starts(torch.tensor([[3, 1, 1, 2]]), bpe, torch.tensor([[True, False, False, False]]))
    assert starts.tolist() == [[True, True, False, True]]
