"""TilePlan: each tile is exactly the sub-graph its owned atoms' energies read (checked by a breadth-first search)."""

from __future__ import annotations

import hypothesis
import hypothesis.strategies as st
import numpy as np
import pytest

from nvalchemi_jaxbridge.layout import HaloPlan
from nvalchemi_jaxbridge.mlip import EdgePlan
from nvalchemi_jaxbridge.mlip.tiles import TilePlan, bisect, check_tiles
from tests.layout.test_halo_plan import systems


def _hops(edges: np.ndarray, start: set[int], n: int) -> set[int]:
    """Rows within `n` hops of `start`, walking from receivers to their senders (one edge at a time)."""
    seen, frontier = set(start), set(start)
    for _ in range(n):
        frontier = {int(s) for s, r in edges if int(r) in frontier} - seen
        seen |= frontier
    return seen


@hypothesis.settings(max_examples=25, deadline=None, derandomize=True)
@hypothesis.given(systems(), st.integers(1, 3), st.integers(1, 9))
def test_each_tile_is_the_sub_graph_its_owned_atoms_read(system, n_layers, n_tiles):
    positions, cell, periodic, cutoff, skin, n_devices, grid = system
    plan = HaloPlan.build(positions, cell, periodic=periodic, cutoff=n_layers * cutoff, skin=skin,
                          n_devices=n_devices, grid=grid, self_images=False)
    edge_plan = EdgePlan.build(plan, positions, cutoff=cutoff, receivers="all",
                               receiver_reach=(n_layers - 1) * cutoff + skin)
    tiles = TilePlan.build(plan, edge_plan, positions, n_tiles=n_tiles, n_layers=n_layers)
    assert tiles.rows.shape[:2] == (n_devices, n_tiles)
    assert tiles.row_capacity > tiles.n_rows.max() and tiles.edge_capacity >= tiles.n_edges.max()
    for d in range(n_devices):
        block = edge_plan.edges[d, : edge_plan.n_edges[d]]
        owned_seen = []
        for t in range(n_tiles):
            n_own, n_rows, n_e = int(tiles.n_owned[d, t]), int(tiles.n_rows[d, t]), int(tiles.n_edges[d, t])
            rows = tiles.rows[d, t]
            owned = set(rows[:n_own].tolist())
            assert all(r < plan.n_owned[d] for r in owned)
            owned_seen += rows[:n_own].tolist()
            receivers = _hops(block, owned, n_layers - 1)
            want_edges = {i for i, (_, r) in enumerate(block) if int(r) in receivers}
            assert set(tiles.edge_ids[d, t, :n_e].tolist()) == want_edges
            assert set(rows[:n_rows].tolist()) == receivers | {int(block[i, 0]) for i in want_edges}
            assert len(set(rows[:n_rows].tolist())) == n_rows  # a row once
            local = tiles.edges[d, t, :n_e]  # the same edges, in tile rows
            np.testing.assert_array_equal(rows[local], block[tiles.edge_ids[d, t, :n_e]])
            assert np.all(rows[n_rows:] >= plan.n_padded[d])  # padding slots name the block's padding rows
            pad = tiles.edges[d, t, n_e:]
            assert np.all(pad[:, 0] == pad[:, 1]) and np.all(pad[:, 0] >= n_rows)
        assert sorted(owned_seen) == list(range(int(plan.n_owned[d])))  # the tiles share out the owned atoms


@hypothesis.settings(max_examples=40, deadline=None, derandomize=True)
@hypothesis.given(st.integers(0, 60), st.integers(1, 30), st.integers(0, 2**31 - 1))
def test_bisection_shares_out_every_point_evenly(n, parts, seed):
    points = np.random.default_rng(seed).uniform(0.0, 10.0, (n, 3))
    groups = bisect(points, parts)
    assert len(groups) == parts
    assert sorted(np.concatenate(groups).tolist()) == list(range(n))
    sizes = [len(g) for g in groups]
    assert max(sizes) - min(sizes) <= max(1, int(np.ceil(np.log2(parts))))


def test_kept_capacities_hold_and_grow_when_a_tile_outgrows_them():
    rng = np.random.default_rng(0)
    cell = np.eye(3) * 12.0
    positions = rng.uniform(0, 12.0, (150, 3))
    plan = HaloPlan.build(positions, cell, cutoff=6.0, skin=0.5, n_devices=2, self_images=False)
    edges = EdgePlan.build(plan, positions, cutoff=3.0, receivers="all", receiver_reach=3.5)
    tiles = TilePlan.build(plan, edges, positions, n_tiles=4, n_layers=2)
    again = tiles.rebuild(plan, edges, positions, n_layers=2)
    assert (again.row_capacity, again.edge_capacity, again.growth) == (tiles.row_capacity, tiles.edge_capacity, ())
    small = TilePlan.build(plan, edges, positions, n_tiles=8, n_layers=2)  # smaller tiles, smaller capacities
    grown = TilePlan.build(plan, edges, positions, n_tiles=4, n_layers=2, keep=small)  # larger tiles
    assert grown.edge_capacity >= grown.n_edges.max() > small.edge_capacity
    assert grown.row_capacity > grown.n_rows.max()
    assert "tile_edge_capacity" in {g.name for g in grown.growth}


@pytest.mark.parametrize("tiles,exchange,match", [
    (0, "deep_halo", "int >= 1"), (2.0, "deep_halo", "int >= 1"), (True, "deep_halo", "int >= 1"),
    (2, "per_layer", "exchange='deep_halo'")])
def test_bad_tiles_are_refused_with_the_fix(tiles, exchange, match):
    with pytest.raises(ValueError, match=match):
        check_tiles(tiles, exchange, "DistributedMLIP")
