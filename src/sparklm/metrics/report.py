"""What a run leaves for people: loss.png (train and validation loss against tokens) and samples.txt."""

from __future__ import annotations

import io

from ..config import StorageConfig
from ..infra.fs import join, write_bytes, write_text
from ..model.figures import FigureSet
from .sinks import read_metrics


def plot_loss(run_dir: str, figures: FigureSet, storage: StorageConfig | None = None) -> None:
    """loss.png from the run's metrics.csv: the train loss, and the task's evaluation loss (``figures.loss``)
    with its headline figure in the title."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(join(run_dir, "metrics.csv"), storage)
    train = [r for r in rows if r["kind"] == "train"]
    loss, head = figures.get(figures.loss), figures.main
    val = [r for r in rows if r["kind"] == "eval" and r.get(loss.key) is not None]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    ax.plot([r["tokens"] for r in train], [r["loss"] for r in train], label="train loss", lw=1)
    if val:
        ax.plot([r["tokens"] for r in val], [r[loss.key] for r in val], "o-", label="validation loss", ms=4)
    ax.set_xlabel("tokens seen")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend()
    if val:
        last = val[-1]
        ax.set_title(f"final validation: {loss.label} {last[loss.key]:{loss.fmt}}, {head.label} {last[head.key]:{head.fmt}}")
    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, format="png")
    plt.close(fig)
    write_bytes(join(run_dir, "loss.png"), png.getvalue(), storage)


def plot_confusion(run_dir: str, kept: dict, storage: StorageConfig | None = None) -> None:
    """confusion.png: the confusion matrix of a classifier's kept evaluation (``kept``: summary.json's best, else
    final: model/'s weights; rows the true class, columns the predicted one), each cell its count and its share
    of the row. Nothing for a run whose figures hold none."""
    confusion = kept.get("val_confusion")
    if not confusion:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    labels, cm = confusion["labels"], np.asarray(confusion["matrix"], dtype=float)
    k = len(labels)
    share = cm / np.maximum(cm.sum(axis=1, keepdims=True), 1)
    size = min(12, 4.5 + 0.5 * k)
    fig, ax = plt.subplots(figsize=(size, size * 0.85), dpi=120)
    im = ax.imshow(share, cmap="Blues", vmin=0, vmax=1)
    ax.set_xticks(range(k), [str(x)[:16] for x in labels], rotation=45, ha="right", parse_math=False)
    ax.set_yticks(range(k), [str(x)[:16] for x in labels], parse_math=False)  # a label is text, never TeX
    ax.set_xlabel("predicted")
    ax.set_ylabel("true")
    if k <= 20:
        for i in range(k):
            for j in range(k):
                ax.text(j, i, f"{int(cm[i, j])}\n{share[i, j]:.0%}", ha="center", va="center", fontsize=8,
                        color="white" if share[i, j] > 0.5 else "black")
    acc = np.trace(cm) / max(cm.sum(), 1)
    ax.set_title(f"model/ on the validation split: accuracy {acc:.1%} of {int(cm.sum()):,}", fontsize=9)
    fig.colorbar(im, ax=ax, fraction=0.046, label="share of the true class")
    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, format="png")
    plt.close(fig)
    write_bytes(join(run_dir, "confusion.png"), png.getvalue(), storage)


def write_samples(model, spec, run_dir: str, dataset, config) -> None:
    """samples.txt: a few sampled continuations (sparklm's default sampling) of fixed prompts (openings of
    validation documents), written by the worker that holds the final model."""
    from ..infer.generate import LoadedModel, generate
    from ..infer.sampling import Sampling

    tc = config.train
    context = dataset.seq_len
    new_tokens = min(tc.sample_tokens, context // 2)  # leave the prompt room within the context
    if not tc.samples or new_tokens < 1:
        return
    tok = spec.hf()
    prompts = sample_prompts(dataset, tok, tc.samples, config)
    lm = LoadedModel(model.eval(), tok, join(run_dir, "model"), context, add_bos=spec.add_bos)
    sampling = Sampling(max_new_tokens=new_tokens, seed=tc.seed)
    lines = [f"# {len(prompts)} samples: temperature {sampling.temperature}, top-k {sampling.top_k}, "
             f"min-p {sampling.min_p}, "
             f"{new_tokens} new tokens (seed {tc.seed})\n"]
    for g in generate(lm, prompts, sampling=sampling, warn=False):
        lines.append(f"--- prompt: {g.prompt!r}\n{g.prompt}{g.text}\n")
    write_text(join(run_dir, "samples.txt"), "\n".join(lines), config.storage)


def sample_prompts(dataset, tok, n: int, config) -> list[str]:
    """The first words of the first validation documents of some length (or training ones): prompts in the
    corpus's voice, not title-page fragments; "The" where too few documents qualify."""
    from ..data.stream import read_rows, row_groups

    # a document starts after its BOS, or (a tokenizer without one) after the previous document's EOS
    start = tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id
    eos = tok.eos_token_id
    prompts: list[str] = []
    for split in ("validation", "train"):
        for group in row_groups(dataset.files(split), config.storage)[:4]:
            ids = read_rows(group, dataset.seq_len, config.storage).input_ids
            for row in ids.tolist():
                for i, t in enumerate(row[:-31]):
                    if t == start and eos not in row[i + 1:i + 31]:
                        words = tok.decode(row[i + 1:i + 7]).split()
                        if len(words) >= 2:
                            prompts.append(" ".join(words[:4]))
                if len(prompts) >= n:
                    return prompts[:n]
    return (prompts + ["The"] * n)[:n]
