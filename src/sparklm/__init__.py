"""sparklm: train and fine-tune transformer language models on Apache Spark, end to end."""

from .config import Config, load_config  # noqa: E402
from .errors import SparklmError  # noqa: E402
from .version import __version__  # noqa: E402


def prepare(*args, **kwargs):
    """Raw text → tokenized, packed Parquet; see :func:`sparklm.data.prepare.prepare`."""
    from .data.prepare import prepare as _prepare

    return _prepare(*args, **kwargs)


__all__ = ["Config", "SparklmError", "load_config", "prepare", "__version__"]
