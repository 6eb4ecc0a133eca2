"""Encoder tasks on the task seam (model/task.py): sequence classification and masked-LM pretraining of a
pretrained HF model (``--init-from``), full or LoRA, under every strategy.

Both read an encoder dataset (data/labelled.py: one record per row with the tokenizer's own CLS/SEP, padded) and
load what ``AutoModelForSequenceClassification`` / ``AutoModelForMaskedLM`` load from a local or object-store
directory (the per-host cache, safetensors only). The classifier's head always trains (peft's ``SEQ_CLS`` task
keeps it in ``modules_to_save``); LoRA runs export merged weights, so that ``model/`` is a plain HF directory that
``pipeline("text-classification")`` loads, with ``id2label``/``label2id`` from the dataset's classes.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from ..config import Config, StorageConfig
from ..data.tokenizer import TokenizerSpec
from ..infra.errors import SparklmError
from . import lora, masking
from .build import model_source
from .figures import CLASSIFY_FIGURES, MLM_FIGURES, classify_figures, lm_figures, safe_name

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


def _find(vocab: dict, names: tuple[str, ...]) -> str | None:
    return next((n for n in names if n in vocab), None)


def encoder_tokenizer(spec: TokenizerSpec, context: int | None):
    """The dataset's tokenizer as ``transformers`` sees an encoder's: CLS/SEP (the spec's BOS/EOS: prepare took
    them from the encoder's tokenizer), PAD, MASK and UNK named, so pipelines and collators find them."""
    from transformers import PreTrainedTokenizerFast

    tok = spec.tokenizer()
    vocab = tok.get_vocab(with_added_tokens=True)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, cls_token=spec.bos_token, sep_token=spec.eos_token,
                                 pad_token=spec.pad_token, mask_token=_find(vocab, MASK_NAMES),
                                 unk_token=_find(vocab, UNK_NAMES), model_max_length=context or int(1e30))
    return hf


def wrap_encoder(model: torch.nn.Module, config: Config, task_type: str | None) -> torch.nn.Module:
    if config.train.grad_checkpoint == "on" and getattr(model, "supports_gradient_checkpointing", False):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if config.lora.r:
        torch.manual_seed(config.train.seed)  # the adapters' initial weights, the same in every process
        model = lora.wrap(model, config.lora, task_type=task_type)
    return model


def base_model(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model under DDP's and peft's wrappers."""
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
        from .build import context_length

        out = model
        if lora.is_lora(model):  # merged into a copy: the run may go on training the adapters
            out = copy.deepcopy(model).merge_and_unload()
        context = context_length(out.config)
        with staged_dir(uri, storage, marker=CHECKSUMS) as tmp:
            out.save_pretrained(str(tmp), safe_serialization=True)
            encoder_tokenizer(spec, context).save_pretrained(str(tmp))
            write_checksums(tmp)


@dataclass(frozen=True)
class SequenceClassifier(EncoderTask):
    """Text (pair) classification into ``labels`` (the dataset's classes, in id order)."""

    name = "classify"
    figure_set = CLASSIFY_FIGURES
    labels: tuple[str, ...] = ()

    @classmethod
    def from_config(cls, config: Config) -> SequenceClassifier:
        return cls(labels=tuple(config.model.labels))

    @property
    def eval_width(self) -> int:
        return 3 + len(self.labels) ** 2

    def build(self, config: Config, spec: TokenizerSpec, context: int) -> torch.nn.Module:
        from transformers import AutoModelForSequenceClassification

        if len(self.labels) < 2:
            raise SparklmError("--task classify needs the dataset's classes (model.labels), and has "
                               f"{len(self.labels)}", hint="train on data prepared with `sparklm prepare --task classify`")
        names = dict(enumerate(self.labels))
        model = load_pretrained(config, AutoModelForSequenceClassification, "a sequence classifier",
                                id2label=names,
                                label2id={v: k for k, v in names.items()})
        if model.config.pad_token_id is None:  # decoders pool their last real token: they must know the padding
            model.config.pad_token_id = spec.pad_id
        model.sparklm_types = uses_types(model)
        return wrap_encoder(model, config, "SEQ_CLS")

    def batch(self, rows) -> EncoderBatch:
        return encoder_batch(rows)

    def loss(self, net: torch.nn.Module, batch: EncoderBatch, total: int | None = None,
             tally: torch.Tensor | None = None) -> torch.Tensor:
        logits = forward(net, batch).logits.float()
        if tally is not None:
            with torch.no_grad():
                tally[0] += (logits.argmax(-1) == batch.labels).sum()
                tally[1] += batch.labels.numel()
        return F.cross_entropy(logits, batch.labels, reduction="sum") / (total or batch.labels.numel())

    def eval_sums(self, model: torch.nn.Module, batch: EncoderBatch, byte_lengths: torch.Tensor) -> torch.Tensor:
        """[nats, examples, correct, confusion matrix K×K (true class-major)]."""
        logits = forward(model, batch).logits.float()
        k = len(self.labels)
        pred = logits.argmax(-1)
        confusion = torch.bincount(batch.labels * k + pred, minlength=k * k).double()
        head = torch.stack([F.cross_entropy(logits, batch.labels, reduction="sum").double(),
                            torch.tensor(float(batch.labels.numel()), dtype=torch.float64, device=logits.device),
                            (pred == batch.labels).sum().double()])
        return torch.cat([head, confusion])

    def figures(self, sums: list[float]) -> dict:
        """The figure set's figures, each class's precision and recall (``val_precision/NAME``: trackers log them),
        and ``val_per_class`` and ``val_confusion`` (summary.json)."""
        values = classify_figures(sums, list(self.labels))
        if not values:
            return {}
        out = self.figure_set.named(values)
        for name, v in values["per_class"].items():
            out[f"val_precision/{safe_name(name)}"] = v["precision"]
            out[f"val_recall/{safe_name(name)}"] = v["recall"]
        out["val_per_class"] = values["per_class"]
        out["val_confusion"] = values["confusion"]
        return out


@dataclass(frozen=True)
class MaskedLM(EncoderTask):
    """Masked-LM continued pretraining: adapt an encoder to a domain's text before fine-tuning it."""

    name = "mlm"
    figure_set = MLM_FIGURES
    eval_width = 4
    probability: float = 0.15
    whole_word: bool = False

    @classmethod
    def from_config(cls, config: Config) -> MaskedLM:
        return cls(probability=config.model.mlm_probability, whole_word=config.model.whole_word_mask)

    def build(self, config: Config, spec: TokenizerSpec, context: int) -> torch.nn.Module:
        from transformers import AutoModelForMaskedLM

        model = load_pretrained(config, AutoModelForMaskedLM, "a masked LM")
        model.sparklm_types = uses_types(model)
        model.sparklm_masking = Masking.of(spec)
        return wrap_encoder(model, config, None)

    def batch(self, rows) -> EncoderBatch:
        return encoder_batch(rows)

    def _masked(self, net: torch.nn.Module, batch: EncoderBatch, generator=None) -> tuple[torch.Tensor, torch.Tensor]:
        m: Masking = base_model(net).sparklm_masking
        # Drawn on the CPU from its RNG (which checkpoints keep), then moved: the same masks on either device.
        ids = batch.input_ids.cpu()
        special = m.special[ids]
        maskable = (batch.attention_mask.cpu() != 0) & ~special
        starts = masking.word_starts(ids, m.starts, special) if self.whole_word else None
        inputs, labels = masking.mask_tokens(ids, maskable, mask_id=m.mask_id, replacements=m.replacements,
                                             probability=self.probability, word_starts=starts, generator=generator)
        where = batch.input_ids.device
        return inputs.to(where, non_blocking=True), labels.to(where, non_blocking=True)

    def loss(self, net: torch.nn.Module, batch: EncoderBatch, total: int | None = None,
             tally: torch.Tensor | None = None) -> torch.Tensor:
        """The masked tokens' mean loss; micro-batches weigh by rows (their masked counts vary by chance)."""
        inputs, labels = self._masked(net, batch)
        logits = forward(net, EncoderBatch(inputs, batch.attention_mask, None, batch.token_type_ids)).logits
        keep = labels != masking.IGNORE
        if tally is not None:
            with torch.no_grad():
                tally[0] += (logits[keep].argmax(-1) == labels[keep]).sum()
                tally[1] += keep.sum()
        if not keep.any():
            return logits.sum() * 0.0
        rows = batch.input_ids.shape[0]
        return F.cross_entropy(logits[keep].float(), labels[keep]) * (rows / (total or rows))

    def eval_sums(self, model: torch.nn.Module, batch: EncoderBatch, byte_lengths: torch.Tensor) -> torch.Tensor:
        """[nats, masked tokens, correct, 0] with masks drawn from the batch's own content (the same every evaluation,
        whatever the batching of other rows)."""
        seed = int(batch.input_ids.sum()) * 1_000_003 + int(batch.input_ids[:, :8].sum())
        inputs, labels = self._masked(model, batch, torch.Generator().manual_seed(seed % (2**63)))
        logits = forward(model, EncoderBatch(inputs, batch.attention_mask, None, batch.token_type_ids)).logits
        keep = labels != masking.IGNORE
        out = logits[keep].float()
        zero = torch.zeros((), dtype=torch.float64, device=out.device)
        return torch.stack([F.cross_entropy(out, labels[keep], reduction="sum").double() if keep.any() else zero,
                            keep.sum().double(), (out.argmax(-1) == labels[keep]).sum().double(), zero])

    def figures(self, sums: list[float]) -> dict:
        """Loss per masked token, perplexity, masked accuracy and count (a causal LM's figures from the same sums;
        the figure set has no bits per byte)."""
        return self.figure_set.named(lm_figures(*sums))



@dataclass(frozen=True)
class Masking:
    """What masking needs from the tokenizer, as tensors: the mask id, the special ids, the ids a random
    replacement may take, and where words start."""

    mask_id: int
    special: torch.Tensor  # [vocab] bool
    replacements: torch.Tensor  # [n] int64
    starts: torch.Tensor  # [vocab] bool

    @classmethod
    def of(cls, spec: TokenizerSpec) -> Masking:
        tok = spec.tokenizer()
        vocab = tok.get_vocab(with_added_tokens=True)
        mask = _find(vocab, MASK_NAMES)
        if mask is None:
            raise SparklmError(f"the dataset's tokenizer has no mask token ({' or '.join(MASK_NAMES)})",
                               hint="--task mlm needs an encoder's tokenizer (BERT, RoBERTa, ...)")
        size = max(vocab.values()) + 1
        special_ids = {i for i, t in tok.get_added_tokens_decoder().items() if t.special}
        special = torch.zeros(size, dtype=torch.bool)
        special[list(special_ids)] = True
        replacements = torch.from_numpy(np.flatnonzero(~special.numpy())).long()
        return cls(vocab[mask], special, replacements, masking.word_start_table(vocab, special_ids))
