"""Settings decided once, on the driver, before any task starts: every "auto" becomes what runs.

Each rule lives here and nowhere else: the device, the compute dtype, the optimizer, the peak learning rate, LoRA's
frozen-base dtype and the torch threads of a worker. They used to be decided inside every rank from that
host's own bf16 measurement, so ranks on hosts that measured differently (or one near the threshold) could
train one DDP model in two dtypes with two optimizers. Now :func:`settings` writes the decisions into the
config every task receives and the run's ``config.json`` (a run directory says what ran, and ``--resume``
keeps it), and the ranks take them as given. :func:`settle` is the launcher's one call (with the budget fit), and
:func:`local` plans a worker driven in this process (a test, a benchmark). Driver-only: no worker module reaches
this one (tests/unit/test_imports.py). Torch-free: the driver decides before Spark starts.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from ..config import Config, LoraConfig, SparkConfig, TrainConfig, flatten
from ..infra.errors import SparklmError
from ..model.attention import MAX_LEN  # (torch-free: the kernel imports torch where it runs)
from ..registry import task
from ..spark.resources import cuda_gpus
from .peak import bf16_fast, compute_dtype

if TYPE_CHECKING:
    from .plan import RunPlan

SCRATCH_LR, LORA_LR, FINETUNE_LR = 3e-3, 1e-3, 5e-5
# train.compile auto: compiled from this time budget on, in bfloat16 on the CPU, bfloat16 or float16 on a GPU. Measured
# (BENCHMARKS.md): the main job (6 minutes, 2-core bf16 CPU, 3 pairs) trained 983 steps compiled against 902 eager
# (medians; 1.13x the tokens/s) for 24 s of compiling with Inductor's cache cold, ~3 s warm, the first step eager and
# as soon as before. On an H100 the compiled step ran 1.85x the eager one for ~28 s of compiling (the whole model
# then; blocks, which compile sooner, are unmeasured on a GPU): it pays there from well under 6 minutes too.
COMPILE_MIN_BUDGET = 360.0


def local_threads(ranks: int) -> int:
    """Torch threads per worker process when ``ranks`` of them share this host's cores."""
    import os

    return max(1, (os.cpu_count() or 1) // ranks)


def threads(tc: TrainConfig, master: str, spark_config: SparkConfig | None = None, spark=None) -> int:
    """``train.threads``, or where it is 0: local mode shares this machine's cores among the workers; on a cluster
    a task owns ``spark.task.cpus`` cores, not its host's (YARN and Kubernetes containers share their host)."""
    if tc.threads:
        return tc.threads
    if master.startswith("local"):
        return local_threads(tc.workers)
    from ..spark.session import planned_conf

    return int(planned_conf(spark_config, "spark.task.cpus", spark) or 1)


def device(tc: TrainConfig, master: str, spark_config: SparkConfig | None = None, spark=None) -> str:
    """``train.device`` decided: "cuda" where Spark hands each task GPUs (``spark.task.resource.gpu.amount``, as
    TorchDistributor asks for them) or, in local mode, where this machine has a CUDA GPU; else "cpu". "cuda" asked
    for where neither holds is one line before any work."""
    from ..spark.session import planned_conf

    if tc.device == "cpu":
        return "cpu"
    task_gpus = float(planned_conf(spark_config, "spark.task.resource.gpu.amount", spark) or 0)
    return device_for(tc.device, master, task_gpus, cuda_gpus() if master.startswith("local") else 0)


def device_for(setting: str, master: str, task_gpus: float, local_gpus: int) -> str:
    """:func:`device`'s rule (pure): ``task_gpus``, Spark's GPUs per task; ``local_gpus``, this machine's."""
    if setting == "cpu":
        return "cpu"
    local = master.startswith("local")
    if task_gpus > 0 or (local and local_gpus > 0):
        return "cuda"
    if setting == "cuda":
        if local:
            raise SparklmError("--device cuda: this machine has no CUDA GPU that torch can use",
                               hint="install a CUDA build of torch (docs/gpus.md) on a machine with a GPU, or leave "
                                    "--device to auto")
        raise SparklmError(f"--device cuda: Spark on {master} hands its tasks no GPUs",
                           hint="set spark.executor.resource.gpu.amount and spark.task.resource.gpu.amount (--conf; "
                                "docs/gpus.md), or leave --device to auto")
    return "cpu"


def with_device(config: Config, master: str, spark=None) -> Config:
    """``config`` with ``train.device`` decided (:func:`device`)."""
    return config.replace(train=replace(config.train, device=device(config.train, master, config.spark, spark)))


def dtype(setting: str, kind: str, threads: int) -> str:
    """``train.dtype`` for ``kind``: on the CPU bf16 where its matmuls measure fast (peak.compute_dtype); on CUDA
    bf16, or fp16 (with a gradient scaler) where the driver sees a GPU without bf16. A driver without a GPU (a
    cluster's) cannot look: it picks bf16, and a rank on a GPU without it says so in one line."""
    if kind == "cuda":
        if setting != "auto":
            return setting
        import torch

        return "float16" if cuda_gpus() and not torch.cuda.is_bf16_supported() else "bfloat16"
    if setting == "float16":
        raise SparklmError("train.dtype float16 is for GPUs without bfloat16; the CPU computes in float32 or "
                           "bfloat16", hint="set train.dtype to auto, bfloat16 or float32")
    return compute_dtype(setting, threads)


def optimizer(tc: TrainConfig, threads: int, *, pretrained: bool) -> str:
    """``train.optimizer``; auto is Muon where bf16 matmuls are fast, for a model trained from scratch. torch's Muon
    runs its Newton-Schulz iterations in bf16 (~35% of a step's FLOPs for the default model); on CPUs where bf16
    is slower than fp32 that costs more than Muon gains. A pretrained model (full or LoRA) keeps AdamW, the
    optimizer it was trained with and the recipe its learning rates are known for."""
    if tc.optimizer != "auto":
        return tc.optimizer
    if pretrained:
        return "adamw"
    if tc.device == "cuda":  # GPUs with bf16 tensor cores: Muon's bf16 iterations are cheap there
        return "muon" if tc.dtype == "bfloat16" else "adamw"
    return "muon" if bf16_fast(threads) else "adamw"


def compiled(tc: TrainConfig, config: Config) -> str:
    """``train.compile``; auto is on only where it was measured to pay: a causal LM trained from scratch (no
    pretrained base, no LoRA) with DDP for a time budget of at least :data:`COMPILE_MIN_BUDGET` seconds, in bfloat16
    on the CPU (where a C++ compiler is found for Inductor; float32 unmeasured) or bfloat16/float16 on a GPU. A round
    of averaging or DiLoCo would compile again in every round's task; a run by steps says nothing of its length.
    ``tc``: the training settings with the device and dtype decided; ``config``: the model and LoRA settings."""
    if tc.compile != "auto":
        return tc.compile
    fresh = not task(config.model.task).pretrained and not config.model.init_from and not config.lora.r
    if tc.device == "cuda":
        dtype_pays = tc.dtype in ("bfloat16", "float16")
    else:
        dtype_pays = tc.dtype == "bfloat16" and cxx_compiler() is not None
    pays = dtype_pays and tc.time_budget >= COMPILE_MIN_BUDGET
    return "on" if fresh and tc.strategy == "ddp" and pays else "off"


def cxx_compiler() -> str | None:
    """The C++ compiler Inductor builds CPU kernels with, as it looks for it (``$CXX``, else g++; clang++ on macOS),
    found on this host's PATH; None where there is none (torch-free: decided on the driver)."""
    import os
    import shutil
    import sys

    name = os.environ.get("CXX") or ("clang++" if sys.platform == "darwin" else "g++")
    return shutil.which(name)


def attention(tc: TrainConfig, config: Config, context: int) -> str:
    """``train.attention``; auto is matmul (model/attention.py) where it was measured faster than SDPA: a causal LM,
    on the CPU, in bfloat16 (in float32 SDPA's kernel is as fast), with sequences of at most
    ``attention.MAX_LEN`` tokens (``context``: the data's); else sdpa. ``tc``: device and dtype decided."""
    if tc.attention != "auto":
        return tc.attention
    fits = task(config.model.task).generates and tc.device == "cpu" and tc.dtype == "bfloat16"
    return "matmul" if fits and 0 < context <= MAX_LEN else "sdpa"


def peak_lr(config: Config) -> float:
    """``train.lr``, or where it is 0 the usual peak for what trains: a fresh model takes a large learning rate, a
    pretrained one a small one (3e-3 would undo its pretraining in a few steps), and LoRA adapters, which start
    at zero, one in between."""
    if config.train.lr:
        return config.train.lr
    if config.lora.r:
        return LORA_LR
    return FINETUNE_LR if config.model.init_from else SCRATCH_LR


def lora_base_dtype(cfg: LoraConfig, compute: str) -> str:
    """``lora.base_dtype``; auto holds the frozen base in bfloat16 where training computes in bfloat16 (under
    autocast its matmuls run in bf16 anyway; measured on SmolLM2: the same held-out loss, 0.4-1.5 GB less memory,
    faster steps: BENCHMARKS.md), else float32."""
    if cfg.base_dtype != "auto":
        return cfg.base_dtype
    return "bfloat16" if compute == "bfloat16" else "float32"


def rounds(rc, strategy: str):
    """``[train.rounds]`` with its automatic choices made. codec auto: int4 for diloco (sent both ways, with the
    default H 32 and outer momentum 0.5 the setting measured within 2% of DDP on both corpora with the fewest
    bytes, BENCHMARKS.md); fp32 for average (it stays the workers' exact average). downlink auto: the codec itself
    for dense codecs, the exact changed weights for topk (re-sparsifying the sum of the workers' Top-k deltas
    measured worse)."""
    codec = rc.codec if rc.codec != "auto" else "int4" if strategy == "diloco" else "fp32"
    downlink = rc.downlink if rc.downlink != "auto" else "exact" if codec == "topk" else "codec"
    if downlink == "forward" and (codec != "topk" or (strategy == "diloco" and rc.outer_momentum > 0)):
        raise SparklmError("train.rounds.downlink = forward takes the workers' topk payloads and one plain SGD step "
                           f"from them (codec {codec}, outer momentum {rc.outer_momentum})",
                           hint="set train.rounds.codec = topk and train.rounds.outer_momentum = 0, or another downlink")
    return replace(rc, codec=codec, downlink=downlink)


def settings(config: Config, n_threads: int, context: int = 0) -> Config:
    """``config`` with every automatic training setting decided for workers of ``n_threads`` torch threads, on
    sequences of ``context`` tokens (0: not known) (a config already decided comes back unchanged)."""
    tc = config.train
    if tc.workers_min > tc.workers:
        raise SparklmError(f"train.workers_min {tc.workers_min} is more than train.workers {tc.workers}",
                           hint="--workers MIN:MAX with MIN <= MAX")
    if tc.device == "auto":  # a worker driven directly (local): this machine decides; the launcher's device()
        tc = replace(tc, device="cuda" if cuda_gpus() else "cpu")
    tc = replace(tc, dtype=dtype(tc.dtype, tc.device, n_threads))
    train = replace(tc, threads=n_threads, lr=peak_lr(config), compile=compiled(tc, config),
                    optimizer=optimizer(tc, n_threads, pretrained=bool(config.model.init_from)),
                    rounds=rounds(tc.rounds, tc.strategy), attention=attention(tc, config, context))
    lora = replace(config.lora, base_dtype=lora_base_dtype(config.lora, train.dtype))
    return config.replace(train=train, lora=lora)


def decided(before: Config, after: Config) -> dict:
    """``{dotted key: value}`` of what :func:`settings` (and the budget fit) changed: what "auto" became."""
    was, now = flatten(before.to_dict()), flatten(after.to_dict())
    return {k: v for k, v in now.items() if k.split(".")[0] in ("train", "lora", "model") and was.get(k) != v}


# -- the driver's settling, before the run plan is made (plan.make) -----------------------------------


def settle(config: Config, *, threads: int, vocab: int, context: int, train_tokens: int, master: str,
           resume: bool, spark=None) -> tuple[Config, str | None]:
    """``config`` with every automatic setting decided — the device for ``master`` (and ``spark``, a running
    session), then the rest for workers of ``threads`` torch threads — and, for a new run, a fresh model fitted to
    its time budget (a resumed run builds the model its checkpoints hold); and a line saying what the fit changed
    (None: nothing). Before Spark starts."""
    config = settings(with_device(config, master, spark), threads, context)
    if resume:
        return config, None
    from . import budget

    return budget.apply(config, vocab=vocab, context=context, train_tokens=train_tokens, master=master)


def local(config: Config, dataset, threads: int = 1, workers: int | None = None) -> RunPlan:
    """The plan of a worker driven directly in this process (a test, a benchmark), which is then its own driver:
    settled for ``threads`` (unless ``train.threads`` says) with no memory limit and no budget fit. The one way a
    test or a benchmark makes a plan."""
    from .plan import make

    split = dataset.manifest["splits"]["train"]
    if workers is not None:
        config = config.replace(train=replace(config.train, workers=workers))
    config = settings(config, config.train.threads or threads, dataset.seq_len)
    return make(config, train_rows=split["sequences"], seq_len=dataset.seq_len, peak=worker_peak(config))


def worker_peak(config: Config) -> float | None:
    """A CPU worker's matmul peak on its threads in its dtype (what its MFU is against), measured here on the driver
    (cached per host) and carried by the run plan; None on a GPU (its datasheet's, on the worker)."""
    tc = config.train
    if tc.device != "cpu":
        return None
    from .peak import matmul_peak

    return matmul_peak(tc.threads or 1, tc.dtype)
