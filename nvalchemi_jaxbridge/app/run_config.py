"""What `nvalchemi-jaxbridge run` simulates: the run options, the demo systems and potentials, JAX start-up.

Call `configure_jax` before anything else touches JAX (the CLI does).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

SYSTEMS = ("argon", "rocksalt")
KERNELS = ("torch", "torch-cells", "triton", "jax")
_SPEC_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "specs")  # package data
DEFAULT_SPECS = {
    ("argon", "torch"): "lj_argon.json", ("argon", "triton"): "lj_argon_triton.json",
    ("argon", "jax"): "lj_argon.json", ("argon", "torch-cells"): "lj_argon_cells.json",
    ("rocksalt", "torch"): "dsf_rocksalt.json", ("rocksalt", "triton"): "dsf_rocksalt_triton.json",
    ("rocksalt", "jax"): "dsf_rocksalt.json",
}
#: Per-system defaults: cubic cells, time step (fs), temperature (K).
SYSTEM_DEFAULTS = {"argon": (4, 5.0, 40.0), "rocksalt": (2, 2.0, 300.0)}


# ------------------------------------------------------------------ config


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """What `run` simulates. `None` fields take the per-system defaults (`SYSTEM_DEFAULTS`).

    Attributes:
        system: "argon" (Lennard-Jones) or "rocksalt" (DSF Coulomb + Born-Mayer, charged); None: argon,
            or rock salt for an `op` that takes charges.
        spec: spec file (default: `nvalchemi_jaxbridge/app/specs/` file for the system and kernel).
        kernel: "torch", "torch-cells" (the cell-list LJ op, argon only), "triton" or "jax"; only with
            the default spec (a given spec names its op).
        devices: devices to spread atoms over (default 8 on the CPU, all GPUs otherwise).
        steps, dt, temperature: MD steps, time step (fs), initial temperature (K).
        langevin: BAOAB friction (1/fs); None runs NVE velocity Verlet.
        cells: cubic cells per axis of the generated system.
        seed: velocities and Langevin noise.
        structure: read this file (ASE) instead of generating the system.
        skin: Verlet skin of the halo plan (Å).
        check_every: host rebuild check interval (steps).
        dtype: "float64" or "float32" (default: float64 on the CPU, float32 on GPUs).
        op: `module:attr` of the user's own force op (block convention) instead of the demo potential.
        params: the op's scalar parameters by name (values: numbers or their text); the rest take the
            op's defaults. Also applies to the demo op (e.g. `{"sigma": 3.3}`).
        rtol: parity tolerance on energy and forces, relative to the reference's largest value
            (default 1e-8 in float64, 1e-4 in float32).
        trajectory, trajectory_every: extended XYZ file to append a frame to every `trajectory_every` steps.
        thermo, thermo_every: CSV file of step, time, temperature and energies every `thermo_every` steps.
        max_energy, max_temperature, max_energy_jump: the run stops past `abs(E_pot)` per atom (eV), the
            temperature (K) or the relative total-energy jump of one step (`guards.Limits`).
    """

    system: str | None = None
    spec: str | None = None
    kernel: str | None = None
    devices: int | None = None
    steps: int = 100
    dt: float | None = None
    temperature: float | None = None
    langevin: float | None = None
    cells: int | None = None
    seed: int = 0
    structure: str | None = None
    skin: float = 1.0
    check_every: int = 10
    dtype: str | None = None
    op: str | None = None
    params: Mapping[str, Any] | None = None
    rtol: float | None = None
    trajectory: str | None = None
    trajectory_every: int = 10
    thermo: str | None = None
    thermo_every: int = 10
    max_energy: float = 1e3
    max_temperature: float = 1e6
    max_energy_jump: float = 1.0

    def __post_init__(self):
        if self.system is not None and self.system not in SYSTEMS:
            raise ValueError(f"run: system must be one of {SYSTEMS}, got {self.system!r}.")
        if self.kernel is not None and self.kernel not in KERNELS:
            raise ValueError(f"run: kernel must be one of {KERNELS}, got {self.kernel!r}.")
        system = self.system or "argon"
        if self.kernel is not None and (system, self.kernel) not in DEFAULT_SPECS:
            have = sorted(k for s, k in DEFAULT_SPECS if s == system)
            raise ValueError(
                f"run: --kernel {self.kernel} has no op for --system {system} (torch-cells is the "
                f"cell-list Lennard-Jones op, argon only); use --system argon, or --kernel "
                f"{' / '.join(have)} for {system}."
            )
        if self.op is not None and self.kernel is not None:
            raise ValueError(
                f"run: --kernel {self.kernel} picks a demo op, but --op {self.op} names your own; drop --kernel."
            )
        if self.spec is not None and self.kernel in ("torch", "torch-cells", "triton"):
            raise ValueError(
                f"run: --kernel {self.kernel} picks the default spec file, but --spec {self.spec} was given "
                "and names its own op; drop --kernel (or use --kernel jax to run the JAX potential with "
                "the spec's transforms)."
            )
        for name in ("steps", "check_every", "trajectory_every", "thermo_every"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"run: --{name.replace('_', '-')} must be a positive int, got {v!r}.")
        for name in ("dt", "temperature", "langevin", "skin", "rtol"):
            v = getattr(self, name)
            zero_ok = name in ("temperature", "skin", "rtol")
            if v is not None and not (np.isfinite(v) and v >= 0 and (v > 0 or zero_ok)):
                raise ValueError(f"run: --{name} must be a finite number {'>= 0' if zero_ok else '> 0'}, got {v!r}.")
        self.limits()
        if self.cells is not None and (not isinstance(self.cells, int) or self.cells < 1):
            raise ValueError(f"run: cells must be a positive int, got {self.cells!r}.")
        if self.dtype not in (None, "float32", "float64"):
            raise ValueError(f"run: dtype must be 'float32' or 'float64', got {self.dtype!r}.")

    def spec_path(self) -> str:
        """The spec file this run uses."""
        if self.spec is not None:
            return self.spec
        return os.path.join(_SPEC_DIR, DEFAULT_SPECS[(self.system or "argon", self.kernel or "torch")])

    def tolerance(self, dtype: str) -> float:
        """The parity tolerance for a run in `dtype`."""
        return self.rtol if self.rtol is not None else (1e-8 if dtype == "float64" else 1e-4)

    def limits(self) -> Any:
        """The run's blow-up thresholds (`guards.Limits`; raises ValueError on a bad one)."""
        from .guards import Limits

        return Limits(self.max_energy, self.max_temperature, self.max_energy_jump)


# ------------------------------------------------------------------ JAX setup


def configure_jax(n_devices: int | None = None, *, dtype: str | None = None) -> tuple[list[Any], str]:
    """Start JAX with `n_devices` devices: virtual CPU devices, or real GPUs when present.

    Must run before JAX is first used: it sets `jax_num_cpu_devices` (CPU) and
    `XLA_PYTHON_CLIENT_PREALLOCATE=false` (GPU). If JAX has already started
    (e.g. under pytest) the existing devices are used when there are enough.

    Args:
        n_devices: devices wanted (default 8 on the CPU, all GPUs otherwise).
        dtype: "float32" or "float64" (default float64 on the CPU, float32 on GPUs);
            float64 turns on `jax_enable_x64`.

    Returns:
        (the devices, the dtype name).

    Raises:
        ValueError: fewer devices than asked for.
    """
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    import jax

    if n_devices is not None and (isinstance(n_devices, bool) or not isinstance(n_devices, int) or n_devices < 1):
        raise ValueError(f"--devices must be a positive int, got {n_devices!r}.")
    started = False
    try:  # never lower a count set earlier in this process (e.g. by a test harness)
        jax.config.update("jax_num_cpu_devices", max(n_devices or 8, int(jax.config.jax_num_cpu_devices)))
    except RuntimeError:
        started = True  # backends already initialised: use what is there
    devices = jax.devices()
    platform = devices[0].platform
    n = n_devices or (8 if platform == "cpu" else len(devices))
    if n > len(devices):
        how = (
            "JAX had already started in this process; start a fresh process, or set "
            f"jax.config.update('jax_num_cpu_devices', {n}) before using JAX"
            if started and platform == "cpu" else f"ask for --devices {len(devices)} or fewer"
        )
        raise ValueError(f"asked for {n} devices but JAX has {len(devices)} {platform} device(s); {how}.")
    dtype = dtype or ("float64" if platform == "cpu" else "float32")
    if dtype == "float64":
        jax.config.update("jax_enable_x64", True)
    if platform == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # Triton on CPU tensors (before Triton imports)
    return devices[:n], dtype


# ------------------------------------------------------------------ physics


@dataclasses.dataclass(frozen=True)
class Potential:
    """A demo potential: its parameters, the species it models, JAX block function and numpy reference."""

    name: str
    params: Any
    charged: bool
    species: tuple[int, ...] = ()

    def scalars(self) -> tuple[float, ...]:
        """The op's scalar arguments after the block arrays."""
        return self.params.args()

    def with_scalars(self, scalars: Mapping[str, Any]) -> "Potential":
        """The same potential with the parameters that `scalars` names (an op's bound scalars) replaced."""
        fields = {f.name for f in dataclasses.fields(self.params)}
        return dataclasses.replace(self, params=dataclasses.replace(
            self.params, **{k: v for k, v in scalars.items() if k in fields}))

    def jax_block(self) -> Callable[..., Any]:
        """The JAX block function of the same convention as the torch op."""
        from ..demo import jax_potentials

        return jax_potentials.dsf_energy_forces if self.charged else jax_potentials.lj_energy_forces

    def reference(self, positions: np.ndarray, charges: np.ndarray | None, system: Any) -> tuple[float, np.ndarray]:
        """Energy and forces of the whole periodic system by the independent numpy reference."""
        from ..demo import reference as ref

        p = dataclasses.asdict(self.params)
        if self.charged:
            return ref.dsf_reference(positions, charges, system.cell, system.periodic, **p)
        return ref.lj_reference(positions, system.cell, system.periodic, **p)


def potential_for(system: str) -> Potential:
    """The demo potential of a system name."""
    from ..demo.params import DSFParams, LJParams

    from ..demo.units import ATOMIC_NUMBER

    if system == "argon":
        return Potential("demo Lennard-Jones (argon)", LJParams(), charged=False, species=(ATOMIC_NUMBER["Ar"],))
    return Potential("demo DSF Coulomb + Born-Mayer (NaCl rock salt)", DSFParams(), charged=True,
                     species=(ATOMIC_NUMBER["Na"], ATOMIC_NUMBER["Cl"]))


def make_system(config: RunConfig, *, charged: bool | None = None) -> Any:
    """The generated (or read) system with velocities, positions wrapped into the cell.

    `charged`: the potential takes charges (default: for the rock salt system).
    """
    from ..demo import systems

    system = config.system or "argon"
    charged = system == "rocksalt" if charged is None else charged
    cells, _, temperature = SYSTEM_DEFAULTS[system]
    temperature = config.temperature if config.temperature is not None else temperature
    if config.structure is not None:
        sys_ = systems.read_structure(config.structure)
        if charged and sys_.charges is None:
            what, other = ("--system rocksalt uses a charged potential", ", or use --system argon") \
                if config.op is None else (f"--op {config.op} takes charges", "")
            raise ValueError(f"run: {what} but {config.structure} has no charges; add initial charges to the file{other}.")
        if not all(sys_.periodic):
            raise ValueError(
                f"run: {config.structure} is not periodic along every axis (pbc={sys_.periodic}); the demo "
                "needs a fully periodic cell (add Lattice=... and pbc=\"T T T\")."
            )
    else:
        if charged and system != "rocksalt":
            raise ValueError(
                f"run: the op takes charges but the generated --system {system} has none; use "
                "--system rocksalt, or a --structure with initial charges."
            )
        make = systems.argon_fcc if system == "argon" else systems.rock_salt
        sys_ = make(config.cells or cells)
    if sys_.velocities is None or config.temperature is not None:
        sys_ = sys_.with_temperature(temperature, seed=config.seed)
    return sys_.replace(positions=wrap(sys_.positions, sys_.cell, sys_.periodic))


def wrap(positions: np.ndarray, cell: np.ndarray, periodic: tuple[bool, bool, bool]) -> np.ndarray:
    """Positions moved into the cell along periodic lattice directions."""
    frac = np.asarray(positions, dtype=np.float64) @ np.linalg.inv(cell)
    per = np.array(periodic)
    frac[:, per] -= np.floor(frac[:, per])
    return frac @ cell


def species_counts(numbers: np.ndarray) -> dict[str, int]:
    """Atoms per chemical symbol, by atomic number."""
    z, count = np.unique(np.asarray(numbers), return_counts=True)
    return {_symbol(int(k)): int(c) for k, c in zip(z, count)}


def _symbol(z: int) -> str:
    """The chemical symbol of atomic number `z` (ASE's table when installed)."""
    try:
        from ase.data import chemical_symbols
    except ImportError:
        from ..demo.units import ATOMIC_NUMBER

        return {v: k for k, v in ATOMIC_NUMBER.items()}.get(z, f"Z={z}")
    return chemical_symbols[z] if 0 < z < len(chemical_symbols) else f"Z={z}"


def check_species(system: Any, pot: Any, source: str) -> None:
    """Refuse a system whose species the potential does not model (`pot.species`; empty: any species).

    Raises:
        ValueError: names the species found, the ones the potential models, and the way out.
    """
    if not getattr(pot, "species", ()):
        return
    found = species_counts(system.atomic_numbers)
    if set(np.unique(system.atomic_numbers).tolist()) <= set(pot.species):
        return
    have = ", ".join(f"{k} x {v}" for k, v in found.items())
    supported = " and ".join(f"{_symbol(z)} (Z={z})" for z in pot.species)
    raise ValueError(
        f"run: {source} holds {have}, but the {pot.name} potential models {supported} only; give a "
        "structure of those species, or run your own potential on it with --op module:attr "
        "(scalars by --param NAME=VALUE)."
    )
