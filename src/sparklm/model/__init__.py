"""Model: build an HF causal LM from config or a directory; FLOPs and parameter counts."""

from .build import build_model, flops_per_token, load_model, param_count

__all__ = ["build_model", "flops_per_token", "load_model", "param_count"]
