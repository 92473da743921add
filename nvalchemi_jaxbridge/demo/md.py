"""Molecular dynamics as pure JAX functions over global arrays.

Units: Å, fs, amu, eV, K. ``force_fn(positions) -> (energy, forces)`` is any
force function (single-device ``jax_potentials.periodic_energy_forces`` or the
CLI's distributed one); nothing here knows about devices.
"""

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp

from .units import KB_EV, MVV2E

ForceFn = Callable[[jax.Array], tuple[jax.Array, jax.Array]]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MDState:
    """Positions (N, 3) Å, velocities (N, 3) Å/fs, forces (N, 3) eV/Å, potential energy eV."""

    positions: jax.Array
    velocities: jax.Array
    forces: jax.Array
    energy: jax.Array


def kinetic_energy(velocities: jax.Array, masses: jax.Array) -> jax.Array:
    """Kinetic energy in eV of velocities (Å/fs) and masses (amu)."""
    return 0.5 * MVV2E * jnp.sum(masses[:, None] * velocities * velocities)


def temperature(velocities: jax.Array, masses: jax.Array, *, dof: int | None = None) -> jax.Array:
    """Instantaneous temperature in K; `dof` defaults to 3N - 3 (zero total momentum)."""
    n_dof = 3 * velocities.shape[0] - 3 if dof is None else dof
    if n_dof <= 0:
        raise ValueError(f"temperature needs a positive number of degrees of freedom, got {n_dof}.")
    return 2.0 * kinetic_energy(velocities, masses) / (n_dof * KB_EV)


def init_state(force_fn: ForceFn, positions: jax.Array, velocities: jax.Array) -> MDState:
    """An MDState with forces and energy evaluated at `positions`."""
    if positions.shape != velocities.shape or positions.ndim != 2 or positions.shape[1] != 3:
        raise ValueError(
            f"init_state: positions and velocities must both have shape (N, 3), got "
            f"{positions.shape} and {velocities.shape}."
        )
    energy, forces = force_fn(positions)
    return MDState(positions, velocities, forces, energy)


def _accel(forces: jax.Array, masses: jax.Array) -> jax.Array:
    """Acceleration in Å/fs² of forces (eV/Å) on masses (amu)."""
    return forces / (MVV2E * masses[:, None])


def verlet_step(force_fn: ForceFn, state: MDState, masses: jax.Array, dt: float) -> MDState:
    """One velocity Verlet step of `dt` fs (NVE)."""
    v_half = state.velocities + 0.5 * dt * _accel(state.forces, masses)
    x = state.positions + dt * v_half
    energy, forces = force_fn(x)
    return MDState(x, v_half + 0.5 * dt * _accel(forces, masses), forces, energy)


def baoab_step(
    force_fn: ForceFn,
    state: MDState,
    masses: jax.Array,
    dt: float,
    key: jax.Array,
    *,
    temperature: float,
    friction: float,
) -> MDState:
    """One BAOAB Langevin step (Leimkuhler & Matthews): kick, drift, OU, drift, kick.

    Args:
        force_fn: positions -> (energy, forces).
        state: the current state.
        masses: (N,) amu.
        dt: time step, fs.
        key: a JAX PRNG key for this step's noise.
        temperature: bath temperature, K.
        friction: collision rate gamma, 1/fs.
    """
    v = state.velocities + 0.5 * dt * _accel(state.forces, masses)
    x = state.positions + 0.5 * dt * v
    c1 = jnp.exp(-friction * dt)
    sigma = jnp.sqrt(KB_EV * temperature / (MVV2E * masses))[:, None]
    noise = jax.random.normal(key, v.shape, dtype=v.dtype)
    v = c1 * v + jnp.sqrt(1.0 - c1 * c1) * sigma * noise
    x = x + 0.5 * dt * v
    energy, forces = force_fn(x)
    return MDState(x, v + 0.5 * dt * _accel(forces, masses), forces, energy)


def run_verlet(
    force_fn: ForceFn, state: MDState, masses: jax.Array, dt: float, n_steps: int
) -> tuple[MDState, jax.Array]:
    """`n_steps` of velocity Verlet under ``lax.scan``; returns (final state, total energy per step)."""

    def body(s, _):
        s = verlet_step(force_fn, s, masses, dt)
        return s, s.energy + kinetic_energy(s.velocities, masses)

    return jax.lax.scan(body, state, None, length=n_steps)


def run_langevin(
    force_fn: ForceFn,
    state: MDState,
    masses: jax.Array,
    dt: float,
    key: jax.Array,
    n_steps: int,
    *,
    temperature: float,
    friction: float,
) -> tuple[MDState, jax.Array]:
    """`n_steps` of BAOAB under ``lax.scan``; returns (final state, kinetic energy per step)."""

    def body(s, k):
        s = baoab_step(force_fn, s, masses, dt, k, temperature=temperature, friction=friction)
        return s, kinetic_energy(s.velocities, masses)

    return jax.lax.scan(body, state, jax.random.split(key, n_steps))
