"""Pure instruction data: records → text segments that train or not → token ids with a loss mask.

An instruction record (a prompt and a response) and a chat record (a list of ``{role, content}``
messages) are both a :class:`Record`: a conversation whose ``assistant`` messages are what the model
learns to write; everything else is context that gets no loss.

:func:`segments` renders a record into text pieces, each flagged *trains* or not. With the model's
chat template (a ``render`` function: messages, add_generation_prompt → text), the pieces are cut
where the template's own renderings of the conversation's prefixes end: the text a turn adds after
the generation prompt (its content and the template's end-of-turn marker) trains, so the model
learns to answer and to stop as the template says. Without a template the contents are joined as
they are. :func:`frame` turns the tokenized pieces into one document with its loss mask.

Nothing here touches Spark, files or a tokenizer: :mod:`sparklm.launch.prepare` feeds these
functions on the executors, and the tests call them directly.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

ASSISTANT = "assistant"
USER = "user"

# (messages as [{"role", "content"}], add_generation_prompt) → the rendered text
Render = Callable[[list[dict[str, str]], bool], str]


class RecordError(ValueError):
    """What is wrong with one input record, as the rest of a sentence ("has no 'prompt' field");
    the reader says where the record is."""


class TemplateError(ValueError):
    """The chat template cannot be cut into prompt and response pieces for this record."""


@dataclass(frozen=True)
class Record:
    """A conversation: ``(role, content)`` messages in order; ``assistant`` contents train."""

    messages: tuple[tuple[str, str], ...]

    @property
    def text(self) -> str:
        """The contents joined by newlines: what counts as the record's text (bytes, tokenizer sample)."""
        return "\n".join(content for _, content in self.messages)

    def key(self) -> str:
        """A canonical text of the whole record (roles included): what dedup and the split hash."""
        return json.dumps(self.messages, ensure_ascii=False, separators=(",", ":"))

    @property
    def trains(self) -> bool:
        """Whether any assistant message has content: a record without one has nothing to learn."""
        return any(role == ASSISTANT and content for role, content in self.messages)

    def map(self, fn: Callable[[str], str]) -> Record:
        """The same record with ``fn`` applied to every content (cleaning)."""
        return Record(tuple((role, fn(content)) for role, content in self.messages))


# -- records from parsed input rows ---------------------------------------------------------------


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    return {bool: "a boolean", int: "a number", float: "a number", list: "a list", dict: "an object"}.get(
        type(value), type(value).__name__)


def _string(values: Mapping[str, Any], name: str) -> str:
    if name not in values:
        raise RecordError(f"has no '{name}' field (fields: {', '.join(map(str, list(values)[:20])) or 'none'})")
    value = values[name]
    if value is None:  # a null is empty, as in text records (a record with an empty response is dropped)
        return ""
    if not isinstance(value, str):
        raise RecordError(f"has {_kind(value)} in '{name}', not text")
    return value


def instruction_record(values: Mapping[str, Any], prompt_field: str, response_field: str) -> Record:
    """A prompt/response row (a JSON object, a CSV row, a Parquet row) as a user turn and an assistant turn.
    ``prompt_field`` may name several fields, comma-separated: the non-empty ones joined by a blank line (Alpaca's
    ``instruction,input``)."""
    if "instruction" in values and "output" in values and prompt_field not in values:
        prompt_field = _alpaca_hint(values, prompt_field)
    prompt = "\n\n".join(p for p in (_string(values, name) for name in prompt_fields(prompt_field)) if p)
    return Record(((USER, prompt), (ASSISTANT, _string(values, response_field))))


def prompt_fields(prompt_field: str) -> list[str]:
    """The fields a prompt is made of: ``data.prompt_field`` split at commas."""
    return [name.strip() for name in prompt_field.split(",")]


def _alpaca_hint(values: Mapping[str, Any], prompt_field: str) -> str:
    """``prompt_field`` when every field it names is there; else the error, saying how Alpaca's records are read."""
    missing = [n for n in prompt_fields(prompt_field) if n not in values]
    if missing:
        fields = ", ".join(map(str, list(values)[:20]))
        raise RecordError(f"has no '{missing[0]}' field (fields: {fields}); Alpaca's records: --prompt-field "
                          "instruction,input --response-field output")
    return prompt_field


def chat_record(values: Mapping[str, Any], messages_field: str) -> Record:
    """A row whose ``messages_field`` holds a list of ``{role, content}`` (or that list as JSON text, as in CSV)."""
    if messages_field not in values:
        raise RecordError(f"has no '{messages_field}' field (fields: {', '.join(map(str, list(values)[:20])) or 'none'})")
    messages = values[messages_field]
    if isinstance(messages, str):
        try:
            messages = json.loads(messages)
        except json.JSONDecodeError:
            raise RecordError(f"has text in '{messages_field}' that is not a JSON list of messages") from None
    if messages is None:  # null, as an empty list: an empty record (dropped and counted)
        return Record(())
    if not isinstance(messages, list):
        raise RecordError(f"has {_kind(messages)} in '{messages_field}', not a list of {{role, content}} messages")
    out = []
    for i, m in enumerate(messages, start=1):
        if isinstance(m, dict) and "role" not in m and isinstance(m.get("from"), str):  # ShareGPT's, common on the Hub
            m = {"role": _SHAREGPT_ROLES.get(m["from"], m["from"]), **({"content": m["value"]} if "value" in m else {})}
        role = m.get("role") if isinstance(m, dict) else None
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(m, dict) and "content" in m and content is None:  # null: empty (a tool call's, say)
            content = ""
        if not isinstance(role, str) or not isinstance(content, str):
            raise RecordError(f"has a message {i} in '{messages_field}' without a string 'role' and 'content' "
                              "(or ShareGPT's 'from' and 'value')")
        out.append((role, content))
    return Record(tuple(out))


# ShareGPT's speakers as chat templates name them; any other (system, tool, ...) is kept as it is
_SHAREGPT_ROLES = {"human": USER, "user": USER, "gpt": ASSISTANT, "chatgpt": ASSISTANT, "bing": ASSISTANT,
                   "bard": ASSISTANT, "model": ASSISTANT}


# -- rendering ------------------------------------------------------------------------------------


def segments(record: Record, render: Render | None = None) -> list[tuple[str, bool]]:
    """The record's text as ``(piece, trains)`` in order; their concatenation is the rendered record.

    Without ``render`` the contents are the pieces, joined as they are (assistant contents train).
    With it, the pieces are cut where the template's renderings of prefixes of the conversation end:
    before each assistant turn, the rendering of the messages before it with the generation prompt;
    after it, the rendering up to and including it. Raises :class:`TemplateError` when those
    renderings are not prefixes of the whole conversation's (a template that renders a turn
    differently once later turns follow), since no cut would then match what the model sees.
    """
    if render is None:
        return [(content, role == ASSISTANT) for role, content in record.messages if content]
    msgs = [{"role": role, "content": content} for role, content in record.messages]
    full = render(msgs, False)
    out: list[tuple[str, bool]] = []
    done = 0
    for k, (role, _) in enumerate(record.messages):
        if role != ASSISTANT:
            continue
        if k == 0:
            raise TemplateError("starts with an assistant message: there is no prompt to render before it")
        start, end = render(msgs[:k], True), render(msgs[:k + 1], False)
        for n, text in ((k, start), (k + 1, end)):
            if not full.startswith(text):
                raise TemplateError(f"cannot be cut into prompt and response: the chat template renders its first {n} "
                                    "message(s) differently from the start of the whole conversation")
        if not done <= len(start) <= len(end):
            raise TemplateError("cannot be cut into prompt and response: the chat template's generation prompt "
                                "does not end where the assistant turn starts")
        out += [(full[done:len(start)], False), (full[len(start):len(end)], True)]
        done = len(end)
    out.append((full[done:], False))
    return [(text, trains) for text, trains in out if text]


def frame(pieces: Sequence[Sequence[int]], trains: Sequence[bool], *, bos_id: int | None, eos_id: int | None
          ) -> tuple[list[int], list[int]]:
    """One document's token ids and loss mask from tokenized pieces and their *trains* flags.

    The document is ``BOS pieces… EOS`` (without BOS when ``bos_id`` is None, without EOS when
    ``eos_id`` is None: a chat template's rendering already holds its special tokens). The mask is 1
    on the tokens of training pieces and on the final EOS when the last piece trains (the model
    learns to stop after a response), 0 elsewhere (BOS, prompts, an EOS after a prompt).
    """
    ids: list[int] = [] if bos_id is None else [bos_id]
    mask: list[int] = [0] * len(ids)
    for piece, flag in zip(pieces, trains, strict=True):
        ids.extend(piece)
        mask.extend([int(bool(flag))] * len(piece))
    if eos_id is not None:
        ids.append(eos_id)
        mask.append(int(bool(trains) and bool(trains[-1])))
    return ids, mask
