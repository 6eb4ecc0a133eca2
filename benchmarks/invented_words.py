"""Invented words in samples (issue 19): how often a sample's first sentence holds a word that its training text never has.

A small BPE model spells by pieces and sometimes assembles a word nobody wrote ("steathed"); a reader of the samples
notices that first. For each run directory: prompts = the openings of its validation documents (as ``samples.txt``
picks them), several seeds each, ``--new-tokens`` sampled at temperature 0.8 and top-k 50 with each ``--min-p``; the
first sentence (prompt + continuation up to ``.``, ``!``, ``?`` or ``;``) counts as invented when one of its words
(letters only, any case) is absent from the words of ``--corpus`` (default: the bundled corpus). A continuation that
stops inside a word does not count that word. Strict: a real word the corpus lacks counts too.

    .venv/bin/python benchmarks/invented_words.py runs/main-bench runs/main-v8192c --seeds 24 --min-p 0 0.1
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

WORD = re.compile(r"[A-Za-z]+")
END = re.compile(r"[.!?;]")


def lexicon(files: list[str]) -> set[str]:
    return {w.lower() for f in files for w in WORD.findall(Path(f).read_text(errors="replace"))}


def invented(prompt: str, continuation: str, known: set[str]) -> list[str]:
    """The words of the first sentence absent from ``known`` (a trailing word cut by the token limit excluded)."""
    end = END.search(continuation)
    sentence = prompt + (continuation[:end.start()] if end else continuation)
    words = WORD.findall(sentence)
    if end is None and continuation[-1:].isalpha():
        words = words[:-1]
    return [w for w in words if w.lower() not in known]


def score(run: Path, known: set[str], *, n_prompts: int, seeds: int, new_tokens: int, min_p: float) -> dict:
    from sparklm.config import Config
    from sparklm.data.manifest import load_prepared
    from sparklm.infer.generate import generate, load
    from sparklm.infer.sampling import Sampling
    from sparklm.tasks.causal_lm import sample_prompts

    lm = load(str(run / "model"), threads=2)
    prompts = sample_prompts(load_prepared(str(run / "data")), lm.tokenizer, n_prompts, Config())
    bad, examples = 0, []
    for seed in range(1, seeds + 1):
        sampling = Sampling(max_new_tokens=new_tokens, seed=seed, temperature=0.8, top_k=50, min_p=min_p)
        for g in generate(lm, prompts, sampling=sampling, warn=False):
            words = invented(g.prompt, g.text, known)
            bad += bool(words)
            examples += words[:1]
    return {"run": str(run), "min_p": min_p, "invented": bad, "samples": seeds * len(prompts), "examples": examples}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", type=Path, help="run directories (model/ and data/, as `sparklm run` writes)")
    ap.add_argument("--corpus", nargs="*", help="the training text's files (default: the bundled corpus)")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--seeds", type=int, default=24)
    ap.add_argument("--new-tokens", type=int, default=40)
    ap.add_argument("--min-p", type=float, nargs="+", default=[0.0, 0.1])
    args = ap.parse_args()
    from sparklm.cli import default_corpus

    known = lexicon(args.corpus or default_corpus())
    print("| run | min-p | first sentences with an invented word | examples |\n|---|---|---|---|")
    for run in args.runs:
        for p in args.min_p:
            r = score(run, known, n_prompts=args.prompts, seeds=args.seeds, new_tokens=args.new_tokens, min_p=p)
            print(f"| {run.name} | {p:g} | {r['invented']}/{r['samples']} | {', '.join(r['examples'][:6])} |",
                  flush=True)


if __name__ == "__main__":
    main()
