"""`ShardMeta`: what a ShardTensor's metadata says, the checks of a block against it, what a result inherits.

A block's metadata is its plan context, layout ("owned", "halo" or
"replicated"), whether it holds positions, and the spec in use. A torch result
keeps the metadata that still describes its rows (`meta_for`, `_prefix_meta`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

LAYOUTS = ("owned", "halo", "replicated")


@dataclasses.dataclass(frozen=True, eq=False)
class ShardMeta:
    """What a ShardTensor knows besides its data: plan context, layout and roles."""

    context: Any  # plan_context.PlanContext: plan, mesh, rank, device tables
    layout: str
    positions: bool = False
    spec: Any = None

    @property
    def plan(self) -> Any:
        """The layout plan (`HaloPlan` or `ShardPlan`)."""
        return self.context.plan

    def base_rows(self) -> int | None:
        """Rows of this rank's block before trailing pad rows; None for replicated data."""
        c = self.context
        if self.layout == "owned":
            return c.n_owned
        if self.layout == "halo":
            return c.n_owned + c.n_ghost
        return None


def _prefix_meta(meta: ShardMeta, out: torch.Tensor) -> ShardMeta | None:
    """The layout of a result that starts with a block's first rows (`x[:k]`, `cat([x, pad])`), or None.

    At least the layout's rows: the same layout (further rows are pad rows).
    Exactly the owned rows of a halo block: "owned", except for positions (a halo
    block holds them in the wrapped frame, which an owned block does not).
    """
    rows, base, n_owned = out.shape[0] if out.ndim else -1, meta.base_rows(), meta.context.n_owned
    if base is not None and rows >= base:
        return meta
    if rows == n_owned and not meta.positions:
        return ShardMeta(meta.context, "owned", False, meta.spec)
    return None


def _check_positions(where: str, t: torch.Tensor, positions: bool) -> None:
    """Raise (TypeError) if a block declared as positions is not real floating point."""
    if positions and not torch.is_floating_point(t):
        why = "its imaginary part would be dropped" if t.is_complex() else \
            "the periodic image shifts added in a halo exchange would be truncated"
        raise TypeError(
            f"{where}(positions=True): positions must be real floating point, got {t.dtype}; {why}. Convert "
            "explicitly: positions.to(torch.float64) (numpy: positions.astype(np.float64))."
        )


def _check_rows(where: str, t: torch.Tensor, meta: ShardMeta) -> None:
    """Raise unless `t` has at least the rows `meta`'s layout needs on this rank."""
    base = meta.base_rows()
    if base is None:
        return
    if t.ndim == 0 or t.shape[0] < base:
        c = meta.context
        what = "n_owned" if meta.layout == "owned" else "n_owned + n_ghost"
        raise ValueError(
            f"{where}: rank {c.rank} needs {what} = {base} rows for layout {meta.layout!r} but the "
            f"block has shape {tuple(t.shape)}; pass this rank's block (plan rows in order, trailing pad "
            "rows allowed) or choose the matching layout"
        )


def meta_for(t: torch.Tensor, candidates: list[tuple[ShardMeta, tuple[int, ...]]]) -> ShardMeta | None:
    """The metadata a result `t` inherits: the first candidate with the same leading dimension."""
    lead = t.shape[0] if t.ndim else None
    for meta, shape in candidates:
        if (shape[0] if shape else None) != lead:
            continue
        if meta.layout == "replicated" and tuple(t.shape) != shape and t.ndim == 0:
            continue
        return meta
    return None
