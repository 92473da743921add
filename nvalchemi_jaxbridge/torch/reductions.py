"""Sums over atoms of a row-layout ShardTensor: owned rows on each rank, then an all-reduce.

The policy's meaning of a sum over atoms, whatever the storage: ghost rows are
copies of other ranks' atoms and pad rows are inert, so each rank sums only its
owned rows and an all-reduce adds the ranks' partials. The result is the same
on every rank (`layout="replicated"`). Its adjoint is the identity
(`replicated_consumer=True`): every rank is expected to call `backward()` on
the same replicated value, so each owned row gets gradient 1, not the world
size. These are collectives: every rank must make the same call.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from . import functions as F
from .block_programs import _jax_dtype
from .meaning import refuse
from .shard_meta import ShardMeta


def _replicated(ctx: Any, part: torch.Tensor, spec: Any) -> Any:
    """All-reduce of this rank's partial with the identity adjoint, as a replicated ShardTensor."""
    from .shard_tensor import ShardTensor

    step = F.all_reduce_step(ctx, tuple(part.shape), _jax_dtype(part), replicated_consumer=True)
    total = F.apply(F.AllReduceSumFn, part.contiguous(), step)
    return ShardTensor._wrap(total, ShardMeta(ctx, "replicated", False, spec))


def _local(x: Any) -> Any:
    """A ShardTensor's local block (a differentiable alias); anything else unchanged."""
    from .shard_tensor import ShardTensor

    return x.to_local() if isinstance(x, ShardTensor) else x


def owned_sum(func: Any, args: tuple, kwargs: dict, meta: Any) -> Any:
    """`func` (`sum` / `nansum` over dims that include the atom dimension) on owned rows, all-reduced."""
    ctx = meta.context
    with torch._C.DisableTorchFunctionSubclass():
        part = func(_local(args[0])[: ctx.n_owned], *args[1:], **kwargs)
    return _replicated(ctx, part, meta.spec)


def owned_mean(func: Any, args: tuple, kwargs: dict, meta: Any) -> Any:
    """`mean` over dims that include the atom dimension: the owned sum, all-reduced, over the global count.

    The count is the job's atoms (`n_global`, ghost and pad rows not counted) times
    the sizes of the other reduced dims; the gradient of each owned entry is 1/count.
    """
    from .meaning_rules import arg, dims

    ctx, x = meta.context, args[0]
    reduced = dims(arg(args, kwargs, 1, ("dim", "axis")), x.ndim)
    rest = range(1, x.ndim) if reduced is None else sorted(reduced - {0})
    count = ctx.n_global * math.prod(x.shape[d] for d in rest)
    total = owned_sum(torch.sum, args, kwargs, meta)
    with torch._C.DisableTorchFunctionSubclass():
        out = total.to_local() / count
    return type(total)._wrap(out, total._jb)


def owned_all_any(func: Any, args: tuple, kwargs: dict, meta: Any) -> Any:
    """`all` / `any` over dims that include the atom dimension: owned rows counted, the counts all-reduced.

    `all` holds where no owned entry of any rank is zero, `any` where one is not;
    the result is a replicated bool ShardTensor.
    """
    from .meaning import short_name

    ctx, name = meta.context, short_name(func)
    with torch._C.DisableTorchFunctionSubclass():
        owned = _local(args[0])[: ctx.n_owned]
        odd = (owned == 0) if name == "all" else (owned != 0)  # the entries that decide
        part = torch.sum(odd, *args[1:], **kwargs, dtype=torch.int32)
    total = _replicated(ctx, part, meta.spec)
    with torch._C.DisableTorchFunctionSubclass():
        out = total.to_local() == 0 if name == "all" else total.to_local() > 0
    return type(total)._wrap(out, total._jb)


def index_sum(func: Any, args: tuple, kwargs: dict, meta: Any) -> Any:
    """`acc.index_add_(0, index, src)` / `scatter_add(_)` of a row-layout `src` into another row space.

    Owned rows of `src` (and of `index`) are scattered into zeros shaped like
    `acc`, the partials are all-reduced, and the sum is added to `acc` (in place
    for the `_` forms, whose return value is `acc` as a replicated ShardTensor).
    `acc` keeps its own values as this rank holds them: start from zeros or from
    a value every rank holds.
    """
    from .meaning import short_name

    ctx, name = meta.context, short_name(func)
    acc, index, src = args[0], _pick(args, kwargs, 2, "index"), _pick(args, kwargs, 3, "source", "src")
    n = ctx.n_owned
    with torch._C.DisableTorchFunctionSubclass():
        acc_l, index_l, src_l = _local(acc), _local(index), _local(src)
        if acc_l.ndim and acc_l.shape[0] in (n, n + ctx.n_ghost, src_l.shape[0]):
            refuse(func, meta.layout, ctx.rank, "scatters atom rows into a target with as many rows as the "
                   "atom block, which reads as this rank's atom rows rather than another row space",
                   "for a per-system sum use x.system_sum(batch, n_systems=...); ")
        zeros = torch.zeros_like(acc_l)
        if name.startswith("index_add"):
            part = torch.index_add(zeros, 0, index_l[:n], src_l[:n], alpha=kwargs.get("alpha", 1))
        else:
            part = torch.scatter_add(zeros, 0, index_l[:n], src_l[:n])
    total = _replicated(ctx, part, meta.spec)
    with torch._C.DisableTorchFunctionSubclass():
        if name.endswith("_"):
            acc_l.add_(total.to_local())
            out = acc_l
        else:
            out = acc_l + total.to_local()
    return type(total)._wrap(out, total._jb)


def _pick(args: tuple, kwargs: dict, pos: int, *names: str) -> Any:
    """An argument by position or keyword."""
    for k in names:
        if k in kwargs:
            return kwargs[k]
    return args[pos]


def system_sum(x: Any, batch: Any = None, n_systems: int | None = None) -> Any:
    """`ShardTensor.system_sum` (see there)."""
    meta = x._jb
    ctx = meta.context
    with torch._C.DisableTorchFunctionSubclass():
        owned = x.to_local()[: ctx.n_owned]
        if batch is None:
            part = owned.sum(0)
        else:
            if n_systems is None:
                raise ValueError(
                    "ShardTensor.system_sum: batch given without n_systems; pass n_systems= (the number "
                    "of systems in the whole job, the same on every rank: each rank only sees its own "
                    "atoms' system indices)"
                )
            idx = _local(batch)
            if idx.ndim != 1 or idx.shape[0] < ctx.n_owned:
                raise ValueError(
                    f"ShardTensor.system_sum: batch has shape {tuple(idx.shape)} but rank {ctx.rank} needs "
                    f"one system index per row, at least n_owned = {ctx.n_owned} rows; pass this rank's "
                    "block of the per-atom system index"
                )
            part = owned.new_zeros((int(n_systems),) + tuple(owned.shape[1:]))
            part = part.index_add(0, idx[: ctx.n_owned].to(torch.long), owned)
    return _replicated(ctx, part, meta.spec)
