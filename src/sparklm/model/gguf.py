"""GGUF import: a llama.cpp model file becomes a float32 safetensors HF directory that sparklm trains and serves.

transformers' own GGUF loader (with the ``gguf`` package) reads the file and dequantizes every tensor; the
result is saved once, by ``sparklm import MODEL.gguf --output DIR`` or into sparklm's cache keyed by the
file's SHA-256, so a later run loads plain safetensors and never parses the GGUF again. Nothing is fetched
from a hub and no remote code runs: the file's metadata is the whole config.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import struct
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from ..infra.cache import cache_dir
from ..infra.errors import SparklmError
from ..infra.fs import file_sha256, staged_cache

MAGIC = b"GGUF"
MARKER = "sparklm_import.json"  # marks a directory this module wrote (and so may replace)
_DIGESTS = "gguf_digests.json"  # (path, size, mtime) -> SHA-256, so a large file is hashed once
_KEEP_DIGESTS = 256


def is_gguf(path: str) -> bool:
    """Whether ``path`` names a GGUF file: by its ``.gguf`` suffix, or by its first four bytes."""
    path = os.fspath(path)
    if path.lower().endswith(".gguf"):
        return True
    try:
        with open(path, "rb") as f:
            return f.read(4) == MAGIC
    except OSError:  # a directory, a URL, a missing file: not a GGUF we can read
        return False


def convert(gguf_path: str, output: str, *, overwrite: bool = False) -> dict:
    """Convert ``gguf_path`` into the HF directory ``output`` (float32 safetensors, config, tokenizer).

    An existing non-empty ``output`` is kept unless ``overwrite``, and even then only an earlier import
    (one with ``sparklm_import.json``) is replaced. Returns what was written: architecture, params, bytes,
    seconds, path.
    """
    from ..infra import fs

    source = _source(gguf_path)
    local = fs.local_path(output)
    if local is not None and local.exists() and not local.is_dir():
        raise SparklmError(f"{output} is a file, not a directory", hint="pass a directory as --output")
    if local is not None:
        fs.check_replaceable(local, overwrite, marker=MARKER, kind="a sparklm import")
    elif fs.exists(output):
        names = fs.list_names(output)
        if names and not overwrite:
            raise SparklmError(f"{output} already exists and is not empty",
                               hint="choose another --output, or pass --overwrite to replace an earlier import")
        if names and MARKER not in names:
            raise SparklmError(f"{output} is not a sparklm import (it has no {MARKER}); not replacing it",
                               hint="choose another --output")
    t0 = time.perf_counter()
    with fs.staged_dir(output, None, marker=fs.CHECKSUMS) as tmp:
        info = _write(source, digest(str(source)), tmp)
    return {**info, "seconds": time.perf_counter() - t0, "path": output}


def cached(gguf_path: str) -> str:
    """The HF directory converted from ``gguf_path`` in sparklm's cache, converting it on first use.

    Keyed by the file's content, so a renamed or copied file reuses the conversion. Two processes
    converting at once each stage their own copy; the first rename wins and the other uses its directory.
    """
    source = _source(gguf_path)
    key = digest(str(source))
    target = cache_dir("models", f"gguf-{key[:24]}")
    if (target / MARKER).is_file():
        return str(target)
    with staged_cache(target, marker=MARKER) as tmp:  # one left without its marker is replaced: it is sparklm's cache
        _write(source, key, tmp)
    return str(target)


def digest(path: str) -> str:
    """SHA-256 of a file, streamed; remembered by (path, size, mtime) so an unchanged file is not re-read."""
    p = Path(path).resolve()
    st = p.stat()
    stamp = f"{p}|{st.st_size}|{st.st_mtime_ns}"
    memo = cache_dir(_DIGESTS)
    try:
        known = json.loads(memo.read_text())
    except (OSError, ValueError):
        known = {}
    if stamp in known:
        return known[stamp]
    known = {k: v for k, v in known.items() if not k.startswith(f"{p}|")}  # drop the file's older versions
    known[stamp] = value = file_sha256(p)
    with contextlib.suppress(OSError):  # a memo only: a read-only cache just means hashing again next time
        from ..infra.fs import write_text

        write_text(str(memo), json.dumps(dict(list(known.items())[-_KEEP_DIGESTS:]), indent=1))
    return value


# -- inside -----------------------------------------------------------------------------------------


def _source(gguf_path: str) -> Path:
    """The GGUF file as an absolute path, after checking that it is one."""
    path = Path(os.path.expanduser(os.fspath(gguf_path))).absolute()
    if not path.exists():
        raise SparklmError(f"GGUF file not found: {gguf_path}", hint="check the path")
    if not path.is_file():
        raise SparklmError(f"{gguf_path} is not a file", hint="pass the .gguf file itself")
    with open(path, "rb") as f:
        head = f.read(4)
    if head != MAGIC:
        raise SparklmError(f"{gguf_path} is not a GGUF file (it does not start with the bytes 'GGUF')",
                           hint="pass a llama.cpp .gguf model file, or a Hugging Face model directory")
    return path


def _inspect(path: Path) -> dict:
    """Architecture and tensor types from the header, and the one fault the loader cannot name itself: a file
    cut short. Stricter than nothing, never stricter than the loader: a header this cannot read, or a tensor
    type it does not know, is left to transformers to accept or refuse."""
    read = _header(path)
    if read is None:
        return {"architecture": None, "types": [], "head_dim": None}
    arch, tensors, data_start, meta = read
    if not arch:
        raise SparklmError(f"{path} does not say which model it holds (no general.architecture in its metadata)",
                           hint="convert the model again with llama.cpp's convert_hf_to_gguf.py")
    sizes = {int(t): s for t, s in _quant_sizes().items()}
    ends = [data_start + offset + elements // sizes[kind][0] * sizes[kind][1]
            for kind, elements, offset in tensors if kind in sizes]
    size = path.stat().st_size
    if ends and max(ends) > size:
        raise SparklmError(f"{path} is truncated ({size} bytes, its tensors need {max(ends)})",
                           hint="download or convert the file again")
    names = {int(t): t.name for t in _quant_sizes()}
    head_dim = meta.get(f"{arch}.attention.key_length")
    return {"architecture": arch, "types": sorted({names.get(kind, f"type {kind}") for kind, _, _ in tensors}),
            "head_dim": head_dim if isinstance(head_dim, int) and head_dim > 0 else None}


def _quant_sizes() -> dict:
    """ggml type → (elements per block, bytes per block), as the ``gguf`` package knows them."""
    try:
        from gguf import GGML_QUANT_SIZES
    except ImportError:  # the loader needs gguf too, and says so
        return {}
    return GGML_QUANT_SIZES


# GGUF metadata value types (the format's numbering) with a fixed size; 8 is a string, 9 an array.
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


def _header(path: Path) -> tuple[str | None, list[tuple[int, int, int]], int, dict] | None:
    """``(architecture, [(ggml type, elements, offset)], data start, scalar metadata)`` from a GGUF v2/v3 header; None
    where it
    cannot be read. Written here because both readers at hand refuse more than the loader does: transformers'
    header rejects tensor types its fast path lacks (Q5_0 in every Q4_K_M file), and gguf's reader fails on a
    truncated file while mapping tensors, before anything can say it is truncated."""
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as blob:
            return _parse_header(blob)
    except (OSError, ValueError, struct.error, UnicodeDecodeError, OverflowError):
        return None


def _parse_header(blob) -> tuple[str | None, list[tuple[int, int, int]], int, dict] | None:
    """The walk behind :func:`_header`: metadata (arrays skipped: None), then the tensor table; raises where it is
    cut."""
    version, n_tensors, n_kv = struct.unpack_from("<IQQ", blob, 4)
    if version < 2:
        return None
    pos, meta = 24, {}
    for _ in range(n_kv):
        key, pos = _string(blob, pos)
        (kind,), pos = struct.unpack_from("<I", blob, pos), pos + 4
        meta[key], pos = _value(blob, pos, kind)
    arch = meta.get("general.architecture")
    alignment = meta.get("general.alignment")
    alignment = alignment if isinstance(alignment, int) and alignment > 0 else 32
    tensors = []
    for _ in range(n_tensors):
        _, pos = _string(blob, pos)
        (n_dims,) = struct.unpack_from("<I", blob, pos)
        dims = struct.unpack_from(f"<{n_dims}Q", blob, pos + 4)
        kind, offset = struct.unpack_from("<IQ", blob, pos + 4 + 8 * n_dims)
        pos += 4 + 8 * n_dims + 12
        tensors.append((kind, int(np.prod(dims, dtype=np.uint64)), offset))
    return (arch if isinstance(arch, str) else None), tensors, -(-pos // alignment) * alignment, meta


def _string(blob: bytes, pos: int) -> tuple[str, int]:
    (n,) = struct.unpack_from("<Q", blob, pos)
    if pos + 8 + n > len(blob):
        raise ValueError("string past the end")
    return blob[pos + 8:pos + 8 + n].decode("utf-8"), pos + 8 + n


def _value(blob: bytes, pos: int, kind: int) -> tuple[Any, int]:
    if kind in _SCALARS:
        fmt = "<" + _SCALARS[kind]
        return struct.unpack_from(fmt, blob, pos)[0], pos + struct.calcsize(fmt)
    if kind == 8:
        return _string(blob, pos)
    if kind == 9:  # an array: only skipped (token lists are long; nothing here needs their values)
        item, count = struct.unpack_from("<IQ", blob, pos)
        pos += 12
        if item in _SCALARS:
            return None, pos + count * struct.calcsize("<" + _SCALARS[item])
        for _ in range(count):
            _, pos = _value(blob, pos, item)
        return None, pos
    raise ValueError(f"metadata value type {kind}")


def _supported() -> list[str]:
    """GGUF architectures this transformers can rebuild (empty when it cannot say)."""
    names: set[str] = set()
    with contextlib.suppress(ImportError):
        from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

        names |= set(GGUF_SUPPORTED_ARCHITECTURES) - {"general", "tokenizer"}  # metadata groups, not models
    with contextlib.suppress(ImportError):
        from transformers.integrations.gguf import GGUF_CONFIG_ARCHS

        names |= set(GGUF_CONFIG_ARCHS)
    return sorted(names)


def _load(path: Path, arch: str | None, head_dim: int | None = None) -> tuple[Any, Any]:
    """Model (float32, dequantized) and tokenizer, through transformers' GGUF loader; local file only. ``head_dim``:
    the file's head width (``ARCH.attention.key_length``), which that loader leaves out for some architectures."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    for needed in ("gguf", "accelerate"):  # transformers' GGUF loader imports both
        try:
            __import__(needed)
        except ImportError:
            raise SparklmError(f"importing a GGUF file needs the {needed!r} package",
                               hint=f"pip install {needed}") from None
    hf_logging.disable_progress_bar()
    folder, name = str(path.parent), path.name
    kwargs: dict[str, Any] = {"gguf_file": name, "local_files_only": True, "trust_remote_code": False,
                              "dtype": torch.float32}
    with contextlib.suppress(ImportError):
        from transformers import GgufConfig

        # Dense weights, always: left packed (the default when a kernel is available) the model could not
        # be saved, nor trained. This also keeps the loader from fetching a kernel from the hub.
        kwargs["quantization_config"] = GgufConfig(dequantize=True)
    what = f"a {arch!r} model" if arch else "the model"
    try:
        with _quiet_loader():
            if head_dim:
                kwargs["config"] = _with_head_dim(folder, name, head_dim)
            model = AutoModelForCausalLM.from_pretrained(folder, **kwargs)
    except (ValueError, NotImplementedError, KeyError, OSError, RuntimeError, struct.error, IndexError) as e:
        import transformers

        supported = _supported()
        known = {_canonical(a) for a in supported}
        if supported and arch and _canonical(arch) not in known:
            hint = f"transformers converts these GGUF architectures: {', '.join(supported)}"
        elif arch:  # its header read cleanly and it is whole: the file is fine, this loader is not enough for it
            hint = (f"transformers {transformers.__version__} does not read this file: upgrade it "
                    "(pip install -U transformers gguf), or use the original checkpoint with --init-from")
        else:
            hint = ("its header could not be read: the file may be damaged (download it again), or newer than "
                    "this transformers reads (pip install -U transformers gguf)")
        raise SparklmError(f"transformers cannot load {what} from {path}: {_short(e)}", hint=hint) from None
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name, local_files_only=True, trust_remote_code=False)
    except (ValueError, NotImplementedError, KeyError, OSError) as e:
        raise SparklmError(f"transformers cannot build the tokenizer of {path}: {_short(e)}",
                           hint="upgrade transformers, or convert the original checkpoint instead") from None
    tokenizer.init_kwargs.pop("local_files_only", None)  # a load option, not part of the tokenizer
    return model.to(torch.float32), tokenizer


def _with_head_dim(folder: str, name: str, head_dim: int):
    """transformers' config of the GGUF file, with the file's head width: its mapping of Qwen3 (among others) leaves
    ``key_length`` out, so the config's default (128) was taken and a model of narrower heads did not load."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(folder, gguf_file=name, local_files_only=True, trust_remote_code=False)
    if getattr(config, "head_dim", None) not in (None, head_dim):
        config.head_dim = head_dim
    return config


@contextlib.contextmanager
def _quiet_loader() -> Iterator[None]:
    """Silence the tqdm bar transformers' GGUF reader draws itself (``disable_progress_bar`` does not reach it)."""
    try:
        import transformers.modeling_gguf_pytorch_utils as reader
    except ImportError:
        yield
        return
    bar = getattr(reader, "tqdm", None)
    reader.tqdm = lambda iterable, *args, **kwargs: iterable
    try:
        yield
    finally:
        reader.tqdm = bar


def _write(path: Path, sha256: str, directory: Path) -> dict:
    """Fill ``directory`` with the converted model; the figures :func:`convert` returns."""
    from ..infra.fs import write_checksums

    t0 = time.perf_counter()
    inspected = _inspect(path)
    model, tokenizer = _load(path, inspected["architecture"], inspected["head_dim"])
    arch = inspected["architecture"] or model.config.model_type
    # transformers' loader leaves the config's default special-token ids; the file's are the real ones.
    for attr in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = getattr(tokenizer, attr, None)
        if value is not None:
            setattr(model.config, attr, value)
            setattr(model.generation_config, attr, value)
    for attr in ("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon", "norm_eps"):
        value = getattr(model.config, attr, None)
        if isinstance(value, float):  # stored as float32: 9.999999747378752e-06 reads back as the 1e-05 it was
            setattr(model.config, attr, float(str(np.float32(value))))
    context = getattr(model.config, "max_position_embeddings", None)
    if context:  # the tokenizer has no length of its own in a GGUF; the model's context is the useful one
        tokenizer.model_max_length = context
    model.save_pretrained(str(directory))
    tokenizer.save_pretrained(str(directory))
    params = sum(p.numel() for p in model.parameters())
    del model  # freed before the checksums read the weights file back
    seconds = time.perf_counter() - t0
    record = {"source": str(path), "size": path.stat().st_size, "sha256": sha256, "architecture": arch,
              "gguf_types": inspected["types"], "dtype": "float32", "seconds": round(seconds, 2)}
    marker = directory / MARKER
    marker.write_text(json.dumps(record, indent=2))
    mode = marker.stat().st_mode & 0o777  # what the umask gives a new file
    for p in directory.rglob("*"):  # safetensors writes its file 0600: executors run as other users read it too
        if p.is_file():
            p.chmod(mode)
    write_checksums(directory)
    size = sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())
    return {"architecture": arch, "params": params, "bytes": size, "seconds": seconds, "gguf_types": inspected["types"]}


def _canonical(arch: str) -> str:
    # llama.cpp writes qwen2moe / gpt-oss where transformers lists qwen2_moe / gpt_oss
    return arch.replace("-", "").replace("_", "")


def _short(e: BaseException) -> str:
    return " ".join(str(e).split())[:300]
