"""Molecular dynamics of a distributed MLIP (NVE or Langevin): the steps between two checks are one program.

The state lives in owned storage on the mesh. A stretch of up to `check_every`
steps (model, exchanges, integrator; a `lax.fori_loop` over the step) is one
dispatch; then the positions come back to the host once to test the layout's
rebuild criterion (an atom moved more than skin/2); a rebuilt layout re-lays
positions, velocities and forces out in the new owned storage (capacities kept
or grown). The Langevin thermostat (BAOAB) draws each atom's noise from its
global ID and the step number, so a run does not depend on the layout or the
device count. Units: Å, fs, amu, eV, K.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..demo.md import MDState, kinetic_energy, verlet_step
from ..demo.units import KB_EV, MVV2E
from ..layout.finite import FIX_POSITIONS, NonFiniteError, bad_rows, check_finite, check_masses, check_time_step
from ..layout.finite import rows_text
from ..lower.finite import all_finite, max_or_inf
from .jax_model import DistributedMLIP, ModelState


@dataclasses.dataclass(frozen=True)
class Langevin:
    """A Langevin (BAOAB) thermostat: bath `temperature` (K), `friction` (1/fs), noise `seed`."""

    temperature: float
    friction: float
    seed: int = 0

    def __post_init__(self):
        if not (np.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"Langevin: temperature must be a finite number of K >= 0, got {self.temperature!r}.")
        if not (np.isfinite(self.friction) and self.friction > 0):
            raise ValueError(f"Langevin: friction must be a finite number of 1/fs > 0 (e.g. 0.01), got "
                             f"{self.friction!r}; for NVE leave the thermostat out.")


def _chunk_fn(model: DistributedMLIP, thermostat: Langevin | None
              ) -> Callable[..., tuple[MDState, jax.Array, jax.Array]]:
    """`chunk(layout, md, masses, reference, ids, start, dt, n) -> (md, stale_at, bad_at)`: `n` steps, one program.

    Velocity Verlet, or BAOAB under `thermostat`. `stale_at` is the first step (0-based
    in the chunk; `n` if none) whose owned atoms, all finite, ended more than skin/2
    from the layout's reference positions: the block's edges may then have missed a
    pair, so the caller must not keep the chunk. `bad_at` is the first step whose
    positions, velocities, forces or energy hold a NaN or inf (an explicit `isfinite`
    reduction; a maximum can drop a NaN across devices); from there on the state is
    held, so `md` is that step's state. `ids` are the owned rows' global IDs (-1 on padding) and `start` the
    number of the chunk's first step (both pick the Langevin noise). `dt` and `start`
    are traced and `n` static (one compiled program per chunk length): a chunk of one
    step of 0 fs (which leaves positions and velocities as they are) gives the first
    forces from the program of one-step chunks.
    """
    grad = jax.value_and_grad(model.energy_fn, argnums=1, has_aux=True)
    limit = (model.skin / 2) ** 2
    key = None if thermostat is None else jax.random.key(thermostat.seed)

    def noise(ids: jax.Array, step: jax.Array, dtype: Any) -> jax.Array:
        k = jax.random.fold_in(key, step)
        draw = jax.vmap(lambda i: jax.random.normal(jax.random.fold_in(k, i), (3,), dtype=dtype))(ids)
        return jnp.where((ids >= 0)[:, None], draw, jnp.zeros((), dtype))

    def step(layout: ModelState, md: MDState, masses: jax.Array, reference: jax.Array, ids: jax.Array,
             number: jax.Array, dt: jax.Array) -> tuple[MDState, jax.Array, jax.Array]:
        def force_fn(x: jax.Array) -> tuple[jax.Array, jax.Array]:
            (energy, _), g = grad(layout, x, jnp.zeros((3, 3), x.dtype))
            return energy, -g

        if thermostat is None:
            out = verlet_step(force_fn, md, masses, dt)
        else:  # BAOAB: kick, drift, Ornstein-Uhlenbeck, drift, kick
            inv_m = (1.0 / (MVV2E * masses))[:, None]
            v = md.velocities + 0.5 * dt * md.forces * inv_m
            x = md.positions + 0.5 * dt * v
            c1 = jnp.exp(-thermostat.friction * dt)
            sigma = jnp.sqrt(KB_EV * thermostat.temperature * inv_m)
            v = c1 * v + jnp.sqrt(1.0 - c1 * c1) * sigma * noise(ids, number, v.dtype)
            x = x + 0.5 * dt * v
            energy, f = force_fn(x)
            out = MDState(x, v + 0.5 * dt * f * inv_m, f, energy)
        d = out.positions - reference
        ok = all_finite(out.positions, out.velocities, out.forces, out.energy)
        return out, ok & (max_or_inf(jnp.sum(d * d, axis=1)) > limit), ok

    def chunk(layout: ModelState, md: MDState, masses: jax.Array, reference: jax.Array, ids: jax.Array,
              start: jax.Array, dt: jax.Array, n: int) -> tuple[MDState, jax.Array, jax.Array]:
        md, moved, ok = step(layout, md, masses, reference, ids, start, dt)  # the first step gives the carry its energy
        none = jnp.asarray(n, jnp.int32)
        first = (jnp.where(moved, 0, none), jnp.where(ok, none, 0))

        def body(k: jax.Array, carry: tuple[MDState, jax.Array, jax.Array]) -> tuple[MDState, jax.Array, jax.Array]:
            md, stale_at, bad_at = carry
            held = bad_at < n  # a step went non-finite: keep its state for the report
            new, moved, ok = step(layout, md, masses, reference, ids, start + k, dt)
            md = jax.tree_util.tree_map(lambda a, b: jnp.where(held, a, b), md, new)
            stale_at = jnp.where((stale_at == n) & moved & ~held, k, stale_at)
            return md, stale_at, jnp.where((bad_at == n) & ~ok, k, bad_at)

        return jax.lax.fori_loop(1, n, body, (md, *first)) if n > 1 else (md, *first)

    jitted = jax.jit(chunk, static_argnums=7)

    def call(layout: ModelState, md: MDState, masses: jax.Array, reference: jax.Array, ids: jax.Array,
             start: int, dt: float, n: int) -> tuple[MDState, jax.Array, jax.Array]:
        # the chunk never reads the energy it is given: leaving it out keeps one compiled program for the
        # first call (an energy placed by the caller) and every later one (the energy a chunk returned)
        return jitted(layout, dataclasses.replace(md, energy=None), masses, reference, ids, np.int32(start), dt, n)

    return call


def nve(model: DistributedMLIP, positions: Any, velocities: Any, masses: Any, numbers: Any, cell: Any,
        pbc: Any = True, *, steps: int, dt: float, check_every: int = 10,
        on_step: Callable[[int, np.ndarray, float], None] | None = None,
        stop_when: Callable[[int, float, float], bool] | None = None) -> dict[str, Any]:
    """Run `steps` NVE (velocity Verlet) steps: `md(...)` without a thermostat; see `md`."""
    return md(model, positions, velocities, masses, numbers, cell, pbc, steps=steps, dt=dt,
              check_every=check_every, on_step=on_step, stop_when=stop_when)


def md(model: DistributedMLIP, positions: Any, velocities: Any, masses: Any, numbers: Any, cell: Any,
       pbc: Any = True, *, steps: int, dt: float, check_every: int = 10, thermostat: Langevin | None = None,
       on_step: Callable[[int, np.ndarray, float], None] | None = None,
       stop_when: Callable[[int, float, float], bool] | None = None,
       frames_every: int | Sequence[int] = (), on_frame: Callable[[int, dict[str, Any]], None] | None = None
       ) -> dict[str, Any]:
    """Run `steps` MD steps (NVE, or Langevin under `thermostat`); the trajectory in global order.

    Args:
        model: the distributed model.
        positions, velocities, masses, numbers: `(N, 3)` Å, `(N, 3)` Å/fs, `(N,)` amu, `(N,)`.
        cell, pbc: the box.
        steps, dt: step count and time step (fs).
        check_every: steps between rebuild checks (host round trip of the positions); the steps
            between two checks are one program (compiled once per chunk length: check_every,
            its halves after a chunk left the skin, and the run's last, shorter one).
        thermostat: a `Langevin` thermostat, or None for NVE.
        on_step: called as `on_step(step, positions, energy)` at every check (progress, logging).
        stop_when: called as `stop_when(step, energy, kinetic)` (eV) at every check; True ends the run
            there (e.g. a runaway energy).
        frames_every: with `on_frame`: a check also ends at every multiple of this many steps (of each,
            for several).
        on_frame: called as `on_frame(step, frame)` at step 0, every multiple of `frames_every`, and the
            last step (the one `stop_when` ended the run at, too); `frame` holds `positions`,
            `velocities`, `forces` (global order, numpy), `energy` and `kinetic` (eV). Each interval
            that does not divide `check_every` adds chunk lengths, so compiled programs.

    Returns:
        `positions` (step -> `(N, 3)`), `energy` (step -> potential energy, eV),
        `kinetic` (step -> kinetic energy, eV), one entry per check step (step 0 is the start),
        `rebuilds` (how many layouts were built), `rebuild_steps` (the steps at which a layout was
        rebuilt), `steps` (the steps run: fewer when `stop_when` ended the run) and `timing`:
        (steps, seconds) of the chunks whose length had run before (no compilation in them), then
        the seconds of the whole call.

    Raises:
        nvalchemi_jaxbridge.layout.finite.NonFiniteError: a NaN or inf in positions, velocities, masses or
            `dt` (before the run), or in a
            step's positions, velocities, forces or energy (the message names the step, the atoms and,
            for a model output at finite positions, the model stage that made it).
        ValueError: a mass <= 0 or `dt` <= 0.
    """
    if steps < 0 or check_every < 1:
        raise ValueError(f"nve: need steps >= 0 and check_every >= 1, got steps={steps}, check_every={check_every}.")
    dt = check_time_step("nve", dt)
    check_masses("nve", masses)
    check_finite("nve", "positions", positions, fix=FIX_POSITIONS)
    check_finite("nve", "velocities", velocities, fix="give every atom a finite velocity (Å/fs)")
    every = (frames_every,) if isinstance(frames_every, int) else tuple(frames_every)
    if any(isinstance(e, bool) or not isinstance(e, int) or e < 1 for e in every):
        raise ValueError(f"md: frames_every must be ints >= 1 (steps between frames), got {frames_every!r}.")
    every = every if on_frame is not None else ()
    dtype = model._np_dtype()
    layout = model.prepare(positions, numbers, cell, pbc)
    chunk_of = model.program(("dynamics.md", thermostat), lambda: _chunk_fn(model, thermostat))  # once per model
    m_global = np.asarray(masses, dtype=dtype)
    n_atoms = m_global.shape[0]

    def owned(layout: ModelState, x: np.ndarray, *, positions: bool = False) -> jax.Array:
        return layout.cs.owned(np.asarray(x, dtype=dtype), positions=positions)

    def start(layout: ModelState, x: np.ndarray, v: np.ndarray, f: np.ndarray | None = None,
              energy: Any = None) -> tuple[MDState, tuple[jax.Array, jax.Array, jax.Array]]:
        """The MD state in `layout`'s owned storage (forces evaluated unless given), and (masses, reference, ids)."""
        pad = layout.plan.owned_mask.reshape(-1)
        m = owned(layout, m_global) + jnp.asarray(1.0 - pad, dtype)  # padding: 1 amu
        x_o, v_o = owned(layout, x, positions=True), owned(layout, v)
        reference = owned(layout, layout.plan.reference_positions, positions=True)  # padding parked like x_o
        ids = layout.cs.owned(np.arange(1, n_atoms + 1, dtype=np.int32)) - 1  # padding (zero) becomes -1
        consts = (m, reference, ids)
        if f is None:  # a step of 0 fs: the forces at x_o, from the step function every later step runs
            md, _, bad = chunk_of(layout, MDState(x_o, v_o, jnp.zeros_like(x_o), None), *consts, 0, 0.0, 1)
            if int(bad) == 0:
                _raise_nonfinite(model, layout, md, 0, numbers, cell, pbc, dt)
            return md, consts
        return MDState(x_o, v_o, owned(layout, f), energy), consts

    def relayout(layout: ModelState, md: MDState) -> tuple[ModelState, MDState, tuple[jax.Array, ...]]:
        """A layout rebuilt at `md`'s positions, with `md` moved into it (forces kept, not recomputed)."""
        g = layout.cs.to_global
        x, v, f = g(md.positions), g(md.velocities), g(md.forces)
        layout = model.rebuild(layout, x)
        return (layout, *start(layout, x, v, f, md.energy))

    def frame(step: int, layout: ModelState, md: MDState, kinetic: float, last: bool = False) -> None:
        if on_frame is not None and (last or step == 0 or step == steps or any(step % e == 0 for e in every)):
            g = layout.cs.to_global
            on_frame(step, {"positions": g(md.positions), "velocities": g(md.velocities), "forces": g(md.forces),
                            "energy": float(md.energy), "kinetic": kinetic})

    t_start = time.perf_counter()
    md, consts = start(layout, np.asarray(positions, dtype=np.float64), np.asarray(velocities, dtype=np.float64))
    traj, energies, rebuilt = {0: np.asarray(positions, dtype=np.float64).copy()}, {0: float(md.energy)}, []
    kinetic = {0: float(kinetic_energy(md.velocities, consts[0]))}  # padding rows have zero velocity
    frame(0, layout, md, kinetic[0])
    # chunk lengths: check_every, halved after a chunk that left the skin, back up a rung after one that did
    # not; a few lengths, so a few compiled programs
    rungs = sorted({check_every >> k for k in range(check_every.bit_length())})
    done, chunk = 0, check_every
    seen, steady = {1}, [0, 0.0]  # chunk lengths run before (the start ran 1); steps and seconds of their reruns
    while done < steps:
        n = min(chunk, steps - done, *(e - done % e for e in every))
        t0 = time.perf_counter()
        new, stale_at, bad_at = chunk_of(layout, md, *consts, done, dt, n)
        stale_at, bad_at = int(stale_at), int(bad_at)  # waits for the chunk
        if bad_at < n and stale_at >= bad_at:  # a step went non-finite on a layout that still held
            _raise_nonfinite(model, layout, new, done + bad_at + 1, numbers, cell, pbc, dt, energies)
        moved = stale_at < n
        if n in seen and not moved:
            steady[0], steady[1] = steady[0] + n, steady[1] + time.perf_counter() - t0
        seen.add(n)
        if moved:  # an atom left the layout's skin inside the chunk: redo it, from a fresh layout
            if n == 1 and layout.plan.max_displacement(layout.cs.to_global(md.positions)) == 0.0:
                raise ValueError(
                    f"nve: an atom moved more than skin/2 = {model.skin / 2} Å in one step of {dt} fs from a "
                    "fresh layout; use a shorter time step or a larger skin (DistributedMLIP(skin=...))."
                )
            layout, md, consts = relayout(layout, md)
            rebuilt.append(done)
            chunk = max(r for r in rungs if r <= max(1, n // 2))
            continue
        md, done, chunk = new, done + n, min((r for r in rungs if r > chunk), default=check_every)
        x = layout.cs.to_global(md.positions)
        traj[done], energies[done] = x, float(md.energy)
        kinetic[done] = float(kinetic_energy(md.velocities, consts[0]))
        stop = stop_when is not None and stop_when(done, energies[done], kinetic[done])
        frame(done, layout, md, kinetic[done], last=stop)
        if on_step is not None:
            on_step(done, x, float(md.energy))
        if stop:
            break
        if done < steps and layout.plan.needs_rebuild(x):
            layout, md, consts = relayout(layout, md)
            rebuilt.append(done)
    return {"positions": traj, "energy": energies, "kinetic": kinetic, "rebuilds": 1 + len(rebuilt),
            "rebuild_steps": rebuilt, "steps": done,
            "timing": (steady[0], steady[1], time.perf_counter() - t_start)}


def _raise_nonfinite(model: DistributedMLIP, layout: ModelState, md: MDState, step: int, numbers: Any, cell: Any,
                     pbc: Any, dt: float, energies: dict[int, float] | None = None) -> None:
    """Raise `NonFiniteError` for the MD state of `step`, which holds a NaN or inf: which quantity, which atoms, why."""
    from .guards import explain

    g = layout.cs.to_global
    x, v, f = g(md.positions), g(md.velocities), g(md.forces)
    last = f" (the last checked energy: {energies[max(energies)]:.6g} eV at step {max(energies)})" if energies else ""
    if (rows := bad_rows(x)).size:
        raise NonFiniteError(
            f"nve: step {step}: the positions of atoms {rows_text(rows)} became non-finite (NaN or inf){last}. The run "
            f"blew up: a time step too large (dt={dt:g} fs), atoms driven too close, or a model that returns NaN; use "
            "a smaller dt, check the structure, or evaluate the model at the last good positions.",
            name="positions", rows=tuple(rows[:5]))
    rows = bad_rows(f)
    if rows.size or not np.isfinite(float(md.energy)):
        what = f"forces on atoms {rows_text(rows)}" if rows.size else "energy"
        raise NonFiniteError(
            f"nve: step {step}: the model returned non-finite {what} (NaN or inf) at finite positions{last}. "
            f"{explain(model, x, numbers, cell, pbc)} Fix the model (NaN weights, a dtype too narrow for its "
            "values), or the structure it is given.", name="forces" if rows.size else "energy", rows=tuple(rows[:5]))
    rows = bad_rows(v)
    raise NonFiniteError(
        f"nve: step {step}: the velocities of atoms {rows_text(rows)} became non-finite (NaN or inf){last}; the "
        f"time step (dt={dt:g} fs) or the masses overflow them. Use a smaller dt.", name="velocities",
        rows=tuple(rows[:5]))
