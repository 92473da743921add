"""Cross-rank transforms: markers saying what happens to an op's argument or output.

Argument transforms (`ArgTransform`) act on what the kernel sees; output transforms
(`OutputTransform`) act on what the caller gets. JSON form: `{"type": kind, **fields}`.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any, ClassVar

from .errors import SpecError, SpecTypeError, jpath, json_type, short, type_name, unknown


@dataclasses.dataclass(frozen=True)
class GatherInputs:
    """Halo storage: owned rows in, owned + ghost rows to the kernel (forward halo exchange)."""

    kind: ClassVar[str] = "gather_inputs"


@dataclasses.dataclass(frozen=True)
class GatherInputsFull:
    """Sharded storage: owned rows in, all rows in global-ID order (+ the pad row) to the kernel."""

    kind: ClassVar[str] = "gather_inputs_full"


@dataclasses.dataclass(frozen=True)
class SliceOwned:
    """Halo storage: the kernel sees only the owned rows of this argument."""

    kind: ClassVar[str] = "slice_owned"


@dataclasses.dataclass(frozen=True)
class ScatterOutputs:
    """Halo storage: ghost partials are added into their owners, then ghosts refreshed."""

    kind: ClassVar[str] = "scatter_outputs"


@dataclasses.dataclass(frozen=True)
class AllReduceSum:
    """Sum of this output over all ranks.

    Args:
        replicated_consumer: False when the gradient reaching this output is this rank's
            partial (the adjoint sums over ranks); True when every rank already holds the
            same global gradient, e.g. the result feeds a replicated FFT (the adjoint is
            the identity, else the gradient would be multiplied by the world size).
    """

    replicated_consumer: bool = False
    kind: ClassVar[str] = "all_reduce_sum"

    def __post_init__(self) -> None:
        if not isinstance(self.replicated_consumer, bool):
            raise SpecTypeError(
                f"AllReduceSum(replicated_consumer={short(self.replicated_consumer)}): expected a bool, "
                f"got {type_name(self.replicated_consumer)}; pass True or False."
            )


@dataclasses.dataclass(frozen=True)
class SliceOutputsOwned:
    """Sharded storage: of the kernel's all-rows output, keep this rank's rows (+ the pad row)."""

    kind: ClassVar[str] = "slice_outputs_owned"


ArgTransform = GatherInputs | GatherInputsFull | SliceOwned
OutputTransform = ScatterOutputs | AllReduceSum | SliceOutputsOwned

ARG_KINDS: dict[str, type] = {c.kind: c for c in (GatherInputs, GatherInputsFull, SliceOwned)}
OUTPUT_KINDS: dict[str, type] = {
    c.kind: c for c in (ScatterOutputs, AllReduceSum, SliceOutputsOwned)
}


def is_arg_transform(x: object) -> bool:
    """True for an instance of one of the three argument transforms."""
    return type(x) in ARG_KINDS.values()


def is_output_transform(x: object) -> bool:
    """True for an instance of one of the three output transforms."""
    return type(x) in OUTPUT_KINDS.values()


def transform_to_dict(t: ArgTransform | OutputTransform) -> dict[str, Any]:
    """JSON form of a transform: its kind under "type", then every field."""
    return {"type": t.kind, **dataclasses.asdict(t)}


def _decode(d: Any, kinds: dict[str, type], other: dict[str, type], slot: str, where: str):
    if not isinstance(d, Mapping):
        raise SpecError(
            f"a transform must be an object like {{\"type\": {next(iter(kinds))!r}}}, "
            f"got {json_type(d)} {short(d)}.",
            path=where,
        )
    if "type" not in d:
        raise SpecError(
            f"transform {short(dict(d))} has no \"type\"; expected one of {sorted(kinds)}.", path=where
        )
    kind = d["type"]
    if not isinstance(kind, str):
        hint = ""
        if isinstance(kind, list | tuple) and len(kind) == 1 and isinstance(kind[0], str):
            hint = f"; write the string itself, \"type\": {json.dumps(kind[0][:60])}"
        raise SpecTypeError(
            f"a transform's \"type\" must be a string, one of {sorted(kinds)}; got {json_type(kind)} "
            f"{short(kind)}{hint}.",
            path=jpath(where, "type"),
        )
    if kind not in kinds:
        if kind in other:
            other_slot = "output_transforms" if slot == "arg_transforms" else "arg_transforms"
            raise SpecError(
                f"{kind!r} is {'an output' if other is OUTPUT_KINDS else 'an argument'} transform "
                f"and belongs in {other_slot}; "
                f"{slot} takes one of {sorted(kinds)}.",
                path=jpath(where, "type"),
            )
        raise SpecError(unknown("transform", kind, kinds) + ".", path=jpath(where, "type"))
    cls = kinds[kind]
    fields = {f.name for f in dataclasses.fields(cls)}
    if extra := sorted(set(d) - fields - {"type"}):
        raise SpecTypeError(
            f"unknown field(s) {short(extra)} for transform {kind!r}; allowed: {sorted(fields) or 'none'}.",
            path=jpath(where, extra[0]),
        )
    given = sorted(fields & set(d))
    for f in dataclasses.fields(cls):  # a flag read from JSON: spell the fix as the file writes it
        if isinstance(f.default, bool) and f.name in d and not isinstance(d[f.name], bool):
            raise SpecTypeError(
                f"transform {kind!r}: \"{f.name}\" must be true or false, got {json_type(d[f.name])} "
                f"{json.dumps(d[f.name], default=str)[:60]}; write {json.dumps(f.default)} (the default) or "
                f"{json.dumps(not f.default)}, unquoted.",
                path=jpath(where, f.name),
            )
    try:
        # Legacy JSON without fields ({"type": "all_reduce_sum"}) takes the defaults.
        return cls(**{k: d[k] for k in given})
    except SpecError as e:  # a field's value: point at the field (the one field there is)
        raise type(e)(e.detail, path=jpath(where, given[0]) if len(given) == 1 else where) from None
    except TypeError as e:
        raise SpecTypeError(str(e), path=where) from None


def arg_transform_from_dict(d: Mapping[str, Any], where: str = "arg_transforms") -> ArgTransform:
    """Decode an argument transform; `where` names the JSON location in errors."""
    return _decode(d, ARG_KINDS, OUTPUT_KINDS, "arg_transforms", where)


def output_transform_from_dict(
    d: Mapping[str, Any], where: str = "output_transforms"
) -> OutputTransform:
    """Decode an output transform; `where` names the JSON location in errors."""
    return _decode(d, OUTPUT_KINDS, ARG_KINDS, "output_transforms", where)
