"""Scoring with encoders over a Spark DataFrame: text classification and embeddings.

``classify_dataframe`` and ``embed_dataframe`` are lazy DataFrame transformations that keep the input columns and
add the model's answer per row. The model is any local or object-store HF directory (a sparklm run's ``model/``
too): executors copy an object store's once per host (``fs.local_copy``) and load it once per Python worker
(``cache.process_local``). Within an Arrow batch, texts are scored in length order, so a batch pads to its
longest text only; the answers go back to the rows' order, so the result does not depend on partitioning or
batching. Texts longer than the model's positions are truncated, and the row says so (``truncated``).

What HF's ``pipeline("text-classification")`` does is what ``classify_texts`` does: softmax over the labels
(sigmoid for one label or multi-label problems), the label ``id2label`` names, its probability as the score.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ..config import StorageConfig
from ..infra.cache import process_local
from ..infra.errors import SparklmError
from ..infra.fs import effective, version
from ..model.encoders import positions
from ..spark.frames import check_columns
from ..spark.resources import check_batching, task_device
from ..spark.session import check_workers_python

POOLINGS = ("mean", "cls", "last")


@dataclass
class Encoder:
    model: torch.nn.Module
    tokenizer: object
    max_length: int  # tokens a text may have, special tokens included
    labels: list[str] | None  # classification: the names of the outputs, in order (id2label)
    sigmoid: bool = False  # classification: independent labels (multi-label, or one output) instead of a softmax
    regression: bool = False  # the head's outputs are values (problem_type "regression"): no softmax, no label


def load_encoder(path: str, *, classify: bool, threads: int = 0, storage: StorageConfig | None = None,
                 device: str = "auto") -> Encoder:
    """An HF model directory (safetensors only: nothing is unpickled) as a classifier (its sequence-classification
    head) or an encoder (the base model's hidden states), on ``device`` (generate.inference_device); one line when it
    cannot be."""
    from transformers import AutoConfig, AutoModel, AutoModelForSequenceClassification
    from transformers.utils import logging as hf_logging

    from ..data.tokenizer import hf_tokenizer
    from ..infra.fs import verify_checksums
    from ..model.build import check_model_dir
    from .generate import inference_device, model_dir

    hf_logging.disable_progress_bar()
    if threads:
        torch.set_num_threads(threads)
    directory = model_dir(path, storage)
    check_model_dir(directory, path)
    verify_checksums(directory)
    tokenizer = hf_tokenizer(directory, path)
    config = AutoConfig.from_pretrained(str(directory), local_files_only=True, trust_remote_code=False)
    if classify:  # from_pretrained would add a randomly initialised head and answer at random
        require_head(path, config.architectures)
    cls = AutoModelForSequenceClassification if classify else AutoModel
    try:
        model = cls.from_pretrained(str(directory), local_files_only=True, trust_remote_code=False,
                                    use_safetensors=True, dtype=torch.float32).eval()
    except Exception as e:
        raise SparklmError(f"cannot load {path} as a {'text classifier' if classify else 'text encoder'}: "
                           f"{' '.join(str(e).split())[:200]}") from None
    if not classify and getattr(model.config, "is_encoder_decoder", False):
        model = model.get_encoder()  # T5, BART: the whole model wants decoder inputs; its encoder embeds (sentence-T5)
    if (where := inference_device(device)) != "cpu":
        model = model.to(where)
    if tokenizer.pad_token_id is None:  # decoders often have none: batches pad with end-of-text, masked out
        tokenizer.pad_token = tokenizer.eos_token
    labels = None
    if classify:
        n = model.config.num_labels
        labels = [str(model.config.id2label.get(i, f"LABEL_{i}")) for i in range(n)]
    # as transformers' text-classification pipeline reads a head: values, independent labels, or a softmax
    regression = classify and model.config.problem_type == "regression"
    sigmoid = classify and not regression and (model.config.problem_type == "multi_label_classification"
                                               or model.config.num_labels == 1)
    return Encoder(model, tokenizer, max_positions(model.config, tokenizer), labels, sigmoid, regression)


def max_positions(config, tokenizer) -> int:
    """The longest input the model takes: its position table (less the padding offset where positions start after
    it, as RoBERTa's do), or the tokenizer's limit when that is smaller and sane."""
    n = positions(config.to_dict()) or 512
    limit = getattr(tokenizer, "model_max_length", None)
    return int(min(n, limit)) if isinstance(limit, int) and 0 < limit < 1_000_000 else int(n)


def length_order(lengths: Sequence[int]) -> list[int]:
    """Indices from the longest text to the shortest (stable): consecutive batches pad little."""
    return sorted(range(len(lengths)), key=lambda i: -lengths[i])


def pool(hidden: torch.Tensor, mask: torch.Tensor, pooling: str) -> torch.Tensor:
    """One vector per sequence from hidden states (B, T, D) and the attention mask (B, T): ``mean`` over the real
    tokens, ``cls`` the first position (BERT's [CLS], RoBERTa's <s>), ``last`` the last real token (a decoder's
    summary of the whole text, whichever side it was padded on)."""
    if pooling == "mean":
        m = mask.unsqueeze(-1).to(hidden.dtype)
        return (hidden * m).sum(1) / m.sum(1).clamp(min=1)
    if pooling == "cls":
        return hidden[:, 0]
    if pooling == "last":
        pos = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
        last = torch.where(mask.bool(), pos, torch.full_like(pos, -1)).max(dim=1).values.clamp(min=0)
        return hidden[torch.arange(hidden.shape[0]), last]
    raise ValueError(f"pooling {pooling!r}: one of {', '.join(POOLINGS)}")


def _batches(enc: Encoder, texts: list[str], batch_size: int):
    """(indices, tokenized batch, truncated flags) in length order, the texts cut to the model's positions."""
    if not texts:  # a tokenizer given no text fails (IndexError) instead of returning nothing
        return
    lengths = [len(ids) for ids in enc.tokenizer(texts, add_special_tokens=True, verbose=False)["input_ids"]]
    order = length_order(lengths)
    for start in range(0, len(order), batch_size):
        idx = order[start:start + batch_size]
        batch = enc.tokenizer([texts[i] for i in idx], padding=True, truncation=True, max_length=enc.max_length,
                              return_tensors="pt").to(enc.model.device)
        yield idx, batch, [lengths[i] > enc.max_length for i in idx]


@torch.no_grad()
def classify_texts(enc: Encoder, texts: list[str], *, batch_size: int = 32) -> tuple[np.ndarray, list[bool]]:
    """Probabilities (texts × labels, float32) for each text, and whether it was truncated; a regression head's
    values as they are."""
    probs = np.zeros((len(texts), len(enc.labels or [])), np.float32)
    truncated = [False] * len(texts)
    for idx, batch, cut in _batches(enc, texts, batch_size):
        logits = enc.model(**batch).logits.float()
        p = logits if enc.regression else torch.sigmoid(logits) if enc.sigmoid else torch.softmax(logits, dim=-1)
        probs[idx] = p.cpu().numpy()
        for i, c in zip(idx, cut):
            truncated[i] = c
    return probs, truncated


@torch.no_grad()
def embed_texts(enc: Encoder, texts: list[str], *, pooling: str = "mean", normalize: bool = False,
                batch_size: int = 32) -> tuple[np.ndarray, list[bool]]:
    """An embedding per text (texts × hidden size, float32), pooled from the last hidden states, and whether it was
    truncated; ``normalize``: scaled to unit length (cosine similarity = dot product)."""
    width = enc.model.config.hidden_size
    out = np.zeros((len(texts), width), np.float32)
    truncated = [False] * len(texts)
    for idx, batch, cut in _batches(enc, texts, batch_size):
        hidden = enc.model(**batch).last_hidden_state
        v = pool(hidden, batch["attention_mask"], pooling)
        if normalize:
            v = torch.nn.functional.normalize(v, dim=-1)
        out[idx] = v.float().cpu().numpy()
        for i, c in zip(idx, cut):
            truncated[i] = c
    return out, truncated


def classify_dataframe(df, *, model: str, text_col: str = "text", label_col: str = "label", score_col: str = "score",
                       probabilities_col: str | None = None, batch_size: int = 32, threads: int = 0,
                       storage: StorageConfig | None = None):
    """``df`` with its columns kept and per row: ``label_col`` (the most likely label's name), ``score_col`` (its
    probability), ``truncated``, and with ``probabilities_col`` every label's probability (in the model's label
    order); a regression model's ``score_col`` is its value, and ``label_col`` null. A null or blank text gets
    nulls. Lazy: nothing runs until an action."""
    from pyspark.sql import types as T

    added = [T.StructField(label_col, T.StringType()), T.StructField(score_col, T.DoubleType()),
             T.StructField("truncated", T.BooleanType())]
    if probabilities_col:
        added.append(T.StructField(probabilities_col, T.ArrayType(T.DoubleType())))
    check_columns(df, text_col, "text_col", added, "classify_dataframe")
    check_batching(batch_size, threads)
    storage = effective(storage or StorageConfig())
    path = _model_path(model, storage, classify=True)

    def answer(enc: Encoder, texts: list[str]) -> dict:
        import pyarrow as pa

        probs, cut = classify_texts(enc, texts, batch_size=batch_size)
        best = probs.argmax(axis=1) if len(texts) else np.zeros(0, np.int64)
        names = [None] * len(best) if enc.regression else [enc.labels[b] for b in best]
        cols = {label_col: pa.array(names, pa.string()),
                score_col: pa.array(probs[np.arange(len(best)), best].astype(float), pa.float64()),
                "truncated": pa.array(cut, pa.bool_())}
        if probabilities_col:
            cols[probabilities_col] = pa.array(probs.astype(float).tolist(), pa.list_(pa.float64()))
        return cols

    return _answered(df, text_col, added, ("classifier", threads), path, storage,
                     lambda where: load_encoder(path, classify=True, threads=threads, storage=storage, device=where),
                     answer)


def embed_dataframe(df, *, model: str, text_col: str = "text", output_col: str = "embedding", pooling: str = "mean",
                    normalize: bool = False, batch_size: int = 32, threads: int = 0,
                    storage: StorageConfig | None = None):
    """``df`` with its columns kept and per row ``output_col`` (an array of floats: the pooled last hidden states;
    ``pooling`` mean, cls or last — last for a decoder such as a sparklm causal model) and ``truncated``. A null or
    blank text gets nulls. Lazy: nothing runs until an action."""
    from pyspark.sql import types as T

    if pooling not in POOLINGS:
        raise SparklmError(f"pooling {pooling!r} is not one of {', '.join(POOLINGS)}",
                           hint="mean (sentence-transformers' usual), cls (BERT's first token) or last (decoders)")
    added = [T.StructField(output_col, T.ArrayType(T.FloatType())), T.StructField("truncated", T.BooleanType())]
    check_columns(df, text_col, "text_col", added, "embed_dataframe")
    check_batching(batch_size, threads)
    storage = effective(storage or StorageConfig())
    path = _model_path(model, storage, classify=False)

    def answer(enc: Encoder, texts: list[str]) -> dict:
        import pyarrow as pa

        vecs, cut = embed_texts(enc, texts, pooling=pooling, normalize=normalize, batch_size=batch_size)
        return {output_col: pa.array(vecs.tolist(), pa.list_(pa.float32())), "truncated": pa.array(cut, pa.bool_())}

    return _answered(df, text_col, added, ("encoder", threads), path, storage,
                     lambda where: load_encoder(path, classify=False, threads=threads, storage=storage, device=where),
                     answer)


def _answered(df, text_col: str, added: list, key: tuple, path: str, storage: StorageConfig, load, answer):
    """``df`` with the ``added`` columns: in each Arrow batch the non-blank texts go to ``answer(encoder, texts)``
    (the encoder, ``load(device)``, loaded once per Python worker, GPU and version of the model at ``path``), which
    returns a column per added field, a value per text; rows with a null or blank text get nulls."""
    from pyspark.sql import types as T

    check_workers_python(df.sparkSession)

    def run(batches):
        import pyarrow as pa

        where = task_device()  # per GPU: a Python worker Spark reuses may be handed another
        enc = process_local((*key, path, version(path, storage), where), lambda: load(where))
        for rb in batches:
            texts = rb.column(text_col).to_pylist()
            todo = [i for i, t in enumerate(texts) if t is not None and t.strip()]
            at = {i: j for j, i in enumerate(todo)}
            rows = pa.array([at.get(i) for i in range(rb.num_rows)], pa.int64())  # null: no answer for the row
            cols = {name: values.take(rows) for name, values in answer(enc, [texts[i] for i in todo]).items()}
            yield pa.RecordBatch.from_arrays([*rb.columns, *cols.values()], [*rb.schema.names, *cols])

    return df.mapInArrow(run, T.StructType([*df.schema.fields, *added]))


def _model_path(model: str, storage: StorageConfig, *, classify: bool) -> str:
    """The model directory, checked on the driver (a missing model or head fails here, not in every task)."""
    import json

    from ..infra.fs import join, read_text
    from .generate import model_uri

    path = model_uri(model, storage)
    try:
        config = json.loads(read_text(join(path, "config.json"), storage))
    except (OSError, ValueError):
        raise SparklmError(f"{model} has no readable config.json", hint="pass an HF model directory") from None
    if classify:
        require_head(model, config.get("architectures"))
    return path


def require_head(name: str, architectures: list | None) -> None:
    """One line unless a model config's architectures include a sequence-classification head."""
    if not any(str(a).endswith("ForSequenceClassification") for a in architectures or []):
        raise SparklmError(f"{name} has no classification head (architectures: {', '.join(architectures or ['none'])})",
                           hint="pass a model fine-tuned for classification (an HF ...ForSequenceClassification), "
                                "or use embed_dataframe for its embeddings")
