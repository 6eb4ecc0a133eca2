"""Secrets never reach disk, the console or a command line: values of keys that look secret are replaced by ``***``,
and so are the credentials inside any value (a URI's user-info, a signature in its query, a header's token).

One rule decides what is secret, for every place a setting is written or shown (config.json, manifest.json, tracker
parameters, the report, the model card, printed lines) and for Spark's UI and event logs too: a new session gets
:data:`KEY_RULE` (with :data:`VALUE_RULE`, which Spark's key regex also tests values against) as
``spark.redaction.regex``, and :data:`VALUE_RULE` as ``spark.redaction.string.regex`` (a user's own regex is kept, and
ours added to it: ``sparklm.spark.session.redaction_conf``). Both are written in the syntax Python's ``re`` and Java's
``java.util.regex`` share, and the tests check that Spark masks the same names and the same parts of values. Values
given that way are also remembered, so a message that happens to contain one (an exception text, a Spark error) is
cleaned before it is printed.

A value may instead name an environment variable, ``${env:NAME}``: the reference is what is saved (a resumed run reads
the variable again), and the secret is read from the environment only where it is used (``config.expand``).
"""

from __future__ import annotations

import re
from typing import Any

# A key naming a secret, password, token, credential, private/access/account/API/... key, a SAS, a connection string
# or a JAAS config; "token", "pass", "pwd" and "auth" only as whole parts (auth.token, DB_PASS, spark.redis.auth), not
# as in max_tokens, passthrough or authenticate.
_WORDS = (r"secret|password|passwd|passphrase|credential|private[._-]?key|(?:access|session|account|api|encryption|"
          r"master|signing|client|storage|customer)[._-]?key|apikey|(?:^|[._-])sas(?:$|[._-])|sas[._-]?token|"
          r"connection[._-]?string|jaas|authorization|bearer|cookie|(?:^|[._-])(?:pass|pwd)(?:$|[._-])|[._-]auth$|"
          r"(?:^|[._-])(?:auth|oauth2?|refresh|access|id)?[._-]?token(?:$|[._-])")
_CAMEL = r"[a-z](?:Token|Secret|Password|Key)(?:$|[._A-Z-])"  # oauthToken, accountKey, sasToken (case counts)
# ...but not a model's special tokens and token counts, nor a setting that names a class, a path, a mode or a size
# (a credential provider, a key file): masked, it would be dropped on --resume and the run would lose it
_NOT = (r"(?:^|[._-])(?:bos|eos|pad|unk|mask|sep|cls|max|num|new|min|per)[._-]?tokens?(?:[._-]?ids?)?$|"
        r"provider(?:s|[._-]?(?:type|path|class))?$|[._-](?:binding|type)$|(?:[._-]|[a-z])(?:file|path)$|"
        r"application[._-]?credentials$|(?:[._-]|[a-z])(?:algorithm|bits|length|size)$")
# Spark applies it with findFirstIn to each key, and to each value: anchored, so that an exception holds for a whole
# key, and only for a key (a value with spaces, such as a command line, is searched for a secret's name throughout)
KEY_RULE = rf"(?s:^(?!(?i:\S*(?:{_NOT})))(?:(?i:.*(?:{_WORDS}))|.*{_CAMEL}))"
SECRET_KEY = re.compile(KEY_RULE)

# Credentials inside a value. A URI's user-info when it holds a password (``s3a://ID:KEY@bucket``, ``abfss://:KEY@``;
# ``abfss://container@account`` names no user, and ``host:8443/x@y`` is a port); a query's or connection string's
# parameter that carries one; an Authorization header's token.
_USER_INFO = r"[^\s/?#@:]*:(?![0-9]{1,5}[/?#])[^\s@]*"
_PARAMS = (r"sig|(?:x-[a-z]+-)?(?:signature|credential|security-token)|awsaccesskeyid|sharedaccess(?:signature|key)|"
           r"(?:(?:access|id|refresh|auth|sas|session|api|client|account|private|storage)[_-]?)?"
           r"(?:token|secret|password|passwd|pwd|pass|key)")
_PARAM_VALUE = r"[^&;#\s]+"
_HEADER_VALUE = r"[A-Za-z0-9._~+/-]+=*"
# Spark's form: each match is the credential alone (Spark replaces a match whole); Java's look-behind takes the
# bounded alternatives Python's refuses
VALUE_RULE = (rf"(?<=://){_USER_INFO}(?=@)|(?<=(?:^|[?&;])\s{{0,8}}(?i:{_PARAMS})=){_PARAM_VALUE}|"
              rf"(?<=(?i:bearer)\s{{1,8}}){_HEADER_VALUE}|(?<=Basic\s{{1,8}})(?=[A-Za-z0-9+/]{{8}}){_HEADER_VALUE}")
# Python's form of the same rule: the credential is the one group that took part in the match
_VALUE = re.compile(rf"(?<=://)({_USER_INFO})(?=@)|(?:^|(?<=[?&;]))\s*(?i:{_PARAMS})=({_PARAM_VALUE})|"
                    rf"(?i:bearer)\s+({_HEADER_VALUE})|Basic\s+((?=[A-Za-z0-9+/]{{8}}){_HEADER_VALUE})")
_MASKED = re.compile(rf"://\*\*\*@|(?:^|[?&;])\s*(?i:{_PARAMS})=\*\*\*(?:$|[&;#\s])|(?i:bearer|basic)\s+\*\*\*")
ENV_REF = re.compile(r"^\$\{env:([A-Za-z_][A-Za-z0-9_]*)\}$")
MASK = "***"
_KNOWN: set[str] = set()


def is_secret(key: str) -> bool:
    return bool(SECRET_KEY.search(str(key)))


def value(s: str) -> str:
    """``s`` with the credentials inside it masked (and remembered): ``s3a://ID:KEY@bucket/x`` → ``s3a://***@bucket/x``,
    ``...&sig=X`` → ``...&sig=***``, ``AccountKey=X;`` → ``AccountKey=***;``, ``Bearer X`` → ``Bearer ***``."""
    def masked(m: re.Match) -> str:
        group = next(i for i, g in enumerate(m.groups(), 1) if g is not None)
        secret = m.group(group)
        remember(secret)
        remember(secret.partition(":")[2] if group == 1 else "")  # the password alone may show up later
        start, end = m.start(group) - m.start(), m.end(group) - m.start()
        return m.group(0)[:start] + MASK + m.group(0)[end:]

    return _VALUE.sub(masked, s) if isinstance(s, str) else s


def holds_mask(s: Any) -> bool:
    """Whether ``s`` had a credential masked by :func:`value` (``***`` where a credential goes)."""
    return isinstance(s, str) and bool(_MASKED.search(s))


def is_reference(value: Any) -> bool:
    """Whether ``value`` names an environment variable (``${env:NAME}``) rather than holding a secret itself."""
    return isinstance(value, str) and bool(ENV_REF.match(value))


def remember(value: str) -> None:
    """A secret value to clean out of any text printed later (values of 4+ characters: shorter ones are words)."""
    if isinstance(value, str) and len(value) >= 4:
        _KNOWN.add(value)


def mapping(data: Any) -> Any:
    """A copy of nested dicts/lists with the values of secret-looking keys masked, and the credentials inside every
    other string (:func:`value`), all remembered; an ``${env:NAME}`` reference is kept as it is (it holds no secret)."""
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
    return value(data) if isinstance(data, str) else data


def unmasked(data: Any) -> Any:
    """A copy of saved settings without the masked values: a resumed run must not hand ``***`` to Spark as a key;
    the setting given again (or Spark's own defaults and the environment's credentials) applies instead. A Spark or
    Hadoop setting (a dotted name) whose value held a credential goes the same way; a sparklm setting (init_from)
    keeps its masked URI, so that its use fails naming it rather than a default taking its place unnoticed."""
    if isinstance(data, dict):
        return {k: unmasked(v) for k, v in data.items()
                if not (v == MASK and is_secret(str(k))) and not ("." in str(k) and holds_mask(v))}
    if isinstance(data, list):
        return [unmasked(v) for v in data]
    return data


def literal_secrets(pairs: list[str]) -> list[str]:
    """The keys of ``KEY=VALUE`` pairs (as typed on a command line) whose value is a secret itself, not a
    ``${env:NAME}`` reference: every user of the host reads a process's command line (``ps``)."""
    out = []
    for pair in pairs:
        key, sep, given = str(pair).partition("=")
        if sep and given and is_secret(key) and not is_reference(given.strip()):
            out.append(key.strip())
    return out


def text(s: str) -> str:
    """``s`` with every remembered secret value, the credentials inside values, and ``key=value`` pairs of secret keys
    masked (``Authorization: Bearer X``: the token, not the word ``Bearer``)."""
    for known in sorted(_KNOWN, key=len, reverse=True):
        s = s.replace(known, MASK)
    s = value(s)
    return re.sub(r"([\w.-]+)(\s*[=:]\s*)((?:(?i:bearer|basic)\s+)?[^\s,;'\"]+)",
                  lambda m: m.group(0) if not is_secret(m.group(1)) or is_reference(m.group(3))
                  or m.group(3).split()[-1] == MASK else m.group(1) + m.group(2) + MASK, s)
