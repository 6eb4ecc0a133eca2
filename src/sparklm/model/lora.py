"""LoRA through ``peft``: adapters on a frozen pretrained model, saved in PEFT's own format.

Only the adapters train, so only they are checkpointed and, with average or DiLoCo, sent between
workers (the task seam's ``trainable``). A run's ``model/`` is what ``PeftModel.save_pretrained``
writes (``adapter_config.json`` naming the base, ``adapter_model.safetensors``) plus the tokenizer;
:func:`load_adapter` reads it back on top of its base.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

from ..config import LoraConfig
from ..infra.errors import SparklmError

ALL_LINEAR = "all-linear"


def no_base() -> SparklmError:
    return SparklmError("LoRA adapts a pretrained model, and none is given",
                        hint="pass --init-from MODEL (an HF model directory or a .gguf file), or drop --lora-r")


def targets(cfg: LoraConfig) -> str | list[str]:
    """peft's ``target_modules``: "all-linear" (every linear layer of the blocks, not the LM head) or names."""
    names = [t.strip() for t in cfg.targets.split(",") if t.strip()]
    if not names:
        raise SparklmError("lora.targets is empty", hint=f"name modules (e.g. q_proj,v_proj) or use {ALL_LINEAR}")
    return ALL_LINEAR if names == [ALL_LINEAR] else names


def peft_config(cfg: LoraConfig, model: torch.nn.Module, task_type: str | None = "CAUSAL_LM"):
    from peft import LoraConfig as PeftLoraConfig

    # GPT-2 stores its projections as Conv1D (weight transposed): peft needs to be told
    conv1d = any(type(m).__name__ == "Conv1D" for m in model.modules())
    return PeftLoraConfig(r=cfg.r, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout, target_modules=targets(cfg),
                          task_type=task_type, fan_in_fan_out=conv1d, bias="none")


def wrap(model: torch.nn.Module, cfg: LoraConfig, task_type: str | None = "CAUSAL_LM") -> torch.nn.Module:
    """``model`` with LoRA adapters (float32, whatever the base's dtype); every base weight frozen, except, for
    peft's ``SEQ_CLS`` task, the classification head (it starts untrained: it always trains)."""
    from peft import get_peft_model

    check_targets(model, cfg)
    with warnings.catch_warnings():  # peft warns about fan_in_fan_out, which peft_config sets on purpose
        warnings.simplefilter("ignore")
        return get_peft_model(model, peft_config(cfg, model, task_type), autocast_adapter_dtype=True)


def check_targets(model: torch.nn.Module, cfg: LoraConfig) -> None:
    """One line when a named target matches no module (peft's own error is a long paragraph)."""
    wanted = targets(cfg)
    if wanted == ALL_LINEAR:
        return
    leaves = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    missing = [t for t in wanted if t not in leaves and not any(n.endswith(f".{t}") for n, _ in model.named_modules())]
    if missing:
        linear = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules()
                         if isinstance(m, torch.nn.Linear) or type(m).__name__ == "Conv1D"} - {"lm_head"})
        raise SparklmError(f"lora.targets names no module of this {type(model).__name__}: {', '.join(missing)}",
                           hint=f"its linear layers are {', '.join(linear)} (or use {ALL_LINEAR})")


def is_lora(model: torch.nn.Module) -> bool:
    return hasattr(model, "peft_config")


def save(model: torch.nn.Module, directory: Path, base: str) -> None:
    """The adapter in PEFT format, its config naming ``base`` (the pretrained model it adapts)."""
    model.peft_config["default"].base_model_name_or_path = base
    model.save_pretrained(str(directory), safe_serialization=True)


def base_of(directory: Path) -> str:
    try:
        return json.loads((directory / "adapter_config.json").read_text())["base_model_name_or_path"]
    except (OSError, ValueError, KeyError, TypeError):
        raise SparklmError(f"{directory}/adapter_config.json does not name its base model",
                           hint="set base_model_name_or_path in it to the base model's directory") from None


def load_adapter(directory: Path, load_base: Callable[[str], torch.nn.Module], *, merge: bool = True
                 ) -> torch.nn.Module:
    """The base model ``directory``'s adapter names, with the adapter loaded (and, with ``merge``, merged in:
    an ordinary HF model, as fast as the base at inference)."""
    from peft import PeftModel

    base_name = base_of(directory)
    try:
        base = load_base(base_name)
    except SparklmError as e:
        raise SparklmError(f"the base model of the adapter {directory} ({base_name}) cannot be loaded: {e.message}",
                           hint="keep the base model where the adapter's adapter_config.json says, or edit "
                                "base_model_name_or_path there") from None
    try:
        with warnings.catch_warnings():  # peft reads transformers' is_gradient_checkpointing, which now warns
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.* is deprecated", category=FutureWarning)
            model = PeftModel.from_pretrained(base, str(directory), is_trainable=False)
    except Exception as e:
        raise SparklmError(f"cannot load the adapter in {directory}: {' '.join(str(e).split())[:200]}") from None
    return model.merge_and_unload() if merge else model
