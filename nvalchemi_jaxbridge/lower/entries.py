"""A spec's adapters, resolved for `compile`: kernel slot, transforms checked against the storage kind, positions.

Everything here is worked out once per `compile` call, before any program is
built; `CompiledSpec` (`compile.py`, `arguments.py`, `programs.py`) only reads the resulting `_Entry` records.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from ..spec.transforms import (
    AllReduceSum,
    GatherInputs,
    GatherInputsFull,
    ScatterOutputs,
    SliceOutputsOwned,
    SliceOwned,
)

_HALO_ONLY = (GatherInputs, SliceOwned, ScatterOutputs, AllReduceSum)
_SHARD_ONLY = (GatherInputsFull, SliceOutputsOwned)
_TORCH_OP_TYPES = ("OpOverload", "OpOverloadPacket", "CustomOpDef")


# ------------------------------------------------------------------ kernel slot


def jax_kernel(op: Any) -> Callable[..., Any]:
    """The default kernel slot: a Python callable is a JAX kernel; torch ops are refused.

    Raises:
        TypeError: `op` is a torch op, a lazy `"ns::name"` reference, or not callable.
    """
    if isinstance(op, str):
        raise TypeError(
            f"op {op!r} is a lazy torch op reference: use nvalchemi_jaxbridge.compile, which knows "
            "torch kernels, or pass kernel_for= to nvalchemi_jaxbridge.lower.compile."
        )
    if hasattr(op, "_schema") or type(op).__name__ in _TORCH_OP_TYPES or _in_torch(op):
        raise TypeError(
            f"op {op} is a torch op: use nvalchemi_jaxbridge.compile, which knows torch kernels "
            "(the lower layer runs JAX callables only)."
        )
    if not callable(op):
        raise TypeError(f"op {op!r} is not callable; a JAX kernel is a function of jax arrays.")
    return op


def _in_torch(op: Any) -> bool:
    """Whether `op` is defined in torch itself (e.g. `torch.sin`); torch is never imported here."""
    module = str(getattr(op, "__module__", "") or "")
    return module == "torch" or module.startswith("torch.")


def _param_names(kernel: Callable[..., Any]) -> tuple[tuple[str, ...], bool] | None:
    """`(positional parameter names, takes *args)`, from `kernel.param_names` or its signature."""
    names = getattr(kernel, "param_names", None)
    if names is not None:
        return tuple(names), False
    try:
        sig = inspect.signature(kernel)
    except (TypeError, ValueError):
        return None
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    params = sig.parameters.values()
    return (tuple(p.name for p in params if p.kind in kinds),
            any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params))


# ---------------------------------------------------------------- one adapter


@dataclasses.dataclass(frozen=True, eq=False)
class _Entry:
    """One adapter of the spec, resolved: its kernel, transforms and position arguments."""

    index: int
    adapter: Any
    name: str
    kernel: Callable[..., Any]
    params: tuple[str, ...] | None
    args: Mapping[int, Any]
    outs: Mapping[int, Any]
    positions: frozenset[int] = frozenset()

    def label(self, pos: int) -> str:
        """`argument 0 ('positions')`, or `argument 0` if the name is unknown."""
        if self.params is not None and pos < len(self.params):
            return f"argument {pos} ({self.params[pos]!r})"
        return f"argument {pos}"


def _target(adapter: Any) -> str:
    """The adapter's target name (`describe().target`), e.g. `"demo::conv"`."""
    try:
        return str(adapter.describe().target)
    except Exception:  # noqa: BLE001 - a stand-in without describe()
        return str(getattr(adapter, "op", adapter))


def _storage_kind(spec: Any) -> str:
    """`"halo"` or `"shard"` from the spec's policy kind."""
    policy = getattr(spec, "policy", None)
    kind = getattr(policy, "kind", None)
    if kind in ("halo", "refresh_halo"):
        return "halo"
    if kind in ("shard", "graph_parallel"):
        return "shard"
    raise ValueError(
        f"compile: the spec's policy is {policy!r}, which has no distributed storage; use "
        "DistributionSpec(policy=HaloStoragePolicy(), ...) with a HaloPlan, or PlainShard() / "
        "GraphParallelPolicy() with a ShardPlan."
    )


def _check_kinds(name: str, table: Mapping[int, Any], slot: str, kind: str, policy: Any) -> None:
    """Raise if a transform of `table` belongs to the other storage kind."""
    wrong = _SHARD_ONLY if kind == "halo" else _HALO_ONLY
    ok = _HALO_ONLY if kind == "halo" else _SHARD_ONLY
    arg_side = (GatherInputs, GatherInputsFull, SliceOwned)
    allowed = [c.__name__ for c in ok if (c in arg_side) == (slot == "arg_transforms")]
    for pos, t in sorted(table.items()):
        if isinstance(t, wrong):
            other = "sharded (PlainShard / GraphParallelPolicy)" if kind == "halo" else "halo (HaloStoragePolicy)"
            raise ValueError(
                f"compile: adapter {name!r} declares {type(t).__name__}() on {slot}[{pos}], a transform "
                f"for {other} storage, but the spec's policy is {type(policy).__name__} ({kind} storage), "
                f"where it would do nothing. Remove it, or use one of {allowed} there."
            )


def _resolve(spec: Any, kind: str, kernel_for: Callable[[Any], Callable[..., Any]]) -> tuple[_Entry, ...]:
    """Every adapter of the spec, checked against the storage kind, with its kernel."""
    entries = []
    for i, adapter in enumerate(getattr(spec, "custom_ops", ()) or ()):
        name = _target(adapter)
        args, outs = dict(adapter.arg_transforms), dict(adapter.output_transforms)
        _check_kinds(name, args, "arg_transforms", kind, spec.policy)
        _check_kinds(name, outs, "output_transforms", kind, spec.policy)
        kernel = kernel_for(adapter.op)
        sig = _param_names(kernel)
        params = None
        if sig is not None:
            params, var = sig
            if not var and (beyond := sorted(p for p in args if p >= len(params))):
                raise ValueError(
                    f"compile: adapter {name!r} declares {type(args[beyond[0]]).__name__}() on argument "
                    f"{beyond[0]}, but its kernel takes {len(params)} positional parameters {params}; "
                    "count positions from 0 as in op(*args)."
                )
        entries.append(_Entry(i, adapter, name, kernel, params, args, outs))
    return tuple(entries)


def _find(entries: tuple[_Entry, ...], target: Any, where: str) -> _Entry:
    """The entry named by an adapter, its op, or its target name."""
    if isinstance(target, str):
        hits = [e for e in entries if e.name == target or (isinstance(e.adapter.op, str) and e.adapter.op == target)]
    else:
        hits = [e for e in entries if e.adapter is target or e.adapter.op is target]
        if not hits:
            hits = [e for e in entries if _safe_eq(e.adapter, target)]
    if len(hits) == 1:
        return hits[0]
    known = [e.name for e in entries]
    if not hits:
        raise KeyError(
            f"{where}: {target!r} is not an adapter of this spec; known targets: {known}. Pass the "
            "OpAdapter, its op, or its target name (OpAdapter.describe().target)."
        )
    raise KeyError(f"{where}: {target!r} matches {len(hits)} adapters ({known}); pass the OpAdapter itself.")


def _safe_eq(a: Any, b: Any) -> bool:
    """`a == b`, False when comparing raises."""
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001
        return False


def _position_args(entries: tuple[_Entry, ...], kind: str, positions: Mapping[Any, Iterable[int | str]] | None):
    """Entries with their `positions` arguments resolved to ints and checked."""
    if not positions:
        return entries
    if not isinstance(positions, Mapping):
        raise TypeError(
            f"compile: positions must be a dict {{adapter or target name: [argument positions or names]}}, "
            f"got {type(positions).__name__}; e.g. positions={{'demo::lj': [0]}}."
        )
    chosen: dict[int, set[int]] = {}
    for key, items in positions.items():
        e = _find(entries, key, "compile(positions=...)")
        if isinstance(items, (str, int)):
            items = [items]
        for item in items:
            pos = item
            if isinstance(item, str):
                if e.params is None or item not in e.params:
                    raise ValueError(
                        f"compile(positions=...): adapter {e.name!r} has no positional parameter {item!r}; "
                        f"its parameters are {e.params}."
                    )
                pos = e.params.index(item)
            if isinstance(pos, bool) or not isinstance(pos, int) or not isinstance(e.args.get(pos), GatherInputs):
                raise ValueError(
                    f"compile(positions=...): adapter {e.name!r} {e.label(pos) if isinstance(pos, int) else repr(pos)} "
                    f"is not a GatherInputs argument (those are {sorted(p for p, t in e.args.items() if isinstance(t, GatherInputs))}); "
                    "only gathered positions get periodic image shifts."
                )
            chosen.setdefault(e.index, set()).add(pos)
    return tuple(dataclasses.replace(e, positions=frozenset(chosen.get(e.index, ()))) for e in entries)
