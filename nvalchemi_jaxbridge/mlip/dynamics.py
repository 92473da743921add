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
from .jax_model import DistributedMLIP, ModelState


def _chunk_fn(model: DistributedMLIP) -> Callable[..., tuple[MDState, jax.Array]]:
    """`chunk(layout, md, masses, reference, dt, n) -> (md, moved_too_far)`: `n` velocity Verlet steps, one program.

    `moved_too_far` is True when an owned atom ended a step more than skin/2 from
    the layout's reference position: the block's edges may then have missed a pair,
    so the caller must not keep the chunk. `dt` is traced and `n` static (one
    compiled program per chunk length): a chunk of one step of 0 fs (which leaves
    positions and velocities as they are) gives the first forces from the program
    of one-step chunks.
    """
    grad = jax.value_and_grad(model.energy_fn, argnums=1, has_aux=True)
    limit = (model.skin / 2) ** 2

    def step(layout: ModelState, md: MDState, masses: jax.Array, reference: jax.Array, dt: jax.Array
             ) -> tuple[MDState, jax.Array]:
        def force_fn(x: jax.Array) -> tuple[jax.Array, jax.Array]:
            (energy, _), g = grad(layout, x, jnp.zeros((3, 3), x.dtype))
            return energy, -g

        out = verlet_step(force_fn, md, masses, dt)
        d = out.positions - reference
        return out, jnp.max(jnp.sum(d * d, axis=1)) > limit

    def chunk(layout: ModelState, md: MDState, masses: jax.Array, reference: jax.Array, dt: jax.Array, n: int
              ) -> tuple[MDState, jax.Array]:
        md, moved = step(layout, md, masses, reference, dt)  # the first step gives the carry its energy

        def body(_: int, carry: tuple[MDState, jax.Array]) -> tuple[MDState, jax.Array]:
            md, flag = step(layout, carry[0], masses, reference, dt)
            return md, carry[1] | flag

        return jax.lax.fori_loop(1, n, body, (md, moved)) if n > 1 else (md, moved)

    jitted = jax.jit(chunk, static_argnums=5)

    def call(layout: ModelState, md: MDState, masses: jax.Array, reference: jax.Array, dt: float, n: int
             ) -> tuple[MDState, jax.Array]:
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
    """
    if steps < 0 or check_every < 1:
        raise ValueError(f"nve: need steps >= 0 and check_every >= 1, got steps={steps}, check_every={check_every}.")
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
            md, _ = chunk_of(layout, MDState(x_o, v_o, jnp.zeros_like(x_o), None), m, reference, 0.0, 1)
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
        new, flag = chunk_of(layout, md, m, ref, dt, n)
        if bool(flag):  # an atom left the layout's skin inside the chunk: redo it, from a fresh layout
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
