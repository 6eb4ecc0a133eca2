"""`sparklm train` on real Spark local mode: learning, DDP equivalence, resume, the run directory."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from conftest import TINY, cfg, figures, resumes_bitwise, run_sparklm, stopped_copy, weights
from sparklm.config import from_dict
from sparklm.infra.errors import SparklmError
from sparklm.launch.train import train
from sparklm.metrics.sinks import read_metrics


def test_loss_falls_and_the_run_directory_is_complete(spark, dataset, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from sparklm.config import TrackingConfig

    run = tmp_path / "run"
    summary = train(dataset, output=str(run), config=cfg(max_steps=60).replace(tracking=TrackingConfig(tensorboard=True)),
                    spark=spark)
    rows = read_metrics(run / "metrics.csv")
    losses = [r["loss"] for r in rows if r["kind"] == "train"]
    assert losses[-1] < losses[0] - 1.5, losses
    events = EventAccumulator(str(run / "tensorboard"))  # --tensorboard: the same curve, step by step
    events.Reload()
    assert [e.step for e in events.Scalars("train/loss")] == list(range(1, 61))
    assert [e.value for e in events.Scalars("train/loss")] == pytest.approx(losses, rel=1e-5)
    for name in ("config.json", "metrics.csv", "summary.json", "loss.png", "samples.txt", "model/config.json",
                 "model/model.safetensors", "model/tokenizer.json", "model/generation_config.json"):
        assert (run / name).is_file(), name
    assert summary["steps"] == 60 and summary["final"]["val_bpb"] > 0
    assert summary["tokens_per_s"] > 0 and 0 < summary["mfu"] < 1
    # model/ reloads with transformers and gives the same logits as the final checkpoint's weights
    model = AutoModelForCausalLM.from_pretrained(run / "model").eval()
    tok = AutoTokenizer.from_pretrained(run / "model")
    ref = AutoModelForCausalLM.from_config(model.config).eval()
    ref.load_state_dict(weights(run), strict=False)
    ref.tie_weights()
    x = torch.tensor([tok("Москва — столица 東京")["input_ids"]])
    with torch.no_grad():
        assert torch.equal(model(x).logits, ref(x).logits)

    # a directory as the Hub's: the context as the tokenizer's limit, a class every transformers loads, sparklm's
    # sampling in generation_config.json, a model card; pipeline's greedy text is `sparklm generate --temperature 0`'s
    from transformers import pipeline

    import sparklm
    from sparklm.infer.generate import generate, load
    from sparklm.infer.sampling import Sampling

    assert tok.model_max_length == model.config.max_position_embeddings
    assert json.loads((run / "model" / "tokenizer_config.json").read_text())["tokenizer_class"] == \
        "PreTrainedTokenizerFast"
    gc = model.generation_config
    assert (gc.do_sample, gc.temperature, gc.top_k, gc.min_p) == (True, 0.8, 50, 0.1)
    card = (run / "model" / "README.md").read_text()
    assert card.startswith("---\nlibrary_name: transformers\npipeline_tag: text-generation")
    assert "| steps | 60 |" in card and "validation bits per byte" in card and "## How to load" in card
    generator = pipeline("text-generation", model=model, tokenizer=tok)
    ours = load(str(run))
    for prompt in ("Москва", "The quick"):
        theirs = generator(prompt, max_new_tokens=8, do_sample=False, return_full_text=False)[0]["generated_text"]
        assert theirs == generate(ours, [prompt], sampling=Sampling(temperature=0, max_new_tokens=8))[0].text

    # `export --format hub`: the files huggingface_hub uploads as they are, without sparklm's checksums
    hub = sparklm.export(str(run), output=str(tmp_path / "hub"), format="hub")
    assert {"README.md", "config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
            "tokenizer_config.json"} <= set(hub["files"]) and "sparklm_checksums.json" not in hub["files"]
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "hub").eval()
    with torch.no_grad():
        assert torch.equal(again(x).logits, model(x).logits)
    with pytest.raises(SparklmError, match="already exists"):
        sparklm.export(str(run), output=str(tmp_path / "hub"), format="hub")


def test_a_short_time_budget_trains_a_smaller_model_and_says_so(spark, dataset, tmp_path, capsys):
    import dataclasses

    run = tmp_path / "run"
    config = cfg(time_budget=1.0, samples=0)
    config = config.replace(model=dataclasses.replace(config.model, n_layer=4, n_embd=256))
    train(dataset, output=str(run), config=config, spark=spark)
    model = json.loads((run / "config.json").read_text())["config"]["model"]
    built = json.loads((run / "model" / "config.json").read_text())
    assert (model["n_layer"], model["n_embd"]) != (4, 256) and model["fit_budget"] is False  # a resume keeps it
    assert (built["num_hidden_layers"], built["hidden_size"]) == (model["n_layer"], model["n_embd"])
    assert f"model: {model['n_layer']} layers × {model['n_embd']} for the 1 s budget" in capsys.readouterr().err


def test_two_workers_equal_one_process_on_the_same_global_batch(spark, dataset, tmp_path):
    one = tmp_path / "one"
    two = tmp_path / "two"
    # eval_batches=0: the whole validation split, split between the ranks by row (possibly unevenly)
    s1 = train(dataset, output=str(one), config=cfg(max_steps=5, batch_size=8, samples=0, eval_batches=0), spark=spark)
    s2 = train(dataset, output=str(two), config=cfg(max_steps=5, batch_size=4, workers=2, samples=0, eval_batches=0),
               spark=spark)
    assert s1["final"]["val_tokens"] == s2["final"]["val_tokens"]
    assert s1["final"]["val_loss"] == pytest.approx(s2["final"]["val_loss"], abs=1e-5)
    a, b = weights(one), weights(two)
    assert a.keys() == b.keys()
    worst = max((a[k] - b[k]).abs().max().item() for k in a)
    assert worst < 1e-5, worst
    la = [r["loss"] for r in read_metrics(one / "metrics.csv") if r["kind"] == "train"]
    rows = [r for r in read_metrics(two / "metrics.csv") if r["kind"] == "train"]
    assert la == pytest.approx([r["loss"] for r in rows], abs=1e-5)
    # every rank's peak memory: per log step and for the run, the largest of them as peak_rss_mb
    for r in rows:
        per_rank = [float(v) for v in r["rank_peak_rss_mb"].split("/")]
        assert len(per_rank) == 2 and min(per_rank) > 0 and r["peak_rss_mb"] == pytest.approx(max(per_rank), abs=1)
    assert len(s1["rank_peak_rss_mb"]) == 1 and len(s2["rank_peak_rss_mb"]) == 2
    assert min(s2["rank_peak_rss_mb"]) > 0 and s2["peak_rss_mb"] == max(s2["rank_peak_rss_mb"])


def test_warm_rank_processes_are_taken_once_and_report_how_their_rank_ended(tmp_path):
    """Local mode: ranks' processes start before Spark (ddp.DDP.prestart); a task takes one over (the rank is
    forked for it, its exit status comes back), a second attempt finds none and starts a fresh process, and
    the unused ones are stopped."""
    import os
    import signal

    from sparklm.config import Config, TrainConfig
    from sparklm.strategies.ddp import DDP, WarmRank

    with DDP().prestart(Config(train=TrainConfig(workers=2, threads=1)), "local[2]") as warm:
        assert len(warm) == 2
        log = tmp_path / "rank-0.log"
        rank = WarmRank.take(warm[0], str(log))
        assert rank is not None and rank.poll() is None
        rank.stdin.write(b"not a start message")
        rank.stdin.close()
        assert list(rank.stdout) == [] and rank.wait() == 1  # the rank's own exit status
        assert "JSONDecodeError" in log.read_text()  # its stderr went to the task's log
        assert WarmRank.take(warm[0], str(log), wait=5) is None  # taken once: a restart starts a fresh process
        other = WarmRank.take(warm[1], str(tmp_path / "rank-1.log"))
        other.kill()
        assert other.wait() == -signal.SIGKILL
        assert not os.path.exists(f"/proc/{other.pid}")  # reaped by its warm process
    assert not any(os.path.exists(p) for p in warm)  # the unused ones stopped, their sockets removed


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_resume_ends_with_the_same_weights(spark, dataset, tmp_path, optimizer):
    full = tmp_path / "full"
    train(dataset, output=str(full), config=cfg(max_steps=8, checkpoint_every=4, samples=0, optimizer=optimizer),
          spark=spark)
    # A run stopped after its step-4 checkpoint: the same directory without what came later.
    stopped = tmp_path / "stopped"
    stopped_copy(full, stopped, after=4, last=8)
    train(None, output=str(stopped), resume=True, spark=spark)
    a, b = weights(full), weights(stopped)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert figures(stopped) == figures(full)  # steps 5-8 once: the resumed run rewound the rows written after step 4


def _hf_weights(directory):
    from safetensors.torch import load_file

    return load_file(str(directory / "model.safetensors"))


def _same(model_dir, tensors) -> bool:
    ours = _hf_weights(model_dir)
    return all(torch.equal(ours[k], tensors[k]) for k in ours if k in tensors)


@pytest.mark.parametrize("strategy", ["ddp", "average"])
def test_model_holds_the_best_evaluation_and_model_final_the_last(spark, dataset, tmp_path, strategy):
    """A run whose last steps wreck the model (resumed with a huge learning rate): model/ holds the weights of
    the best evaluation (also across the resume), model-final/ the final ones, and the summary says which step."""
    run = tmp_path / "run"
    extra = {"strategy": strategy, "sync_every": 5} if strategy != "ddp" else {}
    train(dataset, output=str(run), config=cfg(max_steps=20, eval_every=10, checkpoint_every=10, keep_checkpoints=5,
                                               **extra), spark=spark)
    assert not (run / "model-final").exists()  # the final weights were the best: model/ holds them, alone
    s = train(None, output=str(run), resume=True, changes={"train": {"max_steps": 30, "lr": 5.0}}, spark=spark)
    best = s["best"]["step"]
    assert best in (10, 20) and s["steps"] == 30
    assert s["final"]["val_loss"] > s["best"]["val_loss"] + 1.0
    ckpt = run / "checkpoints"
    assert _same(run / "model", _hf_weights(ckpt / f"step-{best:07d}"))
    assert _same(run / "model-final", _hf_weights(ckpt / "step-0000030"))
    assert not _same(run / "model", _hf_weights(ckpt / "step-0000030"))
    assert (run / "samples.txt").is_file()


@pytest.mark.parametrize("strategy", ["ddp", "diloco"])
def test_early_stop_ends_the_run_after_evaluations_without_a_better_one(spark, dataset, tmp_path, strategy):
    run = tmp_path / "run"
    extra = {"strategy": strategy, "sync_every": 2} if strategy != "ddp" else {}
    # lr 5: every step wrecks the model, so the validation loss soon stops falling
    s = train(dataset, output=str(run), config=cfg(max_steps=200, eval_every=2, early_stop=2, lr=5.0, warmup_steps=0,
                                                   samples=0, **extra), spark=spark)
    evals = [r for r in read_metrics(run / "metrics.csv") if r["kind"] == "eval"]
    assert s["steps"] < 200 and len(evals) >= 3
    best = min(evals, key=lambda r: r["val_loss"])
    assert s["best"]["step"] == best["step"] and s["best"]["val_loss"] == pytest.approx(best["val_loss"], rel=1e-4)
    # the stop is decided on the evaluations before the last one; with rounds, the last evaluation (of the weights
    # after the round that ran while the stop was decided) may still be the best, and model/ then holds it
    decided_on = evals[:-1] if strategy != "ddp" else evals
    decided = min(decided_on, key=lambda r: r["val_loss"])
    after = [r for r in decided_on if r["step"] > decided["step"]]
    assert len(after) >= 2 and all(r["val_loss"] >= decided["val_loss"] for r in after)
    assert (run / "model" / "model.safetensors").is_file()


def test_bad_inputs_are_one_line(spark, dataset, tmp_path):
    with pytest.raises(SparklmError, match="prepared dataset not found"):
        train(str(tmp_path / "nope"), output=str(tmp_path / "r1"), config=cfg(), spark=spark)
    (tmp_path / "empty").mkdir()
    with pytest.raises(SparklmError, match="is not a prepared dataset"):
        train(str(tmp_path / "empty"), output=str(tmp_path / "r2"), config=cfg(), spark=spark)
    with pytest.raises(SparklmError, match="fewer than one global batch"):
        train(dataset, output=str(tmp_path / "r3"), config=cfg(batch_size=100000, max_steps=1), spark=spark)
    broken = tmp_path / "broken"
    shutil.copytree(dataset, broken)
    tok = json.loads((broken / "tokenizer.json").read_text())
    tok["model"]["merges"] = tok["model"]["merges"][:-5]
    (broken / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(SparklmError, match="does not match its manifest"):
        train(str(broken), output=str(tmp_path / "r4"), config=cfg(), spark=spark)
    with pytest.raises(SparklmError, match="cannot resume"):
        train(None, output=str(tmp_path / "r5"), resume=True, spark=spark)


def test_init_from_continues_a_model_and_checks_its_tokenizer(spark, dataset, tmp_path):
    first = tmp_path / "first"
    train(dataset, output=str(first), config=cfg(max_steps=40, samples=0), spark=spark)
    start_loss = [r["loss"] for r in read_metrics(first / "metrics.csv") if r["kind"] == "train"]
    raw = json.loads(json.dumps(TINY))
    raw["train"].update(max_steps=3, samples=0)
    raw["model"]["init_from"] = str(first / "model")
    cont = tmp_path / "cont"
    train(dataset, output=str(cont), config=from_dict(raw), spark=spark)
    cont_loss = [r["loss"] for r in read_metrics(cont / "metrics.csv") if r["kind"] == "train"]
    assert cont_loss[0] < start_loss[0] - 1.0  # it starts where the first run ended, not from scratch
    other = tmp_path / "other-model"
    shutil.copytree(first / "model", other)
    tok = json.loads((other / "tokenizer.json").read_text())
    tok["model"]["merges"] = tok["model"]["merges"][:-3]
    (other / "tokenizer.json").write_text(json.dumps(tok))
    raw["model"]["init_from"] = str(other)
    with pytest.raises(SparklmError, match="tokenizer of .* differs from the dataset's"):
        train(dataset, output=str(tmp_path / "bad"), config=from_dict(raw), spark=spark)


@pytest.mark.slow
def test_cli_resume_keeps_the_saved_settings_and_refuses_a_new_data_order(dataset, tmp_path):
    """The regression: `--resume` rebuilt a complete default Config, so lr, batch size and seed of the run
    reverted to the defaults. Now only what the user sets on the resuming command is applied."""
    run = tmp_path / "run"
    common = ["--master", "local[2]", "--set", "spark.ui=false", "--set", "model.n_layer=1", "--set", "model.n_head=2",
              "--set", "model.n_embd=32", "--set", "train.eval_batches=2", "--set", "train.samples=0",
              "--set", 'train.dtype="float32"', "--threads", "1"]
    def cli(*args):
        return run_sparklm("train", *args)

    r = cli("--data", dataset, "-o", str(run), "--max-steps", "2", "--set", "train.lr=1e-3", "--set",
            "train.batch_size=16", "--set", "train.seed=7", *common)
    assert r.returncode == 0, r.stderr[-2000:]
    r = cli("-o", str(run), "--resume", "--max-steps", "4", "--master", "local[2]", "--set", "spark.ui=false")
    assert r.returncode == 0, r.stderr[-2000:]
    saved = json.loads((run / "config.json").read_text())["config"]["train"]
    assert (saved["lr"], saved["batch_size"], saved["seed"], saved["max_steps"]) == (1e-3, 16, 7, 4)
    assert json.loads((run / "summary.json").read_text())["steps"] == 4
    r = cli("-o", str(run), "--resume", "--max-steps", "6", "--set", "train.seed=8")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("error: cannot change train.seed when resuming")
    r = cli("-o", str(run), "--resume", "--set", "train.sync_every=4")
    assert r.returncode == 2 and "did you mean 'train.rounds.sync_every'" in r.stderr


def test_epochs_csv_sums_each_pass_and_train_rows_carry_the_training_accuracy(spark, tmp_path):
    """The seeds' per-epoch statistics: a small split passed several times gives one epochs.csv row per pass, its
    loss and accuracy the step-weighted means of the pass's train rows."""
    from conftest import make_text
    from sparklm.config import from_dict
    from sparklm.launch.prepare import prepare
    from sparklm.metrics.epochs import epoch_rows

    (tmp_path / "a.txt").write_text(make_text(24, seed=4))
    data = prepare([str(tmp_path / "a.txt")], output=str(tmp_path / "prep"), spark=spark,
                   config=from_dict({"data": {"seq_len": 32, "val_fraction": 0.1}, "tokenizer": {"vocab_size": 300}}))
    per_epoch = data.manifest["splits"]["train"]["tokens"] / 128  # steps per pass: 4 rows of 32 tokens a step
    run = tmp_path / "run"
    train(data.uri, output=str(run), config=cfg(max_steps=int(3.5 * per_epoch) + 1), spark=spark)
    rows = read_metrics(run / "metrics.csv")
    train_rows = [r for r in rows if r["kind"] == "train"]
    assert all(0 <= r["acc"] <= 1 for r in train_rows)
    assert sum(r["acc"] for r in train_rows[-5:]) > sum(r["acc"] for r in train_rows[:5])  # it learns
    epochs = read_metrics(run / "epochs.csv")
    assert [e["epoch"] for e in epochs] == [1, 2, 3]
    want = epoch_rows(train_rows)
    assert [e["step"] for e in epochs] == [w.step for w in want]
    assert [e["loss"] for e in epochs] == pytest.approx([w.loss for w in want], rel=1e-5)
    assert epochs[-1]["loss"] < epochs[0]["loss"] and all(e["epoch_s"] > 0 and e["tokens_per_s"] > 0 for e in epochs)


def test_two_ranks_with_dropout_resume_bitwise_from_the_rng_states_they_gathered(spark, dataset, tmp_path):
    """A DDP checkpoint holds every rank's RNG state, gathered as tensors (nothing unpickled between ranks): with
    dropout drawing from it, two ranks resumed from the checkpoint end bitwise where the uninterrupted run ended."""
    import dataclasses

    from safetensors.torch import load_file

    conf = cfg(max_steps=6, checkpoint_every=3, samples=0, workers=2)
    conf = conf.replace(model=dataclasses.replace(conf.model, dropout=0.2))
    full = tmp_path / "full"
    train(dataset, output=str(full), config=conf, spark=spark)
    rng = load_file(str(full / "checkpoints" / "step-0000003" / "rng.safetensors"))
    assert set(rng) == {"torch.0", "torch.1"} and not torch.equal(rng["torch.0"], rng["torch.1"])
    stopped = tmp_path / "stopped"
    resumes_bitwise(full, stopped, after=3, last=6, spark=spark)
    assert figures(stopped) == figures(full)
