"""Tiles on the PyTorch door, one rank (this process): a rank's block evaluated tile by tile gives the door's numbers
without tiles (energy 1e-9 relative, forces 1e-8 eV/Å, stress 1e-9 eV/Å³, atomic energies 1e-9 eV; MPNN, float64).

Two ranks run in the front door's shared job (tests/mlip/torch_worker.py, cases with a tile count, compared in
tests/mlip/test_torch_door.py). The weighted cotangent (not an energy) is checked against the model's own forward
and autograd on the whole block.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nvalchemi_jaxbridge.layout.budget import LayoutBudgetError
from nvalchemi_jaxbridge.mlip.memory import tables_budget
from nvalchemi_jaxbridge.mlip.memory_probe import ModelCost
from nvalchemi_jaxbridge.mlip.protocol import BlockGraph
from nvalchemi_jaxbridge.mlip import torch_model
from nvalchemi_jaxbridge.mlip.torch_model import TorchDistributedMLIP
from nvalchemi_jaxbridge.mlip.torch_tiles import rank_tiles, tiled_node_energies
from tests.mlip import cases
from tests.mlip._reference import alloy


SMALL = {"tiny": dict(reps=(2, 2, 2), seed=3),  # 32 atoms: 40 tiles leave some without atoms
         "rod": dict(reps=(12, 2, 2), seed=2)}  # 192 atoms, 45 Å long: on one rank a tile reads less than the block


def _atoms(structure: str):
    return alloy(**SMALL[structure]) if structure in SMALL else cases.structure(structure)


def _evaluate(structure: str, **kwargs) -> tuple[dict, object]:
    atoms = _atoms(structure)
    dm = TorchDistributedMLIP(cases.wrapper("mpnn"), exchange="deep_halo", **kwargs)
    state = dm.prepare(atoms.positions, atoms.numbers, atoms.cell.array, atoms.pbc)
    return dm.evaluate(atoms.positions, atoms.numbers, atoms.cell.array, atoms.pbc, state=state), state


def check_same(got: dict, want: dict) -> None:
    """The acceptance's tolerances between two results of the door."""
    assert abs(got["energy"] - want["energy"]) <= 1e-9 * abs(want["energy"])
    np.testing.assert_allclose(got["forces"], want["forces"], rtol=0, atol=1e-8)
    np.testing.assert_allclose(got["stress"], want["stress"], rtol=0, atol=1e-9)
    np.testing.assert_allclose(got["atomic_energies"], want["atomic_energies"], rtol=0, atol=1e-9)


@pytest.mark.parametrize("structure,tiles", [("triclinic", 3), ("rod", 4), ("tiny", 40)])
def test_tiles_give_the_doors_numbers_without_tiles(structure, tiles):
    want, _ = _evaluate(structure)
    got, state = _evaluate(structure, tiles=tiles)
    check_same(got, want)
    assert state.tiles.n_tiles == tiles
    if structure == "tiny":
        assert (state.tiles.n_owned == 0).any()
    if structure == "rod":
        assert state.tiles.n_edges.max() < 0.7 * state.edges.n_edges[0]
    assert np.abs(want["forces"]).max() > 1e-3  # not a vanishing comparison


def _block(dm: TorchDistributedMLIP, state) -> tuple[torch.Tensor, ...]:
    """Device 0's block as the door builds it (positions with the parked row, attributes, edges, shifts)."""
    plan, e, atoms = state.plan, state.edges, _atoms("triclinic")
    n, hr, n_e = int(plan.n_padded[0]), plan.halo_rows, int(e.n_edges[0])
    pos = plan.to_halo(atoms.positions, positions=True).reshape(1, hr, 3)[0, : n + 1]
    attrs = plan.to_halo(dm.wrapper.node_attrs(atoms.numbers)).reshape(1, hr, -1)[0, : n + 1]
    return (torch.tensor(pos, requires_grad=True), torch.tensor(attrs), torch.as_tensor(e.edges[0, :n_e].T).long(),
            torch.tensor(e.shift[0, :n_e], requires_grad=True))


@pytest.mark.parametrize("weighted", [False, True])
def test_a_weighted_sum_of_atomic_energies_differentiates_as_the_whole_block(weighted):
    # a cotangent that differs between atoms runs each tile's backward again with it; a uniform one scales
    dm = TorchDistributedMLIP(cases.wrapper("mpnn"), exchange="deep_halo", tiles=4)
    atoms = _atoms("triclinic")
    state = dm.prepare(atoms.positions, atoms.numbers, atoms.cell.array, atoms.pbc)
    pos, attrs, ei, shift = _block(dm, state)
    n_own = int(state.plan.n_owned[0])
    keep = dm._kept(pos, ei, shift)
    w = torch.tensor(np.random.default_rng(0).normal(size=n_own)) if weighted else torch.full((n_own,), 0.7)
    node = dm.model(BlockGraph(pos, attrs, ei[:, keep].contiguous(), shift[keep], None))
    want = torch.autograd.grad((node[:n_own] * w).sum(), (pos, shift))
    tiles = rank_tiles(state.tiles, 0, int(state.plan.n_padded[0]), torch.device("cpu"))
    tiled = tiled_node_energies(dm.model, pos, attrs, shift, keep, tiles)
    got = torch.autograd.grad((tiled[:n_own] * w).sum(), (pos, shift))
    np.testing.assert_allclose(tiled[:n_own].detach(), node[:n_own].detach(), rtol=0, atol=1e-12)
    for g, h in zip(got, want):
        np.testing.assert_allclose(g, h, rtol=0, atol=1e-10)
    assert want[0].abs().max() > 1e-3


def test_update_rebuilds_the_tiles_with_the_block():
    atoms = _atoms("rod")
    moved = atoms.positions + np.random.default_rng(4).normal(scale=0.3, size=atoms.positions.shape)
    plain = TorchDistributedMLIP(cases.wrapper("mpnn"), exchange="deep_halo")
    want = plain.evaluate(moved, atoms.numbers, atoms.cell.array, atoms.pbc)
    dm = TorchDistributedMLIP(cases.wrapper("mpnn"), exchange="deep_halo", tiles=3)
    state = dm.prepare(atoms.positions, atoms.numbers, atoms.cell.array, atoms.pbc)
    again = dm.update(state, moved)
    assert again is not state and again.tiles is not state.tiles and again.tiles.n_tiles == 3
    check_same(dm.evaluate(moved, atoms.numbers, atoms.cell.array, atoms.pbc, state=again), want)


def test_auto_tiles_fit_the_budget_and_give_the_doors_numbers(monkeypatch):
    wrapper, atoms = cases.wrapper("mpnn"), _atoms("rod")
    want, _ = _evaluate("rod")
    probed = []

    def probe(w, numbers, device):  # the MPNN's cost as the probe measures it (~15 s here; test_tile_choice.py)
        probed.append((w, sorted(numbers), device))
        return ModelCost(bytes_per_row=1424.0, bytes_per_edge=2275.0, fixed=336.0)

    monkeypatch.setattr(torch_model, "probe_cost", probe)
    whole = TorchDistributedMLIP(wrapper, exchange="deep_halo", tiles="auto")
    state0 = whole.prepare(atoms.positions, atoms.numbers, atoms.cell.array, atoms.pbc)
    assert probed == [(wrapper, [29, 79], torch.device("cpu"))]  # measured once, on the rank's device
    assert whole.tile_choice.tiles == 1 and state0.tiles is None  # half the host's memory: the block fits
    tables = tables_budget(whole.budget, 0).cost(state0.plan.n_padded, state0.edges.n_edges).max()
    budget = tables + 0.75 * whole.tile_choice.predicted_bytes  # the tables and 3/4 of the block in one go
    dm = TorchDistributedMLIP(wrapper, exchange="deep_halo", tiles="auto", memory_budget=budget)
    dm.model_cost = whole.model_cost  # the same model, measured once
    state = dm.prepare(atoms.positions, atoms.numbers, atoms.cell.array, atoms.pbc)
    assert dm.tile_choice.tiles >= 2 and state.tiles.n_tiles == dm.tile_choice.tiles
    assert dm.model_cost.predict(state.tiles.n_rows, state.tiles.n_edges).max() <= budget - tables
    check_same(dm.evaluate(atoms.positions, atoms.numbers, atoms.cell.array, atoms.pbc, state=state), want)


def test_tiles_are_refused_without_the_deep_halo_or_past_the_budget():
    w, atoms = cases.wrapper("mpnn"), _atoms("triclinic")
    with pytest.raises(ValueError, match=r"TorchDistributedMLIP: tiles=3 evaluates each tile.*exchange='deep_halo'"):
        TorchDistributedMLIP(w, tiles=3)
    with pytest.raises(ValueError, match=r"TorchDistributedMLIP: tiles must be an int >= 1"):
        TorchDistributedMLIP(w, exchange="deep_halo", tiles=0)
    dm = TorchDistributedMLIP(w, exchange="deep_halo", tiles=2, memory_budget=2e7)
    with pytest.raises(LayoutBudgetError, match=r"largest tile, tile \d of device 0, of 2 tiles.*tiles=4"):
        dm.prepare(atoms.positions, atoms.numbers, atoms.cell.array, atoms.pbc)


def _peak_bytes(run) -> float:
    """Peak bytes torch allocates on the CPU during `run()` (its profiler's allocation events, summed in order)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    steps = sorted((e.time_range.start, e.self_cpu_memory_usage) for e in prof.events())
    return float(np.cumsum([b for _, b in steps]).max())


def test_tiles_lower_the_peak_memory_of_an_evaluation():
    # one tile's intermediates alive at a time: 4 tiles of a 45 Å rod (each reads ~half of the block) measured
    # 0.52 of the block's peak (MPNN, float64, 6,132 edges)
    atoms = alloy(reps=(16, 2, 2), seed=2)
    peaks = []
    for tiles in (1, 4):
        dm = TorchDistributedMLIP(cases.wrapper("mpnn"), exchange="deep_halo", tiles=tiles)
        state = dm.prepare(atoms.positions, atoms.numbers, atoms.cell.array, atoms.pbc)
        dm.evaluate(atoms.positions, atoms.numbers, atoms.cell.array, atoms.pbc, state=state)  # uploads, warm-up
        peaks.append(_peak_bytes(lambda: dm.evaluate(atoms.positions, atoms.numbers, atoms.cell.array, atoms.pbc,
                                                     state=state)))
    assert peaks[1] < 0.7 * peaks[0], peaks


@pytest.mark.parametrize("door", ["DistributedMLIP", "TorchDistributedMLIP"])
def test_an_mliap_model_refuses_tiles_and_a_budget_on_either_door(door):
    from nvalchemi_jaxbridge import mlip
    from nvalchemi_jaxbridge.demo.mliap_models import MLIAPLennardJones

    cls = getattr(mlip, door)
    with pytest.raises(ValueError, match=rf"{door}: tiles=2 with an ML-IAP model, which runs its own forward"):
        cls(MLIAPLennardJones(), tiles=2)
    with pytest.raises(ValueError, match=rf"{door}: memory_budget=8000000000.0 with an ML-IAP model"):
        cls(MLIAPLennardJones(), memory_budget=8e9)
    assert type(cls(MLIAPLennardJones(), tiles=1, memory_budget=None)).__name__ in ("JaxMLIAP", "TorchMLIAP")
