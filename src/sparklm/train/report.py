"""What a run leaves for people: loss.png (train and validation loss against tokens) and samples.txt."""

from __future__ import annotations

from pathlib import Path

from .metrics import read_metrics


def plot_loss(metrics_csv: Path, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(metrics_csv)
    train = [r for r in rows if r["kind"] == "train"]
    val = [r for r in rows if r["kind"] == "eval" and r.get("val_loss") is not None]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    ax.plot([r["tokens"] for r in train], [r["loss"] for r in train], label="train loss", lw=1)
    if val:
        ax.plot([r["tokens"] for r in val], [r["val_loss"] for r in val], "o-", label="validation loss", ms=4)
    ax.set_xlabel("tokens seen")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend()
    if val:
        ax.set_title(f"final validation: {val[-1]['val_loss']:.3f} nats/token, {val[-1]['val_bpb']:.3f} bits/byte")
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)


def write_samples(model_dir: Path, dataset, out: Path, config) -> None:
    """A few temperature-sampled continuations of fixed prompts (openings of validation documents)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tc = config.train
    if not tc.samples:
        return
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), use_safetensors=True).eval()
    prompts = _prompts(dataset, tok, tc.samples, config)
    torch.manual_seed(tc.seed)
    lines = [f"# {len(prompts)} samples: temperature 0.8, top-k 50, {tc.sample_tokens} new tokens\n"]
    for prompt in prompts:
        ids = torch.tensor([[tok.bos_token_id, *tok(prompt, add_special_tokens=False)["input_ids"]]])
        with torch.no_grad():
            generated = model.generate(ids, do_sample=True, temperature=0.8, top_k=50, max_new_tokens=tc.sample_tokens,
                                 pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
        text = tok.decode(generated[0, ids.shape[1]:], skip_special_tokens=True)
        lines.append(f"--- prompt: {prompt!r}\n{prompt}{text}\n")
    out.write_text("\n".join(lines))


def _prompts(dataset, tok, n: int, config) -> list[str]:
    """The first words of the first validation documents of some length (or training ones): prompts in the
    corpus's voice, not title-page fragments."""
    from ..data.stream import read_rows, row_groups

    bos, eos = tok.bos_token_id, tok.eos_token_id
    prompts: list[str] = []
    for split in ("validation", "train"):
        for group in row_groups(dataset.files(split), config.storage)[:4]:
            ids, _ = read_rows(group, dataset.seq_len, config.storage)
            for row in ids.tolist():
                for i, t in enumerate(row[:-31]):
                    if t == bos and eos not in row[i + 1:i + 31]:
                        words = tok.decode(row[i + 1:i + 7]).split()
                        if len(words) >= 2:
                            prompts.append(" ".join(words[:4]))
                if len(prompts) >= n:
                    return prompts[:n]
    return (prompts + [""] * n)[:n]
