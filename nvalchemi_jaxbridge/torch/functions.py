"""Transforms as `torch.autograd.Function`s that run the lowered JAX programs on local blocks.

Each transform is a `Step` (forward and adjoint, torch -> torch) built once per
context, shape and dtype from the programs of `block_programs` (built from
`nvalchemi_jaxbridge.lower.collectives`). Backward runs the program's VJP;
backward's backward runs the forward again, so force training (double
backward) works too.

Per-rank adjoint of `AllReduceSum`: in torch each rank consumes its own copy
of the sum, so the cotangent a rank receives is its partial. The program is
therefore `psum` followed by a cast to per-device (varying) values, whose VJP
sums the partial cotangents over ranks (`replicated_consumer=False`), or the
lowered identity-adjoint sum (`replicated_consumer=True`), where every rank
already holds the global cotangent.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import torch

from ..lower import collectives as col
from .block_programs import Program, _bind, _call, _jax_dtype, _padder, _program, run
from .plan_context import PlanContext as PlanContext  # re-exported: callers of the transforms take
from .plan_context import context_for as context_for  # their context from this module too
from .plan_context import front_door_mesh as front_door_mesh


def _cached_step(ctx: PlanContext, key: tuple, build: Callable[[], Step]) -> Step:
    """`build()`, kept in `ctx.memo` under `key` (built once per context, transform, shape and dtype)."""
    memo = ctx.memo
    step = memo.get(key)
    if step is None:
        step = memo[key] = build()
    return step


@dataclasses.dataclass(frozen=True, eq=False)
class Step:
    """One linear (or affine) map of local blocks: its forward and its adjoint, as torch -> torch."""

    forward: Callable[[torch.Tensor], torch.Tensor]
    backward: Callable[[torch.Tensor], torch.Tensor]
    linear: Callable[[torch.Tensor], torch.Tensor] | None = None  # forward without its constant term

    def adjoint(self) -> Step:
        """The step whose forward is this step's backward."""
        return Step(self.backward, self.linear or self.forward)


class _Transform(torch.autograd.Function):
    """Base: forward runs `step.forward`, backward runs `step.backward` (itself differentiable)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, step: Step) -> torch.Tensor:
        ctx.step = step
        return step.forward(x.detach())

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        return AdjointFn.apply(g.contiguous(), ctx.step.adjoint()), None


class GatherInputsFn(_Transform):
    """GatherInputs: owned rows -> owned + ghost rows (forward halo exchange)."""


class ScatterOutputsFn(_Transform):
    """ScatterOutputs: reverse then forward halo exchange of a kernel output."""


class AllReduceSumFn(_Transform):
    """AllReduceSum: the sum over ranks, held by every rank."""


class GatherInputsFullFn(_Transform):
    """GatherInputsFull: owned rows -> all rows in global-id order."""


class SliceOutputsOwnedFn(_Transform):
    """SliceOutputsOwned: all rows -> this rank's owned rows."""


class GatherOwnedFn(_Transform):
    """`ShardTensor.full_tensor()`: owned rows of every rank in global-id order."""


class AdjointFn(_Transform):
    """The adjoint of a transform (what backward runs); differentiable again."""


def gather_inputs_step(ctx: PlanContext, shape: tuple[int, ...], dtype: Any, *, positions: bool) -> Step:
    """Owned block `(n_owned, *F)` -> halo block `(n_owned + n_ghost, *F)`."""
    key = ("gather_inputs", tuple(shape), np.dtype(dtype), positions)
    return _cached_step(ctx, key, lambda: _gather_inputs_step(ctx, tuple(shape), dtype, positions))


def _gather_inputs_step(ctx: PlanContext, shape: tuple[int, ...], dtype: Any, positions: bool) -> Step:
    """Build `gather_inputs_step`'s step."""
    tail = tuple(shape[1:])
    n_pad, oc, hr, n_owned = ctx.n_owned + ctx.n_ghost, ctx.owned_capacity, ctx.halo_rows, ctx.n_owned
    progs = {
        p: _program(ctx, f"gather_inputs(positions={p})",
                    functools.partial(_halo_forward, axis=ctx.axis, positions=p),
                    (oc,) + tail, dtype, tables=ctx.tables)
        for p in {positions, False}
    }
    fwd_p, lin_p, adj_p = _bind(ctx, progs[positions]), _bind(ctx, progs[False]), _bind(ctx, progs[False], adjoint=True)
    pad, name = _padder(ctx), "GatherInputs argument"
    fwd = lambda x: run(ctx, fwd_p, pad(x, oc), n_pad, name)  # noqa: E731
    bwd = lambda g: run(ctx, adj_p, pad(g, hr), n_owned, name)  # noqa: E731
    lin = lambda x: run(ctx, lin_p, pad(x, oc), n_pad, name)  # noqa: E731
    return Step(fwd, bwd, lin)


def _halo_forward(x: jax.Array, t: Any, *, axis: str, positions: bool) -> jax.Array:
    """`collectives.halo_forward` with keyword arguments bound (for partial)."""
    return col.halo_forward(x, t, axis, positions=positions)


def scatter_outputs_step(ctx: PlanContext, shape: tuple[int, ...], dtype: Any) -> Step:
    """Halo block `(n_owned + n_ghost, *F)` -> the same rows, ghost partials folded into owners."""
    key = ("scatter_outputs", tuple(shape), np.dtype(dtype))
    return _cached_step(ctx, key, lambda: _scatter_outputs_step(ctx, tuple(shape), dtype))


def _scatter_outputs_step(ctx: PlanContext, shape: tuple[int, ...], dtype: Any) -> Step:
    """Build `scatter_outputs_step`'s step."""
    n_pad, hr = ctx.n_owned + ctx.n_ghost, ctx.halo_rows
    prog = _program(ctx, "scatter_outputs", functools.partial(_halo_scatter, axis=ctx.axis),
                    (hr,) + tuple(shape[1:]), dtype, tables=ctx.tables)
    fwd_p, adj_p = _bind(ctx, prog), _bind(ctx, prog, adjoint=True)
    pad, name = _padder(ctx), "ScatterOutputs output"
    fwd = lambda x: run(ctx, fwd_p, pad(x, hr), n_pad, name)  # noqa: E731
    bwd = lambda g: run(ctx, adj_p, pad(g, hr), n_pad, name)  # noqa: E731
    return Step(fwd, bwd)


def _halo_scatter(x: jax.Array, t: Any, *, axis: str) -> jax.Array:
    """`collectives.halo_scatter` with the axis bound."""
    return col.halo_scatter(x, t, axis)


def _sum_per_rank(x: jax.Array, *, axis: str, replicated_consumer: bool) -> jax.Array:
    """All-reduce whose result each device holds and consumes as its own (varying) value."""
    if replicated_consumer:
        return col.all_reduce_sum(x, axis, replicated_consumer=True)
    return jax.lax.pcast(col.all_reduce_sum(x, axis), axis, to="varying")


def all_reduce_step(ctx: PlanContext, shape: tuple[int, ...], dtype: Any, *, replicated_consumer: bool) -> Step:
    """Any-shape partial -> the sum over ranks (same shape)."""
    key = ("all_reduce_sum", tuple(shape), np.dtype(dtype), replicated_consumer)
    return _cached_step(ctx, key, lambda: _all_reduce_step(ctx, tuple(shape), dtype, replicated_consumer))


def _all_reduce_step(ctx: PlanContext, shape: tuple[int, ...], dtype: Any, replicated_consumer: bool) -> Step:
    """Build `all_reduce_step`'s step."""
    local = (1,) + tuple(shape)
    fn = functools.partial(_sum_per_rank, axis=ctx.axis, replicated_consumer=replicated_consumer)
    prog = _program(ctx, f"all_reduce_sum(replicated_consumer={replicated_consumer})", fn, local, dtype)
    fwd_p, adj_p = _bind(ctx, prog), _bind(ctx, prog, adjoint=True)
    name = "AllReduceSum output"

    def go(x: torch.Tensor, program: Callable[[jax.Array], jax.Array]) -> torch.Tensor:
        return run(ctx, program, x.reshape(local), 1, name).reshape(shape)

    return Step(lambda x: go(x, fwd_p), lambda g: go(g, adj_p))


def gather_full_step(ctx: PlanContext, shape: tuple[int, ...], dtype: Any) -> Step:
    """Owned block `(n_owned, *F)` -> `(n_global, *F)` in global-id order (sharded storage)."""
    key = ("gather_full", tuple(shape), np.dtype(dtype))
    return _cached_step(ctx, key, lambda: _gather_full_step(ctx, tuple(shape), dtype))


def _gather_full_step(ctx: PlanContext, shape: tuple[int, ...], dtype: Any) -> Step:
    """Build `gather_full_step`'s step."""
    t = ctx.tables if ctx.kind == "shard" else ctx.shard_tables
    prog = _program(ctx, "gather_full", functools.partial(_gather_full, axis=ctx.axis),
                    (ctx.owned_capacity,) + tuple(shape[1:]), dtype, tables=t)
    return _shard_step(ctx, prog, t, ctx.owned_capacity, ctx.n_global, ctx.n_owned, "GatherInputsFull argument")


def _gather_full(x: jax.Array, t: Any, *, axis: str) -> jax.Array:
    """`collectives.gather_full` with the axis bound."""
    return col.gather_full(x, t, axis)


def slice_outputs_owned_step(ctx: PlanContext, shape: tuple[int, ...], dtype: Any) -> Step:
    """Kernel output `(n_global, *F)` -> this rank's owned rows `(n_owned, *F)`."""
    key = ("slice_outputs_owned", tuple(shape), np.dtype(dtype))
    return _cached_step(ctx, key, lambda: _slice_outputs_owned_step(ctx, tuple(shape), dtype))


def _slice_outputs_owned_step(ctx: PlanContext, shape: tuple[int, ...], dtype: Any) -> Step:
    """Build `slice_outputs_owned_step`'s step."""
    t = ctx.tables
    prog = _program(ctx, "slice_outputs_owned", functools.partial(_slice_owned_out, axis=ctx.axis),
                    (ctx.n_global,) + tuple(shape[1:]), dtype, tables=t)
    return _shard_step(ctx, prog, t, ctx.n_global, ctx.n_owned, ctx.n_global, "SliceOutputsOwned output")


def _slice_owned_out(x: jax.Array, t: Any, *, axis: str) -> jax.Array:
    """`collectives.slice_outputs_owned` with the axis bound."""
    return col.slice_outputs_owned(x, t, axis)


def _shard_step(ctx: PlanContext, prog: Program, tables: Any, in_rows: int, out_rows: int, back_rows: int,
                name: str) -> Step:
    """A step over shard tables (which may differ from `ctx.tables` for a halo plan)."""
    fwd_p, adj_p = _bind(ctx, prog, tables=tables), _bind(ctx, prog, adjoint=True, tables=tables)
    pad = _padder(ctx)
    out_cap = ctx.n_global if in_rows == ctx.owned_capacity else ctx.owned_capacity
    fwd = lambda x: _call(ctx, fwd_p, pad(x, in_rows), name)[:out_rows]  # noqa: E731
    bwd = lambda g: _call(ctx, adj_p, pad(g, out_cap), name)[:back_rows]  # noqa: E731
    return Step(fwd, bwd)


def apply(fn: type[_Transform], x: torch.Tensor, step: Step) -> torch.Tensor:
    """Run a transform Function on a plain (or ShardTensor) block, autograd included."""
    with torch._C.DisableTorchFunctionSubclass():
        return fn.apply(x, step)


def halo_from_owned(ctx: PlanContext, owned: torch.Tensor, *, positions: bool) -> torch.Tensor:
    """Forward halo exchange of an owned block (differentiable)."""
    step = gather_inputs_step(ctx, tuple(owned.shape), _jax_dtype(owned), positions=positions)
    return apply(GatherInputsFn, owned, step)


def gather_owned(ctx: PlanContext, owned: torch.Tensor) -> torch.Tensor:
    """All ranks' owned rows in global-id order, on every rank (differentiable)."""
    return apply(GatherOwnedFn, owned, gather_full_step(ctx, tuple(owned.shape), _jax_dtype(owned)))

