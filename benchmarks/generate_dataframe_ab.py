"""Benchmark: batch generation over a Spark DataFrame (generate_dataframe) by whichever sparklm is on the path, so
that two versions run side by side, each in a fresh process:

    git worktree add /tmp/old COMMIT
    for i in 1 2 3; do .venv/bin/python benchmarks/generate_dataframe_ab.py new 128
                       PYTHONPATH=/tmp/old/src .venv/bin/python benchmarks/generate_dataframe_ab.py old 128; done

PROMPTS prompts (default 32), 64 sampled tokens each, local[2], 2 workers x 1 thread, batch 8, a warm-up pass
first (each worker loads the model). The model: a random Llama 4L/256, context 256, with a 4096-word BPE trained on
../shared/data/tinyshakespeare.txt, made once under /tmp/genbench-run.
"""
import json
import sys
import time
from pathlib import Path

RUN = Path("/tmp/genbench-run")

def model():
    if (RUN / "model" / "config.json").exists():
        return
    from sparklm.config import from_dict
    from sparklm.data.tokenizer import train as train_tokenizer
    from sparklm.model import build_model
    text = Path(__file__).resolve().parents[2] / "shared" / "data" / "tinyshakespeare.txt"
    if not text.exists():
        raise SystemExit(f"{text} not found: the benchmark trains its tokenizer on ../shared/data")
    texts = [text.read_text()[:2_000_000]]
    cfg = from_dict({"tokenizer": {"vocab_size": 4096}, "model": {"n_layer": 4, "n_head": 4, "n_embd": 256}})
    spec = train_tokenizer(texts, cfg.tokenizer)
    m = build_model(cfg.model, vocab_size=spec.vocab_size, context=256, bos_id=spec.bos_id, eos_id=spec.eos_id,
                    pad_id=spec.pad_id, seed=1)
    m.generation_config.bos_token_id, m.generation_config.eos_token_id = spec.bos_id, spec.eos_id
    m.generation_config.pad_token_id = spec.pad_id
    m.save_pretrained(str(RUN / "model"), safe_serialization=True)
    spec.save(RUN / "model")

def main():
    model()
    from sparklm.config import SparkConfig
    from sparklm.infer.batch import generate_dataframe
    from sparklm.infer.sampling import Sampling
    from sparklm.spark.session import get_session
    s = Sampling(temperature=0.8, top_k=50, max_new_tokens=64, min_new_tokens=64, seed=1)
    prompts = [f"Prompt number {i}: the king said" for i in range(int(sys.argv[2]) if len(sys.argv) > 2 else 32)]
    spark = get_session(SparkConfig(master="local[2]", ui=False))
    df = spark.createDataFrame(list(enumerate(prompts)), "id long, prompt string").repartition(2)
    generate_dataframe(df, model=str(RUN), sampling=s, batch_size=8, threads=1).collect()  # warm-up
    t = time.perf_counter()
    rows = generate_dataframe(df, model=str(RUN), sampling=s, batch_size=8, threads=1).collect()
    dt = time.perf_counter() - t
    n = sum(r.new_tokens for r in rows)
    print(json.dumps({"impl": sys.argv[1], "seconds": round(dt, 2), "tok_s": round(n / dt, 1), "tokens": n}))
    spark.stop()

main()
