"""Masked-LM continued pretraining of an encoder (``--init-from``): adapt it to a domain's text before fine-tuning
it. The model's math is model/encoders.py's ``MaskedLM``."""

from __future__ import annotations

from ..model.figures import MLM_FIGURES
from . import DataKind, TaskInfo


def make(config):
    from ..model.encoders import MaskedLM

    return MaskedLM.from_config(config)


INFO = TaskInfo(name="mlm", figures=MLM_FIGURES, make=make, data=("mlm", "classify"),
                prepares=DataKind(rows="encoded", long="window"), pretrained=True, auto="AutoModelForMaskedLM",
                peft=None, pipeline="fill-mask")
