"""The memory model: a probe on random blocks predicts the peak of real tiles; tiles="auto" fits a budget, exactly."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from nvalchemi_jaxbridge.layout.budget import LayoutBudgetError
from nvalchemi_jaxbridge.mlip import DistributedMLIP
from nvalchemi_jaxbridge.mlip.memory import tables_budget
from nvalchemi_jaxbridge.mlip.memory_probe import evaluation_peak, probe_cost
from tests.mlip import cases
from tests.mlip.test_jax_door import check, expected


def _tile_block(state, wrapper, atoms, d: int, t: int) -> tuple[torch.Tensor, ...]:
    """Tile `t` of device `d` as the arrays its stage op sees, real rows and edges only (built on the host)."""
    plan, tiles, hr = state.plan, state.tiles, state.plan.halo_rows
    pos = plan.to_halo(atoms.positions, positions=True).reshape(plan.n_devices, hr, 3)[d]
    attrs = plan.to_halo(wrapper.node_attrs(atoms.numbers)).reshape(plan.n_devices, hr, -1)[d]
    n, e = int(tiles.n_rows[d, t]), int(tiles.n_edges[d, t])
    rows, ids = tiles.rows[d, t, :n], tiles.edge_ids[d, t, :e]
    f = dict(dtype=wrapper.dtype)
    return (torch.as_tensor(pos[rows], **f), torch.as_tensor(attrs[rows], **f),
            torch.as_tensor(tiles.edges[d, t, :e]), torch.as_tensor(state.edges.shift[d, ids], **f))


def test_the_probe_predicts_the_peak_of_real_tiles_at_three_sizes():
    wrapper = cases.wrapper("mpnn")
    cost = probe_cost(wrapper, cases.structure("cubic").numbers)
    seen = []
    for structure, n_tiles in (("small", 2), ("slab", 8), ("cubic", 2)):  # three tile sizes
        atoms = cases.structure(structure)
        model = DistributedMLIP(wrapper, n_devices=1, exchange="deep_halo", tiles=n_tiles)
        state = model.prepare(atoms.positions, atoms.numbers, atoms.cell.array, atoms.pbc)
        t = int(np.argmax(state.tiles.n_edges[0]))
        block = _tile_block(state, wrapper, atoms, 0, t)
        measured = evaluation_peak(wrapper, block)
        predicted = float(cost.predict(len(block[0]), len(block[2])))
        seen.append(len(block[2]))
        assert abs(predicted - measured) <= 0.1 * measured, (n_tiles, predicted, measured)
    assert max(seen) > 2 * min(seen)  # the three sizes differ


def test_auto_tiles_fit_the_budget_and_give_one_devices_numbers(caplog):
    wrapper, atoms = cases.wrapper("mpnn"), cases.structure("triclinic")
    whole = DistributedMLIP(wrapper, n_devices=2, exchange="deep_halo", tiles="auto")
    with caplog.at_level(logging.INFO, logger="nvalchemi_jaxbridge.mlip.tile_choice"):
        state0 = whole.prepare(atoms.positions, atoms.numbers, atoms.cell.array, atoms.pbc)
    assert whole.tile_choice.tiles == 1 and "1 tile(s) per device" in caplog.text  # half the host's memory: fits
    tables = tables_budget(whole.budget, 0).cost(state0.plan.n_padded, state0.edges.n_edges).max()
    budget = tables + whole.tile_choice.predicted_bytes / 3  # the tables and a third of the block in one go
    model = DistributedMLIP(wrapper, n_devices=2, exchange="deep_halo", tiles="auto", memory_budget=budget)
    model.model_cost = whole.model_cost  # the same model, measured once
    state = model.prepare(atoms.positions, atoms.numbers, atoms.cell.array, atoms.pbc)
    choice = model.tile_choice
    assert choice.tiles >= 3 and choice.predicted_bytes <= budget - tables and state.tiles.n_tiles == choice.tiles
    assert model.model_cost.predict(state.tiles.n_rows, state.tiles.n_edges).max() <= budget - tables
    check(model.evaluate(atoms.positions, atoms.numbers, atoms.cell.array, atoms.pbc, state=state),
          expected("mpnn", "triclinic"))
    tiny = DistributedMLIP(wrapper, n_devices=2, exchange="deep_halo", tiles="auto",
                           memory_budget=1.5 * tables)  # the tables fit (also as estimated), no tile beside them
    tiny.model_cost = whole.model_cost
    with pytest.raises(LayoutBudgetError, match="no tile count fits the memory budget"):
        tiny.prepare(atoms.positions, atoms.numbers, atoms.cell.array, atoms.pbc)


def test_explicit_tiles_too_large_for_the_budget_are_refused_before_any_evaluation():
    wrapper, atoms = cases.wrapper("mpnn"), cases.structure("triclinic")
    model = DistributedMLIP(wrapper, n_devices=2, exchange="deep_halo", tiles=2, memory_budget=2e7)
    with pytest.raises(LayoutBudgetError, match=r"largest tile, tile \d of device \d, of 2 tiles.*tiles=4"):
        model.prepare(atoms.positions, atoms.numbers, atoms.cell.array, atoms.pbc)
