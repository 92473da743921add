"""Tiles: a device's owned atoms cut into pieces evaluated one after another, each with its own deep halo.

With the deep halo a device's block holds every row within `n_layers x cutoff` (+ skin) of its
owned atoms and the block's edges (`EdgePlan`), and the model runs on the whole block at once,
so the block's edge-level tensors are alive together. A tile is a part of the owned atoms and the
smallest part of that graph their energies depend on: an owned atom's energy after `L` layers reads
the rows within `L` hops along the edges, and the rows within `L - 1` hops must receive all their
edges. So a tile's rows are its owned atoms, then the rows `1..L` hops away; its edges are every
block edge whose receiver is within `L - 1` hops. Its owned atoms' energies on that sub-graph are
exactly the block's, and so are their derivatives, which is why tiles need no exchange of their
own: a tile reads block rows and its gradients are added back into them.

Owned atoms are cut by recursive bisection along the longest extent of their positions (balanced
counts, compact tiles, any number of tiles, any cell). Each tile's rows and edges are padded to
static capacities shared by all tiles of all devices, kept across rebuilds and grown as the
block's are (`layout.capacity`).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ..layout.capacity import Growth, fitted, regrown


@dataclasses.dataclass(frozen=True, eq=False)
class TilePlan:
    """Per-device tiles of one deep-halo block (`D` devices, `T` tiles each).

    Attributes:
        rows: `(D, T, row_capacity)` int32 block rows of each tile: its owned atoms first, then the
            rows it reads; padding slots name the block's padding rows.
        n_owned, n_rows: `(D, T)` owned and real rows per tile.
        edges: `(D, T, edge_capacity, 2)` int32 tile rows `(sender, receiver)`; a padding edge
            joins a padding row of the tile to itself (`spare`).
        edge_ids: `(D, T, edge_capacity)` int32 the block edge each tile edge is (0 on padding).
        spare: `(D, T, edge_capacity)` int32 the padding row of each tile edge slot.
        n_edges: `(D, T)` real edges per tile.
        row_capacity, edge_capacity: static sizes of every tile.
        growth: capacities grown by this build (empty when kept or fresh).
    """

    rows: np.ndarray
    n_owned: np.ndarray
    n_rows: np.ndarray
    edges: np.ndarray
    edge_ids: np.ndarray
    spare: np.ndarray
    n_edges: np.ndarray
    row_capacity: int
    edge_capacity: int
    headroom: float
    growth: tuple[Growth, ...] = ()

    @property
    def n_tiles(self) -> int:
        return int(self.rows.shape[1])

    @property
    def owned_mask(self) -> np.ndarray:
        """`(D, T, row_capacity)` True on each tile's owned rows."""
        return np.arange(self.row_capacity) < self.n_owned[..., None]

    @property
    def edge_mask(self) -> np.ndarray:
        """`(D, T, edge_capacity)` True on each tile's real edges."""
        return np.arange(self.edge_capacity) < self.n_edges[..., None]

    @classmethod
    def build(cls, plan, edge_plan, positions: np.ndarray, *, n_tiles: int, n_layers: int,
              headroom: float = 1.2, keep: TilePlan | None = None, grow: bool = False) -> TilePlan:
        """Tiles of every device's block of `plan` (a deep-halo `HaloPlan`) and `edge_plan` (its edges).

        Args:
            positions: `(N, 3)` the positions the plan was built for.
            n_tiles: tiles per device (>= 1); n_layers: the model's interaction layers.
            keep: a plan whose capacities to keep when they suffice (grown otherwise, and when `grow`:
                the block grew, so programs compile again anyway).
        """
        if not (isinstance(n_tiles, (int, np.integer)) and not isinstance(n_tiles, bool) and n_tiles >= 1):
            raise ValueError(f"TilePlan.build: n_tiles must be an int >= 1, got {n_tiles!r}.")
        d, hr = plan.n_devices, plan.halo_rows
        halo = plan.to_halo(np.asarray(positions, dtype=np.float64), positions=True).reshape(d, hr, 3)
        per_device = [_device_tiles(halo[k], int(plan.n_owned[k]), edge_plan.edges[k, : int(edge_plan.n_edges[k])],
                                    n_tiles, n_layers) for k in range(d)]
        most_rows = max((len(r) for tiles in per_device for r, _, _ in tiles), default=0)
        most_edges = max((len(e) for tiles in per_device for _, _, e in tiles), default=0)
        rc, ec, growth = _capacities(most_rows + 1, max(most_edges, 1), headroom, keep, grow)
        rows = np.zeros((d, n_tiles, rc), np.int32)
        n_owned = np.zeros((d, n_tiles), np.int64)
        n_rows = np.zeros((d, n_tiles), np.int64)
        edges = np.zeros((d, n_tiles, ec, 2), np.int32)
        edge_ids = np.zeros((d, n_tiles, ec), np.int32)
        spare = np.zeros((d, n_tiles, ec), np.int32)
        n_edges = np.zeros((d, n_tiles), np.int64)
        for k, tiles in enumerate(per_device):
            block_pad = int(plan.n_padded[k])  # the block's padding rows: [n_padded, hr)
            for t, (tile_rows, n_own, ids) in enumerate(tiles):
                n = len(tile_rows)
                rows[k, t, :n] = tile_rows
                rows[k, t, n:] = block_pad + np.arange(rc - n) % (hr - block_pad)
                n_owned[k, t], n_rows[k, t], n_edges[k, t] = n_own, n, len(ids)
                local = np.full(hr, -1, np.int64)
                local[tile_rows] = np.arange(n)
                spare[k, t] = n + np.arange(ec) % (rc - n)
                edges[k, t] = spare[k, t, :, None]
                edges[k, t, : len(ids)] = local[edge_plan.edges[k, ids]]
                edge_ids[k, t, : len(ids)] = ids
        return cls(rows, n_owned, n_rows, edges, edge_ids, spare, n_edges, rc, ec, float(headroom), growth)

    def rebuild(self, plan, edge_plan, positions: np.ndarray, n_layers: int) -> TilePlan:
        """The tiles of a rebuilt block, with these capacities where they suffice."""
        grow = bool(getattr(plan, "growth", ())) or bool(getattr(edge_plan, "growth", ()))
        return TilePlan.build(plan, edge_plan, positions, n_tiles=self.n_tiles, n_layers=n_layers,
                              headroom=self.headroom, keep=self, grow=grow)

    def rows_per_tile(self) -> list[list[dict[str, int]]]:
        """Owned, real and edge counts of every tile of every device."""
        return [[{"owned": int(self.n_owned[k, t]), "rows": int(self.n_rows[k, t]), "edges": int(self.n_edges[k, t])}
                 for t in range(self.n_tiles)] for k in range(self.rows.shape[0])]


def check_tiles(tiles: object, exchange: str, where: str) -> int | str:
    """`tiles` as an int >= 1 or "auto", or a ValueError naming the fix (tiles other than 1 need the deep halo)."""
    if tiles == "auto":
        if exchange != "deep_halo":
            raise ValueError(f"{where}: tiles='auto' chooses tiles evaluated each with its own deep halo, but "
                             f"exchange={exchange!r}; pass exchange='deep_halo' with it (same numbers), or tiles=1.")
        return "auto"
    if isinstance(tiles, bool) or not isinstance(tiles, (int, np.integer)) or tiles < 1:
        raise ValueError(f"{where}: tiles must be an int >= 1 (tiles per device; 1: the block in one go) or 'auto' "
                         f"(as many as the memory budget needs), got {tiles!r}.")
    if tiles > 1 and exchange != "deep_halo":
        raise ValueError(
            f"{where}: tiles={tiles} evaluates each tile with its own deep halo, but exchange={exchange!r}; pass "
            f"exchange='deep_halo' with tiles > 1 (same numbers), or tiles=1."
        )
    return int(tiles)


def refuse_tiles(kwargs: dict, where: str) -> None:
    """Take `tiles` and `memory_budget` out of an ML-IAP model's `kwargs`, refusing any but their defaults."""
    tiles, budget = kwargs.pop("tiles", 1), kwargs.pop("memory_budget", None)
    given = [f"tiles={tiles!r}"] * (tiles != 1) + [f"memory_budget={budget!r}"] * (budget is not None)
    if given:
        raise ValueError(
            f"{where}: {', '.join(given)} with an ML-IAP model, which runs its own forward layer by layer with its "
            "own exchanges; tiles and the memory budget apply to a MessagePassingWrapper (the model as one op per "
            "tile). Leave them out, or wrap the model's layers in a MessagePassingWrapper."
        )


def _capacities(rows: int, edges: int, headroom: float, keep: TilePlan | None, grow: bool
                ) -> tuple[int, int, tuple[Growth, ...]]:
    """Tile row and edge capacities: fresh ones, or `keep`'s where they fit (grown, and logged, where not)."""
    fresh_r, fresh_e = fitted(rows, headroom), fitted(edges, headroom)
    if keep is None:
        return fresh_r, fresh_e, ()
    out, growth = [], []
    for name, old, need, fresh in (("tile_row_capacity", keep.row_capacity, rows, fresh_r),
                                   ("tile_edge_capacity", keep.edge_capacity, edges, fresh_e)):
        if old < need or (grow and fresh > old):
            new = regrown(old, fresh)
            out.append(new)
            growth.append(Growth(name, old, new, need))
        else:
            out.append(old)
    return out[0], out[1], tuple(growth)


def bisect(points: np.ndarray, n_parts: int) -> list[np.ndarray]:
    """`n_parts` groups of row indices of `points` `(n, 3)`: recursive bisection along the longest extent.

    Group sizes differ by at most one per cut level (a group may be empty when n < n_parts); each
    group is sorted.
    """
    def cut(idx: np.ndarray, n: int) -> list[np.ndarray]:
        if n == 1:
            return [np.sort(idx)]
        left = n // 2
        if len(idx) == 0:
            return cut(idx, left) + cut(idx, n - left)
        axis = int(np.argmax(np.ptp(points[idx], axis=0)))
        order = idx[np.argsort(points[idx, axis], kind="stable")]
        k = int(round(len(idx) * left / n))
        return cut(order[:k], left) + cut(order[k:], n - left)

    return cut(np.arange(len(points)), n_parts)


def _device_tiles(block: np.ndarray, n_owned: int, edges: np.ndarray, n_tiles: int, n_layers: int
                  ) -> list[tuple[np.ndarray, int, np.ndarray]]:
    """Each tile of one block as `(rows, n_owned, edge ids)`: its owned rows first, then the rows it reads."""
    receiver = edges[:, 1].astype(np.int64)
    order = np.argsort(receiver, kind="stable")  # edges by receiver (EdgePlan lists them so already)
    starts = np.searchsorted(receiver[order], np.arange(len(block) + 1))
    out = []
    for owned in bisect(block[:n_owned], n_tiles):
        reach = np.zeros(len(block), bool)
        reach[owned] = True
        ids = _incoming(reach, starts, order)
        for _ in range(n_layers - 1):  # receivers: the rows within L - 1 hops
            reach[edges[ids, 0]] = True
            ids = _incoming(reach, starts, order)
        rows = reach.copy()
        rows[edges[ids, 0]] = True  # and their senders (L hops): read, never receive
        rows[owned] = False
        out.append((np.concatenate([owned, np.flatnonzero(rows)]).astype(np.int32), len(owned), ids))
    return out


def _incoming(receivers: np.ndarray, starts: np.ndarray, order: np.ndarray) -> np.ndarray:
    """Ids (sorted) of the edges whose receiver is marked in `receivers`."""
    r = np.flatnonzero(receivers)
    lo, hi = starts[r], starts[r + 1]
    counts = hi - lo
    if counts.sum() == 0:
        return np.zeros(0, np.int64)
    within = np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)
    return np.sort(order[np.repeat(lo, counts) + within])
