"""Baseline contender: fine-tune a local HF causal LM with the Hugging Face ``Trainer`` (+ ``peft`` LoRA) on CPU.

    .venv/bin/python benchmarks/hf_finetune.py --model MODEL_DIR --train FILE.txt --seq-len 256 --batch-size 8 \\
        --threads 2 --steps N [--warmup-steps 3] [--lora-r 8 --lora-alpha 16 --lora-dropout 0.0 \\
        --lora-targets q_proj,k_proj,v_proj,o_proj] [--lr 2e-4] [--scheduler constant|cosine] [--seed 0] \\
        [--bf16-base] [--grad-checkpointing] [--allocator] [--eval FILE.txt] [--out result.json]

What an HF user would write for this on CPU, nothing tuned: the text file's documents (blank-line
paragraphs) are tokenized with the model's own tokenizer (with its special tokens, as ``run_clm``
does), each ends with EOS, and the stream is cut into disjoint blocks of ``seq_len`` tokens (the
``run_clm`` "group_texts" recipe, the last partial block dropped); ``labels = input_ids``. The
Trainer runs with its defaults (AdamW, fused; grad-norm clipping at 1.0; no weight decay), batch
``B``, no gradient accumulation, a constant (or cosine) lr without warmup, no saving, no reporting.

Without ``--lora-r`` every parameter is trained; ``--bf16-base`` loads the weights in bfloat16 (the
LoRA adapters stay fp32: peft's ``autocast_adapter_dtype``) and trains without autocast.
``--allocator`` applies sparklm's glibc allocator settings (``sparklm.train.device.keep_freed_memory``)
so that both engines run with the same malloc behaviour.

One process per measurement. At the end one line ``RESULT {json}`` goes to stdout (and the JSON to
``--out``): tokens/s over the steps after the first ``--warmup-steps``, the median ms/step, the peak
RSS of the process, the parameter counts, the final train loss and, with ``--eval``, the held-out
loss and perplexity (over that file's disjoint blocks; with ``--steps 0`` of the model as loaded).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import resource
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import torch

T_START = time.perf_counter()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="local HF model directory (with its tokenizer)")
    p.add_argument("--train", required=True, help="plain-text training file (documents: blank-line paragraphs)")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    p.add_argument("--steps", type=int, required=True, help="optimizer steps (0: no training, e.g. only --eval)")
    p.add_argument("--warmup-steps", type=int, default=3, help="steps left out of the throughput figures")
    p.add_argument("--lora-r", type=int, default=0, help="LoRA rank; 0 (default): full fine-tune")
    p.add_argument("--lora-alpha", type=float, default=16.0)
    p.add_argument("--lora-dropout", type=float, default=0.0)
    p.add_argument("--lora-targets", default="q_proj,k_proj,v_proj,o_proj", help="comma-separated module names")
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--scheduler", choices=("constant", "cosine"), default="constant")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bf16-base", action="store_true", help="load the model in bfloat16 (LoRA adapters stay fp32)")
    p.add_argument("--bf16", action="store_true", help="bf16 autocast (TrainingArguments(bf16=True)), weights fp32")
    p.add_argument("--grad-checkpointing", action="store_true", help="activation (gradient) checkpointing")
    p.add_argument("--micro-batch", type=int, default=0,
                   help="sequences per forward pass (gradient accumulation makes up --batch-size); 0: --batch-size")
    p.add_argument("--allocator", nargs="?", const="keep", choices=["keep", "return"],
                   help="sparklm's glibc allocator settings (train.allocator): keep freed memory, or return it")
    p.add_argument("--eval", default=None, help="plain-text file for held-out perplexity after training")
    p.add_argument("--out", default=None, help="also write the result JSON here")
    a = p.parse_args(argv)
    if a.seq_len < 2 or a.batch_size < 1 or a.threads < 1 or a.steps < 0 or a.warmup_steps < 0 or a.lora_r < 0:
        p.error("need --seq-len >= 2, --batch-size >= 1, --threads >= 1, --steps >= 0, --warmup-steps >= 0, "
                "--lora-r >= 0")
    if a.steps == 0 and a.eval is None:
        p.error("--steps 0 only makes sense with --eval")
    return a


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def documents(path: str) -> list[str]:
    text = Path(path).read_text(encoding="utf-8-sig")  # universal newlines (CRLF files); a BOM dropped
    return [d.strip() for d in re.split(r"\n\s*\n", text) if d.strip()]


def blocks(path: str, tokenizer, seq_len: int):
    """The file as a ``datasets.Dataset`` of disjoint ``seq_len``-token blocks (input_ids, labels)."""
    from datasets import Dataset

    eos = tokenizer.eos_token_id
    if eos is None:
        raise SystemExit(f"the tokenizer of {tokenizer.name_or_path} has no EOS token")

    def tokenize(batch):
        ids = tokenizer(batch["text"])["input_ids"]  # with the tokenizer's own special tokens (BOS), as run_clm
        return {"input_ids": [x if x and x[-1] == eos else x + [eos] for x in ids]}

    tokenized = Dataset.from_dict({"text": documents(path)}).map(tokenize, batched=True, remove_columns=["text"])
    # group_texts over the whole file at once (not per 1000-document batch, which drops a remainder per batch):
    # the concatenated stream cut into disjoint blocks, the last partial block dropped. Through Arrow and numpy
    # rather than Python lists, so that the data does not dominate the process's peak RSS.
    column = tokenized.data.column("input_ids")
    stream = np.concatenate([chunk.flatten().to_numpy() for chunk in column.chunks]).astype(np.int64)
    n = len(stream) // seq_len
    if n == 0:
        raise SystemExit(f"{path}: fewer than {seq_len} tokens")
    grouped = stream[:n * seq_len].reshape(n, seq_len)
    return Dataset.from_dict({"input_ids": grouped, "labels": grouped})


def load_model(args):
    from transformers import AutoModelForCausalLM

    dtype = torch.bfloat16 if args.bf16_base else torch.float32
    # transformers 5: `dtype` (`torch_dtype` is a deprecated alias)
    model = AutoModelForCausalLM.from_pretrained(args.model, local_files_only=True, dtype=dtype)
    if args.lora_r:
        from peft import LoraConfig, get_peft_model

        config = LoraConfig(r=args.lora_r, lora_alpha=args.lora_alpha, lora_dropout=args.lora_dropout,
                            target_modules=[t.strip() for t in args.lora_targets.split(",") if t.strip()],
                            task_type="CAUSAL_LM")
        # autocast_adapter_dtype=True (the default): adapters of a bf16 base are created in fp32
        model = get_peft_model(model, config, autocast_adapter_dtype=True)
    return model


@torch.no_grad()
def evaluate(model, ds, batch_size: int) -> dict:
    """Mean token cross-entropy over all blocks of ``ds`` (each block predicts seq_len - 1 tokens)."""
    model.eval()
    total, tokens = 0.0, 0
    ids = ds.with_format("torch")[:]["input_ids"]  # one (n, seq_len) int64 tensor
    for i in range(0, len(ids), batch_size):
        x = ids[i:i + batch_size]
        loss = model(input_ids=x, labels=x).loss
        n = x.shape[0] * (x.shape[1] - 1)
        total += float(loss) * n
        tokens += n
    mean = total / tokens
    return {"eval_loss": mean, "eval_ppl": math.exp(min(mean, 700.0)), "eval_tokens": tokens}


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.allocator:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
        from sparklm.train.device import set_allocator

        set_allocator(args.allocator)

    import datasets
    import transformers
    from transformers import AutoTokenizer, Trainer, TrainerCallback, TrainingArguments
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()  # "Loading weights" bars
    datasets.utils.logging.set_verbosity_error()
    datasets.disable_progress_bars()
    transformers.set_seed(args.seed)
    # peft 0.21's PeftModel.__init__ still reads the deprecated `is_gradient_checkpointing` of a transformers 5 model
    warnings.filterwarnings("ignore", message=r".*`is_gradient_checkpointing` is deprecated", category=FutureWarning)

    t0 = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(args.model, local_files_only=True)
    train_ds = None
    if args.steps:
        train_ds = blocks(args.train, tokenizer, args.seq_len).shuffle(seed=args.seed).flatten_indices()
    eval_ds = blocks(args.eval, tokenizer, args.seq_len) if args.eval else None
    data_s = time.perf_counter() - t0
    rss_data = peak_rss_mb()

    t0 = time.perf_counter()
    model = load_model(args)
    load_s = time.perf_counter() - t0
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    trainable_dtypes = sorted({str(p.dtype).replace("torch.", "") for p in model.parameters() if p.requires_grad})
    total = sum(p.numel() for p in model.parameters())
    rss_loaded = peak_rss_mb()

    result: dict = {
        "engine": "hf-trainer", "transformers": transformers.__version__, "torch": torch.__version__,
        "model": args.model, "mode": f"lora-r{args.lora_r}" if args.lora_r else "full",
        "base_dtype": "bfloat16" if args.bf16_base else "float32", "grad_checkpointing": args.grad_checkpointing,
        "autocast": "bfloat16" if args.bf16 else None,
        "allocator": args.allocator, "threads": args.threads, "seq_len": args.seq_len, "batch_size": args.batch_size,
        "steps": args.steps, "warmup_steps": args.warmup_steps, "lr": args.lr, "scheduler": args.scheduler,
        "train_blocks": len(train_ds) if train_ds is not None else None,
        "trainable_params": trainable, "total_params": total, "trainable_dtypes": trainable_dtypes,
        "data_s": round(data_s, 3), "load_s": round(load_s, 3), "peak_rss_after_data_mb": round(rss_data, 1),
        "peak_rss_after_load_mb": round(rss_loaded, 1),
    }

    if args.steps:
        class Clock(TrainerCallback):
            def __init__(self):
                self.begin, self.ends, self.losses = None, [], []

            def on_train_begin(self, *_, **__):
                self.begin = time.perf_counter()

            def on_step_end(self, *_, **__):
                self.ends.append(time.perf_counter())

            def on_log(self, _args, _state, _control, logs=None, **__):
                if logs and "loss" in logs:
                    self.losses.append(float(logs["loss"]))

        clock = Clock()
        with tempfile.TemporaryDirectory(prefix="hf_finetune-") as tmp:
            targs = TrainingArguments(
                output_dir=tmp, per_device_train_batch_size=args.micro_batch or args.batch_size,
                gradient_accumulation_steps=args.batch_size // (args.micro_batch or args.batch_size),
                max_steps=args.steps, learning_rate=args.lr, lr_scheduler_type=args.scheduler, warmup_steps=0,
                logging_strategy="steps", logging_steps=1, save_strategy="no", eval_strategy="no", report_to="none",
                use_cpu=True, dataloader_num_workers=0, seed=args.seed, disable_tqdm=True, log_level="error",
                # transformers 5: `activation_checkpointing` (`gradient_checkpointing` is a deprecated alias)
                activation_checkpointing=args.grad_checkpointing, bf16=args.bf16,
            )
            trainer = Trainer(model=model, args=targs, train_dataset=train_ds, callbacks=[clock])
            # disable_tqdm=True swaps the progress bar for a PrinterCallback that prints every log dict to stdout
            trainer.remove_callback(PrinterCallback)
            trainer.remove_callback(ProgressCallback)
            out = trainer.train()
        model = trainer.model
        result["checkpointing_active"] = bool(getattr(model, "is_activation_checkpointing", False))

        ends = clock.ends
        steps = [b - a for a, b in zip([clock.begin, *ends[:-1]], ends)]
        w = args.warmup_steps if args.warmup_steps < len(ends) else 0  # too few steps: measure them all
        span = ends[-1] - (ends[w - 1] if w else clock.begin)
        measured = len(ends) - w
        result.update({
            "tokens_per_s": measured * args.batch_size * args.seq_len / span,
            "ms_per_step_median": statistics.median(steps[w:]) * 1000,
            "ms_per_step_first": steps[0] * 1000,
            "measured_steps": measured,
            "final_train_loss": clock.losses[-1] if clock.losses else None,
            "first_train_loss": clock.losses[0] if clock.losses else None,
            "mean_train_loss": out.training_loss,
            "train_runtime_s": out.metrics.get("train_runtime"),
            "optim": str(targs.optim.value if hasattr(targs.optim, "value") else targs.optim),
            "max_grad_norm": targs.max_grad_norm,
        })

    if eval_ds is not None:
        t0 = time.perf_counter()
        result.update(evaluate(model, eval_ds, args.batch_size))
        result["eval_s"] = round(time.perf_counter() - t0, 3)

    result["peak_rss_mb"] = round(peak_rss_mb(), 1)
    result["wall_s"] = round(time.perf_counter() - T_START, 3)
    line = json.dumps(result)
    if args.out:
        Path(args.out).write_text(line + "\n")
    print("RESULT " + line, flush=True)
    return result


if __name__ == "__main__":
    main()
