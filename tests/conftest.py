"""Shared fixtures: one real local Spark session per test run, corpora made on the fly, a moto S3 server."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from pathlib import Path

import pytest

from sparklm.config import Config, SparkConfig


def _private_temp_dir() -> None:
    """Under pytest-xdist (CI runs two test processes), each process and everything it starts (the CLI, the JVM,
    Python workers, ranks) gets its own temp dir: tests that check what a job left there see only their own."""
    import tempfile

    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker:
        private = Path(tempfile.gettempdir()) / f"sparklm-tests-{os.getpid()}-{worker}"
        private.mkdir(parents=True, exist_ok=True)
        import atexit
        import shutil

        atexit.register(shutil.rmtree, private, ignore_errors=True)
        os.environ["TMPDIR"] = str(private)
        tempfile.tempdir = None  # computed again from TMPDIR


_private_temp_dir()

# Where PYTHONDONTWRITEBYTECODE is set (many container images), every process the suite starts (CLI calls, Spark's
# Python workers, ranks, the share-nothing cluster's executors) would compile sparklm's modules again: keep bytecode.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False

# The suite starts ~100 short-lived driver JVMs (each CLI call, spark-submit) that do little work each: the client
# JIT alone and the serial collector start them ~4 s sooner on 2 cores and leave the cores to the tests. Test
# processes only (spark-submit reads SPARK_SUBMIT_OPTS); users' Spark keeps the JVM's defaults.
os.environ.setdefault("SPARK_SUBMIT_OPTS", "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC")


def pytest_collection_modifyitems(config, items):
    """The share-nothing cluster (five minutes) first, then the short cases, then the standalone cluster's and the
    slow cases (each group in collection order).

    Two test processes (``-n 2 --dist loadgroup --no-loadscope-reorder``) take work in this order: while one runs
    the long cluster test, which keeps both cores busy part of the time, the other goes through the short cases;
    the cases that start many processes come last, two at a time, instead of three at once at the start."""
    def rank(item) -> int:
        cluster, slow = item.get_closest_marker("cluster"), item.get_closest_marker("slow")
        if cluster and slow:
            return 0  # the longest by far, with a cluster of its own: at once
        return 3 if slow else 2 if cluster else 1

    items.sort(key=rank)  # stable
    if getattr(config.option, "loadgroup", False):  # a test process of `--dist loadgroup` (xdist sets it there)
        _name_groups(items)


def _name_groups(items) -> None:
    """``xdist_group``'s promise kept: the tests of a group go to one test process (its module fixtures, such as a
    standalone cluster or the fine-tuning models, made once). pytest-xdist 3.8 marks a grouped test by appending
    ``@group`` to ``item._nodeid``, which pytest 9 no longer reads (a node's id is ``item._id``): every group was
    spread over both processes, each making the group's fixtures. The same suffix, where pytest 9 keeps it."""
    from _pytest.nodeid import coerce_node_id

    for item in items:
        names = sorted({str(m.args[0] if m.args else m.kwargs.get("name", "default"))
                        for m in item.iter_markers("xdist_group")})
        if names and not item.nodeid.endswith("@" + "_".join(names)):
            item._id = coerce_node_id(f"{item.nodeid}@{'_'.join(names)}")


# A few scripts and shapes the product must handle, not just the shared English corpora.
MULTILINGUAL = [
    "The quick brown fox jumps over the lazy dog.\nIt was the best of times.",
    "Le cœur a ses raisons que la raison ne connaît point.",
    "Ünïcödé: e\u0301 (combining) becomes é after NFC.",
    "東京は日本の首都です。吾輩は猫である。名前はまだ無い。",
    "Москва — столица России.\nВ начале было Слово.",
    "مرحبا بالعالم. هذه جملة عربية.",
    "नमस्ते दुनिया। यह हिंदी में एक वाक्य है।",
    "Emoji 🚀✨ and symbols ∑ ∫ ≠ and tabs\tinside.",
    "Ελληνικά: Γνῶθι σεαυτόν.",
    "한국어 문장입니다. 감사합니다.",
]


def run_sparklm(*args: str, cwd=None, timeout: float = 600, env: dict | None = None) -> subprocess.CompletedProcess:
    """``sparklm ARGS...`` in a fresh process, as a user runs it (Spark bound to loopback); output captured."""
    env = {**os.environ, "SPARK_LOCAL_IP": "127.0.0.1", **(env or {})}
    return subprocess.run([sys.executable, "-m", "sparklm", *args], capture_output=True, text=True, cwd=cwd,
                          timeout=timeout, env=env)


def interrupt(args: list[str], started, during=None) -> subprocess.CompletedProcess:
    """Run ``sparklm ARGS`` in its own process group, call ``during()`` once ``started(stderr so far)`` holds, then
    send the group SIGINT (what a terminal's Ctrl-C does); return the finished process (``pid`` set) once every
    process of the group (the JVM, DDP ranks) is gone."""
    import signal
    import tempfile

    with tempfile.TemporaryFile("w+") as err_file:
        proc = subprocess.Popen([sys.executable, "-m", "sparklm", *args], stdout=subprocess.PIPE, stderr=err_file,
                                text=True, start_new_session=True, env={**os.environ, "SPARK_LOCAL_IP": "127.0.0.1"})

        def err() -> str:
            err_file.seek(0)
            return err_file.read()

        try:
            deadline = time.time() + 180
            while not started(err()) and proc.poll() is None and time.time() < deadline:
                time.sleep(0.1)
            assert proc.poll() is None, err()[-2000:]
            if during is not None:
                during()
            os.killpg(proc.pid, signal.SIGINT)
            out, _ = proc.communicate(timeout=60)
            assert group_gone(proc.pid, 30), "processes of the interrupted command were still running"
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        done = subprocess.CompletedProcess(proc.args, proc.returncode, out, err())
    done.pid = proc.pid
    return done


def group_gone(pgid: int, wait: float = 60) -> bool:
    """Every process of the group has exited within ``wait`` seconds; those left are then SIGKILLed."""
    import signal

    deadline = time.time() + wait
    while time.time() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.2)
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        return True
    return False


def spark_started(stderr: str) -> bool:
    """The command has started its Spark session (and its Ctrl-C handler with it): its jobs are next."""
    return "Spark " in stderr and " started in " in stderr


def assert_one_line_interrupt(r: subprocess.CompletedProcess) -> None:
    """Ctrl-C ended the command with exit 130 and one line, ``interrupted``, last: no traceback, no Spark noise."""
    assert r.returncode == 130, r.stderr[-3000:]
    assert r.stderr.splitlines()[-1] == "interrupted" and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert not any(word in r.stderr for word in ("Py4J", "Error", "Exception")), r.stderr[-3000:]


def make_text(n_paragraphs: int = 40, seed: int = 0) -> str:
    """Paragraphs of mixed scripts separated by blank lines; each paragraph distinct."""
    import random

    rng = random.Random(seed)
    paras = []
    for i in range(n_paragraphs):
        words = " ".join(" ".join(rng.choice(MULTILINGUAL).split()[: rng.randint(3, 12)])
                         for _ in range(rng.randint(1, 3)))
        paras.append(f"{i}. {words}")
    return "\n\n".join(paras) + "\n"


@pytest.fixture(scope="session")
def spark(s3_server):
    # The S3 server starts first so its variables are in the environment Python workers inherit.
    from sparklm.spark.session import get_session

    session = get_session(SparkConfig(master="local[2]", ui=False, conf={"spark.sql.shuffle.partitions": "4"}))
    yield session
    session.stop()


@pytest.fixture
def config() -> Config:
    """A small config for tests: small vocabulary and sequences."""
    from sparklm.config import from_dict

    return from_dict({"data": {"seq_len": 32, "val_fraction": 0.2}, "tokenizer": {"vocab_size": 300}})


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- a standalone Spark cluster on 127.0.0.1 (test_cluster.py, test_hosts.py) ---------------------------


def spark_master(work: Path, env: dict) -> tuple[subprocess.Popen, str, int]:
    """A standalone master started from the pyspark package: (process, master URL, web UI port).

    The master binds ports of its own choosing (0), read back from its log: a port picked here and handed over could
    be taken meanwhile by another test's JVM, and Spark would quietly move to the next one, leaving the workers
    knocking on the wrong door until the wait gave up (seen once in CI)."""
    import re

    import pyspark

    log = work / "master.log"
    proc = subprocess.Popen([str(Path(pyspark.__file__).parent / "bin" / "spark-class"),
                             "org.apache.spark.deploy.master.Master", "--host", "127.0.0.1", "--port", "0",
                             "--webui-port", "0"],
                            env=env, stdout=open(log, "wb"), stderr=subprocess.STDOUT)

    def ports() -> tuple[str, int] | None:
        text = log.read_text(errors="replace")
        url = re.search(r"Starting Spark master at (spark://\S+)", text)
        ui = re.search(r"Successfully started service 'MasterUI' on port (\d+)", text)
        return (url.group(1), int(ui.group(1))) if url and ui else None

    try:
        url, ui = wait_until(ports, [proc], f"standalone master (log in {log})")
    except BaseException:
        stop_processes([proc])
        raise
    return proc, url, ui


def start_standalone(work: Path, workers: int = 2) -> tuple[list[subprocess.Popen], str, int]:
    """A master and ``workers`` 1-core workers from the pyspark package on 127.0.0.1, up: (processes, master URL, UI
    port); logs and work dirs under ``work``."""
    master, url, ui = spark_master(work, standalone_env(work))
    procs = [master]
    for i in range(workers):
        procs.append(add_worker(work, url, f"w{i}"))
    try:
        wait_for_workers(ui, workers, procs, f"standalone cluster (logs in {work})")
    except BaseException:  # pytest.fail or Ctrl-C: leave no JVM behind
        stop_processes(procs)
        raise
    return procs, url, ui


def standalone_env(work: Path) -> dict:
    import pyspark

    from sparklm.spark.java import find_java_home

    home = Path(pyspark.__file__).parent
    # a worker takes SIGPWR as "decommission me" (its executors too, where the application enables it)
    return {**os.environ, "JAVA_HOME": find_java_home(), "SPARK_HOME": str(home), "SPARK_LOCAL_IP": "127.0.0.1",
            "PYSPARK_PYTHON": sys.executable, "SPARK_LOG_DIR": str(work),
            "SPARK_WORKER_OPTS": "-Dspark.decommission.enabled=true"}


def add_worker(work: Path, url: str, name: str) -> subprocess.Popen:
    """One more 1-core worker (3 GB) joining the master at ``url``, in its own session: a host to take away whole
    (kill_tree), or to decommission (SIGPWR)."""
    import pyspark

    home = Path(pyspark.__file__).parent
    return subprocess.Popen(
        [str(home / "bin" / "spark-class"), "org.apache.spark.deploy.worker.Worker", "--host", "127.0.0.1",
         "--cores", "1", "--memory", "3g", "--webui-port", "0", "--work-dir", str(work / name), url],
        env=standalone_env(work), stdout=open(work / f"{name}.log", "wb"), stderr=subprocess.STDOUT,
        start_new_session=True)


def wait_for_workers(ui: int, n: int, procs: list[subprocess.Popen], what: str) -> None:
    """Until the master's UI lists ``n`` live workers (wait_until)."""
    def alive() -> bool | None:
        try:
            state = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{ui}/json/", timeout=2).read())
        except (OSError, ValueError):  # not up yet, or its UI answered before it was ready
            return None
        return sum(w["state"] == "ALIVE" for w in state["workers"]) == n or None

    wait_until(alive, procs, what)


def wait_until(ready, procs: list[subprocess.Popen], what: str, seconds: float = 120):
    """What ``ready()`` returns once it is not None, asked every half second; fails the test after ``seconds`` or
    when one of ``procs`` exits."""
    deadline = time.time() + seconds
    while (found := ready()) is None:
        if time.time() > deadline or any(p.poll() is not None for p in procs):
            pytest.fail(f"{what} did not start")
        time.sleep(0.5)
    return found


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid`` and every process below it (a standalone worker: its executor, Python workers and ranks), as
    a host that goes away takes them all."""
    import signal

    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    todo, found = [pid], []
    while todo:
        found.append(todo.pop())
        todo += children.get(found[-1], [])
    for p in found:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def decommission(worker: subprocess.Popen) -> None:
    """A standalone worker told to leave gracefully (SIGPWR): it takes no new executors, and Spark decommissions the
    ones it runs (with the application's spark.decommission.enabled): their running tasks may finish, no new task
    goes to them; as a Kubernetes node drained, or a spot instance given notice."""
    import signal

    os.kill(worker.pid, signal.SIGPWR)


def stop_processes(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        p.terminate()
    for p in procs:
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()


def stopped_copy(full: Path, stopped: Path, *, after: int, last: int) -> None:
    """``stopped``: the run ``full`` as if killed between its step-``after`` checkpoint and step ``last`` (its later
    checkpoints and model gone; the metric rows it wrote after the checkpoint still there, for the resumed run to
    rewind)."""
    import shutil

    shutil.copytree(full, stopped)
    for ckpt in (stopped / "checkpoints").glob("step-*"):
        if int(ckpt.name.split("-")[1]) > after:
            shutil.rmtree(ckpt)
    shutil.rmtree(stopped / "model")


def resumes_bitwise(full: Path, stopped: Path, *, after: int, last: int, spark, config=None) -> None:
    """``full`` stopped after its step-``after`` checkpoint (:func:`stopped_copy`) and resumed into ``stopped`` ends
    with bit for bit the same newest checkpoint weights."""
    import torch

    from sparklm.launch.train import train

    stopped_copy(full, stopped, after=after, last=last)
    train(None, output=str(stopped), config=config, resume=True, spark=spark)
    a, b = weights(full), weights(stopped)
    for k in a:
        assert torch.equal(a[k], b[k]), k


def figures(run, name: str = "metrics.csv") -> list[tuple]:
    """What a run's metrics.csv (or rounds.csv) says step by step, without timings: equal for a resumed run and an
    uninterrupted one (each step once)."""
    from sparklm.metrics.sinks import read_metrics

    return [(r.get("kind"), r.get("round"), r["step"], r["loss"], r.get("val_loss"))
            for r in read_metrics(str(run) + "/" + name)]


@pytest.fixture(scope="session")
def s3_server():
    """A real S3 endpoint (moto in server mode) on 127.0.0.1 for the whole run."""
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    server.start()
    env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_REGION": "us-east-1",
           "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    yield env["AWS_ENDPOINT_URL"]
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    server.stop()


# -- training: a tiny model on a prepared dataset (shared by the training and rounds tests) ------------

TINY = {"model": {"n_layer": 2, "n_head": 2, "n_embd": 32},
        "train": {"batch_size": 4, "lr": 3e-3, "warmup_steps": 2, "eval_every": 0, "eval_batches": 4,
                  "log_every": 1, "dtype": "float32", "samples": 1, "sample_tokens": 8, "threads": 1,
                  # not auto: the strategies' equivalence tests compare to 1e-5, and Muon's bf16 orthogonalisation
                  # turns fp32 rounding differences of the summed gradients into larger ones
                  "optimizer": "adamw"}}
ROUNDS_KEYS = {"sync_every", "outer_lr", "outer_momentum", "inner_state", "codec", "density", "bits", "residual_decay",
              "downlink", "average_over"}


def plan_for(config, dataset, *, threads: int = 1, workers: int | None = None):
    """The one way a test makes a run plan for a worker it drives itself (resolve.local: settled for ``threads`` on
    this machine, no memory limit, no budget fit); ``dataset``: a PreparedDataset or its URI."""
    from sparklm.data.manifest import load_prepared
    from sparklm.train.resolve import local

    if isinstance(dataset, str):
        dataset = load_prepared(dataset, config.storage)
    return local(config, dataset, threads, workers=workers)


def cfg(**train):
    """The tiny training config with ``train`` settings (round settings go to [train.rounds])."""
    import json

    from sparklm.config import from_dict

    raw = json.loads(json.dumps(TINY))
    raw["train"].update({k: v for k, v in train.items() if k not in ROUNDS_KEYS})
    rounds = {k: v for k, v in train.items() if k in ROUNDS_KEYS}
    if rounds:
        raw["train"]["rounds"] = rounds
    raw["data"] = {"seq_len": 32}
    return from_dict(raw)


@pytest.fixture(scope="session")
def dataset(spark, tmp_path_factory):
    """A prepared dataset of mixed scripts (seq 32, BPE 300), shared by the training tests."""
    from sparklm.config import from_dict
    from sparklm.launch.prepare import prepare

    root = tmp_path_factory.mktemp("data")
    (root / "a.txt").write_text(make_text(400, seed=9))
    prep = from_dict({"data": {"seq_len": 32, "val_fraction": 0.1}, "tokenizer": {"vocab_size": 300},
                      "output": {"row_group_mb": 1}})
    return prepare([str(root / "a.txt")], output=str(root / "prepared"), config=prep, spark=spark).uri


def weights(run_dir):
    """The newest checkpoint's model tensors."""
    from safetensors.torch import load_file

    ckpt = sorted((run_dir / "checkpoints").glob("step-*"))[-1]
    return load_file(str(ckpt / "model.safetensors"))


# -- decoders: tiny random models of real families with their own tokenizers (no downloads) --------------------------


def tiny_tokenizer(texts: list[str], specials: list[str], bos: str | None):
    """A byte-level BPE (vocabulary 300) trained on ``texts`` with ``specials``; with ``bos``, it puts BOS first as
    Llama's does."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=300, special_tokens=specials, show_progress=False,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    if bos:
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, tok.token_to_id(bos))])
    return tok


def tiny_causal(directory, family: str, texts: list[str], *, layers: int = 2, hidden: int = 32, dtype: str = "float32",
                context: int = 64):
    """A tiny random causal LM of ``family`` (llama, qwen2, gemma: each family's own config and layers, grouped-query
    attention) saved as an HF directory (weights in ``dtype``) with a BPE tokenizer trained on ``texts``; returns its
    TokenizerSpec."""
    import torch
    import transformers

    from sparklm.data.tokenizer import from_tokenizer

    if family == "qwen2":  # Qwen's: no BOS, <|endoftext|> ends documents and pads (transformers' Qwen2 tokenizer)
        e = "<|endoftext|>"
        spec = from_tokenizer(tiny_tokenizer(texts, [e, "<|im_start|>", "<|im_end|>"], None), e, e, e)
    else:
        spec = from_tokenizer(tiny_tokenizer(texts, ["<s>", "</s>", "<pad>"], "<s>"), "<s>", "</s>", "<pad>")
    kinds = {"llama": ("LlamaConfig", "LlamaForCausalLM", {}),
             "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"tie_word_embeddings": True}),
             "gemma": ("GemmaConfig", "GemmaForCausalLM", {"head_dim": 8})}
    config_cls, model_cls, extra = kinds[family]
    torch.manual_seed(0)
    config = getattr(transformers, config_cls)(
        vocab_size=spec.vocab_size, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=context, bos_token_id=spec.bos_id,
        eos_token_id=spec.eos_id, pad_token_id=spec.pad_id, **extra)
    getattr(transformers, model_cls)(config).to(getattr(torch, dtype)).save_pretrained(directory)
    spec.save(directory)
    return spec


# -- encoders: tiny random models with their own tokenizers (no downloads) ------------------------------------

LABELS = {0: "negative", 1: "neutral", 2: "positive"}


def _wordpiece_vocab(words: Counter, specials: list[str], size: int) -> list[str]:
    """What ``tokenizers``' WordPiece trainer learns (pair merges by frequency, ``##`` for pieces inside a word), with
    ties broken by the pieces' text: the trainer breaks them by ids that follow a hash map's order, which changes from
    run to run, so a trained vocabulary, and what a test's model learns on it, varied."""
    split = {w: [w[0]] + [f"##{c}" for c in w[1:]] for w in sorted(words)}
    vocab = specials + sorted({p for pieces in split.values() for p in pieces})
    while len(vocab) < size:
        pairs = Counter()
        for w, pieces in split.items():
            for pair in zip(pieces, pieces[1:]):
                pairs[pair] += words[w]
        if not pairs:
            break
        a, b = min(pairs, key=lambda pair: (-pairs[pair], pair))
        merged = a + b[2:]
        for pieces in split.values():
            i = 0
            while i < len(pieces) - 1:
                if pieces[i] == a and pieces[i + 1] == b:
                    pieces[i:i + 2] = [merged]
                i += 1
        if merged not in vocab:
            vocab.append(merged)
    return vocab


def tiny_bert(directory, *, head: bool = True, seed: int = 0, corpus: str = "") -> str:
    """A 2-layer BERT (random weights, 3 labels with names) and a WordPiece tokenizer of 300 pieces learnt from random
    text (and ``corpus``), the same on every run (see ``_wordpiece_vocab``)."""
    import torch
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from transformers import BertConfig, BertForSequenceClassification, BertModel, PreTrainedTokenizerFast

    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    lines = make_text(60, seed=3).splitlines() + corpus.splitlines()
    words = Counter(w for line in lines for w, _ in tok.pre_tokenizer.pre_tokenize_str(tok.normalizer.normalize_str(line)))
    vocab = _wordpiece_vocab(words, ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"], size=300)
    tok.model = models.WordPiece({t: i for i, t in enumerate(vocab)}, unk_token="[UNK]")
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
                                                       special_tokens=[("[CLS]", cls), ("[SEP]", sep)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]",
                                   sep_token="[SEP]", mask_token="[MASK]", model_max_length=48)
    config = BertConfig(vocab_size=tok.get_vocab_size(), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=48, num_labels=3, id2label=LABELS,
                        label2id={v: k for k, v in LABELS.items()})
    torch.manual_seed(seed)
    model = (BertForSequenceClassification if head else BertModel)(config)
    model.save_pretrained(str(directory))
    fast.save_pretrained(str(directory))
    return str(directory)


def tiny_roberta(directory, *, corpus: str = "", seed: int = 0) -> str:
    """A 2-layer RoBERTa masked LM (random weights) and a byte-level BPE tokenizer with <s>/</s> framing."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast, RobertaConfig, RobertaForMaskedLM

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]
    tok.train_from_iterator(make_text(60, seed=4).splitlines() + corpus.splitlines(),
                            trainers.BpeTrainer(vocab_size=400, special_tokens=specials,
                                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.post_processor = processors.RobertaProcessing(("</s>", tok.token_to_id("</s>")), ("<s>", tok.token_to_id("<s>")))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   pad_token="<pad>", cls_token="<s>", sep_token="</s>", mask_token="<mask>",
                                   model_max_length=48)
    config = RobertaConfig(vocab_size=tok.get_vocab_size(), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                           intermediate_size=64, max_position_embeddings=48 + 2, type_vocab_size=1, pad_token_id=1,
                           bos_token_id=0, eos_token_id=2)
    torch.manual_seed(seed)
    RobertaForMaskedLM(config).save_pretrained(str(directory))
    fast.save_pretrained(str(directory))
    return str(directory)


CUES = {"pos": "good great happy lovely fine nice", "neg": "bad awful sad poor ugly grim",
        "mid": "maybe perhaps somewhat fairly rather average"}
FILLER = "the a cat dog house tree river road of and on".split()


def labelled_records(n: int, *, seed: int = 0, classes: tuple[str, ...] = ("neg", "pos"), pairs: bool = False,
                     words: tuple[int, int] = (4, 30)) -> list[dict]:
    """Separable toy records: filler words mixed with words that only their class uses (with pairs: the cue
    words are in the second text)."""
    import random

    rng = random.Random(seed)
    out = []
    for _ in range(n):
        label = rng.choice(classes)
        cues = CUES[label].split()
        text = " ".join(rng.choice(FILLER + cues) for _ in range(rng.randint(*words)))
        record = {"text": text, "label": label}
        if pairs:
            record = {"text": " ".join(rng.choice(FILLER) for _ in range(rng.randint(3, 8))), "second": text,
                      "label": label}
        out.append(record)
    return out


def toy_corpus() -> str:
    """Every word the toy records use, for the tiny tokenizers' training."""
    return " ".join(FILLER + " ".join(CUES.values()).split()) + "\n"



# -- benchmark tasks (lm-evaluation-harness): a tiny model and task files written here, never downloaded -----------

HARNESS_TASKS = ("toy_mc", "toy_roll", "toy_gen")


def harness_toy(root: Path) -> Path:
    """In ``root``: a tiny Llama (``model/``), three task YAML files (``tasks/``: a multiple-choice task scored with
    two shots, a rolling log-likelihood task and a greedy ``generate_until`` task) over JSON Lines written beside them,
    and ARC-Easy's splits in the Hub's layout (``ai2_arc/ARC-Easy/*.jsonl``) for the harness's own ``arc_easy``."""
    import random

    # a context of 128: the two-shot prompts are cut from the left, the longest page takes several windows
    tiny_causal(root / "model", "llama", [make_text(20, seed=i) for i in range(3)] + MULTILINGUAL, context=128)
    rng = random.Random(0)
    words = make_text(30).split() + "über naïve café 東京 Москва".split()

    def words_of(n):
        return " ".join(rng.choice(words) for _ in range(n))

    data, tasks = root / "data", root / "tasks"
    data.mkdir(parents=True)
    tasks.mkdir()

    def jsonl(path: Path, rows: list[dict]) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))

    jsonl(data / "mc.jsonl", [{"question": words_of(rng.randint(3, 9)),
                               "choices": [words_of(rng.randint(1, 3)) for _ in range(4)], "label": i % 4}
                              for i in range(16)])
    jsonl(data / "pages.jsonl", [{"page": words_of(20 + 15 * i)} for i in range(6)])  # the longest: several windows
    jsonl(data / "qa.jsonl", [{"q": words_of(rng.randint(3, 8)), "a": words_of(1)} for _ in range(10)])
    common = "\nmetric_list:\n{}\n"
    metric = "  - metric: {}\n    aggregation: {}\n    higher_is_better: {}"
    (tasks / "mc.yaml").write_text(
        f"task: toy_mc\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data / 'mc.jsonl'}\n"
        f"    train: {data / 'mc.jsonl'}\ntest_split: test\nfewshot_split: train\nnum_fewshot: 2\n"
        "output_type: multiple_choice\ndoc_to_text: \"Question: {{question}}\\nAnswer:\"\ndoc_to_target: label\n"
        "doc_to_choice: \"{{choices}}\"" + common.format("\n".join(
            metric.format(m, "mean", "true") for m in ("acc", "acc_norm"))))
    (tasks / "roll.yaml").write_text(
        f"task: toy_roll\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data / 'pages.jsonl'}\n"
        "test_split: test\noutput_type: loglikelihood_rolling\ndoc_to_text: \"\"\ndoc_to_target: \"{{page}}\""
        + common.format("\n".join([metric.format("word_perplexity", "weighted_perplexity", "false"),
                                   metric.format("byte_perplexity", "weighted_perplexity", "false"),
                                   metric.format("bits_per_byte", "bits_per_byte", "false")])))
    (tasks / "gen.yaml").write_text(
        f"task: toy_gen\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data / 'qa.jsonl'}\n"
        "test_split: test\noutput_type: generate_until\ndoc_to_text: \"Q: {{q}}\\nA:\"\ndoc_to_target: \"{{a}}\"\n"
        "generation_kwargs:\n  until: [\"\\n\", \".\"]\n  max_gen_toks: 12\n  do_sample: false"
        + common.format(metric.format("exact_match", "mean", "true")))
    labels = ["A", "B", "C", "D"]
    for split, n in (("train", 6), ("validation", 4), ("test", 12)):
        jsonl(root / "ai2_arc" / "ARC-Easy" / f"{split}.jsonl", [
            {"id": f"{split}-{i}", "question": words_of(6), "answerKey": labels[i % 4],
             "choices": {"text": [words_of(2) for _ in labels], "label": labels}} for i in range(n)])
    return root


def harness_reference(root: Path, tasks: list[str], *, batch_size: int = 4, model: Path | None = None,
                      **kwargs) -> dict:
    """lm-evaluation-harness's own ``simple_evaluate`` with its HF backend on ``harness_toy(root)``'s model (or
    ``model``; its results, samples logged): the figures sparklm must reproduce. ``arc_easy`` reads the local ARC
    files."""
    from lm_eval import simple_evaluate

    from sparklm.infer.harness import LocalData, offline, serving, task_manager, task_specs

    offline()
    # the harness's TaskManager over the same files; the instance sparklm keeps for them (indexing the harness's own
    # tasks takes seconds), which only indexes: the tasks are built from it anew by simple_evaluate
    manager, _ = task_manager(task_specs([str(root / "tasks"), *(["arc_easy"] if "arc_easy" in tasks else [])]))
    with serving(LocalData([f"allenai/ai2_arc={root / 'ai2_arc'}"])):
        return simple_evaluate(model="hf", model_args={"pretrained": str(model or root / "model"), "dtype": "float32",
                                                       "device": "cpu"}, tasks=tasks, batch_size=batch_size,
                               task_manager=manager, log_samples=True, **kwargs)


def assert_same_figures(ours: dict, theirs: dict) -> None:
    """Every metric of every task equal to 4 decimals (perplexities, exponentials of sums, to 4 significant
    decimals: 1e-4 relative), and every generated text the same."""
    import math

    assert ours["results"].keys() == theirs["results"].keys()
    for task, figures in theirs["results"].items():
        for key, value in figures.items():
            if not isinstance(value, float):
                assert ours["results"][task][key] == value, (task, key)
            elif "perplexity" in key:
                assert math.isclose(ours["results"][task][key], value, rel_tol=1e-4), (task, key)
            else:
                assert round(ours["results"][task][key], 4) == round(value, 4), (task, key)
    for task, samples in theirs.get("samples", {}).items():
        if task == "toy_gen":
            assert [s["resps"] for s in ours["samples"][task]] == [s["resps"] for s in samples]
