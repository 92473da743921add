"""The block-graph protocol: receiver rows, and wrappers that compute node-wise work on them alone."""

from __future__ import annotations

import dataclasses

import hypothesis
import hypothesis.strategies as st
import numpy as np
import pytest
import torch

from nvalchemi_jaxbridge.mlip import BlockGraph
from tests.mlip._reference import alloy, graph, reference


def _graph(n_rows: int, n_receivers: int | None) -> BlockGraph:
    f = torch.float64
    return BlockGraph(torch.zeros((n_rows, 3), dtype=f), torch.zeros((n_rows, 2), dtype=f),
                      torch.zeros((2, 0), dtype=torch.int64), torch.zeros((0, 3), dtype=f), n_receivers)


@hypothesis.settings(max_examples=40, deadline=None, derandomize=True)
@hypothesis.given(n_rows=st.integers(0, 30), frac=st.floats(0, 1), trailing=st.sampled_from([(), (1,), (3, 2)]),
                  seed=st.integers(0, 99))
def test_to_rows_of_the_receiver_slice_keeps_the_receivers_and_zeroes_the_rest(n_rows, frac, trailing, seed):
    r = int(round(frac * n_rows))
    g = _graph(n_rows, r)
    x = torch.from_numpy(np.random.default_rng(seed).normal(size=(n_rows, *trailing)))
    y = g.to_rows(g.receiver_slice(x))
    assert g.receiver_rows == r and y.shape == x.shape
    assert torch.equal(y[:r], x[:r]) and not y[r:].any()


@hypothesis.settings(max_examples=30, deadline=None, derandomize=True)
@hypothesis.given(n_edges=st.integers(0, 40), seed=st.integers(0, 99))
def test_a_stage_sees_its_edges_as_contiguous_sender_and_receiver_rows(n_edges, seed):
    from nvalchemi_jaxbridge.mlip.stages import block_graph

    edges = torch.from_numpy(np.random.default_rng(seed).integers(0, 50, size=(n_edges, 2)).astype(np.int32))
    f = torch.float64
    g = block_graph(torch.zeros((50, 3), dtype=f), torch.zeros((50, 2), dtype=f), edges, torch.zeros((n_edges, 3), dtype=f))
    assert g.edge_index.dtype == torch.int64 and g.edge_index.shape == (2, n_edges)
    assert g.senders.is_contiguous() and g.receivers.is_contiguous()  # torch's vectorised gathers need this
    assert g.senders.tolist() == edges[:, 0].tolist() and g.receivers.tolist() == edges[:, 1].tolist()


def test_every_row_receives_without_a_count():
    g = _graph(7, None)
    x = torch.arange(7.0)
    assert g.receiver_rows == 7
    assert torch.equal(g.to_rows(g.receiver_slice(x)), x)


@pytest.mark.parametrize("bad", [-1, 8])
def test_a_receiver_count_outside_the_block_is_refused(bad):
    with pytest.raises(ValueError, match=r"n_receivers=-?\d+ must lie in \[0, 7\]"):
        _graph(7, bad)


def test_to_rows_refuses_more_rows_than_the_block():
    with pytest.raises(ValueError, match="more than the block's 3"):
        _graph(3, 2).to_rows(torch.zeros(4))


def test_mace_layers_on_the_receiver_rows_alone_agree_with_every_row():
    """MACE's product basis and readout run on the receivers only: same rows as on the whole block."""
    from nvalchemi_jaxbridge.mlip.mace import MACEWrapper, random_mace

    w = MACEWrapper(random_mace([29, 79], hidden_irreps="4x0e + 4x1o", max_ell=2, correlation=3))
    atoms = alloy(reps=(2, 2, 2), seed=3)
    ei, unit = graph(atoms, w.cutoff)
    r = len(atoms) // 2
    keep = ei[1] < r  # as in a per-layer block: only the first r rows receive
    cell = atoms.cell.array
    full = BlockGraph(torch.tensor(atoms.positions), torch.tensor(w.node_attrs(atoms.numbers)),
                      torch.tensor(ei[:, keep]), torch.tensor(unit[keep] @ cell))
    part = dataclasses.replace(full, n_receivers=r)
    h_full = h_part = w.embed(full)
    for i in range(w.n_layers):
        (h_full, e_full), (h_part, e_part) = w.interaction(i, full, h_full), w.interaction(i, part, h_full)
        assert h_part.shape == h_full.shape and e_part.shape == e_full.shape
        torch.testing.assert_close(h_part[:r], h_full[:r], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(e_part[:r], e_full[:r], rtol=1e-12, atol=1e-12)
        assert not h_part[r:].any() and not e_part[r:].any()
        assert e_full[:r].abs().sum() > 0


def test_stages_differentiate_positions_and_features_only():
    """Under jax.grad the stages' torch graphs have the positions, node features and edge shifts as leaves
    (the shifts of edges from images of a device's own atoms carry the strain), never the node attributes
    (nothing reads their gradients); forces and stress still match."""
    from nvalchemi_jaxbridge.mlip import MPNN, DistributedMLIP, MPNNWrapper

    seen: list[tuple[bool, bool, bool, bool]] = []

    class Recording(MPNNWrapper):
        def interaction(self, i, g, h):
            if torch.is_grad_enabled():  # the differentiated runs (not the shape probes)
                seen.append((g.positions.requires_grad, h.requires_grad, g.node_attrs.requires_grad,
                             g.shifts.requires_grad))
            return super().interaction(i, g, h)

    model = MPNN([29, 79], cutoff=4.0)
    atoms = alloy(reps=(3, 3, 3), seed=5)
    args = (atoms.positions, atoms.numbers, atoms.cell.array, atoms.pbc)
    wrapper = Recording(model)
    got = DistributedMLIP(wrapper, n_devices=2).evaluate(*args)
    want = reference(model, atoms, model.cutoff, wrapper.node_attrs(atoms.numbers))  # one device, torch autograd
    assert set(seen) == {(True, True, False, True)}, seen
    for key in ("energy", "forces", "stress"):
        np.testing.assert_allclose(got[key], want[key], rtol=1e-10, atol=1e-10)


def test_forces_without_stress_leave_the_strain_out_of_the_program():
    """`evaluate(stress=False)` runs a program without dE/dstrain: the edge shifts are constants there (not torch
    leaves), and energy and forces equal those of the program with the strain derivative."""
    from nvalchemi_jaxbridge.mlip import MPNN, DistributedMLIP, MPNNWrapper

    seen: list[bool] = []

    class Recording(MPNNWrapper):
        def interaction(self, i, g, h):
            if torch.is_grad_enabled():
                seen.append(g.shifts.requires_grad)
            return super().interaction(i, g, h)

    atoms = alloy(reps=(3, 3, 3), seed=6)
    args = (atoms.positions, atoms.numbers, atoms.cell.array, atoms.pbc)
    bridge = DistributedMLIP(Recording(MPNN([29, 79], cutoff=4.0)), n_devices=2)
    state = bridge.prepare(*args)
    lean = bridge.evaluate(*args, state=state, stress=False)
    assert set(seen) == {False} and "stress" not in lean and "virial" not in lean
    seen.clear()
    full = bridge.evaluate(*args, state=state, stress=True)
    assert set(seen) == {True}
    assert lean["energy"] == pytest.approx(full["energy"], rel=1e-12)
    np.testing.assert_allclose(lean["forces"], full["forces"], rtol=0, atol=1e-12)


@pytest.mark.parametrize("n_layers", [1, 3])
def test_per_layer_ops_are_cut_only_between_layers_and_match_one_device(n_layers):
    """One op per layer (the first also embeds, the last also reads out), one op for a single layer, and the
    same energy, forces and stress as one device."""
    from nvalchemi_jaxbridge.mlip import MPNN, DistributedMLIP, MPNNWrapper

    model = MPNN([29, 79], cutoff=4.0, n_layers=n_layers)
    wrapper = MPNNWrapper(model)
    atoms = alloy(reps=(3, 3, 3), seed=7)
    bridge = DistributedMLIP(wrapper, n_devices=2)
    got = bridge.evaluate(atoms.positions, atoms.numbers, atoms.cell.array, atoms.pbc)
    want = reference(model, atoms, model.cutoff, wrapper.node_attrs(atoms.numbers))
    for key in ("energy", "forces", "stress"):
        np.testing.assert_allclose(got[key], want[key], rtol=1e-10, atol=1e-10)
    (ops,) = bridge.stages.defined()
    names = [name for name, _ in ops.named()]
    assert names == (["whole"] if n_layers == 1 else ["first", *(f"layer_{i}" for i in range(1, n_layers - 1)), "last"])
