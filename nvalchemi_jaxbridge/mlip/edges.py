"""Edges of each device's block: a neighbour list with a static capacity, grown, never cut.

The list is built on the host (scipy's `cKDTree`, open boundaries) from the plan's
halo positions, with radius `cutoff + skin`, so it stays a superset of the pairs
within `cutoff` until the plan needs a rebuild (an atom moved more than `skin / 2`).
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

RECEIVERS = ("owned", "all")


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

        Raises:
            ValueError: a bad `receivers`, a cutoff <= 0, or a plan whose halo is
                shallower than `cutoff + skin`.
        """
        from scipy.spatial import cKDTree

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
        d, hr = plan.n_devices, plan.halo_rows
        halo = plan.to_halo(np.asarray(positions, dtype=np.float64), positions=True).reshape(d, hr, 3)
        n_pad = np.asarray(plan.n_padded)
        n_own = np.asarray(plan.n_owned)
        own_images = plan.own_images if plan.own_images else (np.zeros((0, 4), np.int64),) * d
        per_device = []
        for dev in range(d):
            n_real, imgs = int(n_pad[dev]), own_images[dev]
            # the rows, then the images of the device's own atoms that are no rows (as extra points)
            pts = np.concatenate([halo[dev, :n_real], halo[dev, imgs[:, 0]] + imgs[:, 1:] @ plan.basis])
            pairs = cKDTree(pts).query_pairs(reach, output_type="ndarray") if len(pts) > 1 else np.zeros((0, 2), int)
            both = np.concatenate([pairs, pairs[:, ::-1]])  # (sender, receiver)
            both = both[both[:, 1] < (n_own[dev] if receivers == "owned" else n_real)]  # an image never receives
            extra = both[:, 0] >= n_real
            image = np.zeros((len(both), 3), dtype=np.int64)
            image[extra] = imgs[both[extra, 0] - n_real, 1:]
            both[extra, 0] = imgs[both[extra, 0] - n_real, 0]
            order = np.lexsort((image[:, 2], image[:, 1], image[:, 0], both[:, 0], both[:, 1]))
            per_device.append((both[order].astype(np.int32), image[order].astype(np.int32)))
        n_edges = np.array([len(e) for e, _ in per_device], dtype=np.int64)
        need = int(n_edges.max(initial=0))
        fresh, growth = max(1, fitted(need, headroom)), ()
        cap = fresh if edge_capacity is None else edge_capacity
        if edge_capacity is not None and (edge_capacity < need or (grow == "all" or (grow and fresh > edge_capacity))):
            cap = regrown(edge_capacity, fresh)
            growth = (Growth("edge_capacity", edge_capacity, cap, need),)
        pad_row = n_pad.astype(np.int32)
        spare = (pad_row[:, None] + np.arange(cap)[None, :] % (hr - pad_row)[:, None]).astype(np.int32)
        edges = np.repeat(spare[:, :, None], 2, axis=2)
        image = np.zeros((d, cap, 3), dtype=np.int32)
        for dev, (e, im) in enumerate(per_device):
            edges[dev, : len(e)] = e
            image[dev, : len(e)] = im
        return cls(edges, -(image @ plan.basis), pad_row, spare, n_edges, int(cap), float(cutoff), reach, receivers,
                   float(headroom), growth)

    def rebuild(self, plan: Any, positions: np.ndarray) -> EdgePlan:
        """The edges for a rebuilt plan, keeping this capacity when it suffices (grown otherwise, and with
        the plan's own growth)."""
        return EdgePlan.build(plan, positions, cutoff=self.cutoff, receivers=self.receivers,
                              headroom=self.headroom, edge_capacity=self.edge_capacity, grow=bool(plan.growth))
