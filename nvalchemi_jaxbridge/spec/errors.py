"""Errors of the spec layer and the helpers that make their messages useful."""

from __future__ import annotations

import difflib
import re
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
    close = difflib.get_close_matches(str(value), choices, n=1, cutoff=0.6)
    hint = f"; did you mean {close[0]!r}?" if close else ";"
    return f"unknown {what} {value!r}{hint} expected one of {choices}"


def type_name(x: object) -> str:
    """The name of x's type, as used in messages."""
    return type(x).__name__


_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def jpath(base: str, key: str | int) -> str:
    """Extend a JSON path: `.name` for identifiers, `[i]` for indices, `["k"]` otherwise."""
    if isinstance(key, int):
        return f"{base}[{key}]"
    if _IDENT.fullmatch(key):
        return f"{base}.{key}"
    return f'{base}["{key}"]'
