"""What a torch op means for a ShardTensor in a row layout ("owned" or "halo"): pure classification.

A block in a row layout holds this rank's rows of a distributed per-atom tensor
(owned rows, then ghost copies of other ranks' atoms, then pad rows), the atom
dimension first. Run on the block, an op that keeps every row to itself means
the same as on the whole array; one that mixes rows (pairs them, gathers them by
index, reduces or reorders along them, moves or merges the atom dimension)
silently gives a per-rank answer. `classify` sorts a call into one of:

- `"run"`: row-local, or not about the rows at all; run it on the block. The
  result keeps the layout; a result that leaves it is refused after the call
  (`check_kept`) unless the verdict says a plain result is fine (`plain_ok`).
- `"owned_sum"`: a sum over the atom dimension; the policy's meaning is the
  owned rows summed on each rank, then an all-reduce (a replicated result).
- `"owned_mean"`: `mean` over dims that include the atom dimension: the owned
  sum, all-reduced, divided by the job's count (`n_global` atoms).
- `"owned_all_any"`: `all` / `any` over the atom dimension: owned rows counted,
  the counts all-reduced.
- `"index_sum"`: `index_add(_)` / `scatter_add(_)` of a row-layout source into
  another row space (e.g. `n_systems` rows): the same, per target row.
- `"refuse"`: `refuse` raises `ShardTensorMeaningError` naming the op (its
  Python and aten names), the argument, the layout and the fix.

Default deny: an op in no family of `op_catalogue.CATALOGUE` is refused, and so
is a custom op without an installed adapter. The families' conditions are in
`meaning_rules`. Replicated ShardTensors are never classified: they hold the
same value on every rank, so plain torch semantics are already the global ones.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from . import meaning_rules as R
from . import op_catalogue as C
from .meaning_verdict import (
    HINT_CUSTOM, HINT_HOST, HINT_PAIRS, HINT_SUM, PLAIN, RUN, WHY_ALONG, WHY_CUSTOM, WHY_HOST, WHY_MOVE,
    WHY_PAIRS, WHY_REDUCE, WHY_UNKNOWN, WHY_VMAP, Verdict, refused,
)


class ShardTensorMeaningError(RuntimeError):
    """A ShardTensor in a row layout met an op whose distributed meaning is not known.

    A `RuntimeError`, not a `TypeError`: torch turns a `TypeError` raised inside a
    binary operator (`a @ b`, `a + b`) into `NotImplemented`, and Python then
    reports only "unsupported operand type(s)", losing the message.
    """


def short_name(func: Any) -> str | None:
    """The op's name as the tables above know it (None for a custom op outside `aten`)."""
    if isinstance(func, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        ns, _, name = func.overloadpacket._qualified_op_name.partition("::") if isinstance(
            func, torch._ops.OpOverload) else func._qualified_op_name.partition("::")
        return name if ns == "aten" else None
    name = getattr(func, "__name__", None)
    if name in ("__get__", "__set__"):  # a property of torch.Tensor (`x.T`, `x.grad`)
        name = getattr(getattr(func, "__self__", None), "__name__", name)
    return name


def op_name(func: Any) -> str:
    """The op as a user would write it: `torch.Tensor.scatter_add_`, `torch.sum`, `aten.sum.default`."""
    if isinstance(func, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return str(func)
    name = getattr(func, "__name__", None)
    if name in ("__get__", "__set__"):
        return f"torch.Tensor.{short_name(func)}"
    if name is not None and getattr(torch.Tensor, name, None) is func:
        return f"torch.Tensor.{name}"
    if name is not None and getattr(torch, name, None) is func:
        return f"torch.{name}"
    try:
        resolved = torch.overrides.resolve_name(func)
    except Exception:  # noqa: BLE001 - any callable may arrive here; the name is only for the message
        resolved = None
    return resolved or getattr(func, "__qualname__", None) or repr(func)


def aten_name(func: Any, verdict: Verdict | None = None) -> str:
    """The op's dispatcher name for the message: `aten::cdist`, `jbtest::system_sum`, or a note that it has none."""
    if verdict is not None and verdict.aten:
        return verdict.aten
    if isinstance(func, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        packet = func.overloadpacket if isinstance(func, torch._ops.OpOverload) else func
        return packet._qualified_op_name
    name = short_name(func) or ""
    name = C.ATEN_OF.get(name, C.DUNDER.get(name, name))
    return f"aten::{name}" if name and hasattr(torch.ops.aten, name) else "no single aten op"


def classify(func: Any, args: tuple, kwargs: dict, rows: Callable[[Any], bool]) -> Verdict:
    """The verdict for `func(*args, **kwargs)`; `rows(a)` says whether `a` is a row-layout ShardTensor."""
    name = short_name(func)
    if name is None:
        return dataclasses.replace(refused(WHY_CUSTOM, HINT_CUSTOM), family="custom ops")
    if _under_vmap() and name not in C.QUERIES:
        return dataclasses.replace(refused(WHY_VMAP, HINT_PAIRS), family="anything else")
    verdict = _classify(name, args, kwargs, rows)
    return dataclasses.replace(verdict, family=C.family(name).key) if verdict.action == "refuse" else verdict


def _classify(name: str, args: tuple, kwargs: dict, rows: Callable[[Any], bool]) -> Verdict:
    this = args[0] if args else None
    self_rows = rows(this)
    ndim = this.ndim if isinstance(this, torch.Tensor) else 0
    any_rows = self_rows or any(rows(a) for a in R.flat(args, kwargs))
    if name in C.HOST:
        return refused(WHY_HOST, HINT_HOST) if any_rows else RUN
    if name in C.QUERIES or name.startswith("is_"):  # is_nonzero is a host read, caught above
        return PLAIN
    if name in C.FACTORIES:
        return refused(R.WHY_PLAIN_OUT, HINT_HOST) if any(rows(a) for a in args[1:]) else PLAIN
    if name == "mean" and self_rows and R.touches_rows(R.arg(args, kwargs, 1, ("dim", "axis")), ndim):
        return Verdict("owned_mean")  # the owned sum, all-reduced, over the job's count
    if name in ("all", "any") and self_rows and R.touches_rows(R.arg(args, kwargs, 1, ("dim", "axis")), ndim):
        return Verdict("owned_all_any")  # counts of the deciding entries, all-reduced
    if name in C.SUM and self_rows:
        return Verdict("owned_sum") if R.touches_rows(R.arg(args, kwargs, 1, ("dim", "axis")), ndim) else RUN
    if name in ("max", "min") and isinstance(R.arg(args, kwargs, 1, ("other",)), torch.Tensor):
        return R.pointwise(name, args, kwargs, rows)  # elementwise maximum / minimum
    if name in C.REDUCE and self_rows:
        pos, default = C.REDUCE[name]
        if R.touches_rows(R.arg(args, kwargs, pos, ("dim", "axis"), default), ndim):
            return refused(WHY_REDUCE, HINT_SUM)
        return RUN
    if name in ("cross", "linalg_cross", "cosine_similarity"):
        pos, default = C.ALONG[name]
        return R.pointwise(name, args, kwargs, rows, dim=R.arg(args, kwargs, pos, ("dim",), default))
    if name in C.ALONG and any_rows:
        pos, default = C.ALONG[name]
        d = default if pos is None else R.arg(args, kwargs, pos, ("dim", "dims", "axis", "dimension"), default)
        if name in ("softmax", "log_softmax", "softmin") and d is None:
            d = 0 if ndim in (0, 1, 3) else 1  # torch's legacy implicit dim
        return refused(WHY_ALONG, HINT_SUM) if R.touches_rows(d, ndim) else RUN
    if name in C.TRANSPOSE and self_rows:
        return refused(WHY_MOVE) if R.moves_rows(name, args, kwargs, ndim) else RUN
    if name in C.PAIRS and any_rows:
        return refused(WHY_PAIRS, HINT_PAIRS)
    if name == "__getitem__":
        return R.getitem(args, rows, _n_owned(this))
    if name == "__setitem__":
        return R.setitem(args, rows, _n_owned(this))
    if name in C.RESHAPE and any_rows:
        return R.reshape(name, args, kwargs, rows)
    if name in C.MATMUL and any_rows:
        return R.matmul(name, args, kwargs, rows)
    if name in C.BATCHED_MATRIX and any_rows:
        return RUN if self_rows and ndim >= 3 else refused(R.WHY_MERGE if ndim < 3 else WHY_MOVE, HINT_SUM)
    if name in C.NORMS and any_rows:
        return _norm(name, args, kwargs, rows)
    if name in C.INDEX_SUM or name in C.SCATTER_REDUCE or name in C.SCATTER_COPY:
        return R.scatter(name, args, kwargs, rows)
    if name in C.GATHER:
        return R.gather(name, args, kwargs, rows)
    op = C.DUNDER.get(name, name)
    if op in C.POINTWISE:
        return R.pointwise(op, args, kwargs, rows)
    return refused(WHY_UNKNOWN, HINT_PAIRS) if any_rows else RUN


def _under_vmap() -> bool:
    """Whether a `torch.vmap` transform is active: it maps over rows, hiding a block's atom dimension."""
    if torch._C._functorch.maybe_current_level() is None:
        return False
    stack = torch._C._functorch.get_interpreter_stack() or []
    return any(i.key() == torch._C._functorch.TransformType.Vmap for i in stack)


def _n_owned(x: Any) -> int | None:
    """The owned row count of a row-layout ShardTensor (None for anything else)."""
    meta = getattr(x, "__dict__", {}).get("_jb")
    return None if meta is None else meta.context.n_owned


def _norm(name: str, args: tuple, kwargs: dict, rows: Callable[[Any], bool]) -> Verdict:
    """Normalization layers: statistics per row are row-local; statistics over rows are not."""
    this = args[0] if args else None
    params = [a for a in R.flat(args[1:], kwargs) if isinstance(a, torch.Tensor)]
    why = "normalizes with statistics over the atom dimension (dim 0)"
    if any(rows(p) for p in params) or not rows(this):
        return refused(why, HINT_SUM)
    if name == "batch_norm":
        training = R.arg(args, kwargs, 5, ("training",), False)
        return refused(why, HINT_SUM) if training or R.arg(args, kwargs, 1, ("running_mean",)) is None else RUN
    if name in ("layer_norm", "rms_norm"):
        shape = R.arg(args, kwargs, 1, ("normalized_shape",), ())
        n = 1 if isinstance(shape, int) else len(shape)
        return refused(why, HINT_SUM) if n >= this.ndim else RUN
    return RUN if this.ndim >= 2 else refused(why, HINT_SUM)  # group_norm / instance_norm: per sample


def leading_block(func: Any, args: tuple, kwargs: dict, rows: Callable[[Any], bool]) -> Any:
    """The row-layout block whose rows lead the result, in order, or None.

    Two ops keep a block's rows at the front: a basic slice `x[:k]` / `x[:k, ...]`
    (the result holds its first k rows) and `torch.cat([x, *plain], dim=0)` (the
    block, then trailing rows). The caller decides which layout still describes
    the result from its row count.
    """
    name = short_name(func)
    if name == "__getitem__" and len(args) > 1 and rows(args[0]) and not any(
            map(R._advanced, args[1] if isinstance(args[1], tuple) else (args[1],))):
        first = args[1][0] if isinstance(args[1], tuple) and args[1] else args[1]
        if isinstance(first, slice) and first.start in (None, 0) and first.step in (None, 1):
            return args[0]
    if name in ("cat", "concat", "concatenate"):
        ts, dim = R.arg(args, kwargs, 0, ("tensors",), ()), R.arg(args, kwargs, 1, ("dim", "axis"), 0)
        if ts and rows(ts[0]) and ts[0].ndim and isinstance(dim, int) and dim % ts[0].ndim == 0 \
                and not any(rows(t) for t in ts[1:]):
            return ts[0]
    return None


def where(args: tuple, kwargs: dict, rows: Callable[[Any], bool]) -> str:
    """Which argument is the row block, for the message: ", argument 0 of shape (12, 3)"."""
    for key, a in [*enumerate(args), *kwargs.items()]:
        for sub, b in ([(f"[{i}]", b) for i, b in enumerate(a)] if isinstance(a, (list, tuple)) else [("", a)]):
            if rows(b):
                return f", argument {key}{sub} of shape {tuple(b.shape)}"
    return ""


def check_kept(func: Any, out: Any, layout: str, rank: int, lead: int, verdict: Verdict,
               marked: Callable[[torch.Tensor], bool], at: str = "") -> None:
    """Refuse a result tensor that left the row layout (`marked(t)` is False: it got no layout)."""
    for t in _tensors_in(out):
        if not marked(t):
            why = verdict.why or (f"gives a result of shape {tuple(t.shape)}, which leaves the row layout "
                                  f"(the block has {lead} rows)")
            refuse(func, layout, rank, why, verdict.hint, aten=aten_name(func, verdict),
                   family=verdict.family or C.family(short_name(func) or "").key, at=at)


def _tensors_in(out: Any) -> Any:
    """Tensors of a result, through tuples and lists."""
    if isinstance(out, torch.Tensor):
        yield out
    elif isinstance(out, (tuple, list)):
        for o in out:
            yield from _tensors_in(o)


def refuse(func: Any, layout: str, rank: int, why: str, hint: str = "", *, aten: str = "", family: str = "",
           at: str = "") -> None:
    """Raise the error for a refused call (see `classify`): the op, its aten name, the argument, why, the fix."""
    fam = f" (op family {family!r} of the catalogue in docs/guide.md)" if family else ""
    raise ShardTensorMeaningError(
        f"{op_name(func)} ({aten or aten_name(func)}) on a ShardTensor with layout {layout!r} (rank {rank}{at}) "
        f"{why}; its distributed meaning is not known, so it is refused rather than computed on this rank's "
        f"rows{fam}. Fix: {hint}distribute a message-passing model with the model level (nvalchemi_jaxbridge.mlip), "
        "which refreshes and folds ghost rows per layer; declare an OpAdapter for an opaque kernel "
        "(gather_inputs for one that reads its neighbours' rows: a halo); sum over atoms with .system_sum() "
        "(owned rows, then an all-reduce); take the whole array on every rank with .full_tensor() (a "
        "collective); or call .to_local() to take responsibility for the ghost rows explicitly"
    )
