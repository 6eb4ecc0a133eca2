"""The memory plan as pure functions: limits → micro-batch, accumulation, checkpointing."""

import pytest

from sparklm.infra.errors import SparklmError
from sparklm.train import memory
from sparklm.train.memory import GB, MB, Footprint, Shapes

# a rank that holds 1 GB before activations, 300 MB per sequence (30 MB checkpointed)
FP = Footprint(runtime=500 * MB, weights=400 * MB, states=100 * MB, per_sequence=300 * MB,
               per_sequence_checkpointed=30 * MB, head=24 * MB)


def test_no_limit_keeps_the_configured_settings():
    p = memory.plan(FP, None, batch_size=8, grad_accum=2)
    assert (p.batch_size, p.grad_accum, p.checkpointing) == (8, 2, False)
    assert p.estimate == FP.peak(8, False)


def test_the_largest_micro_batch_that_fits_keeps_the_global_batch():
    limit = int((FP.peak(2, False) + 10 * MB) / memory.HEADROOM)  # room for 2 sequences, not 4
    p = memory.plan(FP, limit, batch_size=8, grad_accum=1, source="test")
    assert (p.batch_size, p.grad_accum, p.checkpointing) == (2, 4, False)
    p = memory.plan(FP, limit, batch_size=6, grad_accum=3)  # 18 sequences a step: divisors of 18 up to 6
    assert (p.batch_size * p.grad_accum, p.batch_size) == (18, 2)


def test_checkpointing_only_when_nothing_fits_without():
    limit = int(FP.peak(1, False) / memory.HEADROOM) - MB  # not even one sequence without checkpointing
    p = memory.plan(FP, limit, batch_size=8, grad_accum=1)
    assert p.checkpointing and p.batch_size * p.grad_accum == 8
    assert FP.peak(p.batch_size, True) <= limit * memory.HEADROOM
    with pytest.raises(SparklmError, match="even a micro-batch of one sequence"):
        memory.plan(FP, limit, batch_size=8, grad_accum=1, checkpointing="off")
    on = memory.plan(FP, 100 * GB, batch_size=8, grad_accum=1, checkpointing="on")
    assert on.checkpointing and on.batch_size == 8


def test_nothing_fits_names_the_fixes():
    with pytest.raises(SparklmError) as e:
        memory.plan(FP, GB, batch_size=4, grad_accum=1, source="spark.executor.pyspark.memory",
                    fixes=["train LoRA adapters only (--lora-r 8)", "shorter sequences"])
    line = e.value.one_line()
    assert "1.00 GB (spark.executor.pyspark.memory)" in line and "--lora-r 8" in line and "\n" not in line


def test_footprint_parts():
    shapes = Shapes(layers=8, hidden=64, intermediate=256, vocab=1000, params=10**6, weight_bytes=4 * 10**6,
                    trainable=10**4, head_trains=False)
    fp = memory.footprint(shapes, seq_len=128, loss_chunk=100)
    assert fp.states == 10**4 * 4 * 3  # gradient + AdamW's two moments
    assert fp.head == 3 * 100 * 1000 * 4  # a frozen head: only the chunk's buffers
    assert fp.per_sequence_checkpointed < fp.per_sequence
    assert memory.footprint(shapes, seq_len=256).per_sequence == 2 * fp.per_sequence
    assert memory.footprint(shapes, seq_len=128, activation_bytes=2).per_sequence * 2 == fp.per_sequence
    whole = memory.footprint(shapes, seq_len=128, loss_chunk=None)  # unchunked: every position's logits
    assert whole.head == 0 and whole.per_sequence - fp.per_sequence == 3 * 128 * 1000 * 4


@pytest.mark.parametrize("text,want", [("2g", 2 * GB), ("1536m", 1536 * MB), ("512", 512 * MB), ("1.5g", int(1.5 * GB)),
                                       ("100k", 100 * 1024), ("3GB", 3 * GB)])
def test_parse_size(text, want):
    assert memory.parse_size(text) == want


def test_parse_size_rejects_nonsense():
    with pytest.raises(SparklmError, match="not a size"):
        memory.parse_size("lots")


def test_rank_limit_sources():
    assert memory.rank_limit({}, "spark://h:7077", ranks_per_host=1, setting="3g") == (3 * GB, "train.memory_limit")
    assert memory.rank_limit({}, "local[2]", ranks_per_host=2, setting="none")[0] is None
    conf = {"spark.executor.pyspark.memory": "4g", "spark.executor.cores": "2"}
    limit, source = memory.rank_limit(conf, "spark://h:7077", ranks_per_host=1)
    assert limit == 2 * GB and source.startswith("spark.executor.pyspark.memory")  # Spark divides it among cores
    yarn = {"spark.executor.memory": "4g", "spark.executor.cores": "2", "spark.task.cpus": "1"}
    limit, _ = memory.rank_limit(yarn, "yarn", ranks_per_host=1)
    assert limit == (4 * GB + int(0.4 * GB) - 2 * GB) // 2  # heap + 10% overhead, less half the heap, 2 tasks
    explicit = {**yarn, "spark.executor.memoryOverhead": "2g"}
    assert memory.rank_limit(explicit, "k8s://x", ranks_per_host=1)[0] == (4 * GB + 2 * GB - 2 * GB) // 2
    assert memory.rank_limit({}, "spark://h:7077", ranks_per_host=1) == (None, "")
    local, source = memory.rank_limit({}, "local[2]", ranks_per_host=2)
    assert local is None or (0 < local and source == "this host's available memory")


@pytest.mark.parametrize("text", [
    "org.apache.spark.SparkException: Python worker exited unexpectedly (crashed)",
    "ExecutorLostFailure (executor 3 exited caused by one of the running tasks) Reason: Container killed by YARN for "
    "exceeding physical memory limits. 4.5 GB of 4.4 GB physical memory used.",
    "The executor with id 2 exited with exit code 137(SIGKILL, possible container OOM).",
])
def test_a_killed_python_worker_is_named_as_memory(text):
    from sparklm.infra.errors import killed_note, known_cause
    from sparklm.strategies.ddp import lost_cause

    assert "memory limit" in killed_note(text) and "--memory-limit" in killed_note(text)
    assert known_cause(text) is None  # the strategies decide: DDP restarts, a round goes on without the worker
    assert killed_note("ValueError: bad input") is None
    if "Python worker" in text:
        assert "memory limit" in lost_cause(RuntimeError(text))  # DDP restarts, and says why it may have died


def test_out_of_memory_line_names_peak_and_limit():
    e = memory.out_of_memory("training rank 0 on h")
    line = e.one_line()
    assert line.startswith("error: training rank 0 on h: out of memory (peak resident memory") and "\n" not in line


def test_memory_is_handed_back_only_when_the_plan_had_to_shrink():
    assert not memory.plan(FP, 100 * GB, batch_size=8, grad_accum=1).hand_back
    limit = int((FP.peak(2, False) + 10 * MB) / memory.HEADROOM)
    assert memory.plan(FP, limit, batch_size=8, grad_accum=1).hand_back
    assert not memory.plan(FP, None, batch_size=8, grad_accum=1).hand_back


@pytest.mark.parametrize("model", [{}, {"arch": "gpt2"}, {"qk_norm": False}, {"tie_embeddings": False, "n_layer": 3}])
def test_scratch_shapes_count_what_build_model_builds(model):
    import torch

    from sparklm.config import from_dict
    from sparklm.model.build import build_model

    cfg = from_dict({"model": model}).model
    shapes = memory.scratch_shapes(cfg, 640, 128)
    with torch.device("meta"):
        net = build_model(cfg, vocab_size=640, context=128, bos_id=1, eos_id=2, pad_id=0)
    assert shapes.params == sum(p.numel() for p in net.parameters())
    assert shapes.weight_bytes == 4 * shapes.params and shapes.layers == cfg.n_layer


def test_an_error_line_reads_back_into_the_error():
    e = memory.out_of_memory("training rank 0 on h")
    back = SparklmError.from_line(e.one_line())
    assert (back.message, back.hint) == (e.message, e.hint)
    assert SparklmError.from_line("error: plain").hint is None


def test_a_bf16_base_where_training_computes_in_bf16():
    """lora.base_dtype "auto": the base is held in bf16 when training computes in bf16, decided on the driver
    (resolve.settings) with the dtype; the memory plan counts what was decided."""
    from sparklm.config import Config, LoraConfig, TrainConfig
    from sparklm.train import resolve

    assert resolve.lora_base_dtype(LoraConfig(r=8), "bfloat16") == "bfloat16"
    assert resolve.lora_base_dtype(LoraConfig(r=8), "float32") == "float32"
    assert resolve.lora_base_dtype(LoraConfig(r=8, base_dtype="float32"), "bfloat16") == "float32"

    def cfg(base="auto", dtype="float32", r=8):
        return resolve.settings(Config(lora=LoraConfig(r=r, base_dtype=base),
                                       train=TrainConfig(dtype=dtype, optimizer="adamw")), 2)

    assert memory.base_in_bf16(cfg(dtype="bfloat16"))
    assert not memory.base_in_bf16(cfg(dtype="float32"))
    assert memory.base_in_bf16(cfg(base="bfloat16", dtype="float32"))
    assert not memory.base_in_bf16(cfg(r=0, dtype="bfloat16"))


def test_the_whole_logits_when_they_fit_else_chunks_before_any_shrinking():
    whole = Footprint(runtime=500 * MB, weights=400 * MB, states=100 * MB, per_sequence=400 * MB,
                      per_sequence_checkpointed=130 * MB, head=0)  # FP plus each sequence's logits
    roomy = memory.plan(FP, 100 * GB, batch_size=8, grad_accum=1, whole=whole)
    assert not roomy.chunked and roomy.batch_size == 8 and roomy.estimate == whole.peak(8, False)
    limit = int(FP.peak(8, False) / memory.HEADROOM) + MB  # the chunked loss fits the micro-batch, the logits do not
    tight = memory.plan(FP, limit, batch_size=8, grad_accum=1, whole=whole)
    assert tight.chunked and (tight.batch_size, tight.checkpointing, tight.hand_back) == (8, False, False)
    assert "LM-head loss in chunks" in tight.describe()
    from sparklm.config import Config

    assert memory.apply(Config(), roomy).train.loss_chunk == -1  # off: the model's own logits and loss
    assert memory.apply(Config(), tight).train.loss_chunk == 0


def test_a_compiled_model_is_planned_with_its_chunked_loss():
    """train.compile on compiles the model's blocks and keeps the chunked LM-head loss (train/compiling.py): the plan is
    the eager one's; only loss_chunk -1 counts every position's logits."""
    from sparklm.config import TrainConfig

    shapes = Shapes(layers=8, hidden=64, intermediate=256, vocab=32000, params=10**6, weight_bytes=4 * 10**6,
                    trainable=10**6, head_trains=True)
    eager, may_be_whole = memory.footprints(TrainConfig(loss_chunk=0), shapes, 256, 4)
    assert memory.footprints(TrainConfig(loss_chunk=0, compile="on"), shapes, 256, 4) == (eager, may_be_whole)
    whole, none = memory.footprints(TrainConfig(loss_chunk=-1), shapes, 256, 4)
    assert none is None and whole == may_be_whole
    assert whole.peak(8, False) > eager.peak(8, False)  # a 32k vocabulary's logits weigh more than chunks
    assert memory.chunks_loss(TrainConfig(compile="on")) and not memory.chunks_loss(TrainConfig(loss_chunk=-1))


# -- train.parallel: the plan replicates, shards, or says what would fit -------------------------------------------

def _decide(limit_gb: float, *, parallel: str = "auto", workers: int = 4, strategy: str = "ddp", lora: int = 0,
            base: str = "auto", init: str = ""):
    """The plan for a 360M-shaped model (SmolLM2-360M's layers) of 0.36e9 float32 parameters on ``workers`` ranks."""
    from sparklm.config import from_dict

    per_layer = 4 * 960 * 960 + 3 * 960 * 2560
    shapes = Shapes(layers=32, hidden=960, intermediate=2560, vocab=49152, params=32 * per_layer + 49152 * 960,
                    weight_bytes=4 * (32 * per_layer + 49152 * 960), trainable=32 * per_layer + 49152 * 960,
                    head_trains=True, heads=15, block_params=per_layer, root_params=49152 * 960)
    if lora:
        shapes = Shapes(**{**shapes.__dict__, "trainable": 32 * 7 * 2 * lora * 960, "head_trains": False})
    config = from_dict({"train": {"parallel": parallel, "workers": workers, "strategy": strategy, "batch_size": 1,
                                  "dtype": "float32", "attention": "sdpa", "grad_checkpoint": "on"},
                        "model": {"init_from": init}, "lora": {"r": lora, "base_dtype": base}})
    return memory.decide(config, shapes, 256, int(limit_gb * GB), "test")


def test_auto_replicates_where_a_replica_fits_and_shards_where_only_a_shard_does():
    roomy = _decide(24)
    assert roomy.parallel == "replicate" and roomy.replicated == 0
    tight = _decide(4)  # a replica's ~6 GB of weights and AdamW state does not fit 4 GB; a quarter of it does
    assert tight.parallel == "shard" and tight.replicated > 4 * GB * memory.HEADROOM > tight.estimate
    assert "sharded over the ranks (a replica: " in tight.describe()
    # the estimate: a quarter of the weights and states, the root's weights and two blocks' gathered
    replica = _decide(100, parallel="replicate").estimate
    assert tight.estimate < replica / 2
    # one rank cannot shard; average and DiLoCo replicate inside each worker
    assert _decide(24, workers=1).parallel == "replicate"
    with pytest.raises(SparklmError, match="replicated on 1 rank.*--lora-base-dtype|replicated on 1 rank"):
        _decide(4, workers=1)


def test_a_plan_that_fits_nowhere_is_one_line_naming_what_would():
    with pytest.raises(SparklmError) as e:
        _decide(4, parallel="replicate")  # asked to replicate what only fits sharded: never an out-of-memory kill
    line = e.value.one_line()
    assert "replicated on 4 ranks" in line and "--parallel shard" in line and "\n" not in line
    with pytest.raises(SparklmError) as e:
        _decide(1, init="base")  # not even sharded over 4: LoRA, more workers, more memory
    line = e.value.one_line()
    assert "sharded over 4 ranks" in line and "--lora-r 8" in line and "more workers" in line
    with pytest.raises(SparklmError) as e:
        _decide(4, strategy="diloco", lora=0)
    assert "--strategy ddp --parallel shard" in e.value.one_line()
    with pytest.raises(SparklmError, match="train.parallel shard is for the strategy ddp, not average"):
        _decide(24, parallel="shard", strategy="average")
    with pytest.raises(SparklmError) as e:
        _decide(0.9, lora=8, base="bfloat16", init="base", workers=1)
    assert "--lora-base-dtype nf4" in e.value.one_line()


def test_a_4_bit_base_counts_its_blocks_at_half_a_byte():
    shapes = Shapes(layers=2, hidden=64, intermediate=256, vocab=1000, params=10**6, weight_bytes=4 * 10**6,
                    trainable=10**4, head_trains=False, block_params=4 * 10**5, root_params=2 * 10**5)
    from sparklm.config import from_dict

    nf4 = memory.base_bytes(from_dict({"lora": {"r": 4, "base_dtype": "nf4"}}), shapes)
    bf16 = memory.base_bytes(from_dict({"lora": {"r": 4, "base_dtype": "bfloat16"}}), shapes)
    assert bf16 == 4 * 10**4 + 2 * (10**6 - 10**4)
    frozen_blocks = 8 * 10**5
    assert nf4 == int(4 * 10**4 + memory.NF4_BYTES * frozen_blocks + 2 * (10**6 - 10**4 - frozen_blocks))
    assert nf4 < bf16 / 2
