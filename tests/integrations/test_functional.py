"""halo_energy_fn: jax-md-style (neighbor_fn, energy_fn) on global positions, against ASE's own LJ.

The MD loop is the usual jax-md one: a jitted chunk of velocity Verlet steps, the overflow flag
checked on the host after each chunk, and on overflow a re-allocation from the positions before
the chunk and the chunk run again. Its reference is the same integrator in numpy with forces from
`ase.calculators.lj.LennardJones` on the whole periodic system (one device, no halo).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("ase", reason="the references use ASE's LennardJones: pip install ase")

from nvalchemi_jaxbridge.demo.units import MVV2E  # noqa: E402
from nvalchemi_jaxbridge.integrations import halo_energy_fn  # noqa: E402
from tests.integrations._common import argon, ase_lj, lj_potential  # noqa: E402

DT = 5.0  # fs


def _triclinic():
    return argon(rattle=0.1, triclinic=True, seed=2)


def test_energy_forces_stress_under_jit_and_grad_match_ase_on_triclinic_cell():
    from ase.stress import full_3x3_to_voigt_6_stress

    atoms = _triclinic()
    ref = atoms.copy()
    ref.calc = ase_lj()
    neighbor_fn, energy_fn = halo_energy_fn(lj_potential(), atoms.numbers, atoms.cell.array, atoms.pbc)
    r = jnp.asarray(atoms.positions)
    nbrs = neighbor_fn.allocate(r)

    @jax.jit
    def evaluate(r, nbrs):  # one program: energy, its gradient and the stress
        e, g = jax.value_and_grad(energy_fn)(r, neighbor=nbrs)
        return e, g, energy_fn.stress_fn(r, neighbor=nbrs)

    e, g, stress = evaluate(r, nbrs)
    e_ref = ref.get_potential_energy()
    assert abs(float(e) - e_ref) <= 1e-10 * abs(e_ref)
    np.testing.assert_allclose(-np.asarray(g), ref.get_forces(), rtol=0, atol=1e-12)
    np.testing.assert_allclose(full_3x3_to_voigt_6_stress(np.asarray(stress)), ref.get_stress(), rtol=0, atol=1e-12)

    # an atom moved by a lattice vector (a wrapping shift function): same energy, no re-allocation
    shifted = r.at[5].add(jnp.asarray(atoms.cell.array[1] - atoms.cell.array[2]))
    assert abs(float(evaluate(shifted, nbrs)[0]) - e_ref) <= 1e-10 * abs(e_ref)
    assert not bool(nbrs.update(shifted).did_buffer_overflow)
    # an atom moved by more than skin / 2 sets the flag, and it stays set
    moved = neighbor_fn.update(r.at[7, 0].add(0.6 * lj_potential().skin), nbrs)
    assert bool(moved.did_buffer_overflow) and bool(moved.update(r).did_buffer_overflow)


def _reference_trajectory(atoms, velocities, steps):
    """Velocity Verlet in numpy with ASE's LJ forces (Å, fs, amu; the same update order as below)."""
    a = atoms.copy()
    a.calc = ase_lj()
    inv_m = 1.0 / (MVV2E * a.get_masses())[:, None]
    v = velocities.copy()
    f = a.get_forces()
    for _ in range(steps):
        v = v + 0.5 * DT * f * inv_m
        a.positions = a.positions + DT * v
        f = a.get_forces()
        v = v + 0.5 * DT * f * inv_m
    return a.positions


def _run(potential, atoms, velocities, steps, chunk_steps):
    """The jax-md overflow loop; returns positions, traces of the jitted chunk, re-allocations, growths."""
    neighbor_fn, energy_fn = halo_energy_fn(potential, atoms.numbers, atoms.cell.array, atoms.pbc)
    inv_m = jnp.asarray(1.0 / (MVV2E * atoms.get_masses())[:, None])
    traces = [0]

    def force(r, nbrs):
        return -jax.grad(energy_fn)(r, neighbor=nbrs)

    @jax.jit
    def chunk(r, v, nbrs):
        """`chunk_steps` steps; pass i computes the force at r_i once and finishes step i / starts step i+1."""
        traces[0] += 1

        def body(i, c):
            r, v, nbrs = c
            nbrs = nbrs.update(r)
            kick = 0.5 * DT * force(r, nbrs) * inv_m
            v = jnp.where(i > 0, v + kick, v)
            v = jnp.where(i < chunk_steps, v + kick, v)
            return jnp.where(i < chunk_steps, r + DT * v, r), v, nbrs

        return jax.lax.fori_loop(0, chunk_steps + 1, body, (r, v, nbrs))

    def allocate(r, previous=None):
        nbrs = neighbor_fn.allocate(r, previous=previous)
        plan = nbrs.state.plan
        owned = np.sort(plan.owned_global[plan.owned_mask])
        assert np.array_equal(owned, np.arange(len(atoms))), "an atom was lost or duplicated"
        return nbrs, list(plan.grown)

    nbrs, _ = allocate(atoms.positions)
    # replicated over the mesh, as the jitted chunk returns them, so that chunk 2 reuses chunk 1's program
    rep = jax.sharding.NamedSharding(nbrs.state.cs.mesh, jax.sharding.PartitionSpec())
    r, v = jax.device_put(atoms.positions, rep), jax.device_put(velocities, rep)
    reallocs, grown = 0, []
    for _ in range(steps // chunk_steps):
        out = chunk(r, v, nbrs)
        if bool(out[2].did_buffer_overflow):  # re-plan from the positions before the chunk, redo it
            nbrs, g = allocate(r, previous=nbrs)
            reallocs += 1
            grown.append(g)
            out = chunk(r, v, nbrs)
            assert not bool(out[2].did_buffer_overflow), "one chunk moved an atom past skin/2 twice over"
        r, v, nbrs = out
    return np.asarray(r), traces[0], reallocs, grown


@pytest.mark.slow
@pytest.mark.parametrize("headroom,steps,growths", [(1.5, 40, 0), (1.1, 25, 1)], ids=["roomy", "tight"])
def test_md_loop_matches_single_device_reference_and_compiles_once_per_capacity(headroom, steps, growths):
    """Velocity Verlet on 8 devices, 40 K, chunks of 5 steps: positions match the numpy/ASE reference to
    1e-8 Å, no atom is lost at any re-plan, and the chunk is traced once plus once per capacity growth.
    With headroom 1.5 nothing grows (1 trace); with 1.1 the first re-plan grows the capacities and, in
    these 25 steps (seeded), no later one does (2 traces)."""
    atoms = argon(rattle=0.05, triclinic=True, seed=2)
    rng = np.random.default_rng(7)
    velocities = rng.normal(scale=np.sqrt(8.617e-5 * 40.0 / (MVV2E * 39.948)), size=(len(atoms), 3))
    velocities -= velocities.mean(0)
    got, traces, reallocs, grown = _run(lj_potential(headroom=headroom), atoms, velocities, steps, chunk_steps=5)
    np.testing.assert_allclose(got, _reference_trajectory(atoms, velocities, steps), rtol=0, atol=1e-8)
    assert reallocs >= 2, "the run should have re-planned more than once"
    assert sum(bool(g) for g in grown) == growths, grown
    assert traces == 1 + growths


def test_fractional_coordinates_give_the_same_energy_and_a_real_space_gradient():
    """jax-md's periodic_general convention: R_frac @ cell is Cartesian, d energy / d R_frac is eV/Å."""
    atoms = _triclinic()
    pot = lj_potential()
    cart_fn, cart_energy = halo_energy_fn(pot, atoms.numbers, atoms.cell.array, atoms.pbc)
    frac_fn, frac_energy = halo_energy_fn(pot, atoms.numbers, atoms.cell.array, atoms.pbc, fractional_coordinates=True)
    r, s = jnp.asarray(atoms.positions), jnp.asarray(atoms.get_scaled_positions(wrap=False))
    e, g = jax.value_and_grad(cart_energy)(r, neighbor=cart_fn.allocate(r))
    nbrs = frac_fn.allocate(s)
    e_frac, g_frac = jax.value_and_grad(frac_energy)(s, neighbor=nbrs)
    assert abs(float(e_frac) - float(e)) <= 1e-12 * abs(float(e))
    np.testing.assert_allclose(np.asarray(g_frac), np.asarray(g), rtol=0, atol=1e-12)
    step = jnp.zeros_like(s).at[3, 0].set(0.6 * pot.skin / np.linalg.norm(atoms.cell.array[0]))
    assert bool(nbrs.update(s + step).did_buffer_overflow) and not bool(nbrs.update(s).did_buffer_overflow)


def test_errors_name_the_fix():
    atoms = _triclinic()
    neighbor_fn, energy_fn = halo_energy_fn(lj_potential(), atoms.numbers, atoms.cell.array)
    with pytest.raises(ValueError, match=r"positions have shape \(3, 3\).*a new atom count needs a new"):
        neighbor_fn.allocate(np.zeros((3, 3)))
    with pytest.raises(TypeError, match=r"pass the layout as neighbor=nbrs"):
        energy_fn(jnp.asarray(atoms.positions))
    with pytest.raises(TypeError, match=r"unexpected keyword arguments \['box'\]"):
        energy_fn(jnp.asarray(atoms.positions), neighbor=None, box=1.0)
    with pytest.raises(ValueError, match=r"fractional_coordinates=True needs a cell with volume"):
        halo_energy_fn(lj_potential(), atoms.numbers, np.diag([20.0, 20.0, 0.0]), (True, True, False),
                       fractional_coordinates=True)
