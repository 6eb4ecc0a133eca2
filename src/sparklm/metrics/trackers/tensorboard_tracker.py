"""TensorBoard: every train, eval and round row's figures as scalars in event files under ``RUN_DIR/tensorboard/``
(``tensorboard --logdir runs/`` shows every run), written by torch's SummaryWriter as rows come."""

from __future__ import annotations

from pathlib import Path

from ...config import StorageConfig, TrackingConfig
from ...infra.fs import local_path, upload_tree
from ..rows import Row
from . import Context, Outcome, numbers


def open_tracker(tc: TrackingConfig, ctx: Context) -> TensorBoardSink:
    from ...infra.fs import join

    return TensorBoardSink(join(ctx.run_dir, "tensorboard"), ctx.storage)


class TensorBoardSink:
    """Every train, eval and round row's figures as TensorBoard scalars (``train/loss``, ``eval/val_bpb``,
    ``round/loss``...) at their step, in event files under ``RUN_DIR/tensorboard/``. An object-store run directory
    gets them from a local directory, uploaded at each flush and at close.

    A DDP restart rewinds the run: TensorBoard's own purge (a writer opened with ``purge_step``) hides the events
    after the step the ranks restart from, so the history stays one clean curve, as metrics.csv's rows do."""

    def __init__(self, uri: str, storage: StorageConfig | None = None):
        import tempfile

        self._writer_class, self.uri, self.storage = self.writer_class(), uri, storage
        here = local_path(uri)
        self.local = here if here is not None else Path(tempfile.mkdtemp(prefix="sparklm-tensorboard-"))
        self.writer = self._writer_class(str(self.local))

    @staticmethod
    def writer_class():
        """torch's SummaryWriter; one line when the tensorboard package it writes with is missing."""
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            from ...infra.errors import SparklmError

            raise SparklmError("--tensorboard needs the tensorboard package",
                               hint="pip install 'sparklm[tensorboard]'") from None
        return SummaryWriter

    def write(self, row: Row) -> None:
        if row.kind not in ("train", "eval", "round") or getattr(row, "step", None) is None:
            return
        for name, value in numbers(row).items():
            self.writer.add_scalar(name, value, row.step)

    def rewind(self, step: int, evaluated: bool = True) -> None:
        # events at later steps are purged by the reader; an evaluation at ``step`` that is done again is written
        # again at the same step (TensorBoard shows the later one)
        self.writer.close()
        self.writer = self._writer_class(str(self.local), purge_step=step + 1)

    def flush(self) -> None:
        self.writer.flush()
        self._upload()

    def _upload(self) -> None:
        if local_path(self.uri) is None:
            upload_tree(self.local, self.uri, self.storage)

    def close(self) -> None:
        self.writer.close()
        self._upload()
        if local_path(self.uri) is None:  # the local copy of an object-store run's files: uploaded, not needed
            import shutil

            shutil.rmtree(self.local, ignore_errors=True)

    def finish(self, outcome: Outcome) -> None:
        pass  # the event files are the whole record: close() wrote them
