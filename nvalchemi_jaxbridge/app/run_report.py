"""What `nvalchemi-jaxbridge run` measured: `RunReport` (the demo potentials and --op), `ModelRunReport`
(--model), each's `to_dict()` the `--json-report` content, and the drift measure."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from .report import describe_capacity


@dataclasses.dataclass(frozen=True)
class RunReport:
    """What a run measured. `to_dict()` is the `--json-report` content (without the final arrays)."""

    system: str  # "argon" / "rocksalt" (generated), or the chemical formula of the structure file read
    potential: str
    spec: str
    op: str
    kernel: str
    n_atoms: int
    n_devices: int
    platform: str
    dtype: str
    grid: tuple[int, int, int]
    steps: int
    dt_fs: float
    thermostat: str
    compile_s: float
    time_per_step_s: float
    wall_s: float
    energy_per_atom_eV: tuple[float, ...]
    energy_change_max_eV_per_atom: float
    energy_slope_eV_per_atom_ps: float
    parity_energy_rel: float
    parity_force_max_abs_eV_per_A: float
    parity_force_max_rel: float
    parity_reference: str
    halo_ghost_rows: int
    halo_rows_per_step: int
    halo_bytes_per_step: int
    halo_padded_bytes_per_step: int
    collectives: tuple[dict[str, Any], ...]
    owned_per_device: tuple[int, ...]
    ghosts_per_device: tuple[int, ...]
    rebuilds: tuple[int, ...]
    late_rebuilds: tuple[int, ...]
    grown: tuple[str, ...]
    final_temperature_K: float
    initial_temperature_K: float
    call_path: str = "-"  # how a torch kernel was called: "ffi" or "callback (<why>)"; "-" for a JAX kernel
    structure: str | None = None  # the file read, or None for a generated system
    species: dict[str, int] = dataclasses.field(default_factory=dict)  # atoms per chemical symbol
    params: dict[str, Any] = dataclasses.field(default_factory=dict)  # the op's scalars, bound by name
    rtol: float = 1e-8
    outputs: dict[str, Any] = dataclasses.field(default_factory=dict)  # {"trajectory": (path, frames), ...}
    steps_done: int = 0  # steps run and kept (less than `steps` when a guard stopped the run)
    stop: dict[str, Any] | None = None  # why the run stopped early (`guards.Stop.to_dict()`), or None
    skin_A: float = 0.0
    max_displacement_A: float = 0.0  # largest displacement since its plan, over every kept step (in-program)
    host_checks: int = 0  # times the host read the steps' displacement flags and energies
    potential_per_atom_eV: tuple[float, ...] = ()  # per kept step, from step 0
    temperature_K: tuple[float, ...] = ()  # per kept step, from step 0
    bath_temperature_K: float | None = None  # the Langevin bath, or None for NVE
    final_positions: np.ndarray | None = dataclasses.field(default=None, repr=False, compare=False)
    final_velocities: np.ndarray | None = dataclasses.field(default=None, repr=False, compare=False)

    @property
    def parity_ok(self) -> bool:
        """Step-1 energy and forces within `rtol` of the reference (False when step 1 was not kept)."""
        return max(self.parity_energy_rel, self.parity_force_max_rel) <= self.rtol

    @property
    def ok(self) -> bool:
        """No guard stopped the run, and the step-1 parity holds."""
        return self.stop is None and self.parity_ok

    @property
    def load_imbalance(self) -> float:
        """max / mean - 1 of owned atoms per device (0 = perfectly balanced)."""
        owned = np.asarray(self.owned_per_device, dtype=float)
        return float(owned.max() / owned.mean() - 1.0)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict of every field but the final arrays, plus `ok` and the load balance summary."""
        d = dataclasses.asdict(dataclasses.replace(self, final_positions=None, final_velocities=None))
        del d["final_positions"], d["final_velocities"]
        d["ok"] = self.ok
        d["grown"] = [describe_capacity(g) for g in self.grown]  # in words, not the plan's field names
        d["load_imbalance"] = self.load_imbalance
        d["owned_min"], d["owned_max"] = min(self.owned_per_device), max(self.owned_per_device)
        return d


    def series(self) -> Any:
        """The picture's data (`plots.MDSeries`): every kept step, time in ps."""
        from .plots import MDSeries

        t = np.arange(len(self.energy_per_atom_eV)) * self.dt_fs * 1e-3
        return MDSeries(time_ps=t, potential=np.asarray(self.potential_per_atom_eV), total=self.energy_per_atom_eV,
                        temperature=np.asarray(self.temperature_K),
                        rebuilds_ps=tuple(s * self.dt_fs * 1e-3 for s in self.rebuilds),
                        owned_per_device=self.owned_per_device, bath_K=self.bath_temperature_K,
                        title=f"{self.potential}: {self.n_atoms} atoms on {self.n_devices} devices, {self.thermostat}")


def energy_drift(total_energy: np.ndarray, n_atoms: int, dt_fs: float) -> tuple[float, float]:
    """(max |E(t) - E(0)| / N, |slope| of a linear fit of E(t)/N in eV/ps)."""
    e = np.asarray(total_energy, dtype=np.float64) / n_atoms
    drift = float(np.max(np.abs(e - e[0]))) if e.size else 0.0
    if e.size < 2:
        return drift, 0.0
    t_ps = np.arange(e.size) * dt_fs * 1e-3
    return drift, float(abs(np.polyfit(t_ps, e, 1)[0]))


@dataclasses.dataclass(frozen=True)
class ModelRunReport:
    """What a model run measured. `to_dict()` is the `--json-report` content; `ok` is the exit status.

    The MD figures are sampled at the MD's checks (`md_steps`: every `--check-every` steps, the output
    steps, and the last). `timing` is (steps, seconds) of the chunks of steps that ran without compiling,
    then the seconds of the whole MD call (compilation included).
    """

    model: str
    source: str
    cutoff: float
    n_layers: int
    n_params: int
    n_atoms: int
    n_devices: int
    platform: str
    dtype: str
    exchange: str
    halo_depth: float
    skin: float
    energy: float
    energy_reference: float
    parity: dict[str, float]
    rtol: float
    reference: str
    rows_per_device: tuple[dict[str, int], ...]
    other_exchange: str
    other_rows_per_device: tuple[dict[str, int], ...]
    compile_s: float
    steps: int
    dt: float
    thermostat: str
    md_steps: tuple[int, ...]
    potential_energy_eV: tuple[float, ...]
    kinetic_energy_eV: tuple[float, ...]
    rebuilds: int  # layouts built (the first one included)
    rebuild_steps: tuple[int, ...]
    timing: tuple[int, float, float]
    wall_s: float
    bath_temperature_K: float | None = None
    steps_done: int = 0  # MD steps run (fewer than `steps` when a guard stopped the run)
    stop: dict[str, Any] | None = None  # why the run stopped early (`guards.Stop.to_dict()`), or None
    outputs: dict[str, Any] = dataclasses.field(default_factory=dict)  # {"trajectory": (path, frames), ...}
    tiles: int | str = 1  # tiles per device as asked (--tiles): an int, or "auto"
    memory_budget_bytes: float | None = None  # per device
    memory_model: str | None = None  # where rows' predicted_bytes come from: "measured" (probe) or "budget"

    @property
    def ok(self) -> bool:
        """No guard stopped the run; energy, forces and stress all within `rtol` of the reference."""
        return self.stop is None and all(
            v <= self.rtol for k, v in self.parity.items() if k in ("energy_rel", "forces_rel", "stress_rel"))

    @property
    def time_per_step_s(self) -> float | None:
        """Seconds per MD step without compilation, else with it (`time_includes_compile`); None: no steps."""
        steps, seconds, whole = self.timing
        if steps:
            return seconds / steps
        return whole / self.steps_done if self.steps_done else None

    @property
    def time_includes_compile(self) -> bool:
        """True when every chunk of steps compiled its program: `time_per_step_s` includes compilation."""
        return self.timing[0] == 0 and self.steps_done > 0

    @property
    def total_energy_per_atom_eV(self) -> np.ndarray:
        """E_pot + E_kin per atom at `md_steps`."""
        return (np.asarray(self.potential_energy_eV) + np.asarray(self.kinetic_energy_eV)) / self.n_atoms

    @property
    def temperature_K(self) -> np.ndarray:
        """Temperature (K, 3N - 3 degrees of freedom) at `md_steps`."""
        from ..demo.units import KB_EV

        return 2.0 * np.asarray(self.kinetic_energy_eV) / (max(3 * self.n_atoms - 3, 1) * KB_EV)

    @property
    def drift(self) -> tuple[float, float]:
        """(largest `abs(E_tot(t) - E_tot(0)) / N` in eV/atom, `abs` of the fit slope in eV/atom/ps) over `md_steps`."""
        e = self.total_energy_per_atom_eV
        drift = float(np.max(np.abs(e - e[0])))
        if e.size < 2:
            return drift, 0.0
        return drift, float(abs(np.polyfit(np.asarray(self.md_steps) * self.dt * 1e-3, e, 1)[0]))

    def series(self) -> Any:
        """The picture's data (`plots.MDSeries`): the MD's checks, time in ps."""
        from .plots import MDSeries

        return MDSeries(time_ps=np.asarray(self.md_steps) * self.dt * 1e-3,
                        potential=np.asarray(self.potential_energy_eV) / self.n_atoms,
                        total=self.total_energy_per_atom_eV, temperature=self.temperature_K,
                        rebuilds_ps=tuple(s * self.dt * 1e-3 for s in self.rebuild_steps),
                        owned_per_device=tuple(r["owned"] for r in self.rows_per_device),
                        bath_K=self.bath_temperature_K, plan="first plan",
                        title=f"{self.model}: {self.n_atoms} atoms on {self.n_devices} devices, {self.thermostat}")

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict of every field plus `ok`, the energy drift, temperatures and time per step."""
        d = dataclasses.asdict(self)
        drift, slope = self.drift
        d.update(ok=self.ok, energy_change_max_eV_per_atom=drift, energy_slope_eV_per_atom_ps=slope,
                 total_energy_per_atom_eV=self.total_energy_per_atom_eV.tolist(),
                 temperature_K=self.temperature_K.tolist(), time_per_step_s=self.time_per_step_s,
                 time_includes_compile=self.time_includes_compile)
        return d
