"""What a torch op means for a ShardTensor in a row layout ("owned" or "halo"): pure classification.

A block in a row layout holds this rank's rows of a distributed per-atom tensor
(owned rows, then ghost copies of other ranks' atoms, then pad rows). Most torch
ops act row by row and mean the same on the block as on the whole array; some
do not, and running them on the block silently gives a per-rank answer (a sum
that counts ghost rows, a scatter that mixes them into owned rows). `classify`
sorts a call into one of:

- `"run"`: row-wise, or not about the rows at all; run it on the block. The
  result keeps the layout if it keeps the leading dimension; a result that
  leaves the row layout is refused after the call (`leaves_layout`) unless the
  verdict says a plain result is fine (`plain_ok`: basic slicing, `new_*`).
- `"owned_sum"`: a sum over the atom dimension; the policy's meaning is the
  owned rows summed on each rank, then an all-reduce (a replicated result).
- `"index_sum"`: `index_add(_)` / `scatter_add(_)` of a row-layout source into
  another row space (e.g. `n_systems` rows): the same, per target row.
- `"refuse"`: no known distributed meaning; `refuse` raises
  `ShardTensorMeaningError` naming the op, the layout and the fix.

Replicated ShardTensors are never classified: they hold the same value on every
rank, so plain torch semantics are already the global ones.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch


class ShardTensorMeaningError(RuntimeError):
    """A ShardTensor in a row layout met an op whose distributed meaning is not known.

    A `RuntimeError`, not a `TypeError`: torch turns a `TypeError` raised inside a
    binary operator (`a @ b`, `a + b`) into `NotImplemented`, and Python then
    reports only "unsupported operand type(s)", losing the message.
    """


@dataclasses.dataclass(frozen=True)
class Verdict:
    """What to do with one call (see the module docstring)."""

    action: str  # "run", "owned_sum", "index_sum", "refuse"
    why: str = ""  # for "refuse", and for "run" results that leave the row layout
    hint: str = ""  # the family's own fix, said before the general ones
    plain_ok: bool = False  # "run": a result that leaves the row layout is returned as a plain tensor


RUN = Verdict("run")
_PLAIN = Verdict("run", plain_ok=True)

# ---- the op families ---------------------------------------------------------------

_SUM = {"sum", "nansum"}
# reductions: name -> (position of `dim` counting self as 0, its default); None = all dims
_REDUCE = {n: (1, None) for n in (
    "mean", "nanmean", "prod", "amax", "amin", "argmax", "argmin", "std", "var", "std_mean", "var_mean",
    "logsumexp", "all", "any", "count_nonzero", "median", "nanmedian", "max", "min", "aminmax")}
_REDUCE |= {"mode": (1, -1), "norm": (2, None), "vector_norm": (2, None), "matrix_norm": (2, (-2, -1)),
            "quantile": (2, None), "nanquantile": (2, None), "kthvalue": (2, -1), "topk": (2, -1)}
_WHOLE = {"dist", "trace", "allclose", "equal", "unique", "unique_consecutive", "nonzero",
          "argwhere", "masked_select", "take", "histc", "histogram", "histogramdd", "kron", "tensordot",
          "addbmm", "chain_matmul", "multi_dot"}
# shape-preserving ops that mix rows along `dim`: name -> (position, default)
_ALONG = {n: (1, None) for n in ("cumsum", "cumprod", "cummax", "cummin", "logcumsumexp", "softmax",
                                 "log_softmax", "softmin", "flip")}
_ALONG |= {"sort": (1, -1), "argsort": (1, -1), "diff": (2, -1), "normalize": (2, 1), "renorm": (2, None),
           "roll": (2, None), "msort": (None, 0), "flipud": (None, 0), "take_along_dim": (2, None)}
_TRANSPOSE = {"T", "H", "t", "t_", "mT", "mH", "adjoint", "transpose", "transpose_", "swapaxes", "swapaxes_",
              "swapdims", "swapdims_", "permute", "movedim", "moveaxis", "rot90"}
_MATMUL = {"matmul", "__matmul__", "__rmatmul__", "mm", "mv", "bmm", "addmm", "addmv", "baddbmm", "dot",
           "vdot", "inner", "outer", "ger", "linear", "einsum"}
_INDEX_SUM = {"index_add", "index_add_", "scatter_add", "scatter_add_"}
_SCATTER_REDUCE = {"scatter_reduce", "scatter_reduce_", "index_reduce", "index_reduce_", "bincount",
                   "segment_reduce", "_segment_reduce"}
_SCATTER_COPY = {"index_copy", "index_copy_", "scatter", "scatter_", "index_put", "index_put_", "put",
                 "put_", "masked_scatter", "masked_scatter_"}
_GATHER = {"__getitem__", "index_select", "gather", "embedding"}
_HOST = {"item", "tolist", "numpy", "__array__", "__float__", "__int__", "__index__", "__complex__",
         "__bool__", "__contains__", "is_nonzero"}
_FACTORIES = {"new_zeros", "new_ones", "new_empty", "new_full", "new_tensor", "new_empty_strided"}
_NOT_CHECKED = {"grad", "backward", "__reduce_ex__", "__deepcopy__", "__setstate__", "__repr__", "__format__"}

_WHY_REDUCE = "reduces over the atom dimension (dim 0)"
_WHY_CONTRACT = "contracts the atom dimension (dim 0)"
_WHY_ALONG = "mixes rows along the atom dimension (dim 0)"
_WHY_MOVE = "moves the atom dimension away from dim 0"
_WHY_SCATTER_IN = ("accumulates into this rank's atom rows by index; whether partials on ghost rows must "
                   "be folded into their owners is not known")
_WHY_SCATTER_OUT = "scatters atom rows by index into another row space, where ghost rows would count again"
_WHY_GATHER = ("gathers rows with an index tensor; the result leaves the row layout, so its ghost rows "
               "can no longer be told apart from owned rows")
_WHY_HOST = "reads this rank's block as a Python or host value: a per-rank partial, not the global value"
_HINT_SUM = "for a sum over atoms use x.sum(0) or x.system_sum(); "
_HINT_SYSTEMS = "for a per-system sum use x.system_sum(batch, n_systems=...); "
_HINT_HOST = "x.full_tensor() gives the global array (a collective), x.to_local() this rank's block; "


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


def _arg(args: tuple, kwargs: dict, pos: int | None, names: tuple[str, ...], default: Any = None) -> Any:
    """An argument by position (self is 0) or by one of its keyword names."""
    for n in names:
        if n in kwargs:
            return kwargs[n]
    return args[pos] if pos is not None and pos < len(args) else default


def _dims(d: Any, ndim: int) -> set[int] | None:
    """Normalized dims of a `dim` argument; None means all dims."""
    if d is None or (isinstance(d, (list, tuple)) and len(d) == 0):
        return None
    ds = d if isinstance(d, (list, tuple)) else (d,)
    if not all(isinstance(v, int) for v in ds):
        return set()  # named dims or the like: not about dim 0 as far as we can tell
    n = max(ndim, 1)
    return {v % n for v in ds}


def _touches_rows(d: Any, ndim: int) -> bool:
    """Whether a `dim` argument includes the atom dimension."""
    dims = _dims(d, ndim)
    return dims is None or 0 in dims


def classify(func: Any, args: tuple, kwargs: dict, rows: Callable[[Any], bool]) -> Verdict:
    """The verdict for `func(*args, **kwargs)`; `rows(a)` says whether `a` is a row-layout ShardTensor."""
    name = short_name(func)
    if name is None or name in _NOT_CHECKED:
        return RUN if name is None else _PLAIN
    this = args[0] if args else None
    self_rows = rows(this)
    ndim = this.ndim if isinstance(this, torch.Tensor) else 0
    if name in _HOST:
        return Verdict("refuse", _WHY_HOST, _HINT_HOST) if self_rows else RUN
    if name in _FACTORIES:
        return _PLAIN
    if name in _SUM and self_rows:
        return Verdict("owned_sum") if _touches_rows(_arg(args, kwargs, 1, ("dim", "axis")), ndim) else RUN
    if name in _REDUCE and self_rows:
        pos, default = _REDUCE[name]
        if name in ("max", "min") and isinstance(_arg(args, kwargs, 1, ("other",)), torch.Tensor):
            return RUN  # elementwise maximum / minimum
        if _touches_rows(_arg(args, kwargs, pos, ("dim", "axis"), default), ndim):
            return Verdict("refuse", _WHY_REDUCE, _HINT_SUM)
        return RUN
    if name in _WHOLE and any(rows(a) for a in _flat(args, kwargs)):
        return Verdict("refuse", _WHY_REDUCE if name not in ("nonzero", "argwhere", "masked_select", "take")
                       else _WHY_GATHER, _HINT_SUM)
    if name in _ALONG and self_rows:
        pos, default = _ALONG[name]
        d = default if pos is None else _arg(args, kwargs, pos, ("dim", "dims", "axis"), default)
        if name in ("softmax", "log_softmax", "softmin") and d is None:
            d = 0 if ndim in (0, 1, 3) else 1  # torch's legacy implicit dim
        return Verdict("refuse", _WHY_ALONG, _HINT_SUM) if _touches_rows(d, ndim) else RUN
    if name in _TRANSPOSE and self_rows:
        return Verdict("refuse", _WHY_MOVE) if _moves_rows(name, args, kwargs, ndim) else RUN
    if name in _MATMUL:
        return _matmul(name, args, kwargs, rows)
    if name == "batch_norm" and rows(this):
        training = _arg(args, kwargs, 5, ("training",), False)
        if training or _arg(args, kwargs, 1, ("running_mean",)) is None:
            return Verdict("refuse", "normalizes with statistics over the atom dimension (dim 0)", _HINT_SUM)
        return RUN
    if name in _INDEX_SUM or name in _SCATTER_REDUCE or name in _SCATTER_COPY:
        return _scatter(name, args, kwargs, rows)
    if name in _GATHER:
        return _gather(name, args, kwargs, rows)
    if name == "__setitem__" and not self_rows and len(args) > 2 and rows(args[2]) and _advanced(args[1]):
        return Verdict("refuse", _WHY_SCATTER_OUT, _HINT_SYSTEMS)  # plain[idx] = x: a scatter of atom rows
    if name in ("cat", "concat", "concatenate", "stack", "split", "chunk", "unbind", "tensor_split"):
        return Verdict("run", "joins or splits blocks along the atom dimension (dim 0)")
    return RUN


def leading_block(func: Any, args: tuple, kwargs: dict, rows: Callable[[Any], bool]) -> Any:
    """The row-layout block whose rows lead the result, in order, or None.

    Two ops keep a block's rows at the front: a basic slice `x[:k]` / `x[:k, ...]`
    (the result holds its first k rows) and `torch.cat([x, *plain], dim=0)` (the
    block, then trailing rows). The caller decides which layout still describes
    the result from its row count.
    """
    name = short_name(func)
    if name == "__getitem__" and len(args) > 1 and rows(args[0]) and not _advanced(args[1]):
        first = args[1][0] if isinstance(args[1], tuple) and args[1] else args[1]
        if isinstance(first, slice) and first.start in (None, 0) and first.step in (None, 1):
            return args[0]
    if name in ("cat", "concat", "concatenate"):
        ts, dim = _arg(args, kwargs, 0, ("tensors",), ()), _arg(args, kwargs, 1, ("dim", "axis"), 0)
        if ts and rows(ts[0]) and ts[0].ndim and isinstance(dim, int) and dim % ts[0].ndim == 0 \
                and not any(rows(t) for t in ts[1:]):
            return ts[0]
    return None


def _flat(args: tuple, kwargs: dict) -> list[Any]:
    """Arguments, one level into lists and tuples."""
    out = []
    for a in (*args, *kwargs.values()):
        out += list(a) if isinstance(a, (list, tuple)) else [a]
    return out


def _gather(name: str, args: tuple, kwargs: dict, rows: Callable[[Any], bool]) -> Verdict:
    """Index gathers: refused when they pick rows of a row-layout block by an index tensor.

    Whatever the index's length, its result is a new row space (edges, a
    subset, a permutation), so the layout no longer describes it.
    """
    this = args[0] if args else None
    refuse = Verdict("refuse", _WHY_GATHER, "take the owned rows with x[:x.n_owned]; ")
    if name == "__getitem__":
        key = args[1] if len(args) > 1 else None
        if not rows(this):
            return Verdict("run", _WHY_GATHER)  # an index ShardTensor: rows of the result are its rows
        first = key[0] if isinstance(key, tuple) and key else key
        if _advanced((first,)):
            return refuse
        return Verdict("run", _WHY_GATHER) if _advanced(key) else _PLAIN  # x[:, idx] is row-wise
    if name == "embedding":
        return refuse if rows(_arg(args, kwargs, 1, ("weight",))) else RUN
    if rows(this) and _touches_rows(_arg(args, kwargs, 1, ("dim",), 0), this.ndim):
        return refuse
    return Verdict("run", _WHY_GATHER)


def _advanced(key: Any) -> bool:
    """Whether an indexing key holds an index tensor, list or array (advanced indexing)."""
    keys = key if isinstance(key, tuple) else (key,)
    return any(isinstance(k, (torch.Tensor, list)) or hasattr(k, "__array__") for k in keys)


def _moves_rows(name: str, args: tuple, kwargs: dict, ndim: int) -> bool:
    """Whether a transpose-like op moves dim 0."""
    if name in ("T", "H", "t", "t_"):
        return ndim >= 2
    if name in ("mT", "mH", "adjoint"):
        return ndim == 2
    if name in ("transpose", "transpose_", "swapaxes", "swapaxes_", "swapdims", "swapdims_"):
        a, b = (_arg(args, kwargs, 1, ("dim0", "axis0")), _arg(args, kwargs, 2, ("dim1", "axis1")))
        a, b = a % max(ndim, 1), b % max(ndim, 1)
        return a != b and 0 in (a, b)
    if name == "permute":
        dims = args[1:] if len(args) > 2 or not isinstance(args[1] if len(args) > 1 else None, (list, tuple)) \
            else args[1]
        dims = kwargs.get("dims", dims)
        return bool(dims) and dims[0] % max(ndim, 1) != 0
    if name in ("movedim", "moveaxis"):
        src = _dims(_arg(args, kwargs, 1, ("source",)), ndim) or set()
        dst = _dims(_arg(args, kwargs, 2, ("destination",)), ndim) or set()
        return (0 in src or 0 in dst) and not (src == {0} and dst == {0})
    if name == "rot90":
        k, dims = _arg(args, kwargs, 1, ("k",), 1), _arg(args, kwargs, 2, ("dims",), (0, 1))
        return k % 4 != 0 and 0 in (_dims(dims, ndim) or set())
    return False


def _matmul(name: str, args: tuple, kwargs: dict, rows: Callable[[Any], bool]) -> Verdict:
    """Products: refused when a row-layout operand's atom dimension is contracted or moved."""
    refuse = Verdict("refuse", _WHY_CONTRACT, _HINT_SUM)
    if name == "einsum":
        return _einsum(args, rows)
    if name in ("addmm", "addmv", "baddbmm"):
        a, b = args[1:3] if len(args) >= 3 else (kwargs.get("mat1"), kwargs.get("mat2"))
        if rows(args[0] if args else None) and not (rows(a) or rows(b)):
            return RUN
    elif name == "__rmatmul__":
        b, a = args[:2]
    elif name == "linear":
        a, w = args[0], _arg(args, kwargs, 1, ("weight",))
        return refuse if rows(w) or (rows(a) and a.ndim == 1) else RUN
    else:
        a, b = (args + (None, None))[:2]
    if rows(a) and (a.ndim == 1 or name in ("dot", "vdot")):
        return refuse
    if rows(b) and (b.ndim <= 2 or name in ("dot", "vdot", "inner", "outer", "ger")):
        return refuse
    return RUN


def _einsum(args: tuple, rows: Callable[[Any], bool]) -> Verdict:
    """einsum: the index of every row-layout operand's dim 0 must lead the output."""
    if not args or not isinstance(args[0], str):
        if any(rows(a) for a in _flat(args, {})):
            return Verdict("refuse", "is an einsum in sublist form, which is not read here", _HINT_SUM)
        return RUN
    ops = list(args[1]) if len(args) == 2 and isinstance(args[1], (list, tuple)) else list(args[1:])
    eq = args[0].replace(" ", "")
    lhs, arrow, out = eq.partition("->")
    if not arrow:  # implicit output: the ellipsis, then the indices seen once, sorted
        letters = [c for c in lhs if c.isalpha()]
        out = ("..." if "..." in lhs else "") + "".join(sorted(c for c in set(letters) if letters.count(c) == 1))
    for term, op in zip(lhs.split(","), ops):
        if not rows(op):
            continue
        explicit = term.replace("...", "")
        lead = "..." if term.startswith("...") and op.ndim > len(explicit) else explicit[:1]
        out_lead = "..." if out.startswith("...") else out[:1]
        if lead != out_lead:
            return Verdict("refuse", _WHY_CONTRACT if lead not in out else _WHY_MOVE, _HINT_SUM)
    return RUN


def _scatter(name: str, args: tuple, kwargs: dict, rows: Callable[[Any], bool]) -> Verdict:
    """Scatter / index reductions: routed (a sum into another row space), row-local, or refused."""
    this = args[0] if args else None
    operands = [a for a in _flat(args[1:], kwargs) if isinstance(a, torch.Tensor)]
    if name in ("bincount", "segment_reduce", "_segment_reduce"):
        return Verdict("refuse", _WHY_SCATTER_OUT, _HINT_SYSTEMS) if rows(this) or any(map(rows, operands)) \
            else RUN
    if name.startswith(("index_put", "put", "masked_scatter")):
        dim, reduce = 0, bool(_arg(args, kwargs, 3, ("accumulate",), False))
    else:
        dim = _arg(args, kwargs, 1, ("dim",), 0)
        reduce = name not in _SCATTER_COPY or _arg(args, kwargs, 4, ("reduce",)) is not None
    ndim = this.ndim if isinstance(this, torch.Tensor) else 1
    if isinstance(dim, int) and dim % max(ndim, 1) != 0:
        return RUN  # along a feature dimension: row by row
    if rows(this):
        return Verdict("refuse", _WHY_SCATTER_IN) if reduce else RUN  # a copy into its own rows is row-local
    if not any(map(rows, operands)):
        return RUN
    if name in _INDEX_SUM and rows(_arg(args, kwargs, 3, ("source", "src"))):
        return Verdict("index_sum", _WHY_SCATTER_OUT, _HINT_SYSTEMS)
    return Verdict("refuse", _WHY_SCATTER_OUT, _HINT_SYSTEMS)


def check_kept(func: Any, out: Any, layout: str, rank: int, lead: int, verdict: Verdict,
               marked: Callable[[torch.Tensor], bool]) -> None:
    """Refuse a result tensor that left the row layout (`marked(t)` is False: it got no layout)."""
    for t in _tensors_in(out):
        if not marked(t):
            why = verdict.why or (f"gives a result of shape {tuple(t.shape)}, which leaves the row layout "
                                  f"(the block has {lead} rows)")
            refuse(func, layout, rank, why, verdict.hint)


def _tensors_in(out: Any) -> Any:
    """Tensors of a result, through tuples and lists."""
    if isinstance(out, torch.Tensor):
        yield out
    elif isinstance(out, (tuple, list)):
        for o in out:
            yield from _tensors_in(o)


def refuse(func: Any, layout: str, rank: int, why: str, hint: str = "") -> None:
    """Raise the error for a refused call (see `classify`)."""
    raise ShardTensorMeaningError(
        f"{op_name(func)} on a ShardTensor with layout {layout!r} (rank {rank}) {why}; its distributed "
        f"meaning is not known, so it is refused rather than computed on this rank's rows. Fix: {hint}"
        "distribute a message-passing model with the model level (nvalchemi_jaxbridge.mlip), which refreshes "
        "and folds ghost rows per layer; declare an OpAdapter for an opaque kernel; sum over atoms with "
        ".system_sum() (owned rows, then an all-reduce); or call .to_local() to take responsibility for the "
        "ghost rows explicitly"
    )
