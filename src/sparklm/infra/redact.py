"""Secrets never reach disk, the console or a command line: values of keys that look secret are replaced by ``***``.

One rule decides what is secret, for every place a setting is written or shown (config.json, manifest.json,
tracker parameters, the report, printed lines): a key naming a secret, password, token, credential, access,
account, API or encryption key, a SAS, a connection string or a JAAS config (Spark's own ``spark.redaction.regex``
is narrower: it misses Azure's ``fs.azure.account.key.*`` and ``fs.azure.sas.*``, ``*.api.key`` and camel-cased
``oauthToken``). Values given that way are also remembered, so a message that happens to contain one (an exception
text, a Spark error) is cleaned before it is printed.

A value may instead name an environment variable, ``${env:NAME}``: the reference is what is saved (a resumed run reads
the variable again), and the secret is read from the environment only where it is used (``config.expand``).
"""

from __future__ import annotations

import re
from typing import Any

# "token" only as a whole part of a key (auth.token, api_token, oauthToken), not as in max_tokens or num_tokens
_WORDS = (r"secret|password|passwd|passphrase|credential|private[._-]?key|(?:access|session|account|api|encryption|"
          r"master|signing|client)[._-]?key|apikey|(?:^|[._-])sas(?:$|[._-])|sas[._-]?token|connection[._-]?string|"
          r"jaas|authorization|bearer|cookie|(?:^|[._-])(?:auth|oauth2?|refresh|access|id)?[._-]?token(?:$|[._-])")
SECRET_KEY = re.compile(_WORDS, re.IGNORECASE)
_CAMEL_TOKEN = re.compile(r"[a-z](?:Token|Secret|Password|Key)(?:$|[._A-Z-])")  # oauthToken, accountKey, sasToken
# a model's special tokens and token counts are settings, not credentials
_NOT_SECRET = re.compile(r"(?:^|[._-])(?:bos|eos|pad|unk|mask|sep|cls|max|num|new|min)[._-]?tokens?$", re.IGNORECASE)
ENV_REF = re.compile(r"^\$\{env:([A-Za-z_][A-Za-z0-9_]*)\}$")
MASK = "***"
_KNOWN: set[str] = set()


def is_secret(key: str) -> bool:
    key = str(key)
    return bool(SECRET_KEY.search(key) or _CAMEL_TOKEN.search(key)) and not _NOT_SECRET.search(key)


def is_reference(value: Any) -> bool:
    """Whether ``value`` names an environment variable (``${env:NAME}``) rather than holding a secret itself."""
    return isinstance(value, str) and bool(ENV_REF.match(value))


def remember(value: str) -> None:
    """A secret value to clean out of any text printed later (values of 4+ characters: shorter ones are words)."""
    if isinstance(value, str) and len(value) >= 4:
        _KNOWN.add(value)


def mapping(data: Any) -> Any:
    """A copy of nested dicts/lists with the values of secret-looking keys masked (and remembered); an
    ``${env:NAME}`` reference is kept as it is (it holds no secret)."""
    if isinstance(data, dict):
        out = {}
        for k, v in data.items():
            if (is_secret(str(k)) and isinstance(v, (str, int, float)) and not isinstance(v, bool) and v != ""
                    and not is_reference(v)):
                remember(str(v))
                out[k] = MASK
            else:
                out[k] = mapping(v)
        return out
    if isinstance(data, list):
        return [mapping(v) for v in data]
    return data


def unmasked(data: Any) -> Any:
    """A copy of saved settings without the masked values: a resumed run must not hand ``***`` to Spark as a key;
    the setting given again (or Spark's own defaults and the environment's credentials) applies instead."""
    if isinstance(data, dict):
        return {k: unmasked(v) for k, v in data.items() if not (v == MASK and is_secret(str(k)))}
    if isinstance(data, list):
        return [unmasked(v) for v in data]
    return data


def literal_secrets(pairs: list[str]) -> list[str]:
    """The keys of ``KEY=VALUE`` pairs (as typed on a command line) whose value is a secret itself, not a
    ``${env:NAME}`` reference: every user of the host reads a process's command line (``ps``)."""
    out = []
    for pair in pairs:
        key, sep, value = str(pair).partition("=")
        if sep and value and is_secret(key) and not is_reference(value.strip()):
            out.append(key.strip())
    return out


def text(s: str) -> str:
    """``s`` with every remembered secret value, and ``key=value`` pairs of secret keys, masked."""
    for value in sorted(_KNOWN, key=len, reverse=True):
        s = s.replace(value, MASK)
    return re.sub(r"([\w.-]+)(\s*[=:]\s*)([^\s,;'\"]+)",
                  lambda m: m.group(0) if not is_secret(m.group(1)) or is_reference(m.group(3))
                  else m.group(1) + m.group(2) + MASK, s)
