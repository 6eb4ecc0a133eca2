"""Benchmark: how fast the round codecs encode and decode (strategies/codec.py), and what that and their measured
bytes mean for a round's time on real links — the step-time model of BENCHMARKS.md, extended to codecs.

    .venv/bin/python benchmarks/codec_speed.py

Speed: a delta of P float32 values (normal, scale 1e-3, as round deltas are), P = 5.3 M (the benchmarks' model),
10 M and 135 M, one process, 1 thread, median of 3: encode, decode, and the driver's step to the workers: for the
dense codecs (downlink codec) the driver encodes its step once and both it and every worker decode and add it
(encode + 2 decodes on the critical path); for Top-k (downlink exact) encode_update / apply_update of the weights
a 2-worker union changes. Bytes per parameter per round and worker are the ones measured by
benchmarks/strategies.py (BENCHMARKS.md, "What a round sends"). The model then prices a round for N = 8 workers
on 25 Gbit/s, 1 Gbit/s and 100 Mbit/s links and P = 10 M, 135 M, 1 B (codec times scaled linearly from 135 M),
against DDP's ring all-reduce every step.
"""
from __future__ import annotations

import math
import statistics
import time

import numpy as np
import torch

from sparklm.strategies.codec import Codec, apply_update, decode, encode_update

torch.set_num_threads(1)

# bits per parameter per round and worker, measured at 256 steps (out: what a worker reads; back: what it sends);
# int4 both ways is the diloco default (the driver's step int4-encoded too, train.rounds.downlink codec)
MEASURED = {"fp32": (32.0, 32.0), "int4": (4.254, 4.254), "topk 1%": (0.953, 0.184), "topk 3%": (2.430, 0.379)}
H = {"fp32": 32, "int4": 32, "topk 1%": 32, "topk 3%": 16}  # fp32 and int4 at the default H; Top-k where measured
LINKS = {"25 Gbit/s": (25e9 / 8, 50e-6), "1 Gbit/s": (1e9 / 8, 500e-6), "100 Mbit/s": (100e6 / 8, 20e-3)}
N = 8


def timed(fn) -> float:
    times = []
    for _ in range(3):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def speeds(p: int) -> dict[str, tuple[float, float, float]]:
    """(encode, decode, the update's extra seconds) for a delta of ``p`` values; the extra is Top-k's driver
    update: encode_update once at the driver plus apply_update on each worker (in parallel)."""
    g = np.random.default_rng(0)
    delta = {"w": (g.standard_normal(p) * 1e-3).astype(np.float32)}
    out = {}
    for label, codec in (("fp32", Codec("fp32")), ("int4", Codec("int4")), ("topk 1%", Codec("topk", density=0.01)),
                         ("topk 3%", Codec("topk", density=0.03))):
        payload = codec.encode(delta)
        enc, dec, extra = timed(lambda c=codec: c.encode(delta)), timed(lambda b=payload: decode(b)), 0.0
        if label == "int4":  # the driver encodes its step; it and each worker (in parallel) decode and add it
            extra = enc + 2 * dec
        if label.startswith("topk"):  # the union of 2 workers' kept positions changes
            old = {"w": g.standard_normal(p).astype(np.float32)}
            new = {"w": old["w"].copy()}
            new["w"][g.random(p) < 2 * codec.density] += 1e-3
            upd = encode_update(old, new)
            extra = (timed(lambda o=old, n=new: encode_update(o, n))
                     + timed(lambda o=old, u=upd: apply_update(o, u)))
        out[label] = (enc, dec, extra)
    return out


def main() -> None:
    sizes = (5_310_000, 10_000_000, 135_000_000)  # the benchmarks' model (strategies.py), 10M, 135M
    measured = {p: speeds(p) for p in sizes}
    print("| codec | " + " | ".join(f"{w} {p / 1e6:g}M" for p in sizes for w in ("encode", "decode", "update")) + " |")
    print("|---|" + "---|" * 3 * len(sizes))
    for label in MEASURED:
        print(f"| {label} | " + " | ".join(f"{v:.3f} s" for p in sizes for v in measured[p][label]) + " |")
    print(f"\nCommunication seconds per optimizer step, N = {N} workers (DDP: ring all-reduce of fp32 gradients every "
          "step; DiLoCo: a round every H steps: what each worker reads and sends, the tree's √N fan-in at the "
          "aggregators, latency, encode on the worker and the driver's decode of N deltas), per link:\n")
    print("| model | link | DDP | " + " | ".join(f"{k} (H {H[k]})" for k in MEASURED) + " |")
    print("|---|---|---|" + "---|" * len(MEASURED))
    fan = math.ceil(math.sqrt(N))
    for p in (10e6, 135e6, 1e9):
        scale = p / 135e6
        for link, (bw, lat) in LINKS.items():
            ddp = 2 * (N - 1) / N * 4 * p / bw + 2 * (N - 1) * lat
            cells = []
            for label, (out_bits, back_bits) in MEASURED.items():
                enc, dec, extra = measured[135_000_000][label]
                comm = (out_bits * p / 8 / bw + math.ceil(math.log2(N)) * lat + 2 * fan * back_bits * p / 8 / bw
                        + 2 * lat + (enc + N * dec + extra) * scale)  # the driver decodes the N deltas in turn
                cells.append(f"{comm / H[label]:.3g} s")
            print(f"| {p / 1e6:,.0f}M | {link} | {ddp:.3g} s | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
