"""The torch backend as generation drives it (a ``generate.Decoder``): the prompt once, then one token per step.

- ``TorchDecoder``: any causal LM, through transformers' forward and its KV cache, on the CPU or a GPU.
- ``LlamaDecoder``: Llama-family models (Llama and SmolLM, Qwen2, Qwen3, Mistral without a sliding window) on the
  CPU, each step without transformers' machinery around each call.

Why a step by hand: at batch 1 a step of SmolLM2-135M in int4 spends 4.4 ms in its matrix products and ~12 ms more
in transformers' forward around them (keyword decorators on every layer, mask and cache objects, seven Linear calls
per layer) on 2 cores here; ``LlamaDecoder``'s step is ~12 ms in all (BENCHMARKS.md). It calls the model's own
modules for everything with numbers in it (its norms, rotary embedding, MLP and activation) and computes the rotation
as transformers' ``apply_rotary_pos_emb`` does (``_rotate``: one roll for rotate_half, the same numbers), so its
float32 logits equal transformers' bit for bit; what it replaces is bookkeeping: keys and values go into a cache
allocated once for the prompt and its new tokens, attention reads that cache's filled columns, and a layer's query
and key heads are rotated at once. Projections that read the same input run as one product: joined when the model
is loaded for inference (``projection_groups`` for ``quantize.pack``: float layers packed for oneDNN as one, int4
layers' packs stacked as one, each weight held once), else, for int4 weights, when the step is built
(``quantize.Int4Linear.joined``: the same numbers, where their packs stack). The prompt
itself runs through transformers (its masks for left padding, its attention over many positions), and its keys and
values are copied into the cache.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from .quantize import Int4Linear, PackedPart, SharedProduct

# the KV cache's dtype for the model's: bfloat16 attention in float32 (torch's bfloat16 attention on the CPU: 48-95 us a
# call for SmolLM2's shapes at batch 1, float32's 11-17 us; BENCHMARKS.md)
_CACHE = {torch.bfloat16: torch.float32}
# the causal LMs whose decoder layers this step runs: transformers' classes, by name
FAMILIES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM")


def supports(model) -> bool:
    """Whether ``model`` is one of ``FAMILIES`` as transformers builds it, on the CPU, attending to every earlier
    position (no sliding window that could cut in)."""
    if type(model).__name__ not in FAMILIES or getattr(model, "device", None) != torch.device("cpu"):
        return False
    inner = getattr(model, "model", None)
    if not all(hasattr(inner, name) for name in ("embed_tokens", "layers", "norm", "rotary_emb")):
        return False
    config = model.config
    window = getattr(config, "sliding_window", None)
    if window is not None and (type(model).__name__ == "MistralForCausalLM" or getattr(config, "use_sliding_window",
                                                                                      False)):
        return False
    return all(getattr(layer.self_attn, "sliding_window", None) is None for layer in inner.layers)


class TorchDecoder:
    """A torch causal LM with its KV cache: the prompt once, then one token per step. The model runs where it was
    loaded; its logits come to the CPU for sampling, so a seed gives the same text on either device."""

    def __init__(self, model):
        self.model = model
        self.dev = getattr(model, "device", None) or torch.device("cpu")
        # Only the last position's logits are needed: skip the LM head for the rest of the prompt.
        self.last_only = {"logits_to_keep": 1} if _accepts(model, "logits_to_keep") else {}

    def start(self, ids: np.ndarray, mask: np.ndarray, new_tokens: int = 0) -> np.ndarray:
        self.attn = torch.from_numpy(mask.astype(np.int64))
        self.positions = _positions(self.attn)
        return self._run(torch.from_numpy(ids.astype(np.int64)), **self.last_only)

    def extend(self, chosen: np.ndarray) -> np.ndarray:
        self.attn = torch.cat([self.attn, torch.ones((len(chosen), 1), dtype=torch.long)], dim=1)
        self.positions = self.positions[:, -1:] + 1
        return self._run(torch.from_numpy(chosen.astype(np.int64))[:, None], **reuse_cache(self.out))

    def _run(self, ids, **extra) -> np.ndarray:
        with torch.no_grad():
            self.out = self.model(input_ids=ids.to(self.dev), attention_mask=self.attn.to(self.dev),
                                  position_ids=self.positions.to(self.dev), use_cache=True, **extra)
        return self.out.logits[:, -1, :].float().cpu().numpy()


class LlamaDecoder:
    """A ``generate.Decoder``: the prompt through transformers, then one token per step through ``_step``."""

    def __init__(self, model):
        self.model, self.inner = model, model.model
        self.joined = [_joined(layer) for layer in self.inner.layers]

    def start(self, ids: np.ndarray, mask: np.ndarray, new_tokens: int) -> np.ndarray:
        attn = torch.from_numpy(mask.astype(np.int64))
        positions = _positions(attn)
        with torch.inference_mode():
            out = self.model(input_ids=torch.from_numpy(ids.astype(np.int64)), attention_mask=attn,
                             position_ids=positions, use_cache=True, logits_to_keep=1)
        (cache,) = reuse_cache(out).values()
        b, t = ids.shape
        self.keys, self.values = [], []
        for i in range(len(self.inner.layers)):
            k, v = _layer_cache(cache, i)
            for filled, store in ((k, self.keys), (v, self.values)):
                full = filled.new_zeros(b, filled.shape[1], t + new_tokens, filled.shape[-1],
                                        dtype=_CACHE.get(filled.dtype, filled.dtype))
                full[:, :, :t] = filled
                store.append(full)
        self.filled, self.positions = t, positions[:, -1:]
        # the keys' mask for the whole cache, new tokens included; only a batch with left padding needs one
        self.mask = torch.cat([attn.bool(), torch.ones((b, new_tokens), dtype=torch.bool)], dim=1) \
            if not bool(attn.all()) else None
        return out.logits[:, -1, :].float().numpy()

    def extend(self, chosen: np.ndarray) -> np.ndarray:
        if self.filled == self.keys[0].shape[2]:
            raise RuntimeError("the decoder's cache is full: start() was given fewer new tokens than were asked for")
        self.positions = self.positions + 1
        with torch.inference_mode():
            logits = self._step(torch.from_numpy(chosen.astype(np.int64))[:, None])
        self.filled += 1
        return logits[:, -1, :].float().numpy()

    def _step(self, ids: torch.Tensor) -> torch.Tensor:
        inner, t = self.inner, self.filled
        x = inner.embed_tokens(ids)
        b = x.shape[0]
        cos, sin = inner.rotary_emb(x, self.positions)
        half = cos.shape[-1] // 2
        # rotate_half's minus moved onto sin, once a step (a sign flip is exact), so each rotation is x*cos+roll(x)*sin
        cos, sin = cos.unsqueeze(1), torch.cat((-sin[..., :half], sin[..., half:]), -1).unsqueeze(1)
        mask = None if self.mask is None else self.mask[:, None, None, :t + 1]
        for i, layer in enumerate(inner.layers):
            attn, mlp = layer.self_attn, layer.mlp
            q, k, v = self._heads(i, layer.input_layernorm(x), cos, sin)
            keys, values = self.keys[i], self.values[i]
            keys.narrow(2, t, 1).copy_(k)
            values.narrow(2, t, 1).copy_(v)
            o = F.scaled_dot_product_attention(q.to(keys.dtype), keys.narrow(2, 0, t + 1), values.narrow(2, 0, t + 1),
                                               attn_mask=mask, scale=attn.scaling, enable_gqa=True)
            x = x + attn.o_proj(o.to(x.dtype).transpose(1, 2).reshape(b, 1, -1))
            h = layer.post_attention_layernorm(x)
            gate_up = self.joined[i][1]
            gate, up = (mlp.gate_proj(h), mlp.up_proj(h)) if gate_up is None else gate_up(h)
            x = x + mlp.down_proj(mlp.act_fn(gate) * up)
        return self.model.lm_head(inner.norm(x))

    def _heads(self, i: int, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Layer ``i``'s queries, keys and values for one position, (B, heads, 1, head dim), queries and keys rotated:
        from a joined product, the query and key heads side by side are rotated at once."""
        attn, qkv = self.inner.layers[i].self_attn, self.joined[i][0]
        b, d = h.shape[0], attn.head_dim
        if qkv is not None and not hasattr(attn, "q_norm"):
            heads = qkv.product(h).view(b, 1, -1, d).transpose(1, 2)
            queries, keys = qkv.sizes[0] // d, qkv.sizes[1] // d
            qk = _rotate(heads[:, :queries + keys], cos, sin)
            return qk[:, :queries], qk[:, queries:], heads[:, queries + keys:]
        q, k, v = (attn.q_proj(h), attn.k_proj(h), attn.v_proj(h)) if qkv is None else qkv(h)
        shape = (b, 1, -1, d)
        q, k, v = q.view(shape), k.view(shape), v.view(shape)
        if hasattr(attn, "q_norm"):  # Qwen3: each head's query and key normalized before the rotation
            q, k = attn.q_norm(q), attn.k_norm(k)
        return _rotate(q.transpose(1, 2), cos, sin), _rotate(k.transpose(1, 2), cos, sin), v.transpose(1, 2)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' rotary embedding, ``x * cos + rotate_half(x) * sin``, given ``sin`` with its first half negated:
    rotate_half's halves swapped as one roll, the same numbers."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * sin


def _joined(layer) -> tuple[SharedProduct | None, SharedProduct | None]:
    attn, mlp = layer.self_attn, layer.mlp
    out = []
    for group in ([attn.q_proj, attn.k_proj, attn.v_proj], [mlp.gate_proj, mlp.up_proj]):
        if all(type(m) is PackedPart for m in group) and len({id(m.shared) for m in group}) == 1 and \
                [m.index for m in group] == list(range(len(group))):
            out.append(group[0].shared)  # packed together when loaded (``projection_groups``)
            continue
        product = Int4Linear.joined(group) if all(type(m) is Int4Linear for m in group) else None
        out.append(product and SharedProduct(product, [m.out_features for m in group]))
    return out[0], out[1]


def projection_groups(model) -> list[list[tuple[torch.nn.Module, str]]]:
    """The projections of each decoder layer that read the same input, for ``quantize.pack`` to run as one product:
    query, key and value; gate and up. No groups for a model this step does not take."""
    if not supports(model):
        return []
    groups = []
    for layer in model.model.layers:
        groups.append([(layer.self_attn, name) for name in ("q_proj", "k_proj", "v_proj")])
        groups.append([(layer.mlp, name) for name in ("gate_proj", "up_proj")])
    return groups


def _positions(attn: torch.Tensor) -> torch.Tensor:
    """Each token's position in its row of a left-padded batch (padding at 0; it is masked anyway)."""
    return (attn.cumsum(-1) - 1).clamp(min=0)


def _layer_cache(cache, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer ``i``'s keys and values (B, heads, T, head dim) from transformers' cache, in its 5.x form or its 4.x."""
    if hasattr(cache, "layers"):
        return cache.layers[i].keys, cache.layers[i].values
    if hasattr(cache, "key_cache"):
        return cache.key_cache[i], cache.value_cache[i]
    return cache[i][0], cache[i][1]


def reuse_cache(out) -> dict:
    """The keyword that hands a forward pass's KV cache to the next one, under the name the model returned it.

    transformers 5.x renamed ``past_key_values`` to ``cache`` (the old name warns, then goes); older versions
    know only ``past_key_values``. The output's own field says which one this model speaks.
    """
    for name in ("cache", "past_key_values"):
        if name in getattr(out, "keys", lambda: ())():
            return {name: out[name]}
    return {}


def _accepts(model, name: str) -> bool:
    import inspect

    forward = getattr(model, "forward", None)
    try:
        return forward is not None and name in inspect.signature(forward).parameters
    except (TypeError, ValueError):
        return False
