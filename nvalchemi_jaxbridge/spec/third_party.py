"""Adapters that patch third-party Python code: functions, scripted helpers, methods, forwards.

Replacements are callables or lazy `"module:qualname"` names; a lazy name is imported
only at install time, so a spec file loads without importing the patched libraries.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import re
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

from .errors import SpecError, SpecTypeError, jpath, json_type, short, type_name, unknown
from .frozen import _KeyedEquality
from .status import AdapterState, AdapterStatus, capture_install_site

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


def _check_name(value: object, field: str, pattern: re.Pattern[str], where: str, example: str) -> None:
    if not isinstance(value, str) or not pattern.fullmatch(value):
        raise SpecError(f"{field} must be {example}, got {short(value)}.", path=f"{where}.{field}")


def _check_mode(mode: object, allowed: tuple[str, ...], where: str) -> None:
    if mode not in allowed:
        raise SpecError(unknown("mode", mode, allowed) + ".", path=f"{where}.mode")


def _callable_replacement(r: Replacement, where: str) -> Callable[..., Any]:
    return resolve_replacement(r, where) if isinstance(r, str) else r


def _marshaller() -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """The torch front door's unwrap-run-rewrap wrapper builder (imported lazily)."""
    from ..torch.dispatch import make_marshaller

    return make_marshaller


class _Helper(_KeyedEquality):
    """Shared behaviour of third-party adapters (equality by JSON identity, describe)."""

    kind: ClassVar[str]
    status_kind: ClassVar[str]

    def target(self) -> str:
        """Dotted path of what is patched."""
        raise NotImplementedError

    def _where(self) -> str:
        return f"{type(self).__name__}({self.target()!r})"

    def describe(self, state: AdapterState = "pending", error: str | None = None) -> AdapterStatus:
        """A snapshot of this adapter for AdapterRegistry.list_active()."""
        return AdapterStatus(self.status_kind, self.target(), state, self.install_site, error)

    def _key(self) -> tuple[Any, ...]:
        return tuple(
            _replacement_key(getattr(self, f.name)) if f.name == "replacement" else getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.compare
        )


def _check_keys(d: Any, kind: str, allowed: tuple[str, ...], required: tuple[str, ...], where: str) -> None:
    if not isinstance(d, Mapping):
        raise SpecTypeError(f"a {kind!r} adapter must be an object, got {json_type(d)}.", path=where)
    if extra := sorted(set(d) - set(allowed) - {"kind"}):
        raise SpecError(unknown(f"key for a {kind!r} adapter:", extra[0], allowed) + ".", path=jpath(where, extra[0]))
    for key in required:
        if key not in d:
            raise SpecError(f"missing {key!r} in a {kind!r} adapter; it needs {list(required)}.", path=where)
    for key in allowed:  # every field of the built-in kinds is a string; "replacement" may be null
        value = d.get(key, "")
        if key == "replacement" and not (value is None or isinstance(value, str)):
            raise SpecTypeError(
                f"replacement must be a 'module:qualname' string or null, got {json_type(value)} {short(value)}.",
                path=jpath(where, key),
            )
        if key != "replacement" and not isinstance(value, str):
            raise SpecTypeError(f"{key} must be a string, got {json_type(value)} {short(value)}.", path=jpath(where, key))


def _memento(adapter: Any, memento: Any, keys: tuple[str, ...]) -> bool:
    """Check a memento given to restore(); True for the `{"deferred": True}` of a declaration-only adapter."""
    if isinstance(memento, Mapping):
        if memento.get("deferred") is True:
            return True
        if all(k in memento for k in keys):
            return False
    raise SpecTypeError(
        f"restore() expects the memento install() returned: {{'deferred': True}} or a dict with "
        f"{list(keys)}; got {short(memento)}. Pass the value of install() back unchanged.",
        path=f"{adapter._where()}.restore",
    )


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


def _original_attr(adapter: Any) -> tuple[Any, Any]:
    """Import the adapter's module and return (module, current attribute)."""
    module = _import(adapter.module_path, adapter._where())
    if not hasattr(module, adapter.attr_name):
        raise AttributeError(
            f"{adapter._where()}: module {adapter.module_path!r} has no attribute "
            f"{adapter.attr_name!r}; check the name against the installed version of the package."
        )
    return module, getattr(module, adapter.attr_name)


def _build(cls: type, where: str, install_site: str, *args: Any, **kwargs: Any) -> Any:
    try:
        return cls(*args, **kwargs, install_site=install_site or capture_install_site())
    except SpecError as e:
        # The constructor names the field as "<Class>(...).<field>"; point at it in the JSON.
        field = (e.path or "").rpartition(".")[2]
        fields = {f.name: f.name for f in dataclasses.fields(cls)} | {"declared_target": "target"}
        raise type(e)(e.detail, path=jpath(where, fields[field]) if field in fields else where) from None


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


@dataclasses.dataclass(frozen=True, init=False, eq=False)
class MethodAdapter(_Helper):
    """Wrap a class method: calls go to `replacement(original, *args, **kwargs)`.

    Forms: `MethodAdapter(RealClass, "method", fn)`,
    `MethodAdapter("module", "Class", "method", fn)`, or keywords
    `module_path=`, `class_name=`, `method_name=`, `replacement=`.

    Args:
        mode: "wrap" (route calls through replacement) or "marshal" (unwrap
            ShardTensors around the whole method; no replacement needed).
    """

    module_path: str
    class_name: str
    method_name: str
    replacement: Replacement = None
    mode: str = "wrap"
    install_site: str = dataclasses.field(default="", compare=False)
    kind: ClassVar[str] = "method"
    status_kind: ClassVar[str] = "method"

    def __init__(
        self,
        target: type | str | None = None,
        method_or_class: str | None = None,
        replacement_or_method: Any = None,
        replacement: Replacement = None,
        *,
        module_path: str | None = None,
        class_name: str | None = None,
        method_name: str | None = None,
        mode: str = "wrap",
        install_site: str = "",
    ) -> None:
        if isinstance(target, type):
            if replacement is not None and replacement_or_method is not None:
                raise SpecTypeError(
                    "MethodAdapter(RealClass, 'method', fn) takes the replacement once; "
                    "got it both positionally and as replacement=."
                )
            module_path, class_name = target.__module__, target.__qualname__
            method_name = method_or_class
            replacement = replacement if replacement is not None else replacement_or_method
        elif target is not None:
            module_path, class_name, method_name = target, method_or_class, replacement_or_method
        if module_path is None or class_name is None or method_name is None:
            raise SpecTypeError(
                "MethodAdapter needs a class and a method: MethodAdapter(RealClass, 'method', fn), "
                "MethodAdapter('module.path', 'Class', 'method', fn), or the keywords "
                "module_path=, class_name=, method_name=."
            )
        where = f"MethodAdapter({module_path!r}, {class_name!r}, {method_name!r})"
        _check_name(module_path, "module_path", _DOTTED, where, "a dotted module path like 'e3nn.o3'")
        _check_name(class_name, "class_name", _DOTTED, where, "a class name like 'SphericalHarmonics'")
        _check_name(method_name, "method_name", _IDENT, where, "a method name like 'forward'")
        _check_replacement(replacement, where)
        _check_mode(mode, ("wrap", "marshal"), where)
        for name, value in (
            ("module_path", module_path), ("class_name", class_name), ("method_name", method_name),
            ("replacement", replacement), ("mode", mode),
            ("install_site", install_site or capture_install_site()),
        ):
            object.__setattr__(self, name, value)

    def target(self) -> str:
        """Dotted path of what is patched."""
        return f"{self.module_path}.{self.class_name}.{self.method_name}"

    def install(self) -> dict[str, Any]:
        """Wrap the method on its class; returns the memento for restore()."""
        if self.mode == "wrap" and self.replacement is None:
            return {"deferred": True}
        obj: Any = _import(self.module_path, self._where())
        for part in self.class_name.split("."):
            if not hasattr(obj, part):
                raise AttributeError(f"{self._where()}: {self.module_path!r} has no class {self.class_name!r}.")
            obj = getattr(obj, part)
        cls = obj
        if self.method_name not in vars(cls) and not hasattr(cls, self.method_name):
            raise AttributeError(f"{self._where()}: class {self.class_name!r} has no method {self.method_name!r}.")
        original = vars(cls).get(self.method_name, getattr(cls, self.method_name))
        if self.mode == "marshal":
            marshalled = _marshaller()(original)

            @functools.wraps(original)
            def patched(*args: Any, **kwargs: Any) -> Any:
                return marshalled(*args, **kwargs)
        else:
            replacement = _callable_replacement(self.replacement, self._where())

            @functools.wraps(original)
            def patched(*args: Any, **kwargs: Any) -> Any:
                return replacement(original, *args, **kwargs)

        had_own = self.method_name in vars(cls)
        setattr(cls, self.method_name, patched)
        return {"cls": cls, "original": original, "had_own": had_own}

    def restore(self, memento: Mapping[str, Any]) -> None:
        """Put the original method back (or drop the patch if the method was inherited)."""
        if _memento(self, memento, ("cls", "original")):
            return
        if memento.get("had_own", True):
            setattr(memento["cls"], self.method_name, memento["original"])
        else:
            delattr(memento["cls"], self.method_name)

    def to_dict(self) -> dict[str, Any]:
        """JSON form, tagged with "kind"."""
        return {
            "kind": self.kind,
            "module_path": self.module_path,
            "class_name": self.class_name,
            "method_name": self.method_name,
            "replacement": replacement_name(self.replacement),
            "mode": self.mode,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], *, where: str = "adapter", install_site: str = "") -> MethodAdapter:
        """Inverse of to_dict; the replacement stays a lazy name."""
        keys = ("module_path", "class_name", "method_name", "replacement", "mode")
        _check_keys(d, cls.kind, keys, keys[:3], where)
        return _build(
            cls, where, install_site, module_path=d["module_path"], class_name=d["class_name"],
            method_name=d["method_name"], replacement=d.get("replacement"), mode=d.get("mode", "wrap"),
        )


@dataclasses.dataclass(frozen=True, eq=False)
class ModuleForwardAdapter(_Helper):
    """Swap one module *instance*'s `forward` while installed.

    A live instance cannot be written to JSON: `to_dict` writes `target` and `label`,
    and `from_dict` gives a declaration-only adapter (module None) whose install does
    nothing; the model wrapper rebuilds the live one.

    Args:
        module: the instance (e.g. a torch.nn.Module), or None for a declaration.
        replacement: the new forward (called like the bound forward), or None.
        label: a name for this adapter in specs and status listings.
        declared_target: the target string of a declaration loaded from JSON.
    """

    module: Any
    replacement: Callable[..., Any] | None = None
    label: str = "module_forward"
    install_site: str = dataclasses.field(default="", compare=False)
    declared_target: str = ""
    kind: ClassVar[str] = "module_forward"
    status_kind: ClassVar[str] = "method"

    def __post_init__(self) -> None:
        where = f"ModuleForwardAdapter(label={self.label!r})"
        if not isinstance(self.label, str):
            raise SpecTypeError(f"label must be a str, got {type_name(self.label)}.", path=f"{where}.label")
        if self.module is None:
            if not self.declared_target:
                raise SpecError(
                    "a declaration without a module needs declared_target (the module's "
                    "'pkg.Class.forward'); pass the live module instance instead.",
                    path=where,
                )
        elif self.replacement is None or not callable(self.replacement):
            raise SpecTypeError(
                f"replacement must be the callable that becomes module.forward, got "
                f"{type_name(self.replacement)}.",
                path=where,
            )
        if not self.install_site:
            object.__setattr__(self, "install_site", capture_install_site())

    def _key(self) -> tuple[Any, ...]:
        return (id(self.module) if self.module is not None else None, self.replacement, self.label, self.target())

    def target(self) -> str:
        """`pkg.Class.forward` of the module's type (or the declared target)."""
        if self.module is None:
            return self.declared_target
        t = type(self.module)
        return f"{t.__module__}.{t.__qualname__}.forward"

    def install(self) -> dict[str, Any]:
        """Set module.forward = replacement; a declaration does nothing."""
        if self.module is None:
            return {"deferred": True}
        had = "forward" in vars(self.module)
        prev = vars(self.module).get("forward")
        self.module.forward = self.replacement
        return {"had": had, "prev": prev}

    def restore(self, memento: Mapping[str, Any]) -> None:
        """Restore the instance's previous forward (or fall back to the class's)."""
        if _memento(self, memento, ("had", "prev")):
            return
        if memento["had"]:
            self.module.forward = memento["prev"]
        else:
            vars(self.module).pop("forward", None)

    def to_dict(self) -> dict[str, Any]:
        """JSON form: target and label only (the instance does not serialize)."""
        return {"kind": self.kind, "target": self.target(), "label": self.label}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], *, where: str = "adapter", install_site: str = "") -> ModuleForwardAdapter:
        """A declaration-only adapter holding the target and label."""
        _check_keys(d, cls.kind, ("target", "label"), ("target",), where)
        if not isinstance(d["target"], str) or not d["target"]:
            raise SpecError(f"target must be a non-empty string, got {d['target']!r}.", path=jpath(where, "target"))
        return _build(
            cls, where, install_site, None, None, d.get("label", "module_forward"), declared_target=d["target"]
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
