"""The storage policy's two exchanges between layers, `refresh` and `fold`, as differentiable collectives.

A message-passing layer reads its neighbours' node features, so between layers
the ghost rows must hold their owners' current values (docs/design.md,
"Message-passing models"; "Refresh and fold per policy" has the table below).

| policy | `refresh(x)` | `fold(x)` |
|---|---|---|
| `HaloStoragePolicy` (`gather_mode="halo_read"`) | `halo_forward(slice_owned(x))` | - |
| `HaloStoragePolicy` (`scatter_mode="halo_correction"`) | - | `halo_forward(halo_reverse(x))` |
| a mode `"local"` | identity (that exchange is off) | identity (that exchange is off) |
| `RefreshOnlyHaloPolicy` | as `HaloStoragePolicy` | identity |
| `GraphParallelPolicy` (sharded) | `gather_full`: all-gather, global-ID order | identity |
| `PlainShard` (sharded) | identity | identity |

The local-block functions (`refresh`, `fold`) run inside `jax.shard_map` on one
device's block, as in `collectives.py`; the `CompiledSpec` methods
(`refresh`, `fold`, `owned_to_halo`, `halo_to_owned`, `halo_to_global`) are the
global-array form, each one jitted `shard_map` program cached by shape and dtype.
Adjoints come from autodiff: refresh's transpose sums ghost cotangents into
their owners (graph-parallel: a reduce-scatter); fold is self-adjoint.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from . import collectives as C
from .arguments import refuse_narrowing
from .tables import HaloTables, ShardTables

if TYPE_CHECKING:
    from .compile import CompiledSpec

_HALO_KINDS = ("halo", "refresh_halo")
_SHARD_KINDS = ("shard", "graph_parallel")


# ------------------------------------------------------------- policy meaning


def _kind(policy: Any, where: str) -> str:
    """The policy's kind if the lower layer knows its exchanges; a ValueError otherwise."""
    kind = getattr(policy, "kind", None)
    if kind in _HALO_KINDS + _SHARD_KINDS:
        return kind
    raise ValueError(
        f"{where}: the policy {policy!r} has no exchanges known to the lower layer; use "
        "HaloStoragePolicy(), RefreshOnlyHaloPolicy(), GraphParallelPolicy() or PlainShard()."
    )


def exchanges_of(policy: Any) -> tuple[bool, bool]:
    """`(refresh_on, fold_on)`: which exchanges `policy` performs (None, local storage: neither)."""
    if policy is None:
        return False, False
    kind = _kind(policy, "exchanges_of")
    if kind in _HALO_KINDS:
        return policy.gather_mode == "halo_read", kind == "halo" and policy.scatter_mode == "halo_correction"
    return kind == "graph_parallel", False


def check_exchanges(policy: Any, *, what: str = "a per-layer message-passing model") -> tuple[bool, bool]:
    """`exchanges_of(policy)`, or a ValueError when distributed storage would leave ghost rows stale.

    A per-layer model needs its ghost rows (halo) or gathered rows (graph
    parallel) to hold the owners' current values after every layer; with both
    exchanges off they keep the values of the layer before, and the reference
    gives a wrong energy without an error.

    Args:
        policy: the spec's storage policy (None, local storage, needs no exchange).
        what: who asks, for the message (optional).

    Returns:
        `(refresh_on, fold_on)`, at least one True for distributed storage.

    Raises:
        ValueError: a halo policy with both modes `"local"` (or a
            `RefreshOnlyHaloPolicy` with `gather_mode="local"`), or `PlainShard`.
    """
    refresh_on, fold_on = exchanges_of(policy)
    if policy is None or refresh_on or fold_on:
        return refresh_on, fold_on
    if policy.kind in _HALO_KINDS:
        raise ValueError(
            f"{what} needs each layer's ghost rows refreshed from their owners, but {policy!r} switches "
            f"both exchanges off (scatter_mode={policy.scatter_mode!r}: no fold; gather_mode="
            f"{policy.gather_mode!r}: no refresh), so ghost rows would keep stale features and the energy "
            "would be silently wrong; use HaloStoragePolicy() (scatter_mode='halo_correction', "
            "gather_mode='halo_read') or switch at least one mode on."
        )
    raise ValueError(
        f"{what} reads neighbours' rows, but {policy!r} stores owned rows only and exchanges nothing; "
        "use GraphParallelPolicy() (all-gathered rows) or HaloStoragePolicy() (ghost rows)."
    )


def _tables_for(kind: str, t: Any, where: str) -> None:
    """Raise if the tables are not of the storage kind of the policy."""
    want = HaloTables if kind in _HALO_KINDS else ShardTables
    if not isinstance(t, want):
        raise ValueError(
            f"{where}: a {kind!r} policy needs {want.__name__}, got {type(t).__name__}; build the tables "
            f"from a {'HaloPlan' if want is HaloTables else 'ShardPlan'} (device_tables(plan, mesh))."
        )


# ------------------------------------------------------------ local blocks


def refresh(x_halo: jax.Array, tables: HaloTables | ShardTables, axis: str, policy: Any) -> jax.Array:
    """Every ghost row set to its owner's current value (one device's block, inside `shard_map`).

    Halo policies with `gather_mode="halo_read"`: `halo_forward(slice_owned(x))`,
    `(halo_rows, *F)` -> the same rows: owned rows unchanged, ghost rows the
    owners' values, padding rows zero. Adjoint: ghost cotangents summed into
    their owners (the reverse exchange), zero on ghost rows. `gather_mode="local"`:
    identity (the refresh is off). `GraphParallelPolicy`: `gather_full`, sharded
    storage `(owned_capacity + k, *F)` -> `(n_global + k, *F)` in global-ID order
    (trailing pad rows kept); adjoint a reduce-scatter. `PlainShard`: identity.

    Args:
        x_halo: the local block (halo storage; sharded storage for sharded policies).
        tables: the local view of the plan's `HaloTables` / `ShardTables`.
        axis: the mesh axis name.
        policy: the spec's storage policy.

    Returns:
        The refreshed block.

    Raises:
        ValueError: the policy is unknown or does not match the tables, or the block has the wrong rows.
    """
    kind = _kind(policy, "refresh")
    _tables_for(kind, tables, "refresh")
    if kind in _HALO_KINDS:
        C._check_rows("refresh", x_halo, tables.halo_rows, "halo storage")
    if not exchanges_of(policy)[0]:
        return x_halo
    if kind in _HALO_KINDS:
        return C.halo_forward(C.slice_owned(x_halo, tables), tables, axis)
    return C.gather_full(x_halo, tables, axis)


def fold(x_halo: jax.Array, tables: HaloTables | ShardTables, axis: str, policy: Any) -> jax.Array:
    """Ghost-row partial sums added into their owners, then refreshed (`halo_correction`; one device's block).

    `HaloStoragePolicy` with `scatter_mode="halo_correction"`:
    `halo_forward(halo_reverse(x))` (= `collectives.halo_scatter`), self-adjoint;
    owned and ghost rows of an atom all end with its total, padding rows zero.
    Identity for `scatter_mode="local"`, `RefreshOnlyHaloPolicy`,
    `GraphParallelPolicy` and `PlainShard`.

    Args:
        x_halo: the local block (halo storage; any rows for sharded policies).
        tables: the local view of the plan's `HaloTables` / `ShardTables`.
        axis: the mesh axis name.
        policy: the spec's storage policy.

    Returns:
        The folded block.

    Raises:
        ValueError: the policy is unknown or does not match the tables, or the block has the wrong rows.
    """
    kind = _kind(policy, "fold")
    _tables_for(kind, tables, "fold")
    if kind in _HALO_KINDS:
        C._check_rows("fold", x_halo, tables.halo_rows, "halo storage")
    return C.halo_scatter(x_halo, tables, axis) if exchanges_of(policy)[1] else x_halo


# ------------------------------------------------------- CompiledSpec methods


def _program(cs: CompiledSpec, name: str, x: Any, body: Any) -> jax.Array:
    """Run `body(t, x_local)` as `jit(shard_map)` over `cs.mesh`, cached by name, shape, dtype and plan shape."""
    key = ("exchange", name, tuple(x.shape), str(x.dtype), cs.tables.static_key, cs.spec.policy)
    fn = cs._cache.get(key)
    if fn is None:
        axis = cs.axis
        fn = jax.jit(jax.shard_map(body, mesh=cs.mesh, in_specs=(cs.tables.specs(axis), P(axis)),
                                   out_specs=P(axis), check_vma=True))
        cs._cache[key] = fn
    return fn(cs.tables, x)


def _global(cs: CompiledSpec, method: str, x: Any, rows: int | None, store: str) -> Any:
    """`x` checked to have `rows` rows (None: sharded storage) and placed `P(axis)` on the mesh."""
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"CompiledSpec.{method}: expected an array of per-atom rows, got {type(x).__name__}.")
    d, got = cs.tables.n_devices, (x.shape[0] if len(x.shape) else None)
    if rows is None:
        oc = cs.tables.owned_capacity
        ok, want = got is not None and got % d == 0 and got // d >= oc, f"{d} * (owned_capacity={oc} + pad rows)"
    else:
        ok, want = got == rows, str(rows)
    if not ok:
        raise ValueError(
            f"CompiledSpec.{method}: expected {store} with {want} rows, got shape {tuple(x.shape)}; "
            f"build it with {'cs.halo(x)' if 'halo' in store else 'cs.owned(x)'} from per-atom (N, ...) values."
        )
    if isinstance(x, jax.core.Tracer):
        return x  # inside jit / grad: shard_map places it by in_specs
    if isinstance(x, jax.Array):
        spec = getattr(x.sharding, "spec", None)
        if isinstance(x.sharding, NamedSharding) and spec and spec[0] == cs.axis:
            return x
        if not x.is_fully_addressable:
            raise ValueError(f"CompiledSpec.{method}: the array must be sharded P({cs.axis!r}) over the mesh, "
                             f"got {x.sharding}.")
    refuse_narrowing(x, f"CompiledSpec.{method}: its input")
    return cs._sharded(np.asarray(x))


def _halo_rows(cs: CompiledSpec) -> int:
    return cs.tables.n_devices * cs.tables.halo_rows


def compiled_refresh(cs: CompiledSpec, x: Any) -> jax.Array:
    """`CompiledSpec.refresh`: `refresh` on every device's block of a global array."""
    policy, axis = cs.spec.policy, cs.axis
    if cs.kind == "halo":
        x = _global(cs, "refresh", x, _halo_rows(cs), "halo storage")
    else:
        x = _global(cs, "refresh", x, None, "sharded storage")
    return _program(cs, "refresh", x, lambda t, b: refresh(b, t, axis, policy))


def compiled_fold(cs: CompiledSpec, x: Any) -> jax.Array:
    """`CompiledSpec.fold`: `fold` on every device's block of a global array."""
    policy, axis = cs.spec.policy, cs.axis
    if cs.kind == "halo":
        x = _global(cs, "fold", x, _halo_rows(cs), "halo storage")
    else:
        x = _global(cs, "fold", x, None, "sharded storage")
    return _program(cs, "fold", x, lambda t, b: fold(b, t, axis, policy))


def owned_to_halo(cs: CompiledSpec, x: Any, positions: bool) -> jax.Array:
    """`CompiledSpec.owned_to_halo`: the forward exchange (GatherInputs) of owned storage."""
    cs._need_halo("owned_to_halo")
    x = _global(cs, "owned_to_halo", x, cs.tables.n_devices * cs.tables.owned_capacity, "owned storage")
    axis, pos = cs.axis, bool(positions)
    return _program(cs, f"owned_to_halo(positions={pos})", x,
                    lambda t, b: C.halo_forward(b, t, axis, positions=pos))


def halo_to_owned(cs: CompiledSpec, x: Any) -> jax.Array:
    """`CompiledSpec.halo_to_owned`: the first owned_capacity rows of every device's halo block."""
    cs._need_halo("halo_to_owned")
    x = _global(cs, "halo_to_owned", x, _halo_rows(cs), "halo storage")
    return _program(cs, "halo_to_owned", x, lambda t, b: C.slice_owned(b, t))


def halo_to_global(cs: CompiledSpec, x: Any) -> np.ndarray:
    """`CompiledSpec.halo_to_global`: halo storage to numpy `(N, ...)` in global-ID order (owned rows)."""
    cs._need_halo("halo_to_global")
    rows, oc = _halo_rows(cs), cs.tables.owned_capacity
    if not hasattr(x, "shape") or not len(x.shape) or x.shape[0] != rows:
        raise ValueError(
            f"CompiledSpec.halo_to_global: expected halo storage with {rows} rows, got "
            f"{tuple(getattr(x, 'shape', ()))}; build it with cs.halo(x) from per-atom (N, ...) values."
        )
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        from jax.experimental import multihost_utils

        x = multihost_utils.process_allgather(x, tiled=True)
    x = np.asarray(x)
    d = cs.tables.n_devices
    owned = x.reshape((d, cs.tables.halo_rows) + x.shape[1:])[:, :oc]
    return cs.plan.from_owned(owned.reshape((d * oc,) + x.shape[1:]))
