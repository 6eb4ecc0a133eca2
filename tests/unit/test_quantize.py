"""quantize.release drops a finished tensor's pages of a mapped safetensors file, and only those; int4 layers; float
layers packed for oneDNN (PackedLinear): the same numbers to rounding, the replaced weights freed."""

import pytest
import torch
from safetensors.torch import load_file, save_file

from sparklm.infer.quantize import file_mappings, in_mappings, release


def _resident_kb(path) -> int:
    """This process's resident kB of its mappings of ``path`` (from /proc/self/smaps)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5 and ":" in fields[3]:
                inside = len(fields) == 6 and fields[5] == str(path)
            elif inside and fields[0] == "Rss:":
                total += int(fields[1])
    return total


def test_release_drops_a_mapped_tensors_pages_and_keeps_its_neighbours(tmp_path):
    path = tmp_path / "w.safetensors"
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)  # 4 MiB each
    save_file({"a": a, "b": b}, str(path))
    loaded = load_file(str(path))  # safetensors maps the file: its tensors are views of the mapping
    assert in_mappings(loaded["a"], file_mappings()) and not in_mappings(a, file_mappings())
    assert float(loaded["a"].sum()) == float(a.sum()) and float(loaded["b"].sum()) == float(b.sum())  # read: resident
    before = _resident_kb(path)
    assert before >= 8 * 1024 - 8
    release(loaded["a"])
    after = _resident_kb(path)
    assert before - 4 * 1024 - 8 <= after <= before - 4 * 1024 + 8  # a's whole pages gone, b's kept
    assert torch.equal(loaded["b"], b)
    assert torch.equal(loaded["a"], a)  # clean file pages: read from the file again, unchanged


def test_shares_bytes_finds_a_tied_head_and_overlapping_views_only():
    from sparklm.infer.quantize import shares_bytes

    embedding = torch.nn.Embedding(64, 16)
    head = torch.nn.Linear(16, 64, bias=False)
    head.weight = embedding.weight  # tied, as most small LMs are
    assert shares_bytes(head.weight, [embedding.weight])
    whole = torch.zeros(8, 1024)
    assert shares_bytes(whole[2:4], [whole[3:6]]) and not shares_bytes(whole[2:4], [whole[4:6], torch.zeros(3)])
    assert not shares_bytes(whole[2:4], [whole[4:4]])  # an empty view holds no bytes


# -- int4 (weights in 4 bits, torch's packed CPU kernel) -----------------------------------------


def test_int4_layer_multiplies_by_its_dequantized_weights():
    from sparklm.infer.quantize import GROUP, Int4Linear, int4_dequantized, int4_groups

    torch.manual_seed(0)
    linear = torch.nn.Linear(96, 48)
    codes, scale, zero = int4_groups(linear.weight)
    assert codes.shape == (48, 96) and int(codes.max()) <= 15 and scale.shape == zero.shape == (48, 96 // GROUP)
    deq = int4_dequantized(linear.weight)
    steps = scale.float().repeat_interleave(GROUP, dim=1)
    assert bool(((deq - linear.weight).abs() <= 0.51 * steps + 1e-6).all())  # within half a step of each group
    layer = Int4Linear.from_linear(linear)
    x = torch.randn(5, 3, 96)
    ref = torch.nn.functional.linear(x.bfloat16().float(), deq, linear.bias)
    y = layer(x)
    assert y.shape == (5, 3, 48) and y.dtype == torch.float32
    assert (y - ref).abs().max() < 1e-2 * ref.abs().max()  # the kernel's output is bfloat16
    constant = torch.nn.Linear(32, 16, bias=False)
    torch.nn.init.constant_(constant.weight, 0.25)
    assert torch.equal(int4_dequantized(constant.weight), constant.weight)  # a constant group is exact


def test_int4_layers_joined_equal_the_joined_weights_packed():
    from sparklm.infer.quantize import Int4Linear, pack_block

    block = pack_block()
    assert block in (16, 32, 64, 128, 256)
    torch.manual_seed(1)
    parts = [torch.nn.Linear(64, n, bias=False) for n in (block, 2 * block, 16)]
    joined = Int4Linear.joined([Int4Linear.from_linear(p) for p in parts])
    whole = torch.nn.Linear(64, 3 * block + 16, bias=False)
    whole.weight.data = torch.cat([p.weight.data for p in parts])
    alone = Int4Linear.from_linear(whole)
    assert torch.equal(joined.packed, alone.packed) and torch.equal(joined.scales_zeros, alone.scales_zeros)
    x = torch.randn(2, 64)
    assert torch.equal(joined(x), torch.cat([Int4Linear.from_linear(p)(x) for p in parts], dim=-1))
    if block > 16:  # a layer that ends inside a block: its pack cannot be stacked
        assert Int4Linear.joined([Int4Linear.from_linear(torch.nn.Linear(64, 16)) for _ in range(2)]) is None


def test_int4_quantizes_the_layers_its_kernel_packs_and_keeps_the_rest():
    from sparklm.infer.quantize import Int4Linear, quantize

    model = torch.nn.Sequential(torch.nn.Linear(64, 48), torch.nn.ReLU(), torch.nn.Linear(48, 40))  # 48 % 32 != 0
    x = torch.randn(3, 64)
    before = model(x)
    quantize(model, "int4")
    assert type(model[0]) is Int4Linear and type(model[2]) is torch.nn.Linear
    assert (model(x) - before).abs().max() < 0.1 * before.abs().max()
    import pytest

    from sparklm.infra.errors import SparklmError

    with pytest.raises(SparklmError, match="int8 or int4"):
        quantize(model, "int2")


# -- float layers packed for oneDNN (PackedLinear) -------------------------------------------------


def _packable(dtype) -> None:
    import pytest

    from sparklm.infer.quantize import packable_dtypes

    if dtype not in packable_dtypes():
        pytest.skip(f"this torch's oneDNN does not pack {dtype} on this CPU")


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2,
                                        tie_word_embeddings=True)).eval()


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_a_packed_layer_gives_the_linear_layers_numbers_to_rounding(dtype, tol):
    from sparklm.infer.quantize import PackedLinear

    _packable(dtype)
    for bias in (True, False):
        torch.manual_seed(0)
        linear = torch.nn.Linear(96, 80, bias=bias).to(dtype).requires_grad_(False)
        packed = PackedLinear.of(linear)
        # the packed weight is not a parameter or state: nothing saves or moves it as if it were a plain one
        assert not list(packed.parameters()) and list(packed.state_dict()) == (["bias"] if bias else [])
        for shape in ((1, 96), (7, 96), (2, 5, 96)):  # one row (decoding), several, a batch of sequences
            x = torch.randn(shape).to(dtype)
            want, got = linear(x), packed(x)
            assert got.shape == want.shape and got.dtype == dtype
            assert float((got - want).abs().max()) <= tol * float(want.abs().max())
        with pytest.raises(RuntimeError, match="input is torch.float64"):
            packed(torch.randn(1, 96, dtype=torch.float64))


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_pack_replaces_a_models_float_layers_and_frees_the_weights_it_replaced(dtype, tol):
    import gc
    import weakref

    from sparklm.infer.quantize import PackedLinear, PackedPart, pack, to_bf16
    from sparklm.infer.torch_decode import projection_groups

    _packable(dtype)
    model = _tiny_llama()
    if dtype == torch.bfloat16:
        to_bf16(model)
    ids = torch.tensor([[3, 14, 15, 92, 65, 35]])
    with torch.inference_mode():
        before = model(input_ids=ids).logits
    # a bfloat16 copy is in memory of its own: held anywhere, both forms would stay in memory at once
    gone = [weakref.ref(model.model.layers[i].mlp.up_proj.weight) for i in (0, 1)]  # joined with gate_proj
    gone += [weakref.ref(model.model.layers[i].mlp.down_proj.weight) for i in (0, 1)]  # packed alone
    tied = model.lm_head.weight
    pack(model, projection_groups(model))
    gc.collect()
    assert all(ref() is None for ref in gone)
    assert all(type(m) is not torch.nn.Linear for m in model.modules())
    assert type(model.lm_head) is PackedLinear and model.model.embed_tokens.weight is tied  # the embedding keeps it
    attn = model.model.layers[0].self_attn
    assert all(type(m) is PackedPart and m.shared is attn.q_proj.shared for m in (attn.k_proj, attn.v_proj))
    assert [m.out_features for m in (attn.q_proj, attn.k_proj, attn.v_proj)] == [64, 32, 32]
    with torch.inference_mode():
        after = model(input_ids=ids).logits
    assert after.dtype == dtype
    assert float((after - before).abs().max()) <= tol * float(before.abs().max())


def test_the_parts_of_a_shared_product_compute_it_once_per_input_and_keep_nothing_after():
    from sparklm.infer.quantize import PackedLinear, PackedPart, SharedProduct

    _packable(torch.float32)
    torch.manual_seed(0)
    weights = [torch.randn(n, 24) for n in (16, 8, 8)]
    shared = SharedProduct(PackedLinear(torch.cat(weights)), [16, 8, 8])
    calls = []
    product = shared.product.forward
    shared.product.forward = lambda x: calls.append(x) or product(x)  # counts the products, changes nothing
    parts = [PackedPart(shared, i) for i in range(3)]
    x, y = torch.randn(2, 3, 24), torch.randn(2, 3, 24)
    for w, part in zip(weights, parts):
        assert torch.allclose(part(x), x @ w.T, atol=1e-5)
    assert len(calls) == 1 and shared._input is None  # once for the three; nothing held between inputs
    assert torch.allclose(parts[1](x), x @ weights[1].T, atol=1e-5)  # another call: computed again, not stale
    assert torch.allclose(parts[1](y), y @ weights[1].T, atol=1e-5)  # another input before the others took theirs
    assert torch.allclose(parts[0](y), y @ weights[0].T, atol=1e-5) and len(calls) == 3


def test_packing_bfloat16_layers_holds_one_layers_weight_at_a_time():
    """The peak, not only the end: 16 layers of 8 MB in bfloat16 (memory of their own, not a file's), packed with
    the process's peak resident memory reset before; it may grow by a few layers, not by all of them."""
    from sparklm.infer.quantize import pack

    _packable(torch.bfloat16)

    def mb(field: str) -> int:
        with open("/proc/self/status") as f:
            return int(f.read().split(field + ":")[1].split()[0]) // 1024

    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 4096, bias=False) for _ in range(16)]).to(torch.bfloat16)
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM back to the resident memory now (Linux)
    except OSError:
        pytest.skip("cannot reset this process's peak resident memory here")
    start = mb("VmHWM")
    pack(model)
    assert mb("VmHWM") - start < 4 * 8  # MB; holding every replaced weight to the end grew it by ~128
