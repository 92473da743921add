"""Tiles on the JAX door: a device's block evaluated tile by tile gives one device's numbers (and MD trajectory).

References share no code with the bridge (tests/mlip/_reference.py): the MPNN on the whole periodic system
with ASE's neighbour list, MACE through its own forward. Tolerances are the acceptance's: energy 1e-9
relative, forces 1e-8 eV/Å, stress 1e-9 eV/Å³ (and atomic energies 1e-9 eV).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nvalchemi_jaxbridge.mlip import DistributedMLIP
from nvalchemi_jaxbridge.mlip.dynamics import nve
from tests.mlip import cases
from tests.mlip.test_jax_door import check, expected

# Every tile count (2, 4 or 8, 27), device count (1, 2, 8) and cell (cubic, triclinic, slab) for each model
# ("small" is triclinic, 108 atoms: MACE's 27 tiles each read nearly all of it); "half" leaves devices, and so all
# their tiles, without atoms.
CASES = [("mpnn", "cubic", 1, 27), ("mpnn", "triclinic", 2, 8), ("mpnn", "slab", 8, 2), ("mpnn", "half", 8, 27),
         ("mace", "small", 1, 27), ("mace", "slab", 2, 4), ("mace", "cubic", 8, 2)]


@pytest.mark.parametrize("name,structure,n_devices,tiles", CASES)
def test_tiles_give_one_devices_numbers(name, structure, n_devices, tiles):
    atoms = cases.structure(structure)
    model = DistributedMLIP(cases.wrapper(name), n_devices=n_devices, exchange="deep_halo", tiles=tiles)
    state = model.prepare(atoms.positions, atoms.numbers, atoms.cell.array, atoms.pbc)
    out = model.evaluate(atoms.positions, atoms.numbers, atoms.cell.array, atoms.pbc, state=state)
    check(out, expected(name, structure))
    rows = state.rows_per_device()
    assert all(r["tiles"] == tiles for r in rows)
    if structure == "half":  # some tiles own no atom
        assert (state.tiles.n_owned == 0).any()
    if n_devices == 1 and tiles > 1:  # a tile reads less than the block
        assert state.tiles.n_edges.min() <= state.edges.n_edges[0]


def test_weighted_atomic_energies_differentiate_as_without_tiles():
    # a cotangent that differs between atoms (not an energy) runs each tile's backward again with it; the tiles
    # are per device, so one device shows it (no collectives between CPU devices: a quarter of the time)
    atoms = cases.structure("triclinic")
    w = cases.wrapper("mpnn")
    grads = []
    for tiles in (1, 5):
        model = DistributedMLIP(w, n_devices=1, exchange="deep_halo", tiles=tiles)
        state = model.prepare(atoms.positions, atoms.numbers, atoms.cell.array, atoms.pbc)
        pos = state.cs.owned(np.asarray(atoms.positions), positions=True)
        weights = state.cs.owned(np.random.default_rng(0).normal(size=len(atoms)))

        def weighted(p, s, model=model, state=state, weights=weights):
            return jnp.sum(model.energy_fn(state, p, s)[1] * weights)

        g_pos, g_strain = jax.grad(weighted, argnums=(0, 1))(pos, jnp.zeros((3, 3)))
        grads.append((state.cs.to_global(g_pos), np.asarray(g_strain)))
    np.testing.assert_allclose(grads[1][0], grads[0][0], rtol=0, atol=1e-10)
    np.testing.assert_allclose(grads[1][1], grads[0][1], rtol=0, atol=1e-10)
    assert np.abs(grads[0][0]).max() > 1e-3  # not a vanishing derivative


@pytest.mark.slow
def test_md_with_tiles_follows_the_one_device_trajectory():
    w, atoms, masses, v, want = cases.mpnn_nve_reference()
    model = DistributedMLIP(w, n_devices=1, exchange="deep_halo", skin=1.0, tiles=3)
    out = nve(model, atoms.positions, v, masses, atoms.numbers, atoms.cell.array, atoms.pbc, steps=100, dt=1.0,
              check_every=25)
    assert out["rebuilds"] >= 2  # tiles rebuilt with the block
    assert sorted(out["positions"])[-1] == 100
    for step, x in out["positions"].items():
        np.testing.assert_allclose(x, want[step], rtol=0, atol=1e-8, err_msg=f"step {step}")
