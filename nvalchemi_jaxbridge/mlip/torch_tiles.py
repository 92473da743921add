"""A rank's block evaluated tile by tile on the PyTorch door (`tiles.TilePlan`), eagerly in torch.

The torch twin of `mlip.tiled`: each tile's forward and backward run in its turn on the tile's own rows
and edges (real ones only: eager torch needs no static shapes), and its gradients are added into the
block's rows and edge shifts, so only one tile's intermediates are alive at a time and nothing is
computed twice. `tiled_node_energies` is an autograd `Function` whose forward keeps the block gradients
of the owned atoms' summed energy; its backward scales them when the cotangent is the same on every
owned row (an energy: forces and stress), else runs every tile's backward again with it (a weighted sum
of atomic energies), so every derivative is exact. The block's own backward (the strain, the halo's
adjoint that folds ghost rows into their owners across ranks) runs once, after the tiles.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from .protocol import BlockGraph


@dataclasses.dataclass(frozen=True)
class RankTiles:
    """One rank's tiles as index tensors on its device: per tile, real rows and edges only.

    Attributes:
        rows: per tile `(n_rows + 1,)` int64 block rows, owned first, then the rows it reads, then the block's
            parked row (the "+1" pad row every block graph has).
        n_owned: per tile, its owned rows (the first ones).
        edges: per tile `(2, n_edges)` int64 tile rows (senders, receivers).
        edge_ids: per tile `(n_edges,)` int64 the block edge each tile edge is.
    """

    rows: tuple[torch.Tensor, ...]
    n_owned: tuple[int, ...]
    edges: tuple[torch.Tensor, ...]
    edge_ids: tuple[torch.Tensor, ...]


def rank_tiles(tiles: Any, rank: int, parked: int, device: torch.device) -> RankTiles:
    """Device `rank`'s tiles of a `TilePlan` as `RankTiles` on `device`; `parked`: the block's pad row."""
    rows, owned, edges, ids = [], [], [], []
    for t in range(tiles.n_tiles):
        n, e = int(tiles.n_rows[rank, t]), int(tiles.n_edges[rank, t])
        r = torch.as_tensor(tiles.rows[rank, t, :n], dtype=torch.int64)
        rows.append(torch.cat([r, torch.tensor([parked])]).to(device))
        owned.append(int(tiles.n_owned[rank, t]))
        edges.append(torch.as_tensor(tiles.edges[rank, t, :e], dtype=torch.int64).T.contiguous().to(device))
        ids.append(torch.as_tensor(tiles.edge_ids[rank, t, :e], dtype=torch.int64).to(device))
    return RankTiles(tuple(rows), tuple(owned), tuple(edges), tuple(ids))


def tiled_node_energies(model: torch.nn.Module, block: torch.Tensor, attrs: torch.Tensor, shift: torch.Tensor,
                        keep: torch.Tensor, tiles: RankTiles) -> torch.Tensor:
    """`(rows,)` node energies of the block's owned rows (zero elsewhere), tile by tile, differentiable.

    Args:
        model: the wrapper's stages as one module, `model(BlockGraph) -> (rows,)` node energies.
        block: `(rows, 3)` block positions (strained, in the autograd graph); attrs: `(rows, A)`.
        shift: `(E, 3)` the block edges' shifts (strained); keep: `(E,)` bool, the edges within the cutoff now.
        tiles: the rank's tiles.
    """
    return _Tiled.apply(block, shift, model, attrs, keep, tiles)


def _turns(model: torch.nn.Module, block: torch.Tensor, shift: torch.Tensor, attrs: torch.Tensor,
           keep: torch.Tensor, tiles: RankTiles, weight: torch.Tensor | None, want_shift: bool
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Node energies, and the block gradients of `sum(weight * node energies)` over owned rows (weight None: 1)."""
    out = torch.zeros(block.shape[0], dtype=block.dtype, device=block.device)
    g_block = torch.zeros_like(block)
    g_shift = torch.zeros_like(shift) if want_shift else None
    for rows, n_own, edges, ids in zip(tiles.rows, tiles.n_owned, tiles.edges, tiles.edge_ids):
        kept = keep[ids]
        ids = ids[kept]
        with torch.enable_grad():
            p = block[rows].detach().requires_grad_(True)
            s = shift[ids].detach().requires_grad_(want_shift)
            node = model(BlockGraph(p, attrs[rows], edges[:, kept].contiguous(), s, None))[:n_own]
            w = node if weight is None else node * weight[rows[:n_own]]
            wrt = (p, s) if want_shift else (p,)
            grads = torch.autograd.grad(w.sum(), wrt, allow_unused=True)
        out[rows[:n_own]] = node.detach()
        if grads[0] is not None:
            g_block.index_add_(0, rows, grads[0])
        if want_shift and grads[1] is not None:
            g_shift.index_add_(0, ids, grads[1])
        del node, w, grads, p, s  # this tile's intermediates die with its turn
    return out, g_block, g_shift


class _Tiled(torch.autograd.Function):
    @staticmethod
    def forward(ctx, block, shift, model, attrs, keep, tiles):
        want_shift = bool(shift.requires_grad)
        out, g_block, g_shift = _turns(model, block, shift, attrs, keep, tiles, None, want_shift)
        ctx.model, ctx.tiles, ctx.want_shift = model, tiles, want_shift
        ctx.n_owned = sum(tiles.n_owned)  # the tiles share out the block's owned rows [0, n_owned)
        ctx.save_for_backward(block.detach(), shift.detach(), attrs, keep, g_block,
                              g_block if g_shift is None else g_shift)
        return out

    @staticmethod
    def backward(ctx, ct):
        block, shift, attrs, keep, g_block, g_shift = ctx.saved_tensors
        own = ct[: ctx.n_owned]
        if own.numel() == 0 or bool((own == own[0]).all()):  # an energy: the forward's gradients, scaled
            c0 = own[0] if own.numel() else ct.new_zeros(())
            gb, gs = c0 * g_block, c0 * g_shift if ctx.want_shift else None
        else:  # any other cotangent: every tile's backward again, weighted by it
            _, gb, gs = _turns(ctx.model, block, shift, attrs, keep, ctx.tiles, ct, ctx.want_shift)
        return gb, gs, None, None, None, None
