"""What `nvalchemi-jaxbridge run` simulates: the run options, the demo systems and potentials, JAX start-up.

Call `configure_jax` before anything else touches JAX (the CLI does).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
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
        system: "argon" (Lennard-Jones) or "rocksalt" (DSF Coulomb + Born-Mayer, charged).
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
    """

    system: str = "argon"
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

    def __post_init__(self):
        if self.system not in SYSTEMS:
            raise ValueError(f"run: system must be one of {SYSTEMS}, got {self.system!r}.")
        if self.kernel is not None and self.kernel not in KERNELS:
            raise ValueError(f"run: kernel must be one of {KERNELS}, got {self.kernel!r}.")
        if self.kernel is not None and (self.system, self.kernel) not in DEFAULT_SPECS:
            have = sorted(k for s, k in DEFAULT_SPECS if s == self.system)
            raise ValueError(
                f"run: --kernel {self.kernel} has no op for --system {self.system} (torch-cells is the "
                f"cell-list Lennard-Jones op, argon only); use --system argon, or --kernel "
                f"{' / '.join(have)} for {self.system}."
            )
        if self.spec is not None and self.kernel in ("torch", "torch-cells", "triton"):
            raise ValueError(
                f"run: --kernel {self.kernel} picks the default spec file, but --spec {self.spec} was given "
                "and names its own op; drop --kernel (or use --kernel jax to run the JAX potential with "
                "the spec's transforms)."
            )
        for name in ("steps", "check_every"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"run: {name} must be a positive int, got {v!r}.")
        for name in ("dt", "temperature", "langevin", "skin"):
            v = getattr(self, name)
            if v is not None and not (np.isfinite(v) and v >= 0 and (v > 0 or name in ("temperature", "skin"))):
                raise ValueError(f"run: {name} must be a finite number {'>= 0' if name in ('temperature', 'skin') else '> 0'}, got {v!r}.")
        if self.cells is not None and (not isinstance(self.cells, int) or self.cells < 1):
            raise ValueError(f"run: cells must be a positive int, got {self.cells!r}.")
        if self.dtype not in (None, "float32", "float64"):
            raise ValueError(f"run: dtype must be 'float32' or 'float64', got {self.dtype!r}.")

    def spec_path(self) -> str:
        """The spec file this run uses."""
        if self.spec is not None:
            return self.spec
        return os.path.join(_SPEC_DIR, DEFAULT_SPECS[(self.system, self.kernel or "torch")])


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
    """A demo potential: its parameters, JAX block function and numpy reference."""

    name: str
    params: Any
    charged: bool

    def scalars(self) -> tuple[float, ...]:
        """The op's scalar arguments after the block arrays."""
        return self.params.args()

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

    if system == "argon":
        return Potential("Lennard-Jones (argon)", LJParams(), charged=False)
    return Potential("DSF Coulomb + Born-Mayer (rock salt)", DSFParams(), charged=True)


def make_system(config: RunConfig) -> Any:
    """The generated (or read) system with velocities, positions wrapped into the cell."""
    from ..demo import systems

    cells, _, temperature = SYSTEM_DEFAULTS[config.system]
    temperature = config.temperature if config.temperature is not None else temperature
    if config.structure is not None:
        sys_ = systems.read_structure(config.structure)
        if config.system == "rocksalt" and sys_.charges is None:
            raise ValueError(
                f"run: --system rocksalt uses a charged potential but {config.structure} has no charges; "
                "add initial charges to the file, or use --system argon."
            )
        if not all(sys_.periodic):
            raise ValueError(
                f"run: {config.structure} is not periodic along every axis (pbc={sys_.periodic}); the demo "
                "needs a fully periodic cell (add Lattice=... and pbc=\"T T T\")."
            )
    else:
        make = systems.argon_fcc if config.system == "argon" else systems.rock_salt
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
