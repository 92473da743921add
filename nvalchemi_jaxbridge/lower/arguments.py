"""A `CompiledSpec.call`'s arguments: each leaf given its role and placed on the mesh.

This implements the argument rule of `compile.py` (the table in its module
docstring): a transformed argument is checked against the plan's storage rows
and placed `P(axis)`; an untransformed leaf becomes a per-device block, a
replicated array or a static constant. The roles are part of the program cache
key, and `programs.build` reads them to choose the `in_specs`.

A role is `(kind, aval, extra)`: kind `"sharded"`, `"replicated"` or
`"static"`; aval `(shape, dtype)` (the type name for a static leaf); extra the
transformed position (or None), or the static value itself.

No silent narrowing: with `jax_enable_x64` off, every array leaf of a 64-bit
dtype (int64, uint64, float64, complex128; numpy or an already placed
`jax.Array`) is refused (`refuse_narrowing`), even one whose values would fit
32 bits, since its dtype would still change; a `jax.Array` made while x64 is
off is already 32-bit and passes. Arguments declared as positions
(`compile(positions=...)`) must be real floating point.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from ..spec.transforms import GatherInputs, SliceOwned
from ..layout.finite import FIX_POSITIONS
from .entries import _Entry
from .finite import check_array
from .tables import HaloTables, place

if TYPE_CHECKING:
    from .compile import CompiledSpec

_STATIC_TYPES = (bool, int, float, complex, str, bytes, type(None))
_NARROW = {"int64": "int32", "uint64": "uint32", "float64": "float32", "complex128": "complex64"}


def refuse_narrowing(x: Any, what: str) -> None:
    """Raise (ValueError) if `x` has a 64-bit dtype while `jax_enable_x64` is off: JAX would cut it to 32 bits.

    Tracers are JAX values already and pass; `what` names the argument in the message.
    """
    if isinstance(x, jax.core.Tracer) or jax.config.read("jax_enable_x64"):
        return
    name = np.dtype(x.dtype).name
    if name not in _NARROW:
        return
    loss = "digits past float32's ~7 would be lost" if "float" in name or "complex" in name else \
        "values past the 32-bit range, such as ids of 2**31 or more, would change"
    raise ValueError(
        f"{what} has dtype {name}, but jax_enable_x64 is off, so JAX would silently cut it to {_NARROW[name]} "
        f'({loss}). Turn 64-bit types on before any JAX computation with jax.config.update("jax_enable_x64", '
        f"True), or convert it yourself if 32 bits are intended: x.astype(np.{_NARROW[name]})."
    )


def classify(cs: CompiledSpec, e: _Entry, args: tuple, kwargs: dict) -> tuple[list, Any, list]:
    """Flatten the call's arguments and give each leaf a role, placing numpy data on the mesh."""
    at: dict[Any, int] = {}  # ("a", i) or ("k", name) -> transformed position
    for pos in e.args:
        if pos < len(args):
            at[("a", pos)] = pos
        elif e.params is not None and pos < len(e.params) and e.params[pos] in kwargs:
            at[("k", e.params[pos])] = pos
        else:
            kw = f" or keyword {e.params[pos]!r}" if e.params is not None and pos < len(e.params) else ""
            raise TypeError(
                f"CompiledSpec.call: adapter {e.name!r} declares {type(e.args[pos]).__name__}() on "
                f"{e.label(pos)}, but the call passed neither positional argument {pos}{kw}."
            )
    flat, roles, parts = [], [], []
    for where, value in [(("a", i), v) for i, v in enumerate(args)] + [(("k", k), v) for k, v in kwargs.items()]:
        pos = at.get(where)
        if pos is not None:
            x, role = _transformed(cs, e, pos, value)
            flat.append(x)
            roles.append(role)
            parts.append(jax.tree_util.tree_structure(0))
            continue
        leaves, sub = jax.tree_util.tree_flatten(value)
        parts.append(sub)
        for leaf in leaves:
            x, role = _plain(cs, e, where, leaf)
            flat.append(x)
            roles.append(role)
    keys = tuple(("a", i) for i in range(len(args))) + tuple(("k", k) for k in kwargs)
    return flat, (keys, tuple(parts)), roles


def _transformed(cs: CompiledSpec, e: _Entry, pos: int, value: Any) -> tuple[jax.Array, tuple]:
    """A transformed argument, checked against the plan's rows and placed `P(axis)`."""
    t = e.args[pos]
    if not hasattr(value, "shape") or not hasattr(value, "dtype"):
        raise TypeError(
            f"CompiledSpec.call: adapter {e.name!r} {e.label(pos)} has {type(t).__name__}() but got "
            f"{type(value).__name__}; pass an array of per-atom rows."
        )
    if pos in e.positions and not jnp.issubdtype(value.dtype, jnp.floating):
        raise TypeError(
            f"CompiledSpec.call: adapter {e.name!r} {e.label(pos)} holds positions (compile(positions=...)) and "
            f"must be real floating point, got dtype {value.dtype}: integer positions would have their periodic "
            "image shifts truncated, complex ones their imaginary part dropped. Convert explicitly: "
            "positions.astype(np.float64)."
        )
    refuse_narrowing(value, f"CompiledSpec.call: adapter {e.name!r} {e.label(pos)}")
    d = cs.tables.n_devices
    rows = value.shape[0] if len(value.shape) else None
    if isinstance(t, GatherInputs):
        want, store = d * cs.tables.owned_capacity, "owned storage (CompiledSpec.owned)"
        ok = rows == want
    elif isinstance(t, SliceOwned):
        want, store = d * cs.tables.halo_rows, "halo storage (CompiledSpec.halo)"
        ok = rows == want
    else:
        want, store = f"{d} * (owned_capacity={cs.tables.owned_capacity} + pad rows)", "sharded storage (CompiledSpec.owned)"
        ok = rows is not None and rows % d == 0 and rows // d >= cs.tables.owned_capacity
    if not ok:
        raise ValueError(
            f"CompiledSpec.call: adapter {e.name!r} {e.label(pos)} ({type(t).__name__}) expects "
            f"{store} with {want} rows, got shape {tuple(value.shape)}."
        )
    if pos in e.positions:  # a NaN coordinate would drop the atom's pairs silently (NaN < cutoff is False)
        check_array(f"CompiledSpec.call: adapter {e.name!r} {e.label(pos)}", "positions", value,
                    ids=getattr(cs.plan, "owned_global", None), fix=FIX_POSITIONS)
    if isinstance(value, jax.core.Tracer):
        pass  # inside jit / grad: shard_map places it by in_specs
    elif isinstance(value, jax.Array):
        spec = getattr(value.sharding, "spec", None)
        if not (isinstance(value.sharding, NamedSharding) and spec and spec[0] == cs.axis):
            if not value.is_fully_addressable:
                raise ValueError(
                    f"CompiledSpec.call: adapter {e.name!r} {e.label(pos)} must be sharded P({cs.axis!r}) "
                    f"over the mesh, got {value.sharding}."
                )
            value = cs._sharded(np.asarray(value))
    else:
        value = cs._sharded(np.asarray(value))
    return value, ("sharded", (tuple(value.shape), str(value.dtype)), pos)


def _plain(cs: CompiledSpec, e: _Entry, where: tuple, leaf: Any) -> tuple[Any, tuple]:
    """An untransformed leaf: per-device block, replicated array, or static constant."""
    if isinstance(leaf, jax.core.Tracer):
        # Under jit / grad only Explicit axes are visible in the type; on an Auto mesh a
        # traced per-device array cannot be told from a replicated one.
        # Storage-shaped traced arrays are taken as per-device blocks.
        spec = getattr(getattr(jax.typeof(leaf), "sharding", None), "spec", None)
        typed = bool(spec) and leaf.ndim > 0 and spec[0] == cs.axis
        role = "sharded" if typed or (leaf.ndim > 0 and leaf.shape[0] in _storage_rows(cs)) else "replicated"
        return leaf, (role, (tuple(leaf.shape), str(leaf.dtype)), None)
    if isinstance(leaf, (jax.Array, np.ndarray, np.generic)):
        refuse_narrowing(leaf, _where(e, where))
    if isinstance(leaf, jax.Array):
        sh = leaf.sharding
        aval = (tuple(leaf.shape), str(leaf.dtype))
        if isinstance(sh, NamedSharding) and sh.spec and sh.spec[0] == cs.axis and leaf.ndim:
            if tuple(sh.mesh.devices.flat) != tuple(cs.mesh.devices.flat):
                raise ValueError(_where(e, where) + " is sharded over another mesh; place it on "
                                 "this CompiledSpec's mesh.")
            return leaf, ("sharded", aval, None)
        if sh.is_fully_replicated:
            return leaf, ("replicated", aval, None)
        raise ValueError(
            _where(e, where) + f" has sharding {sh}; pass per-device blocks sharded "
            f"P({cs.axis!r}) over the mesh, or a replicated array (P())."
        )
    if isinstance(leaf, (np.ndarray, np.generic)):
        x = place(np.asarray(leaf), NamedSharding(cs.mesh, P()))
        return x, ("replicated", (tuple(x.shape), str(x.dtype)), None)
    if isinstance(leaf, _STATIC_TYPES):
        return leaf, ("static", type(leaf).__name__, leaf)
    raise TypeError(
        _where(e, where) + f" is {type(leaf).__name__}; pass arrays, Python scalars or "
        "pytrees of them."
    )


def _storage_rows(cs: CompiledSpec) -> tuple[int, ...]:
    """Global row counts of this plan's storage: owned and halo, or sharded with 0 or 1 pad rows."""
    t, d = cs.tables, cs.tables.n_devices
    if isinstance(t, HaloTables):
        return (d * t.owned_capacity, d * t.halo_rows)
    return (d * t.owned_capacity, d * (t.owned_capacity + 1))


def _where(e: _Entry, where: tuple) -> str:
    what = f"argument {where[1]}" if where[0] == "a" else f"keyword {where[1]!r}"
    return f"CompiledSpec.call: adapter {e.name!r} {what}"


def refuse_explicit(leaves: list, e: _Entry) -> None:
    """A clear error for arrays typed over an `Explicit` mesh axis: the programs run on an `Auto` mesh."""
    for i, x in enumerate(leaves):
        mesh = getattr(getattr(jax.typeof(x), "sharding", None), "mesh", None)
        if mesh is not None and AxisType.Explicit in tuple(getattr(mesh, "axis_types", ())):
            raise ValueError(
                f"CompiledSpec.call({e.name}): argument leaf {i} is sharded over an Explicit mesh axis "
                f"({dict(mesh.shape)}), but the compiled programs run on the Auto-typed copy `cs.mesh` "
                "(compile converts a jax.make_mesh mesh); place inputs with cs.owned()/cs.halo(), or build "
                "the mesh with jax.make_mesh(..., axis_types=(jax.sharding.AxisType.Auto,)) and call "
                "outside jax.set_mesh of an Explicit mesh."
            )
