"""Demo systems: fcc argon, NaCl rock salt, and structures read through ASE.

Units: positions Å, masses amu, velocities Å/fs, charges e, temperature K.
numpy only; ASE is imported lazily by ``read_structure`` and ``System.to_ase``.
"""

import dataclasses
import os
from typing import Any

import numpy as np

from .units import ATOMIC_NUMBER, KB_EV, MASS, MVV2E

_FCC_BASIS = np.array([[0.0, 0.0, 0.0], [0.0, 0.5, 0.5], [0.5, 0.0, 0.5], [0.5, 0.5, 0.0]])


def _readonly(a: np.ndarray) -> np.ndarray:
    """A read-only float64/int64 copy, so a frozen System cannot be changed in place."""
    a = np.array(a, copy=True)
    a.setflags(write=False)
    return a


def _as_float64(name: str, value: Any, shape: tuple[int, ...]) -> np.ndarray:
    """Convert to float64 and check the shape, naming the field on failure."""
    a = np.asarray(value)
    if a.dtype.kind not in "fiu":
        raise TypeError(f"System.{name} must be a real numeric array, got dtype {a.dtype}.")
    if a.shape != shape:
        raise ValueError(f"System.{name} must have shape {shape}, got {a.shape}.")
    a = a.astype(np.float64)
    if not np.all(np.isfinite(a)):
        raise ValueError(f"System.{name} contains NaN or inf; check the input structure.")
    return _readonly(a)


@dataclasses.dataclass(frozen=True, eq=False)
class System:
    """An atomic system (global arrays, numpy).

    Attributes:
        positions: (N, 3) float64, Å.
        cell: (3, 3) float64, Å; rows are the lattice vectors.
        periodic: three bools, periodicity along each lattice vector.
        masses: (N,) float64, amu.
        atomic_numbers: (N,) int64.
        charges: (N,) float64 in e, or None.
        velocities: (N, 3) float64 in Å/fs, or None.
    """

    positions: np.ndarray
    cell: np.ndarray
    periodic: tuple[bool, bool, bool]
    masses: np.ndarray
    atomic_numbers: np.ndarray
    charges: np.ndarray | None = None
    velocities: np.ndarray | None = None

    def __post_init__(self):
        pos = np.asarray(self.positions)
        if pos.ndim != 2 or pos.shape[1] != 3:
            raise ValueError(f"System.positions must have shape (N, 3), got {pos.shape}.")
        n = pos.shape[0]
        put = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731
        put("positions", _as_float64("positions", pos, (n, 3)))
        put("cell", _as_float64("cell", self.cell, (3, 3)))
        per = tuple(self.periodic) if np.ndim(self.periodic) else (self.periodic,) * 3
        if len(per) != 3 or not all(isinstance(p, (bool, np.bool_)) for p in per):
            raise ValueError(
                f"System.periodic must be three bools (one per lattice vector), got {self.periodic!r}."
            )
        put("periodic", tuple(bool(p) for p in per))
        for k, p in enumerate(self.periodic):
            if p and np.linalg.norm(self.cell[k]) == 0.0:
                raise ValueError(
                    f"System is periodic along lattice vector {k} but cell[{k}] is zero; "
                    f"give a cell or set periodic[{k}] = False."
                )
        if any(self.periodic) and abs(np.linalg.det(self.cell)) < 1e-12:
            raise ValueError(
                "System.cell is singular but the system is periodic; give three independent "
                "lattice vectors."
            )
        put("masses", _as_float64("masses", self.masses, (n,)))
        if np.any(self.masses <= 0):
            bad = np.flatnonzero(self.masses <= 0)[:5].tolist()
            raise ValueError(f"System.masses must be positive; atoms {bad} are not.")
        z = np.asarray(self.atomic_numbers)
        if z.shape != (n,) or z.dtype.kind not in "iu":
            raise ValueError(
                f"System.atomic_numbers must be an integer array of shape ({n},), "
                f"got {z.dtype} {z.shape}."
            )
        put("atomic_numbers", _readonly(z.astype(np.int64)))
        if self.charges is not None:
            put("charges", _as_float64("charges", self.charges, (n,)))
        if self.velocities is not None:
            put("velocities", _as_float64("velocities", self.velocities, (n, 3)))

    @property
    def n_atoms(self) -> int:
        """Number of atoms."""
        return self.positions.shape[0]

    def replace(self, **changes: Any) -> "System":
        """A copy with some fields replaced (validated again)."""
        return dataclasses.replace(self, **changes)

    def with_temperature(self, temperature: float, *, seed: int = 0) -> "System":
        """A copy with Maxwell-Boltzmann velocities at `temperature` K (see `maxwell_boltzmann`)."""
        return self.replace(velocities=maxwell_boltzmann(self.masses, temperature, seed=seed))

    def to_ase(self) -> Any:
        """This system as an ``ase.Atoms`` (velocities converted from Å/fs to ASE units)."""
        ase, units = _import_ase("System.to_ase")
        atoms = ase.Atoms(
            numbers=self.atomic_numbers,
            positions=self.positions,
            cell=self.cell,
            pbc=self.periodic,
            masses=self.masses,
        )
        if self.charges is not None:
            atoms.set_initial_charges(self.charges)
        if self.velocities is not None:
            atoms.set_velocities(self.velocities / units.fs)
        return atoms


def maxwell_boltzmann(masses: np.ndarray, temperature: float, *, seed: int = 0) -> np.ndarray:
    """Maxwell-Boltzmann velocities (Å/fs) with zero total momentum.

    Components are drawn from N(0, kB T / m), the centre-of-mass velocity is
    removed, and the result is rescaled so that the instantaneous temperature
    with 3N - 3 degrees of freedom is exactly `temperature`.

    Args:
        masses: (N,) amu, N >= 2.
        temperature: K, >= 0.
        seed: seed of ``numpy.random.default_rng``.

    Returns:
        (N, 3) float64 velocities in Å/fs.
    """
    m = np.asarray(masses, dtype=np.float64)
    if m.ndim != 1 or m.shape[0] < 2:
        raise ValueError(
            f"maxwell_boltzmann needs masses of shape (N,) with N >= 2 (zero momentum leaves "
            f"3N - 3 degrees of freedom), got shape {m.shape}."
        )
    if not (isinstance(temperature, (int, float)) and 0.0 <= temperature < float("inf")):
        raise ValueError(f"maxwell_boltzmann: temperature must be >= 0 K, got {temperature!r}.")
    rng = np.random.default_rng(seed)
    v = rng.normal(size=(m.shape[0], 3)) * np.sqrt(KB_EV * temperature / (MVV2E * m))[:, None]
    v -= (m[:, None] * v).sum(0) / m.sum()
    ke = 0.5 * MVV2E * np.sum(m[:, None] * v * v)
    dof = 3 * m.shape[0] - 3
    target = 0.5 * dof * KB_EV * temperature
    return v * np.sqrt(target / ke) if ke > 0 else v


def _cells(n_cells: int | tuple[int, int, int], where: str) -> tuple[int, int, int]:
    """Normalise n_cells to three positive ints."""
    reps = (n_cells,) * 3 if isinstance(n_cells, (int, np.integer)) else tuple(n_cells)
    if len(reps) != 3 or not all(isinstance(r, (int, np.integer)) and r >= 1 for r in reps):
        raise ValueError(
            f"{where}: n_cells must be a positive int or three positive ints, got {n_cells!r}."
        )
    return tuple(int(r) for r in reps)


def _fcc_sites(reps: tuple[int, int, int], a: float) -> np.ndarray:
    """Fractional-basis fcc sites of a reps[0] x reps[1] x reps[2] cubic supercell, in Å."""
    grid = np.stack(np.meshgrid(*[np.arange(r) for r in reps], indexing="ij"), -1).reshape(-1, 1, 3)
    return ((grid + _FCC_BASIS[None]) * a).reshape(-1, 3)


def _check_a(a: float, where: str) -> float:
    """Check a lattice constant."""
    if not (isinstance(a, (int, float)) and 0.0 < a < float("inf")):
        raise ValueError(f"{where}: lattice_constant must be a positive length in Å, got {a!r}.")
    return float(a)


def argon_fcc(
    n_cells: int | tuple[int, int, int],
    *,
    lattice_constant: float = 5.26,
    temperature: float | None = None,
    seed: int = 0,
) -> System:
    """Periodic fcc argon: 4 atoms per cubic cell.

    Args:
        n_cells: cubic cells along each axis (an int or three ints).
        lattice_constant: cubic cell edge in Å.
        temperature: if given, Maxwell-Boltzmann velocities at this temperature (K).
        seed: velocity seed.

    Returns:
        A `System` with 4 * prod(n_cells) atoms, no charges.
    """
    reps = _cells(n_cells, "argon_fcc")
    a = _check_a(lattice_constant, "argon_fcc")
    pos = _fcc_sites(reps, a)
    n = pos.shape[0]
    sys = System(
        positions=pos,
        cell=np.diag(np.array(reps, dtype=np.float64) * a),
        periodic=(True, True, True),
        masses=np.full(n, MASS["Ar"]),
        atomic_numbers=np.full(n, ATOMIC_NUMBER["Ar"]),
    )
    return sys if temperature is None else sys.with_temperature(temperature, seed=seed)


def rock_salt(
    n_cells: int | tuple[int, int, int],
    *,
    lattice_constant: float = 5.64,
    temperature: float | None = None,
    seed: int = 0,
) -> System:
    """Periodic NaCl rock salt: Na (+1 e) on fcc sites, Cl (-1 e) shifted by a/2 along x.

    Args:
        n_cells: cubic cells along each axis (an int or three ints); 8 ions per cell.
        lattice_constant: cubic cell edge in Å.
        temperature: if given, Maxwell-Boltzmann velocities at this temperature (K).
        seed: velocity seed.

    Returns:
        A neutral `System` with charges, Na and Cl masses.
    """
    reps = _cells(n_cells, "rock_salt")
    a = _check_a(lattice_constant, "rock_salt")
    na = _fcc_sites(reps, a)
    cl = na + np.array([0.5 * a, 0.0, 0.0])
    n = na.shape[0]
    sys = System(
        positions=np.concatenate([na, cl]),
        cell=np.diag(np.array(reps, dtype=np.float64) * a),
        periodic=(True, True, True),
        masses=np.concatenate([np.full(n, MASS["Na"]), np.full(n, MASS["Cl"])]),
        atomic_numbers=np.concatenate(
            [np.full(n, ATOMIC_NUMBER["Na"]), np.full(n, ATOMIC_NUMBER["Cl"])]
        ),
        charges=np.concatenate([np.ones(n), -np.ones(n)]),
    )
    return sys if temperature is None else sys.with_temperature(temperature, seed=seed)


def _import_ase(where: str) -> tuple[Any, Any]:
    """Import ase and ase.units, or say how to install them."""
    try:
        import ase
        import ase.units as units
    except ImportError as e:
        raise ImportError(
            f"{where} needs ASE (the Atomic Simulation Environment): pip install ase"
        ) from e
    return ase, units


def read_structure(
    path: str | os.PathLike[str],
    *,
    periodic: bool | tuple[bool, bool, bool] | None = None,
    index: int = -1,
    format: str | None = None,
) -> System:
    """Read a structure with ASE (extended XYZ, CIF, POSCAR, ... anything ``ase.io.read`` reads).

    Args:
        path: the file.
        periodic: override the file's periodicity (one bool or three); None keeps the file's.
        index: which frame of a trajectory file (default: the last).
        format: ASE format name, if it cannot be guessed from the file name.

    Returns:
        A `System`. Charges come from the file's initial charges (None if all zero);
        velocities from its momenta, converted to Å/fs (None if absent).

    Raises:
        ImportError: ASE is not installed.
        FileNotFoundError: `path` does not exist.
        ValueError: a periodic direction has no cell vector in the file.
    """
    _import_ase("read_structure")
    import ase.io
    import ase.units as units

    if not os.path.exists(path):
        raise FileNotFoundError(f"read_structure: no such file {os.fspath(path)!r}.")
    atoms = ase.io.read(path, index=index, format=format)
    pbc = tuple(bool(p) for p in atoms.pbc) if periodic is None else periodic
    pbc = (pbc,) * 3 if isinstance(pbc, bool) else tuple(pbc)
    cell = np.array(atoms.cell[:], dtype=np.float64)
    missing = [k for k in range(3) if pbc[k] and np.linalg.norm(cell[k]) == 0.0]
    if missing:
        raise ValueError(
            f"read_structure: {os.fspath(path)!r} has no cell vector along lattice directions "
            f"{missing}, but periodic={pbc} asks for periodicity there; add a cell (e.g. "
            "Lattice=\"...\" in extended XYZ) or pass periodic=False."
        )
    q = atoms.get_initial_charges()
    v = atoms.get_velocities() if atoms.has("momenta") else None
    return System(
        positions=atoms.get_positions(),
        cell=cell,
        periodic=pbc,
        masses=atoms.get_masses(),
        atomic_numbers=atoms.get_atomic_numbers(),
        charges=q if np.any(q != 0) else None,
        velocities=None if v is None else v * units.fs,
    )
