"""Benchmark: `sparklm prepare` throughput against raw `tokenizers` and HF `datasets.map`, side by side.

    .venv/bin/python benchmarks/prepare_throughput.py --sizes 10 100
    .venv/bin/python benchmarks/prepare_throughput.py --scale 100 10000            # prepare alone, tokenizer given
    .venv/bin/python benchmarks/prepare_throughput.py --scale 100 10000 --train    # ... and training it
    .venv/bin/python benchmarks/prepare_throughput.py --scale 1000 --allocator system  # on glibc's malloc

For each size, a corpus is built from ../shared/data (books and WikiText repeated as separate files;
dedup is turned off so repeats count), then on the same machine and threads:
  * sparklm prepare (CLI, local[2]): end to end, and excluding Spark/JVM start;
  * (a) tokenizers `encode_batch_fast` over the same paragraphs in one process (the limit);
  * (b) `datasets.Dataset.map(batched=True, num_proc=2)` with the same tokenizer.
Throughput is compared in MB of text per second (tokenizer-independent) and tokens/s.
Peak RSS of the driver (Python), the JVM and the Python workers is sampled from /proc.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

T0 = time.time()
ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared" / "data"
SOURCES = ["tinyshakespeare.txt", "the_adventures_of_sherlock_holmes.txt", "the_adventures_of_tom_sawyer.txt",
           "wikitext-2/test.txt", "wikitext-2/valid.txt", "wikitext-2-raw/wiki.test.raw"]


def build_corpus(size_mb: int, where: Path) -> Path:
    out = where / f"corpus-{size_mb}mb"
    if out.exists():
        return out
    tmp = where / f".corpus-{size_mb}mb-tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    total, i = 0, 0
    blobs = [(SHARED / s).read_bytes() for s in SOURCES]
    while total < size_mb * 1_000_000:
        blob = blobs[i % len(blobs)]
        (tmp / f"{i:04d}-{Path(SOURCES[i % len(SOURCES)]).stem}.txt").write_bytes(blob)
        total += len(blob)
        i += 1
    tmp.rename(out)
    return out


class PeakRSS:
    """Samples the RSS of a process tree every 0.2 s; peak per role (driver, jvm, workers summed)."""

    def __init__(self, pid: int):
        self.pid, self.peak = pid, {"driver_mb": 0.0, "jvm_mb": 0.0, "workers_mb": 0.0}
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _tree(self):
        kids = {}
        for p in Path("/proc").iterdir():
            if p.name.isdigit():
                try:
                    stat = (p / "stat").read_text().rsplit(")", 1)[1].split()
                    kids.setdefault(int(stat[1]), []).append(int(p.name))
                except OSError:
                    pass
        out, todo = [], [self.pid]
        while todo:
            pid = todo.pop()
            out.append(pid)
            todo += kids.get(pid, [])
        return out

    def _rss(self, pid):
        try:
            status = Path(f"/proc/{pid}/status").read_text()
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode()
        except OSError:
            return None, 0.0
        kb = next((int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS")), 0)
        return cmd, kb / 1024

    def _run(self):
        while not self._stop.wait(0.2):
            workers = 0.0
            for pid in self._tree():
                cmd, mb = self._rss(pid)
                if cmd is None:
                    continue
                if pid == self.pid:
                    self.peak["driver_mb"] = max(self.peak["driver_mb"], mb)
                elif cmd.endswith("java"):
                    self.peak["jvm_mb"] = max(self.peak["jvm_mb"], mb)
                else:
                    workers += mb
            self.peak["workers_mb"] = max(self.peak["workers_mb"], workers)

    def stop(self):
        self._stop.set()
        self._t.join()
        return {k: round(v, 1) for k, v in self.peak.items()}


def timed_prepare(corpus: Path, out: Path, flags: list[str], env: dict | None = None) -> tuple[float, dict, dict]:
    """`sparklm prepare CORPUS -o OUT --overwrite FLAGS` in a fresh process: (wall seconds, peak RSS, manifest)."""
    cmd = [sys.executable, "-m", "sparklm", "prepare", str(corpus), "-o", str(out), "--overwrite", *flags]
    t0 = time.time()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **(env or {})})
    mem = PeakRSS(proc.pid)
    _, err = proc.communicate()
    wall = time.time() - t0
    peak = mem.stop()
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{err[-3000:]}")
    return wall, peak, json.loads((out / "manifest.json").read_text())


def run_sparklm(corpus: Path, out: Path, tokenizer: Path | None = None, ahead: bool = True,
                allocator: str = "auto") -> dict:
    tok = ["--tokenizer", str(tokenizer)] if tokenizer else ["--vocab-size", "4096"]
    wall, peak, m = timed_prepare(corpus, out, ["--no-dedup", *tok, "--master", "local[2]", "--set", "spark.ui=false",
                                                "--set", f"tokenizer.allocator={allocator}"],
                                  {"SPARKLM_SAMPLE_AHEAD": "1" if ahead else "0"})
    text_bytes = sum(s["text_bytes"] for s in m["splits"].values())
    tokens = sum(s["tokens"] for s in m["splits"].values())
    t = m["timing"]
    return {"wall_s": round(wall, 2), "spark_start_s": t["spark_start_seconds"], "text_bytes": text_bytes,
            "tokens": tokens, "mb_s_end_to_end": text_bytes / wall / 1e6,
            "mb_s_excl_jvm": text_bytes / (wall - t["spark_start_seconds"]) / 1e6,
            "tokens_s_excl_jvm": tokens / (wall - t["spark_start_seconds"]), "peak_rss": peak,
            "allocator": m["engine"].get("allocator")}


def paragraphs(corpus: Path) -> list[str]:
    """The same documents sparklm makes (blank-line paragraphs, cleaned), for the baselines."""
    sys.path.insert(0, str(ROOT / "src"))
    from sparklm.data.clean import clean_text

    out = []
    for f in sorted(corpus.iterdir()):
        text = f.read_bytes().decode("utf-8", "replace").replace("\r\n", "\n")
        out += [p for p in (clean_text(x) for x in text.split("\n\n")) if p]
    return out


def run_tokenizers(docs: list[str], tok_file: Path) -> dict:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tok_file))
    tok.encode_batch_fast(docs[:1000])  # warm-up
    t0 = time.time()
    tokens = 0
    for i in range(0, len(docs), 2000):
        tokens += sum(len(e.ids) for e in tok.encode_batch_fast(docs[i:i + 2000], add_special_tokens=False))
    dt = time.time() - t0
    nbytes = sum(len(d.encode()) for d in docs)
    return {"seconds": round(dt, 2), "mb_s": nbytes / dt / 1e6, "tokens_s": tokens / dt}


def run_datasets(docs: list[str], tok_dir: Path) -> dict:
    import datasets
    from transformers import PreTrainedTokenizerFast

    datasets.disable_progress_bars()
    tok = PreTrainedTokenizerFast(tokenizer_file=str(tok_dir / "tokenizer.json"))
    with tempfile.TemporaryDirectory() as cache:
        ds = datasets.Dataset.from_dict({"text": docs}).flatten_indices(cache_file_name=f"{cache}/base.arrow")
        t0 = time.time()
        out = ds.map(lambda b: tok(b["text"]), batched=True, num_proc=2, remove_columns=["text"],
                     cache_file_name=f"{cache}/tok.arrow")
        dt = time.time() - t0
        tokens = sum(len(x) for x in out["input_ids"])
    nbytes = sum(len(d.encode()) for d in docs)
    return {"seconds": round(dt, 2), "mb_s": nbytes / dt / 1e6, "tokens_s": tokens / dt}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[10, 100], help="corpus sizes in MB")
    ap.add_argument("--work", default=str(ROOT / ".bench"), help="scratch directory")
    ap.add_argument("--ahead-ab", type=int, metavar="MB",
                    help="only: prepare training its tokenizer, sampled while Spark starts (the default) or by a Spark "
                         "job first (SPARKLM_SAMPLE_AHEAD=0), against datasets.map in a fresh process; interleaved")
    ap.add_argument("--repeats", type=int, default=3, help="--ahead-ab's rounds")
    ap.add_argument("--scale", type=int, nargs="+", metavar="MB",
                    help="only: sparklm prepare at each size (tokenizer given; trained with --train), its wall time, "
                         "MB/s and each role's peak RSS, sampled from /proc every 0.2 s")
    ap.add_argument("--train", action="store_true", help="--scale: prepare trains its tokenizer (BPE 4096)")
    ap.add_argument("--allocator", default="auto", choices=["auto", "system"],
                    help="--scale: tokenizer.allocator (auto: mimalloc or jemalloc where installed; system: glibc's)")
    ap.add_argument("--datasets-one", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.datasets_one:  # one datasets.map run in this fresh process: its whole wall time and its map alone
        t0 = time.time()
        r = run_datasets(paragraphs(Path(args.datasets_one[0])), Path(args.datasets_one[1]))
        print(json.dumps({**r, "process_s": time.time() - T0, "after_start_s": time.time() - t0}))
        return
    work = Path(args.work)
    work.mkdir(exist_ok=True)
    if args.ahead_ab:
        return ahead_ab(args.ahead_ab, args.repeats, work)
    if args.scale:
        return scale(args.scale, args.train, work, args.allocator)
    results = {}
    for size in args.sizes:
        corpus = build_corpus(size, work)
        out = work / f"prepared-{size}mb"
        print(f"[{size} MB] sparklm prepare …", flush=True)
        s = run_sparklm(corpus, out)
        print(f"[{size} MB] sparklm prepare with the tokenizer given (no training) …", flush=True)
        g = run_sparklm(corpus, work / f"prepared-{size}mb-given", tokenizer=out / "tokenizer.json")
        docs = paragraphs(corpus)
        print(f"[{size} MB] tokenizers encode_batch …", flush=True)
        a = run_tokenizers(docs, out / "tokenizer.json")
        print(f"[{size} MB] datasets.map(num_proc=2) …", flush=True)
        b = run_datasets(docs, out)
        results[size] = {"sparklm": s, "sparklm_given_tokenizer": g, "tokenizers": a, "datasets": b,
                         "ratio_vs_tokenizers": s["mb_s_excl_jvm"] / a["mb_s"],
                         "ratio_vs_datasets": s["mb_s_excl_jvm"] / b["mb_s"],
                         "given_ratio_vs_tokenizers": g["mb_s_excl_jvm"] / a["mb_s"],
                         "given_ratio_vs_datasets": g["mb_s_excl_jvm"] / b["mb_s"]}
    print(json.dumps(results, indent=2, default=lambda x: round(x, 3)))
    print("\n| corpus | sparklm e2e MB/s | sparklm excl. JVM MB/s (tokens/s) | tokenizers MB/s | datasets.map MB/s "
          "| vs tokenizers | vs datasets | driver / JVM / workers peak RSS MB |")
    print("|---|---|---|---|---|---|---|---|")
    for size, r in results.items():
        s, a, b = r["sparklm"], r["tokenizers"], r["datasets"]
        p = s["peak_rss"]
        print(f"| {size} MB | {s['mb_s_end_to_end']:.2f} | {s['mb_s_excl_jvm']:.2f} ({s['tokens_s_excl_jvm']:,.0f}) "
              f"| {a['mb_s']:.2f} | {b['mb_s']:.2f} | {r['ratio_vs_tokenizers']:.2f}× | {r['ratio_vs_datasets']:.2f}× "
              f"| {p['driver_mb']:.0f} / {p['jvm_mb']:.0f} / {p['workers_mb']:.0f} |")
        g, p = r["sparklm_given_tokenizer"], r["sparklm_given_tokenizer"]["peak_rss"]
        print(f"| {size} MB, tokenizer given | {g['mb_s_end_to_end']:.2f} | {g['mb_s_excl_jvm']:.2f} "
              f"({g['tokens_s_excl_jvm']:,.0f}) | {a['mb_s']:.2f} | {b['mb_s']:.2f} | {r['given_ratio_vs_tokenizers']:.2f}× "
              f"| {r['given_ratio_vs_datasets']:.2f}× | {p['driver_mb']:.0f} / {p['jvm_mb']:.0f} / {p['workers_mb']:.0f} |")
    (work / "prepare_throughput.json").write_text(json.dumps(results, indent=2, default=float))


def scale(sizes: list[int], train: bool, work: Path, allocator: str = "auto") -> None:
    """prepare alone at each size, one run each (a 10 GB run is ~22 min here): whether the time grows linearly and
    the largest process's memory stays flat. The tokenizer given is one trained on the smallest corpus;
    ``allocator``: tokenizer.allocator (auto: mimalloc where installed; system: glibc's malloc)."""
    tokenizer = work / f"prepared-{min(sizes)}mb" / "tokenizer.json"
    if not train and not tokenizer.exists():
        run_sparklm(build_corpus(min(sizes), work), tokenizer.parent)
    rows = {}
    for size in sizes:
        corpus = build_corpus(size, work)
        out = work / f"prepared-scale-{size}mb"
        print(f"[{size} MB] sparklm prepare, tokenizer {'trained' if train else 'given'} …", flush=True)
        rows[size] = run_sparklm(corpus, out, tokenizer=None if train else tokenizer, allocator=allocator)
        shutil.rmtree(out, ignore_errors=True)  # 10 GB of text is ~5 GB of Parquet
        print(json.dumps(rows[size], default=float), flush=True)
    print(f"\nsparklm prepare --no-dedup, tokenizer {'trained (BPE 4096)' if train else 'given (BPE 4096)'}, local[2], "
          f"write tasks on {', '.join(next(iter(rows.values()))['allocator'] or ['?'])}")
    print("| corpus | text | wall | MB/s end to end | MB/s after Spark's start | tokens/s | peak RSS driver / JVM / "
          "Python workers (sum) |")
    print("|---|---|---|---|---|---|---|")
    for size, r in rows.items():
        p = r["peak_rss"]
        print(f"| {size:,} MB | {r['text_bytes'] / 1e6:,.0f} MB | {r['wall_s'] / 60:.1f} min | {r['mb_s_end_to_end']:.2f} "
              f"| {r['mb_s_excl_jvm']:.2f} | {r['tokens_s_excl_jvm']:,.0f} | {p['driver_mb']:.0f} / {p['jvm_mb']:.0f} / "
              f"{p['workers_mb']:.0f} MB |")
    name = f"prepare_scale{'_train' if train else ''}{'_system' if allocator == 'system' else ''}.json"
    (work / name).write_text(json.dumps(rows, indent=2, default=float))


def ahead_ab(size: int, repeats: int, work: Path) -> None:
    corpus = build_corpus(size, work)
    out = work / f"prepared-{size}mb"
    runs: dict[str, list[dict]] = {"ahead": [], "spark job": [], "datasets.map": []}
    for r in range(repeats):
        runs["ahead"].append(run_sparklm(corpus, out, ahead=True))
        runs["spark job"].append(run_sparklm(corpus, out, ahead=False))
        p = subprocess.run([sys.executable, __file__, "--datasets-one", str(corpus), str(out)], capture_output=True,
                           text=True, check=True)
        runs["datasets.map"].append(json.loads(p.stdout.strip().splitlines()[-1]))
        print(f"round {r + 1}: ahead {runs['ahead'][-1]['wall_s']:.1f} s, spark job {runs['spark job'][-1]['wall_s']:.1f} s, "
              f"datasets.map {runs['datasets.map'][-1]['seconds']:.1f} s (process {runs['datasets.map'][-1]['process_s']:.1f} s)",
              flush=True)
    med = statistics.median
    mb = runs["ahead"][0]["text_bytes"] / 1e6
    d_map, d_all = med(r["seconds"] for r in runs["datasets.map"]), med(r["process_s"] for r in runs["datasets.map"])
    print(f"\n{size} MB corpus ({mb:.1f} MB of text), --no-dedup, BPE 4096 trained by sparklm (datasets.map: the "
          f"tokenizer given), local[2], median of {repeats}")
    print("| contender | wall | MB/s | vs datasets.map (map only) | vs datasets.map (whole process) |")
    print("|---|---|---|---|---|")
    for name in ("ahead", "spark job"):
        w = med(r["wall_s"] for r in runs[name])
        print(f"| sparklm, sample {'read while Spark starts' if name == 'ahead' else 'read by a Spark job'} | "
              f"{w:.1f} s | {mb / w:.2f} | {d_map / w:.2f}× | {d_all / w:.2f}× |")
    print(f"| datasets.map(num_proc=2) | map {d_map:.1f} s, process {d_all:.1f} s | {mb / d_map:.2f} | 1.00× | 1.00× |")
    (work / "prepare_ahead_ab.json").write_text(json.dumps(runs, indent=2, default=float))


if __name__ == "__main__":
    main()
