"""How many tiles a device's block needs for a memory budget, from the model's measured cost (`memory_probe`).

`tiles="auto"`: the block in one go when its predicted peak fits the budget, else the fewest tiles whose
largest one fits (tiles are built, their rows and edges counted, and the count raised until the largest
fits). A budget that even a one-atom tile exceeds is an error before anything large is allocated. The
choice is logged once per layout at INFO: the tiles, the largest tile's rows, edges and predicted peak,
and about how many atoms per device one tile holds at this density.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable
from typing import Any

import numpy as np

from ..layout.budget import LayoutBudgetError, MemoryBudget
from .memory_probe import ModelCost

LOG = logging.getLogger(__name__)

MOST_TURNS = 12
"""How many tile counts `choose` tries before it gives up (each try builds the tiles)."""


@dataclasses.dataclass(frozen=True)
class TileChoice:
    """The chosen tiles per device (1: the block in one go) and what the memory model predicts for them."""

    tiles: int
    rows: int  # of the largest tile (of the block with one tile)
    edges: int
    predicted_bytes: float
    budget_bytes: float
    atoms_per_tile: float  # owned atoms one tile of the predicted peak holds at this block's rows and edges per atom

    def describe(self) -> str:
        return (f"{self.tiles} tile(s) per device; largest {self.rows:,} rows and {self.edges:,} edges, predicted "
                f"peak {self.predicted_bytes / 2**30:.3g} GiB of the {self.budget_bytes / 2**30:.3g} GiB budget; "
                f"one tile holds about {self.atoms_per_tile:,.0f} owned atoms at this density")


def choose(cost: ModelCost, budget: MemoryBudget, block_rows: np.ndarray, block_edges: np.ndarray,
           owned: np.ndarray, build: Callable[[int], Any], where: str, held: float = 0.0
           ) -> tuple[TileChoice, Any]:
    """The fewest tiles whose largest fits `budget` under `cost`, and the tiles built (None for one tile).

    Args:
        block_rows, block_edges, owned: `(D,)` each device's block rows, edges and owned atoms.
        held: bytes the block's tables hold beside a tile (`memory.tables_budget`).
        build: `build(T)` returns a `tiles.TilePlan` of `T` tiles per device.

    Raises:
        LayoutBudgetError: no tile count fits (even a tile of one owned atom), with the numbers and the fix.
    """
    free = budget.bytes - held
    whole = cost.predict(block_rows, block_edges)
    worst = int(np.argmax(whole))
    per_atom = (cost.predict(block_rows[worst], block_edges[worst]) - cost.fixed) / max(int(owned[worst]), 1)
    fits_atoms = max(free - cost.fixed, 0.0) / max(per_atom, 1e-30)
    if whole[worst] <= free:
        choice = TileChoice(1, int(block_rows[worst]), int(block_edges[worst]), float(whole[worst]), free, fits_atoms)
        LOG.info("%s: %s", where, choice.describe())
        return choice, None
    most = max(int(owned.max(initial=1)), 2)
    n = min(max(2, math.ceil(whole[worst] / free)), most)
    for _ in range(MOST_TURNS):
        tiles = build(n)
        peak = cost.predict(tiles.n_rows, tiles.n_edges)
        d, t = np.unravel_index(int(np.argmax(peak)), peak.shape)
        if peak[d, t] <= free:
            choice = TileChoice(n, int(tiles.n_rows[d, t]), int(tiles.n_edges[d, t]), float(peak[d, t]), free,
                                fits_atoms)
            LOG.info("%s: %s", where, choice.describe())
            return choice, tiles
        if n >= most:
            break
        n = min(most, max(n + 1, math.ceil(n * min(4.0, 1.25 * peak[d, t] / free))))
    raise LayoutBudgetError(
        f"{where}: no tile count fits the memory budget of {budget.bytes / 2**30:.3g} GiB per device ("
        f"{free / 2**30:.3g} GiB beside the block's tables): with {n} tiles the "
        f"largest still needs about {float(peak.max()) / 2**30:.3g} GiB ({cost.bytes_per_row:,.0f} B per row and "
        f"{cost.bytes_per_edge:,.0f} B per edge, measured); nothing large was allocated. Fix: a larger "
        f"memory_budget= where the memory is there, or more devices."
    )


def layout_tiles(tiles: int | str, plan: Any, edges: Any, positions: np.ndarray, *, n_layers: int, headroom: float,
                 budget: MemoryBudget, keep: Any, cost: Callable[[], ModelCost], name: str
                 ) -> tuple[Any, TileChoice | None]:
    """A layout's tiles for `tiles=` (None for 1), and the choice made for "auto" (None when none was made now).

    Both front doors call it with a deep-halo block (`plan`, `edges`) and its `positions`. `keep`: the
    previous layout's `TilePlan` (its capacities kept where they suffice; with "auto", its tile count while
    its largest tile still fits). `cost()`: the model's measured `ModelCost` (asked for only with "auto").

    Raises:
        LayoutBudgetError: explicit tiles whose largest costs more than `budget`, or no tile count that fits.
    """
    from .memory import check_tiles_fit, tables_budget
    from .tiles import TilePlan

    if tiles == 1:
        return None, None
    pos = np.asarray(positions, dtype=np.float64)

    def build(n: int) -> Any:
        return TilePlan.build(plan, edges, pos, n_tiles=n, n_layers=n_layers, headroom=headroom)

    if tiles != "auto":
        out = keep.rebuild(plan, edges, pos, n_layers) if keep is not None and keep.n_tiles == tiles else build(tiles)
        check_tiles_fit(budget, out, f"{name} (deep_halo, {tiles} tiles per device)")
        return out, None
    model_cost = cost()
    held = float(tables_budget(budget, 0).cost(plan.n_padded, edges.n_edges).max())
    if keep is not None:
        again = keep.rebuild(plan, edges, pos, n_layers)
        if model_cost.predict(again.n_rows, again.n_edges).max() <= budget.bytes - held:
            return again, None
    choice, out = choose(model_cost, budget, plan.n_padded, edges.n_edges, plan.n_owned, build,
                         f"{name} (deep_halo, tiles='auto')", held=held)
    return out, choice
