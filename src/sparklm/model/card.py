"""The model card (``README.md``) beside a trained model, as the Hugging Face Hub shows one: front matter the Hub
reads (library, pipeline, base model, licence), then what was trained on what, the figures, and how to load it."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from ..version import __version__

_FIGURES = (("val_bpb", "validation bits per byte", ".4f"), ("val_loss", "validation loss", ".4f"),
            ("val_ppl", "validation perplexity", ".2f"), ("val_acc", "next-token accuracy", ".2%"))


def base_license(base_dir: str) -> str | None:
    """The ``license:`` of a local base model's own card, if it has one (a sparklm run never guesses a licence)."""
    card = Path(base_dir).expanduser() / "README.md"
    try:
        text = card.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    front = re.match(r"---\s*\n(.*?)\n---", text, re.S)
    found = re.search(r"^license:\s*(\S+)\s*$", front.group(1), re.M) if front else None
    return found.group(1).strip("'\"") if found else None


def model_card(*, name: str, summary: dict[str, Any], data: str, base: str = "", license: str | None = None,
               adapter: bool = False, which: str = "the best evaluation", final: bool = False) -> str:
    """Markdown with the Hub's front matter; ``base``: the model fine-tuned (empty: trained from scratch);
    ``which``: which of the run's models this directory holds; ``final``: its figures are the last evaluation's
    (else the best one's)."""
    front = ["library_name: " + ("peft" if adapter else "transformers"), "pipeline_tag: text-generation",
             "tags:", "- sparklm", "- apache-spark"]
    if base:
        front.append(f"base_model: {base}")
    if license:
        front.append(f"license: {license}")
    best = (summary.get("final") if final else summary.get("best")) or summary.get("final") or {}
    rows = [f"| {label} | {best[key]:{fmt}} |" for key, label, fmt in _FIGURES if best.get(key) is not None]
    trained = (f"fine-tuned from `{base}`" + (" with LoRA (this directory holds the adapter)" if adapter else "")
               if base else "trained from scratch")
    load = ("from peft import AutoPeftModelForCausalLM\nfrom transformers import AutoTokenizer, pipeline\n\n"
            f'model = AutoPeftModelForCausalLM.from_pretrained("{name}")\n') if adapter else (
        "from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline\n\n"
        f'model = AutoModelForCausalLM.from_pretrained("{name}")\n')
    return "\n".join([
        "---", *front, "---", "",
        f"# {name}", "",
        f"A causal language model {trained} with [sparklm](https://pypi.org/project/sparklm/) {__version__} on "
        f"Apache Spark ({summary.get('strategy', '?')}, {summary.get('workers', '?')} worker(s)). This directory "
        f"holds the model of {which}.", "",
        "| | |", "|---|---|",
        f"| data | `{data}` |",
        f"| steps | {summary.get('steps', 0):,} |",
        f"| tokens trained on | {summary.get('tokens', 0):,} ({summary.get('epochs', 0):.2f} epochs) |",
        f"| parameters | {summary.get('params') or 0:,} ({summary.get('trainable_params') or 0:,} trained) |",
        *rows, "",
        "## How to load", "",
        "```python", load.rstrip("\n"),
        f'tokenizer = AutoTokenizer.from_pretrained("{name}")',
        'print(pipeline("text-generation", model=model, tokenizer=tokenizer)("Once upon a time")[0]["generated_text"])',
        "```", "",
        "`generation_config.json` holds the sampling `sparklm generate` uses by default; pass `do_sample=False` "
        "for greedy decoding (what `sparklm generate --temperature 0` does).", "",
    ])
