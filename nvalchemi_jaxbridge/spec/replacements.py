"""Replacements of third-party adapters: a callable, or a lazy `"module:qualname"` name imported only
at install time (so a spec file loads without importing the patched libraries).
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable
from typing import Any

from .errors import SpecError, SpecTypeError, short, type_name

_DOTTED = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")

Replacement = Callable[..., Any] | str | None


def replacement_name(r: Replacement) -> str | None:
    """JSON form of a replacement: "module:qualname", or None."""
    if r is None or isinstance(r, str):
        return r
    module = getattr(r, "__module__", None)
    qual = getattr(r, "__qualname__", None) or getattr(r, "__name__", None)
    return f"{module}:{qual}" if module and qual else None


def _replacement_key(r: Replacement) -> Any:
    """Equality key: the name for importable callables and strings, else the object."""
    name = replacement_name(r)
    return name if name is not None and "<" not in name else r


def resolve_replacement(name: str, where: str) -> Callable[..., Any]:
    """Import "module:qualname" and return the object it names."""
    module_path, _, qual = name.partition(":")
    if "<" in qual:
        raise SpecError(
            f"replacement {name!r} is a local function or lambda and cannot be imported; "
            "define it at module level, or pass the callable itself.",
            path=where,
        )
    obj: Any = _import(module_path, where)
    for part in qual.split("."):
        if not hasattr(obj, part):
            raise SpecError(
                f"replacement {name!r}: {type_name(obj)} {getattr(obj, '__name__', obj)!r} has no "
                f"attribute {part!r}; fix the name or import the code that defines it.",
                path=where,
            )
        obj = getattr(obj, part)
    if not callable(obj):
        raise SpecTypeError(f"replacement {name!r} names a {type_name(obj)}, not a callable.", path=where)
    return obj


def _import(module_path: str, where: str) -> Any:
    try:
        return importlib.import_module(module_path)
    except ModuleNotFoundError as e:
        raise ModuleNotFoundError(
            f"{where}: cannot import module {module_path!r} ({e}); install the package that "
            "provides it, or remove this adapter from the spec.",
            name=e.name,
        ) from e


def _check_replacement(r: object, where: str) -> None:
    if r is None or callable(r):
        return
    if isinstance(r, str):
        module_path, sep, qual = r.partition(":")
        if sep and _DOTTED.fullmatch(module_path) and qual:
            return
        raise SpecError(
            f"replacement {short(r)} is not of the form 'module.path:qualname', "
            "e.g. 'mypkg.patches:owned_mol_sum'.",
            path=f"{where}.replacement",
        )
    raise SpecTypeError(
        f"replacement must be a callable, a 'module:qualname' string or None, got {type_name(r)}.",
        path=f"{where}.replacement",
    )


def _callable_replacement(r: Replacement, where: str) -> Callable[..., Any]:
    return resolve_replacement(r, where) if isinstance(r, str) else r
