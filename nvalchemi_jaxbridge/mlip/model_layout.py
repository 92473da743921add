"""A model's layout for one geometry: the halo plan, its block edges and their device arrays (`ModelState`).

`build_layout` makes the plan and edges (one cutoff for per-layer exchange, `n_layers` cutoffs for the
deep halo, plus skin) within the model's memory budget; `ModelState` holds them with their device arrays
and is a pytree whose static part is the capacities, so a jitted program is reused while they hold.
`active_edges` turns, inside a program, the edges longer than the cutoff at the current positions into
padding edges.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..layout import HaloPlan
from ..layout.budget import MemoryBudget
from ..layout.structure import checked_structure
from .contract import atomic_numbers
from .edges import EdgePlan
from .memory import check_estimate
from .protocol import MessagePassingWrapper
from .tiled import TileArrays
from .tiles import TilePlan


@dataclasses.dataclass(frozen=True, eq=False)
class ModelState:
    """One geometry's layout: the halo plan, its edges and their device arrays.

    Pass it (with new positions) to `DistributedMLIP.update` each step; a pytree,
    so a jitted step takes it as an argument and is reused while capacities stay.
    """

    plan: HaloPlan
    edges: EdgePlan
    cs: Any  # CompiledSpec: the plan's tables on the mesh
    edge_table: jax.Array  # (D * edge_capacity, 2) int32, P(axis)
    edge_shift: jax.Array  # (D * edge_capacity, 3) the edges' shift vectors (model dtype), P(axis)
    spare: jax.Array  # (D * edge_capacity,) int32 padding row of each edge slot, P(axis)
    attrs: jax.Array  # (D * owned_capacity, A) node attributes, owned storage
    numbers: np.ndarray
    cell: np.ndarray
    periodic: tuple[bool, bool, bool]
    fingerprint: Any = None  # state_check.Fingerprint: the driver and the model as they were at prepare
    tiles: TilePlan | None = None  # the block's tiles (None: the block in one go)
    tile_arrays: TileArrays | None = None  # their tables, (D * T, ...) each, P(axis)

    def rows_per_device(self) -> list[dict[str, int]]:
        """Owned, ghost and edge counts per device (what each device computes on), and its tiles' largest
        rows and edges when it is evaluated in tiles."""
        p, e = self.plan, self.edges
        out = [{"owned": int(p.n_owned[d]), "ghost": int(p.n_ghost[d]), "edges": int(e.n_edges[d])}
               for d in range(p.n_devices)]
        if self.tiles is not None:
            for d, row in enumerate(out):
                row.update(tiles=self.tiles.n_tiles, tile_rows=int(self.tiles.n_rows[d].max(initial=0)),
                           tile_edges=int(self.tiles.n_edges[d].max(initial=0)))
        return out


class _Aux:
    """Static part of a ModelState in a jit cache key: only the capacities matter to a program."""

    def __init__(self, state: ModelState):
        self.state = state
        t = state.tiles
        shape = None if t is None else (t.n_tiles, t.row_capacity, t.edge_capacity)
        self.key = (state.edges.edge_capacity, state.cs.tables.static_key, state.fingerprint, shape)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Aux) and self.key == other.key

    def __hash__(self) -> int:
        return hash(self.key)


jax.tree_util.register_pytree_node(
    ModelState,
    lambda s: ((s.cs, s.edge_table, s.edge_shift, s.spare, s.attrs, s.tile_arrays), _Aux(s)),
    lambda aux, ch: dataclasses.replace(aux.state, cs=ch[0], edge_table=ch[1], edge_shift=ch[2], spare=ch[3],
                                        attrs=ch[4], tile_arrays=ch[5]),
)


def active_edges(pos: jax.Array, edges: jax.Array, shift: jax.Array, spare: jax.Array, cutoff: float, far: float
                 ) -> tuple[jax.Array, jax.Array]:
    """Edges within `cutoff` at `pos` kept, the others made padding edges; and each edge's shift.

    Args:
        pos: `(rows, 3)` block positions; edges: `(E, 2)` (sender, receiver); shift: `(E, 3)` the
            edges' shift vectors (`EdgePlan.shift`, strained as `pos` is); spare: `(E,)` the padding
            row of each edge slot (a real sender is always a lower row).

    Returns:
        `(E, 2)` int32 edges and `(E, 3)` shifts (`shift` for kept edges, `far` along x for padding).
    """
    p, s = jax.lax.stop_gradient(pos), jax.lax.stop_gradient(shift)
    vec = p[edges[:, 1]] - p[edges[:, 0]] + s
    keep = (edges[:, 0] != spare) & (jnp.sum(vec * vec, axis=1) < cutoff * cutoff)
    out = jnp.where(keep[:, None], edges, spare[:, None])
    shift = jnp.where(keep[:, None], shift, jnp.asarray([far, 0.0, 0.0], pos.dtype))
    return out.astype(jnp.int32), shift


def padding_length(cutoff: float, skin: float) -> float:
    """Length (Å) of a padding edge's shift: past every cutoff of the block, so its messages are zero."""
    return 3.0 * (cutoff + skin) + 1.0


def halo_depth(wrapper: MessagePassingWrapper, exchange: str) -> float:
    """Halo width without skin: one cutoff (per-layer exchange) or n_layers cutoffs (deep halo)."""
    return wrapper.cutoff if exchange == "per_layer" else wrapper.n_layers * wrapper.cutoff


def build_layout(wrapper: MessagePassingWrapper, exchange: str, positions: Any, numbers: Any, cell: Any, pbc: Any,
                 *, n_devices: int, skin: float, headroom: float, keep: tuple[HaloPlan, EdgePlan] | None = None,
                 cell_changed: bool = False, budget: MemoryBudget | None = None
                 ) -> tuple[HaloPlan, EdgePlan, np.ndarray, np.ndarray, tuple[bool, bool, bool]]:
    """The halo plan (one cutoff, or n_layers cutoffs for the deep halo, plus skin) and its block edges.

    `keep`: a `(plan, edges)` pair of the same atoms and periodicity whose grid, capacities
    and message offsets to keep (grown where they no longer fit, as `HaloPlan.rebuild` does),
    so that programs compiled for it run on the new layout (e.g. after the cell changed). Plan
    and edges grow together: when either must grow, so does every capacity of both that has used
    part of its headroom, or every one after a change of the cell (`cell_changed`: every count scales
    with it), so one compilation covers them all; `plan.growth + edges.growth` say what grew.
    `budget`: refuse a layout whose estimated, then counted, rows and edges per device cost more
    (`memory.check_estimate`, `HaloPlan.build`, `EdgePlan.build`).
    With the deep halo only rows within `(n_layers - 1) * cutoff + skin` of a device's owned atoms
    receive edges: a row farther out feeds no owned atom's energy.
    """
    pos, numbers, cell, periodic = checked_structure(positions, numbers, cell, pbc, wrapper.name)
    numbers = atomic_numbers(numbers, f"{wrapper.name}: numbers")
    kw: dict[str, Any] = {}
    if keep is not None:
        p = keep[0]
        kw = dict(grid=p.grid, owned_capacity=p.owned_capacity, ghost_capacity=p.ghost_capacity,
                  pair_capacities=dict(zip(p.offsets, p.pair_capacities)))

    # Images of a device's own atoms are no rows: their edges carry the lattice shift (EdgePlan.shift).
    if budget is not None:
        check_estimate(wrapper, exchange, pos, cell, periodic, n_devices, skin, budget)
    per_layer = exchange == "per_layer"

    def plan_and_edges(grow: bool, edge_capacity: int | None) -> tuple[HaloPlan, EdgePlan]:
        plan = HaloPlan.build(pos, cell, periodic=periodic, cutoff=halo_depth(wrapper, exchange), skin=skin,
                              n_devices=n_devices, headroom=headroom, self_images=False, grow=grow,
                              grow_all=cell_changed, budget=budget, **kw)
        edges = EdgePlan.build(plan, pos, cutoff=wrapper.cutoff, receivers="owned" if per_layer else "all",
                               headroom=headroom, edge_capacity=edge_capacity,
                               grow=bool(plan.growth) and ("all" if cell_changed else True),
                               receiver_reach=None if per_layer else (wrapper.n_layers - 1) * wrapper.cutoff + skin,
                               budget=budget)
        return plan, edges

    plan, edges = plan_and_edges(False, None if keep is None else keep[1].edge_capacity)
    if edges.growth and not plan.growth:  # the edges grew alone: the plan's capacities grow with them
        plan, again = plan_and_edges(True, edges.edge_capacity)
        edges = dataclasses.replace(again, growth=edges.growth)
    return plan, edges, numbers, cell, periodic
