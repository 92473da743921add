"""MD integrators: closed-form harmonic oscillator, reversibility, NVE drift, Langevin temperature."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nvalchemi_jaxbridge.demo import argon_fcc
from nvalchemi_jaxbridge.demo import jax_potentials as jp
from nvalchemi_jaxbridge.demo import md
from nvalchemi_jaxbridge.demo.units import KB_EV, MVV2E


def test_verlet_harmonic_oscillator_matches_closed_form():
    k, m = 2.0, jnp.array([12.0, 40.0])  # eV/Å², amu
    force = lambda x: (0.5 * k * jnp.sum(x * x), -k * x)  # noqa: E731
    x0 = jnp.array([[0.3, -0.1, 0.0], [0.0, 0.2, -0.4]])
    s = md.init_state(force, x0, jnp.zeros_like(x0))
    omega = np.sqrt(k / (MVV2E * np.asarray(m)))[:, None]  # 1/fs
    dt, n = 0.5, 400
    s, _ = jax.jit(lambda s: md.run_verlet(force, s, m, dt, n))(s)
    np.testing.assert_allclose(s.positions, np.asarray(x0) * np.cos(omega * dt * n), atol=2e-4)


@pytest.fixture(scope="module")
def argon():
    s = argon_fcc(2, temperature=60.0, seed=1)
    fn = jp.periodic_energy_forces(jp.lj_energy_forces, s.cell, s.periodic, 8.5)
    state = md.init_state(fn, jnp.asarray(s.positions), jnp.asarray(s.velocities))
    return s, fn, state, jnp.asarray(s.masses)


@pytest.mark.slow
def test_nve_energy_conservation_and_reversibility(argon):
    s, fn, state, m = argon
    run = jax.jit(lambda st: md.run_verlet(fn, st, m, 5.0, 200))
    end, e_tot = run(state)
    e0 = float(state.energy + md.kinetic_energy(state.velocities, m))
    # 1 ps at 5 fs: total energy stays within 1e-5 eV/atom (kinetic energy is ~7.8e-3 eV/atom)
    assert np.max(np.abs(np.asarray(e_tot) - e0)) < 1e-5 * s.n_atoms
    assert float(md.temperature(end.velocities, m)) > 10.0  # the system actually moved
    # velocity Verlet is time reversible
    back, _ = run(md.MDState(end.positions, -end.velocities, end.forces, end.energy))
    np.testing.assert_allclose(back.positions, state.positions, atol=1e-8)


@pytest.mark.slow
def test_langevin_reaches_target_temperature(argon):
    s, fn, state, m = argon
    # Without a thermostat the 60 K crystal equipartitions to ~30 K; the bath must heat it to 80 K.
    target = 80.0
    run = jax.jit(lambda st, k: md.run_langevin(fn, st, m, 5.0, k, 300, temperature=target, friction=0.03))
    _, ke = run(state, jax.random.key(0))
    t = 2.0 * np.asarray(ke) / (3 * s.n_atoms * KB_EV)  # Langevin does not conserve momentum: 3N dof
    assert abs(t[100:].mean() - target) < 0.15 * target


def test_md_errors():
    with pytest.raises(ValueError, match=r"positions and velocities must both have shape \(N, 3\)"):
        md.init_state(lambda x: (0.0, x), jnp.zeros((3, 3)), jnp.zeros((2, 3)))
    with pytest.raises(ValueError, match="positive number of degrees of freedom"):
        md.temperature(jnp.zeros((1, 3)), jnp.ones(1))
