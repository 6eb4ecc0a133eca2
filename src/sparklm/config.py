"""Typed configuration: one dataclass per section, loaded from TOML and ``--set`` overrides.

Every field has a type, a default and (where it matters) a range; unknown keys, wrong types and
out-of-range values are rejected with a message that names the key and what is allowed. The
resolved configuration is saved as JSON beside every output (:meth:`Config.to_dict`).
"""

from __future__ import annotations

import codecs
import dataclasses
import difflib
import json
import math
import os
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from .infra.errors import SparklmError
from .registry import DEFAULT_TASK, STRATEGY_NAMES, TASKS


def _f(default: Any, help: str, *, flag: str = "", **limits: Any) -> Any:
    """A config field with a help text, optional ``min``/``max`` limits and an optional command-line ``flag``
    (the CLI generates its flags from this metadata: no second list of names)."""
    meta = {"help": help, "flag": flag, **limits}
    if isinstance(default, (dict, list)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


def _section(cls: type, help: str) -> Any:
    """A nested section (a table inside a table, e.g. ``[train.rounds]``)."""
    return field(default_factory=cls, metadata={"help": help, "flag": ""})


@dataclass(kw_only=True)
class DataConfig:
    """How raw text becomes documents, and documents become training sequences."""

    task: str = _f(
        DEFAULT_TASK, "what the dataset is for, a task's name (model.task lists them): causal-lm packs token streams; "
                     "an encoder's task writes one record (a labelled text or text pair, or a document) per row and "
                     "needs --tokenizer: the encoder's, with its CLS/SEP conventions",
        choices=tuple(TASKS))
    text_field: str = _f("text", "column/field holding the text in JSONL, CSV and Parquet inputs", flag="--text-field")
    label_field: str = _f("label", "classify: the column/field holding each record's label", flag="--label-field")
    pair_field: str = _f("", "classify: a second text column/field, for sentence-pair tasks (empty: single texts)",
                         flag="--pair-field")
    long: Literal["auto", "truncate", "window"] = _f(
        "auto", "classify and mlm: a text longer than seq_len is truncated, or cut into windows (each a row with the "
                "record's label; data.stride apart, 0: disjoint); auto: truncate for classify, window for mlm",
        flag="--long")
    format: Literal["text", "instruction", "chat"] = _f(
        "text", "what the records hold: text (every token trains), instruction (a prompt and a response field) or "
                "chat (a messages field: a list of {role, content}); the loss counts response/assistant tokens only",
        flag="--format",
    )
    prompt_field: str = _f("prompt", "field/column holding the prompt of instruction records; several, "
                                     "comma-separated, are joined by a blank line where not empty (Alpaca's: "
                                     "instruction,input)",
                           flag="--prompt-field")
    response_field: str = _f("response", "field/column holding the response of instruction records", flag="--response-field")
    messages_field: str = _f("messages", "field/column holding the list of {role, content} messages of chat records "
                                         "(a JSON string in CSV)", flag="--messages-field")
    chat_template: bool = _f(True, "instruction records are rendered as a user turn and an assistant turn with the "
                                   "tokenizer's chat template when it has one; false: prompt and response are joined "
                                   "as they are (chat records always need the template)", flag="--no-chat-template")
    doc_mode: Literal["file", "paragraph", "line"] = _f(
        "paragraph", "how plain-text files split into documents: whole file, blank-line paragraphs, or lines", flag="--doc-mode",
    )
    encoding: str = _f("utf-8", "text encoding of the inputs; bytes invalid in it are replaced and counted", flag="--encoding")
    csv_delimiter: str = _f("", "the character between the fields of CSV files (e.g. ';'); empty: ',' for .csv and a "
                                "tab for .tsv", flag="--csv-delimiter")
    normalize: Literal["NFC", "NFKC", "none"] = _f("NFC", "Unicode normalisation form")
    min_chars: int = _f(1, "documents shorter than this (after cleaning) are dropped as too short", min=1, flag="--min-chars")
    dedup: bool = _f(True, "drop exact duplicate documents (by content hash)", flag="--no-dedup")
    val_fraction: float = _f(0.05, "fraction of documents assigned to validation by hash", min=0.0, max=0.9, flag="--val-fraction")
    seq_len: int = _f(256, "tokens per packed sequence (inputs; targets are the inputs shifted by one)", min=2, flag="--seq-len")
    stride: int = _f(0, "tokens between the starts of consecutive windows; 0 means seq_len (disjoint)", min=0, flag="--stride")
    concat: bool = _f(True, "concatenate documents (separated by EOS); false: one document per sequence, padded", flag="--no-concat")
    last_block: Literal["auto", "drop", "pad"] = _f(
        "auto", "the last partial block of a stream: drop, pad, or auto (drop when concat, else pad)", flag="--last-block",
    )
    split_mb: int = _f(64, "plain-text and JSONL files larger than this are read in parallel chunks", min=1)
    engine: Literal["spark", "beam"] = _f(
        "spark", "what runs prepare's passes: spark, or an Apache Beam pipeline on beam.runner (pip install "
        "'sparklm[beam]')", flag="--engine")
    read_tasks: int = _f(0, "read tasks per pass; each packs its documents into its own part files, so the same "
                            "number gives the same rows on any engine or cluster; 0: 4 per core the engine has", min=0)

    def __post_init__(self):
        try:  # an unknown codec would fail first inside every read task; base64 and the like decode bytes to bytes
            text = getattr(codecs.lookup(self.encoding), "_is_text_encoding", True)
        except LookupError:
            text = False
        if not text:
            raise SparklmError(f"data.encoding {self.encoding!r} is not a text encoding Python knows",
                               hint="use a name from Python's codecs, e.g. utf-8, latin-1, cp1252, utf-16")
        if len(self.csv_delimiter) > 1 or self.csv_delimiter in ('"', "\n", "\r"):
            raise SparklmError(f"data.csv_delimiter {self.csv_delimiter!r} must be one character (not a quote or a "
                               "line break)", hint="e.g. ';' or '|'; a tab: name the file .tsv, or pass $'\\t'")


@dataclass(kw_only=True)
class TokenizerConfig:
    """Train a byte-level BPE tokenizer, or load one."""

    path: str = _f("", "an existing tokenizer: a tokenizer.json, an HF tokenizer or model directory (the model's "
                       "tokenizer and its BOS/EOS convention), or a .gguf model; empty: train one", flag="--tokenizer")
    vocab_size: int = _f(8192, "vocabulary size of a trained tokenizer", min=260, max=1_000_000, flag="--vocab-size")
    min_frequency: int = _f(2, "minimum pair frequency for a BPE merge", min=1)
    sample_mb: int = _f(16, "megabytes of training text sampled to train the tokenizer", min=1)
    bos_token: str = _f("<|bos|>", "beginning-of-document token of a trained tokenizer")
    eos_token: str = _f("<|eos|>", "end-of-document token of a trained tokenizer")
    pad_token: str = _f("<|pad|>", "padding token of a trained tokenizer")
    allocator: str = _f("auto", "the malloc prepare tokenizes on (Linux): auto (mimalloc, else jemalloc, where a local "
                                "master's host has one: tokenizing ~1.3x faster), system (the C library's), or a "
                                "library the executors have (e.g. libmimalloc.so.2)")


@dataclass(kw_only=True)
class SparkConfig:
    """Where and how Spark runs."""

    master: str = _f("", "Spark master URL: local[*], spark://host:7077, yarn, k8s://... (empty: spark-submit's "
                         "--master or spark-defaults.conf's, else local[*])", flag="--master")
    app_name: str = _f("", "Spark application name (empty: spark-submit's --name, else sparklm)")
    conf: dict[str, str] = _f({}, "extra Spark configuration (key = value)")
    ui: bool = _f(True, "start the Spark web UI")
    log_level: Literal["ERROR", "WARN", "INFO", "DEBUG"] = _f("ERROR", "Spark log level")
    ship_env: Literal["auto", "on", "off"] = _f(
        "auto", "send this Python environment to the executors (an archive in spark.files): auto does so on a "
                "cluster whose executors cannot import sparklm; off for images that have the packages")
    class_cache: bool = _f(True, "share the driver JVM's loaded classes across runs (a ~120 MB archive in "
                                 "~/.cache/sparklm/jvm): Spark starts ~3 s faster from the second run")


@dataclass(kw_only=True)
class BeamConfig:
    """``prepare --engine beam``: the Apache Beam pipeline that runs prepare's passes."""

    runner: Literal["DirectRunner", "PrismRunner", "DataflowRunner", "FlinkRunner"] = _f(
        "DirectRunner", "the Beam runner (DirectRunner runs here, one process per core)", flag="--runner")
    options: dict[str, str] = _f({}, "pipeline options as Beam's --key=value flags (project, region, temp_location, "
                                     "flink_master, direct_num_workers, ...; --pipeline-option KEY=VALUE)")


@dataclass(kw_only=True)
class StorageConfig:
    """Object storage (s3://) reached from Python on the executors."""

    endpoint_url: str = _f("", "S3 endpoint (empty: AWS_ENDPOINT_URL or AWS's default)", flag="--endpoint-url")
    region: str = _f("", "S3 region (empty: AWS_REGION / AWS_DEFAULT_REGION or us-east-1)")
    anonymous: bool = _f(False, "access public buckets without credentials")


@dataclass(kw_only=True)
class OutputConfig:
    """How prepared Parquet is laid out."""

    file_mb: int = _f(128, "target size of one Parquet file (sets how many write tasks run)", min=1)
    row_group_mb: int = _f(4, "target size of one Parquet row group (the unit of streaming)", min=1)


@dataclass(kw_only=True)
class ModelConfig:
    """The decoder-only transformer (built with transformers)."""

    task: str = _f(DEFAULT_TASK, "what is trained; " + "; ".join(f"{n}: {help}" for n, (_, help) in TASKS.items()),
                   choices=tuple(TASKS), flag="--task")
    arch: Literal["llama", "gpt2"] = _f("llama", "llama: RMSNorm, RoPE, SwiGLU; gpt2: LayerNorm, learned positions, GELU")
    n_layer: int = _f(4, "transformer blocks", min=1)
    n_head: int = _f(4, "attention heads", min=1)
    n_embd: int = _f(256, "model width (must divide by n_head)", min=8)
    intermediate: int = _f(0, "MLP hidden size; 0: 8/3·n_embd rounded to 64 (llama) or 4·n_embd (gpt2)", min=0)
    dropout: float = _f(0.0, "dropout probability", min=0.0, max=0.9)
    tie_embeddings: bool = _f(False, "share the input embedding and the LM head (untied measured better: BENCHMARKS.md)")
    rope_theta: float = _f(10000.0, "RoPE base (llama)", min=1.0)
    qk_norm: bool = _f(True, "RMSNorm on each head's queries and keys (llama; the model is saved as a Qwen3 "
                             "architecture, which is Llama with that norm)")
    fit_budget: bool = _f(True, "with a time budget (local mode): this shape, else half its width, else half its "
                                "layers too: the first that the budget trains on >= 0.45 tokens per non-embedding "
                                "parameter at this machine's measured speed (BENCHMARKS.md), written to the run's "
                                "config.json. false: exactly n_layer x n_embd")
    labels: list = _f([], "classify: the class names in id order (set by train from the dataset's manifest)")
    mlm_probability: float = _f(0.15, "mlm: the share of real tokens chosen to recover (80% masked, 10% random, "
                                       "10% kept)", min=0.01, max=0.9)
    whole_word_mask: bool = _f(False, "mlm: choose whole words (all their tokens together) instead of single tokens",
                               flag="--whole-word-mask")
    init_from: str = _f("", "start from a pretrained model instead of a fresh one: an HF causal-LM directory (local or "
                            "on an object store; safetensors weights), a sparklm run, or a .gguf file (converted once "
                            "into sparklm's cache)", flag="--init-from")

    def __post_init__(self):
        # checked here, on the driver, before Spark starts (not first inside a rank)
        if not self.init_from and self.n_embd % self.n_head:
            raise SparklmError(f"model.n_embd ({self.n_embd}) must be divisible by model.n_head ({self.n_head})",
                               hint="each head gets n_embd / n_head dimensions")
        if not self.init_from and self.arch == "llama" and (self.n_embd // self.n_head) % 2:
            raise SparklmError(f"each head gets n_embd / n_head = {self.n_embd // self.n_head} dimensions, and "
                               "RoPE (model.arch llama) rotates them in pairs: it needs an even number",
                               hint="change model.n_head or model.n_embd, or use model.arch gpt2")

    @property
    def mlp_hidden(self) -> int:
        """The MLP's hidden size: ``intermediate``, else Llama's rule (8/3 of the width, rounded up to a multiple
        of 64: 256 -> 704) or GPT-2's (4 times the width)."""
        if self.intermediate:
            return self.intermediate
        return 64 * ((int(8 * self.n_embd / 3) + 63) // 64) if self.arch == "llama" else 4 * self.n_embd


@dataclass(kw_only=True)
class TrackingConfig:
    """Where a run's figures go besides metrics.csv: experiment trackers, each a metrics sink."""

    tensorboard: bool = _f(False, "write TensorBoard event files under RUN_DIR/tensorboard/ (tensorboard --logdir "
                                  "runs/ shows every run; needs the tensorboard package: sparklm[tensorboard])",
                           flag="--tensorboard")
    mlflow_uri: str = _f("", "log the run to MLflow at this tracking URI (http://host:5000, databricks, a local "
                             "path...); --mlflow alone: MLFLOW_TRACKING_URI or MLflow's default (sparklm[mlflow])",
                         flag="--mlflow", const="default")
    mlflow_experiment: str = _f("sparklm", "the MLflow experiment the runs go to (created if missing)",
                                flag="--mlflow-experiment")
    mlflow_register: str = _f("", "also register the logged model under this name in MLflow's model registry",
                              flag="--mlflow-register")
    wandb_project: str = _f("", "log the run to this Weights & Biases project (WANDB_MODE=offline: to local files, "
                                "synced later with `wandb sync`; sparklm[wandb])", flag="--wandb")
    log_model: bool = _f(True, "log the trained model to MLflow (transformers flavor) and W&B (an artifact)")


@dataclass(kw_only=True)
class LoraConfig:
    """LoRA (peft): train low-rank adapters of a frozen pretrained model (``--init-from``)."""

    r: int = _f(0, "adapter rank; 0: no LoRA, every weight trains", min=0, flag="--lora-r")
    alpha: float = _f(16.0, "adapter scale numerator (the update is scaled by alpha / r)", min=0.0, flag="--lora-alpha")
    dropout: float = _f(0.0, "dropout on the adapters' input", min=0.0, max=0.9)
    targets: str = _f("all-linear", "comma-separated module names to adapt (e.g. q_proj,v_proj); all-linear: every "
                                    "linear layer of the blocks (attention and MLP, any architecture), not the LM head",
                      flag="--lora-targets")
    base_dtype: Literal["auto", "float32", "bfloat16", "nf4"] = _f(
        "auto", "dtype of the frozen base weights; bfloat16 halves their memory (adapters and optimizer state stay "
                "float32); nf4 holds the base's linear weights in 4 bits (QLoRA, torchao's NF4 tensor), quantized "
                "tensor by tensor as they are read; auto: bfloat16 where training computes in bfloat16 "
                "(train.dtype), else float32", flag="--lora-base-dtype")


@dataclass(kw_only=True)
class DdpConfig:
    """Strategy ``ddp``: synchronous data parallelism on Spark barrier tasks (``[train.ddp]``)."""

    collective_timeout: float = _f(300.0, "seconds a collective (all-reduce, barrier) may wait for the other ranks "
                                          "before the run fails naming the rank and host", min=10.0)
    max_restarts: int = _f(2, "times the ranks restart from the last checkpoint after a rank is lost (a crash, "
                              "an out-of-memory kill, a lost executor)", min=0)


@dataclass(kw_only=True)
class RoundsConfig:
    """Strategies ``average`` and ``diloco``: rounds of plain Spark tasks (``[train.rounds]``)."""

    sync_every: int = _f(32, "inner steps each worker runs between synchronisations (H); for diloco with the default "
                             "codec, 32 measured within 2% of DDP on both corpora, 64 not (BENCHMARKS.md)",
                         min=1, flag="--sync-every")
    outer_lr: float = _f(0.7, "diloco: outer learning rate (average uses 1.0)", min=0.0)
    outer_momentum: float = _f(0.5, "diloco: outer Nesterov momentum (average uses none); the paper's 0.9 carries "
                                    "early, large deltas into the last rounds of runs of a few dozen rounds: 0.5 "
                                    "measured better (BENCHMARKS.md)", min=0.0, max=0.999)
    codec: Literal["auto", "fp32", "bf16", "int8", "int4", "int2", "topk"] = _f(
        "auto", "what a round sends: auto (diloco: int4, chosen by measurement in BENCHMARKS.md; average: fp32, the "
                "workers' exact average), fp32 (lossless), bf16, int8/int4/int2 (per-block scales; int2: -1, 0, +1), "
                "topk (each chunk's largest values, quantized to rounds.bits); a lossy codec keeps what it drops "
                "per worker (error feedback) and adds it to the next round's delta", flag="--codec")
    downlink: Literal["auto", "codec", "exact", "forward"] = _f(
        "auto", "a lossy codec: what the driver sends the workers after its outer step: codec (the step encoded with "
                "the same codec, the driver keeping what it did not send for the next step; every worker applies "
                "exactly what the driver applies), exact (the weights that changed, in float32, or the whole weights "
                "when that is smaller), forward (topk: each worker is sent the other workers' payloads, as SparseLoCo's "
                "all-gather, and every side takes the same plain SGD step from them; needs outer_momentum 0), or auto: "
                "codec for "
                "int8/int4/int2/bf16, exact for topk (BENCHMARKS.md)")
    average_over: Literal["senders", "all"] = _f(
        "all", "topk: each value of the workers' average divided by all the workers' weights (a value one worker of R "
               "sent moves 1/R as far; each worker's residual sends its share later), or only by those that sent it "
               "(senders); all measured 0.8-1.4 points closer to dense DiLoCo on a corpus not repeated (BENCHMARKS.md)")
    density: float = _f(0.015625, "topk: the share of each 64×64 tile of a matrix a worker sends (1/64: 64 values)",
                        min=0.0001, max=1.0)
    bits: int = _f(3, "topk: bits per value sent (its sign and a magnitude bin of the tensor's codebook; 1-8; 32: "
                      "float32); 3 (four bins) measured closer to dense DiLoCo than 2 at 1/64 (BENCHMARKS.md)",
                   min=1, max=32)
    residual_decay: float = _f(1.0, "error feedback: the share of a worker's unsent remainder carried into its next "
                                    "delta (1: all; SparseLoCo decays it, e.g. 0.95, and takes no outer momentum)",
                               min=0.0, max=1.0)
    inner_state: Literal["keep", "reset"] = _f(
        "keep", "average/diloco: a worker's optimizer state across rounds: keep (on the executor's disk, per worker, "
                "and in the run directory when that is on an object store) or reset every round"
    )


def embedding_rows(vocab: int) -> int:
    """Rows of a fresh model's embedding table for a tokenizer of ``vocab`` tokens: rounded up to a multiple of 64
    (faster matmuls; the extra rows are never targets)."""
    return 64 * -(-vocab // 64)


# train.loss_chunk 0: about this many bytes of float32 logits per chunk, a power of two in [32, 4096] positions
# (SmolLM2: 512 positions, 100 MB; on CPU chunks of 512 ran faster than 256 and than one chunk). Here, not in
# model.lm_head, because the driver's memory plan needs it before Spark starts, without importing torch (~1 s).
CHUNK_BYTES = 128 << 20


def chunk_size(vocab: int, chunk: int = 0) -> int:
    """Positions per chunk of the LM-head loss: ``chunk`` when set, else about ``CHUNK_BYTES`` of float32 logits."""
    if chunk > 0:
        return chunk
    n = max(1, CHUNK_BYTES // (4 * vocab))
    return min(4096, max(32, 1 << (n.bit_length() - 1)))


@dataclass(kw_only=True)
class TrainConfig:
    """The training loop and its distribution."""

    workers: int = _f(1, "Spark tasks training at once (DDP ranks, or the tasks of a round); --workers MIN:MAX sets "
                         "workers_min too", min=1, flag="--workers")
    workers_min: int = _f(0, "elastic: the fewest workers the run goes on with (0: exactly train.workers). DDP starts "
                             "and restarts on the slots there are, between the two, keeping the global batch by "
                             "changing the micro-batch and accumulation", min=0)
    threads: int = _f(0, "torch threads per worker; 0: the machine's cores divided by workers (local mode), "
                         "spark.task.cpus on a cluster", min=0, flag="--threads")
    strategy: str = _f(
        "ddp", "ddp: synchronous data parallelism on Spark barrier tasks; average: rounds of plain tasks whose "
               "weights are averaged every sync_every steps; diloco: the same rounds with an outer Nesterov step",
        flag="--strategy", choices=STRATEGY_NAMES)
    parallel: Literal["auto", "replicate", "shard"] = _f(
        "auto", "ddp: replicate (every rank holds the whole model, its gradients and optimizer state) or shard (FSDP2: "
                "each rank holds 1/N of them, gathering a block's weights while it computes); auto: replicate where "
                "a replica fits each rank's memory with the planned micro-batch, shard where only a shard fits. "
                "Decided on the driver by the memory plan (config.json)", flag="--parallel")
    batch_size: int = _f(8, "sequences per micro-batch per worker", min=1)
    grad_accum: int = _f(1, "micro-batches per optimizer step", min=1)
    optimizer: Literal["auto", "adamw", "muon"] = _f(
        "auto", "muon: torch.optim.Muon for the hidden weight matrices (attention, MLP) and AdamW for embeddings, "
                "head and norms; adamw: AdamW for all; auto: muon where bf16 matmuls measure fast (torch's Muon "
                "orthogonalises in bf16), else adamw", flag="--optimizer")
    lr: float = _f(0.0, "peak learning rate; 0: auto, by what trains — 3e-3 for a model trained from scratch, 1e-3 for "
                        "LoRA adapters, 5e-5 for every weight of a pretrained model (--init-from)", min=0.0, flag="--lr")
    min_lr_ratio: float = _f(0.1, "final learning rate as a fraction of the peak (cosine floor)", min=0.0, max=1.0)
    warmup_steps: int = _f(5, "linear warmup steps (5 measured as good as 20 on the main job, better for short runs)", min=0)
    weight_decay: float = _f(0.1, "AdamW weight decay on matrices (not on norms, biases, embeddings)", min=0.0)
    beta1: float = _f(0.9, "AdamW beta1", min=0.0, max=1.0)
    beta2: float = _f(0.95, "AdamW beta2", min=0.0, max=1.0)
    grad_clip: float = _f(1.0, "clip the global gradient norm to this; 0: off", min=0.0)
    max_steps: int = _f(0, "optimizer steps; 0: from epochs / max_tokens / time_budget", min=0, flag="--max-steps")
    epochs: float = _f(0.0, "passes over the training tokens (0: unset)", min=0.0, flag="--epochs")
    max_tokens: int = _f(0, "training tokens (0: unset)", min=0, flag="--max-tokens")
    time_budget: float = _f(0.0, "seconds of training (0: unset); the schedule follows elapsed time", min=0.0, flag="--time-budget")
    device: Literal["auto", "cpu", "cuda"] = _f(
        "auto", "where workers compute; auto: cuda where Spark hands the tasks GPUs (spark.task.resource.gpu.amount) "
                "or, in local mode, where this machine has one; else cpu. Decided once, on the driver",
        flag="--device")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = _f(
        "auto", "autocast dtype; auto: on the CPU bfloat16 where bf16 matmuls measure >1.3x faster than fp32, else "
                "float32; on CUDA bfloat16 (float16, with a gradient scaler, for GPUs without bf16: V100, T4)"
    )
    compile: Literal["auto", "on", "off"] = _f(
        "auto", "torch.compile the model's blocks (each transformer layer; the chunked loss stays) from the second "
                "step on (the first runs eager); auto: on where it was measured to pay, a causal LM trained from "
                "scratch with ddp for a time budget of at least 6 minutes, in bfloat16 on the CPU (with a C++ "
                "compiler for Inductor) or bfloat16/float16 on a GPU (the main job: 1.13x the tokens/s, for 24 s of "
                "compiling, ~3 s from Inductor's cache); else off. true/false read as on/off", flag="--compile")
    attention: Literal["auto", "sdpa", "matmul"] = _f(
        "auto", "the attention's kernel: sdpa (torch's scaled_dot_product_attention), or matmul (sparklm's causal "
                "attention for short sequences on the CPU: batched matmuls a few heads at a time, the probabilities "
                "kept for the backward pass; falls back to sdpa where a batch has padding); auto: matmul where it "
                "was measured faster, a causal LM on the CPU in bfloat16 with sequences of at most 512 tokens (its "
                "backward ~2.5x SDPA's at 256); else sdpa")
    grad_checkpoint: Literal["auto", "on", "off"] = _f(
        "auto", "gradient checkpointing: recompute each block's activations in the backward pass (a fraction of the "
                "activation memory, ~30% more compute); auto: only when the memory plan finds nothing that fits without",
        flag="--grad-checkpoint")
    allocator: Literal["auto", "keep", "return", "trim"] = _f(
        "auto", "glibc's handling of freed memory in training processes: keep (reuse it, no page faults: fastest), "
                "return (hand it back to the OS: half the peak resident memory of a LoRA run, measured ~2x slower "
                "steps), trim (keep it within a step, hand the heap's free pages back after each: a sharded rank's "
                "or a 4-bit base's memory stays flat); auto: return where the memory plan had to shrink the "
                "micro-batch to fit a limit, trim for a sharded run or a 4-bit base, else keep")
    memory_limit: str = _f("", "each rank's memory limit, e.g. 2g or 1536m; the micro-batch (and checkpointing) is "
                               "planned to fit it, keeping batch_size x grad_accum. Empty: from Spark — "
                               "spark.executor.pyspark.memory, else on YARN/Kubernetes the executor container, in "
                               "local mode this host's available memory; none: no plan", flag="--memory-limit")
    loss_chunk: int = _f(0, "positions per chunk of the LM-head loss, so that the logits of a whole micro-batch never "
                            "exist at once (same loss and gradients); 0: chunks of ~128 MB of float32 logits where "
                            "the memory plan needs them or no memory limit is known; -1: off (the model's own "
                            "logits and loss)", min=-1)
    seed: int = _f(1337, "seed of weights, data order and dropout")
    eval_every: int = _f(100, "evaluate every N steps (and at the end); 0: only at the end", min=0, flag="--eval-every")
    eval_batches: int = _f(20, "validation micro-batches per evaluation per worker; 0: the whole split", min=0)
    keep_best: bool = _f(True, "export the weights of the evaluation with the lowest validation loss as model/ (the "
                               "final weights go to model-final/ when they differ); false: model/ holds the final "
                               "weights and no copy is kept in memory")
    early_stop: int = _f(0, "stop after this many evaluations in a row without a lower validation loss; 0: never "
                            "(sparklm run uses 3 unless set)", min=0, flag="--early-stop")
    eval_tasks: list = _f([], "lm-evaluation-harness tasks (names, task YAML files or directories) scored on the "
                              "exported model when the run ends, as `sparklm eval --tasks` scores them: eval_tasks.json, "
                              "eval_tasks.csv, the report and the trackers (pip install 'sparklm[eval]')",
                          flag="--eval-tasks")
    eval_tasks_limit: float = _f(0.0, "documents per task of eval_tasks (a fraction below 1: that share); 0: all",
                                 min=0, flag="--eval-tasks-limit")
    eval_tasks_fewshot: int = _f(-1, "few-shot examples per prompt of eval_tasks; -1: each task's own", min=-1)
    eval_tasks_data: list = _f([], "where eval_tasks' datasets are on this machine, as `sparklm eval --task-data` "
                                   "takes them ([DATASET=]DIR; nothing is downloaded)")
    checkpoint_every: int = _f(200, "checkpoint every N steps (and at the end); 0: only at the end", min=0, flag="--checkpoint-every")
    keep_checkpoints: int = _f(2, "how many recent checkpoints to keep", min=1)
    log_every: int = _f(10, "print and record a metrics row every N steps", min=1)
    window_row_groups: int = _f(8, "row groups shuffled together (the shuffle buffer, in row groups)", min=1)
    samples: int = _f(3, "temperature-sampled continuations written to samples.txt", min=0)
    sample_tokens: int = _f(80, "tokens per sample", min=1)
    ddp: DdpConfig = _section(DdpConfig, "settings of the strategy ddp")
    rounds: RoundsConfig = _section(RoundsConfig, "settings of the strategies average and diloco")


SECTIONS: dict[str, type] = {
    "data": DataConfig,
    "tokenizer": TokenizerConfig,
    "spark": SparkConfig,
    "beam": BeamConfig,
    "storage": StorageConfig,
    "output": OutputConfig,
    "model": ModelConfig,
    "lora": LoraConfig,
    "train": TrainConfig,
    "tracking": TrackingConfig,
}


@dataclass(kw_only=True)
class Config:
    """The whole configuration of a sparklm job."""

    data: DataConfig = field(default_factory=DataConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    spark: SparkConfig = field(default_factory=SparkConfig)
    beam: BeamConfig = field(default_factory=BeamConfig)
    storage: StorageConfig = field(default_factory=StorageConfig)
    output: OutputConfig = field(default_factory=OutputConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_saved(self) -> dict[str, Any]:
        """:meth:`to_dict` for files: values of secret-looking keys (e.g. an S3 secret in spark.conf) masked."""
        from .infra.redact import mapping

        return mapping(self.to_dict())

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    def replace(self, **sections: Any) -> Config:
        return dataclasses.replace(self, **sections)


def expand(value: str, where: str) -> str:
    """``value`` with an ``${env:NAME}`` reference (how a secret is given without writing it anywhere) replaced by that
    environment variable, read here, where it is used, and remembered as a secret; any other value as it is."""
    from .infra import redact

    m = redact.ENV_REF.match(value) if isinstance(value, str) else None
    if not m:
        return value
    if m.group(1) not in os.environ:
        raise SparklmError(f"{where} is {value}, and the environment variable {m.group(1)} is not set",
                           hint=f"export {m.group(1)} before running sparklm")
    redact.remember(os.environ[m.group(1)])
    return os.environ[m.group(1)]


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = (),
                flags: dict[str, Any] | None = None) -> Config:
    """Load a TOML file (optional), apply ``section.key=value`` overrides, then flag values, and validate."""
    return from_dict(load_raw(path, overrides, flags))


def load_raw(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = (),
             flags: dict[str, Any] | None = None) -> dict[str, Any]:
    """What the user set, as nested plain data: the TOML file, then ``--set`` overrides, then flags
    (``{"train.workers": 2}``; flags win). Keys are checked here; values by :func:`from_dict`."""
    raw: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise SparklmError(f"config file not found: {p}", hint="pass an existing TOML file to --config")
        try:
            raw = tomllib.loads(p.read_text(encoding="utf-8"))
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
            raise SparklmError(f"config file {p} is not valid TOML: {e}") from None
    for item in overrides:
        _apply_override(raw, item)
    for key, value in (flags or {}).items():
        _apply_override(raw, key, value)
    return raw


def from_dict(raw: dict[str, Any]) -> Config:
    """Build a validated :class:`Config` from nested plain data (as read from TOML or JSON)."""
    if not isinstance(raw, dict):
        raise SparklmError("config must be a table of sections")
    return _build(Config, raw, "")


def merge(base: Config, changes: dict[str, Any]) -> Config:
    """``base`` with the nested ``changes`` applied on top (validated)."""
    return from_dict(_deep_merge(base.to_dict(), changes))


def diff(config: Config, base: Config | None = None) -> dict[str, Any]:
    """The settings where ``config`` differs from ``base`` (default: the defaults), as nested plain data."""
    return _diff(config.to_dict(), (base or Config()).to_dict())


def flatten(raw: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"train": {"lr": 1}}`` → ``{"train.lr": 1}`` (dict-valued fields such as spark.conf stay whole)."""
    out: dict[str, Any] = {}
    for key, value in raw.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and _is_section(name):
            out.update(flatten(value, f"{name}."))
        else:
            out[name] = value
    return out


def fields_with_flags() -> list[tuple[str, dataclasses.Field, Any]]:
    """(dotted key, field, type) of every setting that has a command-line flag."""
    return [(key, f, tp) for key, f, tp in _leaves(Config, "") if f.metadata.get("flag")]


def describe() -> str:
    """Every key with its type, default and help: the text of ``configs/default.toml``."""
    lines = ["# sparklm default configuration (generated from sparklm.config; every key is optional)."]

    def table(cls: type, name: str) -> None:
        lines.extend(["", f"[{name}]"])
        hints = typing.get_type_hints(cls)
        nested = []
        for f in dataclasses.fields(cls):
            if dataclasses.is_dataclass(hints[f.name]):
                nested.append((hints[f.name], f"{name}.{f.name}"))
                continue
            default = f.default_factory() if f.default is dataclasses.MISSING else f.default
            lines.append(f"# {f.metadata['help']} ({_type_name(hints[f.name], f.metadata)})")
            lines.append(f"{f.name} = {_toml_value(default)}")
        for sub, sub_name in nested:
            table(sub, sub_name)

    for name, cls in SECTIONS.items():
        table(cls, name)
    return "\n".join(lines) + "\n"


# -- internals -------------------------------------------------------------------------------


def _leaves(cls: type, prefix: str):
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            yield from _leaves(tp, f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", f, tp


def _is_section(dotted: str) -> bool:
    cls: Any = Config
    for part in dotted.split("."):
        hints = typing.get_type_hints(cls)
        if part not in hints or not dataclasses.is_dataclass(hints[part]):
            return False
        cls = hints[part]
    return True


def _suggest(key: str) -> str:
    """A "did you mean" hint for a mistyped or moved key."""
    known = [k for k, _, _ in _leaves(Config, "")]
    leaf = key.rsplit(".", 1)[-1]
    same_leaf = [k for k in known if k.rsplit(".", 1)[-1] == leaf]
    close = same_leaf or difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    if close:
        return f"did you mean '{close[0]}'?"
    section = key.split(".")[0]
    keys = [k.split(".", 1)[1] for k in known if k.startswith(f"{section}.")]
    return f"keys of [{section}] are: {', '.join(keys)}" if keys else f"sections are: {', '.join(SECTIONS)}"


def _apply_override(raw: dict[str, Any], item: str, value: Any = dataclasses.MISSING) -> None:
    """Set one dotted key in ``raw``: from ``key=text`` (``--set``), or from a key and a typed value (flags)."""
    if value is dataclasses.MISSING:
        key, sep, text = item.partition("=")
        if not sep:
            raise SparklmError(f"bad override '{item}'", hint="write --set section.key=value, e.g. --set data.seq_len=128")
    else:
        key, text = item, None
    parts = key.strip().split(".")
    if len(parts) < 2 or not all(parts):
        raise SparklmError(f"bad override '{item}'", hint="write --set section.key=value, e.g. --set data.seq_len=128")
    cls: Any = Config
    table = raw
    for i, part in enumerate(parts):
        hints = typing.get_type_hints(cls)
        where = ".".join(parts[:i + 1])
        if part not in hints:
            if i == 0:
                raise SparklmError(f"unknown config section '{part}'", hint=f"sections are: {', '.join(SECTIONS)}")
            raise SparklmError(f"unknown config key '{where}'", hint=_suggest(where))
        tp = hints[part]
        if dataclasses.is_dataclass(tp):
            if i == len(parts) - 1:
                raise SparklmError(f"'{where}' is a section, not a key", hint=f"set one of its keys, e.g. {where}.KEY=…")
            sub = table.setdefault(part, {})
            if not isinstance(sub, dict):
                raise SparklmError(f"config section '{where}' must be a table")
            table, cls = sub, tp
            continue
        if typing.get_origin(tp) is dict and i < len(parts) - 1:
            # a key inside a dict-valued field, e.g. spark.conf.spark.executor.memory=4g: kept as text
            sub = table.setdefault(part, {})
            if not isinstance(sub, dict):
                raise SparklmError(f"'{where}' is not a table; cannot set '{key}'")
            sub[".".join(parts[i + 1:])] = text.strip() if text is not None else value
            return
        if i != len(parts) - 1:
            raise SparklmError(f"'{where}' is not a table; cannot set '{key}'")
        table[part] = _parse_value(text.strip()) if text is not None else value
        return


def _deep_merge(base: dict[str, Any], changes: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in changes.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def _diff(new: dict[str, Any], old: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in new.items():
        if isinstance(value, dict) and isinstance(old.get(key), dict) and key not in ("conf", "options"):
            sub = _diff(value, old[key])
            if sub:
                out[key] = sub
        elif old.get(key) != value:
            out[key] = value
    return out


def _parse_value(text: str) -> Any:
    """TOML syntax when it parses (numbers, booleans, quoted strings, arrays), else a bare string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def _build(cls: type, values: dict[str, Any], prefix: str) -> Any:
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for key, value in values.items():
        where = f"{prefix}{key}"
        if key not in fields:
            if not prefix:
                raise SparklmError(f"unknown config section '{key}'", hint=f"sections are: {', '.join(SECTIONS)}")
            raise SparklmError(f"unknown config key '{where}'", hint=_suggest(where))
        if dataclasses.is_dataclass(hints[key]):
            if not isinstance(value, dict):
                raise SparklmError(f"config section '{where}' must be a table, got {type(value).__name__}")
            kwargs[key] = _build(hints[key], value, f"{where}.")
        else:
            kwargs[key] = _check(where, value, hints[key], fields[key].metadata)
    return cls(**kwargs)


def choices(tp: Any, meta: Any) -> tuple | None:
    """The values a field allows: its ``Literal``'s, or the ``choices`` its metadata names (a registry's keys)."""
    if typing.get_origin(tp) is Literal:
        return typing.get_args(tp)
    return tuple(meta["choices"]) if "choices" in meta else None


def _check(key: str, value: Any, tp: Any, meta: Any) -> Any:
    origin = typing.get_origin(tp)
    allowed = choices(tp, meta)
    if allowed is not None:
        return _choice(key, value, allowed)
    if origin is list or tp is list:
        return _strings(key, value)
    if origin is dict:
        if not isinstance(value, dict):
            raise SparklmError(f"config key '{key}' must be a table of key = value")
        # Spark conf values are strings; TOML booleans become Spark's "true"/"false".
        return {str(k): json.dumps(v) if isinstance(v, bool) else str(v) for k, v in value.items()}
    if tp is bool:
        if not isinstance(value, bool):
            raise SparklmError(f"config key '{key}' must be true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise SparklmError(f"config key '{key}' must be an integer, got {value!r}")
    elif tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise SparklmError(f"config key '{key}' must be a finite number, got {value!r}")
        value = float(value)
    elif tp is str:
        if not isinstance(value, str):
            raise SparklmError(f"config key '{key}' must be a string, got {value!r}")
        return value
    lo, hi = meta.get("min"), meta.get("max")
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        bounds = f"{'' if lo is None else f'>= {lo}'}{' and ' if lo is not None and hi is not None else ''}"
        bounds += "" if hi is None else f"<= {hi}"
        raise SparklmError(f"config key '{key}' is {value}; it must be {bounds}")
    return value


def _choice(key: str, value: Any, allowed: tuple) -> Any:
    if isinstance(value, bool) and "on" in allowed and "off" in allowed:  # TOML's true/false for on/off
        value = "on" if value else "off"
    if value not in allowed:
        raise SparklmError(f"config key '{key}' is {value!r}; allowed values: {', '.join(map(repr, allowed))}")
    return value


def _strings(key: str, value: Any) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise SparklmError(f"config key '{key}' must be a list of strings, got {value!r}")
    return list(value)


def _type_name(tp: Any, meta: Any) -> str:
    if (allowed := choices(tp, meta)) is not None:
        return "one of " + ", ".join(repr(a) for a in allowed)
    if typing.get_origin(tp) is dict:
        return "table"
    if tp is list:
        return "list of strings"
    return tp.__name__


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, dict):
        return "{}" if not value else "{ " + ", ".join(f'"{k}" = {json.dumps(v)}' for k, v in value.items()) + " }"
    return repr(value)
