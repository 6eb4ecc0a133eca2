"""The grammar of a search space: ``KEY=DISTRIBUTION`` per setting, as ``sparklm tune --space`` takes it.

``train.lr=loguniform(1e-4,1e-2)``, ``train.warmup=uniform(0,0.2)``, ``model.n_layer=int(2,8)`` (``int(8,64,8)``: a
step; ``logint(16,512)``: on a log scale), ``model.n_embd=choice(128,256)`` (numbers, ``true``/``false`` or words).
KEY is any setting ``train`` takes (``sparklm config`` lists them); a bad one, an unknown distribution or bounds the
wrong way round is one line. Pure functions: Optuna is touched only by :func:`suggest`.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from ..infra.errors import SparklmError

KINDS = ("uniform", "loguniform", "int", "logint", "choice")
_FORM = re.compile(r"^\s*([A-Za-z_][\w.]*)\s*=\s*([a-z]+)\s*\((.*)\)\s*$", re.S)
_HINT = ("write KEY=DIST(...), DIST one of uniform(lo,hi), loguniform(lo,hi), int(lo,hi[,step]), logint(lo,hi), "
         "choice(a,b,...); e.g. --space 'train.lr=loguniform(1e-4,1e-2)'")


@dataclass(frozen=True)
class Dimension:
    """One setting searched: its key, its distribution's kind and arguments (bounds, step or choices)."""

    key: str
    kind: str
    args: tuple

    def describe(self) -> str:
        return f"{self.key}={self.kind}({','.join(str(a) for a in self.args)})"


def parse(text: str) -> Dimension:
    """A ``KEY=DIST(...)`` string as a :class:`Dimension`, or one line saying what is wrong."""
    m = _FORM.match(str(text))
    if not m:
        raise SparklmError(f"--space {text!r} is not KEY=DISTRIBUTION(...)", hint=_HINT)
    key, kind, body = m.group(1), m.group(2), m.group(3)
    if kind not in KINDS:
        raise SparklmError(f"--space {text!r}: unknown distribution {kind!r}", hint=_HINT)
    args = tuple(_value(a.strip(), text) for a in body.split(",")) if body.strip() else ()
    if kind == "choice":
        if not args:
            raise SparklmError(f"--space {text!r}: choice() needs at least one value", hint=_HINT)
        return Dimension(key, kind, args)
    want = (2, 3) if kind == "int" else (2,)
    if len(args) not in want or not all(isinstance(a, (int, float)) and not isinstance(a, bool) for a in args):
        raise SparklmError(f"--space {text!r}: {kind}() takes {' or '.join(map(str, want))} numbers", hint=_HINT)
    lo, hi = args[0], args[1]
    if kind in ("int", "logint") and not all(float(a).is_integer() for a in args):
        raise SparklmError(f"--space {text!r}: {kind}() takes whole numbers", hint="use uniform() for real numbers")
    if not lo < hi:
        raise SparklmError(f"--space {text!r}: the lower bound {lo} is not below the upper {hi}", hint=_HINT)
    if kind in ("loguniform", "logint") and lo <= 0:
        raise SparklmError(f"--space {text!r}: a log scale needs a lower bound above 0", hint=_HINT)
    if kind == "int" and len(args) == 3 and args[2] <= 0:
        raise SparklmError(f"--space {text!r}: the step must be above 0", hint=_HINT)
    return Dimension(key, kind, tuple(int(a) for a in args) if kind in ("int", "logint") else tuple(args))


def _value(token: str, text: str) -> Any:
    """A choice or bound as written: a number, true/false, else a word (quotes optional)."""
    if not token:
        raise SparklmError(f"--space {text!r}: an empty value", hint=_HINT)
    low = token.lower()
    if low in ("true", "false"):
        return low == "true"
    try:
        number = float(token)
    except ValueError:
        return token.strip("'\"")
    return int(number) if re.fullmatch(r"[+-]?\d+", token) else number


def nested(values: dict[str, Any]) -> dict[str, Any]:
    """``{"train.lr": 1e-3}`` as nested settings ``{"train": {"lr": 1e-3}}`` (what ``config.merge`` applies)."""
    out: dict[str, Any] = {}
    for key, value in values.items():
        node = out
        *parents, last = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = value
    return out


def grid(dims: list[Dimension]) -> dict[str, list]:
    """The values a grid search walks: choices as given, whole-number ranges stepped; a continuous range has no
    grid (one line)."""
    out = {}
    for d in dims:
        if d.kind == "choice":
            out[d.key] = list(d.args)
        elif d.kind == "int":
            out[d.key] = list(range(d.args[0], d.args[1] + 1, d.args[2] if len(d.args) == 3 else 1))
        else:
            raise SparklmError(f"--sampler grid walks choice() and int() only: {d.describe()} is continuous",
                               hint="use choice(...) for the values to try, or --sampler tpe / random")
    return out


def grid_size(dims: list[Dimension]) -> int:
    return math.prod(len(v) for v in grid(dims).values())


def suggest(trial, d: Dimension) -> Any:
    """The trial's value of ``d`` (Optuna's ``suggest_*``)."""
    if d.kind == "choice":
        return trial.suggest_categorical(d.key, list(d.args))
    if d.kind == "uniform":
        return trial.suggest_float(d.key, d.args[0], d.args[1])
    if d.kind == "loguniform":
        return trial.suggest_float(d.key, d.args[0], d.args[1], log=True)
    if d.kind == "logint":
        return trial.suggest_int(d.key, d.args[0], d.args[1], log=True)
    return trial.suggest_int(d.key, d.args[0], d.args[1], step=d.args[2] if len(d.args) == 3 else 1)
