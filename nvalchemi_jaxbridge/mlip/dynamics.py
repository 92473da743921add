"""NVE molecular dynamics of a distributed MLIP: the steps between two checks are one program.

The state lives in owned storage on the mesh. A stretch of up to `check_every`
steps (model, exchanges, integrator; a `lax.fori_loop` over the step) is one
dispatch; then the positions come back to the host once to test the layout's
rebuild criterion (an atom moved more than skin/2); a rebuilt layout re-lays
positions, velocities and forces out in the new owned storage (capacities kept
or grown). Units: Å, fs, amu, eV.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..demo.md import MDState, kinetic_energy, verlet_step
from ..layout.finite import FIX_POSITIONS, NonFiniteError, bad_rows, check_finite, check_masses, check_time_step
from ..layout.finite import rows_text
from ..lower.finite import all_finite, max_or_inf
from .jax_model import DistributedMLIP, ModelState


def _chunk_fn(model: DistributedMLIP) -> Callable[..., tuple[MDState, jax.Array, jax.Array]]:
    """`chunk(layout, md, masses, reference, dt, n) -> (md, stale_at, bad_at)`: `n` velocity Verlet steps, one program.

    `stale_at` is the first step (0-based in the chunk; `n` if none) whose owned atoms,
    all finite, ended more than skin/2 from the layout's reference positions: the
    block's edges may then have missed a pair, so the caller must not keep the chunk.
    `bad_at` is the first step whose positions, velocities, forces or energy hold a NaN
    or inf (an explicit `isfinite` reduction; a maximum can drop a NaN across devices);
    from there on the state is held, so `md` is that step's state. `dt` is traced and
    `n` static (one compiled program per chunk length): a chunk of one step of 0 fs
    (which leaves positions and velocities as they are) gives the first forces from
    the program of one-step chunks.
    """
    grad = jax.value_and_grad(model.energy_fn, argnums=1, has_aux=True)
    limit = (model.skin / 2) ** 2

    def step(layout: ModelState, md: MDState, masses: jax.Array, reference: jax.Array, dt: jax.Array
             ) -> tuple[MDState, jax.Array, jax.Array]:
        def force_fn(x: jax.Array) -> tuple[jax.Array, jax.Array]:
            (energy, _), g = grad(layout, x, jnp.zeros((3, 3), x.dtype))
            return energy, -g

        out = verlet_step(force_fn, md, masses, dt)
        d = out.positions - reference
        ok = all_finite(out.positions, out.velocities, out.forces, out.energy)
        return out, ok & (max_or_inf(jnp.sum(d * d, axis=1)) > limit), ok

    def chunk(layout: ModelState, md: MDState, masses: jax.Array, reference: jax.Array, dt: jax.Array, n: int
              ) -> tuple[MDState, jax.Array, jax.Array]:
        md, moved, ok = step(layout, md, masses, reference, dt)  # the first step gives the carry its energy
        none = jnp.asarray(n, jnp.int32)
        first = (jnp.where(moved, 0, none), jnp.where(ok, none, 0))

        def body(k: jax.Array, carry: tuple[MDState, jax.Array, jax.Array]) -> tuple[MDState, jax.Array, jax.Array]:
            md, stale_at, bad_at = carry
            held = bad_at < n  # a step went non-finite: keep its state for the report
            new, moved, ok = step(layout, md, masses, reference, dt)
            md = jax.tree_util.tree_map(lambda a, b: jnp.where(held, a, b), md, new)
            stale_at = jnp.where((stale_at == n) & moved & ~held, k, stale_at)
            return md, stale_at, jnp.where((bad_at == n) & ~ok, k, bad_at)

        return jax.lax.fori_loop(1, n, body, (md, *first)) if n > 1 else (md, *first)

    jitted = jax.jit(chunk, static_argnums=5)

    def call(layout: ModelState, md: MDState, masses: jax.Array, reference: jax.Array, dt: float, n: int
             ) -> tuple[MDState, jax.Array, jax.Array]:
        # the chunk never reads the energy it is given: leaving it out keeps one compiled program for the
        # first call (an energy placed by the caller) and every later one (the energy a chunk returned)
        return jitted(layout, dataclasses.replace(md, energy=None), masses, reference, dt, n)

    return call


def nve(model: DistributedMLIP, positions: Any, velocities: Any, masses: Any, numbers: Any, cell: Any,
        pbc: Any = True, *, steps: int, dt: float, check_every: int = 10,
        on_step: Callable[[int, np.ndarray, float], None] | None = None,
        stop_when: Callable[[int, float, float], bool] | None = None) -> dict[str, Any]:
    """Run `steps` NVE steps; the trajectory in global order.

    Args:
        model: the distributed model.
        positions, velocities, masses, numbers: `(N, 3)` Å, `(N, 3)` Å/fs, `(N,)` amu, `(N,)`.
        cell, pbc: the box.
        steps, dt: step count and time step (fs).
        check_every: steps between rebuild checks (host round trip of the positions); the steps
            between two checks are one program (compiled once per chunk length: check_every,
            its halves after a chunk left the skin, and the run's last, shorter one).
        on_step: called as `on_step(step, positions, energy)` at every check (progress, logging).
        stop_when: called as `stop_when(step, energy, kinetic)` (eV) at every check; True ends the run
            there (e.g. a runaway energy).

    Returns:
        `positions` (step -> `(N, 3)`), `energy` (step -> potential energy, eV),
        `kinetic` (step -> kinetic energy, eV), one entry per check step (step 0 is the start),
        `rebuilds` (how many layouts were built) and `steps` (the steps run: fewer when `stop_when`
        ended the run).

    Raises:
        NonFiniteError: a NaN or inf in positions, velocities, masses or `dt` (before the run), or in a
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
    dtype = model._np_dtype()
    layout = model.prepare(positions, numbers, cell, pbc)
    chunk_of = model.program("dynamics.nve", lambda: _chunk_fn(model))  # compiled once per model
    m_global = np.asarray(masses, dtype=dtype)

    def owned(layout: ModelState, x: np.ndarray, *, positions: bool = False) -> jax.Array:
        return layout.cs.owned(np.asarray(x, dtype=dtype), positions=positions)

    def start(layout: ModelState, x: np.ndarray, v: np.ndarray, f: np.ndarray | None = None,
              energy: Any = None) -> tuple[MDState, jax.Array, jax.Array]:
        """The MD state in `layout`'s owned storage (forces evaluated unless given), masses, reference."""
        m = owned(layout, m_global) + jnp.asarray(1.0 - layout.plan.owned_mask.reshape(-1), dtype)  # padding: 1 amu
        x_o, v_o = owned(layout, x, positions=True), owned(layout, v)
        reference = owned(layout, layout.plan.reference_positions, positions=True)  # padding parked like x_o
        if f is None:  # a step of 0 fs: the forces at x_o, from the step function every later step runs
            md, _, bad = chunk_of(layout, MDState(x_o, v_o, jnp.zeros_like(x_o), None), m, reference, 0.0, 1)
            if int(bad) == 0:
                _raise_nonfinite(model, layout, md, 0, numbers, cell, pbc, dt)
            return md, m, reference
        return MDState(x_o, v_o, owned(layout, f), energy), m, reference

    def relayout(layout: ModelState, md: MDState) -> tuple[ModelState, MDState, jax.Array, jax.Array]:
        """A layout rebuilt at `md`'s positions, with `md` moved into it (forces kept, not recomputed)."""
        g = layout.cs.to_global
        x, v, f = g(md.positions), g(md.velocities), g(md.forces)
        layout = model.rebuild(layout, x)
        return (layout, *start(layout, x, v, f, md.energy))

    md, m, ref = start(layout, np.asarray(positions, dtype=np.float64), np.asarray(velocities, dtype=np.float64))
    traj, energies, rebuilds = {0: np.asarray(positions, dtype=np.float64).copy()}, {0: float(md.energy)}, 1
    kinetic = {0: float(kinetic_energy(md.velocities, m))}  # padding rows have zero velocity
    # chunk lengths: check_every, halved after a chunk that left the skin, back up a rung after one that did
    # not; a few lengths, so a few compiled programs
    rungs = sorted({check_every >> k for k in range(check_every.bit_length())})
    done, chunk = 0, check_every
    while done < steps:
        n = min(chunk, steps - done)
        new, stale_at, bad_at = chunk_of(layout, md, m, ref, dt, n)
        stale_at, bad_at = int(stale_at), int(bad_at)
        if bad_at < n and stale_at >= bad_at:  # a step went non-finite on a layout that still held
            _raise_nonfinite(model, layout, new, done + bad_at + 1, numbers, cell, pbc, dt, energies)
        if stale_at < n:  # an atom left the layout's skin inside the chunk: redo it, from a fresh layout
            if n == 1 and layout.plan.max_displacement(layout.cs.to_global(md.positions)) == 0.0:
                raise ValueError(
                    f"nve: an atom moved more than skin/2 = {model.skin / 2} Å in one step of {dt} fs from a "
                    "fresh layout; use a shorter time step or a larger skin (DistributedMLIP(skin=...))."
                )
            layout, md, m, ref = relayout(layout, md)
            rebuilds, chunk = rebuilds + 1, max(r for r in rungs if r <= max(1, n // 2))
            continue
        md, done, chunk = new, done + n, min((r for r in rungs if r > chunk), default=check_every)
        x = layout.cs.to_global(md.positions)
        traj[done], energies[done] = x, float(md.energy)
        kinetic[done] = float(kinetic_energy(md.velocities, m))
        if on_step is not None:
            on_step(done, x, float(md.energy))
        if stop_when is not None and stop_when(done, energies[done], kinetic[done]):
            break
        if done < steps and layout.plan.needs_rebuild(x):
            layout, md, m, ref = relayout(layout, md)
            rebuilds += 1
    return {"positions": traj, "energy": energies, "kinetic": kinetic, "rebuilds": rebuilds, "steps": done}


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
