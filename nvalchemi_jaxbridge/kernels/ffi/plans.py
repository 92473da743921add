"""The text a plan is registered with: the op's static arguments and where its tensors come from.

The first line is `jb1 <number of FFI arguments>`; then one line per schema
argument, in schema order (keyword-only ones included, defaults already filled):

    N            None                 b0 / b1      bool
    i<int>       int64, decimal       d<float>     double as a C99 hex float (exact; inf, -inf, nan)
    s<hex>       str, UTF-8 in hex    I<i,i,...>   int list
    D<d,d,...>   double list          B<0,1,...>   bool list
    a<k>         FFI argument k       r<k>         FFI result k (a mutated argument, aliased)
    m<k>         FFI argument k, cloned before the op writes into it (backward plans)

A differentiated call has two plans (`encode(..., backward=Backward(...))`), both
taking mutated arguments as `m` slots and adding `G<k,...>`, the FFI arguments
differentiated, and `O<r,...>`, the op results (returns, then mutated arguments)
that get cotangents, in this order; then one of:

    K<cap>       the forward: the op once under autograd; its results, then an int32 (2,)
                 token naming the graph it keeps (at most `cap` kept)
    T<id>        the backward: FFI arguments are the saved arrays, the token, then the
                 cotangents; results are the gradients of the `G` arguments, from the graph
                 plan `id` (the forward) kept, or from a re-run of the op where it is gone

Anything else (a `ScalarType`, `Device`, dict, complex, a Tensor list) makes the
call ineligible for the FFI path; `Ineligible` says which argument and why.
Plain Python, no torch or jax, so the encoding is testable on its own.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

VERSION = "jb1"
_INT64 = (-(2**63), 2**63 - 1)


class Ineligible(Exception):
    """A call the FFI path cannot express; `reason` says which argument and why."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclasses.dataclass(frozen=True)
class TensorSlot:
    """A tensor argument: FFI argument `index`, or FFI result `index` when `from_result` (mutated)."""

    index: int
    from_result: bool = False
    cloned: bool = False


@dataclasses.dataclass(frozen=True)
class Backward:
    """What a plan of a differentiated call adds: the differentiated FFI arguments, the results that
    get cotangents, and either the forward's graph cap (`keep`) or the forward plan the backward reads (`source`)."""

    leaves: tuple[int, ...]
    outputs: tuple[int, ...]
    keep: int | None = None
    source: int | None = None


def _base(type_str: str) -> str:
    """`Optional[float]` -> `float`."""
    return type_str[len("Optional[") : -1] if type_str.startswith("Optional[") else type_str


def _int(v: Any) -> str:
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError
    if not _INT64[0] <= v <= _INT64[1]:
        raise OverflowError
    return str(v)


def _float(v: Any) -> str:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise TypeError
    return float(v).hex()


def _bool(v: Any) -> str:
    if not isinstance(v, bool):
        raise TypeError
    return "1" if v else "0"


def _list(v: Any, item) -> str:
    if not isinstance(v, (list, tuple)):
        raise TypeError
    return ",".join(item(x) for x in v)


def _scalar(v: Any) -> str:
    if isinstance(v, bool):
        return "b" + _bool(v)
    if isinstance(v, int):
        return "i" + _int(v)
    return "d" + _float(v)


def encode_value(type_str: str, v: Any) -> str:
    """One line for a static value of schema type `type_str`; TypeError/OverflowError if it has none."""
    if v is None:
        return "N"
    base = _base(type_str)
    if base == "float":
        return "d" + _float(v)
    if base == "int":
        return "i" + _int(v)
    if base == "bool":
        return "b" + _bool(v)
    if base == "str":
        if not isinstance(v, str):
            raise TypeError
        return "s" + v.encode("utf-8").hex()
    if base == "number":
        return _scalar(v)
    if base == "List[int]":
        return "I" + _list(v, _int)
    if base == "List[float]":
        return "D" + _list(v, _float)
    if base == "List[bool]":
        return "B" + _list(v, _bool)
    raise TypeError


def encode(n_args: int, entries: Sequence[tuple[str, str, Any]], backward: Backward | None = None) -> str:
    """The plan text for (name, schema type, value or TensorSlot) per schema argument.

    With `backward`, the text of the op's backward (see the module docstring).

    Raises:
        Ineligible: a value the encoding cannot express (names the argument and the fix).
    """
    lines = [f"{VERSION} {n_args}"]
    for pos, (name, type_str, v) in enumerate(entries):
        if isinstance(v, TensorSlot):
            lines.append(("r" if v.from_result else "m" if v.cloned else "a") + str(v.index))
            continue
        try:
            lines.append(encode_value(type_str, v))
        except OverflowError:
            raise Ineligible(f"argument {name!r} (position {pos}) is {v}, outside int64") from None
        except TypeError:
            raise Ineligible(
                f"argument {name!r} (position {pos}) has schema type {type_str} and value "
                f"{type(v).__name__} {v!r:.60}, which the FFI plan cannot express (it holds None, bool, "
                f"int, float, str and lists of int/float/bool)"
            ) from None
    if backward is not None:
        lines.append("G" + _list(backward.leaves, _int))
        lines.append("O" + _list(backward.outputs, _int))
        lines.append(f"K{_int(backward.keep)}" if backward.keep is not None else f"T{_int(backward.source)}")
    return "\n".join(lines)

