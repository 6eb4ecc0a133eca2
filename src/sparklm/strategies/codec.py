"""What a round sends, encoded: pure functions from named float32 arrays to bytes and back.

Codecs (``train.rounds.codec``):

- ``fp32``: the arrays as they are (lossless; the default before codecs existed);
- ``bf16``: each value rounded to bfloat16 (half the bytes);
- ``int8`` / ``int4`` / ``int2``: each block of ``BLOCK`` values scaled by its largest magnitude and rounded to 8
  or 4 bits (two values per byte), or to -1, 0 or +1 times that magnitude in 2 bits (four per byte: the values
  above half the block's largest; error feedback carries the rest until they are), the scale kept in bfloat16;
- ``topk``: chunk-wise Top-k (SparseLoCo, Sarfi et al. 2025): the flattened array cut into chunks of ``chunk``
  values, the ``density``·chunk largest magnitudes of each kept with their position in the chunk (one byte when a
  chunk holds at most 256 values), and those values rounded to ``bits`` bits around a per-chunk bfloat16 scale
  (uniform symmetric levels, 2 bits: ±0.5 and ±1.5 times the scale); ``bits = 32`` keeps them in float32.

Every encoding is deterministic (the same array gives the same bytes: a retried task sends what its first
attempt would have), and decoding is exact for what was encoded: ``decode(encode(x))`` is the value a lossy
codec delivers, which error feedback subtracts from what the worker meant to send (``residual``). The payload
is a safetensors file (numpy), its metadata naming the codec and each array's shape, so nothing is unpickled.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

CODECS = ("fp32", "bf16", "int8", "int4", "int2", "topk")
BLOCK = 64  # values per scale of the int8/int4 codecs


@dataclass(frozen=True)
class Codec:
    name: str = "fp32"
    density: float = 0.01  # topk: the share of each chunk's values kept
    bits: int = 2  # topk: bits per kept value (2-8, or 32 for float32)
    chunk: int = 256  # topk: values per chunk (≤ 256: a position fits in one byte)

    def __post_init__(self) -> None:
        if self.name not in CODECS:
            raise ValueError(f"unknown codec {self.name!r}; one of {', '.join(CODECS)}")
        if not 0 < self.density <= 1 or not (2 <= self.bits <= 8 or self.bits == 32) or not 1 <= self.chunk <= 65536:
            raise ValueError(f"bad codec settings: density {self.density}, bits {self.bits}, chunk {self.chunk}")

    @property
    def lossless(self) -> bool:
        return self.name == "fp32"

    def kept(self) -> int:
        """topk: values kept per chunk."""
        return max(1, min(self.chunk, round(self.density * self.chunk)))

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
        flat = np.concatenate([np.ascontiguousarray(arrays[n], np.float32).reshape(-1) for n in names]) if names \
            else np.zeros(0, np.float32)
        meta = {"codec": json.dumps({"name": self.name, "density": self.density, "bits": self.bits,
                                     "chunk": self.chunk, "shapes": shapes})}
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

    def _enc_topk(self, x: np.ndarray) -> dict:
        c, k = self.chunk, self.kept()
        chunks = -(-len(x) // c)
        m = np.zeros(chunks * c, np.float32)
        m[:len(x)] = x
        m = m.reshape(chunks, c)
        # the k largest magnitudes of each chunk, in position order (a stable sort: ties go to the earlier position)
        order = np.argsort(-np.abs(m), axis=1, kind="stable")[:, :k]
        idx = np.sort(order, axis=1)
        vals = np.take_along_axis(m, idx, axis=1)
        parts = {"i": idx.astype(np.uint8 if c <= 256 else np.uint16)}
        if self.bits == 32:
            parts["v"] = vals
            return parts
        levels = 2 ** self.bits
        half = (levels - 1) / 2  # codes 0..L-1 stand for (code - half) * scale
        scale = scale_bf16(np.abs(vals).max(axis=1) / half)
        safe = np.where(scale > 0, from_bf16(scale), 1.0)[:, None]
        codes = np.clip(np.rint(vals / safe + half), 0, levels - 1).astype(np.uint8)
        parts["s"] = scale
        parts["q"] = pack_bits(codes.reshape(-1), self.bits)
        return parts

    def _dec_topk(self, parts: dict, n: int) -> np.ndarray:
        c = self.chunk
        idx = parts["i"].astype(np.int64)
        chunks, k = idx.shape
        if "v" in parts:
            vals = parts["v"]
        else:
            levels = 2 ** self.bits
            codes = unpack_bits(parts["q"], self.bits, chunks * k).reshape(chunks, k).astype(np.float32)
            vals = (codes - (levels - 1) / 2) * from_bf16(parts["s"])[:, None]
        out = np.zeros((chunks, c), np.float32)
        np.put_along_axis(out, idx, vals, axis=1)
        return out.reshape(-1)[:n]


def decode(payload: bytes) -> dict[str, np.ndarray]:
    """The arrays an :meth:`Codec.encode` payload carries, as the codec delivers them (float32)."""
    from safetensors.numpy import load

    meta = json.loads(_metadata(payload)["codec"])
    codec = Codec(name=meta["name"], density=meta["density"], bits=meta["bits"], chunk=meta["chunk"])
    sizes = {name: int(np.prod(shape)) if shape else 1 for name, shape in meta["shapes"].items()}
    flat = getattr(codec, f"_dec_{codec.name}")(load(payload), sum(sizes.values()))
    out, at = {}, 0
    for name, shape in meta["shapes"].items():  # name order, as encoded
        out[name] = flat[at:at + sizes[name]].reshape(shape).copy()
        at += sizes[name]
    return out


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
    """Codes of ``bits`` bits each (< 2**bits), packed little-endian into bytes."""
    if bits == 8:
        return codes.astype(np.uint8)
    planes = ((codes[:, None] >> np.arange(bits, dtype=np.uint8)) & 1).astype(np.uint8).reshape(-1)
    return np.packbits(planes, bitorder="little")


def unpack_bits(b: np.ndarray, bits: int, n: int) -> np.ndarray:
    if bits == 8:
        return b[:n].astype(np.uint8)
    planes = np.unpackbits(b, bitorder="little")[:n * bits].reshape(n, bits)
    return (planes << np.arange(bits, dtype=np.uint8)).sum(axis=1).astype(np.uint8)


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
    import hashlib

    h = hashlib.sha256()
    for name in sorted(arrays):
        a = arrays[name]
        a = a.detach().cpu().numpy() if hasattr(a, "detach") else a
        h.update(name.encode())
        h.update(np.ascontiguousarray(a, np.float32).tobytes())
    return h.hexdigest()


def apply_update(old: Mapping[str, np.ndarray], payload: bytes) -> dict[str, np.ndarray]:
    """``old`` with an update applied (new arrays; ``old`` is left as it is): an :func:`encode_update` payload (the
    changed weights, set) or a :meth:`Codec.encode` payload of a step (decoded and added in float32: the driver
    computes its own copy with this same function, so every worker holds bit for bit what the driver holds)."""
    from safetensors.numpy import load

    meta = _metadata(payload)
    if "codec" in meta:
        step = decode(payload)
        return {n: np.add(np.asarray(old[n], np.float32), step[n]) for n in step}
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
