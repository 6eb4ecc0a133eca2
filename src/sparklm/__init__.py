"""sparklm: train and fine-tune transformer language models on Apache Spark, end to end.

In a notebook::

    import sparklm
    ds = sparklm.prepare(df, output="s3://bucket/data", text_col="body")   # or paths, or a table name
    result = sparklm.fit(data=ds, output="s3://bucket/runs/first", settings={"train.max_steps": 200})
    result.generate("Once upon a time", max_new_tokens=40)
    out = sparklm.generate_dataframe(prompts_df, model=result.run_dir)      # lazy, keeps prompts_df's columns
    vecs = sparklm.embed_dataframe(docs_df, model="/models/all-MiniLM-L6-v2", text_col="body")  # an encoder's too
"""

import logging

# torchao (the 4-bit base, lora.base_dtype nf4), which transformers imports wherever it is installed, logs on import
# that its CUDA kernels do not load on a CPU build of torch and that torch deprecates how it registers its enums:
# neither concerns a sparklm run, and every process that imports transformers would print them.
for _name in ("torchao", "torch.utils._pytree"):
    logging.getLogger(_name).setLevel(logging.ERROR)

from .config import Config, load_config  # noqa: E402
from .infra.errors import SparklmError  # noqa: E402
from .version import __version__  # noqa: E402

# The API's functions are imported on first use: `import sparklm` stays light (no torch, no pyspark).
_LAZY = {"prepare": "api", "fit": "api", "FitResult": "api", "generate": "api", "evaluate": "api", "export": "api", "tune": "api",
         "generate_dataframe": "infer.batch", "Sampling": "infer.sampling",
         "classify_dataframe": "infer.encode", "embed_dataframe": "infer.encode"}

__all__ = ["Config", "SparklmError", "load_config", "__version__", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'sparklm' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
