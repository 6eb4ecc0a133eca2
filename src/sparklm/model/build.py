"""Build a decoder-only transformer with ``transformers`` (Llama-style by default, or GPT-2)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from ..config import ModelConfig, StorageConfig
from ..infra.errors import SparklmError
from ..infra.fs import verify_checksums

if TYPE_CHECKING:  # torch is imported where a model is built or loaded: llama.cpp's generate reads files here only
    import torch


def build_model(cfg: ModelConfig, *, vocab_size: int, context: int, bos_id: int, eos_id: int, pad_id: int,
                seed: int = 0) -> torch.nn.Module:
    """A fresh causal LM from config: Llama (RMSNorm, RoPE, SwiGLU, SDPA) or GPT-2, seeded."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    if cfg.n_embd % cfg.n_head:
        raise SparklmError(f"model.n_embd ({cfg.n_embd}) must be divisible by model.n_head ({cfg.n_head})")
    torch.manual_seed(seed)
    common = dict(vocab_size=vocab_size, bos_token_id=bos_id, eos_token_id=eos_id, pad_token_id=pad_id,
                  tie_word_embeddings=cfg.tie_embeddings)
    if cfg.arch == "llama":
        llama = dict(hidden_size=cfg.n_embd, intermediate_size=cfg.mlp_hidden,
                     num_hidden_layers=cfg.n_layer, num_attention_heads=cfg.n_head, num_key_value_heads=cfg.n_head,
                     max_position_embeddings=context, attention_dropout=cfg.dropout, rope_theta=cfg.rope_theta,
                     rms_norm_eps=1e-5, attn_implementation="sdpa", **common)
        if cfg.qk_norm:  # Qwen3 is Llama plus a per-head RMSNorm of queries and keys: a standard HF architecture
            model = Qwen3ForCausalLM(Qwen3Config(head_dim=cfg.n_embd // cfg.n_head, **llama))
        else:
            model = LlamaForCausalLM(LlamaConfig(**llama))
    else:
        config = GPT2Config(n_embd=cfg.n_embd, n_layer=cfg.n_layer, n_head=cfg.n_head, n_positions=context,
                            n_inner=cfg.mlp_hidden, resid_pdrop=cfg.dropout,
                            embd_pdrop=cfg.dropout, attn_pdrop=cfg.dropout, attn_implementation="sdpa",
                            # GPT-2's tanh GELU as one fused kernel (its default "gelu_new" is 8 elementwise ops)
                            activation_function="gelu_pytorch_tanh", **common)
        model = GPT2LMHeadModel(config)
    return model


def load_model(directory: str, *, dtype: torch.dtype | None = None, storage: StorageConfig | None = None
               ) -> torch.nn.Module:
    """Load a causal LM: an HF model directory (safetensors weights only; nothing is unpickled), a LoRA adapter
    directory (its base loaded and the adapter merged in), on local disk or an object store, or a .gguf file."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # sparklm reports its own progress; keep stderr for real messages
    path = model_source(directory, storage)
    if (path / ADAPTER_CONFIG).is_file():
        from .lora import load_adapter

        return load_adapter(path, lambda base: load_model(base, dtype=dtype, storage=storage))
    check_causal(check_model_dir(path, directory), directory)
    verify_checksums(path)  # a sparklm model/ records its files' SHA-256
    try:  # transformers picks SDPA where the architecture has it, and its eager attention otherwise (Gemma 2)
        return AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True, trust_remote_code=False,
                                                    use_safetensors=True, dtype=dtype or torch.float32)
    except Exception as e:
        raise SparklmError(f"cannot load the model in {directory}: {' '.join(str(e).split())[:200]}") from None


def context_length(config) -> int | None:
    """The context length a model config gives (a ``PretrainedConfig`` or its config.json as a dict): Llama-style
    ``max_position_embeddings`` or GPT-2's ``n_positions``; None when it names neither."""
    get = config.get if isinstance(config, dict) else lambda key: getattr(config, key, None)
    value = get("max_position_embeddings") or get("n_positions")
    return int(value) if isinstance(value, int) else None


ADAPTER_CONFIG = "adapter_config.json"  # what peft's save_pretrained writes beside the adapter weights


def model_source(directory: str, storage: StorageConfig | None = None) -> Path:
    """The local directory of the model ``directory`` names: itself, an object store's copy in the per-host cache,
    or a .gguf file's conversion (done once, cached)."""
    from ..infra.fs import is_remote, local_copy
    from . import gguf

    if is_remote(directory):
        if directory.lower().endswith(".gguf"):
            raise SparklmError(f"{directory}: a .gguf file is read from local disk only",
                               hint="convert it once with `sparklm import FILE.gguf --output DIR` and pass that DIR")
        return local_copy(directory, storage)
    path = Path(directory).expanduser()
    if path.is_file() and gguf.is_gguf(str(path)):
        return Path(gguf.cached(str(path)))
    if (path / "model" / "config.json").is_file() or (path / "model" / ADAPTER_CONFIG).is_file():
        return path / "model"  # a sparklm run directory
    return path


def check_model_dir(path: Path, name: str) -> dict:
    """One line when ``path`` is not a loadable HF model directory: no config.json, no safetensors weights, or a
    model of its own code; returns its config.json (read once, for the checks that follow)."""
    if not path.exists():
        raise SparklmError(f"model {name} not found", hint="pass an HF model directory, a sparklm run or a .gguf file")
    if not (path / "config.json").is_file():
        raise SparklmError(f"{name} is not a Hugging Face model directory (no config.json)",
                           hint="pass a directory written by save_pretrained, a sparklm run's model/ or a .gguf file")
    if not any(path.glob("*.safetensors")):
        pickled = [p.name for p in path.glob("*.bin")] + [p.name for p in path.glob("*.pt")]
        why = f" (only {', '.join(pickled)}: sparklm never unpickles weights)" if pickled else ""
        raise SparklmError(f"{name} has no safetensors weights{why}",
                           hint="save the model with save_pretrained(..., safe_serialization=True)")
    from ..infra.fs import read_config_json

    config = read_config_json(str(path))
    _refuse_own_code(config, name)
    return config


def check_causal(config: dict, name: str) -> None:
    """One line for a model of a type transformers ships with no causal-LM class (an encoder, T5), where
    AutoModelForCausalLM's own error lists every type it knows, cut short (``config``: its config.json)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    kind = config.get("model_type")
    if kind in CONFIG_MAPPING_NAMES and kind not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        from ..registry import TASK_NAMES, generators

        what = ", ".join(config.get("architectures") or []) or kind
        writers = generators()
        others = ", ".join(n for n in TASK_NAMES if n not in writers)
        raise SparklmError(f"{name} is a {kind!r} model ({what}), not a causal LM",
                           hint="generate and train --task causal-lm take decoder-only models (Llama, Qwen, GPT-2, "
                                f"...); an encoder embeds with `predict --embed` or trains with --task {others}")


def _refuse_own_code(config: dict, name: str) -> None:
    """One line for a model whose type transformers does not ship and whose config maps the Auto classes to Python
    files of its own (``auto_map``): transformers would ask on the terminal whether to run them. sparklm never runs
    a model's code (as it never unpickles its weights). A type transformers ships loads with its own classes."""
    from ..infra.fs import own_code_files

    files = own_code_files(config)
    if not files:
        return
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    if config.get("model_type") not in CONFIG_MAPPING_NAMES:
        raise SparklmError(f"{name} is a {config.get('model_type')!r} model that brings its own Python code "
                           f"({', '.join(files)}); sparklm does not run a model's code",
                           hint="use a model type transformers ships (its Auto classes list them), or convert the "
                                "weights to one")


def param_count(model: torch.nn.Module, *, non_embedding: bool = False) -> int:
    n = sum(p.numel() for p in model.parameters())
    if non_embedding:
        n -= model.get_input_embeddings().weight.numel()
    return n


def flops_per_token(model: torch.nn.Module, context: int) -> float:
    """Training FLOPs per token: 6 × (non-embedding params + LM head) + attention (12 · L · d · T).

    The PaLM/nanoGPT estimate; the LM head counts even when tied (it is a real matmul). Frozen weights
    (LoRA's base) cost 4 per parameter, not 6: the backward pass computes no gradient for them, only
    through them.
    """
    cfg = model.config
    n = param_count(model, non_embedding=True)
    if cfg.tie_word_embeddings:
        n += model.get_output_embeddings().weight.numel()
    embed = model.get_input_embeddings().weight
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad and p is not embed)
    if cfg.tie_word_embeddings and not embed.requires_grad:
        frozen += embed.numel()  # the tied LM head
    return 6.0 * n - 2.0 * frozen + 12.0 * cfg.num_hidden_layers * cfg.hidden_size * context


def blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's repeated units, sharded one by one: the modules whose class the Hugging Face model names as not to
    be split (``_no_split_modules``: its decoder or encoder layers), found through any wrapper (peft's); else the
    entries of its longest ``ModuleList``."""
    import torch

    names: set[str] = set()
    for m in model.modules():
        names |= set(getattr(m, "_no_split_modules", None) or ())
    found = [m for m in model.modules() if type(m).__name__ in names]
    if found:
        return found
    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList)]
    return list(max(lists, key=len)) if lists else []
