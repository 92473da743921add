"""Lennard-Jones argon on 8 devices through an OpAdapter, against ASE; re-planning on overflow."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from ase.build import bulk
from ase.calculators.lj import LennardJones

from nvalchemi_jaxbridge.layout import HaloOverflowError, HaloPlan
from nvalchemi_jaxbridge.lower import compile, make_mesh
from nvalchemi_jaxbridge.spec.adapter import OpAdapter
from nvalchemi_jaxbridge.spec.policies import HaloStoragePolicy

from .plans import make_spec

SIGMA, EPS, RC = 3.405, 0.0104, 8.5          # argon, eV and Angstrom
E0 = 4 * EPS * ((SIGMA / RC) ** 12 - (SIGMA / RC) ** 6)   # ASE shifts pair energies to 0 at rc


def lj_block(pos, owned, rows):
    """One device's block: forces on every halo row and this device's share of the energy.

    A pair counts (owned atoms in the pair) / 2, so a pair split over two
    devices is counted 1/2 + 1/2 and a pair of two ghosts not at all. Summed
    over ordered pairs (i, j) this is 1/2 per pair whose first atom is owned;
    owned atoms sit in the first `rows` (= owned_capacity) rows, so only those
    rows need a row of the pair matrix.
    """
    w = owned[:rows].astype(pos.dtype)

    def energy(p):
        d = p[:rows, None, :] - p[None, :, :]
        r2 = jnp.sum(d * d, axis=-1)
        other = jnp.arange(rows)[:, None] != jnp.arange(p.shape[0])[None, :]
        inside = (r2 <= RC * RC) & other
        c6 = (SIGMA * SIGMA / jnp.where(inside, r2, 1.0)) ** 3
        phi = jnp.where(inside, 4 * EPS * (c6 * c6 - c6) - E0, 0.0)
        return 0.5 * jnp.sum(w[:, None] * phi)

    e, g = jax.value_and_grad(energy)(pos)
    return -g, e


def argon(seed=0, size=8):
    atoms = bulk("Ar", "fcc", a=5.26, cubic=True).repeat(size)        # 4 * size**3 atoms
    rng = np.random.default_rng(seed)
    atoms.positions += rng.normal(scale=0.15, size=atoms.positions.shape)
    atoms.wrap()
    return atoms


@pytest.fixture(scope="module")
def system():
    atoms = argon()
    atoms.calc = LennardJones(sigma=SIGMA, epsilon=EPS, rc=RC, smooth=False)
    return atoms, atoms.get_potential_energy(), atoms.get_forces()


@pytest.fixture(scope="module")
def lj():
    adapter = OpAdapter(lj_block, gather_inputs=[0], scatter_outputs=[0], all_reduce_outputs=[1])
    return adapter, make_spec(HaloStoragePolicy(), adapter)


def owned_rows(cs, x_halo):
    """Owned rows of a halo-storage array, as owned storage."""
    t = cs.tables
    x = np.asarray(x_halo).reshape(t.n_devices, t.halo_rows, -1)[:, : t.owned_capacity]
    return x.reshape(t.n_devices * t.owned_capacity, -1)


@pytest.mark.slow
def test_argon_energy_forces_and_grad_match_ase(system, lj):
    atoms, e_ref, f_ref = system
    adapter, spec = lj
    plan = HaloPlan.build(atoms.positions, atoms.cell.array, cutoff=RC, n_devices=8)
    cs = compile(spec, make_mesh(8), plan, positions={adapter: ["pos"]})
    x = cs.owned(atoms.positions, positions=True)
    mask = cs.halo_owned_mask()
    forces, energy = cs.call(adapter, x, mask, cs.tables.owned_capacity)
    assert energy.shape == () and energy.sharding.is_fully_replicated
    np.testing.assert_allclose(float(energy), e_ref, rtol=1e-6)
    f = cs.to_global(owned_rows(cs, forces))
    np.testing.assert_allclose(f, f_ref, rtol=1e-6, atol=1e-6 * np.abs(f_ref).max())
    # ghost rows of the ScatterOutputs result hold their owner's total force
    np.testing.assert_allclose(forces, plan.to_halo(f_ref), rtol=1e-6, atol=1e-6 * np.abs(f_ref).max())
    grad = jax.jit(jax.grad(lambda p: cs.call(adapter, p, mask, cs.tables.owned_capacity)[1]))(x)
    np.testing.assert_allclose(-cs.to_global(grad), f, rtol=1e-9, atol=1e-12)


@pytest.mark.slow
def test_overflow_replans_or_raises_and_keeps_every_atom(lj):
    """Crowd atoms into one domain: a fixed plan overflows; re-planning grows capacities."""
    adapter, spec = lj
    atoms = argon(seed=1, size=3)                                        # 108 atoms
    cell = atoms.cell.array
    plan = HaloPlan.build(atoms.positions, cell, cutoff=RC, n_devices=2, headroom=1.0)
    cs = compile(spec, make_mesh(2), plan, positions={adapter: ["pos"]})
    moved = atoms.positions.copy()
    moved[::2] = moved[::2] * np.array([0.5, 1.0, 1.0])                  # half the atoms move to x < L/2
    with pytest.raises(HaloOverflowError, match="capacit"):
        cs.rebuild(moved, on_overflow="raise")
    grown = cs.rebuild(moved)
    assert grown.plan.grown and grown.tables.static_key != cs.tables.static_key
    ids = np.arange(len(atoms), dtype=np.float64)[:, None]
    np.testing.assert_array_equal(grown.to_global(grown.owned(ids)), ids)   # every atom, once
    assert int(np.sum(grown.plan.n_owned)) == len(atoms)
    moved_atoms = atoms.copy()
    moved_atoms.positions = moved
    moved_atoms.calc = LennardJones(sigma=SIGMA, epsilon=EPS, rc=RC, smooth=False)
    forces, energy = grown.call(adapter, grown.owned(moved, positions=True), grown.halo_owned_mask(),
                                 grown.tables.owned_capacity)
    np.testing.assert_allclose(float(energy), moved_atoms.get_potential_energy(), rtol=1e-6)
    f_ref = moved_atoms.get_forces()
    np.testing.assert_allclose(grown.to_global(owned_rows(grown, forces)), f_ref, rtol=1e-6,
                               atol=1e-6 * np.abs(f_ref).max())
