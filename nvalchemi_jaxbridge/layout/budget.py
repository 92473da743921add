"""A memory budget for layouts: rows and edges per device, estimated and counted before they are allocated.

What one device holds grows with its rows (owned and ghost atoms) and its edges, and what a
model keeps per evaluation grows the same way (features per row, messages per edge, and their
gradients). A layout that would not fit is refused, with its numbers and the fix, instead of
being allocated until the process is killed: the deep halo of a 3-layer model on 32 atoms in a
skewed cell once built ~850,000 edges per device (the model's own graph has 1,860) and was
killed at 20-24 GB.

Three checks, each before the allocation it guards:

1. `estimate` (from the cell, the reach and the atom density alone): a device's rows are the atoms
   within `reach` of its domain, `rho * vol(domain + ball(reach))` (Steiner's formula for a
   parallelepiped: `V + S r + pi r^2 (|a| + |b| + |c|) + 4/3 pi r^3`, clipped to the atoms' extent on
   open axes), its edges its receivers times `rho * 4/3 pi r_edge^3`;
2. the partition counts each rank's rows exactly while it lists them (`partition.find_ghosts`);
3. the edge list counts each device's edges exactly as it finds them, before it builds their tables
   (`mlip.edges.EdgePlan.build`; the list it counts takes some tens of bytes per edge on the host).

The cost of a layout is `rows * bytes_per_row + edges * bytes_per_edge` per device: a rough
figure for a small model's forward and backward (the defaults), not an accounting.
"""

from __future__ import annotations

import dataclasses
import math
import os

import numpy as np

BYTES_PER_ROW = 2048
"""Bytes an evaluation keeps per block row (node features and their gradients; a rough default)."""

BYTES_PER_EDGE = 4096
"""Bytes an evaluation keeps per edge (edge vectors, radial basis, messages and their gradients; a rough default:
the 3-layer MPNN's deep halo on 8 CPU devices took ~3.6 KB per edge of peak RSS)."""

DEFAULT_FRACTION = 0.5
"""Share of the available memory a layout may use by default (its cost per row and edge is a rough guess)."""

MEASURED_FRACTION = 0.8
"""Share used by default with `tiles="auto"`, whose cost per row and edge is the model's, measured: its predicted
peaks were 0.98-0.99x the measured ones on an H200 from 1,372 to 10^6 atoms (MACE, benchmarks `tiles`), so the
fifth left covers what the prediction leaves out (allocator slack, other arrays) with margin."""


class LayoutBudgetError(ValueError):
    """A layout would not fit its memory budget: the message gives the counts, the budget and the fix."""


@dataclasses.dataclass(frozen=True)
class MemoryBudget:
    """Bytes one device's layout may take, and how to say what to do when it does not fit.

    Attributes:
        bytes: budget per device.
        fix: what the caller can change (the model level names per-layer exchange and more devices).
        bytes_per_row, bytes_per_edge: cost of one row and one edge.
    """

    bytes: float
    fix: str = "use more devices, or a smaller cutoff + skin"
    bytes_per_row: float = BYTES_PER_ROW
    bytes_per_edge: float = BYTES_PER_EDGE

    def __post_init__(self) -> None:
        if not (isinstance(self.bytes, (int, float, np.integer, np.floating)) and self.bytes > 0):
            raise ValueError(f"MemoryBudget: bytes must be a number > 0 (bytes per device), got {self.bytes!r}.")

    @property
    def max_rows(self) -> int:
        """Rows per device that fill the budget with no edges at all."""
        return int(self.bytes // self.bytes_per_row)

    def cost(self, rows: float, edges: float) -> float:
        """Estimated bytes of `rows` rows and `edges` edges on one device."""
        return rows * self.bytes_per_row + edges * self.bytes_per_edge

    def check(self, where: str, rows: float, edges: float, *, estimated: bool, detail: str = "") -> None:
        """Raise `LayoutBudgetError` if `rows` and `edges` per device cost more than the budget."""
        cost = self.cost(rows, edges)
        if cost <= self.bytes:
            return
        how = "estimated from the cell, the reach and the atom density" if estimated else "counted"
        raise LayoutBudgetError(
            f"{where}: the layout needs {rows:,.0f} rows and {edges:,.0f} edges on one device ({how}{detail}), "
            f"about {_gb(cost)} at {self.bytes_per_row:g} B per row and {self.bytes_per_edge:g} B per edge, above "
            f"the memory budget of {_gb(self.bytes)} per device; nothing was allocated. Fix: {self.fix}."
        )


def _gb(n: float) -> str:
    return f"{n / 1e9:.3g} GB"


def host_available_bytes() -> float:
    """Memory the host can still give (Linux `MemAvailable`; elsewhere the physical memory)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def _grown_volume(edges: np.ndarray, r: float) -> float:
    """Volume of the parallelepiped with edge vectors `edges` (rows) grown by a ball of radius `r` (Steiner)."""
    volume = abs(float(np.linalg.det(edges)))
    faces = 2.0 * sum(float(np.linalg.norm(np.cross(edges[i], edges[j]))) for i, j in ((0, 1), (1, 2), (0, 2)))
    lengths = float(np.linalg.norm(edges, axis=1).sum())
    return volume + faces * r + math.pi * r * r * lengths + 4.0 / 3.0 * math.pi * r**3


@dataclasses.dataclass(frozen=True)
class LayoutEstimate:
    """Estimated rows (owned + ghost, with images of own atoms) and edges of an average device."""

    rows: float
    edges: float


def estimate(positions: np.ndarray, basis: np.ndarray, periodic: tuple[bool, bool, bool], grid: tuple[int, ...],
             halo_reach: float, edge_reach: float, receiver_reach: float | None) -> LayoutEstimate:
    """Rows and edges of an average device, from the cell, the reaches and the atom density (no table built).

    Args:
        positions: `(N, 3)` (only their count and, on open axes, their extent are used).
        basis: `(3, 3)` the plan's lattice (`partition.effective_cell`); grid: domains per axis.
        halo_reach: cutoff + skin of the halo; edge_reach: of the edges.
        receiver_reach: rows within this distance of the device's own atoms receive edges (None: owned only).
    """
    n = len(positions)
    if n == 0:
        return LayoutEstimate(0.0, 0.0)
    frac = positions @ np.linalg.inv(basis)
    edges = np.array(basis, dtype=np.float64)
    clip = []  # per open axis: the domain's and the atoms' perpendicular extent
    widths = 1.0 / np.linalg.norm(np.linalg.inv(basis), axis=0)
    for k in range(3):
        if periodic[k]:
            edges[k] = basis[k] / grid[k]
        else:
            span = max(float(np.ptp(frac[:, k])), 1e-3)
            edges[k] = basis[k] * span / grid[k]
            clip.append((widths[k] * span / grid[k], widths[k] * span))
    rho = n / (abs(float(np.linalg.det(edges))) * math.prod(grid))

    def atoms_within(r: float) -> float:
        grown = _grown_volume(edges, r)
        for own, extent in clip:  # the ball finds no atoms beyond their extent on an open axis
            grown *= min(1.0, extent / (own + 2.0 * r))
        return rho * grown

    rows, owned = atoms_within(halo_reach), n / math.prod(grid)
    # images of a device's own atoms are no rows (`self_images=False`), so they never receive
    others = (math.prod(grid) - 1) / math.prod(grid)
    receivers = owned if receiver_reach is None else owned + others * max(atoms_within(receiver_reach) - owned, 0.0)
    neighbours = min(rho * 4.0 / 3.0 * math.pi * edge_reach**3, rows)
    return LayoutEstimate(rows, min(receivers, rows) * neighbours)


def rows_over_budget(rank: int, n_owned: int, n_ghost: int, max_rows: int, reach: float, fix: str) -> None:
    """The error of a partition whose rank `rank` holds more than `max_rows` rows (raised while it lists them)."""
    raise LayoutBudgetError(
        f"HaloPlan: rank {rank} would hold at least {n_owned + n_ghost:,} rows ({n_owned:,} owned and {n_ghost:,} "
        f"images within reach {reach:g} Å so far), above the {max_rows:,} rows its memory budget allows; the rest "
        f"was not listed. Fix: {fix}."
    )
