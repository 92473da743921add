"""Check a wrapper against the model's own forward: the distributed model beside a reference the author trusts.

A wrapper's stages run on the whole system in one go only show that the wrapper does not depend on how the
system is cut into blocks. A wrapper can be another model than the one it wraps (a per-atom term left out,
the species in another order, the layers mixed up) and still pass that, identically on every cut. So
`check_wrapper` compares `DistributedMLIP(wrapper, n_devices=...)` (the JAX door; on the CPU, virtual
devices) with the model's *own* forward: its ASE calculator, a function of the structure that calls its
forward, or, for `MPNNWrapper` and `MACEWrapper`, the forward built in (`reference.own_forward`).

When it fails, three more evaluations on one device say what to look at: the stages on the whole graph
(another model, or a dependence on the cut?), and the same after moving atoms by whole lattice vectors
(the same structure: a wrapper whose energy changes has edge vectors that do not add the shift).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from .protocol import MessagePassingWrapper

EXCHANGES = ("per_layer", "deep_halo")


@dataclasses.dataclass(frozen=True)
class Tolerances:
    """Largest absolute differences allowed: energy per atom (eV), force components (eV/Å), stress (eV/Å³)."""

    energy_per_atom: float
    forces: float
    stress: float

    @classmethod
    def for_dtype(cls, dtype: Any) -> Tolerances:
        """The defaults for a model's dtype: float64 `(1e-8, 1e-6, 1e-8)`, float32 `(1e-5, 1e-4, 1e-6)`."""
        return cls(1e-8, 1e-6, 1e-8) if "64" in str(dtype) else cls(1e-5, 1e-4, 1e-6)


@dataclasses.dataclass(frozen=True)
class Comparison:
    """Largest absolute differences of one result from another (stress None: not compared)."""

    structure: str
    against: str
    energy_per_atom: float
    forces: float
    stress: float | None

    def beyond(self, tol: Tolerances) -> list[str]:
        """The quantities whose difference is beyond `tol` (NaN counts as beyond)."""
        pairs = [("energy", self.energy_per_atom, tol.energy_per_atom), ("forces", self.forces, tol.forces),
                 ("stress", self.stress, tol.stress)]
        return [name for name, err, t in pairs if err is not None and not err <= t]


@dataclasses.dataclass(frozen=True)
class WrapperCheck:
    """What `check_wrapper` found: `rows` (distributed vs reference) decide `passed`; `diagnosis` and `hints`
    (filled when it fails) say where to look. `str(report)` is a table."""

    wrapper: str
    reference: str
    n_devices: int
    tolerances: Tolerances
    rows: tuple[Comparison, ...]
    diagnosis: tuple[Comparison, ...] = ()
    hints: tuple[str, ...] = ()

    @property
    def passed(self) -> bool:
        return not any(r.beyond(self.tolerances) for r in self.rows)

    def __str__(self) -> str:
        t = self.tolerances
        lines = [f"check_wrapper: {self.wrapper} on {self.n_devices} devices against {self.reference}",
                 f"  max |difference| allowed: energy {t.energy_per_atom:.0e} eV/atom, forces {t.forces:.0e} eV/Å, "
                 f"stress {t.stress:.0e} eV/Å³ ('!' marks a difference beyond it)",
                 f"  {'structure':<22} {'compared':<44} {'energy/atom':>12} {'forces':>10} {'stress':>10}"]
        for r in self.rows + self.diagnosis:
            bad = r.beyond(t)
            cells = [_cell(r.energy_per_atom, "energy" in bad), _cell(r.forces, "forces" in bad),
                     _cell(r.stress, "stress" in bad)]
            lines.append(f"  {r.structure:<22} {r.against:<44} {cells[0]:>12} {cells[1]:>10} {cells[2]:>10}")
        lines.append("  result: " + ("passed" if self.passed else "FAILED"))
        lines += [f"  - {h}" for h in self.hints]
        return "\n".join(lines)


class WrapperCheckError(AssertionError):
    """The distributed model differs from the reference beyond the tolerances; `report` holds the numbers."""

    def __init__(self, message: str, report: WrapperCheck) -> None:
        super().__init__(message)
        self.report = report


def check_wrapper(wrapper: MessagePassingWrapper, atoms: Any, reference: Any = None, *, n_devices: int = 2,
                  exchanges: str | Sequence[str] = EXCHANGES, tolerances: Tolerances | None = None,
                  raise_on_failure: bool = True) -> WrapperCheck:
    """Compare the distributed model with the model's own forward: energy, forces and stress.

    Args:
        wrapper: the `MessagePassingWrapper` to check.
        atoms: an ASE `Atoms`, or a list of them (a periodic cell, a slab, a cluster). Stress is compared
            on fully periodic cells, where the reference gives one.
        reference: what the model computes without the bridge, one of: an ASE calculator of the model
            (e.g. MACE's `MACECalculator(models=model)`); a function `atoms -> {"energy", "forces",
            "stress"}` (stress optional; `(3, 3)` or Voigt, ASE's sign) that calls the model's own forward;
            None for `MPNNWrapper` (`MPNN.forward`) and `MACEWrapper` (MACE's own forward).
        n_devices: devices of the distributed run, at least 2 (on the CPU, set
            `jax.config.update("jax_num_cpu_devices", 2)` before JAX is used).
        exchanges: "per_layer", "deep_halo" or both (default both).
        tolerances: default `Tolerances.for_dtype(wrapper.dtype)`.
        raise_on_failure: raise `WrapperCheckError` on a failure (default); False returns the report.

    Returns:
        A `WrapperCheck` (`passed`, the differences per structure and exchange, hints on a failure).

    Raises:
        WrapperCheckError: a difference beyond the tolerances; the message holds the table and what to
            look at (the edge vectors' sign and shifts, the receiver rows, per-atom terms, ...).
        TypeError: no reference for a wrapper the project does not know, or a reference of another kind.
        ValueError: n_devices < 2, an unknown exchange, or a reference result of the wrong shape.

    Example:
        >>> check_wrapper(MyWrapper(model), atoms, reference=MyModelCalculator(model))   # raises if wrong
    """
    from .jax_model import DistributedMLIP
    from .reference import stages_on_whole_graph

    if not isinstance(wrapper, MessagePassingWrapper):
        raise TypeError(f"check_wrapper: wrapper must be a MessagePassingWrapper, got {type(wrapper).__name__}.")
    if not isinstance(n_devices, int) or n_devices < 2:
        raise ValueError(
            f"check_wrapper: n_devices={n_devices!r}; the check needs at least 2 devices, since one device's "
            "block has no ghost rows. On the CPU, set jax.config.update('jax_num_cpu_devices', 2) before JAX is used."
        )
    exchanges = (exchanges,) if isinstance(exchanges, str) else tuple(exchanges)
    if not exchanges or set(exchanges) - set(EXCHANGES):
        raise ValueError(f"check_wrapper: exchanges must be among {list(EXCHANGES)}, got {list(exchanges)}.")
    structures = _structures(atoms)
    ref_fn, ref_name = _reference(wrapper, reference)
    tol = Tolerances.for_dtype(wrapper.dtype) if tolerances is None else tolerances
    wants = [_checked(ref_fn(a.copy()), len(a), ref_name) for _, a in structures]
    models = {ex: DistributedMLIP(wrapper, n_devices=n_devices, exchange=ex) for ex in exchanges}
    rows, seen = [], []
    for (label, a), want in zip(structures, wants):
        args = (np.asarray(a.positions, dtype=np.float64), np.asarray(a.numbers), np.asarray(a.cell[:]), a.pbc)
        got = {ex: m.evaluate(*args, stress=None if all(a.pbc) else False) for ex, m in models.items()}
        rows += [_compare(label, f"{ex}, {n_devices} devices vs reference", got[ex], want, a) for ex in exchanges]
        seen.append((label, a, args, want, got))
    report = WrapperCheck(wrapper.name, ref_name, n_devices, tol, tuple(rows))
    if report.passed:
        return report
    diagnosis = []
    for label, a, args, want, got in seen:
        stages = stages_on_whole_graph(wrapper, *args)
        moved = stages_on_whole_graph(wrapper, _moved_by_lattice_vectors(a), *args[1:])
        diagnosis += [_compare(label, "stages, one device vs reference", stages, want, a),
                      _compare(label, "stages, atoms moved by lattice vectors", moved, stages, a)]
        diagnosis += [_compare(label, f"{ex}, {n_devices} devices vs stages", got[ex], stages, a) for ex in exchanges]
    hints = _hints(diagnosis, tol, ref_name)
    report = dataclasses.replace(report, diagnosis=tuple(diagnosis), hints=tuple(hints))
    if raise_on_failure:
        raise WrapperCheckError(
            f"{wrapper.name}: the distributed model differs from the model's own forward ({ref_name}) beyond the "
            f"tolerances.\n{report}\n(check_wrapper(..., raise_on_failure=False) returns this report instead.)",
            report)
    return report


def _structures(atoms: Any) -> list[tuple[str, Any]]:
    """`(label, atoms)` pairs of one ASE `Atoms` or a sequence of them."""
    many = list(atoms) if isinstance(atoms, (list, tuple)) else [atoms]
    for a in many:
        if not all(hasattr(a, k) for k in ("positions", "numbers", "cell", "pbc", "copy")):
            raise TypeError(
                f"check_wrapper: atoms must be an ase.Atoms or a list of them, got {type(a).__name__}; build one "
                "with ase.Atoms(numbers=..., positions=..., cell=..., pbc=...)."
            )
    labels = [f"{a.get_chemical_formula()} pbc={''.join('T' if p else 'F' for p in a.pbc)}" for a in many]
    return [(f"#{k} {s}" if labels.count(s) > 1 else s, a) for k, (s, a) in enumerate(zip(labels, many))]


def _reference(wrapper: MessagePassingWrapper, reference: Any) -> tuple[Callable[[Any], Mapping[str, Any]], str]:
    """The reference as `atoms -> results`, and its name in the report."""
    from .reference import own_forward

    if reference is None:
        own = own_forward(wrapper)
        if own is None:
            raise TypeError(
                f"check_wrapper: no built-in reference for {type(wrapper).__name__} (only MPNNWrapper and MACEWrapper "
                "have one); pass reference=: the model's ASE calculator, or a function atoms -> {'energy', 'forces', "
                "'stress'} that calls the model's own forward."
            )
        fn, name = own
        return (lambda a: fn(a.positions, a.numbers, a.cell[:], a.pbc)), f"{name} (one device)"
    if hasattr(reference, "get_property") and hasattr(reference, "calculate"):  # an ASE calculator
        return (lambda a: _calculate(reference, a)), f"{type(reference).__name__} (ASE calculator)"
    if callable(reference):
        return reference, f"{getattr(reference, '__qualname__', type(reference).__name__)} (a function of atoms)"
    raise TypeError(
        f"check_wrapper: reference must be an ASE calculator or a function atoms -> dict, got "
        f"{type(reference).__name__}; pass the model's calculator, or wrap its forward in a function."
    )


def _calculate(calc: Any, atoms: Any) -> dict[str, Any]:
    """Energy, forces and (fully periodic cells) stress from an ASE calculator."""
    from ase.calculators.calculator import PropertyNotImplementedError

    atoms.calc = calc
    out = {"energy": atoms.get_potential_energy(), "forces": atoms.get_forces()}
    if all(atoms.pbc):
        try:
            out["stress"] = atoms.get_stress(voigt=False)
        except PropertyNotImplementedError:
            pass
    return out


def _checked(out: Any, n_atoms: int, name: str) -> dict[str, Any]:
    """A reference's results as float64 arrays: energy, forces `(N, 3)`, stress `(3, 3)` or None."""
    if not isinstance(out, Mapping) or "energy" not in out or "forces" not in out:
        raise ValueError(
            f"check_wrapper: the reference {name} returned {type(out).__name__}"
            f"{' with keys ' + str(sorted(out)) if isinstance(out, Mapping) else ''}; it must return a dict with "
            "'energy' (eV), 'forces' ((N, 3) eV/Å, in the order of atoms) and optionally 'stress'."
        )
    forces = np.asarray(out["forces"], dtype=np.float64)
    stress = out.get("stress")
    stress = None if stress is None else np.asarray(stress, dtype=np.float64)
    if stress is not None and stress.shape == (6,):  # Voigt: xx yy zz yz xz xy
        xx, yy, zz, yz, xz, xy = stress
        stress = np.array([[xx, xy, xz], [xy, yy, yz], [xz, yz, zz]])
    if forces.shape != (n_atoms, 3) or (stress is not None and stress.shape != (3, 3)):
        raise ValueError(
            f"check_wrapper: the reference {name} returned forces of shape {forces.shape} and stress of shape "
            f"{None if stress is None else stress.shape}; expected ({n_atoms}, 3) forces in the order of atoms "
            "and a (3, 3) or Voigt (6,) stress (ASE's sign)."
        )
    return {"energy": float(np.asarray(out["energy"]).reshape(())), "forces": forces, "stress": stress}


def _compare(label: str, against: str, got: Mapping[str, Any], want: Mapping[str, Any], atoms: Any) -> Comparison:
    n = max(len(atoms), 1)
    stress = None
    if all(atoms.pbc) and got.get("stress") is not None and want.get("stress") is not None:
        stress = _max_abs(got["stress"], want["stress"])
    return Comparison(label, against, abs(float(got["energy"]) - float(want["energy"])) / n,
                      _max_abs(got["forces"], want["forces"]), stress)


def _max_abs(a: Any, b: Any) -> float:
    d = np.abs(np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64))
    return float("nan") if np.isnan(d).any() else float(np.max(d, initial=0.0))


def _cell(x: float | None, bad: bool) -> str:
    return "-" if x is None else f"{x:.1e}{'!' if bad else ''}"


def _moved_by_lattice_vectors(atoms: Any) -> np.ndarray:
    """Positions with every atom moved by a few whole periodic lattice vectors (the same structure)."""
    periodic = np.asarray(atoms.pbc, dtype=bool)
    steps = np.random.default_rng(0).integers(-2, 3, (len(atoms), 3)) * periodic
    return np.asarray(atoms.positions, dtype=np.float64) + steps @ np.asarray(atoms.cell[:], dtype=np.float64)


def _hints(diagnosis: Sequence[Comparison], tol: Tolerances, ref_name: str) -> list[str]:
    """What to look at, from the one-device evaluations (see the module docstring)."""
    def bad(kind: str) -> list[Comparison]:
        return [d for d in diagnosis if d.against.startswith(kind) and d.beyond(tol)]

    moved, cut = bad("stages, atoms moved"), [d for d in diagnosis if d.against.endswith("vs stages") and d.beyond(tol)]
    other = bad("stages, one device")
    hints = []
    if moved:
        hints.append(
            "edge vectors: the wrapper's energy changes when atoms move by whole lattice vectors (the same "
            "structure), so its edge vectors do not add the shift as the protocol does: use g.edge_vectors(), "
            "i.e. pos[receiver] - pos[sender] + shift (receiver minus sender; the shift added, not subtracted or "
            "left out; shifts strained with the positions).")
    if cut and not moved:
        per_layer_only = all(d.against.startswith("per_layer") for d in cut)
        hints.append(
            "receiver rows: the result depends on how the system is cut into blocks"
            + (" (with exchange='per_layer' only)" if per_layer_only else "")
            + ": scatter messages onto g.receivers (edge_index[1]) and read neighbours from g.senders; only the "
            "first g.receiver_rows rows receive messages; embed must be per row; no sums over rows in a stage.")
    if other and not cut and not moved:
        if all(d.beyond(tol) == ["energy"] for d in other):
            hints.append(
                "per-atom terms: only the energy differs: a per-atom term (E0 per species, a scale and shift) is "
                "missing from node_energies, or differs from the forward's.")
        else:
            hints.append(
                "another model: the stages compute another model than the forward, the same on every cut (so a "
                "check of the stages alone passes): compare them with the forward step by step: the species order "
                "of node_attrs, the layers and readouts called, per-atom terms, units, and, for a model that is not "
                "invariant under inversion, the sign of the edge vectors.")
    if not hints:
        hints.append(
            f"the reference: the stages agree with the distributed run but {ref_name} gives another answer; check "
            "that it is the same model (weights, cutoff, dtype: a float32 reference needs float32 tolerances) and "
            "returns forces in the order of atoms.")
    return hints
