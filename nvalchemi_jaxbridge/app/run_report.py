"""What `nvalchemi-jaxbridge run` measured: `RunReport` (the `--json-report` content) and the drift measure."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from .report import describe_capacity


@dataclasses.dataclass(frozen=True)
class RunReport:
    """What a run measured. `to_dict()` is the `--json-report` content (without the final arrays)."""

    system: str
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


def energy_drift(total_energy: np.ndarray, n_atoms: int, dt_fs: float) -> tuple[float, float]:
    """(max |E(t) - E(0)| / N, |slope| of a linear fit of E(t)/N in eV/ps)."""
    e = np.asarray(total_energy, dtype=np.float64) / n_atoms
    drift = float(np.max(np.abs(e - e[0]))) if e.size else 0.0
    if e.size < 2:
        return drift, 0.0
    t_ps = np.arange(e.size) * dt_fs * 1e-3
    return drift, float(abs(np.polyfit(t_ps, e, 1)[0]))
