"""What the third-party adapters share: equality by JSON identity and `describe` (`_Helper`), the checks
of their fields and JSON keys, mementos, and building one from JSON with the field named in errors.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

from .errors import SpecError, SpecTypeError, jpath, json_type, short, unknown
from .frozen import _KeyedEquality
from .replacements import _import, _replacement_key
from .status import AdapterState, AdapterStatus, capture_install_site

def _check_name(value: object, field: str, pattern: re.Pattern[str], where: str, example: str) -> None:
    if not isinstance(value, str) or not pattern.fullmatch(value):
        raise SpecError(f"{field} must be {example}, got {short(value)}.", path=f"{where}.{field}")


def _check_mode(mode: object, allowed: tuple[str, ...], where: str) -> None:
    if mode not in allowed:
        raise SpecError(unknown("mode", mode, allowed) + ".", path=f"{where}.mode")


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
