"""The dispatch handler of one installed `OpAdapter`.

When the op is called with ShardTensor arguments, the handler

1. binds the call to the op's schema, so a declared position is found whether
   it was passed positionally or by keyword (by its schema name);
2. picks the *source*: the first ShardTensor (positional first, depth first)
   with a halo or owned layout, else the first replicated one;
3. applies the argument transforms (autograd Functions running the lowered
   JAX programs), unwraps every other ShardTensor to its local block;
4. calls the kernel eagerly in torch;
5. applies the output transforms and re-wraps the outputs: `ScatterOutputs`
   gives a halo block, `AllReduceSum` a replicated value, `SliceOutputsOwned`
   an owned block; an untransformed output keeps the layout whose row count it
   has (the kernel-side layout first), else it is a plain tensor.

Plain tensors at declared positions (the documented rule): a plain tensor is
taken to be this rank's local block in the layout the transform reads.
`GatherInputs` reads it as a halo block if it has at least `n_owned + n_ghost`
rows (its ghost rows are refreshed), else as an owned block of exactly
`n_owned` rows; it gets no periodic image shifts (wrap positions in a
ShardTensor with `positions=True` for that). A positions ShardTensor in halo
layout holds its owned rows in the plan's wrapped frame; re-gathering it first
takes them back to owned storage (subtracts their `halo_offset`). `SliceOwned` and
`GatherInputsFull` need at least `n_owned` rows. Any other row count raises.
`None` (an omitted optional tensor) passes unchanged; other non-tensors raise.

Transforms that do not apply to the source's storage (e.g. `GatherInputs` on a
sharded plan) raise instead of being ignored.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from ..spec.transforms import (
    AllReduceSum,
    GatherInputs,
    GatherInputsFull,
    ScatterOutputs,
    SliceOutputsOwned,
    SliceOwned,
)
from . import functions as F
from .block_programs import _jax_dtype
from .shard_meta import ShardMeta
from .shard_tensor import ShardTensor

_HALO_ONLY = (GatherInputs, SliceOwned, ScatterOutputs)
_SHARD_ONLY = (GatherInputsFull, SliceOutputsOwned)


def _schema(op: Any) -> tuple[list[str], list[str], int | None]:
    """(argument names, argument type strings, number of returns or None) of an operator."""
    schema = getattr(op, "_schema", None)
    if schema is not None:
        return ([a.name for a in schema.arguments], [str(a.type) for a in schema.arguments],
                len(schema.returns))
    params = list(inspect.signature(op).parameters.values())
    return [p.name for p in params], ["Tensor"] * len(params), None


def _check_declaration(adapter: Any, op: Any, names: list[str], types: list[str], n_ret: int | None) -> None:
    """Raise at install time if a declared position does not exist or is not a tensor argument."""
    for pos, t in adapter.arg_transforms.items():
        if pos >= len(names):
            raise ValueError(
                f"OpAdapter for {op}: arg_transforms[{pos}] ({type(t).__name__}) but the op takes "
                f"{len(names)} arguments ({', '.join(names)}); use a position in 0..{len(names) - 1}"
            )
        if "Tensor" not in types[pos]:
            raise ValueError(
                f"OpAdapter for {op}: arg_transforms[{pos}] ({type(t).__name__}) targets argument "
                f"'{names[pos]}' of type {types[pos]}, which is not a tensor; declare a tensor argument"
            )
    if n_ret is not None:
        for pos, t in adapter.output_transforms.items():
            if pos >= n_ret:
                raise ValueError(
                    f"OpAdapter for {op}: output_transforms[{pos}] ({type(t).__name__}) but the op "
                    f"returns {n_ret} value(s); use a position in 0..{max(n_ret - 1, 0)}"
                )


def make_handler(adapter: Any, op: Any) -> Callable[[Any, tuple, tuple, dict], Any]:
    """The `__torch_function__` handler of `adapter` on `op` (validated here, at install)."""
    names, types, n_ret = _schema(op)
    _check_declaration(adapter, op, names, types, n_ret)
    arg_t = dict(sorted(adapter.arg_transforms.items()))
    out_t = dict(sorted(adapter.output_transforms.items()))
    label = f"OpAdapter for {op}"

    def handler(func: Any, types_: tuple, args: tuple, kwargs: dict) -> Any:
        return _call(label, names, arg_t, out_t, func, args, kwargs)

    return handler


# ---- call -------------------------------------------------------------------------


def _tensors(x: Any):
    """ShardTensors in `x`, depth first through lists and tuples."""
    if isinstance(x, ShardTensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for v in x:
            yield from _tensors(v)


def _source(args: tuple, kwargs: dict) -> ShardMeta | None:
    """The metadata of the source ShardTensor (halo/owned preferred over replicated)."""
    found = [m for v in (*args, *kwargs.values()) for t in _tensors(v)
             if (m := t.__dict__.get("_jb")) is not None]
    for m in found:
        if m.layout != "replicated":
            return m
    return found[0] if found else None


def _unwrap(x: Any) -> Any:
    """ShardTensors replaced by their local blocks (differentiable aliases), recursively."""
    if isinstance(x, ShardTensor):
        return x.to_local()
    if isinstance(x, list):
        return [_unwrap(v) for v in x]
    if isinstance(x, tuple) and not hasattr(x, "_fields"):
        return tuple(_unwrap(v) for v in x)
    return x


def _check_kind(label: str, where: str, t: Any, meta: ShardMeta) -> None:
    """Raise if transform `t` does not apply to the source's storage kind."""
    kind = meta.context.kind
    if kind == "shard" and isinstance(t, _HALO_ONLY):
        raise TypeError(
            f"{label}: {where} is {type(t).__name__}, a halo-storage transform, but the ShardTensor "
            "arguments use a ShardPlan (sharded storage); use GatherInputsFull/SliceOutputsOwned, or "
            "build the tensors from a HaloPlan"
        )
    if kind == "halo" and isinstance(t, _SHARD_ONLY):
        raise TypeError(
            f"{label}: {where} is {type(t).__name__}, a sharded-storage transform, but the ShardTensor "
            "arguments use a HaloPlan; use GatherInputs/ScatterOutputs/SliceOwned, or build the tensors "
            "from a ShardPlan"
        )


def _rows_error(label: str, where: str, x: torch.Tensor, need: str) -> ValueError:
    """The error for a block whose row count does not fit its transform."""
    return ValueError(f"{label}: {where} has shape {tuple(x.shape)} but {need}")


def _arg(label: str, where: str, t: Any, x: Any, src: ShardMeta) -> Any:
    """Apply argument transform `t` to value `x` (a ShardTensor, plain tensor or None)."""
    if x is None:
        return None
    if not isinstance(x, torch.Tensor):
        raise TypeError(
            f"{label}: {where} declares {type(t).__name__} but got {type(x).__name__}; pass a tensor "
            "(a ShardTensor or this rank's local block)"
        )
    ctx = src.context
    meta = x.__dict__.get("_jb") if isinstance(x, ShardTensor) else None
    if meta is not None and meta.context is not ctx:
        raise ValueError(
            f"{label}: {where} belongs to a different plan than the other ShardTensor arguments; build "
            "all arguments of one call from the same plan"
        )
    local = x.to_local() if isinstance(x, ShardTensor) else x
    n_own, n_pad = ctx.n_owned, ctx.n_owned + ctx.n_ghost
    rows = local.shape[0] if local.ndim else None
    if rows is None or rows < n_own:
        raise _rows_error(label, where, local, f"{type(t).__name__} needs at least n_owned = {n_own} rows "
                          f"on rank {ctx.rank}; pass this rank's block")
    dtype = _jax_dtype(local)
    if isinstance(t, SliceOwned):
        return local[:n_own]
    if isinstance(t, GatherInputs):
        layout = meta.layout if meta is not None else ("halo" if rows >= n_pad and rows > n_own else "owned")
        if layout == "replicated" or (layout == "owned" and meta is None and rows != n_own):
            raise _rows_error(label, where, local, f"GatherInputs reads an owned block of n_owned = {n_own} "
                              f"rows or a halo block of n_owned + n_ghost = {n_pad} rows on rank {ctx.rank}")
        base = n_own if layout == "owned" else n_pad
        positions = meta.positions if meta is not None else False
        owned = local[:n_own]
        if layout == "halo" and positions:  # its owned rows are in the wrapped frame: back to owned storage
            owned = owned - _owned_shift(ctx, owned)
        step = F.gather_inputs_step(ctx, tuple(owned.shape), dtype, positions=positions)
        halo = F.apply(F.GatherInputsFn, owned, step)
        return torch.cat([halo, local[base:]]) if rows > base else halo
    if isinstance(t, GatherInputsFull):
        owned = local[:n_own]
        step = F.gather_full_step(ctx, tuple(owned.shape), dtype)
        full = F.apply(F.GatherInputsFullFn, owned, step)
        return torch.cat([full, local[n_own:]]) if rows > n_own else full
    raise TypeError(f"{label}: {where} holds {t!r}, which is not an argument transform")


def _owned_shift(ctx: Any, like: torch.Tensor) -> torch.Tensor:
    """This rank's owned-row `halo_offset` (the shift into the wrapped frame), like `like`."""
    shift = ctx.plan.halo_offset[ctx.rank, : ctx.n_owned]
    return torch.tensor(np.array(shift), dtype=like.dtype, device=like.device)


def _out(label: str, where: str, t: Any, y: Any, src: ShardMeta) -> tuple[torch.Tensor, ShardMeta]:
    """Apply output transform `t` to kernel output `y`; returns the result and its metadata."""
    if not isinstance(y, torch.Tensor):
        raise TypeError(f"{label}: {where} declares {type(t).__name__} but the kernel returned "
                        f"{type(y).__name__} there; declare only tensor outputs")
    ctx = src.context
    dtype = _jax_dtype(y)
    if isinstance(t, AllReduceSum):
        step = F.all_reduce_step(ctx, tuple(y.shape), dtype, replicated_consumer=t.replicated_consumer)
        return F.apply(F.AllReduceSumFn, y, step), ShardMeta(ctx, "replicated", False, src.spec)
    if isinstance(t, ScatterOutputs):
        n_pad = ctx.n_owned + ctx.n_ghost
        if y.ndim == 0 or y.shape[0] < n_pad:
            raise _rows_error(label, where, y, f"ScatterOutputs needs the kernel's halo-block output with at "
                              f"least n_owned + n_ghost = {n_pad} rows on rank {ctx.rank}")
        step = F.scatter_outputs_step(ctx, (n_pad,) + tuple(y.shape[1:]), dtype)
        out = F.apply(F.ScatterOutputsFn, y[:n_pad], step)
        out = torch.cat([out, y[n_pad:]]) if y.shape[0] > n_pad else out  # trailing pad rows kept
        return out, ShardMeta(ctx, "halo", False, src.spec)
    if isinstance(t, SliceOutputsOwned):
        if y.ndim == 0 or y.shape[0] < ctx.n_global:
            raise _rows_error(label, where, y, f"SliceOutputsOwned needs the kernel's all-rows output with "
                              f"at least n_global = {ctx.n_global} rows")
        step = F.slice_outputs_owned_step(ctx, (ctx.n_global,) + tuple(y.shape[1:]), dtype)
        out = F.apply(F.SliceOutputsOwnedFn, y[: ctx.n_global], step)
        out = torch.cat([out, y[ctx.n_global:]]) if y.shape[0] > ctx.n_global else out
        return out, ShardMeta(ctx, "owned", False, src.spec)
    raise TypeError(f"{label}: {where} holds {t!r}, which is not an output transform")


def _untransformed(y: Any, candidates: list[tuple[ShardMeta, int]]) -> Any:
    """Wrap an untransformed kernel output with the first layout whose row count it has."""
    if not isinstance(y, torch.Tensor) or y.ndim == 0:
        return y
    for meta, rows in candidates:
        if y.shape[0] == rows:
            return ShardTensor._wrap(y, meta)
    return y


def _call(label: str, names: list[str], arg_t: dict, out_t: dict, func: Any, args: tuple, kwargs: dict) -> Any:
    """One intercepted call (see the module docstring)."""
    src = _source(args, kwargs)
    if src is None:  # ShardTensors without metadata: nothing to distribute over
        if arg_t or out_t:
            raise ValueError(f"{label}: the call has no ShardTensor built from a plan, so its transforms "
                             "cannot run; build the arguments with ShardTensor.from_local/from_global")
        with torch._C.DisableTorchFunctionSubclass():
            return func(*_unwrap(args), **_unwrap(kwargs))
    for pos, t in arg_t.items():
        _check_kind(label, f"arg_transforms[{pos}]", t, src)
    for pos, t in out_t.items():
        _check_kind(label, f"output_transforms[{pos}]", t, src)
    new_args, new_kwargs = list(args), dict(kwargs)
    with torch._C.DisableTorchFunctionSubclass():
        for pos, t in arg_t.items():
            if pos < len(args):
                new_args[pos] = _arg(label, f"argument {pos} ('{names[pos]}')", t, args[pos], src)
            elif names[pos] in kwargs:
                key = names[pos]
                new_kwargs[key] = _arg(label, f"argument {pos} ('{key}', by keyword)", t, kwargs[key], src)
        done = {p for p in arg_t if p < len(args)}
        new_args = [a if i in done else _unwrap(a) for i, a in enumerate(new_args)]
        done_kw = {names[p] for p in arg_t if p >= len(args)}
        new_kwargs = {k: v if k in done_kw else _unwrap(v) for k, v in new_kwargs.items()}
        result = func(*new_args, **new_kwargs)

        single = isinstance(result, torch.Tensor)
        outs = [result] if single else list(result) if isinstance(result, (tuple, list)) else [result]
        for pos in out_t:
            if pos >= len(outs):
                raise ValueError(f"{label}: output_transforms[{pos}] but the kernel returned {len(outs)} "
                                 "output(s)")
        ctx = src.context
        gathered = any(isinstance(t, GatherInputs) for t in arg_t.values())
        halo = ShardMeta(ctx, "halo", False, src.spec)
        owned = ShardMeta(ctx, "owned", False, src.spec)
        n_pad = ctx.n_owned + ctx.n_ghost
        candidates = [(halo, n_pad), (owned, ctx.n_owned)] if ctx.kind == "halo" else [(owned, ctx.n_owned)]
        if ctx.kind == "halo" and not gathered and src.layout == "owned":
            candidates.reverse()
        wrapped = []
        for i, y in enumerate(outs):
            if i in out_t:
                y, meta = _out(label, f"output {i}", out_t[i], y, src)
                wrapped.append(ShardTensor._wrap(y, meta))
            else:
                wrapped.append(_untransformed(y, candidates))
    if single:
        return wrapped[0]
    return type(result)(wrapped) if isinstance(result, (tuple, list)) else wrapped[0]
