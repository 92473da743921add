"""The per-layer tiles prototype (`benchmarks.perlayer`) gives the untiled answer: MACE and the MPNN, float64,
1, 2 and 5 tiles, cubic and triclinic cells, against each model's own forward on the whole system with
ASE's neighbour list (`tests.mlip._reference`: no stages, no tiles, no checkpoints)."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

from benchmarks import perlayer
from tests.mlip import cases
from tests.mlip._reference import alloy, mace_reference, reference


@functools.cache
def _atoms(cell: str):
    return alloy(reps=(3, 3, 3), triclinic=cell == "triclinic")  # 108 atoms, 11 A: MACE's 5 A reaches images


@functools.cache
def _want(model: str, cell: str) -> dict:
    w, atoms = cases.wrapper(model), _atoms(cell)
    if model == "mace":
        return mace_reference(w.model, atoms)
    return reference(w.model.forward, atoms, w.cutoff, w.node_attrs(atoms.numbers))


@functools.cache
def _system(model: str, cell: str) -> perlayer.System:
    a = _atoms(cell)
    return perlayer.system(cases.wrapper(model), a.positions, a.numbers, a.cell.array, a.pbc)


@pytest.mark.parametrize("cell", ["cubic", "triclinic"])
@pytest.mark.parametrize("model", ["mpnn", "mace"])
@pytest.mark.parametrize("n_tiles", [1, 2, 5])
def test_per_layer_tiles_match_the_whole_system(model, cell, n_tiles):
    w, s, want = cases.wrapper(model), _system(model, cell), _want(model, cell)
    tiles = perlayer.layer_tiles(s, n_tiles)
    assert tiles.n_tiles == n_tiles and sorted(torch.cat([r[:k] for r, k in zip(tiles.rows, tiles.n_receivers)])
                                               .tolist()) == list(range(len(s.wrapped)))  # each atom in one tile
    assert sum(e.shape[1] for e in tiles.edges) == s.edge_index.shape[1]  # each edge in the tile of its receiver
    energy, node_e, forces = perlayer.energy_and_forces(w, s, _atoms(cell).positions, tiles)
    assert abs(float(energy) - want["energy"]) <= 1e-9 * abs(want["energy"])
    np.testing.assert_allclose(node_e.numpy(), want["atomic_energies"], rtol=0, atol=1e-9)
    np.testing.assert_allclose(forces.numpy(), want["forces"], rtol=0, atol=1e-8)
    assert np.abs(want["forces"]).max() > 1e-3  # forces that say something


def test_tiles_read_one_cutoff_only():
    """A tile's rows are its atoms and the senders of their edges: fewer than the deep halo's two cutoffs."""
    s = perlayer.system(cases.wrapper("mpnn"), *(lambda a: (a.positions, a.numbers, a.cell.array, a.pbc))(
        alloy(reps=(6, 3, 3))))  # 648 atoms, 22.5 A long: 2 tiles of 11 A, a 4 A cutoff each side
    tiles = perlayer.layer_tiles(s, 2)
    ei = s.edge_index.numpy()
    for r, k, e, ids in zip(tiles.rows, tiles.n_receivers, tiles.edges, tiles.edge_ids):
        r = r.numpy()
        assert set(r[k:]) == set(ei[0, ids.numpy()]) - set(r[:k])  # exactly the outside senders
        assert (r[e[0].numpy()] == ei[0, ids.numpy()]).all() and (r[e[1].numpy()] == ei[1, ids.numpy()]).all()
        assert (e[1].numpy() < k).all() and len(r) < 0.9 * len(s.wrapped)


def test_bad_tile_count_names_the_fix():
    with pytest.raises(ValueError, match=r"n_tiles must be an int >= 1, got 0"):
        perlayer.layer_tiles(_system("mpnn", "cubic"), 0)
