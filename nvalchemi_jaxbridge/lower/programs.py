"""One adapter's program for one argument layout: `jit(shard_map(body))`, built by `CompiledSpec.call`.

The body runs on every device's block: the argument transforms, the kernel,
and the output transforms (docs/design.md, "Transform semantics inside
shard_map"). The argument roles come from `arguments.classify`; how outputs
are placed (`out_specs`) is the "Outputs" paragraph of `compile.py`'s module
docstring.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
from jax.sharding import PartitionSpec as P

from ..spec.transforms import AllReduceSum, GatherInputs, ScatterOutputs, SliceOwned
from . import collectives as C
from .entries import _Entry
from .tables import Tables

if TYPE_CHECKING:
    from .compile import CompiledSpec


def build(cs: CompiledSpec, e: _Entry, treedef: Any, roles: list) -> Callable[..., Any]:
    """jit(shard_map(body)) for one adapter and argument layout."""
    axis, mesh = cs.axis, cs.mesh
    per_device = cs.per_device_reductions
    (keys, parts) = treedef
    shape_info: dict[str, Any] = {}

    def body(t: Tables, *dyn: Any) -> Any:
        it = iter(dyn)
        flat = [next(it) if r[0] != "static" else r[2] for r in roles]
        pos_iter = iter(flat)
        values = [jax.tree_util.tree_unflatten(p, [next(pos_iter) for _ in range(p.num_leaves)]) for p in parts]
        args = [v for k, v in zip(keys, values) if k[0] == "a"]
        kwargs = {k[1]: v for k, v in zip(keys, values) if k[0] == "k"}
        for k, v in zip(keys, values):
            pos = k[1] if k[0] == "a" else (e.params.index(k[1]) if e.params and k[1] in e.params else None)
            tr = e.args.get(pos) if pos is not None else None
            if tr is None:
                continue
            v = _arg_transform(tr, v, t, axis, pos in e.positions)
            if k[0] == "a":
                args[k[1]] = v
            else:
                kwargs[k[1]] = v
        result = e.kernel(*args, **kwargs)
        single = not isinstance(result, (tuple, list))
        outs = [result] if single else list(result)
        if beyond := sorted(p for p in e.outs if p >= len(outs)):
            raise ValueError(
                f"CompiledSpec.call: adapter {e.name!r} declares {type(e.outs[beyond[0]]).__name__}() on "
                f"output {beyond[0]}, but its kernel returned {len(outs)} output(s)."
            )
        shape_info["single"] = single
        res = []
        for i, o in enumerate(outs):
            if not hasattr(o, "shape"):
                raise TypeError(
                    f"CompiledSpec.call: adapter {e.name!r} output {i} is {type(o).__name__}, expected an array."
                )
            res.append(_out_transform(e, i, e.outs.get(i), o, t, axis, per_device))
        return tuple(res)

    in_specs = (cs.tables.specs(axis),) + tuple(
        P() if r[0] == "replicated" else P(axis) for r in roles if r[0] != "static")

    def probe(t: Tables, *dyn: Any) -> Any:
        return tuple(o[None] for o in body(t, *dyn))

    probe_fn = jax.shard_map(probe, mesh=mesh, in_specs=in_specs, out_specs=P(axis), check_vma=True)
    ghost_args = [jax.ShapeDtypeStruct(r[1][0], r[1][1]) for r in roles if r[0] != "static"]
    avals = jax.eval_shape(probe_fn, cs.tables, *ghost_args)
    out_specs = []
    for i, a in enumerate(avals):
        tr = e.outs.get(i)
        if isinstance(tr, AllReduceSum) and not per_device:
            out_specs.append(P())
        elif len(a.shape) < 2 and not isinstance(tr, AllReduceSum):
            raise ValueError(
                f"CompiledSpec.call: adapter {e.name!r} output {i} is a scalar on each device; declare "
                f"AllReduceSum() on output {i} to sum it over devices, or return per-row values."
            )
        else:
            out_specs.append(P(axis))
    single = shape_info["single"]
    prog = jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=tuple(out_specs), check_vma=True)
    jitted = jax.jit(prog)
    return lambda t, *dyn: (jitted(t, *dyn), single)


def _arg_transform(tr: Any, v: jax.Array, t: Tables, axis: str, positions: bool) -> jax.Array:
    """A `GatherInputs`, `SliceOwned` or `GatherInputsFull` argument on one device's block."""
    if isinstance(tr, GatherInputs):
        return C.halo_forward(v, t, axis, positions=positions)
    if isinstance(tr, SliceOwned):
        return C.slice_owned(v, t)
    return C.gather_full(v, t, axis)


def _out_transform(e: _Entry, i: int, tr: Any, o: jax.Array, t: Tables, axis: str,
                   per_device_reductions: bool) -> jax.Array:
    """Output `i` after its transform (`tr`, or None), on one device's block."""
    if tr is None:
        return o
    if isinstance(tr, ScatterOutputs):
        if o.ndim == 0 or o.shape[0] != t.halo_rows:
            raise ValueError(
                f"CompiledSpec.call: adapter {e.name!r} output {i} (ScatterOutputs) must have halo_rows="
                f"{t.halo_rows} rows per device (the kernel's halo block), got shape {tuple(o.shape)}."
            )
        return C.halo_scatter(o, t, axis)
    if isinstance(tr, AllReduceSum):
        if not per_device_reductions:
            return C.all_reduce_sum(o, axis)
        y = C.all_reduce_sum(o, axis, replicated_consumer=tr.replicated_consumer)
        if not tr.replicated_consumer:
            y = jax.lax.pcast(y, axis, to="varying")
        return y[None]
    return C.slice_outputs_owned(o, t, axis)
