"""Edges of each device's block: a neighbour list with a static capacity, grown, never cut.

The list is built on the host (scipy's `cKDTree`, open boundaries; one pair search and one sort
per block) from the plan's halo positions, with radius `cutoff + skin`, so it stays a superset of
the pairs within `cutoff` until the plan needs a rebuild (an atom moved more than `skin / 2`).
Periodic images of other devices' atoms are ghost rows. Images of a device's own
atoms are ghost rows too in a plan built with `self_images=True`; in one built with
`self_images=False` (the model level's) they are no rows at all: the search places
them as extra points, and an edge from one is an edge from its owned row whose
`shift` is the image's lattice vector (`-image @ basis`, as a model's own
neighbour list gives for a periodic image). On one device the block then holds
the owned atoms alone, as the model's own input would. Inside a program the edges
longer than `cutoff` at the current positions are turned into padding edges
(`active_edges`), so a model sees exactly the pairs a neighbour list at its
cutoff would give, whatever its radial function does beyond it.

Receivers: with per-layer exchange only owned rows receive messages (ghost
features are refreshed from their owners instead); the deep halo lets every real
row receive, since the whole model runs on the block in one go.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from ..layout.capacity import Growth, fitted, regrown
from ..layout.budget import MemoryBudget
from ..layout.partition import search_tree

RECEIVERS = ("owned", "all")
_CHUNK = 1 << 20  # edges keyed and decoded at a time


@dataclasses.dataclass(frozen=True, eq=False)
class EdgePlan:
    """Per-device edge tables for one `HaloPlan`.

    Attributes:
        edges: `(D, edge_capacity, 2)` int32 block rows `(sender, receiver)`; a padding
            edge joins its slot's spare row to itself, `(spare, spare)`.
        shift: `(D, edge_capacity, 3)` float64: the edge vector is `pos[receiver] - pos[sender] +
            shift`. Where the sender is a periodic image `image` (lattice cell, int) of its row's own
            atom, `shift = -image @ basis` in the plan's cell (strain it with the positions); 0 where
            the row itself is meant, and on padding.
        pad_row: `(D,)` int32 the first padding row of each block (`n_owned + n_ghost`).
        spare: `(D, edge_capacity)` int32 the padding row of each edge slot, cycling over all
            padding rows of the block: a padding edge (or a real one beyond the cutoff, inside a
            program) lands there. Spreading them matters: the backward of a gather whose
            indices repeat one row accumulates them one after another (290x slower on an H200
            for MACE's 256-wide features at 10^4 atoms).
        n_edges: `(D,)` real edges per device.
        edge_capacity: static edges per device.
        cutoff: the model's cutoff; `reach`: the list radius (`cutoff + skin`).
        receivers: "owned" (per-layer exchange) or "all" (deep halo).
        growth: the `capacity.Growth` of `edge_capacity` when a kept capacity was grown (else empty).
        receiver_reach: with "all", how far from the owned rows a row still receives (None: every row).
        budget: the `MemoryBudget` the list was checked against (kept for `rebuild`).
    """

    edges: np.ndarray
    shift: np.ndarray
    pad_row: np.ndarray
    spare: np.ndarray
    n_edges: np.ndarray
    edge_capacity: int
    cutoff: float
    reach: float
    receivers: str
    headroom: float
    growth: tuple[Growth, ...] = ()
    receiver_reach: float | None = None
    budget: MemoryBudget | None = None

    @classmethod
    def build(
        cls,
        plan: Any,
        positions: np.ndarray,
        *,
        cutoff: float,
        receivers: str = "owned",
        headroom: float = 1.2,
        edge_capacity: int | None = None,
        grow: bool | str = False,
        receiver_reach: float | None = None,
        budget: MemoryBudget | None = None,
    ) -> EdgePlan:
        """Edges of every device's block for `positions` (the plan's atoms, `(N, 3)`).

        Args:
            plan: a `HaloPlan` whose halo reaches at least `cutoff + plan.skin`.
            positions: `(N, 3)` positions the plan describes.
            cutoff: the model's cutoff (Å).
            receivers: "owned" or "all" (see the module docstring).
            headroom: capacity = `ceil(headroom * most edges on a device)` when one is chosen or grown.
            edge_capacity: a capacity to keep if it suffices; grown otherwise to at least
                `capacity.GROWTH` times itself (`capacity.regrown`), and so is one that has used part of
                its headroom when `grow` (the plan grew: the programs recompile anyway), or any kept one
                when `grow="all"`.
            receiver_reach: with receivers "all", only the rows within this distance (Å) of one of the
                device's owned rows receive (None: every real row). The deep halo of an L-layer model
                needs `(L - 1) * cutoff + skin`: a row farther out feeds no owned atom's energy.
            budget: a `MemoryBudget`: each device's edges are counted as they are found (a host list of
                some tens of bytes per edge), and a device whose rows and edges would cost more raises
                `LayoutBudgetError` before the tables are built.

        Raises:
            ValueError: a bad `receivers`, a cutoff <= 0, or a plan whose halo is
                shallower than `cutoff + skin`.
        """
        if receivers not in RECEIVERS:
            raise ValueError(f"EdgePlan.build: receivers must be one of {RECEIVERS}, got {receivers!r}.")
        if not cutoff > 0:
            raise ValueError(f"EdgePlan.build: cutoff must be > 0 Å, got {cutoff!r}.")
        reach = float(cutoff) + float(plan.skin)
        if plan.cutoff + 1e-12 < float(cutoff):
            raise ValueError(
                f"EdgePlan.build: the plan's halo reaches {plan.cutoff} + skin {plan.skin} Å but the model "
                f"needs cutoff {cutoff} + skin; build the HaloPlan with cutoff >= {cutoff}."
            )
        if receiver_reach is not None and receivers != "all":
            raise ValueError(
                f"EdgePlan.build: receiver_reach={receiver_reach!r} narrows receivers='all' (the deep halo), but "
                f"receivers={receivers!r}; leave receiver_reach None, or pass receivers='all'."
            )
        d, hr = plan.n_devices, plan.halo_rows
        halo = plan.to_halo(np.asarray(positions, dtype=np.float64), positions=True).reshape(d, hr, 3)
        n_pad = np.asarray(plan.n_padded)
        n_own = np.asarray(plan.n_owned)
        own_images = plan.own_images if plan.own_images else (np.zeros((0, 4), np.int64),) * d
        per_device = []  # (sender rows, receivers, moved, images) in the edge order, per device
        for dev in range(d):
            recv = _receivers(halo[dev], int(n_own[dev]), int(n_pad[dev]), receivers, receiver_reach)
            per_device.append(_block_edges(halo[dev], int(n_pad[dev]), own_images[dev], plan.basis, recv, reach))
        n_edges = np.array([len(e[1]) for e in per_device], dtype=np.int64)
        if budget is not None:
            worst = int(np.argmax([budget.cost(int(n_pad[k]), n_edges[k]) for k in range(d)]))
            budget.check("EdgePlan.build", int(n_pad[worst]), int(n_edges[worst]), estimated=False,
                         detail=f"; device {worst}, reach {reach:g} Å")
        need = int(n_edges.max(initial=0))
        fresh, growth = max(1, fitted(need, headroom)), ()
        cap = fresh if edge_capacity is None else edge_capacity
        if edge_capacity is not None and (edge_capacity < need or (grow == "all" or (grow and fresh > edge_capacity))):
            cap = regrown(edge_capacity, fresh)
            growth = (Growth("edge_capacity", edge_capacity, cap, need),)
        pad_row = n_pad.astype(np.int32)
        spare = np.empty((d, cap), dtype=np.int32)
        edges = np.empty((d, cap, 2), dtype=np.int32)
        shift = np.zeros((d, cap, 3))  # `-image @ basis`: most images are zero, so only the others are multiplied
        for dev, (send, recv, moved, image) in enumerate(per_device):
            n = len(recv)
            cycle = max(int(hr) - int(pad_row[dev]), 1)  # the padding rows, cycled (one array op: np.resize
            spare[dev] = pad_row[dev] + np.arange(cap, dtype=np.int32) % cycle  # concatenates cap copies)
            edges[dev, :n, 0], edges[dev, :n, 1] = send, recv
            edges[dev, n:, 0] = edges[dev, n:, 1] = spare[dev, n:]
            shift[dev, moved] = -(image @ plan.basis)
        return cls(edges, shift, pad_row, spare, n_edges, int(cap), float(cutoff), reach, receivers,
                   float(headroom), growth, receiver_reach, budget)

    def rebuild(self, plan: Any, positions: np.ndarray) -> EdgePlan:
        """The edges for a rebuilt plan, keeping this capacity when it suffices (grown otherwise, and with
        the plan's own growth)."""
        return EdgePlan.build(plan, positions, cutoff=self.cutoff, receivers=self.receivers,
                              headroom=self.headroom, edge_capacity=self.edge_capacity, grow=bool(plan.growth),
                              receiver_reach=self.receiver_reach, budget=self.budget)


def _receivers(block: np.ndarray, n_own: int, n_real: int, receivers: str, reach: float | None) -> np.ndarray:
    """Rows of one block that receive edges: the owned rows, every real row, or those within `reach` of an owned row."""
    if receivers == "owned" or n_own == 0 or n_own == n_real:
        return np.arange(n_own)
    if reach is None:
        return np.arange(n_real)
    limit = reach * (1.0 + 1e-9) + 1e-9
    dist, _ = search_tree(block[:n_own]).query(block[n_own:n_real], distance_upper_bound=limit)
    return np.concatenate([np.arange(n_own), n_own + np.flatnonzero(dist <= limit)])  # an owned row is 0 from itself


def _block_edges(block: np.ndarray, n_real: int, own_images: np.ndarray, basis: np.ndarray, recv: np.ndarray,
                 reach: float) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """One block's edges within `reach` into the rows `recv` (ascending).

    Returns `(sender rows, receivers, moved, images)`: the int32 rows of each edge, the edges whose sender
    is an image of its row (indices) and those images' lattice shifts. The points are the block's real
    rows, then the images of its own atoms that are no rows (`own_images`: owned row and lattice shift,
    ordered by both). Pairs of receivers are found once each (`cKDTree.query_pairs`, an edge each way),
    then the other points within reach of a receiver (no search among points that do not receive).
    Edges are ordered by receiver, then sender row, then the sender's lattice shift: one sort of an
    int64 key, the receiver above the sender's rank in the order of rows and shifts (a row's images
    with a negative shift, the row, those with a positive).
    """
    n_pts = n_real + len(own_images)
    if len(recv) == 0 or n_pts < 2:
        return np.zeros(0, np.int32), np.zeros(0, np.int32), np.zeros(0, np.int64), np.zeros((0, 3), np.int64)
    rows = np.concatenate([np.arange(n_real, dtype=np.int32), own_images[:, 0].astype(np.int32)])
    images = own_images[:, 1:]
    points = np.concatenate([block[:n_real], block[own_images[:, 0]] + images @ basis])
    sign = np.zeros(n_pts, np.int64)  # lexicographic sign of each point's shift: -1, 0 (a row) or 1
    sign[n_real:] = np.sign(images[np.arange(len(images)), (images != 0).argmax(axis=1)])
    by_key = np.argsort(rows.astype(np.int64) * 3 + sign + 1, kind="stable")  # own_images are ordered within one
    rank = np.empty(n_pts, np.int64)
    rank[by_key] = np.arange(n_pts)
    others = np.ones(n_pts, bool)
    others[recv] = False
    others = np.flatnonzero(others)
    receivers = search_tree(points[recv])
    pairs = receivers.query_pairs(reach, output_type="ndarray")
    near = search_tree(points[others]).sparse_distance_matrix(receivers, reach, output_type="ndarray")
    bits = n_pts.bit_length()  # the key: receiver (a row) in the high bits, the sender's rank in the low ones
    key = np.empty(2 * len(pairs) + len(near), np.int64)
    high, low = recv.astype(np.int64) << bits, rank[recv]
    parts = [(pairs[:, 1], high, pairs[:, 0], low), (pairs[:, 0], high, pairs[:, 1], low),
             (near["j"], high, near["i"], rank[others])]
    start = 0
    for into, into_key, send, send_key in parts:
        for lo in range(0, len(into), _CHUNK):  # a chunk at a time: the temporaries stay in cache
            hi = min(lo + _CHUNK, len(into))
            np.bitwise_or(into_key[into[lo:hi]], send_key[send[lo:hi]], out=key[start + lo : start + hi])
        start += len(into)
    del pairs, near, parts
    key.sort()
    send_rows, receiver = np.empty(len(key), np.int32), np.empty(len(key), np.int32)
    row_by_rank, image_by_rank = rows[by_key], by_key >= n_real
    moved, moved_images = [np.zeros(0, np.int64)], [np.zeros((0, 3), np.int64)]
    for lo in range(0, len(key), _CHUNK):
        k = key[lo : lo + _CHUNK]
        sender = k & ((1 << bits) - 1)  # the sender's rank
        send_rows[lo : lo + len(k)] = row_by_rank[sender]
        np.right_shift(k, bits, out=receiver[lo : lo + len(k)], casting="unsafe")  # a row: fits int32
        image = np.flatnonzero(image_by_rank[sender])
        moved.append(lo + image)
        moved_images.append(images[by_key[sender[image]] - n_real])
    return send_rows, receiver, np.concatenate(moved), np.concatenate(moved_images)
