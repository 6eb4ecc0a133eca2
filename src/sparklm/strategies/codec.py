"""What a round sends, encoded: pure functions from named float32 arrays to bytes and back.

Codecs (``train.rounds.codec``):

- ``fp32``: the arrays as they are (lossless; the default before codecs existed);
- ``bf16``: each value rounded to bfloat16 (half the bytes);
- ``int8`` / ``int4`` / ``int2``: each block of ``BLOCK`` values scaled by its largest magnitude and rounded to 8
  or 4 bits (two values per byte), or to -1, 0 or +1 times that magnitude in 2 bits (four per byte: the values
  above half the block's largest; error feedback carries the rest until they are), the scale kept in bfloat16;
- ``topk``: SparseLoCo's sparse deltas (Sarfi et al. 2025), tensor by tensor: a matrix (any tensor of 2+
  dimensions, as rows × last dimension) cut into tiles of ``chunk``×``chunk`` values (the matrix's own size where it
  is smaller), the ``density``·tile largest magnitudes of each tile kept with their position in the tile, and each
  value sent as its sign and the mean of its magnitude's bin, in one codebook per tensor
  (2^``bits`` levels: the kept magnitudes cut in equal-count bins; ``bits = 32`` keeps them in float32). Vectors (norms,
  biases: a few hundred values each) go whole in float32. Positions are Rice-coded: a tile's sorted positions as the
  gaps between them, each gap's low bits in fixed width and its high bits in unary (~8 bits a position at 1/64 of a
  64×64 tile, against 12 written plainly; numpy decodes the unary stream in one pass, where a general entropy coder
  would need a loop per value). :func:`sent_mask` says which values a payload carries, so
  an average over workers can count, per value, only those that sent it (:func:`sparse_mean`).

Every encoding is deterministic (the same array gives the same bytes: a retried task sends what its first
attempt would have), and decoding is exact for what was encoded: ``decode(encode(x))`` is the value a lossy
codec delivers, which error feedback subtracts from what the worker meant to send (``residual``). The payload
is a safetensors file (numpy), its metadata naming the codec and each array's shape, so nothing is unpickled.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

CODECS = ("fp32", "bf16", "int8", "int4", "int2", "topk")
BLOCK = 64  # values per scale of the int8/int4 codecs


@dataclass(frozen=True)
class Codec:
    name: str = "fp32"
    density: float = 1 / 64  # topk: the share of each tile's values kept
    bits: int = 3  # topk: bits per kept value (its sign and a magnitude bin: 1-8, or 32 for float32)
    chunk: int = 64  # topk: the side of a tile (64: 4,096 values, a position in 12 bits)

    def __post_init__(self) -> None:
        if self.name not in CODECS:
            raise ValueError(f"unknown codec {self.name!r}; one of {', '.join(CODECS)}")
        if not 0 < self.density <= 1 or not (1 <= self.bits <= 8 or self.bits == 32) or not 1 <= self.chunk <= 256:
            raise ValueError(f"bad codec settings: density {self.density}, bits {self.bits}, chunk {self.chunk}")

    @property
    def lossless(self) -> bool:
        return self.name == "fp32"

    def kept(self, size: int | None = None) -> int:
        """topk: values kept per tile of ``size`` values (a full tile by default)."""
        size = self.chunk * self.chunk if size is None else size
        return max(1, min(size, round(self.density * size)))

    def encode(self, arrays: Mapping[str, np.ndarray]) -> bytes:
        """The arrays, concatenated in name order into one vector (no per-tensor framing: a LoRA adapter has
        hundreds of small tensors), encoded; their names and shapes in the payload's metadata."""
        from safetensors.numpy import save

        names = sorted(arrays)
        for n in names:
            if not np.isfinite(arrays[n]).all():  # a diverged worker: no codec can scale it, nothing should apply it
                raise ValueError(f"non-finite value in {n!r} (NaN or infinity): the training diverged; "
                                 "lower the learning rate or set train.grad_clip")
        shapes = {n: list(np.shape(arrays[n])) for n in names}
        meta = {"codec": json.dumps({"name": self.name, "density": self.density, "bits": self.bits,
                                     "chunk": self.chunk, "shapes": shapes})}
        if self.name == "topk":  # tensor by tensor (tiles follow each matrix's rows and columns), in four arrays:
            # a LoRA adapter has hundreds of small tensors, and a safetensors entry each would outweigh their values
            pieces = [self._enc_tensor(np.asarray(arrays[n], np.float32)) for n in names]
            parts = {k: np.concatenate([p[k] for p in pieces if k in p] or [np.zeros(0, dt)])
                     for k, dt in (("d", np.float32), ("i", np.uint8), ("c", np.float32), ("q", np.uint8),
                                   ("v", np.float32), ("u", np.int64))}
            parts["u"] = unary_encode(parts["u"])  # every tensor's gap quotients in one bit stream
            return save(parts, metadata=meta)
        flat = np.concatenate([np.ascontiguousarray(arrays[n], np.float32).reshape(-1) for n in names]) if names \
            else np.zeros(0, np.float32)
        return save(getattr(self, f"_enc_{self.name}")(flat), metadata=meta)

    # -- the codecs: flat float32 → named arrays, and back ----------------------------------------------------

    def _enc_fp32(self, x: np.ndarray) -> dict:
        return {"v": x}

    def _dec_fp32(self, parts: dict, n: int) -> np.ndarray:
        return parts["v"]

    def _enc_bf16(self, x: np.ndarray) -> dict:
        return {"v": to_bf16(x)}

    def _dec_bf16(self, parts: dict, n: int) -> np.ndarray:
        return from_bf16(parts["v"])

    def _enc_int8(self, x: np.ndarray) -> dict:
        return _quantize_blocks(x, 127)

    def _dec_int8(self, parts: dict, n: int) -> np.ndarray:
        return _dequantize_blocks(parts["q"].astype(np.float32), parts["s"], n)

    def _enc_int4(self, x: np.ndarray) -> dict:
        parts = _quantize_blocks(x, 7)
        return {"q": pack_nibbles(parts["q"].astype(np.int16) + 8), "s": parts["s"]}

    def _dec_int4(self, parts: dict, n: int) -> np.ndarray:
        padded = -(-n // BLOCK) * BLOCK
        q = unpack_nibbles(parts["q"], padded).astype(np.float32) - 8
        return _dequantize_blocks(q, parts["s"], n)

    def _enc_int2(self, x: np.ndarray) -> dict:
        parts = _quantize_blocks(x, 1)
        return {"q": pack_bits((parts["q"] + 1).astype(np.uint8), 2), "s": parts["s"]}

    def _dec_int2(self, parts: dict, n: int) -> np.ndarray:
        padded = -(-n // BLOCK) * BLOCK
        q = unpack_bits(parts["q"], 2, padded).astype(np.float32) - 1
        return _dequantize_blocks(q, parts["s"], n)

    def tiles(self, shape: tuple[int, ...] | list[int]) -> tuple[int, int, int, int]:
        """topk: (rows, columns) of a tensor seen as a matrix, and of its tiles."""
        cols = int(shape[-1])
        rows = int(np.prod(shape[:-1]))
        return rows, cols, min(self.chunk, rows), min(self.chunk, cols)

    def part_sizes(self, shape: list[int]) -> dict[str, int]:
        """topk: how many entries of each array a tensor of ``shape`` takes (what :meth:`_enc_tensor` writes)."""
        size = int(np.prod(shape)) if shape else 1
        if len(shape) < 2 or size == 0:
            return {"d": size}
        rows, cols, tr, tc = self.tiles(shape)
        n = -(-rows // tr) * -(-cols // tc) * self.kept(tr * tc)
        out = {"i": -(-n * rice_bits(tr * tc, self.kept(tr * tc)) // 8), "u": n}  # u: quotients, not bytes
        if self.bits == 32:
            return {**out, "v": n}
        return {**out, "c": max(1, 2 ** self.bits // 2), "q": n if self.bits == 8 else -(-n * self.bits // 8)}

    def _enc_tensor(self, x: np.ndarray) -> dict:
        if x.ndim < 2 or x.size == 0:
            return {"d": x.reshape(-1)}  # a vector goes whole: its values are few and all matter
        rows, cols, tr, tc = self.tiles(x.shape)
        t = _to_tiles(x.reshape(rows, cols), tr, tc)  # (tiles, tr·tc)
        k = self.kept(tr * tc)
        # the k largest magnitudes of each tile, in position order (a stable sort: ties go to the earlier position)
        idx = np.sort(np.argsort(-np.abs(t), axis=1, kind="stable")[:, :k], axis=1)
        vals = np.take_along_axis(t, idx, axis=1).reshape(-1)
        gaps = np.diff(idx, axis=1, prepend=-1).reshape(-1) - 1  # sorted positions as the gaps between them
        b = rice_bits(tr * tc, k)
        parts = {"i": pack_bits(gaps & ((1 << b) - 1), b) if b else np.zeros(0, np.uint8), "u": gaps >> b}
        if self.bits == 32:
            return {**parts, "v": vals}
        book, codes = _codebook(vals, 2 ** self.bits)
        return {**parts, "c": book, "q": pack_bits(codes, self.bits)}

    def _dec_tensor(self, parts: dict, shape: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """(the values a tensor's parts carry, which of them were sent)."""
        if "d" in parts:
            return parts["d"].reshape(shape).copy(), np.ones(shape, bool)
        rows, cols, tr, tc = self.tiles(shape)
        count = -(-rows // tr) * -(-cols // tc)
        k = self.kept(tr * tc)
        b = rice_bits(tr * tc, k)
        low = unpack_bits(parts["i"], b, count * k).astype(np.int64) if b else 0
        gaps = (parts["u"].astype(np.int64) << b) + low  # u: the gaps' quotients (decoded by the caller)
        idx = (np.cumsum(gaps.reshape(count, k) + 1, axis=1) - 1)
        if idx.size and (idx.min() < 0 or idx.max() >= tr * tc):
            raise ValueError("a topk payload's positions fall outside their tile: the payload is damaged")
        if "v" in parts:
            vals = parts["v"]
        else:
            vals = _from_codebook(parts["c"], unpack_bits(parts["q"], self.bits, count * k))
        out = np.zeros((count, tr * tc), np.float32)
        sent = np.zeros((count, tr * tc), bool)
        np.put_along_axis(out, idx, vals.reshape(count, k), axis=1)
        np.put_along_axis(sent, idx, True, axis=1)
        return (_from_tiles(out, rows, cols, tr, tc).reshape(shape),
                _from_tiles(sent, rows, cols, tr, tc).reshape(shape))


def _to_tiles(m: np.ndarray, tr: int, tc: int) -> np.ndarray:
    """A matrix, zero-padded to whole tiles, as one row per tile (tiles in row-major order)."""
    rows, cols = m.shape
    pr, pc = -(-rows // tr) * tr, -(-cols // tc) * tc
    padded = np.zeros((pr, pc), m.dtype)
    padded[:rows, :cols] = m
    return padded.reshape(pr // tr, tr, pc // tc, tc).transpose(0, 2, 1, 3).reshape(-1, tr * tc)


def _from_tiles(t: np.ndarray, rows: int, cols: int, tr: int, tc: int) -> np.ndarray:
    pr, pc = -(-rows // tr) * tr, -(-cols // tc) * tc
    return t.reshape(pr // tr, pc // tc, tr, tc).transpose(0, 2, 1, 3).reshape(pr, pc)[:rows, :cols]


def rice_bits(size: int, k: int) -> int:
    """Low bits written plainly per gap between ``k`` sorted positions of ``size``: Rice's parameter for gaps of mean
    size/k (about log2 of 0.69 × the mean gap, the best for geometric gaps), never more than a plain position."""
    mean = size / max(k, 1)
    return max(0, min(int(size - 1).bit_length(), int(np.floor(np.log2(max(0.69 * mean, 1.0))))))


def unary_encode(q: np.ndarray) -> np.ndarray:
    """Non-negative integers in unary, packed little-endian: each ``v`` as ``v`` zero bits and a one."""
    q = np.asarray(q, np.int64)
    bits = np.zeros(int(q.sum()) + len(q), np.uint8)
    bits[np.cumsum(q + 1) - 1] = 1
    return np.packbits(bits, bitorder="little")


def unary_decode(packed: np.ndarray, n: int) -> np.ndarray:
    """The first ``n`` integers of a :func:`unary_encode` stream (every value ends at a one bit: one pass)."""
    ends = np.flatnonzero(np.unpackbits(packed, bitorder="little"))[:n]
    if len(ends) < n:
        raise ValueError("a topk payload's position stream is short: the payload is damaged")
    return np.diff(ends, prepend=-1) - 1


def _codebook(vals: np.ndarray, levels: int) -> tuple[np.ndarray, np.ndarray]:
    """``levels`` values standing for ``vals``: a sign bit and a magnitude bin. The magnitudes, sorted, are cut in
    ``levels / 2`` equal-count bins, each standing for its bin's mean (SparseLoCo's bin means: the levels follow the
    values' own spread). Returns (the bins' magnitudes, float32; each value's code: bin·2 + negative)."""
    bins = max(1, levels // 2)
    mags = np.abs(vals)
    order = np.argsort(mags, kind="stable")
    which = np.empty(len(vals), np.uint8)
    book = np.zeros(bins, np.float32)
    for j, members in enumerate(np.array_split(order, bins)):
        which[members] = j
        if len(members):
            book[j] = mags[members].astype(np.float64).mean()
    return book, (which * 2 + (vals < 0)).astype(np.uint8)


def _from_codebook(book: np.ndarray, codes: np.ndarray) -> np.ndarray:
    return np.where(codes % 2 == 1, -book[codes // 2], book[codes // 2]).astype(np.float32)


def decode(payload: bytes) -> dict[str, np.ndarray]:
    """The arrays an :meth:`Codec.encode` payload carries, as the codec delivers them (float32)."""

    return _decoded(payload)[0]


def sent_mask(payload: bytes) -> dict[str, np.ndarray] | None:
    """Which values a :meth:`Codec.encode` payload carries (bool arrays), or None when it carries them all."""
    return _decoded(payload)[1]


def _decoded(payload: bytes) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray] | None]:
    from safetensors.numpy import load

    meta = json.loads(_metadata(payload)["codec"])
    codec = Codec(name=meta["name"], density=meta["density"], bits=meta["bits"], chunk=meta["chunk"])
    if codec.name == "topk":
        parts, at = load(payload), dict.fromkeys("dicqvu", 0)
        sizes = {name: codec.part_sizes(shape) for name, shape in meta["shapes"].items()}
        parts["u"] = unary_decode(parts["u"], sum(z.get("u", 0) for z in sizes.values()))
        values, masks = {}, {}
        for name, shape in meta["shapes"].items():  # each tensor's share of the arrays, from its shape
            mine = {}
            for k, size in sizes[name].items():
                mine[k] = parts[k][at[k]:at[k] + size]
                at[k] += size
            values[name], masks[name] = codec._dec_tensor(mine, shape)
        return values, masks
    sizes = {name: int(np.prod(shape)) if shape else 1 for name, shape in meta["shapes"].items()}
    flat = getattr(codec, f"_dec_{codec.name}")(load(payload), sum(sizes.values()))
    out, at = {}, 0
    for name, shape in meta["shapes"].items():  # name order, as encoded
        out[name] = flat[at:at + sizes[name]].reshape(shape).copy()
        at += sizes[name]
    return out, None


def sparse_mean(payloads: Sequence[bytes], weights: Sequence[float], *, senders: bool = True
                ) -> dict[str, np.ndarray]:
    """The workers' average of their encoded deltas (each already multiplied by its weight, the tokens it trained),
    in float32, in the order given. ``senders``: each value divided by the weights of the workers that sent it
    (SparseLoCo: at 1-3% density almost no value is sent by two workers, and dividing by all of them would shrink
    every update R-fold); else by the total weight."""
    total: dict[str, np.ndarray] = {}
    count: dict[str, np.ndarray] = {}
    for payload, w in zip(payloads, weights, strict=True):
        values, masks = _decoded(payload)
        for n, v in values.items():
            got = np.float32(w) * (masks[n] if masks is not None and senders else np.ones(v.shape, bool))
            total[n] = v.astype(np.float32) if n not in total else total[n] + v
            count[n] = got.astype(np.float32) if n not in count else count[n] + got
    return {n: np.divide(total[n], count[n], out=np.zeros_like(total[n]), where=count[n] > 0) for n in total}


def encode_forward(payloads: Sequence[bytes], weights: Sequence[float], *, workers: Sequence[int], lr: float,
                   senders: bool) -> bytes:
    """The downlink that forwards the workers' own payloads (SparseLoCo's all-gather; ``workers``: whose they are):
    every side computes the same outer step from them with :func:`apply_update` (plain SGD: ``θ − lr·mean``), so the
    weights stay bit-identical on the driver and every worker with no second encoding and nothing kept back."""
    from safetensors.numpy import save

    arrays = {f"p{i:05d}": np.frombuffer(p, np.uint8) for i, p in enumerate(payloads)}
    meta = {"forward": json.dumps({"weights": [float(w) for w in weights], "workers": [int(w) for w in workers],
                                   "lr": lr, "senders": senders})}
    return save(arrays, metadata=meta)


def forward_without(bundle: bytes, worker: int) -> bytes:
    """A forward downlink as ``worker`` needs it: without the payload it sent itself (it kept its own copy; its
    SHA-256 stays, to check that copy). An all-gather's bytes: a worker reads only the others' payloads."""
    from safetensors.numpy import load, save

    info = json.loads(_metadata(bundle)["forward"])
    if worker not in info["workers"]:
        return bundle  # it sent nothing last round (a worker that failed, or one a resize added): it needs them all
    parts = load(bundle)
    key = f"p{info['workers'].index(worker):05d}"
    info["own"] = {"key": key, "sha256": hashlib.sha256(parts.pop(key).tobytes()).hexdigest()}
    return save(parts, metadata={"forward": json.dumps(info)})


class MissingOwn(ValueError):
    """A :func:`forward_without` downlink applied without its reader's own payload (or with another one)."""


def needs_own(payload: bytes) -> bool:
    """Whether a downlink left out its reader's own payload (:func:`forward_without`)."""
    meta = _metadata(payload)
    return "forward" in meta and "own" in json.loads(meta["forward"])


def _metadata(payload: bytes) -> dict:
    """A safetensors payload's ``__metadata__`` (its header is a little-endian length and JSON)."""
    size = int.from_bytes(payload[:8], "little")
    return json.loads(payload[8:8 + size]).get("__metadata__", {})


# -- pieces, pure and tested on their own -----------------------------------------------------------------------


def to_bf16(x: np.ndarray) -> np.ndarray:
    """float32 → bfloat16 bit patterns (uint16), rounded to nearest, ties to even (as torch rounds)."""
    bits = x.astype(np.float32).view(np.uint32)
    rounded = bits + (np.uint32(0x7FFF) + ((bits >> 16) & 1))
    out = (rounded >> 16).astype(np.uint16)
    nan = np.isnan(x)
    out[nan] = 0x7FC0
    return out


def from_bf16(b: np.ndarray) -> np.ndarray:
    return (b.astype(np.uint32) << 16).view(np.float32)


def _quantize_blocks(x: np.ndarray, top: int) -> dict:
    n = len(x)
    padded = np.zeros(-(-n // BLOCK) * BLOCK, np.float32)
    padded[:n] = x
    blocks = padded.reshape(-1, BLOCK)
    scale = scale_bf16(np.abs(blocks).max(axis=1) / top)
    safe = np.where(scale > 0, from_bf16(scale), 1.0)[:, None]
    q = np.clip(np.rint(blocks / safe), -top, top).astype(np.int8)
    return {"q": q.reshape(-1), "s": scale}


def _dequantize_blocks(q: np.ndarray, scale: np.ndarray, n: int) -> np.ndarray:
    return (q.reshape(-1, BLOCK) * from_bf16(scale)[:, None]).reshape(-1)[:n]


def scale_bf16(scale: np.ndarray) -> np.ndarray:
    """Non-negative scales as bfloat16 bit patterns, rounded up (never below the value: no code is clipped).
    bfloat16, not float16: a round's deltas are often below float16's smallest normal number (6e-5), where
    float16 loses its precision, while bfloat16 has float32's range."""
    s = np.ascontiguousarray(scale, np.float32)
    b = to_bf16(s)
    return np.where(from_bf16(b) < s, b + np.uint16(1), b).astype(np.uint16)


def pack_nibbles(v: np.ndarray) -> np.ndarray:
    """Values 0-15, two to a byte (the first in the low half)."""
    return pack_bits(v.astype(np.uint8), 4)


def unpack_nibbles(b: np.ndarray, n: int) -> np.ndarray:
    return unpack_bits(b, 4, n)


def pack_bits(codes: np.ndarray, bits: int) -> np.ndarray:
    """Codes of ``bits`` bits each (< 2**bits, up to 16 bits), packed little-endian into bytes."""
    if bits == 8:
        return codes.astype(np.uint8)
    wide = np.uint16 if bits > 8 else np.uint8
    planes = ((codes.astype(wide)[:, None] >> np.arange(bits, dtype=wide)) & 1).astype(np.uint8).reshape(-1)
    return np.packbits(planes, bitorder="little")


def unpack_bits(b: np.ndarray, bits: int, n: int) -> np.ndarray:
    if bits == 8:
        return b[:n].astype(np.uint8)
    wide = np.uint16 if bits > 8 else np.uint8
    planes = np.unpackbits(b, bitorder="little")[:n * bits].reshape(n, bits).astype(wide)
    return (planes << np.arange(bits, dtype=wide)).sum(axis=1).astype(wide)


# -- the driver's update to the workers: the weights that changed, exactly ----------------------------------------

UPDATE_CHUNK = 256  # positions per chunk of an update: a position within a chunk fits in one byte


def encode_update(old: Mapping[str, np.ndarray], new: Mapping[str, np.ndarray]) -> bytes:
    """The entries of ``new`` that differ from ``old`` (the weights a worker holds from the last round), as their
    float32 values with, per chunk of :data:`UPDATE_CHUNK` positions, a count and one byte per position. A worker
    sets them and holds ``new`` exactly: no arithmetic on its side, so nothing drifts between it and the driver."""
    from safetensors.numpy import save

    out, shapes = {}, {}
    for name, b in new.items():
        a = np.ascontiguousarray(old[name], np.float32).reshape(-1)
        b = np.ascontiguousarray(b, np.float32).reshape(-1)
        changed = np.flatnonzero(a.view(np.uint32) != b.view(np.uint32))  # bit patterns: -0.0 and NaN count too
        chunks = -(-len(b) // UPDATE_CHUNK)
        counts = np.bincount(changed // UPDATE_CHUNK, minlength=chunks)
        shapes[name] = list(np.shape(new[name]))
        if counts.max(initial=0) > 255:  # a chunk changed whole: positions need more than a byte's count
            out[f"{name}::v"] = b
            continue
        out[f"{name}::n"] = counts.astype(np.uint8)
        out[f"{name}::i"] = (changed % UPDATE_CHUNK).astype(np.uint8)
        out[f"{name}::v"] = b[changed]
    return save(out, metadata={"update": json.dumps({"shapes": shapes})})


def digest(arrays: Mapping) -> str:
    """SHA-256 of named float32 arrays (or tensors), in name order: whether two copies of the weights are equal."""
    h = hashlib.sha256()
    for name in sorted(arrays):
        a = arrays[name]
        a = a.detach().cpu().numpy() if hasattr(a, "detach") else a
        h.update(name.encode())
        h.update(np.ascontiguousarray(a, np.float32).tobytes())
    return h.hexdigest()


def apply_update(old: Mapping[str, np.ndarray], payload: bytes, own: bytes | None = None) -> dict[str, np.ndarray]:
    """``old`` with an update applied (new arrays; ``old`` is left as it is): an :func:`encode_update` payload (the
    changed weights, set), a :meth:`Codec.encode` payload of a step (decoded and added in float32: the driver
    computes its own copy with this same function, so every worker holds bit for bit what the driver holds), or a
    forward downlink (``own``: the reader's own payload, where :func:`forward_without` left it out)."""
    from safetensors.numpy import load

    meta = _metadata(payload)
    if "codec" in meta:
        step = decode(payload)
        return {n: np.add(np.asarray(old[n], np.float32), step[n]) for n in step}
    if "forward" in meta:
        info, parts = json.loads(meta["forward"]), load(payload)
        if "own" in info:
            if own is None or hashlib.sha256(own).hexdigest() != info["own"]["sha256"]:
                raise MissingOwn("this forward downlink needs the reader's own payload of the last round")
            parts[info["own"]["key"]] = np.frombuffer(own, np.uint8)
        mean = sparse_mean([parts[k].tobytes() for k in sorted(parts)], info["weights"], senders=info["senders"])
        return {n: np.asarray(old[n], np.float32) - np.float32(info["lr"]) * mean[n] for n in mean}
    shapes = json.loads(meta["update"])["shapes"]
    parts = load(payload)
    out = {}
    for name, shape in shapes.items():
        if f"{name}::n" not in parts:
            out[name] = parts[f"{name}::v"].reshape(shape)
            continue
        flat = np.array(old[name], np.float32).reshape(-1)
        counts = parts[f"{name}::n"].astype(np.int64)
        starts = np.repeat(np.arange(len(counts)) * UPDATE_CHUNK, counts)
        flat[starts + parts[f"{name}::i"].astype(np.int64)] = parts[f"{name}::v"]
        out[name] = flat.reshape(shape)
    return out
