"""Train or load an HF ``tokenizers`` tokenizer and ship it to executors as its JSON text."""

from __future__ import annotations

import hashlib
import json
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from ..config import TokenizerConfig
from ..infra.errors import SparklmError
from ..infra.fs import own_code_files, read_config_json

_EOS_NAMES = ("<|eos|>", "<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "[SEP]")
_BOS_NAMES = ("<|bos|>", "<s>", "<bos>", "<|begin_of_text|>", "[CLS]")
_PAD_NAMES = ("<|pad|>", "<pad>", "[PAD]")


@dataclass(frozen=True)
class TokenizerSpec:
    """A tokenizer as JSON text plus the ids of its special tokens: small, picklable, hashable.

    ``add_bos``: documents start with BOS (the tokenizer's own convention: Llama's adds one, GPT-2's,
    Qwen's and SmolLM's do not; sparklm's trained tokenizers do). ``chat_template``: the model's Jinja
    chat template, when its tokenizer has one (instruction data is rendered with it)."""

    json: str
    bos_id: int
    eos_id: int
    pad_id: int
    bos_token: str
    eos_token: str
    pad_token: str
    add_bos: bool = True
    chat_template: str = ""

    @property
    def sha256(self) -> str:
        """Fingerprint of what decides tokenization (not of JSON formatting or padding settings)."""
        d = json.loads(self.json)
        keep = {k: d.get(k) for k in ("added_tokens", "normalizer", "pre_tokenizer", "model", "decoder")}
        return hashlib.sha256(json.dumps(keep, sort_keys=True).encode()).hexdigest()

    @property
    def checksum(self) -> str:
        """What a dataset's manifest records: :attr:`sha256`, and the chat template where there is one (it renders
        the training text and travels with the model, so a template file swapped beside the tokenizer is caught)."""
        if not self.chat_template:
            return self.sha256
        return hashlib.sha256(f"{self.sha256}\n{self.chat_template}".encode()).hexdigest()

    @property
    def vocab_size(self) -> int:
        return self.tokenizer().get_vocab_size(with_added_tokens=True)

    def tokenizer(self) -> Tokenizer:
        return Tokenizer.from_str(self.json)

    def hf(self):
        """The tokenizer as ``transformers`` sees it (what ``AutoTokenizer`` loads from :meth:`save`'s files)."""
        from transformers import PreTrainedTokenizerFast

        # A model that starts no document with BOS is saved without one, so that nothing downstream adds it.
        return PreTrainedTokenizerFast(tokenizer_object=self.tokenizer(), eos_token=self.eos_token,
                                       pad_token=self.pad_token, bos_token=self.bos_token if self.add_bos else None,
                                       chat_template=self.chat_template or None)

    def save(self, directory: str | Path, *, context: int | None = None) -> list[Path]:
        """Write tokenizer.json and the files that let ``AutoTokenizer.from_pretrained(directory)`` load it;
        ``context``: the model's context length, saved as ``model_max_length`` (what pipelines truncate to)."""
        tok = self.hf()
        if context:
            tok.model_max_length = context
        tok.save_pretrained(str(directory))
        # transformers 5 names its class "TokenizersBackend", which 4.x does not know; "PreTrainedTokenizerFast" is
        # that class in 5.x and the tokenizer.json-backed fast tokenizer in 4.x: the directory loads in either.
        config_file = Path(directory) / "tokenizer_config.json"
        saved = json.loads(config_file.read_text(encoding="utf-8"))
        saved["tokenizer_class"] = "PreTrainedTokenizerFast"
        config_file.write_text(json.dumps(saved, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
        return sorted(Path(directory).iterdir())


def train(texts: Iterable[str], config: TokenizerConfig) -> TokenizerSpec:
    """Train a byte-level BPE (GPT-2 style) with BOS, EOS and PAD special tokens."""
    specials = [config.pad_token, config.bos_token, config.eos_token]
    if len(set(specials)) != 3:
        raise SparklmError("tokenizer bos_token, eos_token and pad_token must be three different strings")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=config.vocab_size, min_frequency=config.min_frequency, special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    # BOS first on encode, as Llama's tokenizers do: AutoTokenizer users of a sparklm model get the ids it trained on.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{config.bos_token} $A", pair=f"{config.bos_token} $A {config.bos_token} $B",
        special_tokens=[(config.bos_token, tok.token_to_id(config.bos_token))])
    return from_tokenizer(tok, config.bos_token, config.eos_token, config.pad_token)


# Files that hold a tokenizer's vocabulary: HF's fast tokenizer.json, SentencePiece (tokenizer.model, spiece.model,
# Mistral's tokenizer.model.v3), GPT-2's BPE (vocab.json), WordPiece (vocab.txt), tiktoken. Without one, transformers
# builds a tokenizer of the special tokens alone from a model's config, and every word encodes as the unknown token.
VOCABULARY_FILES = ("tokenizer.json", "vocab.json", "vocab.txt")


def hf_tokenizer(directory: Path, name: str | None = None):
    """transformers' tokenizer of ``directory`` (an HF model or tokenizer directory; ``name``: how the user gave it),
    or one line where it holds no vocabulary file or transformers cannot load it."""
    names = [p.name for p in directory.iterdir()] if directory.is_dir() else []
    if not any(n in VOCABULARY_FILES or n.endswith((".model", ".tiktoken")) or n.startswith("tokenizer.model")
               for n in names):
        raise SparklmError(f"{name or directory} has no tokenizer files (tokenizer.json, tokenizer.model, vocab.json "
                           "or vocab.txt)", hint="save the model's tokenizer beside it: tokenizer.save_pretrained(DIR)")
    from transformers import AutoTokenizer

    try:  # never a tokenizer's own code (transformers would ask on the terminal whether to run it)
        return AutoTokenizer.from_pretrained(str(directory), local_files_only=True, trust_remote_code=False)
    except Exception as e:
        if (directory / "config.json").is_file():  # a damaged config.json is named, not the tokenizer files
            read_config_json(str(directory))
        _refuse_own_code(directory, name)
        raise SparklmError(f"cannot load the tokenizer in {name or directory}: {' '.join(str(e).split())[:200]}",
                           hint="save the model's tokenizer beside it: tokenizer.save_pretrained(DIR)") from None


def _settings(directory: Path) -> dict:
    """``tokenizer_config.json`` as a dict; empty where it is missing or not a JSON object."""
    try:
        value = json.loads((directory / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def _refuse_own_code(directory: Path, name: str | None = None) -> None:
    """One line for a tokenizer whose class transformers does not ship and whose tokenizer_config.json maps it to a
    Python file of its own (``auto_map``): transformers would ask on the terminal whether to run it."""
    settings = _settings(directory)
    files = own_code_files(settings)
    if not files:
        return
    import transformers  # only on this path: a tokenizer with an auto_map

    if not hasattr(transformers, str(settings.get("tokenizer_class") or "")):
        raise SparklmError(f"the tokenizer in {name or directory} brings its own Python code ({', '.join(files)}); "
                           "sparklm does not run a tokenizer's code",
                           hint="save it as a fast tokenizer (tokenizer.json) whose tokenizer_config.json has no "
                                "auto_map")


def check_found(path: str) -> None:
    """A tokenizer path that names nothing, or a tokenizer of its own code, refused before any work (load() reads
    it later)."""
    if not Path(path).exists():
        raise SparklmError(f"tokenizer not found: {path}", hint="pass a tokenizer.json file or an HF tokenizer directory")
    if Path(path).is_dir():
        _refuse_own_code(Path(path), path)


def load(path: str, local: Path | None = None) -> TokenizerSpec:
    """Load a ``tokenizer.json`` file or an HF tokenizer or model directory; ``local``: where a model ``path`` names
    is on this host, when it is elsewhere (model/build.model_source: a .gguf file's conversion, a run's model/)."""
    p = local or Path(path)
    if p.is_dir():
        hf = hf_tokenizer(p, path)
        backend = getattr(hf, "backend_tokenizer", None) or getattr(hf, "_tokenizer", None)
        if backend is None:
            raise SparklmError(f"{p} holds a slow tokenizer only", hint="save it with a tokenizer.json (fast) first")
        eos = hf.eos_token or hf.sep_token
        bos = hf.bos_token or hf.cls_token or eos
        pad = hf.pad_token or eos
        if eos is None:
            eos = _find(backend, _EOS_NAMES, "EOS", p)
            bos, pad = bos or eos, pad or eos
        template = getattr(hf, "chat_template", None)
        return from_tokenizer(backend, bos, eos, pad, chat_template=template if isinstance(template, str) else "")
    if not p.is_file():
        check_found(path)
    try:
        tok = Tokenizer.from_file(str(p))
    except Exception as e:
        raise SparklmError(f"{p} is not a tokenizer.json: {' '.join(str(e).split())[:200]}") from None
    eos = _find(tok, _EOS_NAMES, "EOS", p)
    bos = _find(tok, _BOS_NAMES, None, p) or eos
    pad = _find(tok, _PAD_NAMES, None, p) or eos
    return from_tokenizer(tok, bos, eos, pad)


def token_byte_lengths(spec: TokenizerSpec) -> list[int]:
    """UTF-8 bytes each token id stands for (0 for special tokens): turns nats/token into bits/byte."""
    tok = spec.tokenizer()
    special = {t.content for t in tok.get_added_tokens_decoder().values() if t.special}
    lengths = [0] * tok.get_vocab_size(with_added_tokens=True)
    for token, idx in tok.get_vocab(with_added_tokens=True).items():
        if token not in special and idx < len(lengths):
            lengths[idx] = len(tok.decode([idx], skip_special_tokens=False).encode("utf-8"))
    return lengths


def _find(tok: Tokenizer, names: tuple[str, ...], role: str | None, where: Path) -> str | None:
    vocab = tok.get_vocab(with_added_tokens=True)
    for name in names:
        if name in vocab:
            return name
    if role:
        raise SparklmError(f"tokenizer {where} has no {role} token (looked for {', '.join(names)})",
                           hint="use an HF tokenizer directory whose tokenizer_config.json names it")
    return None


def from_tokenizer(tok: Tokenizer, bos: str, eos: str, pad: str, *, add_bos: bool | None = None,
                   chat_template: str = "") -> TokenizerSpec:
    """A spec from a ``tokenizers.Tokenizer`` and the names of its BOS, EOS and PAD tokens; ``add_bos`` None:
    whether the tokenizer itself puts BOS first (see :func:`adds_bos`)."""
    ids = [tok.token_to_id(t) for t in (bos, eos, pad)]
    if None in ids:
        raise SparklmError(f"special tokens {bos!r}, {eos!r}, {pad!r} are not all in the vocabulary")
    if add_bos is None:
        add_bos = adds_bos(tok, ids[0], ids[1])
    return TokenizerSpec(json=tok.to_str(), bos_id=ids[0], eos_id=ids[1], pad_id=ids[2],
                         bos_token=bos, eos_token=eos, pad_token=pad, add_bos=add_bos, chat_template=chat_template)


def adds_bos(tok: Tokenizer, bos_id: int, eos_id: int) -> bool:
    """Whether ``tok`` puts a BOS (distinct from EOS) before the text it encodes: the model's convention."""
    return bos_id != eos_id and tok.encode("a", add_special_tokens=True).ids[:1] == [bos_id]


def save_to(spec: TokenizerSpec, fs, directory: str) -> None:
    """Save the tokenizer files into ``directory`` on any pyarrow filesystem."""
    with tempfile.TemporaryDirectory() as tmp:
        for local in spec.save(tmp):
            with fs.open_output_stream(f"{directory}/{local.name}") as out:
                out.write(local.read_bytes())

