"""A program called on positions more than skin/2 from its plan is flagged, never silently wrong.

`halo_energy_fn`: an eager `energy_fn` raises (naming the displacement and skin/2); under `jit` / `grad` the
energy and its gradient are NaN and `nbrs.update` sets `did_buffer_overflow`. `Engine` (and so the ASE
calculator): the program's displacement flag makes it re-plan, and the answer is ASE's own Lennard-Jones.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("ase", reason="the references use ASE's LennardJones: pip install ase")

from nvalchemi_jaxbridge.integrations import Engine, halo_energy_fn  # noqa: E402
from tests.integrations._common import argon, ase_lj, lj_potential  # noqa: E402


def _ase(atoms, positions):
    ref = atoms.copy()
    ref.positions = np.asarray(positions)
    ref.calc = ase_lj()
    return ref.get_potential_energy(), ref.get_forces()


def test_energy_fn_past_half_the_skin_raises_eagerly_and_is_nan_under_jit():
    atoms = argon(rattle=0.1, seed=2)
    pot = lj_potential(n_devices=2)  # skin 0.3 Å
    neighbor_fn, energy_fn = halo_energy_fn(pot, atoms.numbers, atoms.cell.array, atoms.pbc)
    r = jnp.asarray(atoms.positions)
    nbrs = neighbor_fn.allocate(r)
    far = r.at[7, 0].add(0.25)
    with pytest.raises(ValueError, match=r"energy_fn: an atom moved 0.25 Å from the positions the layout was built "
                                         r"for, more than skin/2 = 0.15 Å.*neighbor_fn.allocate"):
        energy_fn(far, neighbor=nbrs)
    evaluate = jax.jit(lambda x, nb: jax.value_and_grad(energy_fn)(x, neighbor=nb))
    e, g = evaluate(far, nbrs)
    assert np.isnan(float(e)) and np.all(np.isnan(np.asarray(g)))
    assert bool(nbrs.update(far).did_buffer_overflow)
    assert bool(nbrs.update(r.at[0, 1].set(jnp.nan)).did_buffer_overflow)  # NaN positions count as moved
    near = r.at[7, 0].add(0.1)  # within skin/2: ASE's answer, eager and under jit
    e_ref, f_ref = _ase(atoms, near)
    assert abs(float(energy_fn(near, neighbor=nbrs)) - e_ref) <= 1e-10 * abs(e_ref)
    e, g = evaluate(near, nbrs)
    np.testing.assert_allclose(-np.asarray(g), f_ref, rtol=0, atol=1e-12)
    e, g = evaluate(far, neighbor_fn.allocate(far, nbrs))  # re-allocated: ASE's answer again
    e_ref, f_ref = _ase(atoms, far)
    assert abs(float(e) - e_ref) <= 1e-10 * abs(e_ref)
    np.testing.assert_allclose(-np.asarray(g), f_ref, rtol=0, atol=1e-12)


def test_engine_replans_on_the_programs_stale_flag_and_matches_ase():
    atoms = argon(rattle=0.1, seed=3)
    eng = Engine(lj_potential(n_devices=2))
    args = (atoms.numbers, atoms.cell.array, atoms.pbc)
    eng.compute(atoms.positions, *args)
    old = eng.state
    moved = atoms.positions.copy()
    moved[11] += [0.2, -0.1, 0.05]  # |d| = 0.229 Å > skin/2 = 0.15 Å
    flag = eng._run(old, moved)[4]
    np.testing.assert_allclose(float(flag), np.linalg.norm([0.2, -0.1, 0.05]), rtol=1e-12)
    out = eng.compute(moved, *args)
    assert eng.rebuilds == 1 and eng.state is not old
    e_ref, f_ref = _ase(atoms, moved)
    assert abs(out["energy"] - e_ref) <= 1e-10 * abs(e_ref)
    np.testing.assert_allclose(out["forces"], f_ref, rtol=0, atol=1e-12)
    eng.compute(moved + 0.01, *args)  # within skin/2 of the new plan: no re-plan
    assert eng.rebuilds == 1
