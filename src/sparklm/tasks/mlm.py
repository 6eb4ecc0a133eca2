"""Masked-LM continued pretraining of an encoder (``--init-from``): adapt it to a domain's text before fine-tuning
it. 15% of the tokens (or whole words) are chosen, 80% of them masked, 10% replaced, 10% kept (model/masking.py's
rule); the figures are a causal LM's loss, perplexity and accuracy on the masked tokens. The whole task is this
module, on the encoder building blocks (model/encoders.py). torch is imported where a model is built.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..config import Config
from ..data.tokenizer import TokenizerSpec
from ..infra.errors import SparklmError
from ..model.encoders import EncoderBatch, EncoderTask
from ..model.figures import Figure, FigureSet, lm_figures
from ..registry import DataKind, TaskInfo

if TYPE_CHECKING:
    import torch

FIGURES = FigureSet((
    Figure("val_loss", "loss", "loss", ".4f"),
    Figure("val_ppl", "perplexity", "perplexity", ".3f"),
    Figure("val_acc", "accuracy", "masked accuracy", ".2%"),
    Figure("val_tokens", "tokens", "masked tokens", ",d", shown=False),
), loss="val_loss", headline="val_loss")


@dataclass(frozen=True)
class MaskedLM(EncoderTask):
    """Masked-LM continued pretraining: adapt an encoder to a domain's text before fine-tuning it."""

    name = "mlm"
    figure_set = FIGURES
    eval_width = 4
    probability: float = 0.15
    whole_word: bool = False

    @classmethod
    def from_config(cls, config: Config) -> MaskedLM:
        return cls(probability=config.model.mlm_probability, whole_word=config.model.whole_word_mask)

    def build(self, config: Config, spec: TokenizerSpec, context: int) -> torch.nn.Module:
        from transformers import AutoModelForMaskedLM

        from ..model.encoders import load_pretrained, uses_types, wrap_encoder

        model = load_pretrained(config, AutoModelForMaskedLM, "a masked LM")
        model.sparklm_types = uses_types(model)
        model.sparklm_masking = Masking.of(spec)
        return wrap_encoder(model, config, None)

    def batch(self, rows) -> EncoderBatch:
        from ..model.encoders import encoder_batch

        return encoder_batch(rows)

    def _masked(self, net: torch.nn.Module, batch: EncoderBatch, generator=None) -> tuple[torch.Tensor, torch.Tensor]:
        from ..model import masking
        from ..model.encoders import base_model

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
        import torch
        import torch.nn.functional as F

        from ..model import masking
        from ..model.encoders import forward

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
        import torch
        import torch.nn.functional as F

        from ..model import masking
        from ..model.encoders import forward

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
        import numpy as np
        import torch

        from ..model import masking
        from ..model.encoders import MASK_NAMES, find_token

        tok = spec.tokenizer()
        vocab = tok.get_vocab(with_added_tokens=True)
        mask = find_token(vocab, MASK_NAMES)
        if mask is None:
            raise SparklmError(f"the dataset's tokenizer has no mask token ({' or '.join(MASK_NAMES)})",
                               hint="--task mlm needs an encoder's tokenizer (BERT, RoBERTa, ...)")
        size = max(vocab.values()) + 1
        special_ids = {i for i, t in tok.get_added_tokens_decoder().items() if t.special}
        special = torch.zeros(size, dtype=torch.bool)
        special[list(special_ids)] = True
        replacements = torch.from_numpy(np.flatnonzero(~special.numpy())).long()
        return cls(vocab[mask], special, replacements, masking.word_start_table(vocab, special_ids))


def make(config: Config) -> MaskedLM:
    return MaskedLM.from_config(config)


INFO = TaskInfo(name="mlm", figures=FIGURES, make=make, data=("mlm", "classify"),
                prepares=DataKind(rows="encoded", long="window"), pretrained=True, auto="AutoModelForMaskedLM",
                peft=None, pipeline="fill-mask")
