"""The GPU check (issue 52): the worker code Spark runs, on CUDA and then on the CPU, without Spark or a JVM.

    python benchmarks/gpu_check.py [--out DIR] [--smoke]

The GPU machines this project borrows have torch, transformers, peft, safetensors and pyarrow but no JVM and no
pyspark; a Spark task's worker side needs neither. Each check runs the real entry points:

1. training: ``train.core.train`` (the function a DDP rank process runs) with its collectives on a torch.distributed
   NCCL group of world size 1 (DDP-wrapped) on CUDA, and on the CPU with gloo's single-process path; the two loss
   curves must agree within bf16's tolerance (CUDA bf16 autocast against CPU float32);
2. a round worker's inner steps (the Trainer's ``run_steps``) and its delta through the int4 codec;
3. LoRA: a step of adapters on a pretrained (random) Llama directory, as ``--init-from --lora-r`` does;
4. greedy generation from the trained model on CUDA and on the CPU in float32: the same tokens;
5. speed: sparklm's training step against a plain PyTorch loop of the same model (SmolLM2-135M's shape: 30 blocks
   × 576, 9 heads, MLP 1536; bf16 autocast, fused AdamW, SDPA) on the same GPU, batch 16 × 1,024 tokens, eager and
   compiled; tokens/s and MFU against the card's datasheet bf16 peak.

It writes ``gpu_check.json`` (every figure) under ``--out`` and prints a table; the exit status is non-zero when a
check fails. ``--smoke``: tiny shapes and a few steps, to see every path run (on a machine without CUDA only the
CPU halves run). Data: a synthetic corpus made here (the GPU machine has none of ../shared).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from sparklm.config import TokenizerConfig, from_dict  # noqa: E402
from sparklm.data import tokenizer  # noqa: E402
from sparklm.data.manifest import PreparedDataset  # noqa: E402
from sparklm.metrics.sinks import CsvSink, Sinks, metric_columns, read_metrics  # noqa: E402
from sparklm.model.figures import LM_FIGURES  # noqa: E402
from sparklm.train import collective  # noqa: E402
from sparklm.train.core import Rank, Trainer, train  # noqa: E402
from sparklm.train.resolve import local  # noqa: E402

SMOL = {"arch": "llama", "n_layer": 30, "n_embd": 576, "n_head": 9, "intermediate": 1536, "qk_norm": False}
TINY = {"arch": "llama", "n_layer": 2, "n_embd": 64, "n_head": 2}
CUDA = torch.cuda.is_available()


def corpus(n_words: int, seed: int = 0) -> str:
    """English-like text with structure a model can learn: sentences from a small grammar over a word list."""
    rng = random.Random(seed)
    nouns = "river house garden king queen ship road city forest winter letter window horse friend".split()
    verbs = "sees keeps finds brings leaves wants holds follows remembers builds answers carries".split()
    adjs = "old quiet bright small dark gentle strange broken golden narrow distant".split()
    words, out = 0, []
    while words < n_words:
        s = f"the {rng.choice(adjs)} {rng.choice(nouns)} {rng.choice(verbs)} a {rng.choice(nouns)}"
        if rng.random() < 0.4:
            s += f" by the {rng.choice(adjs)} {rng.choice(nouns)}"
        out.append(s.capitalize() + ".")
        words += len(s.split())
    return "\n".join(" ".join(out[i:i + 6]) for i in range(0, len(out), 6))


def dataset(root: Path, spec, text: str, seq: int) -> PreparedDataset:
    """A prepared dataset as ``sparklm prepare`` lays it out (Parquet rows of ``seq`` ids per split, a manifest)."""
    ids = np.array(spec.tokenizer().encode(text, add_special_tokens=False).ids, dtype=np.int32)
    rows = ids[:len(ids) // seq * seq].reshape(-1, seq)
    cut = int(len(rows) * 0.9)
    splits = {}
    for split, part in (("train", rows[:cut]), ("validation", rows[cut:])):
        path = root / split / "part-0.parquet"
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.table({"input_ids": pa.array(list(part), type=pa.list_(pa.int32())),
                                 "doc_id": pa.array(np.zeros(len(part), dtype=np.int64))}), path, row_group_size=64)
        splits[split] = {"sequences": len(part), "tokens": int(part.size),
                         "files": [{"path": f"{split}/part-0.parquet", "rows": len(part), "bytes": path.stat().st_size}]}
    manifest = {"splits": splits, "packing": {"seq_len": seq}}
    (root / "manifest.json").write_text(json.dumps(manifest))
    return PreparedDataset(uri=str(root), manifest=manifest)


def settings(model: dict, device: str, dtype: str, steps: int, batch: int, **train) -> dict:
    return {"model": model, "train": {"device": device, "dtype": dtype, "batch_size": batch, "max_steps": steps,
                                      "eval_every": 0, "eval_batches": 2, "log_every": 1, "checkpoint_every": 0,
                                      "optimizer": "adamw", "lr": 1e-3, "warmup_steps": 2, "samples": 0,
                                      "threads": os.cpu_count() or 1, **train}}


def nccl_group() -> collective.Group:
    """torch.distributed over NCCL at world size 1: the collectives and DDP wrap a GPU rank runs."""
    import torch.distributed as dist

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29512")
        dist.init_process_group("nccl", rank=0, world_size=1)
    return collective.Group(0, 1)


def run_training(work: Path, ds, spec, raw: dict, *, nccl: bool = False) -> dict:
    """``train.core.train`` as a rank runs it (``nccl``: its collectives on an NCCL group, DDP-wrapped, as a rank
    of a multi-GPU run; else a single worker's, as ``--workers 1`` runs); the per-step losses and steady figures."""
    config = from_dict(raw)
    plan = local(config, ds, threads=config.train.threads)
    run = Path(tempfile.mkdtemp(dir=work))
    sinks = Sinks([CsvSink(str(run / "metrics.csv"), metric_columns(LM_FIGURES), {"train", "eval"})])
    comm = nccl_group() if nccl and plan.device.kind == "cuda" else None
    t0 = time.time()
    result = train(plan, ds, spec, str(run), rank=Rank(threads=plan.threads), sink=sinks, comm=comm)
    sinks.close()
    rows = [r for r in read_metrics(run / "metrics.csv") if r["kind"] == "train"]
    steady = rows[len(rows) // 3:] or rows
    return {"losses": [r["loss"] for r in rows], "tokens_per_s": float(np.median([r["tokens_per_s"] for r in steady])),
            "ms_per_step": float(np.median([r["ms_per_step"] for r in steady])),
            "mfu": float(np.median([r["mfu"] or 0 for r in steady])), "wall_s": time.time() - t0,
            "params": result.params, "peak_flops": result.peak_flops, "device": result.device, "run": str(run)}


def check_training(work, ds, spec, args, out: dict) -> None:
    steps, model = (8, TINY) if args.smoke else (60, {**TINY, "n_layer": 4, "n_embd": 256, "n_head": 4})
    cpu = run_training(work, ds, spec, settings(model, "cpu", "float32", steps, 8))
    out["train_cpu"] = cpu
    if not CUDA:
        return
    gpu = run_training(work, ds, spec, settings(model, "cuda", "bfloat16", steps, 8), nccl=True)
    out["train_cuda"] = gpu
    worst = max(abs(a - b) / max(abs(b), 1e-6) for a, b in zip(gpu["losses"], cpu["losses"]))
    out["train_agree"] = {"max_relative_loss_gap": worst, "ok": worst < 0.03 and len(gpu["losses"]) == len(cpu["losses"])}
    greedy(gpu["run"], cpu["run"], out)


def greedy(gpu_run: str, cpu_run: str, out: dict) -> None:
    """The CUDA-trained model's greedy text on CUDA and on the CPU (fp32): the same tokens."""
    from sparklm.infer.generate import generate, load
    from sparklm.infer.sampling import Sampling

    prompts = ["The old river", "A golden ship finds", "The queen"]
    greedy_ = Sampling(max_new_tokens=24, temperature=0.0)
    on_gpu = generate(load(f"{gpu_run}/model", device="cuda"), prompts, sampling=greedy_)
    on_cpu = generate(load(f"{gpu_run}/model", device="cpu"), prompts, sampling=greedy_)
    same = [a.token_ids == b.token_ids for a, b in zip(on_gpu, on_cpu)]
    out["greedy"] = {"same": same, "ok": all(same), "sample": on_gpu[0].text}


def check_scoring(work, ds, spec, args, out: dict) -> None:
    """``sparklm eval``'s scoring of the CUDA-trained model, and a BERT classifier's and encoder's answers
    (classify_dataframe, embed_dataframe per batch), on CUDA and on the CPU: the same figures within TF32's error."""
    if not CUDA or "train_cuda" not in out:
        return
    from transformers import BertConfig, BertForSequenceClassification

    from sparklm.infer.encode import classify_texts, embed_texts, load_encoder
    from sparklm.infer.evaluate import score
    from sparklm.infer.generate import load, token_ids

    model = f"{out['train_cuda']['run']}/model"
    text = corpus(2_000, seed=7)
    ids = token_ids(load(model, device="cpu"), text)[:512]
    batch = [(ids[i:i + 128], 127) for i in range(0, len(ids) - 128, 128)]
    nats = [score(load(model, device=d), batch)[0].item() for d in ("cuda", "cpu")]
    bert = work / "bert"
    torch.manual_seed(0)
    BertForSequenceClassification(BertConfig(vocab_size=spec.vocab_size, hidden_size=64, num_hidden_layers=2,
                                             num_attention_heads=2, intermediate_size=128, num_labels=3,
                                             pad_token_id=spec.pad_id)).save_pretrained(str(bert))
    spec.save(str(bert))
    texts = text.split(". ")[:40]
    probs = [classify_texts(load_encoder(str(bert), classify=True, device=d), texts)[0] for d in ("cuda", "cpu")]
    vecs = [embed_texts(load_encoder(str(bert), classify=False, device=d), texts)[0] for d in ("cuda", "cpu")]
    gaps = {"eval_nats_relative": abs(nats[0] - nats[1]) / nats[1],
            "classify_probability": float(np.abs(probs[0] - probs[1]).max()),
            "embedding": float(np.abs(vecs[0] - vecs[1]).max() / np.abs(vecs[1]).max())}
    out["scoring"] = {**gaps, "ok": gaps["eval_nats_relative"] < 1e-2 and gaps["classify_probability"] < 1e-2
                      and gaps["embedding"] < 1e-2}


def check_inner_and_codec(work, ds, spec, args, out: dict) -> None:
    """A round worker's inner steps on the device and its delta through the int4 codec (decoded within its error)."""
    from sparklm.strategies.codec import Codec, decode

    kind = "cuda" if CUDA else "cpu"
    cfg = from_dict(settings(TINY, kind, "bfloat16" if CUDA else "float32", 8, 8))
    trainer = Trainer(local(cfg, ds, threads=cfg.train.threads), ds, spec,
                      comm=nccl_group() if CUDA else None)
    before = {n: p.detach().cpu().clone() for n, p in trainer.task.trainable(trainer.model).items()}
    losses = [float(loss) for loss, *_ in trainer.run_steps(trainer.batches(0), 8, lambda i: i / 8)]
    delta = {n: (before[n] - p.detach().cpu()).numpy() for n, p in trainer.task.trainable(trainer.model).items()}
    codec = Codec(name="int4", density=1.0, bits=4)
    blob = codec.encode(delta)
    back = decode(blob)
    err = max(float(np.abs(back[n] - d).max() / (np.abs(d).max() + 1e-12)) for n, d in delta.items())
    out["inner_codec"] = {"device": trainer.device.where, "losses": losses, "bytes": len(blob),
                          "max_relative_error": err, "ok": all(np.isfinite(losses)) and err < 0.2}


def check_lora(work, ds, spec, args, out: dict) -> None:
    """LoRA adapters on a pretrained Llama directory (random weights, our tokenizer) train on the device."""
    from transformers import LlamaConfig, LlamaForCausalLM

    base = work / "llama"
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=spec.vocab_size, hidden_size=64, intermediate_size=128,
                                 num_hidden_layers=2, num_attention_heads=2, max_position_embeddings=2048)
                     ).save_pretrained(str(base))
    spec.save(str(base))
    kind = "cuda" if CUDA else "cpu"
    raw = settings({}, kind, "bfloat16" if CUDA else "float32", 10, 8)
    raw["model"] = {"init_from": str(base)}
    raw["lora"] = {"r": 8}
    raw["train"]["lr"] = 3e-3
    r = run_training(work, ds, spec, raw)
    out["lora"] = {"device": r["device"], "losses": r["losses"],
                   "ok": all(np.isfinite(r["losses"])) and r["losses"][-1] < r["losses"][0]}


def plain_loop(model: torch.nn.Module, vocab: int, batch: int, seq: int, steps: int, compile_: bool) -> dict:
    """The baseline: the same model in the plainest fast loop (random token batches on the GPU, bf16 autocast, fused
    AdamW, gradient clipping as sparklm does)."""
    model = model.cuda().train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    net = torch.compile(model) if compile_ else model
    times = []
    for _ in range(steps):
        x = torch.randint(0, vocab, (batch, seq), device="cuda")
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = net(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    dt = float(np.median(times[steps // 3:]))
    return {"tokens_per_s": batch * seq / dt, "ms_per_step": dt * 1000,
            "peak_gb": torch.cuda.max_memory_allocated() / 2**30}


def check_speed(work, spec, args, out: dict) -> None:
    if not CUDA:
        return
    from sparklm.registry import make_task
    from sparklm.train.peak import gpu_peak

    seq, batch, steps = (128, 4, 6) if args.smoke else (1024, 16, 30)
    shape = TINY if args.smoke else SMOL
    text = corpus(200_000 if args.smoke else 3_000_000, seed=1)
    ds = dataset(work / f"speed-{seq}", spec, text, seq)
    peak = gpu_peak(torch.cuda.get_device_name(0), "bfloat16")
    rows = {}
    for compile_ in (False, True):
        cfg = from_dict(settings(shape, "cuda", "bfloat16", steps, batch, compile=compile_, optimizer="adamw"))
        torch.manual_seed(0)
        task = make_task(cfg)
        model = task.build(cfg, spec, seq)
        fpt = task.flops_per_token(model, seq)
        torch.cuda.reset_peak_memory_stats()
        plain = plain_loop(model, spec.vocab_size, batch, seq, steps, compile_)
        del model
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        ours = run_training(work, ds, spec, settings(shape, "cuda", "bfloat16", steps, batch, compile=compile_))
        ours["peak_gb"] = torch.cuda.max_memory_allocated() / 2**30
        name = "compiled" if compile_ else "eager"
        for r in (plain, ours):
            r["mfu"] = r["tokens_per_s"] * fpt / peak
        rows[name] = {"plain": plain, "sparklm": {k: v for k, v in ours.items() if k != "losses"},
                      "ratio": ours["tokens_per_s"] / plain["tokens_per_s"]}
    out["speed"] = {"gpu": torch.cuda.get_device_name(0), "peak_flops": peak, "batch": batch, "seq": seq, **rows}


def check_generation(work, spec, args, out: dict) -> None:
    """Greedy decoding speed on the GPU: ``sparklm generate``'s loop against HF ``model.generate`` on the same model
    (SmolLM2-135M's shape, random weights, bf16), the same prompts, every row generating exactly ``new`` tokens."""
    if not CUDA:
        return
    from sparklm.infer.generate import generate, load
    from sparklm.infer.sampling import Sampling
    from sparklm.registry import make_task

    new = 16 if args.smoke else 128
    cfg = from_dict(settings(TINY if args.smoke else SMOL, "cuda", "bfloat16", 1, 1))
    torch.manual_seed(0)
    model = make_task(cfg).build(cfg, spec, 1024).to(torch.bfloat16)
    model.save_pretrained(str(work / "gen"))
    spec.save(str(work / "gen"))
    del model
    lm = load(str(work / "gen"), device="cuda")
    lm.tokenizer.padding_side = "left"  # HF generate's batches, as sparklm pads its own
    words = corpus(4_000, seed=3).split()
    rows = {}
    for batch in (1, 32):
        prompts = [" ".join(words[i * 9:i * 9 + 6 + i % 5]) for i in range(batch)]
        greedy_ = Sampling(max_new_tokens=new, min_new_tokens=new, temperature=0.0)
        enc = lm.tokenizer(prompts, return_tensors="pt", padding=True).to("cuda")
        hf_kw = {"max_new_tokens": new, "min_new_tokens": new, "do_sample": False, "pad_token_id": spec.pad_id}
        times: dict[str, list[float]] = {"sparklm": [], "hf": []}
        for rep in range(4):  # the first of each is a warm-up
            for name in ("sparklm", "hf"):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                if name == "sparklm":
                    generate(lm, prompts, sampling=greedy_, batch_size=batch)
                else:
                    lm.model.generate(**enc, **hf_kw)
                torch.cuda.synchronize()
                if rep:
                    times[name].append(time.perf_counter() - t0)
        tps = {k: batch * new / float(np.median(v)) for k, v in times.items()}
        rows[f"batch{batch}"] = {"sparklm_tokens_per_s": tps["sparklm"], "hf_tokens_per_s": tps["hf"],
                                 "ratio": tps["sparklm"] / tps["hf"]}
    out["generation"] = {"dtype": str(next(lm.model.parameters()).dtype), "new_tokens": new, **rows}


def check_shakespeare(work, spec_unused, args, out: dict) -> None:
    """Tiny Shakespeare on the GPU within a time budget (``--shakespeare FILE --budget S``): the validation
    bits/byte reached, for the bar nanoGPT's ``train_shakespeare_char`` sets (2.11 bits/byte on an H200)."""
    if not args.shakespeare:
        return
    text = Path(args.shakespeare).read_text(encoding="utf-8")
    spec = tokenizer.train([text], TokenizerConfig(vocab_size=1024))
    seq = 256
    ds = dataset(work / "shakespeare", spec, text, seq)
    # the validation split's tokens and the bytes they decode to: bits per byte from nats per token
    ids = spec.tokenizer().encode(text, add_special_tokens=False).ids
    rows = len(ids) // seq
    val_ids = ids[int(rows * 0.9) * seq:rows * seq]
    val_bytes = len(spec.tokenizer().decode(val_ids).encode("utf-8"))
    model = {"arch": "llama", "n_layer": 6, "n_embd": 384, "n_head": 6}
    kind = "cuda" if CUDA else "cpu"
    raw = settings(model, kind, "bfloat16" if CUDA else "float32", 0, 64, time_budget=args.budget,
                   compile=CUDA and not args.eager, lr=3e-3, warmup_steps=50, log_every=5)
    raw["train"]["eval_batches"] = 1_000
    r = run_training(work, ds, spec, raw)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    metrics = Path(r["run"]) / "metrics.csv"
    (Path(args.out) / f"shakespeare_metrics{'_eager' if args.eager else ''}.csv").write_bytes(metrics.read_bytes())
    last = [row for row in read_metrics(metrics) if row["kind"] == "eval"][-1]
    bpb = last["val_loss"] * len(val_ids) / val_bytes / np.log(2)
    out["shakespeare"] = {"device": kind, "budget_s": args.budget, "wall_s": r["wall_s"], "val_loss": last["val_loss"],
                          "bits_per_byte": float(bpb), "steps": last.get("step"), "vocab": spec.vocab_size}


def save(out: dict, where: str) -> None:
    """Every figure so far (written after each check, so a run stopped at its time limit keeps what it measured)."""
    Path(where).mkdir(parents=True, exist_ok=True)
    (Path(where) / "gpu_check.json").write_text(json.dumps(out, indent=2, default=str))


def timed(name: str, check, out: dict, where: str) -> None:
    t = time.time()
    try:
        check()
    except Exception as e:  # a failed check is reported with the rest
        import traceback

        traceback.print_exc()
        out[name] = {"ok": False, "error": f"{type(e).__name__}: {e}"}
    print(f"{name}: {time.time() - t:.1f}s", flush=True)
    save(out, where)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, a few steps: every path runs")
    ap.add_argument("--shakespeare", default="", help="Tiny Shakespeare's text: train on it for --budget seconds")
    ap.add_argument("--only", default="", help="run these checks alone (comma-separated names)")
    ap.add_argument("--eager", action="store_true", help="the Tiny Shakespeare run without torch.compile")
    ap.add_argument("--budget", type=float, default=38.0, help="seconds for the Tiny Shakespeare run")
    args = ap.parse_args()
    t0 = time.time()
    out: dict = {"torch": torch.__version__, "cuda": torch.version.cuda, "gpu": torch.cuda.get_device_name(0) if CUDA
                 else None}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        text = corpus(60_000 if args.smoke else 400_000)
        spec = tokenizer.train([text], TokenizerConfig(vocab_size=2048))
        ds = dataset(work / "data", spec, text, 64 if args.smoke else 256)
        checks = (("training", check_training), ("scoring", check_scoring),
                  ("inner steps + codec", check_inner_and_codec), ("lora", check_lora))
        only = set(filter(None, args.only.split(",")))
        checks = tuple(c for c in checks if not only or c[0] in only)
        for name, check in checks:
            timed(name, lambda c=check: c(work, ds, spec, args, out), out, args.out)
        for name, check in (("generation", check_generation), ("speed", check_speed),
                            ("shakespeare", check_shakespeare)):
            if only and name not in only:
                continue
            timed(name, lambda c=check: c(work, spec, args, out), out, args.out)
    out["seconds"] = time.time() - t0
    save(out, args.out)
    failed = [k for k, v in out.items() if isinstance(v, dict) and v.get("ok") is False]
    for k, v in out.items():
        if isinstance(v, dict):
            print(f"{k}: " + json.dumps({a: b for a, b in v.items() if a not in ("losses", "run")}, default=str)[:600])
    print("FAILED: " + ", ".join(failed) if failed else "all checks passed", f"({out['seconds']:.0f}s)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
