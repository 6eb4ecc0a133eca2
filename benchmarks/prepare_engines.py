"""Benchmark: `sparklm prepare` on Spark vs on Apache Beam vs the raw tokenizer, side by side.

    .venv/bin/python benchmarks/prepare_engines.py --size 100 --rounds 3

The corpus is `prepare_throughput.py`'s (the six files of ../shared/data repeated as separate files up to SIZE MB).
A tokenizer is trained once (BPE 4096, by a Spark prepare, not timed); then each round runs every contender once, in
a fresh process, in turn (interleaved, so a slow minute of the machine hits all alike), and the medians are reported:

  * spark:      `sparklm prepare --no-dedup --tokenizer TOK --master local[2]` (one pass);
  * beam:       the same with `--engine beam` (DirectRunner, 2 worker processes);
  * spark+dedup / beam+dedup: the default two passes (scan and deduplicate, then write);
  * tokenizers: `encode_batch_fast` over the same paragraphs in one process, 2 threads (the limit: no reading,
    cleaning, packing or writing).

MB/s are of the input's bytes (with dedup, the corpus's repeated files are read and dropped). The two engines'
datasets are checked to be the same (tokens and sequences per split). Peak RSS of each prepare's process tree
(driver, JVM, Python or Beam workers) is sampled from /proc.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from prepare_throughput import ROOT, build_corpus, timed_prepare  # noqa: E402

CONTENDERS = {
    "spark": ["--master", "local[2]", "--set", "spark.ui=false", "--no-dedup"],
    "beam": ["--engine", "beam", "--pipeline-option", "direct_num_workers=2", "--no-dedup"],
    "spark+dedup": ["--master", "local[2]", "--set", "spark.ui=false"],
    "beam+dedup": ["--engine", "beam", "--pipeline-option", "direct_num_workers=2"],
}


def run_prepare(corpus: Path, out: Path, tok: Path, flags: list[str]) -> dict:
    wall, peak, m = timed_prepare(corpus, out, ["--tokenizer", str(tok), *flags])
    # the input's size, not the text kept: with dedup the corpus's repeats are dropped, and read all the same
    text_bytes = sum(f.stat().st_size for f in corpus.iterdir())
    start = m["timing"]["spark_start_seconds"]
    return {"wall_s": wall, "engine_start_s": start, "text_bytes": text_bytes,
            "tokens": sum(s["tokens"] for s in m["splits"].values()),
            "mb_s": text_bytes / wall / 1e6, "mb_s_excl_start": text_bytes / (wall - start) / 1e6,
            "peak_mb": sum(peak.values()),
            "figures": {k: (s["documents"], s["tokens"], s["sequences"]) for k, s in m["splits"].items()}}


def run_tokenizers(corpus: Path, tok: Path) -> dict:
    """The raw tokenizer in a fresh process (this script again, with --tokenizers-only)."""
    out = subprocess.run([sys.executable, __file__, "--tokenizers-only", str(corpus), str(tok)], capture_output=True,
                         text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def tokenizers_only(corpus: Path, tok: Path) -> None:
    from prepare_throughput import paragraphs
    from prepare_throughput import run_tokenizers as encode

    r = encode(paragraphs(corpus), tok)
    print(json.dumps({"wall_s": r["seconds"], "mb_s": r["mb_s"], "tokens_s": r["tokens_s"]}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", type=int, default=100, help="corpus size in MB")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--work", default=str(ROOT / ".bench"), help="scratch directory")
    ap.add_argument("--tokenizers-only", nargs=2, metavar=("CORPUS", "TOKENIZER"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.tokenizers_only:
        tokenizers_only(Path(args.tokenizers_only[0]), Path(args.tokenizers_only[1]))
        return
    work = Path(args.work)
    work.mkdir(exist_ok=True)
    corpus = build_corpus(args.size, work)
    tok_dir = work / f"engines-tokenizer-{args.size}mb"
    if not (tok_dir / "tokenizer.json").exists():
        subprocess.run([sys.executable, "-m", "sparklm", "prepare", str(corpus), "-o", str(tok_dir), "--overwrite",
                        "--no-dedup", "--vocab-size", "4096", "--master", "local[2]", "--set", "spark.ui=false"],
                       check=True, capture_output=True)
    tok = tok_dir / "tokenizer.json"
    runs: dict[str, list[dict]] = {name: [] for name in [*CONTENDERS, "tokenizers"]}
    for r in range(args.rounds):
        for name, flags in CONTENDERS.items():
            print(f"round {r + 1}: {name} …", flush=True)
            runs[name].append(run_prepare(corpus, work / f"engines-{name}", tok, flags))
        print(f"round {r + 1}: tokenizers …", flush=True)
        runs["tokenizers"].append(run_tokenizers(corpus, tok))
    for a, b in (("spark", "beam"), ("spark+dedup", "beam+dedup")):
        assert runs[a][0]["figures"] == runs[b][0]["figures"], f"{a} and {b} wrote different datasets"
    med = {name: {k: statistics.median(x[k] for x in rs) for k in rs[0] if isinstance(rs[0][k], (int, float))}
           for name, rs in runs.items()}
    (work / "prepare_engines.json").write_text(json.dumps({"runs": runs, "medians": med}, indent=2))
    limit = med["tokenizers"]["mb_s"]
    print(f"\n{args.size} MB corpus, {args.rounds} rounds, medians; ratios of MB/s excluding engine start\n")
    print("| contender | wall s | engine start s | MB/s end to end | MB/s excl. start (tokens/s) | vs spark "
          "| vs tokenizers | peak RSS MB |")
    print("|---|---|---|---|---|---|---|---|")
    for name in CONTENDERS:
        m = med[name]
        base = med["spark+dedup" if "dedup" in name else "spark"]["mb_s_excl_start"]
        tokens_s = m["tokens"] / (m["wall_s"] - m["engine_start_s"])
        print(f"| {name} | {m['wall_s']:.1f} | {m['engine_start_s']:.1f} | {m['mb_s']:.2f} | "
              f"{m['mb_s_excl_start']:.2f} ({tokens_s:,.0f}) | {m['mb_s_excl_start'] / base:.2f}× | "
              f"{m['mb_s_excl_start'] / limit:.2f}× | {m['peak_mb']:.0f} |")
    t = med["tokenizers"]
    print(f"| tokenizers (encode only) | {t['wall_s']:.1f} | – | {t['mb_s']:.2f} | {t['mb_s']:.2f} "
          f"({t['tokens_s']:,.0f}) | | 1.00× | |")


if __name__ == "__main__":
    main()
