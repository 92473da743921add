"""The storage policy's exchanges of node features between a model's layers, on the torch front door.

`refresh_halo` (ghost rows set to their owners' values) and `fold_halo` (ghost
partials added into their owners, then refreshed) are the torch side of
`lower/exchange.py`: each runs the lowered program of the policy's transform on
this rank's block through the front door's autograd Functions (`functions`).
"""

from __future__ import annotations

from typing import Any

import torch

from .block_programs import _jax_dtype
from .functions import (
    ScatterOutputsFn,
    apply,
    gather_owned,
    halo_from_owned,
    scatter_outputs_step,
)
from .plan_context import PlanContext, context_for

def _policy_rows(ctx_or_plan: Any, block: torch.Tensor, policy: Any, fn: str) -> tuple[PlanContext, Any, str]:
    """The context, the policy (the plan's default if None) and its kind, checked against the plan and block."""
    from ..lower.exchange import _kind

    ctx = context_for(ctx_or_plan)
    policy = ctx.default_policy() if policy is None else policy
    kind = _kind(policy, fn)
    storage = "halo" if kind in ("halo", "refresh_halo") else "shard"
    if storage != ctx.kind:
        raise ValueError(
            f"{fn}: the policy {policy!r} uses {storage} storage but the plan is a "
            f"{'HaloPlan' if ctx.kind == 'halo' else 'ShardPlan'}; pass the policy of the spec the plan was built for."
        )
    rows = ctx.n_owned + ctx.n_ghost
    if storage == "halo" and (block.ndim == 0 or block.shape[0] != rows):
        raise ValueError(
            f"{fn}: expected this rank's halo block of n_owned + n_ghost = {ctx.n_owned} + {ctx.n_ghost} = {rows} "
            f"rows, got shape {tuple(block.shape)}; build it with ShardTensor.from_global(x, plan, layout='halo')."
        )
    if storage == "shard" and (block.ndim == 0 or block.shape[0] < ctx.n_owned):
        raise ValueError(
            f"{fn}: expected this rank's n_owned={ctx.n_owned} owned rows (then any pad rows), got shape "
            f"{tuple(block.shape)}."
        )
    return ctx, policy, kind


def refresh_halo(ctx_or_plan: Any, block: torch.Tensor, policy: Any = None) -> torch.Tensor:
    """The policy's refresh of this rank's block: ghost rows replaced by their owners' current values.

    Halo policies (`gather_mode="halo_read"`): `(n_owned + n_ghost, *F)` -> the same
    rows, owned rows unchanged; backward sums the ghost rows' gradients into
    their owners (the reverse exchange) and gives ghost rows zero.
    `gather_mode="local"` and `PlainShard`: the block itself (off).
    `GraphParallelPolicy`: `(n_owned + k, *F)` -> `(n_global + k, *F)`, every
    rank's owned rows in global-id order, the `k` trailing pad rows kept.

    Args:
        ctx_or_plan: the `HaloPlan` / `ShardPlan` (or its `PlanContext`).
        block: this rank's block (a plain tensor, or the data of a `ShardTensor`).
        policy: the storage policy (optional, default the plan's: `HaloStoragePolicy()`
            for a halo plan, `PlainShard()` for a shard plan).

    Returns:
        The refreshed block (differentiable, double backward included).

    Raises:
        ValueError: the policy's storage differs from the plan's, or the block has the wrong rows.
    """
    from ..lower.exchange import exchanges_of

    ctx, policy, kind = _policy_rows(ctx_or_plan, block, policy, "refresh_halo")
    if not exchanges_of(policy)[0]:
        return block
    if kind in ("halo", "refresh_halo"):
        return halo_from_owned(ctx, block[: ctx.n_owned], positions=False)
    full = gather_owned(ctx, block[: ctx.n_owned])  # graph parallel
    return full if block.shape[0] == ctx.n_owned else torch.cat([full, block[ctx.n_owned:]])


def fold_halo(ctx_or_plan: Any, block: torch.Tensor, policy: Any = None) -> torch.Tensor:
    """The policy's fold (ScatterOutputs) of this rank's block: ghost partials added into owners, then refreshed.

    `HaloStoragePolicy` (`scatter_mode="halo_correction"`): `(n_owned + n_ghost, *F)`
    -> the same rows, every copy of an atom holding its total over all ranks;
    self-adjoint. `scatter_mode="local"`, `RefreshOnlyHaloPolicy`,
    `GraphParallelPolicy`, `PlainShard`: the block itself.

    Args:
        ctx_or_plan: the `HaloPlan` / `ShardPlan` (or its `PlanContext`).
        block: this rank's block.
        policy: the storage policy (optional, default the plan's, as in `refresh_halo`).

    Returns:
        The folded block (differentiable).

    Raises:
        ValueError: the policy's storage differs from the plan's, or the block has the wrong rows.
    """
    from ..lower.exchange import exchanges_of

    ctx, policy, _ = _policy_rows(ctx_or_plan, block, policy, "fold_halo")
    if exchanges_of(policy)[1]:
        step = scatter_outputs_step(ctx, tuple(block.shape), _jax_dtype(block))
        return apply(ScatterOutputsFn, block, step)
    return block
