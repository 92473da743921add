"""An adapter's positions and role keywords: parsing and checks (what `OpAdapter` declares where)."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

from .errors import SpecError, SpecTypeError, short, type_name
from .transforms import (
    ARG_KINDS,
    OUTPUT_KINDS,
    AllReduceSum,
    GatherInputs,
    GatherInputsFull,
    ScatterOutputs,
    SliceOutputsOwned,
    SliceOwned,
    is_arg_transform,
    is_output_transform,
)

# Role keywords in the order they are applied (the reference's order).
ARG_ROLES = (
    ("gather_inputs", GatherInputs),
    ("neighbors_inputs", GatherInputs),  # alias of gather_inputs
    ("gather_inputs_full", GatherInputsFull),
    ("owned_slice_inputs", SliceOwned),
)
OUTPUT_ROLES = (
    ("scatter_outputs", ScatterOutputs),
    ("all_reduce_outputs", AllReduceSum),
    ("slice_outputs_owned", SliceOutputsOwned),
)
_POSITION_KEY = re.compile(r"0|[1-9][0-9]*")
#: Positions index op(*args) or its outputs; anything larger is a mistake (and would size arrays).
MAX_POSITION = 2**31 - 1


def position_from_key(key: object, where: str) -> int:
    """A JSON position key ("0", "1", ...) as an int; SpecError (at `where`) for anything else."""
    if not isinstance(key, str) or not _POSITION_KEY.fullmatch(key):
        raise SpecError(
            f"position key {short(key)} is not a decimal position; write \"0\", \"1\", ... "
            "(no sign, no leading zeros).",
            path=where,
        )
    if len(key) > len(str(MAX_POSITION)) or int(key) > MAX_POSITION:  # length first: int() of 5000 digits is slow
        raise SpecError(
            f"position key {short(key)} ({len(key)} digits) is too large; positions index op(*args) or its "
            f"outputs and are at most 2**31 - 1 = {MAX_POSITION}. Count from \"0\".",
            path=where,
        )
    return int(key)


def check_position(pos: object, where: str, what: str) -> int:
    """`pos` as a position of `what` (an int in [0, 2**31 - 1]), else a SpecError or SpecTypeError at `where`."""
    if isinstance(pos, bool) or not isinstance(pos, int):
        raise SpecTypeError(
            f"{what} position {short(pos)} is {type_name(pos)}; positions are ints counted from 0 "
            "as in op(*args), e.g. {0: GatherInputs()}.",
            path=where,
        )
    if pos < 0:
        raise SpecError(
            f"{what} position {short(pos)} is negative; count from 0 as in op(*args) "
            "(keyword arguments cannot be addressed by position).",
            path=where,
        )
    if pos > MAX_POSITION:
        raise SpecError(
            f"{what} position {short(pos)} is too large; positions index op(*args) or its outputs and are "
            f"at most 2**31 - 1 = {MAX_POSITION}. Count from 0.",
            path=where,
        )
    return pos


def check_transforms(
    given: Mapping[int, Any] | None, slot: str, where: str
) -> dict[int, Any]:
    """`arg_transforms` or `output_transforms` (`slot`) checked: positions, and transforms of that slot's kind."""
    if given is None:
        return {}
    if not isinstance(given, Mapping):
        raise SpecTypeError(
            f"{slot} must be a dict position -> transform, got {type_name(given)}; "
            f"e.g. {slot}={{0: {'GatherInputs' if slot == 'arg_transforms' else 'ScatterOutputs'}()}}.",
            path=where,
        )
    ok, bad, bad_slot = (
        (is_arg_transform, is_output_transform, "output_transforms")
        if slot == "arg_transforms"
        else (is_output_transform, is_arg_transform, "arg_transforms")
    )
    kinds = ARG_KINDS if slot == "arg_transforms" else OUTPUT_KINDS
    out: dict[int, Any] = {}
    for pos, t in given.items():
        check_position(pos, where, slot)
        if ok(t):
            out[pos] = t
        elif isinstance(t, type) and t in (*ARG_KINDS.values(), *OUTPUT_KINDS.values()):
            raise SpecTypeError(
                f"{slot}[{pos}] is the class {t.__name__}; pass an instance: {t.__name__}().",
                path=where,
            )
        elif bad(t):
            raise SpecTypeError(
                f"{slot}[{pos}] is {t!r}, which belongs in {bad_slot}; {slot} takes "
                f"{', '.join(c.__name__ for c in kinds.values())}. "
                f"Move it: {bad_slot}={{{pos}: {t!r}}}.",
                path=where,
            )
        else:
            raise SpecTypeError(
                f"{slot}[{pos}] is {type_name(t)} {t!r}, not a transform; {slot} takes "
                f"{', '.join(c.__name__ for c in kinds.values())}.",
                path=where,
            )
    return out


def apply_roles(
    table: dict[int, Any], explicit: dict[int, Any], roles: dict[str, Any], spec, where: str
) -> None:
    """Add each role keyword's positions (`spec`: (keyword, transform class) pairs) to `table`, refusing clashes."""
    source = {pos: "the explicit dict" for pos in explicit}
    for name, cls in spec:
        positions = roles[name]
        if isinstance(positions, str | bytes) or not isinstance(positions, Iterable):
            raise SpecTypeError(
                f"{name} must be a list of positions, got {type_name(positions)} {positions!r}; "
                f"e.g. {name}=[0].",
                path=where,
            )
        positions = list(positions)
        seen: set[int] = set()
        for pos in positions:
            check_position(pos, where, name)
            if pos in seen:
                raise SpecError(
                    f"{name}={positions} lists position {pos} twice; list each position once.",
                    path=where,
                )
            seen.add(pos)
            new = cls()
            if pos in table and table[pos] != new:
                raise SpecError(
                    f"position {pos} gets {new!r} from {name} but already has {table[pos]!r} "
                    f"from {source[pos]}; give each position one transform.",
                    path=where,
                )
            table[pos] = new
            source.setdefault(pos, name)
