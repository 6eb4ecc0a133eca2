"""``sparklm eval --tasks``: lm-evaluation-harness's benchmarks (HellaSwag, ARC, MMLU, ...) scored on Spark.

The harness stays the harness: on the driver it reads the tasks, samples the few-shot examples, builds every request
and computes the metrics. sparklm is its model backend, :class:`SparkLM`, a subclass of its ``TemplateLM`` (the base
its HF backend shares, which turns a context and a continuation into token ids). Each batch of requests the harness
hands over (log-likelihoods, rolling log-likelihoods of whole documents, generations) becomes one Spark job: the
requests are spread over the tasks, each task's Python worker loads the model once and scores its share longest
first in batches (:mod:`sparklm.infer.scoring`), and the answers come back in the harness's order.

Offline by design: nothing is downloaded. A task whose data the harness would fetch from the Hub reads local files
instead (``--task-data``: a dataset's directory, or a root holding datasets by their Hub names), and a dataset found
nowhere is one line naming it and the flag that points it at local files.
"""

from __future__ import annotations

import difflib
import functools
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from ..infra import progress
from ..infra.errors import SparklmError

os.environ.setdefault("TQDM_DISABLE", "1")  # the harness's progress bars (read when tqdm is imported): sparklm shows its own
try:
    import lm_eval  # noqa: F401 - the extra's presence, checked once
except ImportError:
    raise SparklmError("benchmark tasks (--tasks) need lm-evaluation-harness",
                       hint="pip install 'sparklm[eval]'") from None

from lm_eval.api.model import TemplateLM  # noqa: E402 - after the check above, which makes its absence one line

from .scoring import Backend, generation_rows, loglikelihood_rows  # noqa: E402

# the builders datasets ships for local files: a task that names one reads files it lists, never the Hub
PACKAGED = {"json", "parquet", "csv", "arrow", "text", "pandas", "imagefolder", "audiofolder"}
_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv", ".arrow": "arrow"}
_SEEDS = ("random_seed", "numpy_random_seed", "torch_random_seed", "fewshot_random_seed")


def offline() -> None:
    """No Hub downloads from this process: datasets and huggingface_hub read their caches only (set before they are
    imported, and on their constants where they already are)."""
    import sys

    os.environ["HF_HUB_OFFLINE"] = os.environ["HF_DATASETS_OFFLINE"] = "1"
    if "huggingface_hub" in sys.modules:
        import huggingface_hub.constants as hub

        hub.HF_HUB_OFFLINE = True
    if "datasets" in sys.modules:
        import datasets.config

        datasets.config.HF_HUB_OFFLINE = True
        if hasattr(datasets.config, "HF_DATASETS_OFFLINE"):
            datasets.config.HF_DATASETS_OFFLINE = True


# -- which tasks ---------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class TaskSpecs:
    names: list[str]  # what the harness loads: registered names and YAML file paths
    include: list[str]  # directories whose YAML files the harness indexes beside its own
    registry: bool  # whether the harness's own tasks are needed (indexing them takes seconds)


def task_specs(tasks: list[str]) -> TaskSpecs:
    """``--tasks`` entries: harness task, group or tag names (globs too), YAML files, or directories of them (every
    task a directory defines). A path that does not exist is one line."""
    names, include, registry = [], [], False
    for raw in tasks:
        item = raw.strip()
        if not item:
            continue
        path = Path(item).expanduser()
        looks_like_path = os.sep in item or item.endswith((".yaml", ".yml"))
        if path.is_dir():
            from lm_eval.tasks import TaskManager

            found = TaskManager(include_path=str(path), include_defaults=False).all_subtasks
            if not found:
                raise SparklmError(f"--tasks {item}: the directory defines no task (no YAML file with a 'task:' key)")
            include.append(str(path.resolve()))
            names += found
        elif path.is_file():
            include.append(str(path.resolve().parent))
            names.append(str(path.resolve()))
        elif looks_like_path:
            raise SparklmError(f"--tasks {item}: no such task file or directory",
                               hint="pass a harness task name, a task YAML file or a directory of them")
        else:
            names.append(item)
            registry = True
    if not names:
        raise SparklmError("--tasks names no task", hint="e.g. --tasks hellaswag,arc_easy or --tasks my_tasks/")
    return TaskSpecs(names, list(dict.fromkeys(include)), registry)


def task_manager(specs: TaskSpecs):
    """The harness's TaskManager over ``specs`` with every registered name checked (one line, with the nearest names,
    for a typo); glob patterns expand to the names they match."""
    stamp = tuple((str(p), p.stat().st_mtime_ns) for d in specs.include for p in sorted(Path(d).rglob("*.y*ml")))
    manager = _indexed(tuple(specs.include), specs.registry, stamp)
    known = set(manager.all_tasks)
    names = []
    for name in specs.names:
        if Path(name).is_file():
            names.append(name)
        elif any(c in name for c in "*?["):
            matched = manager.match_tasks([name])
            if not matched:
                raise SparklmError(f"--tasks {name} matches no task", hint="`lm_eval ls tasks` lists them")
            names += matched
        elif name not in known:
            near = difflib.get_close_matches(name, sorted(known), n=3)
            raise SparklmError(f"unknown task {name!r}" + (f" (did you mean {', '.join(near)}?)" if near else ""),
                               hint="a name from lm-evaluation-harness's registry, a task YAML file or a directory")
        else:
            names.append(name)
    return manager, names


@functools.lru_cache(maxsize=4)
def _indexed(include: tuple[str, ...], registry: bool, stamp: tuple):
    """A TaskManager, kept for the next evaluation in this process (indexing the harness's ~15,000 names takes
    seconds); ``stamp``, the include directories' YAML files and their times, makes an edited task file count."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=list(include) or None, include_defaults=registry)


# -- where the data is ---------------------------------------------------------------------------------------------

class LocalData:
    """Where each dataset a task names is read from, never the Hub: ``--task-data NAME=DIR`` (NAME a task's
    ``dataset_path`` as its YAML gives it, or a task or group name, standing for the datasets its tasks read) or
    ``--task-data ROOT`` (a directory holding datasets under their Hub names: ROOT/allenai/ai2_arc/...).

    A dataset's directory holds its splits as JSON Lines, JSON, Parquet, CSV or Arrow files named by split
    (``test.jsonl``, ``validation-00000-of-00001.parquet``, or a ``test/`` folder of files), under a subdirectory
    named by the task's ``dataset_name`` where it has one (``ARC-Easy/test-....parquet``, as a Hub repository lays
    them out), or a dataset saved with ``DatasetDict.save_to_disk``."""

    def __init__(self, entries: list[str], manager=None):
        self.named: dict[str, Path] = {}
        self.roots: list[Path] = []
        for entry in entries:
            name, sep, where = entry.partition("=")
            if not sep:
                name, where = "", entry
            path = Path(where).expanduser().resolve()
            if not path.is_dir():
                raise SparklmError(f"--task-data {entry}: {path} is not a directory",
                                   hint="a directory of the dataset's split files (docs/lm-eval.md)")
            if not name:
                self.roots.append(path)
                continue
            for dataset in _datasets_of(name, manager):
                self.named[dataset] = path

    def find(self, dataset: str) -> Path | None:
        if dataset in self.named:
            return self.named[dataset]
        for root in self.roots:
            if (root / dataset).is_dir():
                return root / dataset
        return None

    def load(self, real, path: str, name: str | None = None, **kwargs):
        """What ``datasets.load_dataset(path, name, **kwargs)`` gives a task, from this machine only."""
        where = self.find(path)
        if where is not None:
            try:
                return read_splits(where, name, path)
            except SparklmError:
                raise
            except Exception as e:  # noqa: BLE001 - datasets could not read the files: which, and why, in one line
                cause = e.__cause__ or e
                raise SparklmError(f"cannot read the dataset {path} in {where}: {' '.join(str(cause).split())[:200]}",
                                   hint="one file per split, all with the same columns (docs/lm-eval.md)") from None
        if path in PACKAGED or Path(path).expanduser().exists():
            _check_files(kwargs.get("data_files"), path)
            return real(path, name, **kwargs)
        try:  # a dataset already in the Hub's cache (datasets reads it offline)
            return real(path, name, **kwargs)
        except Exception:  # noqa: BLE001 - any failure here means: not on this machine
            shown = f"{path} ({name})" if name else path
            raise SparklmError(f"the dataset {shown} is not on this machine, and sparklm never downloads",
                               hint=f"put its splits in a directory and pass --task-data {path}=DIR "
                                    "(docs/lm-eval.md)") from None


def _datasets_of(name: str, manager) -> list[str]:
    """The dataset paths a task or group ``name`` reads (a name that is none: itself, taken as a dataset path)."""
    index = getattr(manager, "task_index", {}) if manager is not None else {}
    if name not in index:
        return [name]
    found, todo, seen = [], [name], set()
    while todo:
        entry = index.get(todo.pop())
        if entry is None or entry.name in seen:
            continue
        seen.add(entry.name)
        cfg = entry.cfg or {}
        if cfg.get("dataset_path"):
            found.append(cfg["dataset_path"])
        children = cfg.get("task") if "group" in cfg else None
        for child in children if isinstance(children, list) else []:
            todo.append(child["task"] if isinstance(child, dict) else child)
    return sorted(set(found)) or [name]


def _check_files(data_files, dataset: str) -> None:
    """A task's own local files (``dataset_kwargs.data_files``), each there, or one line naming the one missing."""
    import glob

    if data_files is None:
        return
    if isinstance(data_files, dict):
        files = [f for v in data_files.values() for f in ([v] if isinstance(v, str) else v)]
    else:
        files = [data_files] if isinstance(data_files, str) else list(data_files)
    for f in files:
        if "://" not in f and not glob.glob(os.path.expanduser(f)):
            raise SparklmError(f"a task's data file {f} is not found (dataset_kwargs.data_files of a {dataset} task)",
                               hint="write the file there, or point the task's YAML at it")


def read_splits(where: Path, name: str | None, dataset: str):
    """The splits of the local dataset in ``where`` (see :class:`LocalData`), as a DatasetDict that names the
    directory when a task asks for a split it lacks."""
    import datasets

    base = where / name if name and (where / name).is_dir() else where
    if (base / "dataset_dict.json").is_file():
        loaded = datasets.load_from_disk(str(base))
        return Splits(loaded, base)
    files: dict[str, list[str]] = {}
    kinds = set()
    for p in sorted(base.rglob("*")):
        kind = _FORMATS.get(p.suffix.lower())
        if kind is None or not p.is_file() or p.name.startswith("."):
            continue
        split = split_of(p.relative_to(base))
        files.setdefault(split, []).append(str(p))
        kinds.add(kind)
    if not files:
        extra = f" (nor in a {name}/ subdirectory)" if name else ""
        raise SparklmError(f"no data files for the dataset {dataset} in {base}{extra}",
                           hint="its splits as test.jsonl, validation.parquet, ... (docs/lm-eval.md)")
    if len(kinds) > 1:
        raise SparklmError(f"the dataset {dataset} in {base} mixes file formats ({', '.join(sorted(kinds))})",
                           hint="keep one format per dataset directory")
    return Splits(datasets.load_dataset(kinds.pop(), data_files=files), base)


def split_of(rel: Path) -> str:
    """The split a data file holds, from its path in the dataset's directory (pure): its name up to the first ``-``
    or ``.`` (``test.jsonl``, ``validation-00000-of-00001.parquet``, ``data/train-0000.parquet``), or, where that
    is a number (``test/0000.parquet``, Hub's parquet conversion), its folder's name."""
    prefix = rel.name.split(".")[0].split("-")[0]
    if (prefix.isdigit() or prefix in ("part", "")) and len(rel.parts) > 1:
        return rel.parts[-2]
    return prefix


class Splits(dict):
    """A dataset's splits; a split a task needs and the directory lacks is one line naming both."""

    def __init__(self, splits, where: Path):
        super().__init__(splits)
        self.where = where

    def __getitem__(self, split):
        if split not in self:
            raise SparklmError(f"the dataset in {self.where} has no {split!r} split (it has {', '.join(sorted(self))})",
                               hint=f"add {split}.jsonl (or .parquet) there")
        return super().__getitem__(split)


@contextmanager
def serving(data: LocalData) -> Iterator[None]:
    """While the harness builds its tasks, their ``datasets.load_dataset`` reads from ``data`` (the harness's task
    module looks the function up on its ``datasets`` module; only that name is swapped, and only here)."""
    import datasets
    import lm_eval.api.task as task_module

    class _Datasets:
        def __getattr__(self, attr):
            return getattr(datasets, attr)

    proxy = _Datasets()
    proxy.load_dataset = partial(data.load, datasets.load_dataset)
    task_module.datasets = proxy
    try:
        yield
    finally:
        task_module.datasets = datasets


# -- the model backend ---------------------------------------------------------------------------------------------

class SparkLM(TemplateLM):
    """lm-evaluation-harness's model interface, answered by Spark jobs. Tokenization, truncation and the rolling
    windows follow the harness's HF backend (``HFLM``) step for step, so the same model gives the same numbers."""

    backend = "causal"

    def __init__(self, spark, scorer: Backend, tokenizer, hf_config, *, max_length: int = 0, partitions: int = 0):
        from lm_eval.models.utils import DEFAULT_MAX_LENGTH, configure_pad_token, resolve_max_length

        super().__init__()
        self._spark, self.scorer, self._partitions = spark, scorer, partitions
        self.tokenizer = configure_pad_token(tokenizer, model_config=hf_config)
        self._max_length = max_length or resolve_max_length(hf_config, self.tokenizer, default=DEFAULT_MAX_LENGTH)
        self.add_bos_token = None
        self.counts = {"loglikelihood": 0, "loglikelihood_rolling": 0, "generate_until": 0, "forward_passes": 0}

    @property
    def spark(self):
        """The session, started at the first request: the harness reads every task's data before (a task whose data
        is missing fails without a JVM started)."""
        if callable(self._spark):
            self._spark = self._spark()
        return self._spark

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.tokenizer.eos_token_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def max_gen_toks(self) -> int:
        return 256

    @property
    def tokenizer_name(self) -> str:
        return self.tokenizer.name_or_path.replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, left_truncate_len: int | None = None,
                   **kwargs) -> list[int]:
        from lm_eval.models.utils import has_bos_prefix

        asked = add_special_tokens if add_special_tokens is not None else self.add_bos_token
        special = {} if asked is None else {"add_special_tokens": asked}  # None: the tokenizer's own default
        if add_special_tokens is None and has_bos_prefix(string, self.tokenizer.decode(self.prefix_token_id)):
            special["add_special_tokens"] = False  # the string carries its BOS already
        ids = self.tokenizer.encode(string, **special)
        return ids[-left_truncate_len:] if left_truncate_len else ids

    def tok_decode(self, tokens, skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=skip_special_tokens)

    def _job(self, rows: list, run, what: str) -> list:
        """``rows`` spread over the tasks (every n-th, so each gets long and short ones alike), ``run`` on each."""
        from ..infra.errors import spark_errors

        n = max(1, min(self._partitions or self.spark.sparkContext.defaultParallelism, len(rows)))
        shares = [rows[i::n] for i in range(n)]
        with spark_errors(), progress.stage(self.spark, f"{what}: {len(rows):,} on {n} task(s)"):
            return self.spark.sparkContext.parallelize(shares, n).flatMap(lambda share: share) \
                .mapPartitions(run).collect()

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """Each request's input is cut from the left to the model's length as the harness cuts it; requests with the
        same input (choices of one token after one context) share a forward pass."""
        inputs: dict[tuple, list] = {}
        for index, (_, context, continuation) in enumerate(requests):
            if not context or not continuation or len(continuation) > self.max_length:
                raise SparklmError("a request has an empty context or continuation, or one longer than the model's "
                                   f"{self.max_length} tokens", hint="check the task's doc_to_text/doc_to_target")
            ids = tuple((context + continuation)[-(self.max_length + 1):][:-1])
            inputs.setdefault(ids, []).append((index, list(continuation)))
        rows = [(list(ids), conts) for ids, conts in inputs.items()]
        self.counts["forward_passes"] += len(rows)
        answers = self._job(rows, partial(loglikelihood_rows, self.scorer), "log-likelihoods")
        out: list = [None] * len(requests)
        for index, logp, greedy in answers:
            out[index] = (logp, greedy)
        return out

    def loglikelihood(self, requests, disable_tqdm: bool = False):
        self.counts["loglikelihood"] += len(requests)
        return super().loglikelihood(requests, disable_tqdm=True)

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Whole documents in windows of the model's length, each token scored once (the harness's rolling windows,
        one token of context), all windows of all documents in one job."""
        from lm_eval import utils

        self.counts["loglikelihood_rolling"] += len(requests)
        windows, owner = [], []
        for i, (text,) in enumerate(req.args for req in requests):
            for context, continuation in map(utils.make_disjoint_window, utils.get_rolling_token_windows(
                    token_list=self.tok_encode(text), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length, context_len=1)):
                windows.append((None, context, continuation))
                owner.append(i)
        totals = [0.0] * len(requests)
        for i, (logp, _) in zip(owner, self._loglikelihood_tokens(windows) if windows else []):
            totals[i] += logp
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Contexts encoded and cut from the left to leave room for the new tokens, as the harness's HF backend does;
        the new tokens decoded here and cut at the first stop string by the harness's own function."""
        from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text

        self.counts["generate_until"] += len(requests)
        eos = self.tok_decode(self.eot_token_id, skip_special_tokens=False)
        rows = []
        for index, (context, gen_kwargs) in enumerate(req.args for req in requests):
            if not isinstance(gen_kwargs, dict):
                raise SparklmError(f"a generate_until request's settings are a {type(gen_kwargs).__name__}, not a dict",
                                   hint="check the task's generation_kwargs")
            kwargs = normalize_gen_kwargs(gen_kwargs, self.max_gen_toks)
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
            max_new = kwargs.pop("max_gen_toks")
            if max_new >= self.max_length:
                raise SparklmError(f"a task asks for {max_new} new tokens, not fewer than the model's {self.max_length}",
                                   hint="lower the task's generation_kwargs.max_gen_toks")
            ids = self.tok_encode(context, left_truncate_len=self.max_length - max_new)
            extra = tuple(sorted(kwargs.items()))
            rows.append((index, ids, tuple(until), max_new, extra))
        answers = self._job(rows, partial(generation_rows, self.scorer, pad_id=self.tokenizer.pad_token_id),
                            "generations")
        out: list = [""] * len(requests)
        for index, tokens in answers:
            out[index] = postprocess_generated_text(self.tok_decode(tokens), list(rows[index][2]), None)
        return out

    def get_model_info(self) -> dict:
        return {"model_source": self.scorer.source, "backend": "sparklm (Spark)"}


# -- a whole evaluation --------------------------------------------------------------------------------------------

def _hf_config(directory: Path):
    """The model's transformers config (a LoRA adapter's: its base's), read without loading weights."""
    from transformers import AutoConfig

    from ..model.build import ADAPTER_CONFIG, model_source
    from ..model.lora import base_of

    if not (directory / "config.json").is_file() and (directory / ADAPTER_CONFIG).is_file():
        directory = model_source(base_of(directory))
    try:
        return AutoConfig.from_pretrained(str(directory), local_files_only=True, trust_remote_code=False)
    except Exception as e:
        raise SparklmError(f"cannot read the model's config in {directory}: {' '.join(str(e).split())[:200]}") from None


def seeds(seed: int | None) -> dict:
    """``--seed N`` sets the harness's four seeds (Python, NumPy, torch, few-shot sampling) as its own ``--seed N``
    does; None keeps its defaults."""
    return {} if seed is None else dict.fromkeys(_SEEDS, seed)


def evaluate_tasks(model: str, tasks: list[str], *, num_fewshot: int | None = None, limit: float | None = None,
                   batch_size: int = 8, seed: int | None = None, threads: int = 0, task_data: list[str] = (),
                   log_samples: bool = False, storage=None, spark=None, spark_config=None) -> dict:
    """Score ``tasks`` on ``model`` (a sparklm run directory, an HF model directory, a LoRA adapter directory or a
    .gguf file) and return the harness's results (the dict its ``simple_evaluate`` returns)."""
    from lm_eval import simple_evaluate

    from ..config import StorageConfig
    from ..infra.fs import effective, local_copy, version
    from ..spark.resources import check_batching
    from ..spark.session import check_shared, get_session
    from .generate import model_uri, tokenizer_of

    check_batching(batch_size, threads)
    if num_fewshot is not None and num_fewshot < 0:
        raise SparklmError(f"--num-fewshot must be >= 0 (got {num_fewshot})")
    if limit is not None and limit <= 0:
        raise SparklmError(f"--limit must be > 0 (a count, or a fraction below 1; got {limit})")
    offline()
    storage = effective(storage or StorageConfig())
    specs = task_specs(list(tasks))
    manager, names = task_manager(specs)
    data = LocalData(list(task_data), manager)
    source = model_uri(model, storage)
    directory = local_copy(source, storage)  # (model_dir would resolve the path a second time)
    tokenizer, _ = tokenizer_of(directory)
    hf_config = _hf_config(directory)
    scorer = Backend(source, version(source, storage), storage, threads, batch_size)
    def session():
        started = get_session(spark_config, spark=spark() if callable(spark) else spark)
        check_shared(started, {"model": source})
        return started

    lm = SparkLM(session, scorer, tokenizer, hf_config)
    with serving(data), _quiet():
        results = simple_evaluate(model=lm, tasks=names, num_fewshot=num_fewshot, limit=limit, task_manager=manager,
                                  log_samples=log_samples, bootstrap_iters=100000, **seeds(seed))
    if results is None:
        raise SparklmError("the harness returned no results")
    results["config"]["model"] = source
    results["config"]["requests"] = dict(lm.counts)
    return results


@contextmanager
def _quiet() -> Iterator[None]:
    """The harness's progress bars and info logging off (sparklm shows its own progress); its warnings stay."""
    import logging

    logger = logging.getLogger("lm_eval")
    level = logger.level
    logger.setLevel(logging.WARNING)
    os.environ.setdefault("TQDM_DISABLE", "1")
    try:
        yield
    finally:
        logger.setLevel(level)


def metrics(results: dict) -> dict[str, float]:
    """Each task's (and group's) figures as ``task/metric`` (the harness's ``acc,none`` keys with the default filter
    dropped, another filter kept: ``gsm8k/exact_match,strict-match``), numbers only."""
    out = {}
    for section in ("results", "groups"):
        for task, figures in (results.get(section) or {}).items():
            for key, value in figures.items():
                if key in ("alias", "name", "sample_len") or "_stderr" in key or not isinstance(value, (int, float)):
                    continue
                metric = key[:-len(",none")] if key.endswith(",none") else key
                out[f"{task}/{metric}"] = float(value)
    return out


def table(results: dict) -> str:
    """The harness's own Markdown table of the results (and of the groups, where there are any)."""
    from lm_eval.utils import make_table

    out = make_table(results)
    if results.get("groups"):
        out += "\n" + make_table(results, "groups")
    return out


def results_json(results: dict) -> str:
    """The results as the harness's ``--output_path`` writes them (samples apart), so tooling that reads its files
    reads ours."""
    from lm_eval.utils import handle_non_serializable

    kept = {k: v for k, v in results.items() if k != "samples"}
    return json.dumps(kept, indent=2, default=handle_non_serializable, ensure_ascii=False)


def samples_jsonl(results: dict) -> dict[str, str]:
    """Each task's logged samples (``--log-samples``) as JSON Lines, by file name."""
    from lm_eval.utils import handle_non_serializable

    return {f"samples_{task}.jsonl": "".join(json.dumps(s, default=handle_non_serializable, ensure_ascii=False) + "\n"
                                             for s in rows)
            for task, rows in (results.get("samples") or {}).items()}


def check_tasks(tasks: list[str], task_data: list[str]) -> None:
    """``tasks`` name tasks the harness knows, whose data is on this machine: each is built once, reading its data,
    so a typo or a missing file is one line before the work that needs them (a run's training) starts."""
    manager, names = task_manager(task_specs(list(tasks)))
    offline()
    with serving(LocalData(list(task_data), manager)), _quiet():
        manager.load(names)
