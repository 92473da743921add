"""`ShardTensor`: a `torch.Tensor` whose data IS this process's local block.

Layouts (rows of the local block, for this rank of the plan):

- `"owned"`:  the owned rows (`n_owned`), plus optional trailing pad rows;
- `"halo"`:   owned rows, then ghost rows by source rank (`n_owned + n_ghost`),
  plus optional trailing pad rows (the "+1" row of the sharded convention);
- `"replicated"`: the same value on every rank (an all-reduce result).

Ordinary torch ops see a plain tensor. A result keeps the metadata of the first
ShardTensor argument whose leading dimension it shares (elementwise math,
row indexing that keeps all rows, `x[:, 0]`); a result whose leading dimension
differs (`x.sum()`, `x[:3]`, `x.reshape(-1)`) is a plain `torch.Tensor`, since
halo metadata would be a lie for it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from . import dispatch

LAYOUTS = ("owned", "halo", "replicated")


@dataclasses.dataclass(frozen=True, eq=False)
class ShardMeta:
    """What a ShardTensor knows besides its data: plan context, layout and roles."""

    context: Any  # functions.PlanContext: plan, mesh, rank, device tables
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


class ShardTensor(torch.Tensor):
    """One process's local block of a distributed per-atom tensor.

    Build it with `ShardTensor.from_local` or `ShardTensor.from_global`; get the
    plain block back with `to_local()` and the whole array (owned rows, global
    order) with `full_tensor()`. Calling a torch op on which an `OpAdapter` is
    installed hands the local blocks to the adapter's lowered JAX programs.
    """

    _jb: ShardMeta

    @staticmethod
    def _wrap(t: torch.Tensor, meta: ShardMeta) -> ShardTensor:
        """`t` as a ShardTensor carrying `meta` (differentiable alias, no copy)."""
        out = t.as_subclass(ShardTensor)
        out._jb = meta
        return out

    @staticmethod
    def _leaf(t: torch.Tensor, meta: ShardMeta, requires_grad: bool) -> ShardTensor:
        """A new autograd leaf sharing `t`'s storage, carrying `meta`."""
        out = torch.Tensor._make_subclass(ShardTensor, t.detach(), requires_grad)
        out._jb = meta
        return out

    @classmethod
    def from_local(
        cls,
        local: torch.Tensor,
        plan: Any,
        *,
        layout: str = "owned",
        positions: bool = False,
        spec: Any = None,
        requires_grad: bool | None = None,
    ) -> ShardTensor:
        """Wrap this rank's block.

        Args:
            local: the block, rows as described by `layout` (trailing pad rows allowed).
            plan: the `HaloPlan` / `ShardPlan` the block belongs to (this process is
                rank `jax.process_index()` of it).
            layout: "owned", "halo" or "replicated".
            positions: the block holds Cartesian positions, so a halo exchange adds the
                plan's `halo_offset` (owned and ghost rows into the wrapped frame).
            spec: the `DistributionSpec` in use (kept for reference; optional).
            requires_grad: make the result a leaf that requires grad (default: keep `local`'s).

        Raises:
            ValueError: unknown layout, or the block has fewer rows than the layout needs.
        """
        from .functions import context_for

        if layout not in LAYOUTS:
            raise ValueError(f"ShardTensor.from_local: layout must be one of {LAYOUTS}, got {layout!r}")
        if not isinstance(local, torch.Tensor):
            raise TypeError(f"ShardTensor.from_local: expected a torch.Tensor, got {type(local).__name__}")
        meta = ShardMeta(context_for(plan), layout, positions, spec)
        _check_rows("ShardTensor.from_local", local, meta)
        if isinstance(local, ShardTensor):
            local = local.to_local()
        if requires_grad is not None:
            return cls._leaf(local, meta, requires_grad)
        return cls._wrap(local, meta)

    @classmethod
    def from_global(
        cls,
        full: torch.Tensor | np.ndarray,
        plan: Any,
        *,
        layout: str = "owned",
        positions: bool = False,
        spec: Any = None,
        requires_grad: bool = False,
        pad_rows: int = 0,
    ) -> ShardTensor:
        """This rank's block of a global tensor (rows in global-ID order).

        `layout="halo"` fills the ghost rows with a forward halo exchange (every
        rank must call it together); with `positions=True` owned and ghost rows
        are put in the plan's wrapped frame (ghosts as periodic images), as a
        kernel sees them. `pad_rows` appends that many zero rows.

        Returns:
            A leaf ShardTensor (`requires_grad` as asked).
        """
        from .functions import context_for, halo_from_owned

        if layout not in ("owned", "halo"):
            raise ValueError(
                f"ShardTensor.from_global: layout must be 'owned' or 'halo', got {layout!r}; a replicated "
                "value is the same on every rank: use ShardTensor.from_local(x, plan, layout='replicated')"
            )
        full = torch.as_tensor(full)
        ctx = context_for(plan)
        if full.ndim == 0 or full.shape[0] != ctx.n_global:
            raise ValueError(
                f"ShardTensor.from_global: the global tensor has shape {tuple(full.shape)} but the plan "
                f"has {ctx.n_global} atoms; pass one row per atom in global-ID order"
            )
        ids = torch.as_tensor(ctx.owned_ids(), device=full.device)
        local = full.index_select(0, ids)
        if layout == "halo":
            local = halo_from_owned(ctx, local.detach(), positions=positions)
        if pad_rows:
            local = torch.cat([local, local.new_zeros((pad_rows,) + tuple(local.shape[1:]))])
        meta = ShardMeta(ctx, layout, positions, spec)
        return cls._leaf(local.contiguous(), meta, requires_grad)

    # ---- metadata -----------------------------------------------------------------
    @property
    def layout(self) -> str:
        """'owned', 'halo' or 'replicated'."""
        return self._jb.layout

    @property
    def plan(self) -> Any:
        """The plan this block belongs to."""
        return self._jb.plan

    @property
    def spec(self) -> Any:
        """The `DistributionSpec` given at construction (or None)."""
        return self._jb.spec

    @property
    def policy(self) -> Any:
        """The storage policy: the spec's, else implied by the plan (halo or sharded)."""
        if self._jb.spec is not None and getattr(self._jb.spec, "policy", None) is not None:
            return self._jb.spec.policy
        return self._jb.context.default_policy()

    @property
    def is_positions(self) -> bool:
        """Whether halo exchanges add the plan's position shifts (`halo_offset`) to this block's rows."""
        return self._jb.positions

    @property
    def rank(self) -> int:
        """This process's rank in the plan."""
        return self._jb.context.rank

    @property
    def n_owned(self) -> int:
        """Owned rows of this rank."""
        return self._jb.context.n_owned

    @property
    def n_ghost(self) -> int:
        """Ghost rows of this rank (0 for sharded storage)."""
        return self._jb.context.n_ghost

    @property
    def pad_rows(self) -> int:
        """Trailing rows past the layout's rows (the "+1" pad row convention)."""
        base = self._jb.base_rows()
        return 0 if base is None else self.shape[0] - base

    def to_local(self) -> torch.Tensor:
        """The local block as a plain tensor (a differentiable alias, no copy)."""
        with torch._C.DisableTorchFunctionSubclass():
            return torch.Tensor.as_subclass(self, torch.Tensor)

    def full_tensor(self) -> torch.Tensor:
        """All owned rows of all ranks in global-ID order (a collective; differentiable).

        A replicated tensor returns its local copy.
        """
        from .functions import gather_owned

        if self.layout == "replicated":
            return self.to_local()
        local = self.to_local()[: self.n_owned]
        return gather_owned(self._jb.context, local)

    def __repr__(self, *, tensor_contents: Any = None) -> str:
        with torch._C.DisableTorchFunctionSubclass():
            body = torch.Tensor.__repr__(self.to_local())
        return f"ShardTensor(layout={self.layout}, rank={self.rank}, {body})"

    # ---- dispatch -----------------------------------------------------------------
    @classmethod
    def __torch_function__(cls, func: Any, types: tuple, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        handler = dispatch.lookup(func)
        if handler is not None:
            return handler(func, types, args, kwargs)
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **kwargs)
            if func in _NO_WRAP:
                return out
            metas = list(_metas(args, kwargs))
            if not metas:
                return out
            return _rewrap(out, metas, _ids(args, kwargs))


# Methods whose results must stay as torch returns them (plain tensors or non-tensors).
_NO_WRAP = {torch.Tensor.__repr__, torch.Tensor.__format__, torch.Tensor.numpy, torch.Tensor.tolist,
            torch.Tensor.item}


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


def _metas(args: Any, kwargs: dict) -> Iterator[tuple[ShardMeta, tuple[int, ...]]]:
    """(meta, shape) of every ShardTensor in the arguments, depth first, positional first."""
    stack = [list(args), list(kwargs.values())]
    for group in stack:
        todo = list(group)
        while todo:
            a = todo.pop(0)
            if isinstance(a, ShardTensor):
                meta = a.__dict__.get("_jb")
                if meta is not None:
                    yield meta, tuple(a.shape)
            elif isinstance(a, (list, tuple)):
                todo[:0] = list(a)


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


def _ids(args: tuple, kwargs: dict) -> set[int]:
    """ids of the top-level tensor arguments (in-place ops return one of them)."""
    return {id(a) for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)}


def _rewrap(out: Any, candidates: list, arg_ids: frozenset[int] | set[int] = frozenset()) -> Any:
    """Give tensor results the metadata that still describes them; others become plain tensors."""
    if isinstance(out, ShardTensor) and id(out) in arg_ids:
        return out  # an in-place op returned its argument: keep its identity and metadata
    if isinstance(out, torch.Tensor):
        meta = meta_for(out, candidates)
        if meta is None:
            return out.as_subclass(torch.Tensor) if isinstance(out, ShardTensor) else out
        return ShardTensor._wrap(out, meta)
    if isinstance(out, tuple) and not hasattr(out, "_fields"):
        return tuple(_rewrap(o, candidates, arg_ids) for o in out)
    if isinstance(out, list):
        return [_rewrap(o, candidates, arg_ids) for o in out]
    return out


def _unwrap_all(x: Any) -> Any:
    """ShardTensors replaced by their local blocks, through lists, tuples and dicts."""
    if isinstance(x, ShardTensor):
        return x.to_local()
    if isinstance(x, list):
        return [_unwrap_all(v) for v in x]
    if isinstance(x, tuple) and not hasattr(x, "_fields"):
        return tuple(_unwrap_all(v) for v in x)
    if isinstance(x, dict):
        return {k: _unwrap_all(v) for k, v in x.items()}
    return x


def marshal_call(fn: Any, args: tuple, kwargs: dict) -> Any:
    """Call `fn` on local blocks and re-wrap its tensor results (see `dispatch.make_marshaller`)."""
    with torch._C.DisableTorchFunctionSubclass():
        metas = list(_metas(args, kwargs))
        local_args, local_kwargs = _unwrap_all(args), _unwrap_all(kwargs)
    out = fn(*local_args, **local_kwargs)
    with torch._C.DisableTorchFunctionSubclass():
        return _rewrap(out, metas) if metas else out
