"""The task seam: what is trained. A task builds the model, computes its loss and evaluation sums,
says which parameters train (and which decay), and exports the result.

The training core and every strategy talk to a task only through this interface, so an encoder task
(classification, embeddings, masked LM) or LoRA (a trainable subset of a frozen base, merged on
export) plugs in here without touching the loop; rounds ship only the trainable parameters' deltas. The tasks
themselves are sparklm/tasks/'s modules; this one holds the interface and what the token-stream tasks share (the
batch, its targets, the LM head's loss settings). Torch-free at import: the task modules read it on the driver.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from ..config import Config, StorageConfig
from ..data.tokenizer import TokenizerSpec
from .figures import FigureSet

if TYPE_CHECKING:
    import numpy as np
    import torch

IGNORE = -100  # label of positions without a loss (padding), as in HF and torch's cross_entropy (lm_head.IGNORE)


@dataclass(frozen=True)
class Batch:
    input_ids: torch.Tensor  # (B, T)
    attention_mask: torch.Tensor | None  # (B, T) 1 = real token; None: no padding
    labels: torch.Tensor  # (B, T) targets before the shift; IGNORE where no loss


def make_batch(ids: np.ndarray, mask: np.ndarray | None, loss_mask: np.ndarray | None = None) -> Batch:
    """A batch from a stream's (input_ids, attention_mask, loss_mask) arrays: padded positions and those
    whose loss mask is 0 (instruction data: prompts) get no loss (label IGNORE)."""
    import torch

    x = torch.from_numpy(ids)
    m = None if mask is None else torch.from_numpy(mask)
    keep = None if m is None else m != 0
    if loss_mask is not None:
        trains = torch.from_numpy(loss_mask) != 0
        keep = trains if keep is None else keep & trains
    return Batch(x, None if m is None else m.long(), x if keep is None else x.masked_fill(~keep, IGNORE))


def targets(batch: Batch) -> int:
    """The positions of ``batch`` whose next-token prediction counts (labels shift by one inside the model)."""
    return int((batch.labels[:, 1:] != IGNORE).sum())


class Task(Protocol):
    """What is trained. The training core and the strategies ask the task everything that depends on it; a task
    holds only what its configuration says (nothing is set on it during a run)."""

    name: str
    figure_set: FigureSet  # the named figures ``figures`` returns (model/figures.py: what the driver reads)
    eval_width: int  # the length of ``eval_sums``' vector (the loop sums them over batches and ranks)

    def build(self, config: Config, spec: TokenizerSpec, context: int) -> torch.nn.Module: ...

    def batch(self, rows: tuple) -> Batch:
        """A batch from a stream's columns (input_ids, attention_mask, loss_mask; a labelled task its labels)."""
        ...

    def weight(self, batch: Batch) -> int:
        """How much ``batch`` counts in its step (micro-batches weigh by it)."""
        ...

    def loss(self, net: torch.nn.Module, batch: Batch, total: int | None = None,
             tally: torch.Tensor | None = None) -> torch.Tensor:
        """The batch's loss for backward; ``tally`` ([correct, counted], on the device), when given, gets the
        batch's training-accuracy counts added (no extra forward: from what the loss computes)."""
        ...

    def eval_sums(self, model: torch.nn.Module, batch: Batch, byte_lengths: torch.Tensor) -> torch.Tensor: ...

    def figures(self, sums: list[float]) -> dict:
        """The evaluation's named figures (``figure_set``'s keys) from summed ``eval_sums``; {} when nothing was
        scored."""
        ...

    def flops_per_token(self, model: torch.nn.Module, seq_len: int) -> float: ...

    def trainable(self, model: torch.nn.Module) -> dict[str, torch.nn.Parameter]: ...

    def decays(self, model: torch.nn.Module) -> set[int]: ...

    def matrices(self, model: torch.nn.Module) -> set[int]: ...

    def export(self, model: torch.nn.Module, spec: TokenizerSpec, uri: str, storage: StorageConfig) -> None: ...

    def artefacts(self, model: torch.nn.Module, spec: TokenizerSpec, run_dir: str, dataset, config: Config) -> None:
        """What the run leaves besides model/ (text samples for a causal LM)."""
        ...


def set_loss_chunks(model: torch.nn.Module, chunk: int | None, *, fused: bool = False) -> None:
    """How ``model``'s loss is computed: the LM head's loss in chunks of ``chunk`` positions (0: by the vocabulary's
    size; model/lm_head.py), or None: the model's own logits and loss. Kept on the model, decided when it is built;
    ``fused`` (set where train.compile compiles the model): each chunk's terms in one compiled function."""
    model.sparklm_loss_chunk = chunk
    model.sparklm_loss_fused = fused


def loss_chunk(net: torch.nn.Module) -> int | None:
    """What :func:`set_loss_chunks` decided for ``net`` (seen through DDP's wrapper)."""
    return getattr(getattr(net, "module", net), "sparklm_loss_chunk", None)


def loss_fused(net: torch.nn.Module) -> bool:
    """Whether :func:`set_loss_chunks` fused ``net``'s chunked loss (seen through DDP's wrapper)."""
    return getattr(getattr(net, "module", net), "sparklm_loss_fused", False)


