"""Spark ML stages (``pyspark.ml``): in a ``Pipeline``, :class:`CausalLM` fits a causal language model on a DataFrame
of documents and the :class:`CausalLMModel` it returns continues a DataFrame of prompts.

They wrap :func:`sparklm.prepare`, :func:`sparklm.fit` and :func:`sparklm.generate_dataframe`; nothing is
duplicated. A saved model holds its stage's settings and a copy of the trained model directory, so it loads
where the run directory is gone.
"""

from __future__ import annotations

import time
import uuid

from pyspark import keyword_only
from pyspark.ml import Estimator, Model
from pyspark.ml.param import Param, Params, TypeConverters
from pyspark.ml.util import (
    DefaultParamsReadable,
    DefaultParamsReader,
    DefaultParamsWritable,
    DefaultParamsWriter,
    MLReadable,
    MLReader,
    MLWritable,
    MLWriter,
)

from .infra.errors import SparklmError


def _settings(value) -> dict:
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise TypeError(f"expected a dict of settings with str keys, got {type(value).__name__}")
    return dict(value)


class _Generation(Params):
    """What the fitted model's ``transform`` adds."""

    promptCol = Param(Params._dummy(), "promptCol", "column of prompts to continue", TypeConverters.toString)
    outputCol = Param(Params._dummy(), "outputCol", "column the continuations go to", TypeConverters.toString)
    sampling = Param(Params._dummy(), "sampling", "generation settings: sparklm.Sampling's fields "
                     "(max_new_tokens, temperature, top_k, top_p, min_p, repetition_penalty, num_samples, seed)",
                     _settings)



class CausalLM(Estimator, _Generation, DefaultParamsReadable, DefaultParamsWritable):
    """Prepares ``textCol`` (a row per document) under ``workDir`` and trains a causal LM there; ``settings`` are
    sparklm's dotted settings (``{"train.max_steps": 500, "data.seq_len": 256}``), for both steps."""

    textCol = Param(Params._dummy(), "textCol", "column of documents to train on", TypeConverters.toString)
    workDir = Param(Params._dummy(), "workDir", "directory (local or object store) for the prepared data and the "
                    "run directory of each fit", TypeConverters.toString)
    settings = Param(Params._dummy(), "settings", "sparklm settings as dotted keys", _settings)

    @keyword_only
    def __init__(self, *, textCol: str = "text", workDir: str | None = None, settings: dict | None = None,
                 promptCol: str = "prompt", outputCol: str = "generated", sampling: dict | None = None) -> None:
        super().__init__()
        self._setDefault(textCol="text", settings={}, promptCol="prompt", outputCol="generated", sampling={})
        self._set(**{k: v for k, v in self._input_kwargs.items() if v is not None})

    def _fit(self, dataset) -> CausalLMModel:
        from .api import fit, prepare

        if not self.isDefined(self.workDir):
            raise SparklmError("CausalLM needs workDir= for the prepared data and the run directory",
                               hint="e.g. CausalLM(workDir='s3://bucket/sparklm', textCol='body')")
        work, settings = self.getOrDefault(self.workDir).rstrip("/"), self.getOrDefault(self.settings)
        stamp = f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"  # one pair of directories per fit
        data = prepare(dataset, output=f"{work}/data-{stamp}", text_col=self.getOrDefault(self.textCol),
                       settings=settings)
        result = fit(data=data, output=f"{work}/run-{stamp}", settings=settings)
        model = CausalLMModel(runDir=result.run_dir)
        return self._copyValues(model)


class CausalLMModel(Model, _Generation, MLReadable, MLWritable):
    """Continues ``promptCol`` with the model of ``runDir`` (a run directory or an HF model directory), keeping the
    input's columns (:func:`sparklm.generate_dataframe`)."""

    runDir = Param(Params._dummy(), "runDir", "the trained model: a sparklm run directory or an HF model directory",
                   TypeConverters.toString)

    @keyword_only
    def __init__(self, *, runDir: str | None = None, promptCol: str = "prompt", outputCol: str = "generated",
                 sampling: dict | None = None) -> None:
        super().__init__()
        self._setDefault(promptCol="prompt", outputCol="generated", sampling={})
        self._set(**{k: v for k, v in self._input_kwargs.items() if v is not None})

    def _transform(self, dataset):
        from .infer.batch import generate_dataframe
        from .infer.sampling import Sampling

        return generate_dataframe(dataset, model=self.getOrDefault(self.runDir),
                                  prompt_col=self.getOrDefault(self.promptCol),
                                  output_col=self.getOrDefault(self.outputCol),
                                  sampling=Sampling(**self.getOrDefault(self.sampling)))

    def write(self) -> MLWriter:
        return _ModelWriter(self)

    @classmethod
    def read(cls) -> MLReader:
        return _ModelReader(cls)


class _ModelWriter(MLWriter):
    """The stage's settings (Spark ML's metadata) and a copy of the model directory beside them."""

    def __init__(self, instance: CausalLMModel) -> None:
        super().__init__()
        self.instance = instance

    def saveImpl(self, path: str) -> None:
        import pyarrow.fs as pafs

        from .infer.generate import model_uri
        from .infra.fs import exists, resolve

        if exists(path):  # overwrite() removed it before this; Spark's JVM stages refuse it in these words
            raise SparklmError(f"path {path} already exists",
                               hint="to replace it, save with model.write().overwrite().save(path)")
        DefaultParamsWriter.saveMetadata(self.instance, path, self.sparkSession)
        source_fs, source = resolve(model_uri(self.instance.getOrDefault(self.instance.runDir)))
        target_fs, target = resolve(f"{path.rstrip('/')}/model")
        target_fs.create_dir(target, recursive=True)
        pafs.copy_files(source, target, source_filesystem=source_fs, destination_filesystem=target_fs)


class _ModelReader(MLReader):
    def __init__(self, cls) -> None:
        super().__init__()
        self.cls = cls

    def load(self, path: str) -> CausalLMModel:
        metadata = DefaultParamsReader.loadMetadata(path, self.sparkSession)
        instance = self.cls()
        instance._resetUid(metadata["uid"])
        DefaultParamsReader.getAndSetParams(instance, metadata)
        return instance._set(runDir=f"{path.rstrip('/')}/model")
