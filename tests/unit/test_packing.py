"""Packing is pure: properties over random documents, batchings and window settings."""

import numpy as np
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
