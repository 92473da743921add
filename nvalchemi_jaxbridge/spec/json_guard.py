"""Limits checked before a spec is decoded: nesting depth, duplicate keys, number sizes.

They run before anything recursive or large is built (the JSON parser, `freeze_json`, a message
quoting a value), so a broken or hostile file ends in a SpecError with its JSON path, not in a
RecursionError, a silently dropped key or a long conversion of a 100 000-digit number.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from .errors import SpecError, jpath

#: Containers (objects, arrays) a spec may nest; the deepest a valid file needs is 6
#: (`$.core.custom_ops[0].output_transforms["0"]`), so 32 leaves room for custom kinds.
MAX_DEPTH = 32
#: Digits an integer literal may have; a spec's numbers are small (`"version": 2`).
MAX_DIGITS = 64

# A string, a structural character, or an integer literal longer than MAX_DIGITS (not the
# fraction or exponent of a float). Anything else (numbers, true, false, null, ":") is skipped.
_TOKEN = re.compile(r'"(?:[^"\\]++|\\.)*+"|[{}\[\],]|(?<![0-9.eE+-])-?[0-9]{%d,}' % (MAX_DIGITS + 1))


_SCALARS = (str, int, float, bool, type(None))


def _is_container(x: Any) -> bool:
    t = type(x)
    return t is dict or t is list or t is tuple or (t not in _SCALARS and isinstance(x, Mapping | list | tuple))


def check_depth(value: Any, where: str = "$") -> None:
    """Raise SpecError if `value` (decoded JSON or a Python dict) nests deeper than MAX_DEPTH.

    Iterative, so it cannot itself overflow the stack; a dict that contains itself is caught too.
    """
    stack: list[tuple[Any, int, Any]] = [(value, 1, None)]  # (value, depth, (parent trail, key) or None)
    while stack:
        v, depth, trail = stack.pop()
        if not _is_container(v):
            continue
        if depth > MAX_DEPTH:
            keys = []
            while trail is not None:
                trail, k = trail
                keys.append(k)
            path = where
            for k in reversed(keys):
                path = jpath(path, k if isinstance(k, str | int) else repr(k))
            raise SpecError(
                f"nested deeper than {MAX_DEPTH} levels of objects and arrays; a spec needs at most 6 "
                '($.core.custom_ops[0].output_transforms["0"]). Remove the extra nesting.',
                path=path,
            )
        items = v.items() if isinstance(v, Mapping) else enumerate(v)
        children = [(c, depth + 1, (trail, k)) for k, c in items if _is_container(c)]
        stack.extend(reversed(children))  # reversed: report the first too-deep value in document order


def _location(text: str, pos: int, source: str) -> str:
    line = text.count("\n", 0, pos) + 1
    col = pos - (text.rfind("\n", 0, pos) + 1) + 1
    return f"{source}:{line}:{col}" if source else f"line {line} column {col}"


def _here(stack: list[list[Any]]) -> str:
    """The JSON path of the value being read inside the innermost open container."""
    if not stack:
        return "$"
    path, _, key, _, _ = stack[-1]
    return path if key is None else jpath(path, key)


def scan_text(text: str, source: str = "") -> None:
    """Check JSON text before it is parsed: depth, duplicate keys and huge integers, each with its JSON path.

    Malformed JSON is left to the parser, which reports its line and column.

    Raises:
        SpecError: nesting deeper than MAX_DEPTH, a key given twice in one object, or an
            integer literal of more than MAX_DIGITS digits.
    """
    # One frame per open container: [path, is_object, current key or index, keys seen, expecting a key]
    stack: list[list[Any]] = []
    for m in _TOKEN.finditer(text):
        tok = m.group()
        c = tok[0]
        if c in "{[":
            path = _here(stack)
            if len(stack) >= MAX_DEPTH:
                raise SpecError(
                    f"{_location(text, m.start(), source)}: nested deeper than {MAX_DEPTH} levels of objects and "
                    'arrays; a spec needs at most 6 ($.core.custom_ops[0].output_transforms["0"]). Remove the '
                    "extra nesting.",
                    path=path,
                )
            stack.append([path, c == "{", None if c == "{" else 0, set(), c == "{"])
        elif c in "}]":
            if not stack or stack[-1][1] != (c == "}"):
                return  # malformed; json.loads says where
            stack.pop()
        elif c == ",":
            if not stack:
                return
            frame = stack[-1]
            if frame[1]:
                frame[4] = True
            else:
                frame[2] += 1
        elif c == '"':
            if stack and stack[-1][1] and stack[-1][4]:
                frame = stack[-1]
                try:
                    key = json.loads(tok)
                except ValueError:
                    return
                if key in frame[3]:
                    raise SpecError(
                        f"{_location(text, m.start(), source)}: duplicate key {json.dumps(key)[:60]} in one object; "
                        "a JSON reader keeps only the last value, so the first would be dropped silently. "
                        "Keep one of them.",
                        path=jpath(frame[0], key),
                    )
                frame[3].add(key)
                frame[2], frame[4] = key, False
        else:
            raise SpecError(
                f"{_location(text, m.start(), source)}: an integer of {len(tok.lstrip('-'))} digits; spec "
                f"numbers are small (the format's only one is \"version\": 2), at most {MAX_DIGITS} digits.",
                path=_here(stack),
            )
