"""Errors of the spec layer and the helpers that make their messages useful."""

from __future__ import annotations

import difflib
import json
import re
import reprlib
from collections.abc import Iterable


class SpecError(ValueError):
    """A declaration or spec file is wrong; the message says what, where and how to fix it.

    Attributes:
        path: where the problem is (a JSON path like `$.core.custom_ops[0].op`, or a
            declaration like `OpAdapter('demo::spread')`), or None.
        detail: the message without the path.
    """

    def __init__(self, detail: str, *, path: str | None = None) -> None:
        super().__init__(f"{path}: {detail}" if path else detail)
        self.path = path
        self.detail = detail


class SpecTypeError(SpecError, TypeError):
    """A spec problem the reference reports as TypeError (wrong type, unexpected field)."""


class OpResolutionError(SpecError, RuntimeError):
    """A lazy op reference ("ns::name") does not name a registered torch op."""


def unknown(what: str, value: object, choices: Iterable[str]) -> str:
    """'unknown <what> <value>; did you mean ...? Expected one of [...].' for messages."""
    choices = sorted(choices)
    close = difflib.get_close_matches(value, choices, n=1, cutoff=0.6) if isinstance(value, str) else []
    hint = f"; did you mean {close[0]!r}?" if close else ";"
    return f"unknown {what} {short(value)}{hint} expected one of {choices}"


def type_name(x: object) -> str:
    """The name of x's type, as used in messages."""
    return type(x).__name__


def json_type(x: object) -> str:
    """type_name for a value decoded from JSON, except that None is `null`, as the file writes it."""
    return "null" if x is None else type_name(x)


class _ShortRepr(reprlib.Repr):
    def repr_int(self, x: int, level: int) -> str:
        if x.bit_length() > 128:  # repr() of a huge int is slow, and past 4300 digits it raises
            return f"<int of {x.bit_length()} bits>"
        return repr(x)


_SHORT = _ShortRepr(maxlevel=3, maxdict=6, maxlist=6, maxtuple=6, maxstring=60, maxother=60)


def short(x: object) -> str:
    """repr(x) cut to a readable length: a value quoted from a spec file may be huge or deeply nested."""
    return _SHORT.repr(x)


_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_LONG_KEY = 40  # longer keys are cut in paths (a 5000-digit position key would fill a screen)


def jpath(base: str, key: str | int) -> str:
    """Extend a JSON path: `.name` for identifiers, `[i]` for indices, `["k"]` otherwise.

    A key longer than 40 characters is cut: `["1000000000…(5000 chars)"]`.
    """
    if isinstance(key, int):
        return f"{base}[{key}]"
    key = key if isinstance(key, str) else str(key)
    if len(key) > _LONG_KEY:
        return f"{base}[{json.dumps(key[:24] + f'…({len(key)} chars)', ensure_ascii=False)}]"
    if _IDENT.fullmatch(key):
        return f"{base}.{key}"
    return f"{base}[{json.dumps(key, ensure_ascii=False)}]"
