"""The torch backend's quantized Linear layers for CPU inference, made one layer at a time so that the float
weights leave memory as their quantized copies arrive (and ``to_bf16``: every weight in bfloat16, the same way).

- ``int8``: torch's dynamic int8 Linear (int8 weights, activations quantized per batch), the layers and numbers of
  ``torch.ao.quantization.quantize_dynamic``.
- ``int4``: weights only, 4 bits in groups of 32 along the input, each group with its own scale and minimum (the
  layout of GGUF's q4_1), multiplied by torch's packed int4 CPU kernel (``_weight_int4pack_mm_for_cpu``, the one
  torchao's CPU int4 uses) with bfloat16 activations: its float32 path is scalar, ~25x slower at batch 1. A decoding
  step reads every weight once, so at batch 1 its time follows the weights' bytes: SmolLM2-135M's Linear layers
  take 45 ms in float32 and 5.8 ms in int4 on 2 cores here (BENCHMARKS.md).
- ``pack``: the float layers left as they are in number, their weights in oneDNN's packed layout (``PackedLinear``),
  which torch multiplies faster at batch 1 than its plain layout.

A model loaded from safetensors holds its float weights as pages of the file's mapping: they count in the process's
RSS once read, and stay until the last tensor of the file is freed. ``quantize_dynamic`` reads every weight before
any is dropped, so the int8 model peaked above the float one (SmolLM2-135M: 1.3 GB against fp32's 1.0). Here each
layer's float weight, once quantized, gives its pages back with ``madvise(MADV_DONTNEED)``: torch has no call that
drops part of a mapped storage, and the pages are clean file pages, so dropping them loses nothing (they are read
from the file again if anything touched them).
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import warnings

import torch

from ..infra.errors import SparklmError

KINDS = ("int8", "int4")
GROUP = 32  # int4: input values per scale and minimum (q4_1's block)
ROWS_AT_ONCE = 4096  # int4: output rows quantized together
_MADV_DONTNEED = 4  # Linux; the same value on every architecture torch ships for


def to_bf16(model: torch.nn.Module) -> torch.nn.Module:
    """Every float32 parameter of ``model`` in bfloat16, one at a time, each original's file pages handed back (as
    the quantized layers do: loading with transformers' ``dtype=bfloat16`` instead holds every float32 page it read
    beside the bfloat16 copies until it closes the file, SmolLM2-135M peaking at 1.19 GB against fp32's 1.0). The
    same numbers as that load: round to nearest even, buffers (the rotary frequencies) as they were."""
    params = [p for p in model.parameters() if p.dtype == torch.float32]
    mapped = file_mappings()
    done: dict[int, torch.Tensor] = {}  # tied parameters (the embedding and the head) stay one tensor
    for i, p in enumerate(params):
        old = p.data
        if old.data_ptr() in done:
            p.data = done[old.data_ptr()]
            continue
        p.data = done[old.data_ptr()] = old.to(torch.bfloat16)
        waiting = [q.data for q in params[i + 1:] if q.data.data_ptr() != old.data_ptr()]
        if old.is_contiguous() and in_mappings(old, mapped) and not shares_bytes(old, waiting):
            release(old)
    return model


def quantize(model: torch.nn.Module, kind: str = "int8") -> torch.nn.Module:
    """Replace the ``nn.Linear`` layers of ``model`` in place with ``kind``'s (see the module's text). int8 takes
    every Linear; int4 those whose shape its kernel packs (outputs a multiple of 16, inputs of 32), the rest stay
    float. The float tensors that stay (embeddings, norms) are copied out of the file's mapping, so it closes."""
    if kind not in KINDS:
        raise SparklmError(f"--quantize {kind}: the torch backend quantizes to {' or '.join(KINDS)}")
    if kind == "int4" and not hasattr(torch, "_weight_int4pack_mm_for_cpu"):
        raise SparklmError(f"--quantize int4 needs torch's packed int4 CPU kernel, which torch {torch.__version__} "
                           "lacks", hint="torch >= 2.6, or --quantize int8")
    with warnings.catch_warnings():  # torch.ao.quantization announces its move to torchao
        warnings.simplefilter("ignore")
        _replace_linears(model, _int8 if kind == "int8" else
                         lambda child: Int4Linear.packable(child) and Int4Linear.from_linear(child))
    return model


def pack(model: torch.nn.Module, groups: list[list[tuple[torch.nn.Module, str]]] = ()) -> torch.nn.Module:
    """Replace the float ``nn.Linear`` layers of ``model`` (on the CPU) in place with ``PackedLinear``: the same
    numbers to rounding, faster where the CPU's oneDNN takes the weight's dtype; the rest of the model untouched.
    A head tied to its embedding gets a packed copy (the embedding keeps the plain weight).

    ``groups``: layers (a parent and a child's name) that always read the same input, such as a decoder layer's
    query, key and value projections: each group becomes one product, its layers ``PackedPart``s of it (one call
    instead of several; the weights held once). Float layers are joined as one ``PackedLinear``, int4 layers as one
    ``Int4Linear`` where their packs stack (``Int4Linear.joined``)."""
    owned, mapped = _owned(model), file_mappings()
    for group in groups:
        layers = [getattr(parent, name) for parent, name in group]
        product = _joined(layers)
        if product is None:
            continue
        shared = SharedProduct(product, [m.out_features for m in layers])
        for i, (parent, name) in enumerate(group):
            setattr(parent, name, PackedPart(shared, i))
        for m in layers:
            if type(m) is torch.nn.Linear:
                _hand_back(m, owned, mapped)
        del layers, m
        _trim()  # the joined copy and the separate layers, freed: back to the OS, not left in glibc's heap
    if packable_dtypes():
        _replace_linears(model, lambda child: PackedLinear.packable(child) and PackedLinear.of(child), owned, mapped)
    return model


def _joined(layers: list[torch.nn.Module]) -> PackedLinear | Int4Linear | None:
    """One product for ``layers`` (their outputs side by side), or None where they cannot be joined."""
    if all(type(m) is Int4Linear for m in layers):
        return Int4Linear.joined(layers)
    if not all(type(m) is torch.nn.Linear and PackedLinear.packable(m) for m in layers) or \
            len({(m.in_features, m.weight.dtype) for m in layers}) > 1:
        return None
    bias = None if all(m.bias is None for m in layers) else torch.cat(
        [m.bias.detach() if m.bias is not None else m.weight.new_zeros(m.out_features) for m in layers])
    return PackedLinear(torch.cat([m.weight.detach() for m in layers]), bias)  # the joined copy: freed, trimmed by pack


def _replace_linears(model: torch.nn.Module, make, owned=None, mapped=None) -> None:
    """Each ``nn.Linear`` of ``model`` for which ``make`` returns a module is replaced by it, one at a time, its
    weight's memory handed back (``_hand_back``); then what stays float leaves the file's mapping (``_own_memory``)."""
    owned = _owned(model) if owned is None else owned
    mapped = file_mappings() if mapped is None else mapped
    for parent in [m for m in model.modules() if type(m) is not torch.nn.Linear]:  # parents: not holding the layers
        for name in [name for name, _ in parent.named_children()]:  # names: a list of children would hold them
            child = getattr(parent, name)
            if type(child) is not torch.nn.Linear:
                continue
            replaced = make(child)
            if not replaced:
                continue
            setattr(parent, name, replaced)
            _hand_back(child, owned, mapped)
            del child
    _own_memory(model)


def _owned(model: torch.nn.Module) -> list[tuple[int, tuple[int, int]]]:
    """Every module's own tensors, a tied one under each module that holds it (the embedding and the head), known by
    the module's id and the tensor's bytes only: holding them would keep weights that are not in a file (a bfloat16
    copy) alive to the end, the old and new forms in memory at once."""
    return [(id(m), _span(t)) for m in model.modules()
            for t in [*m.parameters(recurse=False), *m.buffers(recurse=False)]]


def _hand_back(layer: torch.nn.Linear, owned: list, mapped: list) -> None:
    """``layer``, just replaced: its weight's file pages dropped, unless another module's tensor shares them."""
    weight = layer.weight
    if _overlaps(_span(weight), [span for m, span in owned if m != id(layer)]):
        return
    if weight.is_contiguous() and in_mappings(weight, mapped):
        release(weight)
    else:
        # a weight in memory of its own (a bfloat16 copy), freed once the caller drops the layer; glibc keeps the
        # block in its heap, where the next layer's larger one does not fit: SmolLM2-135M's bf16 packing held both
        # forms at once. The whole heap's free pages go back as each one is freed.
        layer.weight = None
        del weight
        _trim()


def _int8(linear: torch.nn.Linear) -> torch.nn.Module:
    from torch.ao.nn.quantized.dynamic import Linear as DynamicLinear
    from torch.ao.quantization import default_dynamic_qconfig

    linear.qconfig = default_dynamic_qconfig
    return DynamicLinear.from_float(linear)


def int4_groups(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``weight`` (N, K) in 4 bits, groups of ``GROUP`` along K: codes 0..15 (N, K) and each group's scale and value
    of code 8 (N, K / GROUP), both bfloat16 as the kernel reads them; a weight is ``(code - 8) * scale + zero``.
    The scale spans the group's least to greatest value in 15 steps (asymmetric, as q4_1)."""
    n, k = weight.shape
    groups = weight.detach().float().reshape(n, k // GROUP, GROUP)
    low, high = groups.amin(-1), groups.amax(-1)
    # a constant group: any scale is exact; the smallest normal bfloat16 keeps the division finite
    scale = ((high - low) / 15).clamp(min=torch.finfo(torch.bfloat16).tiny).to(torch.bfloat16)
    zero = (low + 8 * scale.float()).to(torch.bfloat16)
    codes = ((groups - zero.float()[..., None]) / scale.float()[..., None] + 8).round_().clamp_(0, 15)
    return codes.reshape(n, k).to(torch.uint8), scale, zero


def int4_dequantized(weight: torch.Tensor) -> torch.Tensor:
    """The float32 values ``weight`` has once in 4 bits (what an ``Int4Linear`` multiplies by)."""
    codes, scale, zero = int4_groups(weight)
    n, k = weight.shape
    groups = (codes.reshape(n, k // GROUP, GROUP).float() - 8) * scale.float()[..., None] + zero.float()[..., None]
    return groups.reshape(n, k)


class Int4Linear(torch.nn.Module):
    """A Linear layer with 4-bit weights (``int4_groups``), packed for torch's int4 CPU kernel; its input is rounded
    to bfloat16 for the kernel and its output comes back in the input's dtype."""

    def __init__(self, packed: torch.Tensor, scales_zeros: torch.Tensor, in_features: int,
                 bias: torch.Tensor | None = None):
        super().__init__()
        self.in_features, self.out_features = in_features, packed.shape[0]
        self.register_buffer("packed", packed)
        self.register_buffer("scales_zeros", scales_zeros)
        self.bias = None if bias is None else torch.nn.Parameter(bias.detach().clone(), requires_grad=False)

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear) -> Int4Linear:
        # Rows a few thousand at a time where packs stack: an LM head's float temporaries would be several times
        # its weight at once (SmolLM2's 113 MB head: ~0.2 GB more at the peak)
        block = pack_block()
        rows = max(block, ROWS_AT_ONCE // block * block) if block else linear.out_features
        packs, scales_zeros = [], []
        for start in range(0, linear.out_features, rows):
            codes, scale, zero = int4_groups(linear.weight[start:start + rows])
            # the kernel's form: packed codes, and per (group, output) the scale and the value of code 8
            packs.append(torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1))
            scales_zeros.append(torch.stack([scale.t(), zero.t()], -1))
        return cls(torch.cat(packs), torch.cat(scales_zeros, dim=1).contiguous(), linear.in_features, linear.bias)

    @classmethod
    def joined(cls, layers: list[Int4Linear]) -> Int4Linear | None:
        """One layer whose outputs are ``layers``' side by side (layers that read the same input), with their own
        numbers; None where their packs cannot be stacked: the kernel packs output rows in blocks (64 with AVX-512
        here), so stacked packs equal the stacked weights' pack only where each layer but the last fills whole
        blocks."""
        block = pack_block()
        if not block or any(m.out_features % block for m in layers[:-1]) or len({m.in_features for m in layers}) > 1:
            return None
        bias = None if all(m.bias is None for m in layers) else torch.cat(
            [m.bias if m.bias is not None else torch.zeros(m.out_features) for m in layers])
        return cls(torch.cat([m.packed for m in layers]),
                   torch.cat([m.scales_zeros for m in layers], dim=1).contiguous(), layers[0].in_features, bias)

    @staticmethod
    def packable(linear: torch.nn.Linear) -> bool:
        return linear.out_features % 16 == 0 and linear.in_features % GROUP == 0 and linear.weight.device.type == "cpu"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).to(torch.bfloat16)
        y = torch._weight_int4pack_mm_for_cpu(flat, self.packed, GROUP, self.scales_zeros)
        y = y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bits=4, group={GROUP}"


class PackedLinear(torch.nn.Module):
    """A float Linear layer whose weight is held in oneDNN's packed layout (``torch.ops.mkldnn``, what inductor's
    frozen CPU graphs use), multiplied by oneDNN's own product. Why: at batch 1 every step reads every weight once,
    and torch's plain products read them slowly on the CPU: SmolLM2-135M's LM head (49152 x 576, float32) takes 11 ms
    through ``F.linear`` (10 GB/s) and 4.9 ms packed (23 GB/s), all its Linear layers 52 ms against 31-36 ms on 2
    cores here (BENCHMARKS.md). The packed weight is an opaque tensor, outside the module's parameters and state."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.dtype = weight.dtype
        # the layout oneDNN picks for one row at a time (decoding); any number of rows multiplies by it
        self.weight_packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 1)
        self.register_buffer("bias", None if bias is None else bias.detach())

    @classmethod
    def of(cls, linear: torch.nn.Linear) -> PackedLinear:
        return cls(linear.weight, linear.bias)

    @staticmethod
    def packable(linear: torch.nn.Linear) -> bool:
        return linear.weight.device.type == "cpu" and linear.weight.dtype in packable_dtypes()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != self.dtype:  # as F.linear would say, not oneDNN's own words
            raise RuntimeError(f"PackedLinear: input is {x.dtype}, the weight {self.dtype}")
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.weight_packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, dtype={self.dtype}, packed"


class SharedProduct:
    """Layers that read the same input as one packed product (``pack``'s groups). Called, it gives every layer's
    output; its ``PackedPart``s each give one, from one product per input: the first part called with an input
    computes them all, and the product is kept until each part has taken its own (or another input comes). The
    input is known by identity, held while the product is kept, so no other tensor can take its place; the model's
    code must not change it in place between the parts' calls (transformers' attention and MLP do not). One
    model per thread, as torch's modules generally are."""

    def __init__(self, product: PackedLinear | Int4Linear, sizes: list[int]):
        self.product, self.sizes = product, sizes
        self._input, self._outputs, self._left = None, (), 0

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.product(x).split(self.sizes, dim=-1)

    def part(self, x: torch.Tensor, i: int) -> torch.Tensor:
        if x is not self._input:
            self._input, self._outputs, self._left = x, self(x), len(self.sizes)
        out = self._outputs[i]
        self._left -= 1
        if self._left == 0:  # every part served: hold nothing between calls
            self._input, self._outputs = None, ()
        return out


class PackedPart(torch.nn.Module):
    """One layer of a ``SharedProduct``, where the model calls that layer."""

    def __init__(self, shared: SharedProduct, index: int):
        super().__init__()
        self.shared, self.index = shared, index
        self.in_features, self.out_features = shared.product.in_features, shared.sizes[index]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.shared.part(x, self.index)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, part {self.index} of a packed product"


@functools.cache
def packable_dtypes() -> tuple[torch.dtype, ...]:
    """The weight dtypes ``PackedLinear`` takes here: float32 where torch has oneDNN, bfloat16 too where oneDNN
    runs it natively (AVX512-BF16 or AMX; inductor asks the same)."""
    if not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        return ()
    bf16 = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return (torch.float32, torch.bfloat16) if bf16 is not None and bf16() else (torch.float32,)


@functools.cache
def pack_block() -> int:
    """The rows the int4 packing works in on this CPU (0: none found), found by packing two layers apart and
    together: the layout is the kernel's own and differs between instruction sets."""
    gen = torch.Generator().manual_seed(0)
    for block in (16, 32, 64, 128, 256):
        codes = torch.randint(0, 16, (2 * block, 2 * GROUP), generator=gen, dtype=torch.int32)
        pack = torch.ops.aten._convert_weight_to_int4pack_for_cpu
        if torch.equal(torch.cat([pack(codes[:block], 1), pack(codes[block:], 1)]), pack(codes, 1)):
            return block
    return 0


def file_mappings() -> list[tuple[int, int]]:
    """The address ranges of this process's mappings of files (from /proc/self/maps); empty where there is none."""
    ranges = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                fields = line.split(maxsplit=5)
                if len(fields) == 6 and fields[5].startswith("/"):
                    start, end = fields[0].split("-")
                    ranges.append((int(start, 16), int(end, 16)))
    except OSError:  # not Linux: nothing is released, the result is the same
        return []
    return ranges


def in_mappings(t: torch.Tensor, ranges: list[tuple[int, int]]) -> bool:
    """Whether ``t``'s bytes lie inside one of ``ranges`` (a mapped file, so its pages can be dropped safely)."""
    start, end = _span(t)
    return any(a <= start and end <= b for a, b in ranges)


def _span(t: torch.Tensor) -> tuple[int, int]:
    return t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()


def shares_bytes(t: torch.Tensor, others: list[torch.Tensor]) -> bool:
    """Whether any of ``others`` overlaps ``t``'s bytes (a head tied to its embedding shares them)."""
    return _overlaps(_span(t), [_span(other) for other in others])


def _overlaps(span: tuple[int, int], spans: list[tuple[int, int]]) -> bool:
    """Whether any of ``spans`` that holds a byte overlaps ``span``."""
    start, end = span
    return any(b > a and a < end and start < b for a, b in spans)


def release(t: torch.Tensor) -> None:
    """Drop from this process the whole pages that lie inside ``t``'s bytes (the pages at its ends may hold a
    neighbour's bytes too, and stay). Only for a contiguous tensor in a file mapping that nothing uses any more."""
    page = mmap.PAGESIZE
    first, last = _span(t)
    start, end = -(-first // page) * page, last // page * page
    if end > start:
        _libc().madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), _MADV_DONTNEED)


@functools.cache
def _libc():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc


def _trim() -> None:
    """glibc: hand the free pages of the heap back to the OS (``malloc_trim``); elsewhere nothing."""
    try:
        trim = getattr(_libc(), "malloc_trim", None)
    except (OSError, TypeError):  # no C library to load by that name (not a Unix)
        return
    if trim is not None:
        trim(0)


def _own_memory(model: torch.nn.Module) -> None:
    """Copy the tensors that stay float (embedding, norms) out of the file's mapping, so that it closes once the
    loader lets go (a tensor still pointing into it keeps every page read so far resident)."""
    copies: dict[int, torch.Tensor] = {}  # tensors that share storage (tied weights) stay shared
    for t in [*model.parameters(), *model.buffers()]:
        if t.data_ptr() not in copies:
            copies[t.data_ptr()] = t.data.clone()
        t.data = copies[t.data_ptr()]
