"""A jax-md-style functional API over a distributed potential: `neighbor_fn, energy_fn = halo_energy_fn(...)`.

Positions are global `(N, 3)` arrays in the caller's atom order: Cartesian, or
fractional with `fractional_coordinates=True` (jax-md's `space.periodic_general`
default, box `cell.T`). The halo layout plays the part of jax-md's neighbour list:

- `neighbor_fn.allocate(R, previous=None)` (host, not jit-able) builds the layout;
  with `previous` its capacities are kept, or grown where they no longer fit.
- `neighbor_fn.update(R, nbrs)` / `nbrs.update(R)` (jit-able) cannot re-plan inside a
  program; they set `nbrs.did_buffer_overflow` once some atom moved more than
  skin/2 from the positions the layout was built for. The caller then
  re-allocates from the positions before the chunk and redoes it, as with jax-md.
- `energy_fn(R, neighbor=nbrs)` (jit-able, differentiable) gathers `R` into owned
  storage with the layout's device index arrays and runs the potential's program.
  The program also measures the largest displacement from the layout's positions:
  past skin/2 (the layout may miss pairs) the energy, and so every force and the
  stress, is NaN instead of silently wrong, and an eager call (concrete `R`, no
  `jit` / `grad` around it) raises a `ValueError` naming the displacement and skin/2.
  `update` counts a NaN position as moved too far (the largest displacement is taken
  with NaN as +inf: a plain maximum over a sharded array can drop a NaN), so a chunk
  that met a stale layout or a NaN always ends with `did_buffer_overflow` set, and its
  energy is NaN. An eager call with a NaN or inf in `R` raises `NonFiniteError` naming
  the atoms; so does `allocate`.

An atom moved by a lattice vector (a wrapping shift function) is mapped back to
the image the layout was built for, so wrapping needs no re-allocation.

Check the positions the energy was evaluated at: in a jax-md step, where the force
is computed at the new positions, call `nbrs.update(state.position)` after
`apply_fn(state, neighbor=nbrs)`, so a chunk that passes used a valid layout for
every force it computed (tests/integrations/test_jax_md.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np

from ..layout.finite import FIX_POSITIONS, check_finite
from .engine import cell_volume, potential_dtype, prepare, structure


@dataclasses.dataclass(frozen=True, eq=False)
class HaloNeighbors:
    """The layout as a jax-md-like neighbour state (a pytree; pass it as `neighbor=`).

    Attributes:
        state: the potential's state (`KernelState` or `ModelState`).
        reference: `(N, 3)` positions the layout was built for.
        ids: owned storage `(D * owned_capacity,)` int32: the global atom of each owned row.
        basis, inv_basis: `(3, 3)` lattice used to find lattice jumps (periodic axes only).
        overflow: bool scalar, set once an atom moved more than skin/2 (see `did_buffer_overflow`).
        neighbor_fn: the `HaloNeighborFn` that made it (static).
    """

    state: Any
    reference: Any
    ids: Any
    basis: Any
    inv_basis: Any
    overflow: Any
    neighbor_fn: HaloNeighborFn

    @property
    def did_buffer_overflow(self) -> Any:
        """True once the layout no longer holds for the positions passed to `update`: re-allocate.

        A bool scalar (jax-md's is a uint8 bitmask; both are truthy exactly on overflow).
        """
        return self.overflow

    def update(self, positions: Any) -> HaloNeighbors:
        """`neighbor_fn.update(positions, self)` (jit-able)."""
        return self.neighbor_fn.update(positions, self)


class _Static:
    """Static part of HaloNeighbors: the neighbour function (identity), compared with equal capacities."""

    def __init__(self, fn: HaloNeighborFn):
        self.fn = fn

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Static) and other.fn is self.fn

    def __hash__(self) -> int:
        return id(self.fn)


def _register() -> None:
    import jax

    jax.tree_util.register_pytree_node(
        HaloNeighbors,
        lambda s: ((s.state, s.reference, s.ids, s.basis, s.inv_basis, s.overflow), _Static(s.neighbor_fn)),
        lambda aux, ch: HaloNeighbors(*ch, neighbor_fn=aux.fn),
    )


_register()


@dataclasses.dataclass(frozen=True, eq=False)
class HaloNeighborFn:
    """Allocates and checks the halo layout of one structure (see the module docstring).

    Made by `halo_energy_fn`; the structure's numbers, cell, periodicity and per-atom
    inputs are fixed here, positions change.
    """

    potential: Any
    numbers: np.ndarray
    cell: np.ndarray
    periodic: tuple[bool, bool, bool]
    per_atom: Mapping[str, np.ndarray]
    skin: float
    fractional: bool = False

    @property
    def n_atoms(self) -> int:
        """Atoms of the structure."""
        return len(self.numbers)

    def allocate(self, positions: Any, previous: HaloNeighbors | None = None) -> HaloNeighbors:
        """Build the layout for `positions` (host; not jit-able).

        Args:
            positions: `(N, 3)` Cartesian positions (Å), or fractional ones (`fractional_coordinates`).
            previous: a state of this function whose capacities to keep (grown if needed).

        Returns:
            A fresh `HaloNeighbors` (overflow flag cleared).
        """
        import jax

        pos = self._host_positions(positions, "allocate")
        check_finite("HaloNeighborFn.allocate", "positions", pos, fix=FIX_POSITIONS)
        if self.fractional:
            pos = pos @ self.cell
        if previous is None:
            state = prepare(self.potential, pos, self.numbers, self.cell, self.periodic, dict(self.per_atom) or None)
        else:
            if not isinstance(previous, HaloNeighbors) or previous.neighbor_fn is not self:
                raise ValueError(
                    "HaloNeighborFn.allocate: previous must be a HaloNeighbors made by this neighbor_fn (from "
                    "allocate or update); one from another halo_energy_fn has another structure."
                )
            state = self.potential.rebuild(previous.state, pos)
        cs = state.cs
        basis = np.asarray(cs.plan.basis, dtype=np.float64)
        ids = cs.owned(np.arange(self.n_atoms, dtype=np.int32))
        # replicated on the mesh, as a jitted step returns them: a re-allocated state then hits the jit cache
        rep = jax.sharding.NamedSharding(cs.mesh, jax.sharding.PartitionSpec())
        put = lambda x: jax.device_put(x, rep)  # noqa: E731
        return HaloNeighbors(state, put(pos), ids, put(basis), put(np.linalg.inv(basis)), put(np.zeros((), bool)),
                             self)

    def update(self, positions: Any, neighbor: HaloNeighbors) -> HaloNeighbors:
        """`neighbor` with its overflow flag set if some atom moved more than skin/2 (jit-able).

        The flag stays set once set; the layout itself is unchanged (re-plan with `allocate`).
        """
        import jax.numpy as jnp

        self._check(positions, neighbor, "update")
        stale = ~(self.moved(positions, neighbor) <= self.skin / 2)  # NaN positions count as stale
        return dataclasses.replace(neighbor, overflow=jnp.logical_or(neighbor.overflow, stale))

    def moved(self, positions: Any, neighbor: HaloNeighbors) -> Any:
        """Largest minimum-image displacement (Å) of any atom from the layout's positions (jit-able scalar)."""
        import jax.numpy as jnp

        from ..lower.finite import max_or_inf

        disp, _ = self._displacement(self.cartesian(positions), neighbor)
        return jnp.sqrt(max_or_inf(jnp.sum(disp * disp, axis=1)))  # a NaN position counts as moved infinitely far

    def cartesian(self, positions: Any) -> Any:
        """Cartesian `(N, 3)` positions (jit-able): `positions` itself, or `R_frac @ cell` when fractional.

        With fractional coordinates the gradient passes through unchanged, as jax-md's
        `space.transform` does: `jax.grad` of an energy with respect to fractional
        positions is the real-space gradient (eV/Å), which `periodic_general`'s
        `shift_fn(R_frac, dR_real)` expects.
        """
        if not self.fractional:
            return positions
        import jax
        import jax.numpy as jnp

        cell = jnp.asarray(self.cell, positions.dtype)

        @jax.custom_jvp
        def to_cartesian(frac):
            return frac @ cell

        @to_cartesian.defjvp
        def _(primals, tangents):
            return to_cartesian(primals[0]), tangents[0]  # real-space tangent (jax-md's convention)

        return to_cartesian(positions)

    # ------------------------------------------------------------ helpers

    def _host_positions(self, positions: Any, where: str) -> np.ndarray:
        pos = np.asarray(positions, dtype=np.float64)
        if pos.shape != (self.n_atoms, 3):
            raise ValueError(
                f"HaloNeighborFn.{where}: positions have shape {pos.shape}, but this halo_energy_fn is for "
                f"({self.n_atoms}, 3); a new atom count needs a new halo_energy_fn."
            )
        return pos

    def _check(self, positions: Any, neighbor: Any, where: str) -> None:
        from ..mlip.state_check import StaleStateError, fingerprint_change

        if not isinstance(neighbor, HaloNeighbors) or neighbor.neighbor_fn is not self:
            raise TypeError(
                f"{where}: neighbor must be the HaloNeighbors of this halo_energy_fn (neighbor_fn.allocate(R)), "
                f"got {type(neighbor).__name__}; pass it as neighbor=nbrs."
            )
        # eagerly at every call, under jit when traced: a model changed after allocate (e.g. its cutoff)
        fp = getattr(self.potential, "fingerprint", None)
        if fp is not None and (why := fingerprint_change(neighbor.state, fp())) is not None:
            raise StaleStateError(
                f"{where}: the layout does not hold for the model any more: {why}; re-allocate: "
                "nbrs = neighbor_fn.allocate(R, nbrs) (and trace a jitted function again)."
            )
        if tuple(getattr(positions, "shape", ())) != (self.n_atoms, 3):
            kind = "fractional" if self.fractional else "Cartesian"
            raise ValueError(
                f"{where}: positions have shape {tuple(getattr(positions, 'shape', ()))}, but this "
                f"halo_energy_fn is for ({self.n_atoms}, 3) {kind} positions."
            )

    def _displacement(self, positions: Any, neighbor: HaloNeighbors) -> tuple[Any, Any]:
        """Minimum-image displacements from the reference and the lattice jumps `(N, 3)` (no gradient)."""
        import jax
        import jax.numpy as jnp

        r = jax.lax.stop_gradient(positions)
        d = r - neighbor.reference.astype(r.dtype)
        frac = d @ neighbor.inv_basis.astype(r.dtype)
        per = jnp.asarray(self.periodic)[None, :]
        jump = jnp.where(per, jnp.round(frac), jnp.zeros((), r.dtype))
        return (frac - jump) @ neighbor.basis.astype(r.dtype), jump

    def owned_positions(self, positions: Any, neighbor: HaloNeighbors) -> Any:
        """Global `(N, 3)` Cartesian positions as the layout's owned storage (padding rows parked), jit-able."""
        import jax.numpy as jnp

        _, jump = self._displacement(positions, neighbor)
        cell = jnp.asarray(self.cell, positions.dtype)
        r = positions - jump @ cell  # the image the layout was built for
        t = neighbor.state.cs.tables
        return jnp.where(t.owned_mask[:, None], r[neighbor.ids], t.owned_offset.astype(positions.dtype))


@dataclasses.dataclass(frozen=True, eq=False)
class HaloEnergyFn:
    """`energy_fn(R, neighbor=nbrs) -> energy` (jit-able, differentiable); `.stress_fn(R, neighbor=nbrs)`."""

    neighbor_fn: HaloNeighborFn

    def __call__(self, positions: Any, neighbor: HaloNeighbors | None = None, **kwargs: Any) -> Any:
        return self._energy(positions, neighbor, kwargs, None, "energy_fn")

    def stress_fn(self, positions: Any, neighbor: HaloNeighbors | None = None, **kwargs: Any) -> Any:
        """`(3, 3)` stress `(1/V) dE/dstrain` in eV/Å³, ASE's sign (jax-md's `quantity.stress` has the other)."""
        import jax
        import jax.numpy as jnp

        volume = cell_volume(self.neighbor_fn.cell, self.neighbor_fn.periodic)
        if volume is None:
            raise ValueError(
                f"stress_fn: stress needs a cell periodic along every axis with a volume, but pbc="
                f"{self.neighbor_fn.periodic}; use a fully periodic structure."
            )
        zero = jnp.zeros((3, 3), positions.dtype)
        return jax.grad(lambda e: self._energy(positions, neighbor, kwargs, e, "stress_fn"))(zero) / volume

    def _energy(self, positions: Any, neighbor: Any, kwargs: dict, strain: Any, where: str) -> Any:
        import jax
        import jax.numpy as jnp

        from ..lower.finite import check_array

        if kwargs:
            raise TypeError(
                f"{where}: unexpected keyword arguments {sorted(kwargs)}; it takes (R, neighbor=nbrs) only (for "
                "the stress use energy_fn.stress_fn, which has ASE's sign)."
            )
        if neighbor is None:
            raise TypeError(f"{where}: pass the layout as neighbor=nbrs (from neighbor_fn.allocate(R)).")
        fn = self.neighbor_fn
        fn._check(positions, neighbor, where)
        check_array(where, "positions", positions, fix=FIX_POSITIONS)  # eager calls (under jit: a NaN energy)
        pos = jnp.asarray(positions)
        pos_owned = fn.owned_positions(fn.cartesian(pos), neighbor).astype(potential_dtype(fn.potential))
        eps = jnp.zeros((3, 3), pos_owned.dtype) if strain is None else strain.astype(pos_owned.dtype)
        energy, _ = fn.potential.energy_fn(neighbor.state, pos_owned, eps)
        moved = fn.moved(pos, neighbor)
        if not isinstance(moved, jax.core.Tracer) and not float(moved) <= fn.skin / 2:
            raise ValueError(
                f"{where}: an atom moved {float(moved):.4g} Å from the positions the layout was built for, more than "
                f"skin/2 = {fn.skin / 2:g} Å, so the layout may miss pairs; re-allocate first (nbrs = "
                "neighbor_fn.allocate(R, nbrs)), or check nbrs.update(R).did_buffer_overflow before using the energy."
            )
        stale = jax.lax.stop_gradient(jnp.where(moved <= fn.skin / 2, 1.0, jnp.nan).astype(energy.dtype))
        return (energy * stale).astype(pos.dtype)  # NaN (and NaN gradients) on a stale layout


def halo_energy_fn(potential: Any, numbers: Any, cell: Any, pbc: Any = True, *,
                   per_atom: Mapping[str, Any] | None = None, fractional_coordinates: bool = False
                   ) -> tuple[HaloNeighborFn, HaloEnergyFn]:
    """jax-md-style `(neighbor_fn, energy_fn)` for a distributed potential on one structure.

    Args:
        potential: a `KernelPotential` or `mlip.DistributedMLIP`.
        numbers: `(N,)` atomic numbers.
        cell: `(3, 3)` lattice vectors as rows (Å); jax-md's `periodic_general` box is `cell.T`.
        pbc: periodic flag per lattice axis (or one bool).
        per_atom: per-atom inputs the potential's recipe names (e.g. `{"charges": q}`).
        fractional_coordinates: positions are fractional, `R_frac @ cell` Cartesian, as with
            `jax_md.space.periodic_general(cell.T)` (its default); gradients are then real-space,
            as jax-md's are. Needs a cell with volume.

    Returns:
        `neighbor_fn` (`allocate(R, previous=None)`, `update(R, nbrs)`) and `energy_fn(R, neighbor=)`
        (with `energy_fn.stress_fn(R, neighbor=)`). Use a shift function that does not wrap
        (`jax_md.space.free()`), or any: wrapped atoms are mapped back to their layout image.

    Example:
        >>> neighbor_fn, energy_fn = halo_energy_fn(pot, atoms.numbers, atoms.cell.array)
        >>> nbrs = neighbor_fn.allocate(R)
        >>> forces = -jax.grad(energy_fn)(R, neighbor=nbrs)
    """
    dummy = np.zeros((len(np.asarray(numbers).reshape(-1)), 3))
    _, numbers, cell, periodic = structure(dummy, numbers, cell, pbc, "halo_energy_fn")
    if fractional_coordinates and not abs(np.linalg.det(cell)) > 0:
        raise ValueError(
            f"halo_energy_fn: fractional_coordinates=True needs a cell with volume (R_frac @ cell), but det(cell) = "
            f"{np.linalg.det(cell):.3g}; give every lattice row a length (a vacuum row on an open axis), or pass "
            "Cartesian positions."
        )
    skin = float(getattr(potential, "skin", 0.0))
    values = {k: np.asarray(v) for k, v in (per_atom or {}).items()}
    fn = HaloNeighborFn(potential, numbers, cell, periodic, values, skin, bool(fractional_coordinates))
    return fn, HaloEnergyFn(fn)
