"""`ShardTensor`: a `torch.Tensor` whose data IS this process's local block.

Layouts (rows of the local block, for this rank of the plan):

- `"owned"`:  the owned rows (`n_owned`), plus optional trailing pad rows;
- `"halo"`:   owned rows, then ghost rows by source rank (`n_owned + n_ghost`),
  plus optional trailing pad rows (the "+1" row of the sharded convention);
- `"replicated"`: the same value on every rank (an all-reduce result).

Ordinary torch ops see a plain tensor; a result keeps the metadata of the first
ShardTensor argument whose leading dimension it shares (row-wise ops). On an
"owned" / "halo" block only the ops of the catalogue run (`op_catalogue.py`,
default deny): an op that would mix rows of the block (pair, gather, reduce or
reorder them, move or merge the atom dimension) raises `ShardTensorMeaningError`
before it runs, and a sum or mean over atoms means owned rows, then an
all-reduce (a replicated result): see `meaning.py` and `ShardTensor.system_sum`.
`x[:x.n_owned]` is an "owned" block (plain for halo positions, in the wrapped
frame); other subsets of rows are refused. `to_local()` / `full_tensor()` are
the explicit ways out.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from . import dispatch, meaning, reductions
from .meaning import ShardTensorMeaningError as ShardTensorMeaningError
from .shard_meta import LAYOUTS, ShardMeta, _check_positions, _check_rows, _prefix_meta, meta_for


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
            TypeError: `local` is not a tensor, or `positions=True` and it is not real floating point.
            ValueError: unknown layout, or the block has fewer rows than the layout needs.
        """
        from .plan_context import context_for

        if layout not in LAYOUTS:
            raise ValueError(f"ShardTensor.from_local: layout must be one of {LAYOUTS}, got {layout!r}")
        if not isinstance(local, torch.Tensor):
            raise TypeError(f"ShardTensor.from_local: expected a torch.Tensor, got {type(local).__name__}")
        _check_positions("ShardTensor.from_local", local, positions)
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
        check: bool = True,
    ) -> ShardTensor:
        """This rank's block of a global tensor (rows in global-ID order).

        `layout="halo"` fills the ghost rows with a forward halo exchange (every
        rank must call it together); with `positions=True` owned and ghost rows
        are put in the plan's wrapped frame (ghosts as periodic images), as a
        kernel sees them. `pad_rows` appends that many zero rows.

        Positions (`positions=True`, a `HaloPlan`) are checked against the plan, as
        `CompiledSpec.owned` does: an atom more than skin/2 from the plan's positions
        (minimum image) raises `StaleLayoutError` (re-plan: `plan.rebuild(positions)`);
        an atom moved by a lattice vector is put back at the plan's image (exact).
        `check=False`: as given, unchecked.

        Returns:
            A leaf ShardTensor (`requires_grad` as asked).

        Raises:
            TypeError: `positions=True` with an integer, bool or complex `full` (image shifts would be
                truncated, an imaginary part dropped): convert it first, e.g. `full.to(torch.float64)`.
            ValueError: an unknown layout, or not one row per atom of the plan.
        """
        from .functions import halo_from_owned
        from .plan_context import context_for

        if layout not in ("owned", "halo"):
            raise ValueError(
                f"ShardTensor.from_global: layout must be 'owned' or 'halo', got {layout!r}; a replicated "
                "value is the same on every rank: use ShardTensor.from_local(x, plan, layout='replicated')"
            )
        full = torch.as_tensor(full)
        _check_positions("ShardTensor.from_global", full, positions)
        ctx = context_for(plan)
        if full.ndim == 0 or full.shape[0] != ctx.n_global:
            raise ValueError(
                f"ShardTensor.from_global: the global tensor has shape {tuple(full.shape)} but the plan "
                f"has {ctx.n_global} atoms; pass one row per atom in global-ID order"
            )
        if positions and check and hasattr(plan, "reference_positions") and full.shape == (ctx.n_global, 3):
            full = _at_plan_image(plan, full)
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

    def system_sum(self, batch: torch.Tensor | None = None, n_systems: int | None = None) -> ShardTensor:
        """The sum over atoms: this rank's owned rows summed, then an all-reduce (a collective).

        What `x.sum(0)` means for a row layout; with `batch`, what
        `zeros.index_add_(0, batch, x)` means. Ghost and pad rows are not counted.
        Identity adjoint: every rank calls `backward()` on the same value and each
        owned row gets gradient 1, not the world size.

        Args:
            batch: optional per-row system index (this rank's block, a ShardTensor or a
                plain tensor of at least `n_owned` rows).
            n_systems: the number of systems in the whole job (needed with `batch`).

        Returns:
            A replicated ShardTensor of shape `x.shape[1:]`, or `(n_systems, *x.shape[1:])`.

        Raises:
            ValueError: `batch` without `n_systems`, or a `batch` with too few rows.
        """
        if self.layout == "replicated":
            raise TypeError(
                "ShardTensor.system_sum: this ShardTensor is replicated (the same value on every rank), "
                "so it is not a per-atom block to sum over ranks; use plain torch (x.sum(0)) on it"
            )
        return reductions.system_sum(self, batch, n_systems)

    # ---- dispatch -----------------------------------------------------------------
    @classmethod
    def __torch_function__(cls, func: Any, types: tuple, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        handler = dispatch.lookup(func)
        if handler is not None:
            return handler(func, types, args, kwargs)
        with torch._C.DisableTorchFunctionSubclass():
            metas = list(_metas(args, kwargs))
            rows = next((m for m, _ in metas if m.layout != "replicated"), None)
            verdict = meaning.RUN if rows is None else meaning.classify(func, args, kwargs, _is_rows)
            at = "" if rows is None else meaning.where(args, kwargs, _is_rows)
            if verdict.action == "refuse":
                meaning.refuse(func, rows.layout, rows.context.rank, verdict.why, verdict.hint,
                               aten=meaning.aten_name(func, verdict), family=verdict.family, at=at)
            if verdict.action == "owned_sum":
                return reductions.owned_sum(func, args, kwargs, rows)
            if verdict.action == "owned_mean":
                return reductions.owned_mean(func, args, kwargs, rows)
            if verdict.action == "owned_all_any":
                return reductions.owned_all_any(func, args, kwargs, rows)
            if verdict.action == "index_sum":
                return reductions.index_sum(func, args, kwargs, rows)
            if verdict.args is not None:  # the layout's meaning of the call (x.squeeze(): not the atom dim)
                args, kwargs = verdict.args, verdict.kwargs or {}
            out = func(*args, **kwargs)
            if func in _NO_WRAP or not metas:
                return out
            block = None if rows is None else meaning.leading_block(func, args, kwargs, _is_rows)
            if block is not None and (meta := _prefix_meta(block._jb, out)) is not None:
                return ShardTensor._wrap(out, meta)
            out = _rewrap(out, metas, _ids(args, kwargs))
            if rows is not None and not verdict.plain_ok:
                lead = next(s[0] for m, s in metas if m.layout != "replicated" and s)
                meaning.check_kept(func, out, rows.layout, rows.context.rank, lead, verdict, _is_marked, at)
            return out


def _is_marked(t: torch.Tensor) -> bool:
    """Whether a result tensor carries layout metadata."""
    return isinstance(t, ShardTensor)


def _is_rows(a: Any) -> bool:
    """Whether `a` is a ShardTensor in a row layout ("owned" or "halo")."""
    meta = a.__dict__.get("_jb") if isinstance(a, ShardTensor) else None
    return meta is not None and meta.layout != "replicated"


# Methods whose results must stay as torch returns them (plain tensors or non-tensors).
_NO_WRAP = {torch.Tensor.__repr__, torch.Tensor.__format__, torch.Tensor.numpy, torch.Tensor.tolist,
            torch.Tensor.item}


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
        items = tuple(_rewrap(o, candidates, arg_ids) for o in out)
        return items if type(out) is tuple else type(out)(items)  # torch.return_types (values, indices)
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


def _at_plan_image(plan: Any, full: torch.Tensor) -> torch.Tensor:
    """Global positions checked against `plan` (`layout.displacement`) and moved to its periodic images."""
    from ..layout.displacement import checked_positions

    host = full.detach().cpu()  # its own width: rounding the plan's positions to it is no move
    host = (host if host.dtype in (torch.float16, torch.float32, torch.float64) else host.float()).numpy()
    fix = "plan = plan.rebuild(positions) and make the ShardTensors from the new plan (or check=False)"
    shift = host - checked_positions(plan, host, "ShardTensor.from_global(positions=True)", fix)
    return full if not shift.any() else full - torch.as_tensor(shift, dtype=full.dtype, device=full.device)
