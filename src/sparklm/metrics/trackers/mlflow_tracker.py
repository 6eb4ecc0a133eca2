"""MLflow: one MLflow run per sparklm command (however many workers train), with the resolved settings as
parameters, every row's figures as metrics at their step, the run directory's files as artifacts and the trained
model in MLflow's ``transformers`` flavor with a signature, so that ``mlflow.pyfunc.spark_udf`` scores a
DataFrame with it and the model registry takes it.

Talks to the tracking server through ``MlflowClient`` (explicit run ids: a notebook's active MLflow run is left
alone), except for the model, which MLflow's flavor logs into the active run: that run is ours for the call.
"""

from __future__ import annotations

import os
import re
import tempfile
import time
from pathlib import Path

from ...config import TrackingConfig
from ...infra import progress, redact
from ...infra.errors import SparklmError
from ...infra.fs import exists, inside, join, read_bytes
from ..rows import Row
from . import Buffered, Context, numbers, short, summary_figures

BATCH = 1000  # MLflow's log_batch takes at most 1000 metrics and 100 parameters per call
PARAMS_PER_BATCH = 100
PARAM_CHARS = 500  # the longest parameter value every MLflow server version accepts


def check(tc: TrackingConfig) -> None:
    if re.match(r"^[a-z][a-z0-9+.-]*://[^/@]*:[^/@]*@", tc.mlflow_uri, re.I):
        raise SparklmError("the MLflow URI holds a password, which sparklm would save in the run's config.json",
                           hint="give the URI without it and set MLFLOW_TRACKING_USERNAME and "
                                "MLFLOW_TRACKING_PASSWORD (or MLFLOW_TRACKING_TOKEN) in the environment")


def tracking_uri(tc: TrackingConfig) -> str:
    """``--mlflow`` alone means MLFLOW_TRACKING_URI, else MLflow's own default."""
    if tc.mlflow_uri != "default":
        return tc.mlflow_uri
    import mlflow

    return os.environ.get("MLFLOW_TRACKING_URI") or mlflow.get_tracking_uri()


def open_tracker(tc: TrackingConfig, ctx: Context) -> MlflowTracker:
    # MLflow's client retries an unreachable server for minutes by default; a wrong URI should fail in seconds
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "30")
    from mlflow import MlflowClient

    uri = tracking_uri(tc)
    try:
        client = MlflowClient(tracking_uri=uri)
        experiment = client.get_experiment_by_name(tc.mlflow_experiment)
        exp_id = experiment.experiment_id if experiment else client.create_experiment(tc.mlflow_experiment)
        run_id = _resumed_run(client, exp_id, ctx) if ctx.resume else None
        if run_id is None:
            nested = {"mlflow.parentRunId": ctx.parent["mlflow"]} if "mlflow" in ctx.parent else {}
            run_id = client.create_run(exp_id, run_name=ctx.name, tags={
                "sparklm.command": ctx.command, "sparklm.run_dir": redact.value(ctx.run_dir),
                "mlflow.source.name": f"sparklm {ctx.command}", "mlflow.source.type": "JOB", **nested}).info.run_id
            _log_params(client, run_id, ctx.params)
        else:
            client.update_run(run_id, status="RUNNING")
    except SparklmError:
        raise
    except Exception as e:
        raise SparklmError(f"cannot open an MLflow run at {uri}: {short(e)}",
                           hint="check --mlflow URI (is the tracking server up?) and its credentials") from None
    progress.info(f"MLflow: run {run_id} in experiment '{tc.mlflow_experiment}' at {uri}")
    return MlflowTracker(client, run_id, uri, tc, ctx)


def _resumed_run(client, exp_id: str, ctx: Context) -> str | None:
    """The MLflow run an earlier attempt of this run directory opened: a resumed run continues its history."""
    quoted = ctx.run_dir.replace("\\", "\\\\").replace("'", "\\'")
    found = client.search_runs([exp_id], filter_string=f"tags.`sparklm.run_dir` = '{quoted}' and "
                                                       f"tags.`sparklm.command` = '{ctx.command}'",
                               order_by=["attributes.start_time DESC"], max_results=1)
    return found[0].info.run_id if found else None


def _log_params(client, run_id: str, params: dict) -> None:
    from mlflow.entities import Param

    items = [Param(k, _param_value(v)) for k, v in sorted(params.items())]
    for i in range(0, len(items), PARAMS_PER_BATCH):
        client.log_batch(run_id, params=items[i:i + PARAMS_PER_BATCH])


def _param_value(v) -> str:
    text = str(v)
    return text if len(text) <= PARAM_CHARS else text[:PARAM_CHARS - 1] + "…"


class MlflowTracker(Buffered):
    label = "MLflow"

    def __init__(self, client, run_id: str, uri: str, tc: TrackingConfig, ctx: Context):
        super().__init__()
        self.client, self.run_id, self.uri, self.tc, self.ctx = client, run_id, uri, tc, ctx

    def parent_ref(self) -> dict[str, str]:
        """A search's run: its trials' runs are its children (MLflow's ``mlflow.parentRunId``)."""
        return {"mlflow": self.run_id}

    def _send(self, rows: list[tuple[int, Row]]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self._log_metrics([Metric(key, value, now, step) for step, row in rows for key, value in numbers(row).items()])

    def _log_summary(self, summary: dict) -> None:
        from mlflow.entities import Metric

        now, step = int(time.time() * 1000), int(summary.get("steps") or 0)
        self._log_metrics([Metric(f"summary/{k}", v, now, step) for k, v in summary_figures(summary).items()])

    def _log_metrics(self, metrics: list) -> None:
        for i in range(0, len(metrics), BATCH):
            self.client.log_batch(self.run_id, metrics=metrics[i:i + BATCH])

    def _end(self, ok: bool) -> None:
        self.client.set_terminated(self.run_id, status="FINISHED" if ok and not self.failed else "FAILED")

    def _log_files(self) -> None:
        with tempfile.TemporaryDirectory(prefix="sparklm-mlflow-") as tmp:
            for name in self.ctx.files():
                uri = join(self.ctx.run_dir, name)
                if exists(uri, self.ctx.storage):
                    dest = inside(Path(tmp), name, what="a run file")
                    dest.parent.mkdir(parents=True, exist_ok=True)
                    dest.write_bytes(read_bytes(uri, self.ctx.storage))
            self.client.log_artifacts(self.run_id, tmp)

    def _log_model(self, model_dir: str) -> None:
        """The model as a ``text-generation`` pipeline in MLflow's transformers flavor (a LoRA run's adapter merged
        into its base: the logged model stands alone), with sparklm's sampling defaults as its inference config; an
        encoder's as the pipeline its task names (``text-classification``: a label and a score per text)."""
        if self.ctx.task.pipeline != "text-generation":
            self._log_pipeline(model_dir, self.ctx.task.pipeline)
            return
        import transformers
        from mlflow.models import ModelSignature
        from mlflow.types import ColSpec, ParamSchema, ParamSpec, Schema

        from ...infer.sampling import Sampling
        from ...model.build import context_length, load_model, model_source

        model = load_model(model_dir, storage=self.ctx.storage)
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(model_source(model_dir, self.ctx.storage)),
                                                               local_files_only=True, trust_remote_code=False)
        pipe = transformers.pipeline("text-generation", model=model, tokenizer=tokenizer, trust_remote_code=False)
        d = Sampling().fitted(context_length(model.config))
        inference = {"max_new_tokens": d.max_new_tokens,
                     "do_sample": True, "temperature": d.temperature, "top_k": d.top_k}
        # spelled out, not inferred: MLflow's inference imports pyspark.sql.connect, which exits the process
        # when Spark Connect's packages are missing and __main__ has no file (pytest-xdist workers, some notebooks)
        types = {int: "long", float: "double", bool: "boolean"}
        signature = ModelSignature(inputs=Schema([ColSpec("string")]), outputs=Schema([ColSpec("string")]),
                                   params=ParamSchema([ParamSpec(k, types[type(v)], v) for k, v in inference.items()]))
        requirements = _requirements()
        self._log_pipe(pipe, "text-generation", signature, model_config=inference, pip_requirements=requirements)

    def _log_pipeline(self, model_dir: str, task: str) -> None:
        """An encoder's model/ (a plain HF directory: merged weights) as the transformers pipeline ``task``."""
        import transformers

        from ...model.build import model_source

        path = str(model_source(model_dir, self.ctx.storage))
        pipe = transformers.pipeline(task, model=path, tokenizer=path, device="cpu", trust_remote_code=False)
        self._log_pipe(pipe, task, _pipeline_signature(task), pip_requirements=_requirements())

    def _log_pipe(self, pipe, task: str, signature, **extra) -> None:
        """``pipe`` into this run in MLflow's transformers flavor (registered when tracking.mlflow_register says)."""
        import mlflow

        before = mlflow.get_tracking_uri()
        mlflow.set_tracking_uri(self.uri)
        try:
            with mlflow.start_run(run_id=self.run_id):
                mlflow.transformers.log_model(transformers_model=pipe, name="model", task=task, signature=signature,
                                              registered_model_name=self.tc.mlflow_register or None, **extra)
        finally:
            mlflow.set_tracking_uri(before)


def _pipeline_signature(task: str):
    from mlflow.models import ModelSignature
    from mlflow.types import ColSpec, Schema

    outputs = (Schema([ColSpec("string", "label"), ColSpec("double", "score")]) if task == "text-classification"
               else Schema([ColSpec("string")]))
    return ModelSignature(inputs=Schema([ColSpec("string")]), outputs=outputs)


def _requirements() -> list[str]:
    import torch
    import transformers

    return [f"torch=={torch.__version__.split('+')[0]}", f"transformers=={transformers.__version__}",
            f"tokenizers=={_version('tokenizers')}", f"safetensors=={_version('safetensors')}"]


def _version(package: str) -> str:
    from importlib.metadata import version

    return version(package)
