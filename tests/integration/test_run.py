"""The main job, as a user runs it: `sparklm run` on the bundled corpus, end to end (short budget)."""

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def test_main_job_on_the_bundled_corpus(tmp_path):
    run = tmp_path / "run"
    args = [sys.executable, "-m", "sparklm", "run", "--output", str(run), "--time-budget", "20", "--master", "local[2]",
            "--set", "spark.ui=false", "--set", "model.n_layer=2", "--set", "model.n_embd=64", "--set", "model.n_head=2",
            "--set", "train.eval_every=20", "--set", "train.eval_batches=4", "--set", "train.sample_tokens=16"]
    r = subprocess.run(args, capture_output=True, text=True, timeout=600, cwd=tmp_path,
                       env={**os.environ, "SPARK_LOCAL_IP": "127.0.0.1"})
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout.strip().splitlines()
    assert out[-2] == str(run) and out[-1].startswith("validation bits/byte of model/ (step ")
    bpb = float(out[-1].split(": ")[1])
    summary = json.loads((run / "summary.json").read_text())
    # model/ is the best evaluation: its figure is printed, no worse than the final one
    assert summary["best"]["val_bpb"] == pytest.approx(bpb, abs=1e-4) and bpb < 8  # learned something (8 = uniform)
    assert summary["best"]["val_bpb"] <= summary["final"]["val_bpb"] and out[-1].startswith(f"validation bits/byte of model/ (step "
                                                                      f"{summary['best']['step']}): ")
    assert json.loads((run / "config.json").read_text())["config"]["train"]["early_stop"] == 3  # run's default
    assert (run / "data" / "manifest.json").is_file() and (run / "samples.txt").read_text().count("--- prompt") == 3
    assert "step " in r.stderr and "tok/s" in r.stderr  # live progress was shown
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(run / "model")
    model = AutoModelForCausalLM.from_pretrained(run / "model")
    ids = tok("It is a truth universally", return_tensors="pt")["input_ids"]
    assert model(ids).logits.shape[-1] >= tok.vocab_size
