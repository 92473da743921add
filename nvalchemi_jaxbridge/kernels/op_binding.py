"""A torch op's schema as `TorchOpKernel` uses it, and how a call's arguments bind to it.

`OpBinding` resolves the op (an OpOverload, its packet or a CustomOpDef),
classifies its arguments once (Tensor, Tensor list, static value), names the
results JAX sees (the returned tensors, then the mutated `Tensor(a!)` arguments
in schema order) and which of them a call returns (`outputs=`). `bind` and
`check_kinds` turn a call's arguments into one value per schema position,
arrays where the schema has Tensors and Python values elsewhere. `_Call` is
what one combination of argument shapes, dtypes and static values compiles to.
The output shapes come from `shape_probe`.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
import torch

_TENSOR = "tensor"
_TENSOR_LIST = "tensor_list"
_STATIC = "static"


class KernelError(ValueError):
    """A torch op cannot be called from JAX as asked; the message says why and the fix."""


@dataclasses.dataclass(frozen=True)
class _Param:
    """One argument of the op's schema."""

    name: str
    kind: str  # _TENSOR, _TENSOR_LIST or _STATIC
    mutable: bool
    kwarg_only: bool
    has_default: bool
    default: Any
    type_str: str


def _params(op: Any) -> tuple[_Param, ...]:
    """The op's arguments, classified once."""
    opt_tensor = torch._C.OptionalType.ofTensor()
    out = []
    for a in op._schema.arguments:
        if a.type.isSubtypeOf(opt_tensor):
            kind = _TENSOR
        elif "Tensor" in str(a.type):
            kind = _TENSOR_LIST
        else:
            kind = _STATIC
        mutable = bool(a.alias_info is not None and a.alias_info.is_write)
        has_default = a.has_default_value()
        out.append(
            _Param(a.name, kind, mutable, a.kwarg_only, has_default, a.default_value if has_default else None, str(a.type))
        )
    return tuple(out)


def _hashable(v: Any, where: str) -> Any:
    """A hashable stand-in for a static argument (lists become tuples)."""
    if isinstance(v, (list, tuple)):
        return (type(v).__name__, tuple(_hashable(x, where) for x in v))
    if isinstance(v, dict):
        return ("dict", tuple(sorted((k, _hashable(x, where)) for k, x in v.items())))
    try:
        hash(v)
    except TypeError:
        raise KernelError(
            f"{where} is a {type(v).__name__}, which cannot key the kernel cache; pass a "
            f"number, bool, string, None, or a list/tuple of those."
        ) from None
    return (type(v).__name__, v)


def _is_array(v: Any) -> bool:
    return isinstance(v, (jax.Array, np.ndarray, np.generic)) or isinstance(v, jax.core.Tracer)


class _Missing:
    def __repr__(self) -> str:
        return "<missing>"


_MISSING = _Missing()


def _contains_array(v: Any) -> bool:
    if isinstance(v, (list, tuple)):
        return any(_contains_array(x) for x in v)
    return _is_array(v)


def _as_overload(op: Any) -> Any:
    """An OpOverload from an OpOverload, packet or CustomOpDef; raise otherwise."""
    tname = type(op).__name__
    if tname == "CustomOpDef" and hasattr(op, "_opoverload"):
        return op._opoverload
    if tname == "OpOverloadPacket":
        try:
            return op.default
        except AttributeError:
            raise KernelError(
                f"op packet {op} has no default overload; pass one of {list(op.overloads())} "
                f"explicitly, e.g. torch.ops.<ns>.<name>.<overload>."
            ) from None
    if hasattr(op, "_schema") and hasattr(op, "_overloadname"):
        return op
    raise KernelError(
        f"TorchOpKernel needs a torch op (torch.ops.ns.name.default, its packet, or a "
        f"@torch.library.custom_op function); got {type(op).__name__} {op!r:.80}."
    )


# ----------------------------------------------------------------------------- per-call plan


@dataclasses.dataclass(frozen=True)
class _Call:
    """What one (op, argument shapes/dtypes, static values) combination compiles to."""

    array_pos: tuple[int, ...]  # schema positions fed by JAX arrays, in call order
    mutated_pos: tuple[int, ...]  # schema positions of mutated tensor args that are arrays
    statics: tuple[Any, ...]  # value per schema position (None where an array goes)
    n_returns: int
    result_specs: tuple[jax.ShapeDtypeStruct, ...]  # returns, then mutated args
    selected: tuple[int, ...]  # indices into result_specs that the caller gets
    fn: Callable[..., tuple[jax.Array, ...]]  # the custom_vjp function of the arrays
    path: str = "callback"  # the forward's path: "ffi" or "callback (<why>)"
    bwd_path: str = "callback"  # the backward's path, likewise
    kept: Callable[[], int] = lambda: 0  # torch graphs held for backwards to come (vjp.custom_vjp)
    token_reads: Callable[[], int] = lambda: 0  # backwards that read their graph's token from the device


# ----------------------------------------------------------------------------- the binding


class OpBinding:
    """A torch op's schema, classified, and the results a call returns.

    Args:
        op: a torch `OpOverload`, its packet, or a `CustomOpDef`.
        outputs: `TorchOpKernel`'s `outputs=`: result indices or mutated arguments'
            names, or None for all results.
    """

    def __init__(self, op: Any, outputs: Any) -> None:
        op = _as_overload(op)
        self.op = op
        self.name = f"{op._schema.name}" + (
            f".{op._overloadname}" if op._overloadname not in ("default", "") else ""
        )
        self.params = _params(op)
        returns = op._schema.returns
        bad = [str(r.type) for r in returns if str(r.type) != "Tensor"]
        if bad:
            raise KernelError(
                f"op {self.name} returns {[str(r.type) for r in returns]}; only ops returning "
                f"Tensors (or nothing) can be called from JAX. Wrap it in a custom op that "
                f"returns plain Tensors."
            )
        self.n_returns = len(returns)
        self.mutable = tuple(i for i, p in enumerate(self.params) if p.mutable)
        names = [f"return {i}" for i in range(self.n_returns)] + [
            f"mutated argument {self.params[i].name!r}" for i in self.mutable
        ]
        self.result_names = tuple(names)
        self.outputs = None if outputs is None else tuple(outputs)
        self.selected = self._resolve_outputs(self.outputs)

    # -- outputs --------------------------------------------------------------------

    def _resolve_outputs(self, outputs: tuple[int | str, ...] | None) -> tuple[int, ...]:
        n = len(self.result_names)
        listing = ", ".join(f"{i}: {s}" for i, s in enumerate(self.result_names)) or "none"
        if outputs is None:
            if n == 0:
                raise KernelError(
                    f"op {self.name} returns nothing and mutates no argument, so it has no "
                    f"result JAX could return; only ops with a Tensor result or a Tensor(a!) "
                    f"argument can be called."
                )
            return tuple(range(n))
        selected = []
        mutable_names = {self.params[i].name: self.n_returns + j for j, i in enumerate(self.mutable)}
        for k, o in enumerate(outputs):
            if isinstance(o, bool) or not isinstance(o, (int, str)):
                raise KernelError(
                    f"outputs[{k}] of op {self.name} is {o!r}; give a result index (int) or the "
                    f"name of a mutated argument (str). The op's results are {listing}."
                )
            if isinstance(o, str):
                if o not in mutable_names:
                    other = "" if not any(p.name == o for p in self.params) else (
                        f" ({o!r} is an argument the op does not mutate: it is not Tensor(a!) in the schema)"
                    )
                    raise KernelError(
                        f"outputs[{k}] of op {self.name} names {o!r}, which is not a mutated "
                        f"argument{other}; mutated arguments: {sorted(mutable_names) or 'none'}. "
                        f"The op's results are {listing}."
                    )
                selected.append(mutable_names[o])
            else:
                if not -n <= o < n:
                    raise KernelError(
                        f"outputs[{k}] of op {self.name} is {o}, but the op has {n} result(s): "
                        f"{listing}. Use one of these indices, or a mutated argument's name."
                    )
                selected.append(o % n)
        return tuple(selected)

    # -- binding --------------------------------------------------------------------

    def bind(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> list[Any]:
        """Values per schema position, defaults filled in; raise on a bad call."""
        params = self.params
        n_pos = sum(not p.kwarg_only for p in params)
        if len(args) > n_pos:
            raise KernelError(
                f"op {self.name} takes {n_pos} positional argument(s) but {len(args)} were "
                f"given; its schema is {self.op._schema}."
            )
        values: list[Any] = list(args) + [_MISSING] * (len(params) - len(args))
        by_name = {p.name: i for i, p in enumerate(params)}
        for key, v in kwargs.items():
            if key not in by_name:
                close = difflib.get_close_matches(key, list(by_name), n=1)
                hint = f" Did you mean {close[0]!r}?" if close else ""
                raise KernelError(
                    f"op {self.name} has no argument {key!r}; its arguments are {list(by_name)}.{hint}"
                )
            i = by_name[key]
            if values[i] is not _MISSING:
                raise KernelError(f"op {self.name} got argument {key!r} both by position ({i}) and by keyword.")
            values[i] = v
        for i, p in enumerate(params):
            if values[i] is _MISSING:
                if not p.has_default:
                    raise KernelError(
                        f"op {self.name} is missing argument {p.name!r} (position {i}, type "
                        f"{p.type_str}); its schema is {self.op._schema}."
                    )
                values[i] = p.default
        return values

    def check_kinds(self, values: list[Any]) -> None:
        """Raise unless each value fits its schema argument: arrays for Tensors, Python values elsewhere."""
        for i, (p, v) in enumerate(zip(self.params, values)):
            where = f"argument {p.name!r} (position {i}) of op {self.name}"
            if p.kind == _TENSOR:
                if v is None and "Optional" in p.type_str:
                    continue
                if not _is_array(v):
                    raise KernelError(
                        f"{where} is a Tensor in the schema, so pass a JAX array; got "
                        f"{type(v).__name__} {v!r:.60}. Wrap scalars with jnp.asarray(...)."
                    )
            elif p.kind == _TENSOR_LIST:
                if _contains_array(v):
                    raise KernelError(
                        f"{where} is a {p.type_str}; lists of tensors cannot be passed to a torch "
                        f"op from JAX yet. Wrap the op in a custom op that takes separate Tensors."
                    )
            elif _contains_array(v):
                raise KernelError(
                    f"{where} is a {p.type_str} in the schema and must be a Python value, got a "
                    f"JAX array. Pass a Python {p.type_str} (it is baked into the compiled program); "
                    f"values that change from call to call must be Tensor arguments of the op."
                )
            if p.mutable and not _is_array(v):
                raise KernelError(f"{where} is mutated by the op (Tensor(a!)) and must be a JAX array holding its initial value.")

    def array_positions(self, values: Sequence[Any]) -> tuple[int, ...]:
        """The schema positions a call feeds with arrays: its Tensor arguments that are not None."""
        return tuple(i for i, v in enumerate(values) if self.params[i].kind == _TENSOR and v is not None)

    def cache_key(self, values: Sequence[Any], array_pos: tuple[int, ...], arrays: Sequence[Any]) -> Any:
        """What a compiled call depends on: the arrays' shapes and dtypes, and the static values."""
        return (
            tuple((i, tuple(a.shape), np.dtype(a.dtype).str) for i, a in zip(array_pos, arrays)),
            tuple(
                (i, _hashable(v, f"argument {self.params[i].name!r} of op {self.name}"))
                for i, v in enumerate(values)
                if i not in array_pos
            ),
        )
