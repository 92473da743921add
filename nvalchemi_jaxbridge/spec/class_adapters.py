"""Adapters that patch a class: a method (`MethodAdapter`) or an `nn.Module`'s forward (`ModuleForwardAdapter`)."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

from .adapter_base import _build, _check_keys, _check_mode, _check_name, _Helper, _marshaller, _memento
from .errors import SpecError, SpecTypeError, jpath, type_name
from .replacements import _IDENT, Replacement, _callable_replacement, _check_replacement, _DOTTED, _import, replacement_name
from .status import capture_install_site

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
