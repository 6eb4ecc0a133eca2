"""What the encoder tasks (sparklm/tasks/: classification, regression, masked LM) are built from: the batch of an
encoder dataset (data/labelled.py: one record per row with the tokenizer's own CLS/SEP, padded), loading a pretrained
HF model (``--init-from``: what ``AutoModelForSequenceClassification`` / ``AutoModelForMaskedLM`` load from a local or
object-store directory, the per-host cache, safetensors only), LoRA wrapping (a classifier's head always trains:
peft's ``SEQ_CLS`` keeps it in ``modules_to_save``), and :class:`EncoderTask`: parameters, decay, FLOPs and the merged
export, so that ``model/`` is a plain HF directory its pipeline loads. Torch-free at import.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..config import Config, StorageConfig
from ..data.tokenizer import TokenizerSpec
from ..infra.errors import SparklmError
from .build import model_source

if TYPE_CHECKING:  # torch is imported where a model is built or run: the task modules read this one on the driver
    import torch

MASK_NAMES = ("[MASK]", "<mask>")
UNK_NAMES = ("[UNK]", "<unk>")


@dataclass(frozen=True)
class EncoderBatch:
    input_ids: torch.Tensor  # (B, T)
    attention_mask: torch.Tensor  # (B, T)
    labels: torch.Tensor | None  # (B,) class ids (classify); None: masked at the loss (mlm)
    token_type_ids: torch.Tensor | None = None  # (B, T), text pairs


def encoder_batch(rows) -> EncoderBatch:
    """A batch from a stream's Rows of an encoder dataset, its padding cut to the batch's longest row (rows are
    stored padded to seq_len; attention ignores padding, so the answers are the same, for less work)."""
    import torch

    width = int(rows.attention_mask.sum(axis=1).max()) if rows.attention_mask is not None else rows.input_ids.shape[1]
    cut = slice(0, max(width, 1))
    ids = torch.from_numpy(rows.input_ids[:, cut])
    mask = torch.ones_like(ids) if rows.attention_mask is None else torch.from_numpy(rows.attention_mask[:, cut]).long()
    labels = None if rows.labels is None else torch.from_numpy(rows.labels)
    types = None if rows.token_type_ids is None else torch.from_numpy(rows.token_type_ids[:, cut]).long()
    return EncoderBatch(ids, mask, labels, types)


def no_model(task: str) -> SparklmError:
    return SparklmError(f"--task {task} trains a pretrained model, and none is given",
                        hint="pass --init-from MODEL_DIR (an HF model directory, e.g. a BERT or RoBERTa)")


def load_pretrained(config: Config, auto_class, what: str, **overrides) -> torch.nn.Module:
    """``config.model.init_from`` loaded with ``auto_class``; one line when it cannot be (no such model, a model
    type without that head, a damaged directory)."""
    import torch
    from transformers import AutoConfig
    from transformers.utils import logging as hf_logging

    from ..infra.fs import verify_checksums
    from .build import check_model_dir

    name = config.model.init_from
    if not name:
        raise no_model(config.model.task)
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()  # "newly initialized: classifier..." is what fine-tuning means here
    torch.manual_seed(config.train.seed)  # a new head's initial weights: the same in every process and run
    path = model_source(name, config.storage)
    check_model_dir(path, name)
    verify_checksums(path)
    try:
        hf_config = AutoConfig.from_pretrained(str(path), local_files_only=True, trust_remote_code=False, **overrides)
        return auto_class.from_pretrained(str(path), config=hf_config, local_files_only=True, trust_remote_code=False,
                                          use_safetensors=True, dtype=torch.float32, ignore_mismatched_sizes=True)
    except Exception as e:
        raise SparklmError(f"cannot load {name} as {what}: {' '.join(str(e).split())[:200]}",
                           hint="pass a model whose architecture has that head (transformers' Auto classes list them)"
                           ) from None


# model types whose position ids start after the padding id (RoBERTa's convention: transformers'
# create_position_ids_from_input_ids): padding id + 1 positions fewer. MPNet's padding id is 1 whatever its config says.
_OFFSET_POSITIONS = ("roberta", "xlm-roberta", "xlm-roberta-xl", "camembert", "longformer", "data2vec-text", "ibert",
                     "mpnet", "roberta-prelayernorm", "esm", "luke", "xmod", "markuplm", "lilt")
_FIXED_PADDING = {"mpnet": 1}


def positions(hf_config: dict) -> int | None:
    """How many tokens a row may hold for the model of ``hf_config`` (config.json as a dict); None: no limit known."""
    n = hf_config.get("max_position_embeddings") or hf_config.get("n_positions")  # GPT-2 names it n_positions
    if not isinstance(n, int):
        return None
    kind = hf_config.get("model_type")
    if kind in _OFFSET_POSITIONS:
        n -= int(_FIXED_PADDING.get(kind, hf_config.get("pad_token_id") or 0)) + 1
    return n


def check_loadable(config: Config, path: Path, seq_len: int | None = None,
                   auto: str = "AutoModelForSequenceClassification") -> None:
    """Before Spark starts: the model in ``path`` (``--init-from``'s local copy) has the task's head (``auto``: the
    Auto class the task loads it with), and its positions hold the dataset's rows (a config read, no weights)."""
    import json

    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_MASKED_LM_MAPPING_NAMES,
        MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES,
    )

    name = config.model.init_from
    try:
        hf_config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return  # load_pretrained says what is wrong with it
    kind = hf_config.get("model_type")
    table, what = {"AutoModelForSequenceClassification": (MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES,
                                                          "a sequence classifier"),
                   "AutoModelForMaskedLM": (MODEL_FOR_MASKED_LM_MAPPING_NAMES, "a masked LM")}[auto]
    if kind not in table:
        raise SparklmError(f"{name} (model type {kind!r}) cannot be loaded as {what} for --task {config.model.task}",
                           hint="pass a model whose type transformers can load with that head (BERT, RoBERTa, "
                                "DistilBERT, XLM-R; decoders such as Llama or Qwen classify too)")
    limit = positions(hf_config)
    if seq_len and limit and seq_len > limit:
        raise SparklmError(f"the dataset's rows hold {seq_len} tokens and {name} has {limit} positions",
                           hint=f"prepare the data again with --seq-len {limit} or less (longer texts are then "
                                "truncated and counted, or windowed with --long window)")


def find_token(vocab: dict, names: tuple[str, ...]) -> str | None:
    return next((n for n in names if n in vocab), None)


def encoder_tokenizer(spec: TokenizerSpec, context: int | None):
    """The dataset's tokenizer as ``transformers`` sees an encoder's: CLS/SEP (the spec's BOS/EOS: prepare took
    them from the encoder's tokenizer), PAD, MASK and UNK named, so pipelines and collators find them."""
    from transformers import PreTrainedTokenizerFast

    tok = spec.tokenizer()
    vocab = tok.get_vocab(with_added_tokens=True)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, cls_token=spec.bos_token, sep_token=spec.eos_token,
                                 pad_token=spec.pad_token, mask_token=find_token(vocab, MASK_NAMES),
                                 unk_token=find_token(vocab, UNK_NAMES), model_max_length=context or int(1e30))
    return hf


def wrap_encoder(model: torch.nn.Module, config: Config, task_type: str | None) -> torch.nn.Module:
    import torch

    from . import lora

    if config.train.grad_checkpoint == "on" and getattr(model, "supports_gradient_checkpointing", False):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if config.lora.r:
        torch.manual_seed(config.train.seed)  # the adapters' initial weights, the same in every process
        model = lora.wrap(model, config.lora, task_type=task_type)
    return model


def base_model(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model under DDP's and peft's wrappers."""
    from . import lora

    model = getattr(model, "module", model)
    return model.get_base_model() if lora.is_lora(model) else model


def forward(net: torch.nn.Module, batch: EncoderBatch, **extra):
    kwargs = {"input_ids": batch.input_ids, "attention_mask": batch.attention_mask, **extra}
    if batch.token_type_ids is not None and getattr(base_model(net), "sparklm_types", False):
        kwargs["token_type_ids"] = batch.token_type_ids
    return net(**kwargs)


def uses_types(model: torch.nn.Module) -> bool:
    """Whether the model has segment embeddings for a second text (BERT: 2; RoBERTa: 1, DistilBERT: none)."""
    return int(getattr(model.config, "type_vocab_size", 0) or 0) >= 2


class EncoderTask:
    """What the encoder tasks share: parameters, decay, FLOPs and the merged HF export."""

    name = "encoder"

    def weight(self, batch: EncoderBatch) -> int:
        return int(batch.input_ids.shape[0])

    def flops_per_token(self, model: torch.nn.Module, seq_len: int) -> float:
        """6 × non-embedding parameters (4 for frozen ones: no weight gradient) + attention (12 · L · d · T)."""
        base = base_model(model)
        embed = base.get_input_embeddings().weight
        n = sum(p.numel() for p in model.parameters() if p is not embed)
        frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad and p is not embed)
        cfg = base.config
        return 6.0 * n - 2.0 * frozen + 12.0 * cfg.num_hidden_layers * cfg.hidden_size * seq_len

    def trainable(self, model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
        return {n: p for n, p in model.named_parameters() if p.requires_grad}

    def decays(self, model: torch.nn.Module) -> set[int]:
        """Weight decay on matrices, not on norms, biases or the embedding tables."""
        import torch

        embeds = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
        return {id(p) for p in model.parameters() if p.dim() >= 2 and id(p) not in embeds}

    def matrices(self, model: torch.nn.Module) -> set[int]:
        """The hidden weight matrices: not the embeddings, nor the head (what Muon would optimize)."""
        heads = {id(p) for n, p in model.named_parameters() if any(h in n for h in ("classifier", "score", "lm_head",
                                                                                    "cls.predictions", "pre_classifier"))}
        return self.decays(model) - heads

    def artefacts(self, model: torch.nn.Module, spec: TokenizerSpec, run_dir: str, dataset, config: Config) -> None:
        """Nothing beside model/: an encoder has no text samples to show; a classifier's confusion matrix is drawn
        from its kept evaluation by the driver (confusion.png: tasks/classify.py)."""

    def export(self, model: torch.nn.Module, spec: TokenizerSpec, uri: str, storage: StorageConfig) -> None:
        """An HF model directory (merged weights when LoRA trained) with the tokenizer as an encoder's."""
        from ..infra.fs import CHECKSUMS, staged_dir, write_checksums
        from . import lora
        from .build import context_length

        out = model
        if lora.is_lora(model):  # merged into a copy: the run may go on training the adapters
            out = copy.deepcopy(model).merge_and_unload()
        context = context_length(out.config)
        with staged_dir(uri, storage, marker=CHECKSUMS) as tmp:
            out.save_pretrained(str(tmp), safe_serialization=True)
            encoder_tokenizer(spec, context).save_pretrained(str(tmp))
            write_checksums(tmp)


