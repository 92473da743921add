"""`JaxBridgeCalculator`: an ASE calculator over a distributed potential (one process, all local devices).

ASE asks for one property at a time and drops its results whenever the atoms
change, so every `calculate` fills energy, free energy, forces, stress and (when
the potential has them) per-atom energies in one program run. The halo layout
is kept between calls by an `Engine`: re-planned once some atom moved more than
skin/2, rebuilt with the old capacities when the cell changes (e.g. under a
cell filter), and built anew for new atomic numbers, periodicity or atom count.

Importing this module imports ASE.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .engine import Engine, per_atom_names

try:
    from ase.calculators.calculator import Calculator, PropertyNotImplementedError, all_changes
    from ase.stress import full_3x3_to_voigt_6_stress
except ImportError as e:  # pragma: no cover - exercised only without ASE
    raise ImportError(
        "nvalchemi_jaxbridge.integrations.ase_calculator needs ASE (the Atomic Simulation Environment): "
        "pip install ase"
    ) from e


class JaxBridgeCalculator(Calculator):
    """ASE calculator over a `KernelPotential` or `mlip.DistributedMLIP`.

    Results: `energy` and `free_energy` (eV), `forces` `(N, 3)` (eV/Å), `stress` (Voigt
    xx, yy, zz, yz, xz, xy, eV/Å³, ASE's sign `(1/V) dE/dstrain`; fully periodic cells
    only) and, when the potential splits the energy by atom, `energies` `(N,)`.

    Per-atom inputs the potential's recipe names are read from the atoms: `"charges"`
    from `atoms.get_initial_charges()`, any other name from `atoms.arrays[name]`.

    Args:
        potential: the potential (its `skin` sets how often the layout is re-planned).
        **kwargs: passed to `ase.calculators.calculator.Calculator` (e.g. `label`).

    Attributes:
        engine: the `Engine` (its `traces`, `prepares` and `rebuilds` count the work done).

    Example:
        A whole model (a `MessagePassingWrapper`, a LAMMPS ML-IAP object, or `load_model(path)`):

        >>> from nvalchemi_jaxbridge.mlip import MPNN, MPNNWrapper, DistributedMLIP
        >>> atoms.calc = JaxBridgeCalculator(DistributedMLIP(MPNNWrapper(MPNN([29])), n_devices=8))
        >>> atoms.get_potential_energy(), atoms.get_forces(), atoms.get_stress()

        A system larger than a device's memory: a tiled model as it is, same numbers
        (`DistributedMLIP(wrapper, n_devices=8, exchange="deep_halo", tiles="auto")`, see `mlip.tiles`).

        One kernel of a spec: `JaxBridgeCalculator(KernelPotential(spec, args=..., cutoff=6.0))`.
    """

    def __init__(self, potential: Any, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.potential = potential
        self.engine = Engine(potential)
        props = ["energy", "free_energy", "forces", "stress"]
        if getattr(potential, "atom_energies", True):
            props.append("energies")
        self.implemented_properties = props

    def calculate(self, atoms: Any = None, properties: Any = None, system_changes: Any = all_changes) -> None:
        """Compute every property for `atoms` in one run (ASE calls this with one property name)."""
        super().calculate(atoms, properties, system_changes)
        a = self.atoms
        pbc = tuple(bool(p) for p in a.pbc)
        if properties and "stress" in properties and not all(pbc):
            raise PropertyNotImplementedError(
                f"JaxBridgeCalculator: stress needs a cell periodic along every axis, but pbc={pbc}; make the "
                "structure fully periodic (atoms.pbc = True with a cell), or do not ask for stress."
            )
        out = self.engine.compute(a.positions, a.numbers, a.cell.array, pbc, per_atom=self._per_atom(a),
                                  where="JaxBridgeCalculator")
        self.results = {"energy": out["energy"], "free_energy": out["energy"], "forces": out["forces"]}
        if out["stress"] is not None:
            self.results["stress"] = full_3x3_to_voigt_6_stress(out["stress"])
        if out["energies"] is not None:
            self.results["energies"] = out["energies"]

    def _per_atom(self, atoms: Any) -> dict[str, np.ndarray]:
        out = {}
        for name in per_atom_names(self.potential):
            if name == "charges":
                out[name] = atoms.get_initial_charges()
            elif name in atoms.arrays:
                out[name] = atoms.arrays[name]
            else:
                raise ValueError(
                    f"JaxBridgeCalculator: the potential reads the per-atom array {name!r}, which these atoms do "
                    f"not have; set it with atoms.set_array({name!r}, values) (charges: "
                    "atoms.set_initial_charges)."
                )
        return out
