"""Files a run writes as it goes: the trajectory (extended XYZ) and the thermo log (CSV).

Output paths are checked before the run starts (`check_paths`). The files are written
at the host rebuild checks and at the end, from values the job holds anyway: each
step's `[e_pot, e_kin]` (device values, copied once per check) and, every
`trajectory_every` steps, the state's arrays (kept on the device until the check).
No step waits for the host because of an output.

Frames and rows: step 0 (the initial state), every `every` steps, and the last step.
A model run (`run --model`) writes them with `CheckOutputs`, from the MD's checks
(`mlip.dynamics.md` ends a check at every output step).
A trajectory frame holds positions, velocities (as ASE momenta) and, as calculator
results, `energy` (potential, eV) and `forces` (eV/Å), so `ase.io.read(path, ":")`
gives them back; `info` holds `step` and `time_fs`.
"""

from __future__ import annotations

import csv
import os
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

THERMO_HEADER = ("step", "time_fs", "temperature_K", "e_pot_eV", "e_kin_eV", "e_tot_eV")


def check_paths(paths: Mapping[str, str | None]) -> None:
    """Refuse output files a run could not write, before anything runs (`paths`: option -> path or None).

    Raises:
        ValueError: a path is a directory, its directory does not exist or is not writable, or two
            options name the same file (the message names the option and the fix).
    """
    seen: dict[str, str] = {}
    for option, path in paths.items():
        if path is None:
            continue
        full = os.path.abspath(os.fspath(path))
        if full in seen:
            raise ValueError(f"run: {seen[full]} and {option} name the same file {path}; give each its own file.")
        seen[full] = option
        parent = os.path.dirname(full)
        if os.path.isdir(full):
            raise ValueError(f"run: {option} {path} is a directory; give a file name inside it "
                             f"(e.g. {os.path.join(os.fspath(path), 'out')}).")
        if os.path.exists(parent) and not os.path.isdir(parent):
            raise ValueError(f"run: {option} {path}: {parent} is a file, not a directory; choose another path.")
        if not os.path.isdir(parent):
            raise ValueError(f"run: {option} {path}: the directory {parent} does not exist; create it "
                             "first, or choose another path.")
        if not os.access(parent, os.W_OK) or (os.path.exists(full) and not os.access(full, os.W_OK)):
            raise ValueError(f"run: {option} {path} is not writable; choose a path in a directory you can write.")


def require_ase(option: str) -> tuple[Any, Any, Any]:
    """ase.io, ase.units and SinglePointCalculator, or say how to install ASE."""
    try:
        import ase.io
        import ase.units
        from ase.calculators.singlepoint import SinglePointCalculator
    except ImportError as e:
        raise ImportError(f"run: {option} writes extended XYZ through ASE: pip install ase") from e
    return ase.io, ase.units, SinglePointCalculator


class Trajectory:
    """An extended XYZ file, started empty, one frame appended per `write`."""

    def __init__(self, path: str, every: int, system: Any):
        self.io, self.units, self.calc = require_ase("--trajectory")
        self.path, self.every, self.frames = os.fspath(path), every, 0
        self._atoms = system.to_ase()
        open(self.path, "w").close()

    def write(self, step: int, time_fs: float, positions: np.ndarray, velocities: np.ndarray, energy: float,
              forces: np.ndarray) -> None:
        """Append the frame of `step` (positions Å, velocities Å/fs, energy eV, forces eV/Å)."""
        atoms = self._atoms.copy()
        atoms.set_positions(positions)
        atoms.set_velocities(velocities / self.units.fs)
        atoms.info.update(step=int(step), time_fs=float(time_fs))
        atoms.calc = self.calc(atoms, energy=float(energy), forces=np.asarray(forces, dtype=np.float64))
        self.io.write(self.path, atoms, format="extxyz", append=True)
        self.frames += 1


class Thermo:
    """A CSV file with the `THERMO_HEADER` columns, one row per `write`."""

    def __init__(self, path: str, every: int, n_atoms: int):
        from ..demo.units import KB_EV

        self.path, self.every, self.rows = os.fspath(path), every, 0
        self._dof_kb = max(3 * n_atoms - 3, 1) * KB_EV
        with open(self.path, "w", newline="") as f:
            csv.writer(f).writerow(THERMO_HEADER)

    def write(self, rows: list[tuple[int, float, float, float]]) -> None:
        """Append rows of (step, time fs, e_pot eV, e_kin eV)."""
        with open(self.path, "a", newline="") as f:
            w = csv.writer(f)
            for step, t, e_pot, e_kin in rows:
                w.writerow([step, repr(t), repr(2.0 * e_kin / self._dof_kb), repr(e_pot), repr(e_kin),
                            repr(e_pot + e_kin)])
        self.rows += len(rows)


class Recorder:
    """The host's record of a run: every step's values, and the frames and rows the outputs ask for.

    Call `start` with the initial state, `step` after each step (no host sync), `pull` at each host
    check (one transfer of the values since the last one), `truncate` to drop steps that will be run
    again, `flush` to write the due rows and frames, and `finish` at the end. A step's values are
    `[e_pot, e_kin, moved]` (eV, eV, Å; the displacement is kept, not written).

    Args:
        config: the `RunConfig` (`trajectory`, `trajectory_every`, `thermo`, `thermo_every`, `steps`).
        system: the run's system (species, masses, cell, charges for the frames).
        dt: the time step (fs).
        progress: called as `progress(step, temperature=K, energy=eV/atom)` at each flush, or None.
    """

    def __init__(self, config: Any, system: Any, dt: float, progress: Callable[..., Any] | None = None):
        self.steps, self.dt, self.n, self.progress = config.steps, dt, system.n_atoms, progress
        self.traj = Trajectory(config.trajectory, config.trajectory_every, system) if config.trajectory else None
        self.thermo = Thermo(config.thermo, config.thermo_every, system.n_atoms) if config.thermo else None
        self.host = np.zeros((0, 3))  # host copies of the values of steps 1, 2, ..., pulled so far
        self.pending: list[Any] = []  # device values of the steps after those, dropped once pulled
        self.written = 0  # steps whose thermo rows are written
        self._frames: list[tuple[int, Any, Any]] = []  # (step, compiled spec, state) still on the device
        self._dof = max(3 * system.n_atoms - 3, 1)

    def _wants(self, out: Any, step: int) -> bool:
        return out is not None and (step % out.every == 0 or step == self.steps)

    def start(self, cs: Any, state: Any, e_pot: float, e_kin: float) -> None:
        """Record step 0."""
        if self.thermo is not None:
            self.thermo.write([(0, 0.0, e_pot, e_kin)])
        if self.traj is not None:
            self._frames.append((0, cs, state))
            self._write_frames()

    def step(self, step: int, cs: Any, state: Any, energies: Any) -> None:
        """Record step `step` (device values; nothing is copied to the host here)."""
        self.pending.append(energies)
        if self._wants(self.traj, step):
            self._frames.append((step, cs, state))

    def pull(self) -> np.ndarray:
        """Copy the values since the last pull to the host; all host values `(steps so far, columns)`."""
        import jax

        if self.pending:
            block = np.asarray(jax.device_get(self.pending), dtype=np.float64).reshape(len(self.pending), -1)
            self.host = block if len(self.host) == 0 else np.concatenate([self.host, block])
            self.pending.clear()  # a device array held per step would grow the job's memory (issue 29)
        return self.host

    def truncate(self, step: int) -> None:
        """Forget the steps after `step` (not yet written), to be run again."""
        assert step >= self.written, f"Recorder.truncate({step}): steps up to {self.written} are written"
        del self.pending[max(step - len(self.host), 0):]
        self.host = self.host[:step]
        self._frames = [f for f in self._frames if f[0] <= step]

    def flush(self) -> np.ndarray:
        """Pull, then write the due rows and frames; all host values."""
        host = self.pull()
        if len(host) > self.written:
            if self.thermo is not None:
                self.thermo.write([(s, s * self.dt, float(host[s - 1, 0]), float(host[s - 1, 1]))
                                   for s in range(self.written + 1, len(host) + 1) if self._wants(self.thermo, s)])
            if self.progress is not None:
                from ..demo.units import KB_EV

                e_pot, e_kin = host[-1, :2]
                self.progress(len(host), temperature=2.0 * e_kin / (self._dof * KB_EV),
                              energy=(e_pot + e_kin) / self.n)
            self.written = len(host)
        self._write_frames()
        return host

    def finish(self) -> np.ndarray:
        """The last flush; the host values `(steps, columns)` of every step kept."""
        return self.flush()

    def _write_frames(self) -> None:
        for step, cs, state in self._frames:
            pos = cs.to_global(state.positions).astype(np.float64)
            vel = cs.to_global(state.velocities).astype(np.float64)
            frc = cs.to_global(state.forces).astype(np.float64)
            self.traj.write(step, step * self.dt, pos, vel, float(state.energy), frc)
        self._frames.clear()

    def summary(self) -> dict[str, Any]:
        """What was written, for the report: {"trajectory": (path, frames), "thermo": (path, rows)}."""
        return written(self.traj, self.thermo)


class CheckOutputs:
    """A model run's trajectory and thermo files, written from the MD's checks, and its progress.

    `every` holds the step intervals on which the MD must end a check (empty when nothing is written);
    pass `on_frame` to `mlip.dynamics.md` as its `on_frame`, `watch(stop_when)` as its `stop_when`.

    Args:
        config: the `ModelRunConfig` (`trajectory`, `trajectory_every`, `thermo`, `thermo_every`, `steps`,
            `dt`).
        system: the run's system (species, masses, cell for the frames).
        progress: called as `progress(step, phase="MD", temperature=K, energy=eV/atom)` at each check.
    """

    def __init__(self, config: Any, system: Any, progress: Callable[..., Any]):
        self.steps, self.dt, self.n, self.progress = config.steps, float(config.dt), system.n_atoms, progress
        self.traj = Trajectory(config.trajectory, config.trajectory_every, system) if config.trajectory else None
        self.thermo = Thermo(config.thermo, config.thermo_every, system.n_atoms) if config.thermo else None
        self.every = tuple(sorted({o.every for o in (self.traj, self.thermo) if o is not None}))
        self._dof_kb = max(3 * system.n_atoms - 3, 1)

    def on_frame(self, step: int, frame: dict[str, Any]) -> None:
        """Write `frame` (positions, velocities, forces, energy, kinetic) where an output is due at `step`."""
        last = step == self.steps or all(step % e for e in self.every)  # the last step, or the one a guard stopped
        t = step * self.dt
        if self.traj is not None and (last or step % self.traj.every == 0):
            self.traj.write(step, t, np.asarray(frame["positions"], dtype=np.float64),
                            np.asarray(frame["velocities"], dtype=np.float64), frame["energy"],
                            np.asarray(frame["forces"], dtype=np.float64))
        if self.thermo is not None and (last or step % self.thermo.every == 0):
            self.thermo.write([(step, t, float(frame["energy"]), float(frame["kinetic"]))])

    def watch(self, stop_when: Callable[[int, float, float], bool]) -> Callable[[int, float, float], bool]:
        """`stop_when`, reporting the progress (T, E_tot per atom) at each check first."""
        from ..demo.units import KB_EV

        def check(step: int, e_pot: float, e_kin: float) -> bool:
            self.progress(step, phase="MD", temperature=2.0 * e_kin / (self._dof_kb * KB_EV),
                          energy=(e_pot + e_kin) / self.n)
            return stop_when(step, e_pot, e_kin)

        return check

    def summary(self) -> dict[str, Any]:
        """What was written, for the report: {"trajectory": (path, frames), "thermo": (path, rows)}."""
        return written(self.traj, self.thermo)


def written(traj: Trajectory | None, thermo: Thermo | None) -> dict[str, Any]:
    """{"trajectory": (path, frames), "thermo": (path, rows)} of the files a run wrote."""
    out = {}
    if traj is not None:
        out["trajectory"] = (traj.path, traj.frames)
    if thermo is not None:
        out["thermo"] = (thermo.path, thermo.rows)
    return out
