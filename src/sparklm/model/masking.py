"""Masked-LM inputs: which tokens an encoder must recover, and what it sees in their place (pure functions).

BERT's rule: 15% of the real, non-special tokens are chosen; of those 80% become the mask token, 10% a random
token and 10% stay as they are; the loss counts the chosen ones only. *Dynamic*: a batch is masked anew each time
it is seen (from torch's RNG, which checkpoints keep, so a resumed run masks as the uninterrupted one). With whole
words, a word's tokens are chosen together (WordPiece's ``##`` pieces, byte-level BPE's and SentencePiece's
tokens without their word-start mark belong to the word before them).
"""

from __future__ import annotations

import torch

IGNORE = -100  # no loss at this position (as HF and cross_entropy)


def mask_tokens(ids: torch.Tensor, maskable: torch.Tensor, *, mask_id: int, replacements: torch.Tensor,
                probability: float = 0.15, word_starts: torch.Tensor | None = None,
                generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, labels) for ids [B, T]: ``maskable`` [B, T] marks the tokens that may be chosen (real, not special);
    ``replacements``: the ids a randomly replaced token may take; ``word_starts`` [B, T] (whole-word masking): True
    where a word begins; labels are IGNORE except at the chosen positions, where they hold the original id."""
    draw = (lambda shape: torch.rand(shape, generator=generator)) if generator is not None else torch.rand
    if word_starts is None:
        chosen = (draw(ids.shape) < probability) & maskable
    else:
        word = torch.cumsum(word_starts.long(), dim=1)  # the word each position belongs to (0: before the first)
        picked = draw((ids.shape[0], ids.shape[1] + 1)) < probability  # one draw per word, by its index
        chosen = picked.gather(1, word) & maskable
    labels = ids.masked_fill(~chosen, IGNORE)
    roll = draw(ids.shape)
    inputs = ids.clone()
    inputs[chosen & (roll < 0.8)] = mask_id
    random = chosen & (roll >= 0.8) & (roll < 0.9)
    if random.any():
        pick = (draw((int(random.sum()),)) * len(replacements)).long().clamp_(max=len(replacements) - 1)
        inputs[random] = replacements[pick]
    return inputs, labels


def word_start_table(vocab: dict[str, int], specials: set[int]) -> torch.Tensor:
    """For each token id, whether it starts a word: WordPiece marks continuations (``##``), byte-level BPE
    (``Ġ``) and SentencePiece (``▁``) mark starts; special tokens start (and end) words. A vocabulary with none of
    these marks: every token is a word."""
    size = max(vocab.values()) + 1
    table = torch.ones(size, dtype=torch.bool)
    tokens = vocab.items()
    if any(t.startswith("##") for t, _ in tokens):
        for t, i in tokens:
            table[i] = not t.startswith("##")
    else:
        mark = "Ġ" if any(t.startswith("Ġ") for t, _ in tokens) else "▁" if any(t.startswith("▁") for t, _ in tokens) \
            else None
        if mark is not None:
            for t, i in tokens:
                table[i] = t.startswith(mark)
    for i in specials:
        table[i] = True
    return table


def word_starts(ids: torch.Tensor, table: torch.Tensor, special: torch.Tensor) -> torch.Tensor:
    """[B, T]: where words begin, by ``table``; a token right after a special one (the first word after CLS, which
    byte-level BPE writes without its mark) begins one too."""
    starts = table[ids]
    after = torch.zeros_like(starts)
    after[:, 1:] = special[:, :-1]
    return starts | after | special
