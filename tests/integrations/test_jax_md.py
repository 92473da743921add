"""jax-md itself drives `halo_energy_fn`: `simulate.nve` on `space.periodic_general`, against jax-md's own LJ.

Both runs are the same jax-md program: `periodic_general(box=cell.T, fractional_coordinates=True)`,
`simulate.nve(energy_fn, shift_fn, dt)` (which hands `neighbor=` on to the energy) and jax-md's overflow
protocol: a jitted `lax.fori_loop` chunk of steps, `did_buffer_overflow` checked on the host after it and,
on overflow, a re-allocation from the state before the chunk and the chunk run again. They differ only in
the energy: ours is the demo JAX LJ kernel on 8 devices (halo layout as the neighbour list); the reference
is `smap.pair_neighbor_list` over a `partition.neighbor_list` on one device.

The reference pair energy: the demo LJ is the plain 12-6 shifted to zero at the cutoff per pair, with the
forces of the unshifted 12-6 (ASE's `smooth=False`). jax-md's `energy.lennard_jones_pair` /
`lennard_jones_neighbor_list` multiply the 12-6 by a smooth switch between `r_onset` and `r_cutoff`, which
changes energies and forces below the cutoff, so the reference is `energy.lennard_jones` (plain 12-6)
minus its value at the cutoff, zero beyond, through `smap.pair_neighbor_list`: the same function exactly.

Order in a step: `state = apply_fn(state, neighbor=nbrs)` then `nbrs = nbrs.update(state.position)`, so the
check sees the positions each force was computed at (for jax-md's list either order works).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

jax_md = pytest.importorskip("jax_md", reason="needs jax-md: pip install 'nvalchemi_jaxbridge[engines]'")

from jax_md import energy, partition, simulate, smap, space  # noqa: E402

from nvalchemi_jaxbridge.integrations import halo_energy_fn  # noqa: E402
from tests.integrations._common import EPSILON, RC, SIGMA, argon, lj_potential  # noqa: E402

DT = 0.5  # jax-md time unit with eV, Å, amu: 10.18 fs, so about 5 fs (a float32 number: nve casts dt)
MASS = 39.948  # amu
STEPS, CHUNK = 50, 5


def _shifted_lj(dr, **unused):
    """12-6 minus its value at RC for 0 < r < RC, else 0 (padding pairs have r = 0): the demo kernel's form.

    The parameters go in as float64 arrays: `energy.lennard_jones` computes `f32(4) * epsilon`, which
    rounds a Python float epsilon to float32 (a 1e-8 relative error in every energy and force).
    """
    sigma, epsilon, rc = (jnp.asarray(x, dr.dtype) for x in (SIGMA, EPSILON, RC))
    inside = (dr > 0) & (dr < rc)
    r = jnp.where(inside, dr, rc)
    return jnp.where(inside, energy.lennard_jones(r, sigma, epsilon) - energy.lennard_jones(rc, sigma, epsilon), 0.0)


def _md(neighbor_fn, energy_fn, shift_fn, r0, momenta, reallocate):
    """jax-md's loop: fractional positions after every chunk, and the number of re-allocations."""
    init_fn, apply_fn = simulate.nve(energy_fn, shift_fn, DT)

    @jax.jit
    def chunk(state, nbrs):
        def body(_, carry):
            state, nbrs = carry
            state = apply_fn(state, neighbor=nbrs)
            return state, nbrs.update(state.position)

        return jax.lax.fori_loop(0, CHUNK, body, (state, nbrs))

    nbrs = neighbor_fn.allocate(r0)
    state = init_fn(jax.random.key(0), r0, 0.0, mass=MASS, momenta=momenta, neighbor=nbrs)
    path, reallocs = [], 0
    for _ in range(STEPS // CHUNK):
        new_state, new_nbrs = chunk(state, nbrs)
        if bool(new_nbrs.did_buffer_overflow):  # re-allocate from the state before the chunk, redo it
            nbrs = reallocate(state.position, nbrs)
            reallocs += 1
            new_state, new_nbrs = chunk(state, nbrs)
            assert not bool(new_nbrs.did_buffer_overflow), "one chunk overflowed a fresh allocation"
        state, nbrs = new_state, new_nbrs
        path.append(np.asarray(state.position))
    return np.stack(path), reallocs


# jax-md 0.2.29's neighbour list scatters int64 into int32 under x64 (its own code; harmless here)
@pytest.mark.filterwarnings("ignore:scatter inputs have incompatible types:FutureWarning")
def test_jax_md_nve_on_halo_energy_fn_matches_jax_md_lj_with_reallocation():
    atoms = argon(rattle=0.05, seed=4)  # cubic, 15.8 Å: minimum image holds for RC + skin in the reference
    cell = atoms.cell.array
    rng = np.random.default_rng(11)
    v = rng.normal(scale=np.sqrt(8.617e-5 * 40.0 / MASS), size=(len(atoms), 3))  # 40 K, Å per time unit
    momenta = jnp.asarray(MASS * (v - v.mean(0)))
    r0 = jnp.asarray(atoms.get_scaled_positions(wrap=True))
    displacement, shift = space.periodic_general(jnp.asarray(cell.T), fractional_coordinates=True)

    pot = lj_potential()
    neighbor_fn, energy_fn = halo_energy_fn(pot, atoms.numbers, cell, atoms.pbc, fractional_coordinates=True)
    ours, reallocs = _md(neighbor_fn, energy_fn, shift, r0, momenta,
                         lambda r, nbrs: neighbor_fn.allocate(r, previous=nbrs))

    ref_neighbor_fn = partition.neighbor_list(displacement, jnp.asarray(cell.T), RC, dr_threshold=pot.skin,
                                              fractional_coordinates=True, format=partition.OrderedSparse)
    ref_energy_fn = smap.pair_neighbor_list(_shifted_lj, space.metric(displacement))  # fn takes distances
    ref, _ = _md(ref_neighbor_fn, ref_energy_fn, shift, r0, momenta, lambda r, nbrs: ref_neighbor_fn.allocate(r))

    assert reallocs >= 1, "the run should have re-allocated the halo layout at least once"
    d = ours - ref
    d -= np.round(d)  # the same atom wrapped in one run and not (yet) in the other
    np.testing.assert_allclose(d @ cell, 0.0, rtol=0, atol=1e-8)
    moved = ref[-1] - np.asarray(r0)
    assert np.abs((moved - np.round(moved)) @ cell).max() > 0.5 * pot.skin  # the atoms did move
