"""Blow-up guards of the MD jobs (`run`, `run --model`): absurd options, runaway energies, stale plans.

Pure numpy; the jobs call these at each host check and before step 1.

- `check_first_step`: refuses a time step whose first step would move an atom orders of
  magnitude (`FIRST_STEP_FACTOR`) past the skin (up front, the option named).
- `check_rows`: per step `[e_pot, e_kin]`; the first step whose energy or temperature is not
  finite, whose `abs(E_pot)` per atom or temperature passes its limit, or whose total energy jumps
  by more than `max_energy_jump` (relative to `abs(E_pot) + E_kin` of the step before) gives a `Stop`.
- `stale_step`: a step whose forces came from a plan some atom had moved more than skin/2
  away from (the in-program flag of each step) after a fresh plan: one step moved too far.

The defaults are far beyond any physical run (bond energies are a few eV per atom; classical
potentials mean nothing at 10⁶ K); `--max-energy`, `--max-temperature`, `--max-energy-jump`
override them.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

#: A first step moving an atom more than this many times skin/2 is refused before the run.
FIRST_STEP_FACTOR = 100.0

_CAUSE_HOT = ("the time step is too large (--dt) or the temperature too high (--temperature), or atoms overlap "
              "in the structure")
_CAUSE_JUMP = "the time step is too large (--dt), or the skin too small (--skin) so that the plan missed pairs"
_CAUSE_STALE = "the time step is too large (--dt) or the temperature too high (--temperature) for the skin (--skin)"


@dataclasses.dataclass(frozen=True)
class Limits:
    """Thresholds past which a run is stopped.

    Attributes:
        max_energy_per_atom: `abs(E_pot) / N` in eV (default 1e3).
        max_temperature: kinetic temperature in K (default 1e6).
        max_energy_jump: `abs(E_tot(t) - E_tot(t-1)) / (abs(E_pot(t-1)) + E_kin(t-1))` per step (default 1).
    """

    max_energy_per_atom: float = 1e3
    max_temperature: float = 1e6
    max_energy_jump: float = 1.0

    def __post_init__(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not (math.isfinite(v) and v > 0):
                option = "--" + f.name.replace("_per_atom", "").replace("_", "-")
                raise ValueError(f"run: {option} must be a finite number > 0, got {v!r}.")


@dataclasses.dataclass(frozen=True)
class Stop:
    """Why a run stopped: at `step`, `quantity` had `value` past `limit` (units in `unit`); `cause` in words."""

    step: int
    quantity: str
    value: float
    limit: float
    unit: str
    option: str
    cause: str
    detail: str = ""  # set instead of a value past a limit (a non-finite state): the message's whole text

    def message(self) -> str:
        """One line: the step, the quantity, its value, the threshold and the likely cause."""
        if self.detail:
            return f"run stopped at step {self.step}: {self.detail}"
        unit = f" {self.unit}" if self.unit else ""
        return (f"run stopped at step {self.step}: {self.quantity} is {self.value:.6g}{unit}, past the limit "
                f"{self.limit:.6g}{unit} ({self.option}); likely cause: {self.cause}.")

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields plus the message."""
        return {**dataclasses.asdict(self), "message": self.message()}


def temperature(e_kin: Any, n_atoms: int) -> np.ndarray:
    """Kinetic temperature (K) of `e_kin` (eV) with 3N - 3 degrees of freedom."""
    from ..demo.units import KB_EV

    return 2.0 * np.asarray(e_kin, dtype=np.float64) / (max(3 * n_atoms - 3, 1) * KB_EV)


def check_rows(rows: Any, first_step: int, n_atoms: int, limits: Limits, previous: Any = None) -> Stop | None:
    """The first runaway step of `rows` (`(k, >=2)`: e_pot, e_kin in eV of steps `first_step`, ...), or None.

    `previous`: the `[e_pot, e_kin]` of the step before `first_step`, for the energy jump (None: no jump
    check on the first row).
    """
    rows = np.asarray(rows, dtype=np.float64)[:, :2]
    if previous is not None:
        rows = np.concatenate([np.asarray(previous, dtype=np.float64).reshape(1, -1)[:, :2], rows])
        first_step -= 1
    e_pot, e_kin = rows[:, 0], rows[:, 1]
    t = temperature(e_kin, n_atoms)
    total = e_pot + e_kin
    scale = np.abs(e_pot) + np.abs(e_kin)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        jump = np.concatenate([[0.0], np.abs(np.diff(total)) / np.maximum(scale[:-1], n_atoms * 1e-12)])
    skip = 1 if previous is not None else 0
    for k in range(skip, len(rows)):
        step = first_step + k
        if not np.isfinite(e_pot[k]):
            return Stop(step, "the potential energy per atom", float(e_pot[k]) / n_atoms, limits.max_energy_per_atom,
                        "eV/atom", "--max-energy", _CAUSE_HOT)
        if not np.isfinite(t[k]):
            return Stop(step, "the temperature", float(t[k]), limits.max_temperature, "K", "--max-temperature",
                        _CAUSE_HOT)
        if abs(e_pot[k]) / n_atoms > limits.max_energy_per_atom:
            return Stop(step, "|potential energy| per atom", abs(float(e_pot[k])) / n_atoms,
                        limits.max_energy_per_atom, "eV/atom", "--max-energy", _CAUSE_HOT)
        if t[k] > limits.max_temperature:
            return Stop(step, "the temperature", float(t[k]), limits.max_temperature, "K", "--max-temperature",
                        _CAUSE_HOT)
        if k > 0 and not jump[k] <= limits.max_energy_jump:
            return Stop(step, "the total energy's jump in one step (relative to |E_pot| + E_kin before it)",
                        float(jump[k]), limits.max_energy_jump, "", "--max-energy-jump", _CAUSE_JUMP)
    return None


class Watch:
    """`watch(step, e_pot, e_kin) -> bool` at each check: True (and `watch.stop` set) once a limit is passed.

    Each call is checked against the call before it (the energy jump spans the steps between them).
    """

    def __init__(self, limits: Limits, n_atoms: int):
        self.limits, self.n_atoms = limits, n_atoms
        self.last: tuple[float, float] | None = None
        self.stop: Stop | None = None

    def __call__(self, step: int, e_pot: float, e_kin: float) -> bool:
        if self.stop is None:
            self.stop = check_rows([[e_pot, e_kin]], step, self.n_atoms, self.limits, previous=self.last)
        self.last = (float(e_pot), float(e_kin))
        return self.stop is not None


def kinetic(velocities: Any, masses: Any) -> float:
    """Kinetic energy (eV) of velocities (Å/fs) and masses (amu)."""
    from ..demo.units import MVV2E

    v, m = np.asarray(velocities, dtype=np.float64), np.asarray(masses, dtype=np.float64).reshape(-1, 1)
    return float(0.5 * MVV2E * np.sum(m * v * v))


def stale_step(step: int, moved: float, skin: float) -> Stop:
    """The `Stop` of a step that moved an atom `moved` Å from a fresh plan, more than skin/2."""
    return Stop(step, "an atom's displacement in one step from a freshly built halo plan", float(moved),
                skin / 2, "Å", "skin/2; --skin", _CAUSE_STALE)


def nonfinite_step(step: int, checked: int, atoms: str) -> Stop:
    """The `Stop` of the first step whose positions, velocities, forces or energy hold NaN or inf.

    `checked`: the step of the host check that found it; `atoms`: the atoms non-finite there (text).
    """
    where = f"; at step {checked} (the check that found it) {atoms}" if atoms else ""
    return Stop(step, "positions, velocities, forces or the potential energy", math.nan, math.nan, "",
                "--dt; --max-energy", _CAUSE_HOT,
                detail=(f"the positions, velocities, forces or potential energy became non-finite (NaN or inf){where}. "
                        f"The run blew up, and no energy after step {step - 1} is reported; likely cause: "
                        f"{_CAUSE_HOT}. Use a smaller --dt, or check the structure for atoms too close together."))


def first_step_displacement(velocities: Any, forces: Any, masses: Any, dt: float) -> float:
    """Largest |v dt + F dt² / 2m| of the first velocity Verlet step (Å), units Å/fs, eV/Å, amu, fs."""
    from ..demo.units import MVV2E

    v = np.asarray(velocities, dtype=np.float64)
    a = np.asarray(forces, dtype=np.float64) / (MVV2E * np.asarray(masses, dtype=np.float64).reshape(-1, 1))
    with np.errstate(over="ignore", invalid="ignore"):
        d = np.linalg.norm(dt * v + 0.5 * dt * dt * a, axis=1)
    return float(np.max(d, initial=0.0)) if np.all(np.isfinite(d)) else math.inf


def check_first_step(moved: float, skin: float, dt: float) -> None:
    """Refuse a time step whose first step moves an atom `FIRST_STEP_FACTOR` times past skin/2 or more.

    Raises:
        ValueError: names `--dt`, the displacement, skin/2 and a time step that fits.
    """
    half = skin / 2
    if moved <= FIRST_STEP_FACTOR * half and (half > 0 or moved == 0):
        return
    fit = dt * half / moved if math.isfinite(moved) and moved > 0 and half > 0 else None
    hint = f"use --dt {fit:.3g} or less" if fit else "use a finite, smaller --dt"
    raise ValueError(
        f"run: --dt {dt:g} fs moves an atom {moved:.3g} Å in the first step, more than {FIRST_STEP_FACTOR:g} x "
        f"skin/2 = {half:g} Å (the distance the halo plan stays valid for); {hint}, or a larger --skin."
    )
