"""The parts of an `MLIPSpec` below the spec itself: output kinds and reductions, force strategies,
`CompilePolicy` and `OutputSpec`, and the checks that read their JSON values (with the JSON path of a
bad value in the error). Imports neither jax nor torch.
"""

from __future__ import annotations

import dataclasses
import enum
import warnings
from collections.abc import Iterable, Mapping
from typing import Any

from .errors import SpecError, SpecTypeError, jpath, json_type, short, unknown

class OutputKind(enum.StrEnum):
    """What one row of a model output is: an atom, a system, or nothing rank-local."""

    PER_NODE = "per_node"
    PER_GRAPH = "per_graph"
    GLOBAL = "global"
    UNKNOWN = "unknown"


class Reduce(enum.StrEnum):
    """How an output's per-rank values combine: by kind (none), summed over ranks, or owned rows kept."""

    NONE = "none"
    ALL_REDUCE = "all_reduce"
    OWNED_ONLY = "owned_only"


class ForceStrategy(enum.StrEnum):
    """Who produces forces: the model itself, or the framework by autograd of a node or global energy."""

    MODEL_INTERNAL = "model_internal"
    FRAMEWORK_FROM_NODE_ENERGY = "framework_from_node_energy"
    FRAMEWORK_FROM_GLOBAL_ENERGY = "framework_from_global_energy"


ENVELOPE_KEYS = (
    "system_reductions", "node_energy_key", "node_virial_key", "gp_replicate_geometry",
    "owned_only_outputs", "all_reduce_outputs", "output_kinds", "compile",
)
_COMPILE_KEYS = ("static_shapes", "force_strategy", "stress_via_strain")


def _vocab[E: enum.StrEnum](cls: type[E], value: object, what: str, path: str) -> E:
    """value as a member of the str enum cls; errors list the allowed values."""
    allowed = [m.value for m in cls]
    if isinstance(value, cls):
        return value
    if not isinstance(value, str):
        raise SpecTypeError(f"{what} must be a string, one of {allowed}, got {json_type(value)}.", path=path)
    if value not in allowed:
        raise SpecError(unknown(what, value, allowed) + ".", path=path)
    return cls(value)


def _check_bool(value: object, path: str) -> None:
    if not isinstance(value, bool):
        raise SpecTypeError(f"must be a bool (true/false in JSON), got {short(value)} ({json_type(value)}).", path=path)


def _check_name(value: object, path: str, what: str = "output names") -> str:
    if not isinstance(value, str) or not value:
        raise SpecTypeError(f"{what} must be non-empty strings, got {short(value)}.", path=path)
    return value


def _sequence(value: object, path: str, what: str) -> tuple[Any, ...]:
    if isinstance(value, str | bytes | Mapping) or not isinstance(value, Iterable):
        raise SpecTypeError(f"must be {what}, got {json_type(value)}.", path=path)
    return tuple(value)


def _names(value: object, path: str) -> tuple[str, ...]:
    """A set of output names given as a tuple, list or set: validated, in the given order."""
    items = _sequence(value, path, "a list, tuple or set of output names")
    for i, name in enumerate(items):
        _check_name(name, jpath(path, i))
        if name in items[:i]:
            raise SpecError(f"{name!r} is listed twice; list each output once.", path=jpath(path, i))
    return items


def _kinds(value: object, path: str) -> dict[str, OutputKind]:
    """output_kinds given as {name: kind} or as [(name, kind), ...] pairs."""
    out: dict[str, OutputKind] = {}
    if isinstance(value, Mapping):
        for name, kind in value.items():
            here = jpath(path, str(name))
            _check_name(name, here)
            out[name] = _vocab(OutputKind, kind, f"output kind for {name!r}:", here)
        return out
    pairs = _sequence(value, path, 'a {name: kind} mapping or a list of ["<output>", "<kind>"] pairs')
    for i, pair in enumerate(pairs):
        here = jpath(path, i)
        if isinstance(pair, str | bytes | Mapping) or not isinstance(pair, list | tuple) or len(pair) != 2:
            raise SpecTypeError(f'must be a pair ["<output>", "<kind>"], got {short(pair)}.', path=here)
        name, kind = pair
        _check_name(name, jpath(here, 0))
        if name in out:
            raise SpecError(f"output {name!r} is declared twice; give each output one kind.", path=jpath(here, 0))
        out[name] = _vocab(OutputKind, kind, f"output kind for {name!r}:", jpath(here, 1))
    return out


def _rebased(e: SpecError, prefix: str, where: str) -> str:
    """e's path with a Python prefix (`MLIPSpec.x`) turned into a JSON path (`$.x`)."""
    path = e.path or ""
    return where + path[len(prefix):] if path.startswith(prefix) else (path or where)


# --------------------------------------------------------------------------- compile


@dataclasses.dataclass(frozen=True)
class CompilePolicy:
    """How the framework drives a model: static shapes, who computes forces, stress by strain.

    Args:
        static_shapes: pad to fixed per-rank capacities so a compiled step stays compiled.
        force_strategy: a `ForceStrategy` or its string; the reference's default is
            `"model_internal"` (the model returns its own forces).
        stress_via_strain: the framework takes stress as dE/dstrain / V (only for models whose
            whole cell dependence is differentiable).

    The reference's `graph_padder` (a live padding object) has no JSON form and no field here;
    `from_dict` drops a `"graph_padder"` key with a warning.

    Example:
        >>> CompilePolicy(force_strategy="framework_from_node_energy").to_dict()["force_strategy"]
        'framework_from_node_energy'
    """

    static_shapes: bool = True
    force_strategy: ForceStrategy = ForceStrategy.MODEL_INTERNAL
    stress_via_strain: bool = False

    def __post_init__(self) -> None:
        _check_bool(self.static_shapes, "CompilePolicy.static_shapes")
        _check_bool(self.stress_via_strain, "CompilePolicy.stress_via_strain")
        strategy = _vocab(ForceStrategy, self.force_strategy, "force strategy", "CompilePolicy.force_strategy")
        object.__setattr__(self, "force_strategy", strategy)

    @property
    def forces_via_autograd(self) -> bool:
        """True when the framework takes forces as -dE/dpositions (any `framework_from_*` strategy)."""
        return self.force_strategy is not ForceStrategy.MODEL_INTERNAL

    @property
    def energy_output(self) -> str:
        """The output differentiated for forces: "atomic_energies" for the node strategy, else "energy"."""
        return "atomic_energies" if self.force_strategy is ForceStrategy.FRAMEWORK_FROM_NODE_ENERGY else "energy"

    def to_dict(self) -> dict[str, Any]:
        """JSON form, the reference's: `{"static_shapes", "force_strategy", "stress_via_strain"}`."""
        return {
            "static_shapes": self.static_shapes,
            "force_strategy": self.force_strategy.value,
            "stress_via_strain": self.stress_via_strain,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], *, where: str = "compile") -> CompilePolicy:
        """Inverse of to_dict; missing `static_shapes` / `stress_via_strain` take their defaults.

        Raises:
            SpecError: `{}`, no `force_strategy`, an unknown key or a bad value (with its path).
        """
        if not isinstance(d, Mapping):
            raise SpecTypeError(f"a compile policy must be an object or null, got {json_type(d)}.", path=where)
        if not d:
            raise SpecError(
                'an empty compile policy {} declares nothing; write null for no policy, or e.g. '
                '{"force_strategy": "model_internal"}.',
                path=where,
            )
        fields = dict(d)
        if "graph_padder" in fields:
            del fields["graph_padder"]
            warnings.warn(
                f"{where}.graph_padder: dropped; nvalchemi-toolkit never writes it (a graph padder is a live "
                "object), and this package sizes padded shapes from its own layout plans. Remove the key.",
                UserWarning,
                stacklevel=2,
            )
        if extra := sorted(set(fields) - set(_COMPILE_KEYS)):
            raise SpecError(unknown("compile key", extra[0], _COMPILE_KEYS) + ".", path=jpath(where, extra[0]))
        if "force_strategy" not in fields:
            raise SpecError(
                f'missing "force_strategy"; one of {[s.value for s in ForceStrategy]}.', path=where
            )
        try:
            return cls(**fields)
        except SpecError as e:
            raise type(e)(e.detail, path=_rebased(e, "CompilePolicy", where)) from None


# --------------------------------------------------------------------------- outputs


@dataclasses.dataclass(frozen=True)
class OutputSpec:
    """One output's declaration, for `MLIPSpec(outputs={name: ...})`: its kind and its reduction."""

    kind: OutputKind = OutputKind.UNKNOWN
    reduce: Reduce = Reduce.NONE

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", _vocab(OutputKind, self.kind, "output kind", "OutputSpec.kind"))
        object.__setattr__(self, "reduce", _vocab(Reduce, self.reduce, "reduction", "OutputSpec.reduce"))


def _output_spec(value: object, path: str) -> OutputSpec:
    """An `outputs=` value: OutputSpec, a kind ("per_graph"), or a (kind, reduce) pair."""
    try:
        if isinstance(value, OutputSpec):
            return value
        if isinstance(value, str):
            return OutputSpec(value)
        if isinstance(value, list | tuple) and len(value) == 2:
            return OutputSpec(*value)
    except SpecError as e:
        raise type(e)(e.detail, path=_rebased(e, "OutputSpec", path)) from None
    raise SpecTypeError(
        f'an output is declared as a kind ("per_graph"), a (kind, reduce) pair (("per_node", "owned_only")) '
        f"or an OutputSpec, got {short(value)}.",
        path=path,
    )
