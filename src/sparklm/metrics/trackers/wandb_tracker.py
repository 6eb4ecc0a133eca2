"""Weights & Biases: one W&B run per sparklm command with what the MLflow tracker logs: the resolved settings as
the run's config, every row's figures in its history, the closing figures in its summary, and the run
directory's files and the trained model as artifacts. ``WANDB_MODE=offline`` writes it all under
``RUN_DIR/wandb/`` (a temporary directory for an object-store run, uploaded at the end), for ``wandb sync`` later.

Rows are logged with their training step as a field (``step``), the x-axis of every chart: W&B's own step
only grows, and a round's evaluation arrives after the train rows of the round that follows it.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from ...config import TrackingConfig
from ...infra import progress
from ...infra.errors import SparklmError
from ...infra.fs import exists, inside, join, local_path, read_bytes, upload_tree
from ..rows import Row
from . import Buffered, Context, numbers, summary_figures

KINDS = ("train", "eval", "round")


def open_tracker(tc: TrackingConfig, ctx: Context) -> WandbTracker:
    import wandb

    here = local_path(ctx.run_dir)
    local = here if here is not None else Path(tempfile.mkdtemp(prefix="sparklm-wandb-"))
    local.mkdir(parents=True, exist_ok=True)
    resume_id = _resumed_id(local) if ctx.resume else None
    try:
        run = wandb.init(project=tc.wandb_project, name=ctx.name, dir=str(local), config=ctx.params,
                         job_type=ctx.command, tags=[f"sparklm-{ctx.command}"], id=resume_id,
                         group=ctx.parent.get("wandb") or (ctx.name if ctx.command == "tune" else None),
                         resume="allow" if resume_id else None, reinit="create_new",
                         settings=wandb.Settings(console="off", save_code=False, silent=True))
    except Exception as e:
        raise SparklmError(f"cannot start a W&B run in project '{tc.wandb_project}': {' '.join(str(e).split())[:240]}",
                           hint="log in with `wandb login` (or set WANDB_API_KEY), or set WANDB_MODE=offline "
                                "and sync later with `wandb sync`") from None
    run.define_metric("step")
    for kind in KINDS:
        run.define_metric(f"{kind}/*", step_metric="step")
    mode = "offline, under " + str(local / "wandb") if os.environ.get("WANDB_MODE") == "offline" else run.url
    progress.info(f"W&B: run {run.id} in project '{tc.wandb_project}' ({mode})")
    return WandbTracker(run, local, here is None, tc, ctx)


def _resumed_id(local: Path) -> str | None:
    """The W&B run id an earlier attempt in this run directory used (``wandb/latest-run`` links to it)."""
    latest = local / "wandb" / "latest-run"
    if latest.exists():
        name = latest.resolve().name  # run-20261125_172906-<id> or offline-run-…-<id>
        return name.rsplit("-", 1)[-1] or None
    return None


class WandbTracker(Buffered):
    label = "W&B"

    def __init__(self, run, local: Path, temporary: bool, tc: TrackingConfig, ctx: Context):
        super().__init__()
        self.run, self.local, self.temporary, self.tc, self.ctx = run, local, temporary, tc, ctx

    def parent_ref(self) -> dict[str, str]:
        """A search's run: its trials' runs join its group."""
        return {"wandb": self.ctx.name}

    def _send(self, rows: list[tuple[int, Row]]) -> None:
        for step, row in rows:
            self.run.log({"step": step, **numbers(row)})

    def _log_summary(self, summary: dict) -> None:
        self.run.summary.update(summary_figures(summary))

    def _end(self, ok: bool) -> None:
        try:
            self.run.finish(exit_code=0 if ok else 1)
        finally:
            if self.temporary:  # an object-store run directory: its offline files go there, then the copy goes
                upload_tree(self.local / "wandb", join(self.ctx.run_dir, "wandb"), self.ctx.storage)
                shutil.rmtree(self.local, ignore_errors=True)

    def _log_files(self) -> None:
        import wandb

        art = wandb.Artifact(f"{_safe(self.ctx.name)}-files", type=f"sparklm-{self.ctx.command}")
        for name in self.ctx.files():
            uri = join(self.ctx.run_dir, name)
            if not exists(uri, self.ctx.storage):
                continue
            path = local_path(uri)
            if path is None:  # an object-store run: a local copy in the temporary directory
                path = inside(self.local / "files", name, what="a run file")
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(read_bytes(uri, self.ctx.storage))
            art.add_file(str(path), name=name)
        self.run.log_artifact(art)

    def _log_model(self, model_dir: str) -> None:
        import wandb

        from ...model.build import model_source

        art = wandb.Artifact(f"{_safe(self.ctx.name)}-model", type="model",
                             metadata={"format": "huggingface", "task": self.ctx.task.pipeline})
        art.add_dir(str(model_source(model_dir, self.ctx.storage)))
        self.run.log_artifact(art)


def _safe(name: str) -> str:
    """An artifact name W&B accepts (letters, digits, - _ .)."""
    return "".join(c if c.isalnum() or c in "-_." else "-" for c in name) or "run"
