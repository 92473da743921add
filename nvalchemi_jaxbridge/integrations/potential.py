"""`KernelPotential`: an energy from one kernel of a `DistributionSpec`, with the model-level protocol.

A kernel adapter already says which of its arguments are gathered and how its
outputs are reduced; `KernelPotential` adds the call recipe (which argument is
the positions, the owned-row mask, a per-atom array or a constant) and which
output is the energy. It then behaves like `mlip.DistributedMLIP` for the
engines of this package: `prepare` lays a structure out over the mesh,
`needs_rebuild` / `rebuild` follow the atoms, and `energy_fn(state, pos, strain)`
is a pure JAX function whose gradients are the forces and the virial. The
recipe is checked against the adapter at construction (`recipe.py`).

Stress: the strain acts on the owned positions and on the tables' periodic
image shifts (`halo_offset`), which is the same as straining positions and
cell together, so `dE/dstrain` is exact with periodic images.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from .recipe import RESERVED, check_energy_output, check_recipe, pick_adapter

_DTYPES = ("float32", "float64")


@dataclasses.dataclass(frozen=True, eq=False)
class KernelState:
    """One geometry laid out for a `KernelPotential`: the compiled spec and the per-atom arrays.

    A pytree whose children are the `CompiledSpec` (its tables) and the
    per-atom device arrays, so a jitted function of it is reused while the
    capacities stay. `values` keeps the global per-atom arrays for re-layouts.
    """

    cs: Any
    per_atom: tuple[Any, ...]  # one device array per per-atom recipe item, in recipe order
    values: Mapping[str, np.ndarray]
    numbers: np.ndarray
    cell: np.ndarray
    periodic: tuple[bool, bool, bool]

    @property
    def plan(self) -> Any:
        """The state's `HaloPlan`."""
        return self.cs.plan


class _StateKey:
    """Static part of a KernelState: compared by the per-atom names only (capacities live in the tables)."""

    def __init__(self, state: KernelState):
        self.state = state
        self.key = ("kernel_state", tuple(state.values))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _StateKey) and self.key == other.key

    def __hash__(self) -> int:
        return hash(self.key)


def _register() -> None:
    import jax

    jax.tree_util.register_pytree_node(
        KernelState,
        lambda s: ((s.cs, s.per_atom), _StateKey(s)),
        lambda aux, ch: dataclasses.replace(aux.state, cs=ch[0], per_atom=tuple(ch[1])),
    )


_register()


@dataclasses.dataclass(frozen=True, eq=False)
class KernelPotential:
    """The energy of one kernel of a spec, as a potential the ASE calculator and `halo_energy_fn` drive.

    Args:
        spec: a `DistributionSpec` with a halo policy (`HaloStoragePolicy`, `RefreshOnlyHaloPolicy`).
        args: the kernel call, one item per positional argument: `"positions"` (owned-storage
            positions, must be a `GatherInputs` argument), `"owned_mask"` (the halo block's
            owned-row mask), the name of a per-atom array (e.g. `"charges"`, given at `prepare`
            as `per_atom={"charges": ...}`), or a Python scalar passed as is.
        cutoff: halo width without skin (Å); at least the kernel's interaction range.
        adapter: which of `spec.custom_ops` (the `OpAdapter`, its op, or its target name);
            optional when the spec has one.
        energy_output: index of the energy among the kernel's outputs (an `AllReduceSum`
            output); a kernel returning one scalar uses 0.
        skin: Verlet skin (Å); the layout is rebuilt once an atom moved more than `skin / 2`.
        headroom: relative headroom of the plan's static capacities (>= 1). A capacity that no longer fits
            grows to at least `layout.capacity.GROWTH` times itself (the program compiles again; logged once
            at INFO, a warning after a few): raise it for a cell that will shrink.
        species: atomic numbers the kernel is meant for (optional; others are refused).
        n_devices: devices of a new 1-D mesh (default all); or give `mesh`.
        mesh: a mesh from `lower.make_mesh`.
        dtype: "float64" or "float32" (default float64 on the CPU, float32 on GPUs).

    Forces and stress come from `jax.grad` of the energy, so the kernel must be
    differentiable: JAX kernels are; a torch op needs `torch.library.register_autograd`.

    Example:
        >>> lj = OpAdapter(jax_potentials.lj_energy_forces, gather_inputs=[0],
        ...                all_reduce_outputs=[0], scatter_outputs=[1])
        >>> pot = KernelPotential(DistributionSpec(HaloStoragePolicy(), adapters=(lj,)),
        ...                       args=("positions", "owned_mask", 0.0104, 3.4, 6.0), cutoff=6.0)
    """

    spec: Any
    args: tuple[Any, ...]
    cutoff: float
    adapter: Any = None
    energy_output: int = 0
    skin: float = 0.5
    headroom: float = 1.2
    species: tuple[int, ...] | None = None
    n_devices: int | None = None
    mesh: Any = None
    dtype: str | None = None

    #: The engines read this: a kernel energy has no per-atom split.
    atom_energies = False

    def __post_init__(self) -> None:
        where = "KernelPotential"
        custom_ops = tuple(getattr(self.spec, "custom_ops", None) or ())
        kind = getattr(getattr(self.spec, "policy", None), "kind", None)
        if not custom_ops or kind not in ("halo", "refresh_halo"):
            raise ValueError(
                f"{where}: spec must be a DistributionSpec with a halo policy and at least one OpAdapter, got "
                f"policy {type(getattr(self.spec, 'policy', None)).__name__} with {len(custom_ops)} adapter(s); "
                "use DistributionSpec(policy=HaloStoragePolicy(), adapters=(OpAdapter(...),))."
            )
        object.__setattr__(self, "adapter", pick_adapter(custom_ops, self.adapter))
        if isinstance(self.args, (str, bytes)) or not hasattr(self.args, "__iter__"):
            raise TypeError(
                f"{where}: args must be a tuple, one item per kernel argument, got {type(self.args).__name__}; "
                "e.g. args=('positions', 'owned_mask', 0.0104, 3.4, 6.0)."
            )
        object.__setattr__(self, "args", tuple(self.args))
        check_recipe(self.args, self.adapter)
        check_energy_output(self.energy_output, self.adapter)
        for name, low in (("cutoff", 0.0), ("skin", 0.0), ("headroom", 1.0)):
            v = getattr(self, name)
            ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
            if not ok or v < low or (name == "cutoff" and v == 0):
                sign = "> 0" if name == "cutoff" else f">= {low:g}"
                raise ValueError(f"{where}: {name} must be a finite number {sign}, got {v!r}.")
            object.__setattr__(self, name, float(v))
        if self.species is not None:
            object.__setattr__(self, "species", tuple(int(z) for z in self.species))
        if self.dtype is not None and self.dtype not in _DTYPES:
            raise ValueError(f"{where}: dtype must be one of {_DTYPES} or None (platform default), got {self.dtype!r}.")
        if self.mesh is not None and self.n_devices is not None:
            raise ValueError(f"{where}: give n_devices or mesh, not both (the mesh fixes the device count).")
        from ..lower.cache import enable_compilation_cache

        enable_compilation_cache()  # unless the user chose a cache or opted out (lower/cache.py)

    # ---------------------------------------------------------------- derived

    @functools.cached_property
    def per_atom_names(self) -> tuple[str, ...]:
        """Names of the per-atom arrays the recipe reads, in recipe order, without repeats."""
        return tuple(dict.fromkeys(a for a in self.args if isinstance(a, str) and a not in RESERVED))

    @functools.cached_property
    def device_mesh(self) -> Any:
        """The mesh the potential runs on (built on first use)."""
        from ..lower import make_mesh

        return self.mesh if self.mesh is not None else make_mesh(self.n_devices)

    @functools.cached_property
    def np_dtype(self) -> np.dtype:
        """The floating dtype of positions and per-atom floats."""
        import jax

        name = self.dtype or ("float64" if self.device_mesh.devices.flat[0].platform == "cpu" else "float32")
        if name == "float64" and not jax.config.jax_enable_x64:
            raise ValueError(
                "KernelPotential: dtype float64 needs 64-bit JAX; call jax.config.update('jax_enable_x64', True) "
                "before using JAX, or pass dtype='float32'."
            )
        return np.dtype(name)

    @functools.cached_property
    def growth_log(self) -> Any:
        """Every capacity growth of this potential's layouts (`layout.capacity.GrowthLog`)."""
        from ..layout.capacity import GrowthLog

        return GrowthLog("KernelPotential")

    @functools.cached_property
    def _template(self) -> dict[str, Any]:
        return {}  # the first CompiledSpec: later plans reuse its programs through with_plan

    # ---------------------------------------------------------------- layout

    def prepare(self, positions: Any, numbers: Any, cell: Any, pbc: Any = True, *,
                per_atom: Mapping[str, Any] | None = None, previous: KernelState | None = None) -> KernelState:
        """The layout of one structure: halo plan, compiled spec, per-atom arrays on the mesh.

        Args:
            positions, numbers, cell, pbc: the structure (Å; cell rows are lattice vectors).
            per_atom: the per-atom arrays the recipe names, `(N, ...)` each.
            previous: a state of the same atom count and periodicity whose capacities to keep
                (grown where they no longer fit), e.g. after the cell changed.

        Returns:
            A `KernelState`.
        """
        from ..layout import HaloPlan
        from .engine import structure

        pos, numbers, cell, periodic = structure(positions, numbers, cell, pbc, "KernelPotential.prepare")
        if self.species is not None and (bad := sorted(set(numbers.tolist()) - set(self.species))):
            raise ValueError(
                f"KernelPotential.prepare: atomic numbers {bad} are not among the kernel's species "
                f"{list(self.species)}; use a structure of those elements, or widen species=."
            )
        values = self._values(per_atom, len(pos))
        n_dev = int(self.device_mesh.devices.size)
        kw: dict[str, Any] = {}
        if previous is not None and previous.plan.n_atoms == len(pos) and previous.periodic == periodic:
            p = previous.plan
            kw = dict(grid=p.grid, owned_capacity=p.owned_capacity, ghost_capacity=p.ghost_capacity,
                      pair_capacities=dict(zip(p.offsets, p.pair_capacities)),
                      grow_all=not np.array_equal(previous.cell, cell))  # a new cell scales every count
        plan = HaloPlan.build(pos, cell, periodic=periodic, cutoff=self.cutoff, skin=self.skin, n_devices=n_dev,
                              headroom=self.headroom, **kw)
        self.growth_log.record(plan.growth, self.headroom)
        return self._state(self._compiled(plan), values, numbers, cell, periodic)

    def needs_rebuild(self, state: KernelState, positions: Any) -> bool:
        """Whether an atom moved more than skin/2 from the layout's positions (minimum image: an atom
        re-wrapped by a lattice vector has not moved; `CompiledSpec.owned` puts it back at the layout's image)."""
        from ..layout.displacement import moved_atoms

        return bool(len(moved_atoms(state.plan, np.asarray(positions))[0]))

    def rebuild(self, state: KernelState, positions: Any) -> KernelState:
        """A new layout for `positions` with `state`'s cell and capacities (grown where they no longer fit)."""
        cs = state.cs.rebuild(np.asarray(positions, dtype=np.float64))
        self.growth_log.record(cs.plan.growth, self.headroom, logged=True)  # HaloPlan.rebuild logged it
        return self._state(cs, state.values, state.numbers, state.cell, state.periodic)

    def _compiled(self, plan: Any) -> Any:
        cache = self._template
        if "cs" in cache:
            return cache["cs"].with_plan(plan)
        op = self.adapter.op
        if callable(op) and not hasattr(op, "_schema") and not type(op).__module__.startswith("torch"):
            from ..lower import compile as kcompile  # a JAX kernel: no need to import torch
        else:
            from ..kernels import compile as kcompile

        where = self.args.index("positions")
        cache["cs"] = kcompile(self.spec, self.device_mesh, plan, positions={self.adapter: [where]})
        return cache["cs"]

    def _values(self, per_atom: Mapping[str, Any] | None, n: int) -> dict[str, np.ndarray]:
        given = dict(per_atom or {})
        if extra := sorted(set(given) - set(self.per_atom_names)):
            raise ValueError(
                f"KernelPotential.prepare: per_atom has {extra}, which the recipe args={self.args!r} does not "
                f"read; the recipe names {list(self.per_atom_names)}. Drop them or add them to args."
            )
        out = {}
        for name in self.per_atom_names:
            if name not in given:
                raise ValueError(
                    f"KernelPotential.prepare: the recipe reads the per-atom array {name!r}, but per_atom has no "
                    f"{name!r}; pass per_atom={{{name!r}: array of {n} values}} (the ASE calculator reads "
                    "'charges' from atoms.get_initial_charges() and other names from atoms.arrays)."
                )
            a = np.asarray(given[name])
            if a.ndim == 0 or a.shape[0] != n:
                raise ValueError(
                    f"KernelPotential.prepare: per_atom[{name!r}] has shape {a.shape}, expected {n} rows (one per "
                    "atom); the atom count changed, or the array belongs to another structure."
                )
            out[name] = a.astype(self.np_dtype) if np.issubdtype(a.dtype, np.floating) else a
        return out

    def _state(self, cs: Any, values: Mapping[str, np.ndarray], numbers: np.ndarray, cell: np.ndarray,
               periodic: tuple[bool, bool, bool]) -> KernelState:
        from ..spec.transforms import GatherInputs

        arrays = []
        for i, item in enumerate(self.args):
            if isinstance(item, str) and item not in RESERVED:
                gathered = isinstance(self.adapter.arg_transforms.get(i), GatherInputs)
                arrays.append(cs.owned(values[item]) if gathered else cs.halo(values[item]))
        return KernelState(cs, tuple(arrays), dict(values), numbers, cell, periodic)

    # ---------------------------------------------------------------- program

    def energy_fn(self, state: KernelState, pos_owned: Any, strain: Any) -> tuple[Any, None]:
        """Energy (replicated scalar) of owned-storage positions under a `(3, 3)` strain; pure JAX.

        The symmetric part `e` of `strain` maps every position `x -> x + x @ e` and
        the periodic image shifts likewise, so `dE/dstrain / V` is the stress.

        Returns:
            `(energy, None)`: a kernel has no per-atom energies.
        """
        cs = state.cs
        eps = (strain + strain.T) / 2
        t = cs.tables
        off = t.halo_offset + t.halo_offset @ eps.astype(t.halo_offset.dtype)
        cs = cs.with_tables(dataclasses.replace(t, halo_offset=off))
        x = pos_owned + pos_owned @ eps.astype(pos_owned.dtype)
        per_atom = iter(state.per_atom)
        call = []
        for item in self.args:
            if item == "positions":
                call.append(x)
            elif item == "owned_mask":
                call.append(cs.halo_owned_mask())
            elif isinstance(item, str):
                call.append(next(per_atom))
            else:
                call.append(item)
        out = cs.call(self.adapter, *call)
        if isinstance(out, (tuple, list)):
            out = out[self.energy_output]
        if getattr(out, "shape", None) != ():
            raise ValueError(
                f"KernelPotential: output {self.energy_output} of the kernel has shape {getattr(out, 'shape', None)} "
                "after its AllReduceSum, expected a scalar energy; set energy_output= to the energy's index."
            )
        return out, None
