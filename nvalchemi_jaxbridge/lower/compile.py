"""compile(spec, mesh, plan): each adapter as one jitted `shard_map` program.

A call runs, on every device's block: the argument transforms, the kernel, and
the output transforms (docs/design.md, "Transform semantics inside shard_map").

Argument rule (one per leaf of the call's arguments):

| argument | passed to the program as | global shape |
|---|---|---|
| at a `GatherInputs` position | owned storage, `P(axis)` | `(D * owned_capacity, ...)` |
| at a `SliceOwned` position | halo storage, `P(axis)` | `(D * halo_rows, ...)` |
| at a `GatherInputsFull` position | sharded storage + pad rows, `P(axis)` | `(D * (owned_capacity + k), ...)` |
| other `jax.Array` sharded `P(axis, ...)` on the mesh | per-device block, `P(axis)` | `(D * rows, ...)` |
| other traced array (inside `jit` / `grad` / `vjp`) with storage rows | per-device block, `P(axis)` | owned or halo storage rows |
| other traced array | replicated, `P()` | any |
| other array (numpy, or a fully replicated `jax.Array`) | replicated, `P()` | any |
| Python scalar, `None`, string | a static constant (a new value recompiles) | - |

Inside `jax.jit` / `jax.grad` an Auto mesh does not type per-device arrays, so a
traced untransformed array is taken as per-device exactly when its rows are this
plan's storage rows (`D * owned_capacity`, `D * halo_rows`; sharded storage:
`D * owned_capacity` or `D * (owned_capacity + 1)`). Pass per-device arrays of
other row counts as concrete arrays (closures) when differentiating.
Untransformed arguments may be pytrees (lists, tuples, dicts) of such leaves.
Any other `jax.Array` sharding is rejected, never resharded silently. With
`jax_enable_x64` off a 64-bit array (numpy or `jax.Array`, in `owned`, `halo` or
`call`) is refused, never narrowed silently (`arguments.refuse_narrowing`).

Outputs: `ScatterOutputs` -> halo storage `P(axis)`; `AllReduceSum` ->
replicated `P()`; `SliceOutputsOwned` -> `(D * (owned_capacity + k), ...)`
`P(axis)`; any other output is each device's block, concatenated `P(axis)`.

Where the pieces live: `arguments.py` gives each leaf its role and places it
(the rule above); `programs.py` builds an adapter's `shard_map` program for
one argument layout (`call` caches it); `entries.py` resolves the adapters;
`exchange.py` runs the `refresh` / `fold` methods. This module keeps
`CompiledSpec` (placement, plans, `call`, pytree) and `compile`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ..layout.displacement import checked_positions
from ..layout.finite import FIX_POSITIONS, check_finite
from . import arguments, exchange, programs
from .entries import _Entry, _find, _position_args, _resolve, _storage_kind, jax_kernel
from .mesh import auto_mesh, mesh_axis
from .tables import Tables, device_tables, is_halo_plan, is_shard_plan, place


# -------------------------------------------------------------- CompiledSpec


@dataclasses.dataclass(frozen=True, eq=False)
class CompiledSpec:
    """A spec lowered for one mesh and plan. Build it with `compile`.

    A `CompiledSpec` is a pytree whose leaves are its tables: pass it as an
    argument of an outer `jax.jit` (rather than closing over it) so that a plan
    with equal capacities reuses the outer program too. Under `jax.distributed`
    this is required: arrays spanning other processes cannot be closed over.

    Attributes:
        spec, mesh, plan: what it was compiled for.
        tables: the plan's tables on the mesh (`HaloTables` or `ShardTables`).
        axis: the mesh axis name.
        kind: `"halo"` or `"shard"`.
    """

    spec: Any
    mesh: Mesh
    plan: Any
    tables: Tables
    axis: str
    kind: str
    _entries: tuple[_Entry, ...]
    _cache: dict = dataclasses.field(repr=False)
    per_device_reductions: bool = False

    # ------------------------------------------------------------- data

    def _sharded(self, x: np.ndarray) -> jax.Array:
        return place(x, NamedSharding(self.mesh, P(self.axis)))

    def owned(self, x: Any, positions: bool = False, *, pad_rows: int = 1, check: bool = True) -> jax.Array:
        """Global per-atom numpy values `(N, ...)` as owned storage, sharded over the mesh.

        Halo plans give `(D * owned_capacity, ...)` (`positions=True` parks padding
        rows); shard plans give `(D * (owned_capacity + pad_rows), ...)`.

        Positions of a halo plan (`positions=True`) are checked against the plan: an atom
        more than `skin / 2` from the position the plan was built for (minimum image), or
        raises `StaleLayoutError` (re-plan with `cs.rebuild(positions)`), a non-finite one
        `NonFiniteError` naming the atoms;
        an atom moved by a lattice vector (re-wrapped) is put back at the plan's image,
        which gives the same results exactly. `check=False` skips both (the caller's
        coordinates as given, unchecked: for callers that check in the program).
        Positions that change inside a program (an integrator) are the caller's to check:
        compare them with `owned(plan.reference_positions, positions=True)` there, as the
        main job and `Engine` do.

        Nothing is narrowed: with `jax_enable_x64` off a 64-bit `x` (int64, float64, ...)
        raises ValueError; cast it to 32 bits yourself or turn x64 on. Positions must be
        real floating point (TypeError otherwise).
        """
        x = _host_input(x, "CompiledSpec.owned: x")
        if self.kind == "halo":
            x = np.asarray(x)
            if positions and check and x.shape == (self.plan.n_atoms, 3) and x.dtype.kind == "f":
                check_finite("CompiledSpec.owned(positions=True)", "positions", x, fix=FIX_POSITIONS)
                fix = "cs = cs.rebuild(positions), or cs.owned(..., check=False) to pass them unchecked"
                x = checked_positions(self.plan, x, "CompiledSpec.owned(positions=True)", fix).astype(x.dtype)
            return self._sharded(self.plan.to_owned(x, positions=positions))
        if positions:
            raise ValueError(
                "CompiledSpec.owned(positions=True): sharded storage has no image shifts or parking; "
                "leave positions=False."
            )
        return self._sharded(self.plan.to_owned(np.asarray(x), pad_rows=pad_rows))

    def halo(self, x: Any, positions: bool = False, *, check: bool = True) -> jax.Array:
        """Global per-atom numpy values `(N, ...)` as halo storage `(D * halo_rows, ...)`, sharded.

        `positions=True` puts owned and ghost rows in the plan's wrapped frame
        (`plan.halo_offset`) and parks padding rows, as a `GatherInputs` of positions does;
        the positions are checked against the plan first, as in `owned`.
        """
        self._need_halo("halo")
        x = _host_input(x, "CompiledSpec.halo: x")
        if positions and check and x.shape == (self.plan.n_atoms, 3) and x.dtype.kind == "f":
            fix = "cs = cs.rebuild(positions), or cs.halo(..., check=False) to pass them unchecked"
            x = checked_positions(self.plan, x, "CompiledSpec.halo(positions=True)", fix).astype(x.dtype)
        return self._sharded(self.plan.to_halo(x, positions=positions))

    def halo_owned_mask(self) -> jax.Array:
        """`(D * halo_rows,)` bool, sharded: True on each device's owned rows of its halo block."""
        self._need_halo("halo_owned_mask")
        return self.tables.halo_owned_mask

    def to_global(self, x_owned: jax.Array, *, pad_rows: int = 1) -> np.ndarray:
        """Owned storage back to per-atom numpy values `(N, ...)` in global-ID order (all processes).

        A numpy `x_owned` stays on the host and keeps its dtype (int64 ids come back exact).
        """
        if isinstance(x_owned, jax.Array) and not x_owned.is_fully_addressable:
            from jax.experimental import multihost_utils

            x = np.asarray(multihost_utils.process_allgather(x_owned, tiled=True))
        else:
            x = np.asarray(x_owned)
        if self.kind == "halo":
            return self.plan.from_owned(x)
        return self.plan.from_owned(x, pad_rows=pad_rows)

    # ------------------------------------------------------------- exchanges (lower/exchange.py)

    def refresh(self, x: Any) -> jax.Array:
        """The policy's refresh of every device's block: ghost rows set to their owners' values.

        Halo storage `(D * halo_rows, ...)` -> the same rows (identity for
        `gather_mode="local"`); `GraphParallelPolicy`: sharded storage ->
        `(D * (n_global + k), ...)`, each device's all-gathered block; `PlainShard`:
        identity. Differentiable; callable inside `jax.jit` (see `exchange.refresh`).
        """
        return exchange.compiled_refresh(self, x)

    def fold(self, x: Any) -> jax.Array:
        """The policy's fold: ghost partials added into their owners, then refreshed (see `exchange.fold`)."""
        return exchange.compiled_fold(self, x)

    def owned_to_halo(self, x_owned: Any, positions: bool = False) -> jax.Array:
        """Owned storage -> halo storage: the forward exchange (GatherInputs), whatever the policy's modes."""
        return exchange.owned_to_halo(self, x_owned, positions)

    def halo_to_owned(self, x_halo: Any) -> jax.Array:
        """Halo storage -> owned storage: each device's first `owned_capacity` rows, padding zeroed."""
        return exchange.halo_to_owned(self, x_halo)

    def halo_to_global(self, x_halo: Any) -> np.ndarray:
        """Halo storage -> per-atom numpy `(N, ...)` in global-ID order (every device's owned rows)."""
        return exchange.halo_to_global(self, x_halo)

    def _need_halo(self, what: str) -> None:
        if self.kind != "halo":
            raise ValueError(
                f"CompiledSpec.{what}: the spec uses sharded storage ({type(self.spec.policy).__name__}), "
                "which has no halo rows; use owned() / to_global()."
            )

    def adapter(self, target: Any) -> Any:
        """The `OpAdapter` that `call(target, ...)` runs: target is the adapter, its op, or its target name.

        Raises:
            KeyError: no adapter, or several, match `target` (the message lists the known targets).
        """
        return _find(self._entries, target, "CompiledSpec.adapter").adapter

    # ------------------------------------------------------------- plans

    def with_plan(self, plan: Any) -> CompiledSpec:
        """The same spec on a new plan. Compiled programs are reused when capacities and offsets match."""
        if (self.kind == "halo") != is_halo_plan(plan) or (self.kind == "shard") != is_shard_plan(plan):
            raise TypeError(
                f"CompiledSpec.with_plan: this spec uses {self.kind} storage, so the new plan must be a "
                f"{'HaloPlan' if self.kind == 'halo' else 'ShardPlan'}, got {type(plan).__name__}."
            )
        _check_self_images(self.spec, plan, "CompiledSpec.with_plan")
        return dataclasses.replace(self, plan=plan, tables=device_tables(plan, self.mesh))

    def with_tables(self, tables: Tables) -> CompiledSpec:
        """The same spec and plan with other table arrays of the same layout (e.g. strained `halo_offset`).

        Works inside a traced function (the arrays may be tracers); the programs are
        reused, since they depend only on the tables' static part (`tables.static_key`),
        which must match this spec's. Use `dataclasses.replace(cs.tables, field=...)` to
        make them.
        """
        if type(tables) is not type(self.tables) or tables.static_key != self.tables.static_key:
            got = tables.static_key if hasattr(tables, "static_key") else type(tables).__name__
            raise ValueError(
                f"CompiledSpec.with_tables: the new tables must keep the layout {self.tables.static_key} "
                f"(capacities and offsets), got {got}; change only the arrays "
                "(dataclasses.replace(cs.tables, ...)), or use with_plan for another plan."
            )
        return dataclasses.replace(self, tables=tables)

    def rebuild(self, positions: Any, *, on_overflow: str = "replan") -> CompiledSpec:
        """`with_plan(plan.rebuild(positions, on_overflow=...))`: re-plan after atoms moved (halo plans).

        With `on_overflow="replan"` a capacity that no longer fits is grown (the
        programs then recompile once); with `"raise"` the layout layer's
        `HaloOverflowError` propagates.
        """
        self._need_halo("rebuild")
        return self.with_plan(self.plan.rebuild(np.asarray(positions), on_overflow=on_overflow))

    # ------------------------------------------------------------- calls

    def call(self, target: Any, /, *args: Any, **kwargs: Any) -> Any:
        """Run one adapter's program: argument transforms, kernel, output transforms.

        Args:
            target: the `OpAdapter`, its op, or its target name (`describe().target`).
            *args, **kwargs: the kernel's arguments; transformed positions may
                be passed by keyword (matched by parameter name). See the module
                docstring for how each argument is placed.

        Returns:
            The kernel's outputs after the output transforms, as global
            `jax.Array`s (a single array if the kernel returns one).

        The plan must hold for the positions: `owned(positions, positions=True)` checks
        that (`StaleLayoutError` past skin/2); positions computed inside a program are the
        caller's to check (see `owned`).
        """
        e = _find(self._entries, target, "CompiledSpec.call")
        flat, treedef, roles = arguments.classify(self, e, args, kwargs)
        key = (e.index, treedef, tuple(r[:2] if r[0] != "static" else r for r in roles),
               self.tables.static_key, self.per_device_reductions)
        fn = self._cache.get(key)
        if fn is None:
            fn = programs.build(self, e, treedef, roles)
            self._cache[key] = fn
        dyn = [x for x, r in zip(flat, roles) if r[0] != "static"]
        arguments.refuse_explicit(dyn, e)
        out, single = fn(self.tables, *dyn)
        return out[0] if single else out


def _host_input(x: Any, what: str) -> np.ndarray:
    """`x` as a numpy array, refused if JAX would narrow its dtype (`arguments.refuse_narrowing`)."""
    x = x if isinstance(x, (np.ndarray, jax.Array)) else np.asarray(x)
    arguments.refuse_narrowing(x, what)
    return np.asarray(x)


# ------------------------------------------------------------------ pytree


class _Static:
    """A CompiledSpec's non-array parts, compared by what a traced program depends on (not the plan)."""

    def __init__(self, cs: CompiledSpec):
        self.cs = cs
        self.key = (id(cs.spec), cs.mesh, cs.axis, cs.kind, id(cs._entries), id(cs._cache),
                    cs.per_device_reductions)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Static) and self.key == other.key

    def __hash__(self) -> int:
        return hash(self.key)


def _flatten(cs: CompiledSpec) -> tuple[tuple[Tables], _Static]:
    return (cs.tables,), _Static(cs)


def _unflatten(static: _Static, children: tuple[Tables]) -> CompiledSpec:
    return dataclasses.replace(static.cs, tables=children[0])


jax.tree_util.register_pytree_node(CompiledSpec, _flatten, _unflatten)


# ------------------------------------------------------------------- compile


def _check_self_images(spec: Any, plan: Any, where: str) -> None:
    """Refuse a plan without rows for images of a device's own atoms when the spec has kernels to run.

    An opaque kernel finds its neighbours from the block's positions, so it would silently miss
    those images; only a consumer with explicit edges (the model level) may leave them out.
    """
    if getattr(plan, "self_images", True) or not tuple(getattr(spec, "custom_ops", ())):
        return
    raise ValueError(
        f"{where}: the plan was built with self_images=False (images of a device's own atoms are no rows), "
        f"but the spec has {len(tuple(spec.custom_ops))} kernel adapter(s), which find their neighbours "
        "from the block's rows and would miss those images; build the plan with HaloPlan.build(..., "
        "self_images=True) (the default). self_images=False is for consumers with explicit edges that "
        "carry the images as shifts (the model level, nvalchemi_jaxbridge.mlip)."
    )


def compile(  # noqa: A001 - the name users know from the spec
    spec: Any,
    mesh: Mesh,
    plan: Any,
    *,
    kernel_for: Callable[[Any], Callable[..., Any]] | None = None,
    positions: Mapping[Any, Iterable[int | str]] | None = None,
    per_device_reductions: bool = False,
) -> CompiledSpec:
    """Lower a `DistributionSpec` for a mesh and a plan.

    Every adapter's transforms are checked against the storage kind now;
    programs are traced and compiled on first call per argument layout and
    cached per (adapter, argument shapes and shardings, plan capacities), so
    `with_plan` with equal capacities reuses them.

    Args:
        spec: a `DistributionSpec` with a halo policy (`HaloStoragePolicy`,
            `RefreshOnlyHaloPolicy`) or a sharded one (`PlainShard`,
            `GraphParallelPolicy`); its `custom_ops` are the adapters.
        mesh: a 1-D mesh with `plan.n_devices` devices: `make_mesh`, or `jax.make_mesh` (an
            `Explicit` axis is used as `Auto`: `CompiledSpec.mesh` is that copy).
        plan: a `HaloPlan` (halo policies) or `ShardPlan` (sharded policies).
        kernel_for: the kernel slot, `op -> callable of local jax arrays`
            (optional, default `jax_kernel`: Python callables only). A kernel may
            expose `param_names` so keyword arguments map to positions.
        positions: which `GatherInputs` arguments are positions and get the
            plan's periodic image shifts and parking points, as
            `{adapter, op or target name: [positions or parameter names]}`
            (optional; by default no argument is shifted).
        per_device_reductions: return `AllReduceSum` outputs as one copy per
            device, `(D, *shape)` sharded `P(axis)`, so each device's cotangent
            is separate: summed over devices in the adjoint for
            `replicated_consumer=False`, passed through for `True` (the
            PyTorch front door's per-rank semantics). By default (False) they
            are one replicated `P()` value whose single cotangent reaches every
            device's partial unchanged, whichever the flag.

    Returns:
        A `CompiledSpec`; run an adapter with `.call(target, *args, **kwargs)`.

    Raises:
        ValueError: the policy has no distributed storage, the plan kind does
            not match it, a transform belongs to the other storage kind, a
            transform position is beyond the kernel's parameters, or
            `positions` names something that is not a gathered argument.
        KeyError: `positions` names an unknown adapter.
        TypeError: the kernel slot refuses an op (e.g. a torch op with the default slot).

    Example:
        >>> cs = compile(spec, make_mesh(8), plan, positions={"lj": [0]})
        >>> forces, energy = cs.call("lj", cs.owned(pos, positions=True), cs.halo_owned_mask())
    """
    mesh = auto_mesh(mesh)  # a jax.make_mesh mesh has an Explicit axis
    axis = mesh_axis(mesh)
    kind = _storage_kind(spec)
    if kind == "halo" and not is_halo_plan(plan):
        raise ValueError(
            f"compile: the spec's policy {type(spec.policy).__name__} uses halo storage, which needs a "
            f"HaloPlan (nvalchemi_jaxbridge.layout.HaloPlan.build), got {type(plan).__name__}."
        )
    if kind == "shard" and not is_shard_plan(plan):
        raise ValueError(
            f"compile: the spec's policy {type(spec.policy).__name__} uses sharded storage, which needs a "
            f"ShardPlan, got {type(plan).__name__}."
        )
    _check_self_images(spec, plan, "compile")
    tables = device_tables(plan, mesh)
    entries = _resolve(spec, kind, kernel_for or jax_kernel)
    entries = _position_args(entries, kind, positions)
    return CompiledSpec(spec, mesh, plan, tables, axis, kind, entries, {},
                        per_device_reductions=bool(per_device_reductions))
