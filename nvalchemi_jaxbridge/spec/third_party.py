"""Adapters that patch third-party Python code: functions, scripted helpers, methods, forwards.

Replacements are callables or lazy `"module:qualname"` names; a lazy name is imported
only at install time, so a spec file loads without importing the patched libraries.
This module holds the function-level adapters and the registry of adapter kinds;
`class_adapters` the class-level ones, `adapter_base` what they share, `replacements`
the replacement names.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

from .adapter_base import _build, _check_keys, _check_mode, _check_name, _Helper, _marshaller, _memento, _original_attr
from .class_adapters import MethodAdapter as MethodAdapter
from .class_adapters import ModuleForwardAdapter as ModuleForwardAdapter
from .errors import SpecError, SpecTypeError, jpath, json_type, short, type_name, unknown
from .replacements import _IDENT, Replacement, _callable_replacement, _check_replacement, _DOTTED, replacement_name
from .status import capture_install_site

@dataclasses.dataclass(frozen=True, eq=False)
class PythonAdapter(_Helper):
    """Replace a module-level Python function `module_path.attr_name` while installed.

    Args:
        module_path: dotted module path, e.g. "aimnet.nbops".
        attr_name: the attribute to replace, e.g. "mol_sum".
        replacement: the new function, a lazy "module:qualname", or None (declaration
            only: installing does nothing, the model wrapper patches it itself).
        install_site: where it was declared; captured when empty.
    """

    module_path: str
    attr_name: str
    replacement: Replacement = None
    install_site: str = dataclasses.field(default="", compare=False)
    kind: ClassVar[str] = "python"
    status_kind: ClassVar[str] = "python"

    def __post_init__(self) -> None:
        where = f"{type(self).__name__}({self.module_path!r}, {self.attr_name!r})"
        _check_name(self.module_path, "module_path", _DOTTED, where, "a dotted module path like 'aimnet.nbops'")
        _check_name(self.attr_name, "attr_name", _IDENT, where, "an attribute name like 'mol_sum'")
        _check_replacement(self.replacement, where)
        if not self.install_site:
            object.__setattr__(self, "install_site", capture_install_site())

    def target(self) -> str:
        """Dotted path of what is patched."""
        return f"{self.module_path}.{self.attr_name}"

    def install(self) -> dict[str, Any]:
        """Swap in the replacement; returns the memento for restore()."""
        if self.replacement is None:
            return {"deferred": True}
        replacement = _callable_replacement(self.replacement, self._where())
        module, original = _original_attr(self)
        setattr(module, self.attr_name, replacement)
        return {"module": module, "original": original}

    def restore(self, memento: Mapping[str, Any]) -> None:
        """Put the original attribute back."""
        if not _memento(self, memento, ("module", "original")):
            setattr(memento["module"], self.attr_name, memento["original"])

    def to_dict(self) -> dict[str, Any]:
        """JSON form, tagged with "kind"."""
        return {
            "kind": self.kind,
            "module_path": self.module_path,
            "attr_name": self.attr_name,
            "replacement": replacement_name(self.replacement),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], *, where: str = "adapter", install_site: str = "") -> PythonAdapter:
        """Inverse of to_dict; the replacement stays a lazy name."""
        _check_keys(d, cls.kind, ("module_path", "attr_name", "replacement"), ("module_path", "attr_name"), where)
        return _build(cls, where, install_site, d["module_path"], d["attr_name"], d.get("replacement"))


@dataclasses.dataclass(frozen=True, eq=False)
class JitAdapter(_Helper):
    """Patch a `@torch.jit.script` module-level helper so ShardTensors can cross it.

    Args:
        module_path, attr_name, replacement, install_site: as for PythonAdapter.
        mode: "eager" swaps in `replacement` (a plain-Python equivalent; None means
            declaration only); "marshal" wraps the current attribute: unwrap
            ShardTensors, run, re-wrap (no replacement needed).
    """

    module_path: str
    attr_name: str
    replacement: Replacement = None
    mode: str = "eager"
    install_site: str = dataclasses.field(default="", compare=False)
    kind: ClassVar[str] = "jit"
    status_kind: ClassVar[str] = "jit"

    def __post_init__(self) -> None:
        PythonAdapter.__post_init__(self)  # type: ignore[arg-type]
        _check_mode(self.mode, ("eager", "marshal"), self._where())

    target = PythonAdapter.target

    def install(self) -> dict[str, Any]:
        """Swap in the replacement (eager) or the marshalled original; returns the memento."""
        if self.mode == "eager":
            return PythonAdapter.install(self)  # type: ignore[arg-type]
        module, original = _original_attr(self)
        setattr(module, self.attr_name, _marshaller()(original))
        return {"module": module, "original": original}

    restore = PythonAdapter.restore

    def to_dict(self) -> dict[str, Any]:
        """JSON form, tagged with "kind"."""
        return {**PythonAdapter.to_dict(self), "kind": self.kind, "mode": self.mode}  # type: ignore[arg-type]

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], *, where: str = "adapter", install_site: str = "") -> JitAdapter:
        """Inverse of to_dict; the replacement stays a lazy name."""
        keys = ("module_path", "attr_name", "replacement", "mode")
        _check_keys(d, cls.kind, keys, keys[:2], where)
        return _build(
            cls, where, install_site, d["module_path"], d["attr_name"], d.get("replacement"),
            d.get("mode", "eager"),
        )


def FunctionAdapter(func: Callable[..., Any], replacement: Replacement = None) -> PythonAdapter:  # noqa: N802
    """A PythonAdapter for the module-level function `func`, named by the object itself.

    Raises:
        TypeError: `func` has no `__module__` / `__name__`.
        SpecError: `func` is not the object bound at `func.__module__.func.__name__`
            (e.g. a re-export); name the binding with PythonAdapter(module_path, attr_name).
    """
    module_path, name = getattr(func, "__module__", None), getattr(func, "__name__", None)
    if not module_path or not name:
        raise SpecTypeError(
            f"FunctionAdapter expects a module-level function with __module__ and __name__, "
            f"got {type_name(func)}."
        )
    bound = getattr(importlib.import_module(module_path), name, None)
    if bound is not func:
        raise SpecError(
            f"FunctionAdapter: {module_path}.{name} is not the object passed (a re-export or a "
            f"local function?); name the binding to patch with "
            f"PythonAdapter(module_path=..., attr_name=...).",
        )
    return PythonAdapter(module_path, name, replacement, install_site=capture_install_site())


# Serialized "kind" -> adapter class (with a from_dict classmethod).
_BUILTIN_ADAPTER_KINDS: dict[str, type] = {
    c.kind: c for c in (PythonAdapter, JitAdapter, MethodAdapter, ModuleForwardAdapter)
}
_ADAPTER_KINDS: dict[str, type] = dict(_BUILTIN_ADAPTER_KINDS)


def register_adapter_kind(kind: str, cls: type) -> None:
    """Register `cls` for third-party adapter dicts with `"kind": kind`.

    `cls` needs `from_dict(d)` and instances with `to_dict()` (writing that kind),
    `install()`, `restore(memento)` and `describe(state, error)`. Re-registering a
    custom kind replaces it; built-in kinds cannot be replaced.
    """
    if not isinstance(kind, str) or not kind:
        raise SpecError(f"register_adapter_kind: kind must be a non-empty string, got {kind!r}.")
    if kind in _BUILTIN_ADAPTER_KINDS and cls is not _BUILTIN_ADAPTER_KINDS[kind]:
        raise SpecError(f"register_adapter_kind: {kind!r} is a built-in adapter kind; choose another name.")
    missing = [m for m in ("from_dict", "to_dict", "install", "restore", "describe") if not callable(getattr(cls, m, None))]
    if missing:
        raise SpecTypeError(f"register_adapter_kind({kind!r}, {getattr(cls, '__name__', cls)}): missing {missing}.")
    _ADAPTER_KINDS[kind] = cls


def adapter_kinds() -> list[str]:
    """All known third-party adapter kinds, sorted."""
    return sorted(_ADAPTER_KINDS)


def is_third_party_adapter(x: object) -> bool:
    """Duck-typed: has install, restore, describe and to_dict, and is not an OpAdapter."""
    from .adapter import OpAdapter

    return not isinstance(x, OpAdapter | type) and all(
        callable(getattr(x, m, None)) for m in ("install", "restore", "describe", "to_dict")
    )


def adapter_from_dict(d: Mapping[str, Any], *, where: str = "adapter", install_site: str = "") -> Any:
    """Decode a third-party adapter dict by its "kind"."""
    if not isinstance(d, Mapping):
        raise SpecTypeError(f"an adapter must be an object with \"kind\", got {json_type(d)}.", path=where)
    if "kind" not in d:
        hint = " (it has \"op\": op adapters go in custom_ops)" if "op" in d else ""
        raise SpecError(f"adapter has no \"kind\"{hint}; expected one of {adapter_kinds()}.", path=where)
    kind = d["kind"]
    if not isinstance(kind, str):
        raise SpecTypeError(
            f"an adapter's \"kind\" must be a string, one of {adapter_kinds()}; got {json_type(kind)} {short(kind)}.",
            path=jpath(where, "kind"),
        )
    cls = _ADAPTER_KINDS.get(kind)
    if cls is None:
        raise SpecError(
            unknown("adapter kind", kind, _ADAPTER_KINDS)
            + ". A custom kind must be registered with register_adapter_kind(kind, cls) first.",
            path=jpath(where, "kind"),
        )
    if kind in _BUILTIN_ADAPTER_KINDS:
        return cls.from_dict(d, where=where, install_site=install_site)
    return cls.from_dict(d)
