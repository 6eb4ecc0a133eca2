"""The prepared dataset: what ``manifest.json`` holds, and the check later stages run before using one.

A directory is a prepared dataset only when its ``manifest.json`` exists: prepare writes it last,
so an interrupted run is never mistaken for a finished one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any

from ..config import StorageConfig
from ..infra.errors import SparklmError
from ..infra.fs import inside, join, resolve
from .tokenizer import TokenizerSpec, from_tokenizer

MANIFEST = "manifest.json"
FORMAT = "sparklm.prepared/1"
SPLITS = ("train", "validation")


@dataclass(frozen=True)
class PreparedDataset:
    """A prepared dataset: its location, manifest and Parquet files per split."""

    uri: str
    manifest: dict[str, Any]

    def files(self, split: str) -> list[str]:
        return [self.file(f["path"]) for f in self.manifest["splits"][split]["files"]]

    def file(self, name: str) -> str:
        """The dataset's file ``name`` (as its manifest gives it), refused in one line unless it is inside the
        dataset: a manifest is data, and a remote dataset's must not make a run read this host's files."""
        return join(self.uri, _inside(self.uri, name))

    @property
    def seq_len(self) -> int:
        return int(self.manifest["packing"]["seq_len"])


def _inside(uri: str, name: str) -> str:
    return inside(PurePosixPath("."), name, what=f"a file in {uri}/{MANIFEST}").as_posix()


def load_prepared(uri: str, storage: StorageConfig | None = None) -> PreparedDataset:
    """Open a prepared dataset, or say in one line why it is not one."""
    fs, path = resolve(uri, storage)
    try:
        info = fs.get_file_info(path)
        if info.type.name == "NotFound":
            raise SparklmError(f"prepared dataset not found: {uri}", hint="run `sparklm prepare INPUT --output DIR` first")
        if info.type.name == "File":
            raise SparklmError(f"{uri} is a file, not a prepared dataset",
                               hint=f"prepare it first: sparklm prepare {uri} --output DIR, then --data DIR")
        with fs.open_input_stream(f"{path}/{MANIFEST}") as f:
            manifest = json.loads(f.read().decode("utf-8"))
    except SparklmError:
        raise
    except FileNotFoundError:
        raise _not_a_dataset(fs, path, uri) from None
    except (OSError, ValueError) as e:
        raise SparklmError(f"cannot read {uri}/{MANIFEST}: {' '.join(str(e).split())[:200]}") from None
    if manifest.get("format") != FORMAT:
        raise SparklmError(f"{uri}/{MANIFEST} has format {manifest.get('format')!r}, expected {FORMAT!r}",
                           hint="prepare the data again with this version of sparklm")
    return PreparedDataset(uri=uri, manifest=manifest)


def _not_a_dataset(fs, path: str, uri: str) -> SparklmError:
    """What a directory without a manifest is: a split of a dataset (its parent has one), or text to prepare (prepare
    writes its output whole, manifest last: an interrupted one leaves no directory to mistake for a dataset)."""
    parent, parent_uri = path.rstrip("/").rsplit("/", 1)[0], uri.rstrip("/").rsplit("/", 1)[0]
    if path.rstrip("/").rsplit("/", 1)[-1] in SPLITS and fs.get_file_info(f"{parent}/{MANIFEST}").type.name == "File":
        return SparklmError(f"{uri} is a split of the prepared dataset {parent_uri}, not the dataset",
                            hint=f"pass the dataset's own directory: --data {parent_uri}")
    return SparklmError(f"{uri} is not a prepared dataset (no {MANIFEST})",
                        hint=f"prepare its text first: sparklm prepare {uri} --output DIR, then --data DIR")


def load_tokenizer(dataset: PreparedDataset, storage: StorageConfig | None = None) -> TokenizerSpec:
    """The tokenizer a prepared dataset was made with, with its special ids from the manifest."""
    from tokenizers import Tokenizer

    fs, path = resolve(dataset.uri, storage)
    with fs.open_input_stream(f"{path}/tokenizer.json") as f:
        tok = Tokenizer.from_str(f.read().decode("utf-8"))
    t = dataset.manifest["tokenizer"]
    names = [tok.id_to_token(t[k]) for k in ("bos_id", "eos_id", "pad_id")]
    template = ""
    if t.get("chat_template"):  # kept beside the tokenizer, as save_pretrained writes it; checked by its checksum
        with fs.open_input_stream(f"{path}/{_inside(dataset.uri, t['chat_template'])}") as f:
            template = f.read().decode("utf-8")
    # datasets from before the BOS convention was recorded all start documents with BOS
    spec = from_tokenizer(tok, *names, add_bos=t.get("add_bos", True), chat_template=template)
    if spec.checksum != t["sha256"]:
        raise SparklmError(f"{dataset.uri}/tokenizer.json or its chat template does not match its manifest "
                           "(fingerprint differs)",
                           hint="prepare the dataset again; do not edit its files")
    return spec


def checked_row_groups(dataset: PreparedDataset, split: str, storage: StorageConfig | None = None) -> list:
    """The split's row groups, after checking every file against the manifest: its size, and its rows as the
    Parquet footers count them (a manifest that claims other files than those present is refused)."""
    from collections import Counter

    from .stream import row_groups

    entries = dataset.manifest["splits"][split]["files"]
    uris = dataset.files(split)
    groups = row_groups(uris, storage)
    rows = Counter()
    for g in groups:
        rows[g.path] += g.rows
    fs, _ = resolve(dataset.uri, storage)
    infos = fs.get_file_info([resolve(uri, storage)[1] for uri in uris])  # one listing request, not one per file
    for entry, uri, info in zip(entries, uris, infos):
        if rows[uri] != entry["rows"]:
            raise SparklmError(f"{uri} holds {rows[uri]:,} rows, its manifest says {entry['rows']:,}",
                               hint="the dataset was changed after prepare: prepare it again")
        if "bytes" in entry:
            size = info.size
            if size != entry["bytes"]:
                raise SparklmError(f"{uri} has {size:,} bytes, its manifest says {entry['bytes']:,}",
                                   hint="the dataset was changed after prepare: prepare it again")
    return groups
