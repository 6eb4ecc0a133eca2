"""The chunked LM-head loss equals the unchunked one, values and gradients, whatever the chunk size."""

import pytest
import torch
import torch.nn.functional as F
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from sparklm.model import lm_head
from sparklm.model.task import IGNORE

V = 300


def tiny(arch: str, tie: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    if arch == "llama":
        cfg = LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                          tie_word_embeddings=tie)
        return LlamaForCausalLM(cfg)
    cfg = GPT2Config(vocab_size=V, n_embd=32, n_layer=2, n_head=4, n_positions=64, tie_word_embeddings=tie)
    return GPT2LMHeadModel(cfg).eval()  # no dropout: both losses see the same network


def batch(seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (3, 17), generator=g)
    mask = torch.ones_like(ids)
    mask[2, 12:] = 0  # right padding
    labels = ids.masked_fill(mask == 0, IGNORE)
    labels[1, :6] = IGNORE  # a prompt without loss
    return ids, mask, labels


def reference(model, ids, mask, labels):
    logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
    return F.cross_entropy(logits.reshape(-1, V), labels[:, 1:].reshape(-1), ignore_index=IGNORE, reduction="sum")


def chunked(model, ids, mask, labels, chunk):
    with lm_head.hidden_states(model) as box:
        out = model(input_ids=ids, attention_mask=mask)
    assert out.logits.shape[1] == 0  # the head was handed no positions
    return lm_head.nll_sum(box["hidden"], lm_head.head_of(model), labels, chunk)


def grads(model, loss):
    model.zero_grad(set_to_none=True)
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("arch,tie", [("llama", False), ("llama", True), ("gpt2", True)])
@pytest.mark.parametrize("chunk", [1, 7, 16, 4096])
def test_chunked_loss_and_gradients_equal_the_unchunked(arch, tie, chunk):
    model = tiny(arch, tie)
    ids, mask, labels = batch()
    assert lm_head.supports(model)
    want = reference(model, ids, mask, labels)
    want_grads = grads(model, want)
    got = chunked(model, ids, mask, labels, chunk)
    got_grads = grads(model, got)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    assert want_grads.keys() == got_grads.keys()
    for name in want_grads:
        torch.testing.assert_close(got_grads[name], want_grads[name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fused_chunk_terms_give_the_eager_loss_gradients_and_hits(dtype):
    """train.compile's loss (fused=True: each chunk's terms in one compiled function) against the eager chunks, with
    the head's matmul in float32 and under bf16 autocast, over chunks of 7 positions (a short last one)."""
    model = tiny("llama", False)
    ids, mask, labels = batch()
    results = []
    for fused in (False, True):
        tally = torch.zeros(2)
        with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
            with lm_head.hidden_states(model) as box:
                model(input_ids=ids, attention_mask=mask)
            loss = lm_head.nll_sum(box["hidden"], lm_head.head_of(model), labels, 7, tally, fused=fused)
        results.append((loss, grads(model, loss), tally))
    (want, want_grads, want_tally), (got, got_grads, got_tally) = results
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    assert got_tally.tolist() == want_tally.tolist() and want_tally[1] > 0
    for name in want_grads:  # bf16: the same rounding of the chunk's gradient to bf16, so equal to its precision
        torch.testing.assert_close(got_grads[name], want_grads[name], rtol=1e-2 if dtype == torch.bfloat16 else 1e-4,
                                   atol=1e-6, msg=name)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_the_head_computes_nothing_in_the_models_forward(arch):
    """Inside hidden_states() the model's own forward costs its full forward less the head's matmul (counted)."""
    from torch.utils.flop_counter import FlopCounterMode

    model = tiny(arch, tie=True)
    ids, mask, _ = batch()

    def flops(fn):
        with torch.no_grad(), FlopCounterMode(display=False) as counter:
            fn()
        return counter.get_total_flops()

    full = flops(lambda: model(input_ids=ids, attention_mask=mask))

    def hooked():
        with lm_head.hidden_states(model):
            model(input_ids=ids, attention_mask=mask)

    assert full - flops(hooked) == 2 * ids.numel() * 32 * V  # the head's (B·T × d) @ (d × V)


def test_chunked_loss_under_bf16_autocast_matches_autocast_reference():
    model = tiny("llama", False)
    ids, mask, labels = batch(2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = reference(model, ids, mask, labels)
        got = chunked(model, ids, mask, labels, 5)
    assert abs(got.item() - want.item()) / want.item() < 1e-3


def test_frozen_head_gets_no_gradient_and_no_target_gives_zero():
    model = tiny("llama", True)
    for p in model.parameters():
        p.requires_grad_(False)
    model.model.layers[0].mlp.up_proj.weight.requires_grad_(True)
    ids, mask, _ = batch()
    labels = torch.full_like(ids, IGNORE)
    loss = chunked(model, ids, mask, labels, 4)
    loss.backward()
    assert loss.item() == 0.0
    assert model.lm_head.weight.grad is None
    assert torch.count_nonzero(model.model.layers[0].mlp.up_proj.weight.grad) == 0


@pytest.mark.parametrize("chunk", [1, 3, 0])
def test_score_sums_equal_token_sums(chunk):
    model = tiny("gpt2", True).eval()
    ids, mask, labels = batch(3)
    valid = labels[:, 1:] != IGNORE
    byte_lengths = torch.arange(V, dtype=torch.float64)
    want = lm_head.score(model, ids, mask, valid, byte_lengths, chunked=False)
    got = lm_head.score(model, ids, mask, valid, byte_lengths, chunk=chunk)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-4)


def test_models_that_change_logits_after_the_head_keep_the_unchunked_loss():
    from transformers import Gemma2Config, Gemma2ForCausalLM

    gemma = Gemma2ForCausalLM(Gemma2Config(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                           num_attention_heads=2, num_key_value_heads=1, head_dim=16))
    assert gemma.config.final_logit_softcapping  # soft-capped logits
    assert not lm_head.supports(gemma)
    model = tiny("llama", False)
    model.lm_head.register_forward_hook(lambda m, a, out: out * 2 + 1)  # a transform no config names
    assert not lm_head.supports(model)


@pytest.mark.parametrize("chunk", [1, 7, 4096])
def test_training_accuracy_counts_equal_the_evaluations_and_the_unchunked_ones(chunk):
    """The training accuracy the chunked loss tallies is top-1 over the positions with a loss: what evaluation's
    token_sums counts, and what the task's unchunked loss (a model without loss chunks) counts."""
    from sparklm.model.task import Batch
    from sparklm.tasks.causal_lm import CausalLM

    model = tiny("llama", False)
    ids, mask, labels = batch()
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits
    _, counted, correct, _ = lm_head.token_sums(logits[:, :-1], ids[:, 1:], labels[:, 1:] != IGNORE).tolist()
    tally = torch.zeros(2)
    with lm_head.hidden_states(model) as box:
        model(input_ids=ids, attention_mask=mask)
    lm_head.nll_sum(box["hidden"], lm_head.head_of(model), labels, chunk, tally)
    assert tally.tolist() == [correct, counted] and counted > 0
    plain = torch.zeros(2)
    CausalLM().loss(model, Batch(input_ids=ids, attention_mask=mask, labels=labels), tally=plain)
    assert plain.tolist() == [correct, counted]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (benchmarks/gpu_check.py)")
@pytest.mark.parametrize("chunked", [True, False])
def test_score_sums_stay_on_the_models_device_and_equal_the_cpus(chunked):
    # A training evaluation on CUDA once added these sums (made on the CPU) into a CUDA total; the device's
    # byte-length table is on the GPU, `sparklm eval`'s on the CPU: both must work.
    model = tiny("llama", False).eval()
    ids, mask, labels = batch(5)
    valid = labels[:, 1:] != IGNORE
    lengths = torch.arange(V, dtype=torch.float64)
    want = lm_head.score(model, ids, mask, valid, lengths, chunked=chunked)
    gpu = model.cuda()
    for table in (lengths, lengths.cuda()):
        got = lm_head.score(gpu, ids.cuda(), mask.cuda(), valid.cuda(), table, chunked=chunked)
        assert got.device.type == "cuda"
        torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-3)
