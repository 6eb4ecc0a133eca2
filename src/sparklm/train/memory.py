"""Each rank's memory: its limit, the estimated peak of a training step, and the micro-batch that fits.

On YARN and Kubernetes a rank lives inside an executor container; going over its memory gets the
container killed (exit 137) and the task retried into the same wall. Before training, the driver
learns each rank's limit from Spark's settings (or ``train.memory_limit``), estimates a rank's peak
from the model's shapes, and picks the largest micro-batch that fits while keeping the global batch
(micro-batch × accumulation); gradient checkpointing only when nothing fits without it (it costs
compute), and before shrinking, the chunked LM-head loss instead of the whole micro-batch's logits (it
costs a little step time). When even one sequence per micro-batch cannot fit, training does not start:
one line says what would make it fit.

The estimate is a sum of parts (bytes): the runtime (Python, torch, transformers, the data reader),
the weights at their dtype, gradients and optimizer state of what trains, the activations kept for
the backward pass (per sequence, from hidden and MLP widths, layers and sequence length; with
checkpointing only the blocks' inputs and one block's activations) and the LM head's loss buffers
(chunked: a constant; unchunked: the logits, per sequence). Its coefficients were fitted to peak RSS
measured on SmolLM2-135M (benchmarks/finetune.py speed); it errs high.

The same estimate decides ``train.parallel`` (:func:`decide`): a sharded rank (FSDP2) holds 1/N of the weights,
gradients and optimizer state, plus the weights it gathers (the root's, and two blocks'), and its gradients exist as
its activations are freed, so its peak holds the larger of the two (measured against it: BENCHMARKS.md).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from pathlib import Path

from ..config import chunk_size, embedding_rows
from ..infra.errors import SparklmError
from ..spark.session import process_limit

MB = 1 << 20
GB = 1 << 30
RUNTIME = 700 * MB  # a training process before its model: interpreter, torch, transformers, peft, pyarrow, gloo
HEADROOM = 0.9  # plan to this fraction of the limit: allocator fragmentation and what the estimate misses
# Extra address space over resident memory (thread stacks, allocator arenas, shared libraries): an
# RLIMIT_AS limit (spark.executor.pyspark.memory) counts it, a container's memory limit does not.
ADDRESS_SPACE = 700 * MB
# Activation elements kept per token and layer, in units of the hidden and MLP widths (fitted, see above)
HIDDEN_UNITS, MLP_UNITS = 14, 6
# A sharded rank hands freed memory back (train.allocator return): its runtime and activations measured smaller than
# the fit above, made with freed memory kept (fitted on the 135M and 360M shapes sharded over 2 and 4 ranks:
# BENCHMARKS.md, issue 80)
SHARDED_RUNTIME, SHARDED_ACTIVATIONS = 450 * MB, 0.6


@dataclass(frozen=True)
class Shapes:
    """What the estimate needs of a model: its sizes and what trains."""

    layers: int
    hidden: int
    intermediate: int
    vocab: int
    params: int  # every parameter
    weight_bytes: int  # every parameter in float32 (plan_for counts a bfloat16 base)
    trainable: int  # parameters that train (all, or LoRA's adapters)
    head_trains: bool  # the LM head's weight gets a gradient (not under LoRA)
    heads: int = 0  # attention heads per layer (train.attention matmul keeps each head's T x T probabilities)
    # sharding (train.parallel shard) gathers one unit at a time: a decoder block's weights, or the root's (embeddings,
    # head, final norm), which stay gathered through the step; 0: unknown (counted as params / layers)
    block_params: int = 0
    root_params: int = 0

    def block(self) -> int:
        return self.block_params or self.params // max(1, self.layers)

    def root(self) -> int:
        return self.root_params or max(0, self.params - self.layers * self.block())


@dataclass(frozen=True)
class Footprint:
    """A rank's estimated memory, in bytes, by part (see the module docstring)."""

    runtime: int
    weights: int
    states: int  # gradients and optimizer state of the trainable parameters
    per_sequence: int  # activations per sequence
    per_sequence_checkpointed: int
    head: int  # the LM head's loss buffers (chunked loss)
    address_space: int = 0  # added when the limit counts address space, not resident memory
    # sharded: the gradients, apart from ``states`` (the optimizer's), which exist as the activations are freed (the
    # backward pass frees a block's as it makes its gradients): the peak holds the larger of the two; 0: replicated,
    # whose ``states`` count the gradients and which keeps both (its fit, on measured peaks, counts them so)
    grads: int = 0

    def peak(self, micro_batch: int, checkpointing: bool) -> int:
        act = micro_batch * (self.per_sequence_checkpointed if checkpointing else self.per_sequence)
        return self.runtime + self.weights + self.states + max(act, self.grads) + self.head + self.address_space


def footprint(shapes: Shapes, *, seq_len: int, optimizer_slots: int = 2, activation_bytes: int = 4,
              loss_chunk: int | None = 512, score_bytes: int = 0, shards: int = 1) -> Footprint:
    """The estimate's parts for a model of ``shapes`` trained on sequences of ``seq_len`` tokens (pure).

    ``optimizer_slots``: float32 values of optimizer state per trainable parameter (AdamW 2);
    ``activation_bytes``: 4 in float32, 2 when the model computes in bfloat16 (bf16 base weights);
    ``loss_chunk``: positions per chunk of the LM-head loss, None: unchunked (logits of every position);
    ``score_bytes``: bytes of each attention probability kept for the backward pass (train.attention matmul: the
    compute dtype's; SDPA keeps none); ``shards``: ranks the weights, gradients and optimizer state are sharded over
    (FSDP2: each holds 1/N, plus the root's weights and gradients, gathered through the step, and two blocks' —
    the one computing and the next, prefetched — with one block's gradients before they are reduce-scattered)."""
    per_token_layer = HIDDEN_UNITS * shapes.hidden + MLP_UNITS * shapes.intermediate
    scores = shapes.heads * seq_len * seq_len * score_bytes  # a layer's, per sequence
    per_sequence = seq_len * shapes.layers * per_token_layer * activation_bytes + shapes.layers * scores
    # checkpointing keeps each block's input, and recomputes one block at a time in the backward pass
    checkpointed = seq_len * (shapes.layers * shapes.hidden + 2 * per_token_layer) * activation_bytes + scores
    head = shapes.vocab * shapes.hidden * 4 if shapes.head_trains else 0
    if loss_chunk is None:  # the logits, their softmax and its gradient for every position of a sequence
        per_sequence += 3 * seq_len * shapes.vocab * 4
        checkpointed += 3 * seq_len * shapes.vocab * 4
    else:
        head += 3 * loss_chunk * shapes.vocab * 4
    weights, states, grads, runtime = shapes.weight_bytes, shapes.trainable * 4 * (1 + optimizer_slots), 0, RUNTIME
    if shards > 1:
        runtime = SHARDED_RUNTIME
        per_sequence = int(per_sequence * SHARDED_ACTIVATIONS)
        checkpointed = int(checkpointed * SHARDED_ACTIVATIONS)
        per_param = shapes.weight_bytes / max(1, shapes.params)
        trains = shapes.trainable / max(1, shapes.params)  # the share of a unit that trains (LoRA: the adapters')
        gathered = shapes.root() + 2 * shapes.block()
        weights = int(shapes.weight_bytes / shards + gathered * per_param)
        states = int(shapes.trainable * 4 * optimizer_slots / shards)
        grads = int(shapes.trainable * 4 / shards + (shapes.root() + shapes.block()) * trains * 4)
    return Footprint(runtime=runtime, weights=weights, states=states, grads=grads,
                     per_sequence=per_sequence, per_sequence_checkpointed=checkpointed, head=head)


@dataclass(frozen=True)
class MemoryPlan:
    batch_size: int  # sequences per micro-batch
    grad_accum: int
    checkpointing: bool
    estimate: int  # bytes at the chosen settings
    limit: int | None  # bytes; None: no limit known
    source: str  # where the limit comes from
    hand_back: bool = False  # freed memory goes back to the OS (device.hand_back_memory): the plan had to shrink
    chunked: bool = True  # the LM-head loss in chunks (model/lm_head.py); False: the whole micro-batch's logits fit
    parallel: str = "replicate"  # train.parallel as decided: replicate, or shard (FSDP2 over the ranks)
    replicated: int = 0  # bytes a replica's step would need at the configured micro-batch (the decision's evidence)

    def describe(self) -> str:
        est = f"estimated peak {self.estimate / GB:.2f} GB"
        where = f"of {self.limit / GB:.2f} GB ({self.source})" if self.limit else "(no memory limit known)"
        ckpt = ", LM-head loss in chunks" if self.chunked and self.limit else ""
        ckpt += ", gradient checkpointing" if self.checkpointing else ""
        ckpt += ", freed memory handed back" if self.hand_back else ""
        if self.parallel == "shard":
            ckpt += ", sharded over the ranks" + (f" (a replica: {self.replicated / GB:.2f} GB)" if self.replicated else "")
        return (f"memory: micro-batch {self.batch_size} x {self.grad_accum} accumulation{ckpt}, "
                f"{est} {where}")


def plan(fp: Footprint, limit: int | None, *, batch_size: int, grad_accum: int, checkpointing: str = "auto",
         source: str = "", fixes: list[str] | None = None, whole: Footprint | None = None,
         chunked: bool = True) -> MemoryPlan:
    """The micro-batch, accumulation and checkpointing that fit ``limit`` bytes per rank (pure).

    The sequences a rank takes per step (``batch_size × grad_accum``) stay the same: the micro-batch is their
    largest divisor, up to ``batch_size``, whose estimate fits. ``checkpointing``: "on", "off", or "auto" (only
    when no micro-batch fits without). With no limit, or the configured settings fitting, they are kept.
    ``whole``: the footprint with the unchunked LM-head loss, chosen when the configured settings fit with it
    (the chunked loss, ``fp``, is then not needed; otherwise it comes first, before any shrinking).
    ``fixes``: what would lower the estimate, named in the error when nothing fits. ``chunked``: whether ``fp``
    computes the loss in chunks (:func:`chunks_loss`)."""
    per_step = batch_size * grad_accum
    sizes = [m for m in range(batch_size, 0, -1) if per_step % m == 0]
    options = {"on": [True], "off": [False], "auto": [False, True]}[checkpointing]
    if limit is None:
        ckpt = checkpointing == "on"
        return MemoryPlan(batch_size, grad_accum, ckpt, fp.peak(batch_size, ckpt), None, source or "none",
                          chunked=chunked)
    budget = limit * HEADROOM
    ckpt = checkpointing == "on"
    if whole is not None and whole.peak(batch_size, ckpt) <= budget:
        return MemoryPlan(batch_size, grad_accum, ckpt, whole.peak(batch_size, ckpt), limit, source, chunked=False)
    for ckpt in options:
        for m in sizes:
            if fp.peak(m, ckpt) <= budget:
                shrunk = (m, ckpt) != (batch_size, checkpointing == "on")
                return MemoryPlan(m, per_step // m, ckpt, fp.peak(m, ckpt), limit, source, hand_back=shrunk,
                                  chunked=chunked)
    least = min(fp.peak(1, c) for c in options)
    hint = "; ".join(fixes or []) or "give each rank more memory"
    raise SparklmError(f"training does not fit in each rank's {limit / GB:.2f} GB ({source}): even a micro-batch of "
                       f"one sequence needs about {least / GB:.2f} GB", hint=f"to fit: {hint}")


def scratch_shapes(cfg, vocab: int, context: int) -> Shapes:
    """The shapes of a model sparklm builds from ``[model]`` (pure arithmetic: the driver need not import
    transformers, ~3 s, before a run that trains from scratch)."""
    d, layers, f = cfg.n_embd, cfg.n_layer, cfg.mlp_hidden
    if cfg.arch == "llama":
        per_layer = 4 * d * d + 3 * d * f + 2 * d + (2 * (d // cfg.n_head) if cfg.qk_norm else 0)
        params = vocab * d + layers * per_layer + d
    else:
        per_layer = 4 * d * d + 4 * d + 2 * d * f + f + d + 4 * d
        params = vocab * d + context * d + layers * per_layer + 2 * d
    if not cfg.tie_embeddings:
        params += vocab * d
    return Shapes(layers=layers, hidden=d, intermediate=f, vocab=vocab, params=params, weight_bytes=4 * params,
                  trainable=params, head_trains=True, heads=cfg.n_head, block_params=per_layer,
                  root_params=params - layers * per_layer)


def model_shapes(config, spec, context: int) -> Shapes:
    """The shapes of the model ``config`` trains, before Spark starts: sparklm's own from ``[model]`` by arithmetic;
    a pretrained model built empty on the meta device from its config.json (no weights read), its LoRA targets
    checked on it and its adapters counted by peft."""
    if not config.model.init_from:  # LoRA without a base was refused before
        return scratch_shapes(config.model, embedding_rows(spec.vocab_size), context)
    import torch
    import transformers

    from ..model import lora
    from ..model.build import ADAPTER_CONFIG, model_source
    from ..registry import task as task_info

    name = config.model.init_from
    path = model_source(name, config.storage)
    if (path / ADAPTER_CONFIG).is_file():  # a LoRA run: its base, with the adapter merged in
        path = model_source(lora.base_of(path), config.storage)
    task = task_info(config.model.task)
    auto = getattr(transformers, task.auto)  # the class the task loads its model with
    extra = task.hf_config(config) if task.hf_config is not None else {}
    try:  # float32: a bfloat16 base's bytes are counted by plan_for, which knows the dtype training computes in
        with torch.device("meta"):
            hf_config = transformers.AutoConfig.from_pretrained(str(path), local_files_only=True,
                                                                trust_remote_code=False, **extra)
            model = auto.from_config(hf_config, dtype=torch.float32)
    except Exception as e:
        raise SparklmError(f"cannot read the model config in {name}: {' '.join(str(e).split())[:200]}") from None
    if config.lora.r:
        lora.check_targets(model, config.lora)
        with torch.device("meta"):
            model = lora.wrap(model, config.lora, task_type=task.peft)
    cfg = model.config
    params = list(model.parameters())
    head = model.get_output_embeddings()  # a classifier's logits are its classes, not a vocabulary
    from ..model.build import blocks

    units = blocks(model)
    block = max((sum(p.numel() for p in b.parameters()) for b in units), default=0)
    return Shapes(layers=cfg.num_hidden_layers, hidden=cfg.hidden_size,
                  intermediate=getattr(cfg, "intermediate_size", None) or getattr(cfg, "n_inner", None) or 4 * cfg.hidden_size,
                  vocab=head.weight.shape[0] if head is not None else model.config.num_labels,
                  params=sum(p.numel() for p in params), weight_bytes=sum(p.numel() * p.element_size() for p in params),
                  trainable=sum(p.numel() for p in params if p.requires_grad),
                  head_trains=head.weight.requires_grad if head is not None else True,
                  heads=getattr(cfg, "num_attention_heads", None) or getattr(cfg, "n_head", None) or 0,
                  block_params=block,
                  root_params=sum(p.numel() for p in params) - sum(p.numel() for b in units for p in b.parameters()))


def base_in_bf16(config) -> bool:
    """Whether LoRA's frozen base will be held in bfloat16 (the driver decided ``lora.base_dtype``: resolve.py)."""
    return bool(config.lora.r) and config.lora.base_dtype == "bfloat16"


NF4_BYTES = 0.5 + 1 / 64 + 4 / (64 * 256)  # an NF4 weight: 4 bits, an 8-bit scaler per 64, a float32 per 256 scalers


def base_bytes(config, shapes: Shapes) -> int:
    """Bytes of the weights as training holds them: LoRA's frozen base in bfloat16 (2 bytes), or with ``nf4`` its
    blocks' weights in 4 bits and the rest (embeddings, head, norms) in bfloat16; what trains in float32."""
    if not config.lora.r or config.lora.base_dtype not in ("bfloat16", "nf4"):
        return shapes.weight_bytes
    frozen = shapes.params - shapes.trainable
    if config.lora.base_dtype == "bfloat16":
        return shapes.weight_bytes - 2 * frozen
    linear = min(frozen, shapes.layers * shapes.block())  # the blocks' weights (their norms: a rounding error)
    return int(4 * shapes.trainable + NF4_BYTES * linear + 2 * (frozen - linear))


def chunks_loss(tc) -> bool:
    """Whether training may compute the LM head's loss in chunks: not where ``train.loss_chunk`` is -1 (a compiled
    model keeps it: its blocks are compiled, the head stays eager; train/compiling.py)."""
    return tc.loss_chunk >= 0


def footprints(tc, shapes: Shapes, seq_len: int, activation_bytes: int, shards: int = 1
               ) -> tuple[Footprint, Footprint | None]:
    """The footprint as ``tc`` (train settings) computes the LM head's loss, and the unchunked one where the plan
    may pick either (None: it may not); ``shards``: ranks the model is sharded over (1: replicated)."""
    chunked = chunks_loss(tc)
    scores = (4 if tc.dtype == "float32" else 2) if tc.attention == "matmul" else 0  # in the compute dtype
    fp = footprint(shapes, seq_len=seq_len, activation_bytes=activation_bytes,
                   loss_chunk=chunk_size(shapes.vocab, tc.loss_chunk) if chunked else None, score_bytes=scores,
                   shards=shards)
    # loss_chunk 0: the whole micro-batch's logits when they fit (the same step time or a little less than the
    # chunked loss, BENCHMARKS.md), the chunked loss when they do not
    whole = (footprint(shapes, seq_len=seq_len, activation_bytes=activation_bytes, loss_chunk=None,
                       score_bytes=scores, shards=shards)
             if tc.loss_chunk == 0 and chunked else None)
    return fp, whole


def plan_for(config, shapes: Shapes, seq_len: int, spark) -> MemoryPlan:
    """The memory plan of a training job on ``spark`` for a model of ``shapes`` (driver side, before any task
    starts)."""
    tc = config.train
    sc = spark.sparkContext
    conf = dict(sc.getConf().getAll())
    limit, source = (gpu_limit(tc.memory_limit) if tc.device == "cuda" else
                     rank_limit(conf, sc.master, ranks_per_host=tc.workers, setting=tc.memory_limit))
    return decide(config, shapes, seq_len, limit, source, address_space=source.startswith("spark.executor.pyspark.memory"))


def decide(config, shapes: Shapes, seq_len: int, limit: int | None, source: str, *, address_space: bool = False
           ) -> MemoryPlan:
    """:func:`plan_for`'s decision for ``limit`` bytes per rank (pure): the micro-batch, checkpointing and LM-head
    loss, and ``train.parallel``. auto replicates where a replica fits at the configured micro-batch, shards where
    only a shard does (DDP on more than one rank), and otherwise takes the first of the two that fits by shrinking
    the micro-batch; nothing fitting is one line naming what would."""
    tc = config.train
    shapes = replace(shapes, weight_bytes=base_bytes(config, shapes))
    acts = 2 if config.lora.r and config.lora.base_dtype in ("bfloat16", "nf4") else 4
    can_shard = tc.strategy == "ddp" and tc.workers > 1
    if tc.parallel == "shard" and tc.strategy != "ddp":
        raise SparklmError(f"train.parallel shard is for the strategy ddp, not {tc.strategy} (its workers each train "
                           "a whole replica between rounds)", hint="--strategy ddp, or --parallel replicate")
    ways = {"replicate": ["replicate"], "shard": ["shard"],
            "auto": ["replicate", "shard"] if can_shard else ["replicate"]}[tc.parallel]

    def fits(way: str, *, shrink: bool) -> MemoryPlan | None:
        fp, whole = footprints(tc, shapes, seq_len, acts, shards=tc.workers if way == "shard" else 1)
        if address_space:
            fp = replace(fp, address_space=ADDRESS_SPACE)
            whole = whole and replace(whole, address_space=ADDRESS_SPACE)
        try:
            p = plan(fp, limit, batch_size=tc.batch_size,
                     grad_accum=tc.grad_accum, checkpointing=tc.grad_checkpoint, source=source, whole=whole,
                     chunked=chunks_loss(tc))
        except SparklmError:
            return None
        if not shrink and p.hand_back:  # it fits only with a smaller micro-batch or checkpointing
            return None
        return replace(p, parallel=way)

    replica = footprints(tc, shapes, seq_len, acts)[0].peak(tc.batch_size, tc.grad_checkpoint == "on")
    for shrink in (False, True):
        for way in ways:
            p = fits(way, shrink=shrink)
            if p is not None:
                return replace(p, replicated=replica if p.parallel == "shard" else 0)
    fixes = []
    if can_shard and "shard" not in ways:
        fixes.append("shard the model over the ranks (--parallel shard)")
    if tc.strategy != "ddp":
        fixes.append("shard the model over DDP ranks (--strategy ddp --parallel shard)")
    if config.model.init_from and not config.lora.r:
        fixes.append("train LoRA adapters only (--lora-r 8)")
    if config.lora.r and config.lora.base_dtype != "nf4":
        fixes.append("hold the frozen base in 4 bits (--lora-base-dtype nf4)")
    if tc.grad_checkpoint == "off":
        fixes.append("--grad-checkpoint auto")
    if "shard" in ways or can_shard:
        fixes.append("more workers to shard over (--workers)")
    fixes += ["shorter sequences (prepare --seq-len)", "more memory per rank (--memory-limit, "
              "spark.executor.pyspark.memory, or a larger executor)"]
    fp = footprints(tc, shapes, seq_len, acts, shards=tc.workers if ways[-1] == "shard" else 1)[0]
    least = fp.peak(1, tc.grad_checkpoint != "off") + (ADDRESS_SPACE if address_space else 0)
    how = "sharded over" if ways[-1] == "shard" else "replicated on"
    raise SparklmError(f"training does not fit in each rank's {limit / GB:.2f} GB ({source}): {how} "
                       f"{tc.workers} rank{'s' * (tc.workers > 1)}, even a micro-batch of one sequence needs about "
                       f"{least / GB:.2f} GB", hint=f"to fit: {'; '.join(fixes)}")


def unplanned(tc) -> MemoryPlan:
    """The settings as they are, where no limit is known or nothing was planned (a worker driven directly)."""
    return MemoryPlan(tc.batch_size, tc.grad_accum, tc.grad_checkpoint == "on", 0, None, "none",
                      chunked=chunks_loss(tc), parallel="shard" if tc.parallel == "shard" else "replicate")


def apply(config, p: MemoryPlan):
    """``config`` with the plan's micro-batch, accumulation, checkpointing and LM-head loss."""
    tc = config.train
    # a sharded rank gathers and frees a block's weights twice a step: glibc's kept free lists then grow by a block's
    # worth every time (measured on the 360M shape, 2 ranks: 8.3 GB and rising after 3 steps with "keep", 3.9 GB
    # flat with "return", 10% fewer tokens/s)
    shrink = p.hand_back or p.parallel == "shard"
    # a 4-bit base dequantizes each weight at every use: kept, the freed copies grow the heap a step at a time
    # (the 1.7B shape: 3.4 -> 4.9 GB over 4 steps); trimmed after each step it stays flat (3.9 GB), as fast
    nf4 = config.lora.r and config.lora.base_dtype == "nf4"
    allocator = (tc.allocator if tc.allocator != "auto" else "return" if shrink else "trim" if nf4 else "keep")
    return config.replace(train=replace(tc, batch_size=p.batch_size, grad_accum=p.grad_accum,
                                        grad_checkpoint="on" if p.checkpointing else "off", allocator=allocator,
                                        loss_chunk=tc.loss_chunk if p.chunked else -1, parallel=p.parallel))


# -- the limit --

_UNITS = {"": 1 << 20, "b": 1, "k": 1 << 10, "kb": 1 << 10, "m": 1 << 20, "mb": 1 << 20, "g": 1 << 30, "gb": 1 << 30,
          "t": 1 << 40, "tb": 1 << 40}


def parse_size(text: str, what: str = "memory size") -> int:
    """Bytes of a Spark-style size ("2g", "1536m", "512k"; a bare number is MiB, as Spark's memory settings)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise SparklmError(f"{what} {text!r} is not a size", hint="write it as Spark does, e.g. 2g or 1536m")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def rank_limit(conf: dict[str, str], master: str, *, ranks_per_host: int, setting: str = "") -> tuple[int | None, str]:
    """Each rank's memory limit in bytes and where it comes from (pure but for local mode's host memory).

    ``setting`` (train.memory_limit) wins; "none" plans nothing. Else spark.executor.pyspark.memory, which Spark
    divides among an executor's cores and enforces as the Python worker's address-space limit; else, on YARN and
    Kubernetes, the executor container (memory + overhead) less what its JVM holds, shared by the ranks in it;
    in local mode this host's available memory shared by the ranks; else (standalone) none known."""
    if setting.strip().lower() == "none":
        return None, "train.memory_limit = none"
    if setting.strip():
        return parse_size(setting, "train.memory_limit"), "train.memory_limit"
    cores = max(1, int(conf.get("spark.executor.cores", "1") or 1))
    if conf.get("spark.executor.pyspark.memory"):
        total = parse_size(conf["spark.executor.pyspark.memory"], "spark.executor.pyspark.memory")
        return total // cores, "spark.executor.pyspark.memory" + (f" / {cores} cores" if cores > 1 else "")
    if master.startswith(("yarn", "k8s://")):
        heap = parse_size(conf.get("spark.executor.memory", "1g"), "spark.executor.memory")
        factor = float(conf.get("spark.executor.memoryOverheadFactor", "0.1"))
        overhead = (parse_size(conf["spark.executor.memoryOverhead"], "spark.executor.memoryOverhead")
                    if conf.get("spark.executor.memoryOverhead") else max(384 * MB, int(heap * factor)))
        # the JVM of a training task holds little of its heap; count it at half, at least 512 MB
        share = heap + overhead - max(512 * MB, heap // 2)
        tasks = max(1, cores // max(1, int(conf.get("spark.task.cpus", "1") or 1)))
        return share // tasks, "the executor container: spark.executor.memory + memoryOverhead, less the JVM"
    if master.startswith("local"):
        avail = host_available()
        return (avail // max(1, ranks_per_host), "this host's available memory") if avail else (None, "")
    return None, ""


def gpu_limit(setting: str = "") -> tuple[int | None, str]:
    """A GPU rank's memory limit in bytes and where it comes from: ``setting`` (train.memory_limit) wins; else the
    driver's GPU, less 8% for the CUDA context and allocator slack, standing for the executors' (a cluster's
    driver often has none: then nothing is planned, and --memory-limit says the executors' GPU memory)."""
    if setting.strip():
        return rank_limit({}, "", ranks_per_host=1, setting=setting)
    import torch

    if not torch.cuda.is_available():
        return None, ""
    props = torch.cuda.get_device_properties(0)
    return int(props.total_memory * 0.92), f"the GPU's memory ({props.name}, 92%)"


def host_available() -> int | None:
    """Bytes this host (or this container's memory cgroup) can still give: MemAvailable, capped by the cgroup."""
    avail = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024
    except OSError:
        return None
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < (1 << 60):
            used = _cgroup_used(path)
            avail = min(avail or int(text), int(text) - used)
    return avail


def _cgroup_used(limit_path: str) -> int:
    used = limit_path.replace("memory.max", "memory.current").replace("limit_in_bytes", "usage_in_bytes")
    try:
        return int(Path(used).read_text().strip())
    except (OSError, ValueError):
        return 0


def out_of_memory(where: str) -> SparklmError:
    """The one line for a rank that ran out of memory: its peak, its limit, and what would fit."""
    from .device import peak_rss_mb

    limit = process_limit()
    held = f"peak resident memory {peak_rss_mb() / 1024:.2f} GB"
    if limit is not None:
        held += f", address-space limit {limit / GB:.2f} GB (spark.executor.pyspark.memory)"
    return SparklmError(f"{where}: out of memory ({held})",
                        hint="let sparklm plan the micro-batch to each rank's memory (--memory-limit SIZE, not none), "
                             "or lower train.batch_size, or train LoRA adapters with a bfloat16 base, or "
                             "--grad-checkpoint on")
