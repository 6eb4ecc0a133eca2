"""Secrets never reach disk or the console: values of keys that look secret are replaced by ``***``.

A key is secret when its name mentions secret, password, token, credential or access key (as Spark's
own ``spark.redaction.regex`` does). Values given that way are also remembered, so a message that
happens to contain one (an exception text, a Spark error) is cleaned before it is printed.
"""

from __future__ import annotations

import re
from typing import Any

# "token" only as a whole part of a key (auth.token, api_token), not as in max_tokens
SECRET_KEY = re.compile(r"secret|password|passwd|credential|access[._-]?key|session[._-]?key|private[._-]?key|"
                        r"(?:^|[._-])token(?:$|[._-])", re.IGNORECASE)
MASK = "***"
_KNOWN: set[str] = set()


def is_secret(key: str) -> bool:
    return bool(SECRET_KEY.search(key))


def remember(value: str) -> None:
    """A secret value to clean out of any text printed later (values of 4+ characters: shorter ones are words)."""
    if isinstance(value, str) and len(value) >= 4:
        _KNOWN.add(value)


def mapping(data: Any) -> Any:
    """A copy of nested dicts/lists with the values of secret-looking keys masked (and remembered)."""
    if isinstance(data, dict):
        out = {}
        for k, v in data.items():
            if is_secret(str(k)) and isinstance(v, (str, int, float)) and not isinstance(v, bool) and v != "":
                remember(str(v))
                out[k] = MASK
            else:
                out[k] = mapping(v)
        return out
    if isinstance(data, list):
        return [mapping(v) for v in data]
    return data


def text(s: str) -> str:
    """``s`` with every remembered secret value, and ``key=value`` pairs of secret keys, masked."""
    for value in sorted(_KNOWN, key=len, reverse=True):
        s = s.replace(value, MASK)
    return re.sub(r"([\w.-]*(?:secret|password|passwd|credential|access[._-]?key)[\w.-]*\s*[=:]\s*)([^\s,;'\"]+)",
                  lambda m: m.group(1) + MASK, s, flags=re.IGNORECASE)
