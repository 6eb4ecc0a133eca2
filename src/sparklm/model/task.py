"""The task seam: what is trained. A task builds the model, computes its loss and evaluation sums,
says which parameters train (and which decay), and exports the result.

The training core and every strategy talk to a task only through this interface, so an encoder task
(classification, embeddings, masked LM) or LoRA (a trainable subset of a frozen base, merged on
export) plugs in here without touching the loop; rounds ship only the trainable parameters' deltas.
``CausalLM`` is the task today.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from ..config import Config, StorageConfig, embedding_rows
from ..data.tokenizer import TokenizerSpec
from ..infra.errors import SparklmError
from . import attention, lm_head, lora
from .build import build_model, context_length, flops_per_token, load_model
from .figures import LM_FIGURES, FigureSet, lm_figures

IGNORE = lm_head.IGNORE  # label of positions without a loss (padding), as in HF and torch's cross_entropy


@dataclass(frozen=True)
class Batch:
    input_ids: torch.Tensor  # (B, T)
    attention_mask: torch.Tensor | None  # (B, T) 1 = real token; None: no padding
    labels: torch.Tensor  # (B, T) targets before the shift; IGNORE where no loss


def make_batch(ids: np.ndarray, mask: np.ndarray | None, loss_mask: np.ndarray | None = None) -> Batch:
    """A batch from a stream's (input_ids, attention_mask, loss_mask) arrays: padded positions and those
    whose loss mask is 0 (instruction data: prompts) get no loss (label IGNORE)."""
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


@dataclass(frozen=True)
class CausalLM:
    """Next-token prediction with an HF causal LM (built from config, or continued from a directory)."""

    name = "causal-lm"
    figure_set = LM_FIGURES
    eval_width = 4  # nats, tokens, correct, bytes
    base: str = ""  # the pretrained model LoRA adapts (named in the exported adapter's config)
    chunk: int = 0  # train.loss_chunk: positions per chunk of the LM-head loss; 0: by the vocabulary; -1: off
    # how the exported model samples by default (infer/sampling.py's Sampling; None: transformers' defaults), and
    # what writes the run's text samples (model, spec, run_dir, dataset, config; None: none): given by the task's
    # module (tasks/causal_lm.py), which sits above the model and the inference code
    sampling: Any = field(default=None, compare=False)
    samples: Callable | None = field(default=None, compare=False)

    @classmethod
    def from_config(cls, config: Config, *, sampling: Any = None, samples: Callable | None = None) -> CausalLM:
        return cls(base=config.model.init_from, chunk=config.train.loss_chunk,
                   sampling=sampling, samples=samples)

    def build(self, config: Config, spec: TokenizerSpec, context: int) -> torch.nn.Module:
        vocab = spec.vocab_size
        if config.model.init_from:
            dtype = torch.bfloat16 if config.lora.r and config.lora.base_dtype == "bfloat16" else None
            model = load_model(config.model.init_from, dtype=dtype, storage=config.storage)
            have = model.get_input_embeddings().weight.shape[0]
            if have < vocab:
                raise SparklmError(f"{config.model.init_from} has a vocabulary of {have} tokens, the data's tokenizer "
                                   f"{vocab}", hint="prepare the data with --tokenizer pointing at that model's tokenizer")
        elif config.lora.r:
            raise lora.no_base()
        else:
            model = build_model(config.model, vocab_size=embedding_rows(vocab), context=context,
                                bos_id=spec.bos_id, eos_id=spec.eos_id, pad_id=spec.pad_id, seed=config.train.seed)
        if config.train.grad_checkpoint == "on":  # "auto" was resolved by the memory plan (train/memory.py)
            # non-reentrant: works with frozen inputs (LoRA) and needs no inputs that require grad
            if hasattr(model, "activation_checkpointing_enable"):  # transformers 5's name
                model.activation_checkpointing_enable({"use_reentrant": False})
            else:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False  # training never reuses keys and values
        if config.train.attention == "matmul":  # for this process only: saved configs keep naming SDPA
            model.config._attn_implementation = attention.register()
        if config.lora.r:
            torch.manual_seed(config.train.seed)  # the adapters' initial weights, the same in every process
            model = lora.wrap(model, config.lora)
        chunked = self.chunk >= 0 and lm_head.supports(model)
        set_loss_chunks(model, self.chunk if chunked else None)
        return model

    def batch(self, rows: tuple) -> Batch:
        return make_batch(*rows[:3])

    def weight(self, batch: Batch) -> int:
        return targets(batch)

    def loss(self, net: torch.nn.Module, batch: Batch, total: int | None = None,
             tally: torch.Tensor | None = None) -> torch.Tensor:
        """The summed next-token loss of ``batch`` divided by ``total`` targets (default: the batch's own), so that
        micro-batches of a step weigh by the targets they hold (instruction data: response tokens only); a batch
        without any target gives a zero that still reaches every parameter (DDP expects every gradient)."""
        n = targets(batch)
        chunk = loss_chunk(net)
        if chunk is not None:  # the head's loss a chunk of positions at a time (model/lm_head.py)
            with lm_head.hidden_states(net) as box:
                net(input_ids=batch.input_ids, attention_mask=batch.attention_mask)
            nats = lm_head.nll_sum(box["hidden"], lm_head.head_of(net), batch.labels, chunk, tally,
                                   fused=loss_fused(net))
            return nats / (total or max(n, 1))
        out = net(input_ids=batch.input_ids, attention_mask=batch.attention_mask, labels=batch.labels)
        if tally is not None:
            with torch.no_grad():
                want = batch.labels[:, 1:]
                keep = want != IGNORE
                # max's indices, not argmax: the same first-maximum index, and on the CPU 4x faster on bf16 logits
                # (argmax converts them; 30 against 7 ms for 16 x 256 x 4096, ~5% of a compiled bf16 step)
                tally[0] += (out.logits[:, :-1].max(-1).indices[keep] == want[keep]).sum()
                tally[1] += keep.sum()
        if n == 0:
            return out.logits.sum() * 0.0
        return out.loss * (n / (total or n))

    def eval_sums(self, model: torch.nn.Module, batch: Batch, byte_lengths: torch.Tensor) -> torch.Tensor:
        # the targets the loss counts: labels are IGNORE on padding and on tokens whose loss mask is 0
        mask = batch.attention_mask if batch.attention_mask is not None else torch.ones_like(batch.input_ids)
        chunk = loss_chunk(model)
        return lm_head.score(model, batch.input_ids, mask, batch.labels[:, 1:] != IGNORE, byte_lengths,
                             chunk=chunk or 0, chunked=chunk is not None)

    def figures(self, sums: list[float]) -> dict:
        """val_loss (nats per target token), val_ppl, val_bpb (bits per byte of text), val_acc, val_tokens from
        summed [nats, tokens, correct, bytes]."""
        return self.figure_set.named(lm_figures(*sums))

    def flops_per_token(self, model: torch.nn.Module, seq_len: int) -> float:
        return flops_per_token(model, seq_len)

    def trainable(self, model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
        return {n: p for n, p in model.named_parameters() if p.requires_grad}

    def decays(self, model: torch.nn.Module) -> set[int]:
        """Weight decay on matrices, not on norms, biases or the embedding table."""
        embed = id(model.get_input_embeddings().weight)
        return {id(p) for p in model.parameters() if p.dim() >= 2 and id(p) != embed}

    def matrices(self, model: torch.nn.Module) -> set[int]:
        """The hidden weight matrices (attention, MLP): what Muon optimizes; not the embedding or the LM head."""
        ends = {id(model.get_input_embeddings().weight), id(model.get_output_embeddings().weight)}
        return {id(p) for p in model.parameters() if p.dim() == 2 and id(p) not in ends}

    def export(self, model: torch.nn.Module, spec: TokenizerSpec, uri: str, storage: StorageConfig) -> None:
        """An HF model directory (config, model.safetensors, tokenizer files, generation config), or with LoRA
        the adapter in PEFT format naming its base, with the tokenizer files."""
        from ..infra.fs import CHECKSUMS, staged_dir, write_checksums

        gc = model.generation_config
        gc.bos_token_id = spec.bos_id if spec.add_bos else None
        gc.eos_token_id = spec.eos_id
        gc.pad_token_id = spec.pad_id
        default = self.sampling
        if default is not None:  # what `sparklm generate` does by default: pipeline("text-generation") samples alike
            gc.do_sample = default.temperature > 0
            gc.temperature, gc.top_k, gc.top_p = default.temperature, default.top_k, default.top_p
            gc.min_p, gc.repetition_penalty = default.min_p, default.repetition_penalty
        context = context_length(model.config)
        if default is not None:
            gc.max_new_tokens = default.fitted(context).max_new_tokens
        with staged_dir(uri, storage, marker=CHECKSUMS) as tmp:
            if lora.is_lora(model):
                lora.save(model, tmp, base_name(self.base))
            else:
                model.config.use_cache = True  # for generation by whoever loads it
                model.save_pretrained(str(tmp), safe_serialization=True)
                model.config.use_cache = False
            spec.save(tmp, context=context)
            # peft writes a blank model card template; the run writes its own card (README.md) once it knows its figures
            (tmp / "README.md").unlink(missing_ok=True)
            write_checksums(tmp)

    def artefacts(self, model: torch.nn.Module, spec: TokenizerSpec, run_dir: str, dataset, config: Config) -> None:
        """samples.txt: continuations of validation prompts (train.samples of them)."""
        if self.samples is not None:
            self.samples(model, spec, run_dir, dataset, config)


def base_name(init_from: str) -> str:
    """How an adapter names its base: an object store URI as given, a local path absolute (so it loads from
    anywhere on this host)."""
    from ..infra.fs import is_remote

    return init_from if is_remote(init_from) else str(Path(init_from).expanduser().resolve())
