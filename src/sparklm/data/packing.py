"""Pure packing: token streams → fixed-length sequences.

Each document becomes ``BOS tokens EOS`` (``tokens EOS`` for a tokenizer without BOS). In concat mode documents are joined into one stream and
cut into windows of ``seq_len`` tokens whose starts are ``stride`` apart (stride == seq_len:
disjoint blocks; stride < seq_len: overlapping sliding windows). Without concat, each document is
windowed on its own. The last partial window of a stream is dropped or padded with PAD (its
``attention_mask`` is 0 on the padding).

Instruction data arrives framed instead (:func:`sparklm.data.instruct.frame`: specials included)
with a per-token loss mask, which travels with its tokens through every cut, carry and window, so
a sequence that spans two records keeps each token's own mask (padding: 0).

Targets are the inputs shifted by one (the Hugging Face causal-LM convention: ``labels =
input_ids``, the model shifts internally), so a sequence of ``seq_len`` tokens trains
``seq_len - 1`` predictions.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from itertools import chain

import numpy as np


@dataclass(frozen=True)
class PackSpec:
    seq_len: int
    stride: int
    pad_id: int
    concat: bool = True
    pad_last: bool = False

    def __post_init__(self) -> None:
        if self.seq_len < 2 or not 1 <= self.stride <= self.seq_len:
            raise ValueError(f"need seq_len >= 2 and 1 <= stride <= seq_len, got {self.seq_len}, {self.stride}")

    @property
    def has_mask(self) -> bool:
        return self.pad_last or not self.concat


@dataclass
class Packed:
    """A block of sequences: ``input_ids`` (n, seq_len) int32, ``attention_mask`` (n, seq_len) int8
    or None, ``doc_id`` (n,): the document at each sequence's first token, and ``loss_mask`` (n, seq_len)
    int8: 1 where predicting the token counts in the loss (None: every real token does)."""

    input_ids: np.ndarray
    attention_mask: np.ndarray | None
    doc_id: np.ndarray
    loss_mask: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.input_ids)


def window_starts(n: int, seq_len: int, stride: int, *, final: bool, pad_last: bool, covered: int = 0
                  ) -> tuple[np.ndarray, int]:
    """Starts of the windows to emit from a stream of ``n`` tokens, and where the unconsumed rest begins.

    Full windows are emitted as soon as they fit. When ``final``, the tokens after the last full
    window are either covered by one more (padded) window or dropped. ``covered`` counts leading
    tokens that earlier (overlapping) windows already hold.
    """
    full = np.arange(0, max(n - seq_len + 1, 0), stride, dtype=np.int64)
    rest = int(full[-1]) + stride if len(full) else 0
    if not final:
        return full, rest
    covered = int(full[-1]) + seq_len if len(full) else covered
    if pad_last and n > covered:
        return np.append(full, rest), n
    return full, n


def pack(tokens: np.ndarray, doc_starts: np.ndarray, doc_ids: np.ndarray, spec: PackSpec, *, final: bool,
         covered: int = 0, loss: np.ndarray | None = None) -> tuple[Packed, int]:
    """Cut one token stream into sequences; return them and the offset of the unconsumed rest.

    ``doc_starts`` are the stream offsets where documents begin (ascending), ``doc_ids`` their ids;
    ``covered`` as in :func:`window_starts`; ``loss``: the stream's per-token loss mask, cut alike.
    """
    starts, rest = window_starts(len(tokens), spec.seq_len, spec.stride, final=final, pad_last=spec.pad_last,
                                 covered=covered)
    n = len(starts)
    padded = np.concatenate([tokens, np.full(spec.seq_len, spec.pad_id, dtype=tokens.dtype)])
    index = starts[:, None] + np.arange(spec.seq_len)[None, :]
    ids = padded[index].astype(np.int32, copy=False).reshape(n, spec.seq_len)
    mask = None
    if spec.has_mask:
        mask = (index < len(tokens)).astype(np.int8).reshape(n, spec.seq_len)
    loss_mask = None
    if loss is not None:
        loss_mask = np.concatenate([loss, np.zeros(spec.seq_len, np.int8)])[index].reshape(n, spec.seq_len)
    which = np.searchsorted(doc_starts, starts, side="right") - 1
    docs = doc_ids[np.clip(which, 0, max(len(doc_ids) - 1, 0))] if len(doc_ids) else np.zeros(n, np.int64)
    return Packed(ids, mask, docs.astype(np.int64, copy=False), loss_mask), rest


@dataclass
class Packer:
    """Streaming wrapper around :func:`pack` that carries the rest of the stream between batches."""

    spec: PackSpec
    bos_id: int | None  # None: documents start without BOS (the tokenizer's convention, e.g. GPT-2, Qwen)
    eos_id: int
    tokens_in: int = 0  # document tokens seen, BOS and EOS included
    tokens_dropped: int = 0  # tokens of last partial blocks that were dropped
    _covered: int = 0  # leading carried tokens already inside an emitted (overlapping) window
    _carry: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    _carry_starts: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    _carry_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    _carry_loss: np.ndarray | None = None  # the carried tokens' loss mask (framed documents only)
    _framed: bool | None = None  # whether the documents come framed with loss masks (set by the first feed)

    def feed(self, docs: Sequence[Sequence[int]], ids: Sequence[int],
             masks: Sequence[Sequence[int]] | None = None) -> Iterator[Packed]:
        """Add documents and yield the sequences that are complete.

        Without ``masks``, ``docs`` are token ids without specials: each becomes ``BOS tokens EOS`` and
        the sequences carry no loss mask. With ``masks``, ``docs`` are whole documents, specials included
        (see :func:`sparklm.data.instruct.frame`), and ``masks`` their per-token loss masks, which the
        sequences carry. One packer takes one kind or the other.
        """
        if not docs:
            return
        framed = masks is not None
        if self._framed is not None and self._framed != framed:
            raise ValueError("a Packer takes documents either all with loss masks or all without")
        self._framed = framed
        flat, starts, ends, loss = self._frame(docs, masks)
        self.tokens_in += len(flat)
        doc_ids = np.asarray(ids, np.int64)
        if not self.spec.concat:
            for s, e, i in zip(starts, ends, doc_ids):
                packed = self._final(flat[s:e], np.zeros(1, np.int64), np.array([i], np.int64),
                                     loss=None if loss is None else loss[s:e])
                if len(packed):
                    yield packed
            return
        stream = np.concatenate([self._carry, flat])
        doc_starts = np.concatenate([self._carry_starts, starts + len(self._carry)])
        all_ids = np.concatenate([self._carry_ids, doc_ids])
        carried = self._carry_loss if self._carry_loss is not None else np.zeros(0, np.int8)
        stream_loss = None if loss is None else np.concatenate([carried, loss])
        packed, rest = pack(stream, doc_starts, all_ids, self.spec, final=False, loss=stream_loss)
        if len(packed):
            self._covered = self.spec.seq_len - self.spec.stride
        self._keep(stream, doc_starts, all_ids, rest, stream_loss)
        if len(packed):
            yield packed

    def _frame(self, docs: Sequence[Sequence[int]], masks: Sequence[Sequence[int]] | None):
        """(the documents as one stream, their starts, their ends, the stream's loss mask or None)."""
        specials = 0 if masks is not None else 1 if self.bos_id is None else 2
        lengths = np.fromiter((len(d) + specials for d in docs), np.int64, len(docs))
        total = int(lengths.sum())
        ends = np.cumsum(lengths)
        starts = ends - lengths
        if masks is not None:
            loss = np.fromiter(chain.from_iterable(masks), np.int8, total)
            return np.fromiter(chain.from_iterable(docs), np.int32, total), starts, ends, loss
        flat = np.empty(total, np.int32)
        mask = np.ones(len(flat), bool)
        if self.bos_id is not None:
            flat[starts] = self.bos_id
            mask[starts] = False
        flat[ends - 1] = self.eos_id
        mask[ends - 1] = False
        flat[mask] = np.fromiter(chain.from_iterable(docs), np.int32, total - specials * len(docs))
        return flat, starts, ends, None

    def finish(self) -> Iterator[Packed]:
        """Emit the last (padded) window or drop it, as the spec says."""
        if self.spec.concat and len(self._carry):
            packed = self._final(self._carry, self._carry_starts, self._carry_ids, self._covered,
                                 loss=self._carry_loss)
            self._carry = self._carry[:0]
            self._carry_loss = None if self._carry_loss is None else self._carry_loss[:0]
            if len(packed):
                yield packed

    def _final(self, stream: np.ndarray, doc_starts: np.ndarray, ids: np.ndarray, covered: int = 0, *,
               loss: np.ndarray | None = None) -> Packed:
        packed, _ = pack(stream, doc_starts, ids, self.spec, final=True, covered=covered, loss=loss)
        if not self.spec.pad_last:  # count the tail no window covers
            full, _ = window_starts(len(stream), self.spec.seq_len, self.spec.stride, final=False, pad_last=False)
            last_end = int(full[-1]) + self.spec.seq_len if len(full) else covered
            self.tokens_dropped += max(len(stream) - last_end, 0)
        return packed

    def _keep(self, stream: np.ndarray, doc_starts: np.ndarray, ids: np.ndarray, rest: int,
              loss: np.ndarray | None) -> None:
        # Keep the document that covers `rest` too, so the first carried window knows its doc id.
        first = max(int(np.searchsorted(doc_starts, rest, side="right")) - 1, 0)
        self._carry = stream[rest:]
        self._carry_loss = None if loss is None else loss[rest:]
        self._carry_starts = np.maximum(doc_starts[first:] - rest, 0)
        self._carry_ids = ids[first:]
