"""Op references: normalising torch op handles, naming them, and resolving lazy names.

Nothing here imports torch at module load; torch objects are recognised by type name
(as the reference does) and `resolve_op` imports torch only when called.
"""

from __future__ import annotations

import re
from typing import Any

from .errors import OpResolutionError, SpecError, SpecTypeError, type_name, unknown

_NAME = r"[A-Za-z_][A-Za-z0-9_]*"
_QUALIFIED = re.compile(rf"({_NAME})::({_NAME})(?:\.({_NAME}))?")


def parse_op_name(name: str) -> tuple[str, str, str | None]:
    """Split "ns::name" or "ns::name.overload" into (ns, name, overload or None)."""
    m = _QUALIFIED.fullmatch(name) if isinstance(name, str) else None
    if m is None:
        raise SpecError(
            f"op {name!r} is not a qualified op name; write '<namespace>::<name>' or "
            "'<namespace>::<name>.<overload>', e.g. 'demo::spread' for torch.ops.demo.spread."
        )
    ns, op, overload = m.groups()
    return ns, op, overload


def is_torch_op(op: object) -> bool:
    """True for a torch OpOverload (anything with a `_schema` and an `_overloadname`)."""
    return hasattr(op, "_schema") and hasattr(op, "_overloadname")


def normalize_op(op: Any) -> Any:
    """Packets become their `.default` overload and CustomOpDefs their OpOverload.

    Strings (lazy references) are checked for the qualified form and kept as given;
    OpOverloads and plain callables are kept.
    """
    if isinstance(op, str):
        parse_op_name(op)
        return op
    tname = type(op).__name__
    if tname == "OpOverloadPacket":
        try:
            return op.default
        except AttributeError:
            overloads = list(op.overloads())
            raise SpecError(
                f"op packet {op} has no default overload; pass one of its overloads "
                f"explicitly, e.g. {op}.{overloads[0] if overloads else '<overload>'} "
                f"(available: {overloads})."
            ) from None
    if tname == "CustomOpDef" and hasattr(op, "_opoverload"):
        return op._opoverload
    if op is None or not callable(op):
        raise SpecTypeError(
            f"op must be a torch op (torch.ops.ns.name or an overload), a lazy name "
            f"'ns::name', or a callable; got {type_name(op)} {op!r}."
        )
    return op


def op_qualname(op: Any) -> str | None:
    """The JSON name of an op: "ns::name", plus ".overload" only for non-default overloads.

    Returns None for ops that have no qualified name (plain Python callables).
    """
    if isinstance(op, str):
        return op
    if is_torch_op(op):
        schema = op._schema
        overload = schema.overload_name
        return f"{schema.name}.{overload}" if overload and overload != "default" else schema.name
    return None


def op_key(op: Any) -> Any:
    """What equality and hashing use: the canonical name, or the object for callables."""
    name = op_qualname(op)
    if name is None:
        return op
    ns, base, overload = parse_op_name(name)
    return f"{ns}::{base}" if overload in (None, "default") else f"{ns}::{base}.{overload}"


def op_target(op: Any) -> str:
    """A readable name for messages and AdapterStatus.target."""
    if isinstance(op, str):
        return op
    if is_torch_op(op):
        return op._schema.name
    module, qual = getattr(op, "__module__", None), getattr(op, "__qualname__", None)
    return f"{module}.{qual}" if module and qual else str(op)


def _registered_names(torch: Any, ns: str) -> list[str] | None:
    """Op names registered under `ns`, or None when torch cannot list them."""
    try:
        names = torch._C._dispatch_get_all_op_names()
    except Exception:  # private API; the message just gets less specific
        return None
    prefix = f"{ns}::"
    return sorted({n[len(prefix) :].split(".")[0] for n in names if n.startswith(prefix)})


def resolve_op(name: str) -> Any:
    """The live torch OpOverload named by "ns::name" or "ns::name.overload".

    Raises:
        SpecError: `name` is not a qualified op name.
        ImportError: torch is not installed.
        OpResolutionError: the namespace, op or overload is not registered.
    """
    ns, op, overload = parse_op_name(name)
    try:
        import torch
    except ImportError as e:
        raise ImportError(
            f"op {name!r} is a torch op, and resolving it needs PyTorch: pip install torch."
        ) from e
    packet = getattr(getattr(torch.ops, ns), op, None)
    if packet is None:
        known = _registered_names(torch, ns)
        if known == []:
            raise OpResolutionError(
                f"op {name!r}: no op is registered in namespace {ns!r} (torch.ops.{ns} is "
                f"empty). Import the extension that registers it (the Python package that "
                f"defines the '{ns}::' ops) before installing or compiling."
            )
        what = unknown(f"op in namespace {ns!r}:", op, known) if known else f"torch.ops.{ns}.{op} is not registered"
        raise OpResolutionError(
            f"op {name!r}: {what}. Import the extension that registers it, or fix the name."
        )
    try:
        return getattr(packet, overload or "default")
    except AttributeError:
        overloads = list(packet.overloads())
        raise OpResolutionError(
            f"op {name!r}: torch.ops.{ns}.{op} has no such overload; "
            + unknown("overload", overload or "default", overloads)
            + "."
        ) from None

