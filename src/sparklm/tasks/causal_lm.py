"""Next-token prediction with a decoder: sparklm's own model from ``[model]`` (fitted to the time budget) or a
pretrained one (``--init-from``: any local Hugging Face causal LM or GGUF file), full or LoRA.

The whole task is this module: its model and loss on the model/ building blocks (build.py's models, lm_head.py's
chunked loss, LoRA, attention), its figures (loss, perplexity, bits per byte, accuracy: model/figures.py's, which
evaluation shares), what a run leaves besides model/ (samples.txt: continuations of validation prompts) and its
section of report.html. torch is imported where a model is built.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..config import Config, StorageConfig, embedding_rows
from ..data.tokenizer import TokenizerSpec
from ..infra.errors import SparklmError
from ..infra.fs import join, write_text
from ..model.figures import LM_FIGURES, lm_figures
from ..model.task import IGNORE, Batch, loss_chunk, loss_fused, make_batch, set_loss_chunks, targets
from ..registry import DataKind, TaskInfo

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class CausalLM:
    """Next-token prediction with an HF causal LM (built from config, or continued from a directory)."""

    name = "causal-lm"
    figure_set = LM_FIGURES
    eval_width = 4  # nats, tokens, correct, bytes
    base: str = ""  # the pretrained model LoRA adapts (named in the exported adapter's config)
    chunk: int = 0  # train.loss_chunk: positions per chunk of the LM-head loss; 0: by the vocabulary; -1: off
    # how the exported model samples by default (infer/sampling.py's Sampling; None: transformers' defaults), and
    # whether the run leaves text samples (samples.txt): a run's task (from_config) does, a bare one (a test) not
    sampling: Any = field(default=None, compare=False)
    samples: bool = field(default=False, compare=False)

    @classmethod
    def from_config(cls, config: Config) -> CausalLM:
        from ..infer.sampling import Sampling

        return cls(base=config.model.init_from, chunk=config.train.loss_chunk, sampling=Sampling(), samples=True)

    def build(self, config: Config, spec: TokenizerSpec, context: int) -> torch.nn.Module:
        import torch

        from ..model import lora
        from ..model.build import build_model, load_model

        vocab = spec.vocab_size
        if config.model.init_from:
            if config.lora.r and config.lora.base_dtype == "nf4":
                from ..model import nf4

                shards = config.train.workers if config.train.parallel == "shard" else 1
                model = nf4.load(config.model.init_from, config.storage, shards)  # quantized tensor by tensor as read
            else:
                dtype = torch.bfloat16 if config.lora.r and config.lora.base_dtype == "bfloat16" else None
                model = load_model(config.model.init_from, dtype=dtype, storage=config.storage)
            have = model.get_input_embeddings().weight.shape[0]
            if have < vocab:
                raise SparklmError(f"{config.model.init_from} has a vocabulary of {have} tokens, the data's tokenizer "
                                   f"{vocab}", hint="prepare the data with --tokenizer pointing at that model's tokenizer")
        elif config.lora.r:
            raise lora.no_base()
        else:
            model = build_model(config.model, vocab_size=embedding_rows(vocab), context=context,
                                bos_id=spec.bos_id, eos_id=spec.eos_id, pad_id=spec.pad_id, seed=config.train.seed)
        return self._trainable(model, config)

    def build_empty(self, config: Config, spec: TokenizerSpec, context: int):
        """The pretrained model without its weights, on the meta device (its buffers real), and the directory whose
        safetensors files hold them: a sharded run reads each rank's part itself (train/shard.materialize). None
        where the weights must be built otherwise (from scratch, LoRA's base, an adapter or a GGUF file)."""
        import torch

        from ..model.build import ADAPTER_CONFIG, check_causal, check_model_dir, model_source, verify_checksums

        name = config.model.init_from
        if not name or config.lora.r or name.lower().endswith(".gguf"):
            return None
        path = model_source(name, config.storage)
        if (path / ADAPTER_CONFIG).is_file():
            return None
        check_causal(check_model_dir(path, name), name)
        verify_checksums(path)
        from accelerate import init_empty_weights
        from transformers import AutoConfig, AutoModelForCausalLM

        try:
            hf = AutoConfig.from_pretrained(str(path), local_files_only=True, trust_remote_code=False)
            with init_empty_weights(include_buffers=False):  # buffers (rotary frequencies) are computed, not read
                model = AutoModelForCausalLM.from_config(hf, dtype=torch.float32)
            model.tie_weights()  # (from_pretrained ties them as it loads; a sharded model must share one before)
        except Exception as e:
            raise SparklmError(f"cannot load the model in {name}: {' '.join(str(e).split())[:200]}") from None
        if model.get_input_embeddings().weight.shape[0] < spec.vocab_size:
            raise SparklmError(f"{name} has a vocabulary of {model.get_input_embeddings().weight.shape[0]} tokens, the "
                               f"data's tokenizer {spec.vocab_size}",
                               hint="prepare the data with --tokenizer pointing at that model's tokenizer")
        return self._trainable(model, config, probe=False), path

    def weights_loaded(self, model: torch.nn.Module) -> None:
        """What :meth:`build_empty`'s model decides once its weights are read: whether the chunked LM-head loss
        equals its own (a forward pass: a sharded model's ranks run it together)."""
        from ..model import lm_head

        chunked = self.chunk >= 0 and lm_head.supports(model)
        set_loss_chunks(model, self.chunk if chunked else None)

    def _trainable(self, model: torch.nn.Module, config: Config, *, probe: bool = True) -> torch.nn.Module:
        """``model`` set up to train as ``config`` says: checkpointing, the attention kernel, LoRA, the chunked loss."""
        import torch

        from ..model import attention, lora

        if config.train.grad_checkpoint == "on":  # "auto" was resolved by the memory plan (train/memory.py)
            # non-reentrant: works with frozen inputs (LoRA) and needs no inputs that require grad
            if hasattr(model, "activation_checkpointing_enable"):  # transformers 5's name
                model.activation_checkpointing_enable({"use_reentrant": False})
            else:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False  # training never reuses keys and values
        if config.train.attention == "matmul":  # for this process only: saved configs keep naming SDPA
            model.config._attn_implementation = attention.register()
        if config.lora.r:
            torch.manual_seed(config.train.seed)  # the adapters' initial weights, the same in every process
            model = lora.wrap(model, config.lora)
        if probe:
            self.weights_loaded(model)
        return model

    def batch(self, rows: tuple) -> Batch:
        return make_batch(*rows[:3])

    def weight(self, batch: Batch) -> int:
        return targets(batch)

    def loss(self, net: torch.nn.Module, batch: Batch, total: int | None = None,
             tally: torch.Tensor | None = None) -> torch.Tensor:
        """The summed next-token loss of ``batch`` divided by ``total`` targets (default: the batch's own), so that
        micro-batches of a step weigh by the targets they hold (instruction data: response tokens only); a batch
        without any target gives a zero that still reaches every parameter (DDP expects every gradient)."""
        import torch

        from ..model import lm_head

        n = targets(batch)
        chunk = loss_chunk(net)
        if chunk is not None:  # the head's loss a chunk of positions at a time (model/lm_head.py)
            with lm_head.hidden_states(net) as box:
                net(input_ids=batch.input_ids, attention_mask=batch.attention_mask)
            nats = lm_head.nll_sum(box["hidden"], lm_head.head_of(net), batch.labels, chunk, tally,
                                   fused=loss_fused(net))
            return nats / (total or max(n, 1))
        out = net(input_ids=batch.input_ids, attention_mask=batch.attention_mask, labels=batch.labels)
        if tally is not None:
            with torch.no_grad():
                want = batch.labels[:, 1:]
                keep = want != IGNORE
                # max's indices, not argmax: the same first-maximum index, and on the CPU 4x faster on bf16 logits
                # (argmax converts them; 30 against 7 ms for 16 x 256 x 4096, ~5% of a compiled bf16 step)
                tally[0] += (out.logits[:, :-1].max(-1).indices[keep] == want[keep]).sum()
                tally[1] += keep.sum()
        if n == 0:
            return out.logits.sum() * 0.0
        return out.loss * (n / (total or n))

    def eval_sums(self, model: torch.nn.Module, batch: Batch, byte_lengths: torch.Tensor) -> torch.Tensor:
        import torch

        from ..model import lm_head

        # the targets the loss counts: labels are IGNORE on padding and on tokens whose loss mask is 0
        mask = batch.attention_mask if batch.attention_mask is not None else torch.ones_like(batch.input_ids)
        chunk = loss_chunk(model)
        return lm_head.score(model, batch.input_ids, mask, batch.labels[:, 1:] != IGNORE, byte_lengths,
                             chunk=chunk or 0, chunked=chunk is not None)

    def figures(self, sums: list[float]) -> dict:
        """val_loss (nats per target token), val_ppl, val_bpb (bits per byte of text), val_acc, val_tokens from
        summed [nats, tokens, correct, bytes]."""
        return self.figure_set.named(lm_figures(*sums))

    def flops_per_token(self, model: torch.nn.Module, seq_len: int) -> float:
        from ..model.build import flops_per_token

        return flops_per_token(model, seq_len)

    def trainable(self, model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
        return {n: p for n, p in model.named_parameters() if p.requires_grad}

    def decays(self, model: torch.nn.Module) -> set[int]:
        """Weight decay on matrices, not on norms, biases or the embedding table."""
        embed = id(model.get_input_embeddings().weight)
        return {id(p) for p in model.parameters() if p.dim() >= 2 and id(p) != embed}

    def matrices(self, model: torch.nn.Module) -> set[int]:
        """The hidden weight matrices (attention, MLP): what Muon optimizes; not the embedding or the LM head."""
        ends = {id(model.get_input_embeddings().weight), id(model.get_output_embeddings().weight)}
        return {id(p) for p in model.parameters() if p.dim() == 2 and id(p) not in ends}

    streams_export = True  # export(weights=...) takes a writer of the weights (a sharded model's, gathered as written)

    def export(self, model: torch.nn.Module, spec: TokenizerSpec, uri: str, storage: StorageConfig, *,
               weights: Callable[[Path], None] | None = None) -> None:
        """An HF model directory (config, model.safetensors, tokenizer files, generation config), or with LoRA
        the adapter in PEFT format naming its base, with the tokenizer files. ``weights``: what writes the weights'
        files into the directory instead of ``save_pretrained`` (which would need the whole model here)."""
        from ..infra.fs import CHECKSUMS, staged_dir, write_checksums
        from ..model import lora
        from ..model.build import context_length

        gc = model.generation_config
        gc.bos_token_id = spec.bos_id if spec.add_bos else None
        gc.eos_token_id = spec.eos_id
        gc.pad_token_id = spec.pad_id
        default = self.sampling
        if default is not None:  # what `sparklm generate` does by default: pipeline("text-generation") samples alike
            gc.do_sample = default.temperature > 0
            gc.temperature, gc.top_k, gc.top_p = default.temperature, default.top_k, default.top_p
            gc.min_p, gc.repetition_penalty = default.min_p, default.repetition_penalty
        context = context_length(model.config)
        if default is not None:
            gc.max_new_tokens = default.fitted(context).max_new_tokens
        with staged_dir(uri, storage, marker=CHECKSUMS) as tmp:
            if lora.is_lora(model):
                lora.save(model, tmp, base_name(self.base))
            else:
                model.config.use_cache = True  # for generation by whoever loads it
                if weights is None:
                    model.save_pretrained(str(tmp), safe_serialization=True)
                else:
                    model.config.save_pretrained(str(tmp))
                    gc.save_pretrained(str(tmp))
                    weights(tmp)
                model.config.use_cache = False
            spec.save(tmp, context=context)
            # peft writes a blank model card template; the run writes its own card (README.md) once it knows its figures
            (tmp / "README.md").unlink(missing_ok=True)
            write_checksums(tmp)

    def artefacts(self, model: torch.nn.Module, spec: TokenizerSpec, run_dir: str, dataset, config: Config, *,
                  write: bool = True) -> None:
        """samples.txt: continuations of validation prompts (train.samples of them). ``write`` False: a sharded
        model's other ranks, which compute the same samples with rank 0 (each forward gathers every rank's
        shards), and write nothing."""
        if self.samples:
            write_samples(model, spec, run_dir, dataset, config, write=write)


def base_name(init_from: str) -> str:
    """How an adapter names its base: an object store URI as given, a local path absolute (so it loads from
    anywhere on this host)."""
    from ..infra.fs import is_remote

    return init_from if is_remote(init_from) else str(Path(init_from).expanduser().resolve())


def write_samples(model, spec, run_dir: str, dataset, config, *, write: bool = True) -> None:
    """samples.txt: a few sampled continuations (sparklm's default sampling) of fixed prompts (openings of
    validation documents), written by the worker that holds the final model."""
    from ..infer.generate import LoadedModel, generate
    from ..infer.sampling import Sampling

    tc = config.train
    context = dataset.seq_len
    new_tokens = min(tc.sample_tokens, context // 2)  # leave the prompt room within the context
    if not tc.samples or new_tokens < 1:
        return
    tok = spec.hf()
    prompts = sample_prompts(dataset, tok, tc.samples, config)
    lm = LoadedModel(model.eval(), tok, join(run_dir, "model"), context, add_bos=spec.add_bos)
    sampling = Sampling(max_new_tokens=new_tokens, seed=tc.seed)
    lines = [f"# {len(prompts)} samples: temperature {sampling.temperature}, top-k {sampling.top_k}, "
             f"min-p {sampling.min_p}, "
             f"{new_tokens} new tokens (seed {tc.seed})\n"]
    for g in generate(lm, prompts, sampling=sampling, warn=False):
        lines.append(f"--- prompt: {g.prompt!r}\n{g.prompt}{g.text}\n")
    if write:
        write_text(join(run_dir, "samples.txt"), "\n".join(lines), config.storage)


def sample_prompts(dataset, tok, n: int, config) -> list[str]:
    """The first words of the first validation documents of some length (or training ones): prompts in the
    corpus's voice, not title-page fragments; "The" where too few documents qualify."""
    from ..data.stream import read_rows, row_groups

    # a document starts after its BOS, or (a tokenizer without one) after the previous document's EOS
    start = tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id
    eos = tok.eos_token_id
    prompts: list[str] = []
    for split in ("validation", "train"):
        for group in row_groups(dataset.files(split), config.storage)[:4]:
            ids = read_rows(group, dataset.seq_len, config.storage).input_ids
            for row in ids.tolist():
                for i, t in enumerate(row[:-31]):
                    if t == start and eos not in row[i + 1:i + 31]:
                        words = tok.decode(row[i + 1:i + 7]).split()
                        if len(words) >= 2:
                            prompts.append(" ".join(words[:4]))
                if len(prompts) >= n:
                    return prompts[:n]
    return (prompts + ["The"] * n)[:n]


def section(run) -> list[str]:
    """report.html: the run's samples.txt."""
    from ..metrics.html_report import esc

    return ["<h2>Samples</h2>", f"<pre>{esc(run.samples)}</pre>" if run.samples else
            "<p class=note>No samples.txt (train.samples = 0, or the run did not end).</p>"]


def make(config: Config) -> CausalLM:
    return CausalLM.from_config(config)


INFO = TaskInfo(name="causal-lm", figures=LM_FIGURES, make=make, prepares=DataKind(rows="packed"), generates=True,
                shows="samples.txt", section=section)
