"""Next-token prediction with a decoder: sparklm's own model from ``[model]`` or a pretrained one (``--init-from``),
full or LoRA. The model's math is model/task.py's ``CausalLM``; what a run leaves besides model/ is samples.txt."""

from __future__ import annotations

from ..model.figures import LM_FIGURES
from . import DataKind, TaskInfo


def make(config):
    from ..infer.sampling import Sampling
    from ..metrics.report import write_samples
    from ..model.task import CausalLM

    return CausalLM.from_config(config, sampling=Sampling(), samples=write_samples)


def section(run) -> list[str]:
    from ..metrics.html_report import samples_section

    return samples_section(run)


INFO = TaskInfo(name="causal-lm", figures=LM_FIGURES, make=make, prepares=DataKind(rows="packed"),
                shows="samples.txt", section=section)
