"""`Engine`: one jitted program for energy, forces, stress and per-atom energies of any potential.

A potential here is anything with the model-level protocol (`KernelPotential`,
`mlip.DistributedMLIP`): `prepare`, `needs_rebuild`, `rebuild` and a pure
`energy_fn(state, pos_owned, strain) -> (energy, node energies or None)`. The
engine keeps the layout between calls and rebuilds it only when needed: the
program also returns the largest displacement of an owned atom from the
positions its plan was built from, and a result computed more than skin/2 away
(where the plan may miss pairs) is thrown away, the layout re-planned at the
new positions and the program run again. The program is `jax.jit` over the
state pytree, so it is traced again only when a capacity grows (`Engine.traces`
counts the traces).
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Mapping
from typing import Any

import numpy as np

from ..layout.displacement import to_plan_image
from ..layout.structure import checked_structure as structure


def potential_dtype(potential: Any) -> np.dtype:
    """The floating dtype a potential computes in (`np_dtype`, a torch wrapper's dtype, else float64)."""
    if hasattr(potential, "np_dtype"):
        return np.dtype(potential.np_dtype)
    wrapper = getattr(potential, "wrapper", None)
    if wrapper is not None and hasattr(wrapper, "dtype"):
        from ..mlip.protocol import numpy_dtype

        return numpy_dtype(wrapper.dtype)
    return np.dtype("float64")


def per_atom_names(potential: Any) -> tuple[str, ...]:
    """Per-atom inputs a potential reads besides positions and numbers (e.g. `("charges",)`)."""
    return tuple(getattr(potential, "per_atom_names", ()))


def prepare(potential: Any, positions: Any, numbers: Any, cell: Any, pbc: Any,
            per_atom: Mapping[str, Any] | None = None, previous: Any = None) -> Any:
    """`potential.prepare(...)`, passing `per_atom` and `previous` only to a potential that takes them."""
    params = inspect.signature(potential.prepare).parameters
    kw: dict[str, Any] = {}
    if "per_atom" in params:
        kw["per_atom"] = per_atom
    elif per_atom:
        raise ValueError(
            f"{type(potential).__name__}.prepare reads no per-atom arrays, got per_atom={sorted(per_atom)}; "
            "leave per_atom out for this potential."
        )
    if previous is not None and "previous" in params:
        kw["previous"] = previous
    return potential.prepare(positions, numbers, cell, pbc, **kw)


def cell_volume(cell: np.ndarray, periodic: tuple[bool, bool, bool]) -> float | None:
    """|det cell| when every axis is periodic and the cell has volume, else None (no stress)."""
    if not all(periodic):
        return None
    v = abs(float(np.linalg.det(np.asarray(cell, dtype=np.float64))))
    return v if v > 0 else None


class _Program:
    """`jax.jit` of energy, node energies, forces and dE/dstrain of one potential; counts its traces."""

    def __init__(self, potential: Any) -> None:
        import jax

        self.potential = potential
        self.traces = 0
        self.jitted = jax.jit(self._evaluate)

    def _evaluate(self, state: Any, pos_owned: Any, reference: Any) -> tuple[Any, Any, Any, Any, Any]:
        import jax
        import jax.numpy as jnp

        from ..lower.finite import max_or_inf

        self.traces += 1
        strain = jnp.zeros((3, 3), pos_owned.dtype)
        grad = jax.value_and_grad(self.potential.energy_fn, argnums=(1, 2), has_aux=True)
        (energy, node_e), (g_pos, g_strain) = grad(state, pos_owned, strain)
        d = pos_owned - reference  # padding rows are parked alike in both
        return energy, node_e, -g_pos, g_strain, jnp.sqrt(max_or_inf(jnp.sum(d * d, axis=1)))  # NaN: inf


_PROGRAMS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _explain(potential: Any, positions: Any, numbers: Any, cell: Any, periodic: Any) -> str:
    """Which stage of `potential` made a non-finite result (`mlip.guards.explain`; a kernel named without torch)."""
    adapter = getattr(potential, "adapter", None)
    if adapter is not None:
        return f"It came from the kernel {getattr(adapter, 'op', adapter)!r} (the energy output of its adapter)."
    from ..mlip.guards import explain

    return explain(potential, positions, numbers, cell, periodic)


def program_for(potential: Any) -> _Program:
    """The potential's one jitted program (made on first use): every engine of it shares the compilations."""
    prog = _PROGRAMS.get(potential)
    if prog is None:
        prog = _PROGRAMS[potential] = _Program(potential)
    return prog


class Engine:
    """Energy, forces (global order), stress and per-atom energies of a potential, layout cached.

    Args:
        potential: a `KernelPotential` or `DistributedMLIP` (or the same protocol).

    Attributes:
        prepares, rebuilds: how many layouts were built from scratch / re-planned for moved atoms.
        grown: names of the capacities that re-plans had to grow (each growth compiles the program again).

    Example:
        >>> eng = Engine(pot)
        >>> out = eng.compute(atoms.positions, atoms.numbers, atoms.cell.array, atoms.pbc)
        >>> out["energy"], out["forces"].shape, out["stress"]
    """

    def __init__(self, potential: Any) -> None:
        for name in ("prepare", "needs_rebuild", "rebuild", "energy_fn"):
            if not callable(getattr(potential, name, None)):
                raise TypeError(
                    f"Engine: {type(potential).__name__} has no {name}(); pass a KernelPotential, a "
                    "DistributedMLIP, or an object with prepare / needs_rebuild / rebuild / energy_fn."
                )
        self.potential = potential
        self.dtype = potential_dtype(potential)
        self.prepares = 0
        self.rebuilds = 0
        self.grown: list[str] = []
        self.state: Any = None
        self._key: tuple | None = None
        self._reference: tuple[Any, Any] | None = None  # (state, its plan's positions in owned storage)
        self._program = program_for(potential)

    @property
    def traces(self) -> int:
        """Traces of the potential's program so far: 1, plus one per new set of capacities (shared by
        every Engine of the same potential object)."""
        return self._program.traces

    def update(self, positions: Any, numbers: Any, cell: Any, pbc: Any,
               per_atom: Mapping[str, Any] | None = None) -> Any:
        """The layout for this structure: the cached one, re-planned, or new (see the class docstring).

        A new atom count, new atomic numbers or new periodicity build a new layout, and so does
        a model changed since the layout was made (a `DistributedMLIP` whose wrapper's cutoff,
        layers or dtype changed: `fingerprint()` is read at every call); a new cell or new
        per-atom values rebuild it with the old capacities where the potential allows
        (`KernelPotential`). Moved atoms are `compute`'s business: its program flags a stale plan.
        """
        from ..mlip.state_check import is_current

        pos, numbers, cell, periodic = structure(positions, numbers, cell, pbc, "Engine")
        values = {k: np.asarray(v) for k, v in (per_atom or {}).items()}
        topo = (len(pos), numbers.tobytes(), periodic)
        geo = (cell.tobytes(), tuple((k, v.tobytes()) for k, v in sorted(values.items())))
        if self.state is None or self._key is None or self._key[0] != topo or not is_current(self.potential,
                                                                                               self.state):
            self.state = prepare(self.potential, pos, numbers, cell, periodic, values)
            self.prepares += 1
        elif self._key[1] != geo:
            self.state = prepare(self.potential, pos, numbers, cell, periodic, values, previous=self.state)
            self.prepares += 1
            self.grown.extend(self.state.cs.plan.grown)
        self._key = (topo, geo)
        return self.state

    def compute(self, positions: Any, numbers: Any, cell: Any, pbc: Any = True, *,
                per_atom: Mapping[str, Any] | None = None, where: str = "Engine.compute") -> dict[str, Any]:
        """Energy (eV), forces `(N, 3)` (eV/Å), stress `(3, 3)` (eV/Å³, ASE's sign) and per-atom energies.

        Returns:
            A dict with `energy` (float), `forces`, `stress` (None unless every axis is
            periodic), `energies` (`(N,)`, or None when the potential has no per-atom split)
            and `virial` (`-dE/dstrain`, eV).

        Raises:
            NonFiniteError: an input (positions, cell, a per-atom array) or a result holds NaN or inf; the
                message names it, the atoms, and for a result the model stage that made it (`where`: the
                caller's name in the message).
        """
        from ..layout.finite import check_structure
        from ..lower.finite import check_results

        check_structure(where, positions, cell, per_atom)
        pos = np.asarray(positions, dtype=np.float64)
        state = self.update(positions, numbers, cell, pbc, per_atom)
        energy, node_e, f_owned, g_strain, moved = self._run(state, pos)
        if not float(moved) <= state.cs.plan.skin / 2:  # stale plan (or non-finite positions): re-plan, redo
            self.state = state = self.potential.rebuild(state, pos)
            self.rebuilds += 1
            self.grown.extend(state.cs.plan.grown)
            energy, node_e, f_owned, g_strain, moved = self._run(state, pos)
        cs = state.cs
        virial = -np.asarray(g_strain, dtype=np.float64)
        _, _, cell, periodic = structure(positions, numbers, cell, pbc, "Engine")
        volume = cell_volume(cell, periodic)
        out = {
            "energy": float(energy),
            "forces": cs.to_global(f_owned).astype(np.float64),
            "stress": None if volume is None else -virial / volume,
            "energies": None if node_e is None else cs.to_global(node_e).astype(np.float64),
            "virial": virial,
        }
        check_results(where, out, explain=lambda: _explain(self.potential, pos, numbers, cell, periodic))
        return out

    def _run(self, state: Any, pos: np.ndarray) -> tuple[Any, ...]:
        """The program on `state` at global positions `pos`: energy, node energies, forces, dE/dstrain, moved."""
        cs = state.cs
        if self._reference is None or self._reference[0] is not state:
            ref = cs.owned(cs.plan.reference_positions.astype(self.dtype), positions=True)
            self._reference = (state, ref)
        try:
            # each atom at the plan's periodic image (exact; re-wrapping is no move); the program measures the rest
            x = cs.owned(to_plan_image(cs.plan, pos).astype(self.dtype), positions=True, check=False)
            return self._program.jitted(state, x, self._reference[1])
        except Exception as e:
            if type(e).__name__ == "NotDifferentiableError":
                raise type(e)(
                    f"{type(self.potential).__name__}: forces and stress are -dE/dR and dE/dstrain by jax.grad "
                    f"of the energy, so the kernel must be differentiable. {e}"
                ) from e
            raise
