"""Per-layer tiles, a measured prototype (issue 30's other way; benchmarks only, not library code).

The library's tiles each carry a deep halo (`n_layers x cutoff` of rows they read), so a tile holds
1.7-2.2x its atoms as rows. The other way keeps the node features of ALL atoms between layers (small:
rows x features) and cuts only the edge-level work of each layer into tiles:

    h = embed(whole system)
    for each layer i:
        for each tile t:              # receivers: the tile's atoms; rows: those + the senders they read
            h_t, e_t = checkpoint(interaction(i, g_t, h[rows_t]))   # g_t's edge features made inside
        h = the tiles' receiver rows, in atom order;  e += the same of e_t
    E = sum(node_energies(e));  F = -dE/dx  (one backward: each checkpoint recomputes its own tile)

A tile's sub-graph is one cutoff deep (its atoms and the senders of their edges), the same for every
layer. `torch.utils.checkpoint` (non-reentrant) keeps only each tile's inputs, which are the shared
whole-system tensors, so between layers nothing of a tile's edge work stays alive, and in the backward
one tile at a time is recomputed and differentiated. The price: every layer's forward runs twice, and
the edge features (MACE's spherical harmonics and radial basis) are made per tile and per layer.

Eager torch on one device, one block with every atom owned (the whole periodic system), any
`MessagePassingWrapper`. Tiles: the library's recursive bisection (`mlip.tiles.bisect`) of the wrapped
positions.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import numpy as np
import torch
from torch.utils.checkpoint import checkpoint

from nvalchemi_jaxbridge.mlip.protocol import BlockGraph, MessagePassingWrapper, as_tuple, like
from nvalchemi_jaxbridge.mlip.reference import periodic_graph
from nvalchemi_jaxbridge.mlip.tiles import bisect


@dataclasses.dataclass(frozen=True)
class System:
    """A whole periodic system as one block on `device`: every atom owned, edges over periodic images.

    Attributes:
        attrs: `(N, A)` node attributes; edge_index: `(2, E)` int64 sender -> receiver;
        shifts: `(E, 3)` Cartesian shift of each edge (vector = `pos[recv] - pos[send] + shift`).
        wrapped: `(N, 3)` float64 host positions wrapped into the cell (what the tiles are cut from).
    """

    attrs: torch.Tensor
    edge_index: torch.Tensor
    shifts: torch.Tensor
    wrapped: np.ndarray


@dataclasses.dataclass(frozen=True)
class LayerTiles:
    """Tiles of one cutoff for the per-layer way: per tile, its atoms first, then the senders they read.

    Attributes:
        rows: per tile `(n_rows,)` int64 system rows (receivers first).
        n_receivers: per tile, its atoms (the leading rows).
        edges: per tile `(2, n_edges)` int64 tile rows (senders, receivers): every edge into its atoms.
        edge_ids: per tile `(n_edges,)` int64 the system edge each tile edge is.
        inverse: `(N,)` int64: the tiles' receivers concatenated, indexed by this, are in atom order.
    """

    rows: tuple[torch.Tensor, ...]
    n_receivers: tuple[int, ...]
    edges: tuple[torch.Tensor, ...]
    edge_ids: tuple[torch.Tensor, ...]
    inverse: torch.Tensor

    @property
    def n_tiles(self) -> int:
        return len(self.rows)

    def counts(self) -> dict[str, int]:
        """Rows held over all tiles, the largest tile's rows and edges."""
        return {"rows": sum(int(r.numel()) for r in self.rows), "largest_rows": max(int(r.numel()) for r in self.rows),
                "largest_edges": max(int(e.shape[1]) for e in self.edges)}


def system(wrapper: MessagePassingWrapper, positions: Any, numbers: Any, cell: Any, pbc: Any,
           device: Any = "cpu") -> System:
    """The whole system's graph at the wrapper's cutoff (`mlip.reference.periodic_graph`) on `device`."""
    pos = np.asarray(positions, np.float64)
    cell = np.asarray(cell, np.float64).reshape(3, 3)
    per = np.broadcast_to(np.asarray(pbc, bool), (3,))
    edge_index, unit = periodic_graph(pos, cell, per, wrapper.cutoff)
    frac = pos @ np.linalg.inv(cell)
    wrapped = pos - np.where(per, np.floor(frac), 0.0) @ cell
    f = dict(dtype=wrapper.dtype, device=device)
    return System(torch.as_tensor(wrapper.node_attrs(np.asarray(numbers)), **f),
                  torch.as_tensor(edge_index, dtype=torch.int64, device=device),
                  torch.as_tensor(unit @ cell, **f), wrapped)


def layer_tiles(s: System, n_tiles: int) -> LayerTiles:
    """`n_tiles` tiles of `s` by recursive bisection of its wrapped positions (see `LayerTiles`)."""
    if isinstance(n_tiles, bool) or not isinstance(n_tiles, (int, np.integer)) or n_tiles < 1:
        raise ValueError(f"layer_tiles: n_tiles must be an int >= 1, got {n_tiles!r}.")
    device = s.edge_index.device
    edges = s.edge_index.cpu().numpy()
    n = len(s.wrapped)
    groups = bisect(s.wrapped, int(n_tiles))
    owner = np.empty(n, np.int64)
    for t, g in enumerate(groups):
        owner[g] = t
    by_tile = np.argsort(owner[edges[1]], kind="stable")  # edges grouped by their receiver's tile
    bounds = np.searchsorted(owner[edges[1]][by_tile], np.arange(len(groups) + 1))
    local = np.full(n, -1, np.int64)
    as_t = functools.partial(torch.as_tensor, dtype=torch.int64, device=device)
    rows, n_recv, tile_edges, ids = [], [], [], []
    for t, g in enumerate(groups):
        e = by_tile[bounds[t]:bounds[t + 1]]
        senders = np.unique(edges[0, e])
        r = np.concatenate([g, senders[owner[senders] != t]])  # its atoms, then the senders they read
        local[r] = np.arange(len(r))
        rows.append(as_t(r))
        n_recv.append(len(g))
        tile_edges.append(as_t(local[edges[:, e]]))
        ids.append(as_t(e))
        local[r] = -1
    inverse = np.empty(n, np.int64)
    inverse[np.concatenate(groups)] = np.arange(n)
    return LayerTiles(tuple(rows), tuple(n_recv), tuple(tile_edges), tuple(ids),
                      torch.as_tensor(inverse, device=device))


def node_energies(wrapper: MessagePassingWrapper, s: System, positions: torch.Tensor, tiles: LayerTiles
                  ) -> torch.Tensor:
    """`(N,)` node energies of the whole system, each layer's edge work tile by tile under checkpoints.

    Differentiable in `positions` (`(N, 3)`); the backward recomputes one tile's layer at a time.
    """
    whole = BlockGraph(positions, s.attrs, s.edge_index, s.shifts)
    h = wrapper.embed(whole)
    template, h = h, as_tuple(h)
    total = torch.zeros(len(s.wrapped), dtype=positions.dtype, device=positions.device)
    for i in range(wrapper.n_layers):
        outs = [checkpoint(functools.partial(_tile_layer, wrapper, i, template, tiles.rows[t], tiles.n_receivers[t],
                                             tiles.edges[t], tiles.edge_ids[t]),
                           positions, s.attrs, s.shifts, *h, use_reentrant=False)
                for t in range(tiles.n_tiles)]
        parts = [torch.cat(p)[tiles.inverse] for p in zip(*outs)]  # each output in atom order
        h, total = tuple(parts[:-1]), total + parts[-1]
    return wrapper.node_energies(whole, total)


def _tile_layer(wrapper: MessagePassingWrapper, i: int, template: Any, rows: torch.Tensor, n_recv: int,
                edges: torch.Tensor, ids: torch.Tensor, positions: torch.Tensor, attrs: torch.Tensor,
                shifts: torch.Tensor, *h: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Layer `i` on one tile: its receivers' new features (each part) and energy terms.

    Gathers inside, so the checkpoint keeps the whole-system tensors only (no per-tile copies)."""
    g = BlockGraph(positions[rows], attrs[rows], edges, shifts[ids], n_receivers=n_recv)
    feats = wrapper.edge_features(g)  # made here, per tile: none of them outlives the tile
    if feats is not None:
        g = dataclasses.replace(g, edge_features=as_tuple(feats))
    new, e = wrapper.interaction(i, g, like(template, [x[rows] for x in h]))
    return (*[x[:n_recv] for x in as_tuple(new)], e[:n_recv])


def energy_and_forces(wrapper: MessagePassingWrapper, s: System, positions: Any, tiles: LayerTiles
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`(energy, (N,) node energies, (N, 3) forces)`, detached: one forward, one backward."""
    pos = torch.as_tensor(positions, dtype=wrapper.dtype, device=s.attrs.device).detach().requires_grad_(True)
    node_e = node_energies(wrapper, s, pos, tiles)
    energy = node_e.sum()
    (grad,) = torch.autograd.grad(energy, pos)
    return energy.detach(), node_e.detach(), -grad
