"""The project's plain-torch message-passing model (index_add messages, 3 layers) and its wrapper.

Invariant (distances only), smooth at the cutoff (Bessel radial basis times a
polynomial envelope that is exactly zero beyond it), float64 by default:

    h_i^0     = W_emb z_i                                    (z_i: one-hot species)
    m_ij^l    = (W_s^l h_j^l) * (R(r_ij) W_r^l) * f_cut(r_ij)
    h_i^{l+1} = h_i^l + silu(W_u^l sum_j m_ij^l)
    E_i       = E0[z_i] + sum_l w^l . h_i^{l+1}

`MPNN.forward` runs the whole model on any graph (a periodic system with
shifts, or a block), so a single-device reference needs only a neighbour list.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from .protocol import BlockGraph, MessagePassingWrapper, numpy_dtype, one_hot


def bessel_basis(r: torch.Tensor, cutoff: float, n: int) -> torch.Tensor:
    """`(E, n)` radial Bessel functions `sqrt(2/c) sin(k pi r / c) / r`, k = 1..n."""
    k = torch.arange(1, n + 1, dtype=r.dtype, device=r.device)
    return math.sqrt(2.0 / cutoff) * torch.sin(k * math.pi * r[:, None] / cutoff) / r[:, None]


def envelope(r: torch.Tensor, cutoff: float, p: int = 6) -> torch.Tensor:
    """Polynomial envelope: 1 at 0, zero with two zero derivatives at `cutoff`, 0 beyond."""
    x = r / cutoff
    env = 1 - (p + 1) * (p + 2) / 2 * x**p + p * (p + 2) * x ** (p + 1) - p * (p + 1) / 2 * x ** (p + 2)
    return torch.where(x < 1, env, torch.zeros_like(env))


class MPNN(torch.nn.Module):
    """A small invariant message-passing potential (see the module docstring).

    Args:
        species: atomic numbers the model knows, in one-hot order.
        cutoff: Å.
        features, n_rbf, n_layers: widths and depth.
        seed: weights are drawn from `torch.Generator().manual_seed(seed)`.
        dtype: parameter dtype.
    """

    def __init__(self, species: Sequence[int], *, cutoff: float = 4.0, features: int = 16, n_rbf: int = 8,
                 n_layers: int = 3, seed: int = 0, dtype: torch.dtype = torch.float64) -> None:
        super().__init__()
        self.species = tuple(int(z) for z in species)
        self.cutoff, self.n_rbf, self.n_layers = float(cutoff), int(n_rbf), int(n_layers)
        gen = torch.Generator().manual_seed(seed)

        def lin(n_in: int, n_out: int, scale: float = 1.0) -> torch.nn.Linear:
            layer = torch.nn.Linear(n_in, n_out, bias=False, dtype=dtype)
            with torch.no_grad():
                layer.weight.copy_(scale * torch.randn(n_out, n_in, generator=gen, dtype=dtype) / math.sqrt(n_in))
            return layer

        f = features
        self.embedding = lin(len(self.species), f)
        self.sender = torch.nn.ModuleList(lin(f, f) for _ in range(n_layers))
        self.radial = torch.nn.ModuleList(lin(n_rbf, f) for _ in range(n_layers))
        self.update = torch.nn.ModuleList(lin(f, f) for _ in range(n_layers))
        self.readout = torch.nn.ModuleList(lin(f, 1, 0.05) for _ in range(n_layers))  # ~0.1 eV per atom and layer
        self.e0 = torch.nn.Parameter(-torch.rand(len(self.species), generator=gen, dtype=dtype))

    def layer(self, i: int, h: torch.Tensor, vectors: torch.Tensor, edge_index: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `i`: `(new h, (rows,) energy term)`; messages summed onto receivers with `index_add`."""
        r = torch.linalg.vector_norm(vectors, dim=1)
        radial = self.radial[i](bessel_basis(r, self.cutoff, self.n_rbf)) * envelope(r, self.cutoff)[:, None]
        msg = self.sender[i](h)[edge_index[0]] * radial
        agg = torch.zeros_like(h).index_add(0, edge_index[1], msg)
        h = h + torch.nn.functional.silu(self.update[i](agg))
        return h, self.readout[i](h)[:, 0]

    def forward(self, positions: torch.Tensor, node_attrs: torch.Tensor, edge_index: torch.Tensor,
                shifts: torch.Tensor) -> torch.Tensor:
        """`(N,)` node energies of a graph (edges `sender -> receiver`, vector `r_recv - r_send + shift`)."""
        vectors = positions[edge_index[1]] - positions[edge_index[0]] + shifts
        h = self.embedding(node_attrs)
        total = node_attrs @ self.e0
        for i in range(self.n_layers):
            h, e = self.layer(i, h, vectors, edge_index)
            total = total + e
        return total


class MPNNWrapper(MessagePassingWrapper):
    """`MessagePassingWrapper` for `MPNN`: one stage per layer, E0 added in `node_energies`."""

    def __init__(self, model: MPNN) -> None:
        self.model = model
        self.cutoff = model.cutoff
        self.n_layers = model.n_layers
        self.dtype = model.e0.dtype
        self.name = "mpnn"

    def model_reach(self) -> tuple[float, int]:
        return self.model.cutoff, self.model.n_layers

    def node_attrs(self, numbers: np.ndarray) -> np.ndarray:
        return one_hot(numbers, self.model.species, dtype=numpy_dtype(self.dtype), model="MPNN")

    def embed(self, g: BlockGraph) -> torch.Tensor:
        return self.model.embedding(g.node_attrs)

    def interaction(self, i: int, g: BlockGraph, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.model.layer(i, h, g.edge_vectors(), g.edge_index)

    def node_energies(self, g: BlockGraph, layer_energy: torch.Tensor) -> torch.Tensor:
        return g.node_attrs @ self.model.e0 + layer_energy
