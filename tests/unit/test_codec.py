"""The round codecs as pure functions: exact where lossless, bounded where not, deterministic, compact."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from sparklm.strategies.codec import (
    Codec,
    apply_update,
    decode,
    encode_forward,
    forward_without,
    from_bf16,
    needs_own,
    pack_bits,
    rice_bits,
    sent_mask,
    sparse_mean,
    to_bf16,
    unary_decode,
    unary_encode,
    unpack_bits,
)

FLOATS = st.floats(-1e3, 1e3, allow_nan=False, width=32)


def _delta(seed: int = 0) -> dict[str, np.ndarray]:
    g = np.random.default_rng(seed)
    return {"w": g.standard_normal((64, 48)).astype(np.float32) * 1e-3, "b": g.standard_normal(17).astype(np.float32),
            "s": np.array(0.5, np.float32)}


@given(arrays(np.float32, st.integers(1, 300), elements=FLOATS))
@settings(max_examples=60, deadline=None)
def test_fp32_is_exact_and_bf16_rounds_as_torch(x):
    assert np.array_equal(decode(Codec("fp32").encode({"x": x}))["x"], x)
    want = torch.from_numpy(x).to(torch.bfloat16).float().numpy()
    assert np.array_equal(from_bf16(to_bf16(x)), want)
    assert np.array_equal(decode(Codec("bf16").encode({"x": x}))["x"], want)


@pytest.mark.parametrize("name,top", [("int8", 127), ("int4", 7), ("int2", 1)])
@given(x=arrays(np.float32, st.integers(1, 300), elements=FLOATS))
@settings(max_examples=40, deadline=None)
def test_block_quantizers_err_at_most_half_a_step(name, top, x):
    got = decode(Codec(name).encode({"x": x}))["x"]
    pad = np.zeros(-(-len(x) // 64) * 64, np.float32)
    pad[:len(x)] = x
    step = np.repeat(np.abs(pad.reshape(-1, 64)).max(axis=1) / top, 64)[:len(x)]
    # bfloat16 scales, rounded up: at most 1/128 coarser; below float32's normal range a scale underflows to 0
    assert np.all(np.abs(got - x) <= step * 0.5 * 1.01 + 1e-37)


def _tiles(m: np.ndarray, side: int):
    for r in range(0, m.shape[0], side):
        for c in range(0, m.shape[1], side):
            yield m[r:r + side, c:c + side], (slice(r, r + side), slice(c, c + side))


@given(x=arrays(np.float32, st.tuples(st.integers(1, 150), st.integers(1, 150)), elements=FLOATS),
       density=st.sampled_from([0.01, 0.05, 0.3, 1.0]), side=st.sampled_from([8, 64]))
@settings(max_examples=60, deadline=None)
def test_topk_keeps_each_tiles_largest_values(x, density, side):
    codec = Codec("topk", density=density, bits=32, chunk=side)
    payload = codec.encode({"x": x})
    got, sent = decode(payload)["x"], sent_mask(payload)["x"]
    tr, tc = min(side, x.shape[0]), min(side, x.shape[1])
    k = codec.kept(tr * tc)
    for part, where in _tiles(x, side) if x.shape[0] >= side and x.shape[1] >= side else [(x, ...)]:
        if part.shape != (tr, tc):
            continue  # an edge tile: zero-padded, kept values may fall on the padding
        out, kept = got[where], sent[where]
        assert kept.sum() == k
        assert np.array_equal(out[kept], part[kept])  # float32 values: exact
        if (~kept).any():
            assert np.abs(part[~kept]).max() <= np.abs(part[kept]).min()
    assert np.all(got[~sent] == 0)


def test_topk_two_bits_is_compact_and_within_its_levels():
    """Per tensor: a matrix in 64×64 tiles, Rice-coded positions (under 8 bits each at 1/32 of a tile, where a plain
    position takes 12), a sign and one of two magnitudes per kept value; a vector or scalar whole."""
    g = np.random.default_rng(1)
    d = {"w": g.standard_normal((256, 192)).astype(np.float32) * 1e-3, "e": g.standard_normal((300, 64)).astype(np.float32),
         "b": g.standard_normal(17).astype(np.float32), "s": np.array(0.5, np.float32)}
    codec = Codec("topk", density=1 / 32, bits=2)
    payload = codec.encode(d)
    got, sent = decode(payload), sent_mask(payload)
    assert {n: a.shape for n, a in got.items()} == {n: a.shape for n, a in d.items()}
    assert np.array_equal(got["b"], d["b"]) and got["s"] == d["s"] and sent["b"].all()
    kept = sum(int(sent[m].sum()) for m in ("w", "e"))  # 12 tiles of w, 5 of e (its last row of tiles padded)
    assert kept == 17 * 128
    assert len(payload) <= kept * (8 + 2) / 8 + 4 * (17 + 1 + 2 * 2) + 1024  # positions, codes, vectors, header
    for name in ("w", "e"):
        kept = sent[name]
        assert kept.sum() == codec.kept() * (-(-d[name].shape[0] // 64)) * (-(-d[name].shape[1] // 64))
        assert np.all(np.sign(got[name][kept]) == np.sign(d[name][kept]))
        mags = np.unique(np.abs(got[name][kept]))
        assert len(mags) == 2  # two magnitude bins
        assert np.abs(d[name][kept]).min() <= mags.min() and mags.max() <= np.abs(d[name][kept]).max()


def test_the_average_counts_only_the_workers_that_sent_a_value():
    """SparseLoCo's average: a value one of two workers sent moves as far as that worker asked, not half as far."""
    a = np.zeros((64, 64), np.float32)
    b = np.zeros((64, 64), np.float32)
    a[0, :4], b[1, :4], a[2, 0], b[2, 0] = 1.0, 2.0, 3.0, 5.0
    codec = Codec("topk", density=5 / 4096, bits=32)
    pa, pb = codec.encode({"x": a, "v": np.ones(3, np.float32)}), codec.encode({"x": b, "v": np.ones(3, np.float32)})
    senders = sparse_mean([pa, pb], [1.0, 1.0])
    assert np.array_equal(senders["x"][0, :4], np.ones(4)) and np.array_equal(senders["x"][1, :4], 2 * np.ones(4))
    assert senders["x"][2, 0] == 4.0 and np.count_nonzero(senders["x"]) == 9 and np.array_equal(senders["v"], np.ones(3))
    everyone = sparse_mean([pa, pb], [1.0, 1.0], senders=False)
    assert np.array_equal(everyone["x"], (a + b) / 2)
    weighted = sparse_mean([pa, pb], [0.5, 1.0])  # the deltas arrive already multiplied by their tokens' weight
    assert weighted["x"][0, 0] == 2.0 and np.isclose(weighted["x"][2, 0], 8 / 1.5)


def test_the_forwarded_payloads_give_every_side_the_same_weights():
    g = np.random.default_rng(2)
    held = {"x": g.standard_normal((70, 130)).astype(np.float32), "v": g.standard_normal(9).astype(np.float32)}
    deltas = [{n: g.standard_normal(a.shape).astype(np.float32) for n, a in held.items()} for _ in range(3)]
    payloads = [Codec("topk", density=0.02, bits=2).encode(d) for d in deltas]
    bundle = encode_forward(payloads, [1.0, 0.9, 1.0], workers=[0, 2, 3], lr=1.0, senders=True)
    driver = apply_update(held, bundle)
    worker = apply_update({n: a.copy() for n, a in held.items()}, bytes(bundle))
    assert all(np.array_equal(driver[n], worker[n]) for n in held)
    mean = sparse_mean(payloads, [1.0, 0.9, 1.0])
    assert all(np.array_equal(driver[n], held[n] - mean[n]) for n in held)
    assert len(bundle) < sum(len(p) for p in payloads) + 1024
    # an all-gather: worker 2 reads the others' payloads and puts back its own, and ends bit for bit where all do
    mine = forward_without(bundle, 2)
    assert needs_own(mine) and len(mine) < len(bundle) - len(payloads[1]) + 256
    got = apply_update({n: a.copy() for n, a in held.items()}, mine, own=payloads[1])
    assert all(np.array_equal(driver[n], got[n]) for n in held)
    with pytest.raises(ValueError, match="own payload"):
        apply_update(held, mine, own=payloads[0])
    with pytest.raises(ValueError, match="own payload"):
        apply_update(held, mine)
    assert forward_without(bundle, 1) == bundle and not needs_own(bundle)  # worker 1 sent nothing: all


@pytest.mark.parametrize("name", ["fp32", "bf16", "int8", "int4", "int2", "topk"])
def test_every_codec_is_deterministic_and_smaller_than_the_last(name):
    d = _delta(3)
    a, b = Codec(name).encode(d), Codec(name).encode({k: v.copy() for k, v in d.items()})
    assert a == b  # a retried task sends the same bytes
    sizes = {c: len(Codec(c).encode(d)) for c in ("fp32", "bf16", "int8", "int4", "int2", "topk")}
    assert sizes["fp32"] > sizes["bf16"] > sizes["int8"] > sizes["int4"] > sizes["int2"] > sizes["topk"]


@given(st.lists(st.integers(0, 300), max_size=200))
def test_unary_round_trips_and_a_short_stream_is_refused(values):
    q = np.array(values, np.int64)
    packed = unary_encode(q)
    assert len(packed) == -(-(int(q.sum()) + len(q)) // 8)
    assert np.array_equal(unary_decode(packed, len(q)), q)
    with pytest.raises(ValueError, match="damaged"):
        unary_decode(packed, len(q) + 1)


@pytest.mark.parametrize("size,k", [(4096, 64), (4096, 128), (4096, 4096), (12, 1), (1, 1), (100, 3), (1024, 16)])
def test_rice_positions_beat_plain_ones_at_low_density(size, k):
    """The Rice parameter never costs more low bits than a plain position, and positions of ``k`` of ``size`` (drawn
    at random, as Top-k's are near enough) take fewer bits than plain ones once k is a few percent of the tile."""
    plain = max(1, (size - 1).bit_length())
    b = rice_bits(size, k)
    assert 0 <= b <= plain
    idx = np.sort(np.random.default_rng(size + k).choice(size, k, replace=False))
    gaps = np.diff(idx, prepend=-1) - 1
    cost = k * (b + 1) + int((gaps >> b).sum())
    if 16 <= k <= size // 32:  # (a handful of positions gains less: the stream's last gap is long)
        assert cost < 0.8 * k * plain


@given(st.integers(1, 16), st.lists(st.integers(0, 65535), min_size=1, max_size=200))
def test_bit_packing_round_trips(bits, values):
    codes = np.array([v % (2 ** bits) for v in values], np.uint16 if bits > 8 else np.uint8)
    packed = pack_bits(codes, bits)
    assert len(packed) == -(-len(codes) * bits // 8)
    assert np.array_equal(unpack_bits(packed, bits, len(codes)), codes)


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="unknown codec"):
        Codec("zip")
    with pytest.raises(ValueError, match="bad codec settings"):
        Codec("topk", density=0.0)


@given(st.integers(0, 2000), st.floats(0.0, 1.0), st.integers(0, 10))
@settings(max_examples=60, deadline=None)
def test_an_update_carries_exactly_the_changed_weights(n, share, seed):
    from sparklm.strategies.codec import apply_update, encode_update

    g = np.random.default_rng(seed)
    old = {"w": g.standard_normal(n).astype(np.float32), "m": g.standard_normal((3, 5)).astype(np.float32)}
    new = {k: v.copy() for k, v in old.items()}
    hit = g.random(n) < share
    new["w"][hit] -= 1e-3 * g.standard_normal(hit.sum()).astype(np.float32)
    payload = encode_update(old, new)
    got = apply_update(old, payload)
    assert all(np.array_equal(got[k].view(np.uint32), new[k].view(np.uint32)) for k in new)
    if share < 0.05 and n >= 1000:
        assert len(payload) < 0.25 * sum(v.nbytes for v in new.values()) + 400


@pytest.mark.parametrize("name", ["int8", "int4", "int2", "topk"])
def test_an_encoded_step_lands_bit_for_bit_and_the_driver_keeps_what_it_did_not_send(name):
    """The driver's side of a round with downlink = codec: it encodes the step from the weights the workers hold
    (h) to its exact weights (x), and both sides compute h + decode with the same function: equal bits. What one
    step does not deliver stays in x - h, so over steps the workers' weights follow the exact ones."""
    from sparklm.strategies.codec import apply_update

    codec = Codec(name, density=0.05, bits=2)
    g = np.random.default_rng(7)
    held = {"w": g.standard_normal(1000).astype(np.float32), "b": g.standard_normal(3).astype(np.float32)}
    exact = {n: a.copy() for n, a in held.items()}
    for _ in range(30):
        exact = {n: a - 0.01 * g.standard_normal(a.shape).astype(np.float32) for n, a in exact.items()}
        payload = codec.encode({n: exact[n] - held[n] for n in exact})
        driver = apply_update(held, payload)
        worker = apply_update({n: a.copy() for n, a in held.items()}, bytes(payload))
        assert all(np.array_equal(driver[n], worker[n]) for n in driver)
        assert all(np.array_equal(driver[n], held[n] + decode(payload)[n]) for n in driver)
        held = driver
    # bounded by what a step can leave behind (the 30 steps moved each weight by ~0.05), not growing with them
    assert np.abs(exact["w"] - held["w"]).max() < 0.1


def test_non_finite_values_are_refused_in_one_line():
    for bad in (np.nan, np.inf):
        d = _delta()
        d["b"][5] = bad
        with pytest.raises(ValueError, match="non-finite value in 'b'"):
            Codec("int4").encode(d)


@pytest.mark.parametrize("name", ["fp32", "bf16", "int8", "int4", "int2", "topk"])
def test_empty_and_odd_sized_tensors_keep_their_shapes(name):
    arrays = {"empty": np.zeros((0, 3), np.float32), "odd": np.arange(7, dtype=np.float32).reshape(7, 1),
              "scalar": np.array(2.0, np.float32)}
    got = decode(Codec(name).encode(arrays))
    assert {n: a.shape for n, a in got.items()} == {n: a.shape for n, a in arrays.items()}
    assert decode(Codec(name).encode({})) == {}
