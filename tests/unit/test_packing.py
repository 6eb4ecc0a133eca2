"""Packing is pure: properties over random documents, batchings and window settings."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sparklm.data.packing import Packer, PackSpec, window_starts

BOS, EOS, PAD = 1, 2, 0
docs_st = st.lists(st.lists(st.integers(3, 50), max_size=20), min_size=1, max_size=25)


def run(docs, spec, cuts=()):
    """Feed documents in batches split at `cuts`; return all packed rows."""
    packer = Packer(spec, bos_id=BOS, eos_id=EOS)
    bounds = [0, *sorted({c % (len(docs) + 1) for c in cuts}), len(docs)]
    out = []
    for a, b in zip(bounds, bounds[1:]):
        out += list(packer.feed(docs[a:b], list(range(a, b))))
    out += list(packer.finish())
    ids = np.concatenate([p.input_ids for p in out]) if out else np.zeros((0, spec.seq_len), np.int32)
    masks = np.concatenate([p.attention_mask for p in out]) if out and spec.has_mask else None
    doc = np.concatenate([p.doc_id for p in out]) if out else np.zeros(0, np.int64)
    return ids, masks, doc, packer


def stream_of(docs):
    return [t for d in docs for t in [BOS, *d, EOS]]


@settings(max_examples=200, deadline=None)
@given(docs=docs_st, seq_len=st.integers(2, 17), cuts=st.lists(st.integers(0, 30), max_size=4))
def test_disjoint_padded_blocks_lose_and_duplicate_nothing(docs, seq_len, cuts):
    spec = PackSpec(seq_len=seq_len, stride=seq_len, pad_id=PAD, pad_last=True)
    ids, masks, _, packer = run(docs, spec, cuts)
    stream = stream_of(docs)
    assert ids.shape[1] == seq_len
    assert ids[masks == 1].tolist() == stream  # every token once, in order
    assert (ids[masks == 0] == PAD).all() and (masks[:-1] == 1).all()  # only the last row is padded
    assert packer.tokens_in == len(stream) and packer.tokens_dropped == 0


@settings(max_examples=200, deadline=None)
@given(docs=docs_st, seq_len=st.integers(2, 17), cuts=st.lists(st.integers(0, 30), max_size=4))
def test_dropping_the_last_block_keeps_an_exact_prefix(docs, seq_len, cuts):
    spec = PackSpec(seq_len=seq_len, stride=seq_len, pad_id=PAD)
    ids, masks, _, packer = run(docs, spec, cuts)
    stream = stream_of(docs)
    assert masks is None
    assert ids.reshape(-1).tolist() == stream[: len(ids) * seq_len]
    assert len(stream) - ids.size == packer.tokens_dropped < seq_len


@settings(max_examples=200, deadline=None)
@given(docs=docs_st, seq_len=st.integers(2, 17), data=st.data(), cuts=st.lists(st.integers(0, 30), max_size=4))
def test_sliding_windows_match_a_direct_slice(docs, seq_len, data, cuts):
    stride = data.draw(st.integers(1, seq_len))
    pad_last = data.draw(st.booleans())
    spec = PackSpec(seq_len=seq_len, stride=stride, pad_id=PAD, pad_last=pad_last)
    ids, masks, doc, _ = run(docs, spec, cuts)
    stream = stream_of(docs)
    starts, _ = window_starts(len(stream), seq_len, stride, final=True, pad_last=pad_last)
    expected = [(stream[s: s + seq_len] + [PAD] * seq_len)[:seq_len] for s in starts]
    assert ids.tolist() == expected  # batching never changes the result
    if len(stream) >= seq_len or pad_last:
        assert len(ids) >= 1
    # every window's doc id is the document its first token belongs to
    owner = [i for i, d in enumerate(docs) for _ in range(len(d) + 2)]
    assert doc.tolist() == [owner[s] for s in starts]
    if pad_last:  # every token is covered by some window
        covered = {s + k for s in starts for k in range(seq_len) if s + k < len(stream)}
        assert covered == set(range(len(stream)))


@settings(max_examples=100, deadline=None)
@given(docs=docs_st, seq_len=st.integers(2, 17))
def test_one_document_per_sequence(docs, seq_len):
    spec = PackSpec(seq_len=seq_len, stride=seq_len, pad_id=PAD, concat=False, pad_last=True)
    ids, masks, doc, _ = run(docs, spec)
    # each row holds tokens of exactly one document; concatenating a document's rows gives it back
    for i, d in enumerate(docs):
        rows = doc == i
        assert ids[rows][masks[rows] == 1].tolist() == [BOS, *d, EOS]
    assert len(ids) == sum(-(-(len(d) + 2) // seq_len) for d in docs)


def test_small_example():
    spec = PackSpec(seq_len=4, stride=4, pad_id=PAD, pad_last=True)
    ids, masks, doc, _ = run([[5, 6, 7], [8]], spec)
    assert ids.tolist() == [[1, 5, 6, 7], [2, 1, 8, 2]]
    ids, masks, doc, _ = run([[5, 6, 7], [8], [9]], spec)
    assert ids.tolist() == [[1, 5, 6, 7], [2, 1, 8, 2], [1, 9, 2, 0]] and masks[-1].tolist() == [1, 1, 1, 0]
    assert doc.tolist() == [0, 0, 2]


# -- framed documents (instruction data): the loss mask travels with its tokens --------------------

framed_st = st.lists(st.lists(st.tuples(st.integers(3, 50), st.integers(0, 1)), min_size=1, max_size=20),
                     min_size=1, max_size=25)


def run_framed(docs, spec, cuts=()):
    """Like `run`, for framed documents of (token, loss mask) pairs; returns (ids, attention, loss, doc)."""
    packer = Packer(spec, bos_id=BOS, eos_id=EOS)
    bounds = [0, *sorted({c % (len(docs) + 1) for c in cuts}), len(docs)]
    out = []
    for a, b in zip(bounds, bounds[1:]):
        part = docs[a:b]
        out += list(packer.feed([[t for t, _ in d] for d in part], list(range(a, b)),
                                masks=[[m for _, m in d] for d in part]))
    out += list(packer.finish())
    assert packer.tokens_in == sum(len(d) for d in docs)
    if not out:
        return np.zeros((0, spec.seq_len), np.int32), None, np.zeros((0, spec.seq_len), np.int8), np.zeros(0)
    cat = np.concatenate
    return (cat([p.input_ids for p in out]), cat([p.attention_mask for p in out]) if spec.has_mask else None,
            cat([p.loss_mask for p in out]), cat([p.doc_id for p in out]))


def windows_of(tokens, loss, spec):
    starts, _ = window_starts(len(tokens), spec.seq_len, spec.stride, final=True, pad_last=spec.pad_last)
    ids = [(tokens[s: s + spec.seq_len] + [PAD] * spec.seq_len)[:spec.seq_len] for s in starts]
    masks = [(loss[s: s + spec.seq_len] + [0] * spec.seq_len)[:spec.seq_len] for s in starts]
    return ids, masks, starts


@settings(max_examples=200, deadline=None)
@given(docs=framed_st, seq_len=st.integers(2, 17), data=st.data(), cuts=st.lists(st.integers(0, 30), max_size=4))
def test_loss_masks_travel_with_their_tokens(docs, seq_len, data, cuts):
    stride = data.draw(st.integers(1, seq_len))
    spec = PackSpec(seq_len=seq_len, stride=stride, pad_id=PAD, pad_last=data.draw(st.booleans()))
    ids, attention, loss, doc = run_framed(docs, spec, cuts)
    tokens = [t for d in docs for t, _ in d]  # framed: no BOS/EOS added
    want_ids, want_loss, starts = windows_of(tokens, [m for d in docs for _, m in d], spec)
    assert ids.tolist() == want_ids and loss.tolist() == want_loss  # whatever the batching
    assert loss.dtype == np.int8
    if attention is not None:
        assert (loss[attention == 0] == 0).all()  # padding never trains
    owner = [i for i, d in enumerate(docs) for _ in d]
    assert doc.tolist() == [owner[s] for s in starts]


@settings(max_examples=100, deadline=None)
@given(docs=framed_st, seq_len=st.integers(2, 17))
def test_framed_documents_one_per_sequence(docs, seq_len):
    spec = PackSpec(seq_len=seq_len, stride=seq_len, pad_id=PAD, concat=False, pad_last=True)
    ids, attention, loss, doc = run_framed(docs, spec)
    for i, d in enumerate(docs):
        rows = doc == i
        assert ids[rows][attention[rows] == 1].tolist() == [t for t, _ in d]
        assert loss[rows][attention[rows] == 1].tolist() == [m for _, m in d]
        assert (loss[rows][attention[rows] == 0] == 0).all()


def test_a_sequence_across_two_records_keeps_each_tokens_mask():
    spec = PackSpec(seq_len=4, stride=4, pad_id=PAD, pad_last=True)
    packer = Packer(spec, bos_id=BOS, eos_id=EOS)
    # record 0: BOS prompt(5) response(6, 7) EOS; record 1: BOS prompt(8) response(9) EOS — fed one at a time
    out = list(packer.feed([[1, 5, 6, 7, 2]], [0], masks=[[0, 0, 1, 1, 1]]))
    out += list(packer.feed([[1, 8, 9, 2]], [1], masks=[[0, 0, 1, 1]]))
    out += list(packer.finish())
    assert np.concatenate([p.input_ids for p in out]).tolist() == [[1, 5, 6, 7], [2, 1, 8, 9], [2, 0, 0, 0]]
    assert np.concatenate([p.loss_mask for p in out]).tolist() == [[0, 0, 1, 1], [1, 0, 0, 1], [1, 0, 0, 0]]
    with pytest.raises(ValueError, match="either all with loss masks"):
        list(packer.feed([[5]], [2]))
    plain = Packer(spec, bos_id=BOS, eos_id=EOS)
    assert all(p.loss_mask is None for p in [*plain.feed([[5, 6, 7]], [0]), *plain.finish()])
