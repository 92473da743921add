"""The conditions under which a known op keeps a row block's atom dimension whole at dim 0 (pure functions).

Each rule takes the call and `rows(a)` (whether `a` is a row-layout
ShardTensor) and returns a `Verdict` (see `meaning.py`). They decide from the
op's arguments and the operands' shapes before anything runs, so an op that
would pair all rows (an `n x n` matrix) is refused before it allocates.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from .meaning_verdict import (
    HINT_GATHER, HINT_SUM, HINT_SYSTEMS, PLAIN, RUN, WHY_CONTRACT, WHY_GATHER, WHY_MOVE, WHY_SCATTER_IN,
    WHY_SCATTER_OUT, Verdict, refused,
)
from .op_catalogue import INDEX_SUM, SCATTER_COPY

Rows = Callable[[Any], bool]
WHY_PLAIN_OUT = "writes atom rows into a plain tensor, which then carries them with no layout"
WHY_SUBSET = "takes a subset of the atom rows (dim 0), which is not a layout"
WHY_ONE_ROW = "selects one atom row (an integer index on dim 0)"
WHY_SPREAD = "spreads a one-row block over several rows by broadcasting"
WHY_NEW_DIM = "inserts a dimension before the atom dimension, which moves it away from dim 0"
WHY_MERGE = "merges or splits the atom dimension (dim 0) with other dimensions"
HINT_VIEW = ("keep the atom dimension first (x[:, None], x.unsqueeze(1), x.reshape(x.shape[0], -1)); for all "
             "pairs of atoms, declare the pair computation as a kernel with OpAdapter(op, gather_inputs=[...]) "
             "(a halo of one cutoff) or run it on x.full_tensor(); ")


def flat(args: tuple, kwargs: dict) -> list[Any]:
    """Arguments, one level into lists and tuples (`out=` left out)."""
    out = []
    for a in (*args, *(v for k, v in kwargs.items() if k != "out")):
        out += list(a) if isinstance(a, (list, tuple)) else [a]
    return out


def arg(args: tuple, kwargs: dict, pos: int | None, names: tuple[str, ...], default: Any = None) -> Any:
    """An argument by position (self is 0) or by one of its keyword names."""
    for n in names:
        if n in kwargs:
            return kwargs[n]
    return args[pos] if pos is not None and pos < len(args) else default


def dims(d: Any, ndim: int) -> set[int] | None:
    """Normalized dims of a `dim` argument; None means all dims."""
    if d is None or (isinstance(d, (list, tuple)) and len(d) == 0):
        return None
    ds = d if isinstance(d, (list, tuple)) else (d,)
    if not all(isinstance(v, int) for v in ds):
        return set()  # named dims or the like: not about dim 0 as far as we can tell
    n = max(ndim, 1)
    return {v % n for v in ds}


def touches_rows(d: Any, ndim: int) -> bool:
    """Whether a `dim` argument includes the atom dimension."""
    ds = dims(d, ndim)
    return ds is None or 0 in ds


def pointwise(name: str, args: tuple, kwargs: dict, rows: Rows, *, dim: Any = None) -> Verdict:
    """Elementwise ops with broadcasting: every block's atom dimension must be the result's dim 0, whole.

    `x[:, None] - x` broadcasts the second `x` to (1, n, 3): its atoms land on dim 1
    (a pairwise matrix), so it is refused. With `dim` (cross, cosine_similarity) the
    op also acts along `dim`, which must not be 0.
    """
    tensors = [t for t in flat(args, kwargs) if isinstance(t, torch.Tensor)]
    blocks = [t for t in tensors if rows(t)]
    out = kwargs.get("out")
    if out is not None and blocks and not all(rows(t) for t in (out if isinstance(out, (list, tuple)) else [out])):
        return refused(WHY_PLAIN_OUT + " (out=)", "drop out= and use the result; ")
    if not blocks:
        return RUN
    inplace = (name.endswith("_") and not name.startswith("__")) or name.startswith("__i")
    if inplace and args and isinstance(args[0], torch.Tensor) and not rows(args[0]):
        return refused(WHY_PLAIN_OUT + " (in place)", "use the out-of-place op, whose result keeps the layout; ")
    try:
        shape = torch.broadcast_shapes(*(t.shape for t in tensors))
    except RuntimeError:
        return RUN  # torch raises its own shape error
    for i, t in enumerate(tensors):
        if not rows(t):
            continue
        if t.ndim != len(shape):
            return refused(f"broadcasts operand {i} of shape {tuple(t.shape)} to {tuple(shape)}, which puts its "
                           f"atom dimension at dim {len(shape) - t.ndim} (rows paired with other rows)", HINT_VIEW)
        if t.shape[0] != shape[0]:
            return refused(WHY_SPREAD, HINT_VIEW)
    if dim is not None and touches_rows(dim, len(shape)):
        return refused("acts along the atom dimension (dim 0)", HINT_SUM)
    return RUN


def _size_args(args: tuple, kwargs: dict, names: tuple[str, ...]) -> list[Any]:
    """Sizes given as `f(x, a, b)`, `f(x, (a, b))` or a keyword."""
    for n in names:
        if n in kwargs:
            v = kwargs[n]
            return list(v) if isinstance(v, (list, tuple, torch.Size)) else [v]
    rest = args[1:]
    if len(rest) == 1 and isinstance(rest[0], (list, tuple, torch.Size)):
        return list(rest[0])
    return list(rest)


def reshape(name: str, args: tuple, kwargs: dict, rows: Rows) -> Verdict:
    """Shape ops: the atom dimension must stay dim 0 with its size, every row keeping its own entries."""
    this = args[0] if args else None
    if name in ("cat", "concat", "concatenate", "stack"):
        return _join(name, args, kwargs, rows)
    if not rows(this):
        blocks = [a for a in flat(args[1:], kwargs) if rows(a)]
        return refused(WHY_MERGE, HINT_VIEW) if blocks and name not in ("view_as", "reshape_as", "expand_as") \
            else RUN
    nd, n = this.ndim, this.shape[0]
    merge = refused(WHY_MERGE, HINT_VIEW)
    if name in ("view", "reshape", "view_as", "reshape_as"):
        target = _size_args(args, kwargs, ("shape", "size", "dtype", "other"))
        if name.endswith("_as"):
            target = list(target[0].shape) if target and isinstance(target[0], torch.Tensor) else target
        if len(target) == 1 and isinstance(target[0], torch.dtype):
            return RUN if nd >= 2 or torch.empty((), dtype=target[0]).element_size() == this.element_size() \
                else merge
        return _rows_kept(target, this, merge)
    if name in ("unsqueeze", "unsqueeze_"):
        d = arg(args, kwargs, 1, ("dim",), 0)
        return refused(WHY_NEW_DIM, HINT_VIEW) if d % (nd + 1) == 0 else RUN
    if name in ("squeeze", "squeeze_"):
        d = arg(args, kwargs, 1, ("dim",), None)
        if d is None:  # every singleton dim but the atoms': what x.squeeze() means for the whole array
            keep = tuple(i for i in range(1, nd) if this.shape[i] == 1)
            return Verdict("run", args=(this, keep), kwargs={})
        return refused("removes the atom dimension (dim 0)", HINT_VIEW) if touches_rows(d, nd) else RUN
    if name == "flatten":
        s, e = arg(args, kwargs, 1, ("start_dim",), 0) % max(nd, 1), arg(args, kwargs, 2, ("end_dim",), -1) % max(nd, 1)
        return merge if s == 0 and e > 0 else RUN
    if name == "ravel":
        return merge if nd > 1 else RUN
    if name == "unflatten":
        return merge if arg(args, kwargs, 1, ("dim",), 0) % nd == 0 else RUN
    if name in ("expand", "broadcast_to", "expand_as"):
        sizes = _size_args(args, kwargs, ("size", "shape", "other"))
        if name == "expand_as":
            sizes = list(sizes[0].shape) if sizes and isinstance(sizes[0], torch.Tensor) else sizes
        if len(sizes) != nd:
            return refused(WHY_NEW_DIM, HINT_VIEW)
        return RUN if sizes[0] in (-1, n) else refused(WHY_SPREAD, HINT_VIEW)
    if name in ("repeat", "tile"):
        reps = _size_args(args, kwargs, ("repeats", "sizes", "dims"))
        if len(reps) > nd or not reps:
            return refused(WHY_NEW_DIM, HINT_VIEW) if reps else RUN
        return RUN if len(reps) < nd and name == "tile" or reps[0] == 1 else refused(
            "repeats the atom rows along dim 0", HINT_VIEW)
    if name == "repeat_interleave":
        d = arg(args, kwargs, 2, ("dim",), None)
        return merge if d is None or d % nd == 0 else RUN
    pos = 1 if name in ("narrow", "select", "unbind") else 2
    d = arg(args, kwargs, pos, ("dim",), 0)
    return refused("splits or selects along the atom dimension (dim 0)", HINT_GATHER) if d % nd == 0 else RUN


def _rows_kept(target: list[Any], this: torch.Tensor, merge: Verdict) -> Verdict:
    """view/reshape to `target`: dim 0 keeps its size and every row its own entries (row-major order)."""
    if not all(isinstance(s, int) for s in target):
        return merge
    n, per_row = this.shape[0], math.prod(this.shape[1:])
    if not target or target.count(-1) > 1:
        return merge
    if -1 in target[1:]:
        return RUN if target[0] == n else merge
    return RUN if target[0] in (-1, n) and math.prod(target[1:]) == per_row else merge


def _join(name: str, args: tuple, kwargs: dict, rows: Rows) -> Verdict:
    """cat / stack: along a feature dim row-local; along dim 0 only a block followed by plain pad rows."""
    ts = list(arg(args, kwargs, 0, ("tensors",), ()))
    if not any(rows(t) for t in ts):
        return RUN
    d, nd = arg(args, kwargs, 1, ("dim", "axis"), 0), ts[0].ndim
    if name == "stack":
        return refused(WHY_NEW_DIM, "stack along a feature dim (torch.stack(xs, dim=1)); ") \
            if d % (nd + 1) == 0 else RUN
    if d % max(nd, 1) != 0:
        return RUN
    if rows(ts[0]) and not any(rows(t) for t in ts[1:]):
        return Verdict("run", "joins rows after the block's rows, which leaves the layout unless they are pad rows")
    return refused("joins blocks along the atom dimension (dim 0)", "cat along a feature dim; ")


def getitem(args: tuple, rows: Rows, n_owned: int | None) -> Verdict:
    """`x[key]`: the atom dimension must be kept whole (`:` or `...`) or cut to a layout (`x[:x.n_owned]`)."""
    this, key = args[0], args[1] if len(args) > 1 else None
    entries = list(key) if isinstance(key, tuple) else [key]
    adv = [i for i, e in enumerate(entries) if _advanced(e)]
    if not rows(this):  # a block used as the index: result rows are its rows when it is the only, first index
        block_at = [i for i, e in enumerate(entries) if rows(e)]
        if not block_at:
            return RUN
        return Verdict("run", WHY_GATHER) if block_at == [0] and adv == [0] else refused(
            "indexes a tensor with an atom block that is not its first and only index, so the atom "
            "dimension does not lead the result", HINT_VIEW)
    used = sum(e.ndim if isinstance(e, torch.Tensor) and e.dtype == torch.bool else 1 for e in entries
               if e is not None and e is not Ellipsis and not isinstance(e, bool))
    first = None
    for e in entries:
        if e is None or isinstance(e, bool):
            return refused(WHY_NEW_DIM, HINT_VIEW, aten="aten::unsqueeze")
        if e is Ellipsis:
            if this.ndim - used > 0:
                first = slice(None)
                break
            continue
        first = e
        break
    if len(adv) > 1 and adv[-1] - adv[0] + 1 != len(adv):  # torch moves separated index dims to the front
        return refused("mixes separated index tensors, so torch moves their dimension before the atom "
                       "dimension", HINT_VIEW, aten="aten::index")
    if first is None or (isinstance(first, slice) and _whole(first, this.shape[0])):
        return PLAIN
    if _advanced(first) or isinstance(first, torch.Tensor):
        return refused(WHY_GATHER, HINT_GATHER, aten="aten::index")
    if isinstance(first, int):
        return refused(WHY_ONE_ROW, HINT_GATHER, aten="aten::select")
    if isinstance(first, slice) and first.start in (None, 0) and first.step in (None, 1) and \
            isinstance(first.stop, int):
        if first.stop == n_owned:
            return PLAIN  # x[:x.n_owned]: an "owned" block, or plain owned positions in the wrapped frame
        return Verdict("run", WHY_SUBSET, HINT_GATHER, aten="aten::slice")  # kept only if it is a layout
    return refused(WHY_SUBSET, HINT_GATHER, aten="aten::slice")


def _whole(s: slice, n: int) -> bool:
    """Whether a slice of dim 0 keeps every row, in order."""
    return s.start in (None, 0) and s.step in (None, 1) and (s.stop is None or
                                                             (isinstance(s.stop, int) and s.stop >= n))


def _advanced(key: Any) -> bool:
    """Whether an index entry is an index tensor, list or array (advanced indexing)."""
    return isinstance(key, (torch.Tensor, list)) or hasattr(key, "__array__")


def setitem(args: tuple, rows: Rows, n_owned: int | None) -> Verdict:
    """`x[key] = value`: a write into a block's own rows, never atom rows moved between rows or out."""
    this, key, value = (args + (None, None, None))[:3]
    entries = key if isinstance(key, tuple) else (key,)
    if not rows(this):
        if rows(value):
            if any(_advanced(e) for e in entries):
                return refused(WHY_SCATTER_OUT, HINT_SYSTEMS, aten="aten::index_put_")
            return refused(WHY_PLAIN_OUT, "start from torch.zeros_like(x) (a block) or use x.to_local(); ",
                           aten="aten::index_put_")
        return RUN
    if not rows(value):
        return RUN  # plain values into this block's rows: nothing moves between rows
    where = getitem((this, key), rows, n_owned)
    if where.action == "refuse" or where.why:
        return refused("writes atom rows of another block into a subset of this block's rows", HINT_GATHER,
                       aten="aten::index_put_")
    return RUN


def matmul(name: str, args: tuple, kwargs: dict, rows: Rows) -> Verdict:
    """Products: every block's atom dimension must become the result's dim 0 (a batch or row dim)."""
    refuse = refused(WHY_CONTRACT, HINT_SUM)
    if name == "einsum":
        return _einsum(args, rows)
    if name in ("addmm", "addmv", "baddbmm"):
        a, b = args[1:3] if len(args) >= 3 else (kwargs.get("mat1"), kwargs.get("mat2"))
        if rows(args[0] if args else None) and not (rows(a) or rows(b)):  # the added term is the block
            return RUN if args[0].ndim == {"addmm": 2, "addmv": 1, "baddbmm": 3}[name] else refused(WHY_SPREAD)
    elif name == "__rmatmul__":
        b, a = args[:2]
    elif name in ("linear", "bilinear"):
        xs = [arg(args, kwargs, i, (k,)) for i, k in ((0, "input"), (1, "input2"))][: 2 if name == "bilinear" else 1]
        w = arg(args, kwargs, 2 if name == "bilinear" else 1, ("weight",))
        b = arg(args, kwargs, 3 if name == "bilinear" else 2, ("bias",))
        return refuse if rows(w) or rows(b) or any(rows(x) and x.ndim == 1 for x in xs) else RUN
    else:
        a, b = (args + (None, None))[:2]
    if name in ("dot", "vdot", "inner", "outer", "ger") and (rows(a) or rows(b)):
        return refuse
    nd = lambda t: t.ndim if isinstance(t, torch.Tensor) else 0  # noqa: E731
    if rows(a) and not (nd(a) == 2 and nd(b) <= 2 or nd(a) >= 3 and nd(b) <= nd(a)):
        return refuse
    if rows(b) and not (nd(b) >= 3 and nd(a) <= nd(b)):
        return refuse
    return RUN


def _einsum(args: tuple, rows: Rows) -> Verdict:
    """einsum: the index of every block's dim 0 must lead the output."""
    if not args or not isinstance(args[0], str):
        if any(rows(a) for a in flat(args, {})):
            return refused("is an einsum in sublist form, which is not read here", HINT_SUM)
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
            return refused(WHY_CONTRACT if lead not in out else WHY_MOVE, HINT_SUM)
    return RUN


def scatter(name: str, args: tuple, kwargs: dict, rows: Rows) -> Verdict:
    """Scatter / index reductions: routed (a sum into another row space), row-local, or refused."""
    this = args[0] if args else None
    operands = [a for a in flat(args[1:], kwargs) if isinstance(a, torch.Tensor)]
    if name in ("bincount", "segment_reduce", "_segment_reduce"):
        return refused(WHY_SCATTER_OUT, HINT_SYSTEMS) if rows(this) or any(map(rows, operands)) else RUN
    if name.startswith(("index_put", "put", "masked_scatter")):
        dim, reduce = 0, bool(arg(args, kwargs, 3, ("accumulate",), False))
    else:
        dim = arg(args, kwargs, 1, ("dim",), 0)
        reduce = name not in SCATTER_COPY or arg(args, kwargs, 4, ("reduce",)) is not None
    ndim = this.ndim if isinstance(this, torch.Tensor) else 1
    if isinstance(dim, int) and dim % max(ndim, 1) != 0:
        return RUN  # along a feature dimension: row by row
    if rows(this):
        if reduce:
            return refused(WHY_SCATTER_IN)
        src = [a for a in operands if rows(a) and a is not this]
        return refused("copies atom rows into other rows of the block by index", HINT_GATHER) if src else RUN
    if not any(map(rows, operands)):
        return RUN
    if name in INDEX_SUM and rows(arg(args, kwargs, 3, ("source", "src"))):
        return Verdict("index_sum", WHY_SCATTER_OUT, HINT_SYSTEMS)
    return refused(WHY_SCATTER_OUT, HINT_SYSTEMS)


def gather(name: str, args: tuple, kwargs: dict, rows: Rows) -> Verdict:
    """Index gathers: refused when they pick rows of a block by an index (a new row space, edges or pairs)."""
    this = args[0] if args else None
    refuse = refused(WHY_GATHER, HINT_GATHER)
    if name == "embedding":
        return refuse if rows(arg(args, kwargs, 1, ("weight",))) else RUN
    if name == "one_hot":
        return RUN
    if name in ("take", "masked_select", "nonzero", "argwhere", "unique", "unique_consecutive", "histc",
                "histogram", "histogramdd"):
        return refuse if any(rows(a) for a in flat(args, kwargs)) else RUN
    if name in ("index_fill", "index_fill_"):
        return refuse if rows(this) and touches_rows(arg(args, kwargs, 1, ("dim",), 0), this.ndim) else RUN
    if rows(this) and touches_rows(arg(args, kwargs, 1, ("dim",), 0), this.ndim):
        return refuse
    index = arg(args, kwargs, 2, ("index",))
    if rows(index) and not touches_rows(arg(args, kwargs, 1, ("dim",), 0), index.ndim):
        return refused("gathers with an atom block as the index along a feature dim, so its atom dimension "
                       "does not lead the result", HINT_VIEW)
    return Verdict("run", WHY_GATHER)


def moves_rows(name: str, args: tuple, kwargs: dict, ndim: int) -> bool:
    """Whether a transpose-like op moves dim 0."""
    if name in ("T", "H", "t", "t_"):
        return ndim >= 2
    if name in ("mT", "mH", "adjoint"):
        return ndim == 2
    if name in ("transpose", "transpose_", "swapaxes", "swapaxes_", "swapdims", "swapdims_"):
        a, b = (arg(args, kwargs, 1, ("dim0", "axis0")), arg(args, kwargs, 2, ("dim1", "axis1")))
        a, b = a % max(ndim, 1), b % max(ndim, 1)
        return a != b and 0 in (a, b)
    if name == "permute":
        ds = args[1:] if len(args) > 2 or not isinstance(args[1] if len(args) > 1 else None, (list, tuple)) \
            else args[1]
        ds = kwargs.get("dims", ds)
        return bool(ds) and ds[0] % max(ndim, 1) != 0
    if name in ("movedim", "moveaxis"):
        src = dims(arg(args, kwargs, 1, ("source",)), ndim) or set()
        dst = dims(arg(args, kwargs, 2, ("destination",)), ndim) or set()
        return (0 in src or 0 in dst) and not (src == {0} and dst == {0})
    if name == "rot90":
        k, ds = arg(args, kwargs, 1, ("k",), 1), arg(args, kwargs, 2, ("dims",), (0, 1))
        return k % 4 != 0 and 0 in (dims(ds, ndim) or set())
    return False
