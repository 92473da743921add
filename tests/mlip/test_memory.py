"""Bounded memory at the model level: the skewed cell's deep halo is exact in bounded memory, and a layout
over its budget is refused before it is built, with the numbers and the fix.

The case: 32 atoms in the cell [[7.5,0,0],[7,2.5,0],[3,2,7.5]], `exchange="deep_halo"` with the
3-layer MPNN, built ~850,000 edges per device (the model's own graph has ~1,900) and was killed at
20-24 GB. Two causes: the ghost search kept every image in a fractional box (5x the images within
reach in this cell), and every ghost row received edges, where only rows within
`(n_layers - 1) * cutoff + skin` of a device's own atoms feed its energy.
"""

from __future__ import annotations

import numpy as np
import pytest
from ase import Atoms

from nvalchemi_jaxbridge.layout import HaloPlan
from nvalchemi_jaxbridge.layout.budget import LayoutBudgetError, MemoryBudget
from nvalchemi_jaxbridge.mlip import DistributedMLIP, EdgePlan, MPNNWrapper
from tests.mlip import cases
from tests.mlip._reference import reference

SKEWED = np.array([[7.5, 0, 0], [7, 2.5, 0], [3, 2, 7.5]])


@pytest.fixture(scope="module")
def skewed():
    rng = np.random.default_rng(0)
    atoms = Atoms(numbers=rng.choice([29, 79], 32), scaled_positions=rng.uniform(0, 1, (32, 3)), cell=SKEWED,
                  pbc=True)
    return atoms


def _run(wrapper, atoms, **kw):
    dm = DistributedMLIP(wrapper, **kw)
    state = dm.prepare(atoms.positions, atoms.numbers, atoms.cell.array, atoms.pbc)
    return dm.evaluate(atoms.positions, atoms.numbers, atoms.cell.array, atoms.pbc, state=state), state


def test_the_skewed_cells_deep_halo_is_exact_in_bounded_memory(skewed):
    w = cases.wrapper("mpnn")
    want = reference(w.model, skewed, w.cutoff, w.node_attrs(skewed.numbers))  # MPNN.forward, ASE's list
    deep, state = _run(w, skewed, n_devices=2, exchange="deep_halo")
    per_layer, _ = _run(w, skewed, n_devices=2)
    for got in (deep, per_layer):
        np.testing.assert_allclose(got["energy"], want["energy"], rtol=1e-12)
        np.testing.assert_allclose(got["forces"], want["forces"], atol=1e-9)
        np.testing.assert_allclose(got["stress"], want["stress"], atol=1e-10)
    counts = state.rows_per_device()
    assert max(c["edges"] for c in counts) < 80_000, counts  # ~850,000 before
    assert max(c["owned"] + c["ghost"] for c in counts) < 3_000, counts  # ~8,500 before


def test_deep_halo_receivers_are_the_rows_within_the_models_reach_of_owned_atoms(skewed):
    pos, cell = skewed.positions, skewed.cell.array
    plan = HaloPlan.build(pos, cell, cutoff=12.0, skin=0.5, n_devices=2, self_images=False)
    every = EdgePlan.build(plan, pos, cutoff=4.0, receivers="all")
    near = EdgePlan.build(plan, pos, cutoff=4.0, receivers="all", receiver_reach=8.5)
    halo = plan.to_halo(pos, positions=True).reshape(2, plan.halo_rows, 3)
    for d in range(2):
        n_own, n_real = int(plan.n_owned[d]), int(plan.n_padded[d])
        dist = np.linalg.norm(halo[d, :n_real, None] - halo[d, None, :n_own], axis=2).min(axis=1)
        rows = set(np.flatnonzero(dist <= 8.5).tolist())

        def edges(e, rows=None):
            k = int(e.n_edges[d])
            table = np.concatenate([e.edges[d, :k], np.round(e.shift[d, :k], 9)], axis=1).tolist()
            return {tuple(t) for t in table if rows is None or int(t[1]) in rows}

        assert edges(near) == edges(every, rows)
        assert int(near.n_edges[d]) < int(every.n_edges[d]) / 2


def test_a_layout_over_its_budget_is_refused_by_the_estimate_naming_per_layer_exchange(skewed):
    w = cases.wrapper("mpnn")
    budget = 40e6  # bytes per device: the per-layer layout fits, the deep halo's (~100,000 edges) does not
    dm = DistributedMLIP(w, n_devices=8, exchange="deep_halo", memory_budget=budget)
    with pytest.raises(LayoutBudgetError, match=r"mpnn \(deep_halo, 8 devices\): the layout needs [\d,]+ rows and "
                       r"[\d,]+ edges on one device \(estimated from the cell.*above the memory budget of 0\.04 GB "
                       r"per device; nothing was allocated\. Fix: use exchange='per_layer'.*more devices.*"
                       r"memory_budget="):
        dm.prepare(skewed.positions, skewed.numbers, skewed.cell.array)
    state = DistributedMLIP(w, n_devices=8, memory_budget=budget).prepare(
        skewed.positions, skewed.numbers, skewed.cell.array)
    assert state.edges.n_edges.sum() > 0


def test_edges_over_the_budget_are_refused_when_counted_before_they_are_listed(skewed):
    pos, cell = skewed.positions, skewed.cell.array
    plan = HaloPlan.build(pos, cell, cutoff=12.0, skin=0.5, n_devices=2, self_images=False)
    rows = int(plan.n_padded.max())
    budget = MemoryBudget(2048 * (rows + 1000), fix="FIX-HERE")  # the rows and 1,000 edges
    with pytest.raises(LayoutBudgetError, match=r"EdgePlan\.build: the layout needs [\d,]+ rows and [\d,]+ edges "
                       r"on one device \(counted; device \d, reach 4\.5 Å\).*Fix: FIX-HERE"):
        EdgePlan.build(plan, pos, cutoff=4.0, receivers="all", receiver_reach=8.5, budget=budget)


def test_the_budget_argument_is_checked_and_defaults_to_half_of_each_devices_memory():
    w = cases.wrapper("mpnn")
    for bad in (0, -1.0, "1GB", True):
        with pytest.raises(ValueError, match="memory_budget must be a number of bytes per device > 0"):
            DistributedMLIP(w, n_devices=2, memory_budget=bad)
    from nvalchemi_jaxbridge.layout.budget import host_available_bytes

    dm = DistributedMLIP(w, n_devices=4)
    assert 0 < dm.budget.bytes <= 0.5 * host_available_bytes() / 4 * 1.5  # its share of the host (CPU devices)
    assert "per_layer" not in dm.budget.fix and "the default is half" in dm.budget.fix
    auto = DistributedMLIP(w, n_devices=4, exchange="deep_halo", tiles="auto")  # a measured cost: a larger share
    assert auto.budget.bytes == pytest.approx(dm.budget.bytes * 0.8 / 0.5, rel=0.2)
    assert "the default is 80% of each device's memory" in auto.budget.fix
    assert MPNNWrapper is type(w)
