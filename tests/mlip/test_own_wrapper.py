"""A user's own model, not in the project, distributed through a wrapper written from the guide alone.

The wrapper (between the two marker comments) must take at most 40 lines; the
model is a small continuous-filter convolution (SchNet-like) written here.
"""

from __future__ import annotations

import inspect
import math

import numpy as np
import pytest
import torch

from nvalchemi_jaxbridge.mlip import DistributedMLIP, shared_edge_features
from nvalchemi_jaxbridge.mlip.stages import Stages, block_graph
from tests.mlip import cases
from tests.mlip._reference import reference


class FilterConv(torch.nn.Module):
    """h_i <- h_i + sum_j W(r_ij) * h_j, energy = sum_i w . h_i (two layers, cosine cutoff)."""

    def __init__(self, n_species=2, width=8, cutoff=3.5, seed=1):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.cutoff = cutoff
        self.embed = torch.nn.Parameter(torch.randn(n_species, width, generator=g, dtype=torch.float64))
        self.filters = torch.nn.ParameterList(
            torch.nn.Parameter(torch.randn(4, width, generator=g, dtype=torch.float64) / 2) for _ in range(2))
        self.out = torch.nn.Parameter(torch.randn(width, generator=g, dtype=torch.float64) / 10)

    def conv(self, i, h, vectors, edge_index):
        r = vectors.norm(dim=1)
        fc = 0.5 * (torch.cos(math.pi * r / self.cutoff) + 1) * (r < self.cutoff)
        basis = torch.stack([torch.exp(-(r - c) ** 2) for c in (1.0, 2.0, 3.0, 4.0)], 1)
        msg = (basis @ self.filters[i]) * fc[:, None] * h[edge_index[0]]
        return torch.tanh(h + torch.zeros_like(h).index_add(0, edge_index[1], msg))

    def forward(self, positions, node_attrs, edge_index, shifts):
        vectors = positions[edge_index[1]] - positions[edge_index[0]] + shifts
        h = node_attrs @ self.embed
        for i in range(2):
            h = self.conv(i, h, vectors, edge_index)
        return h @ self.out


# --- the user's wrapper: begin
from nvalchemi_jaxbridge.mlip import MessagePassingWrapper  # noqa: E402
from nvalchemi_jaxbridge.mlip.protocol import one_hot  # noqa: E402


class FilterConvWrapper(MessagePassingWrapper):
    def __init__(self, model, species):
        self.model, self.species = model, species
        self.cutoff = model.cutoff
        self.n_layers = 2
        self.dtype = torch.float64
        self.name = "filterconv"

    def node_attrs(self, numbers):
        return one_hot(numbers, self.species, dtype=np.float64, model=self.name)

    def embed(self, g):
        return g.node_attrs @ self.model.embed

    def interaction(self, i, g, h):
        h = self.model.conv(i, h, g.edge_vectors(), g.edge_index)
        energy = h @ self.model.out if i == self.n_layers - 1 else torch.zeros_like(h[:, 0])
        return h, energy
# --- the user's wrapper: end


def test_the_wrapper_is_short():
    src = inspect.getsource(inspect.getmodule(FilterConvWrapper))
    body = src.split("# --- the user's wrapper: begin")[1].split("# --- the user's wrapper: end")[0]
    lines = [ln for ln in body.strip().splitlines() if ln.strip()]
    assert len(lines) <= 40, len(lines)


def test_own_model_matches_one_device():
    model = FilterConv()
    wrapper = FilterConvWrapper(model, (29, 79))
    atoms = cases.structure("triclinic")
    want = reference(model, atoms, model.cutoff, wrapper.node_attrs(atoms.numbers))
    out = DistributedMLIP(wrapper, n_devices=4).evaluate(atoms.positions, atoms.numbers, atoms.cell.array, atoms.pbc)
    assert abs(out["energy"] - want["energy"]) <= 1e-9 * abs(want["energy"])
    np.testing.assert_allclose(out["forces"], want["forces"], rtol=0, atol=1e-8)
    np.testing.assert_allclose(out["stress"], want["stress"], rtol=0, atol=1e-9)


class SharedVectorsWrapper(FilterConvWrapper):
    """The same model with its edge vectors shared between the layers (`edge_features`)."""

    def edge_features(self, g):
        return (g.edge_vectors(),)

    def interaction(self, i, g, h):
        (vectors,) = shared_edge_features(self, g)
        h = self.model.conv(i, h, vectors, g.edge_index)
        energy = h @ self.model.out if i == self.n_layers - 1 else torch.zeros_like(h[:, 0])
        return h, energy


def _two_devices_against_one(wrapper_cls: type) -> DistributedMLIP:
    """`wrapper_cls` over FilterConv on 2 devices; energy, forces and stress checked against one device."""
    model = FilterConv()
    wrapper = wrapper_cls(model, (29, 79))
    atoms = cases.structure("small")
    want = reference(model, atoms, model.cutoff, wrapper.node_attrs(atoms.numbers))
    bridge = DistributedMLIP(wrapper, n_devices=2)
    out = bridge.evaluate(atoms.positions, atoms.numbers, atoms.cell.array, atoms.pbc)
    assert abs(out["energy"] - want["energy"]) <= 1e-9 * abs(want["energy"])
    np.testing.assert_allclose(out["forces"], want["forces"], rtol=0, atol=1e-8)
    np.testing.assert_allclose(out["stress"], want["stress"], rtol=0, atol=1e-9)
    return bridge


def test_shared_edge_features_are_computed_once_and_match_one_device():
    bridge = _two_devices_against_one(SharedVectorsWrapper)
    model = bridge.wrapper.model
    (ops,) = bridge.stages.defined()
    assert [name for name, _ in ops.named()] == ["first", "last"]  # cut only where the exchange is
    assert bridge.stages.n_edge_features == ops.n_edge_features == 1  # handed from the first op to the last
    assert Stages.of(FilterConvWrapper(model, (29, 79))).n_edge_features == 0  # nothing shared: no edges op


def test_edge_features_as_one_tensor_are_one_feature_not_its_rows():
    class OneTensor(SharedVectorsWrapper):
        def edge_features(self, g):
            return g.edge_vectors()  # a bare tensor, as embed may return one

    assert _two_devices_against_one(OneTensor).stages.n_edge_features == 1


def test_edge_features_that_are_not_per_edge_are_refused_with_the_fix():
    class NodeWise(FilterConvWrapper):
        def edge_features(self, g):
            return (g.positions,)  # one row per node, not per edge

    with pytest.raises(TypeError, match=r"'filterconv'\)\.edge_features\(g\).* returned .*per-edge tensors"):
        Stages.of(NodeWise(FilterConv(), (29, 79)))


def test_shared_edge_features_of_a_wrapper_that_shares_none_says_what_to_implement():
    wrapper = FilterConvWrapper(FilterConv(), (29, 79))
    g = block_graph(torch.zeros((2, 3), dtype=torch.float64), torch.zeros((2, 2), dtype=torch.float64),
                    torch.tensor([[0, 1]], dtype=torch.int32), torch.zeros((1, 3), dtype=torch.float64))
    with pytest.raises(TypeError, match="implement edge_features"):
        shared_edge_features(wrapper, g)
