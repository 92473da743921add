"""Gradients of a torch op called from JAX: the `jax.custom_vjp` around a call.

One forward per differentiated call, as in torch: when JAX traces the forward
for a VJP, the op runs once under torch autograd and its graph stays in a table
of the call (`graph_table`), named by a token (an int32 pair) that joins the
saved input arrays among the residuals (on the FFI path the backward finds the
graph by where that token was written, without reading it back from the device;
see `graph_table`). The backward takes that graph and calls
`torch.autograd.grad` with the cotangents; where the graph is gone (a pullback
called twice, an entry evicted past the table's cap) it re-runs the op under
autograd on the saved inputs instead. Both run on the forward's path: the FFI
handlers (`ffi_path.grad_calls`, graphs kept in C++) where the forward took the
FFI path, else `buffer_callback`s (`callback_path.forward_keeping` and
`backward_body`). Only the inexact inputs are differentiated, against the
cotangents of the inexact selected results. Before the first backward, a
trace-time check on fake tensors says whether torch can differentiate the op
at all (`NotDifferentiableError`, naming the fix).

Inside `shard_map(check_vma=True)` the varying-axes typing that
`buffer_callback` drops is restored with `jax.lax.pcast` (`_vary`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import torch
from jax.experimental.buffer_callback import buffer_callback

from . import callback_path
from .graph_table import GraphTable
from .op_binding import KernelError, OpBinding, _Call
from .shape_probe import _is_inexact, fake_run


class NotDifferentiableError(KernelError):
    """`jax.grad` reached a torch op that torch cannot differentiate."""


# ----------------------------------------------------------------------------- VMA


def _vma(x: Any) -> frozenset[str]:
    """The mesh axes `x` varies over inside shard_map (empty outside)."""
    aval = jax.typeof(x)
    mat = getattr(aval, "mat", None)
    varying = getattr(mat, "varying", None)
    if varying is None:
        varying = getattr(aval, "vma", frozenset())  # older jax
    return frozenset(varying)


def _vary(x: jax.Array, axes: frozenset[str]) -> jax.Array:
    """Mark `x` as varying over `axes` (what buffer_callback's abstract eval forgets)."""
    missing = tuple(sorted(axes - _vma(x)))
    return jax.lax.pcast(x, missing, to="varying") if missing else x


# ----------------------------------------------------------------------------- the check


def _is_data_dependent(e: BaseException) -> bool:
    """Whether a fake-tensor run failed only because the code asked for tensor values."""
    from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException

    return isinstance(e, (DataDependentOutputException, DynamicOutputShapeException))


def check_differentiable(binding: OpBinding, call: _Call, arrays: Sequence[Any]) -> None:
    """Trace-time check, on fake tensors, that torch can differentiate the op."""
    fix = (
        f"Register a backward formula with torch.library.register_autograd({binding.name.split('.')[0]!r}, "
        f"backward, setup_context=...), or do not differentiate through this op "
        f"(jax.lax.stop_gradient on its inputs)."
    )
    outputs = [binding.result_names[j] for j in call.selected]

    def probe(results: tuple[Any, ...], leaves: list[Any]) -> str | None:
        live = [r for r in (results[j] for j in call.selected) if r.requires_grad]
        if not leaves:
            return None
        if not live:
            return f"torch autograd records no gradient for its results {outputs}."
        torch.autograd.grad(live, leaves, [torch.ones_like(r) for r in live], allow_unused=True)
        return None

    try:
        problem = fake_run(binding, call.statics, call.array_pos, arrays, grad=True, then=probe)
    except Exception as e:
        if _is_data_dependent(e):
            # A backward formula exists but reads values (e.g. `.item()`), which fake
            # tensors cannot answer: differentiable; the real backward runs on real data.
            return
        problem = f"torch cannot differentiate it: {type(e).__name__}: {str(e).splitlines()[0][:300]}"
    if problem is not None:
        raise NotDifferentiableError(f"jax.grad reached op {binding.name}, but {problem} {fix}")


# ----------------------------------------------------------------------------- the custom_vjp


def custom_vjp(
    binding: OpBinding,
    call: _Call,
    fwd_cb: Callable[..., Any],
    avals: Sequence[jax.ShapeDtypeStruct],
    grad_ffi: Any = None,
    *,
    check_grad: bool,
) -> tuple[Callable[..., Any], Callable[[], int], Callable[[], int]]:
    """The call's `jax.custom_vjp` function of its arrays (returning the selected results), and two counts.

    Args:
        binding: the op's binding.
        call: the call's plan (`fn` not set yet).
        fwd_cb: the forward on the call's path, returning every result.
        avals: the shapes and dtypes of the call's arrays.
        grad_ffi: the FFI path's differentiated forward and backward (`ffi_path.GradCalls`),
            where the forward takes the FFI path; else the callback path's are used.
        check_grad: run `check_differentiable` when the forward is traced for a VJP.

    Returns:
        `(fn, kept, token_reads)`: `kept()` is how many torch graphs the call holds for backwards
        to come, `token_reads()` how many backwards read their graph's token back from the device.
    """
    selected = call.selected
    sel_inexact = tuple(j for j, s in enumerate(selected) if _is_inexact(call.result_specs[s].dtype))
    dtypes = [a.dtype for a in avals]
    diff = tuple(k for k, d in enumerate(dtypes) if _is_inexact(d))
    graphs = bool(diff) and bool(sel_inexact)  # else no gradient flows: no graph, no backward call
    if not graphs:
        fwd_keep = bwd = None
        kept: Callable[[], int] = lambda: 0
        token_reads: Callable[[], int] = lambda: 0
    elif grad_ffi is not None:
        fwd_keep, bwd, kept, token_reads = grad_ffi.forward, grad_ffi.backward, grad_ffi.kept, grad_ffi.token_reads
    else:
        table = GraphTable()
        fwd_keep = callback_path.forward_keeping(binding, call, dtypes, sel_inexact, table)
        shapes = tuple(jax.ShapeDtypeStruct(tuple(avals[k].shape), avals[k].dtype) for k in diff)
        bwd = buffer_callback(callback_path.backward_body(binding, call, dtypes, sel_inexact, table), shapes)
        kept = table.__len__
        token_reads = lambda: table.token_reads  # noqa: E731

    def run_forward(*arrays: jax.Array) -> tuple[jax.Array, ...]:
        axes = frozenset().union(*(_vma(a) for a in arrays)) if arrays else frozenset()
        outs = fwd_cb(*arrays)
        return tuple(_vary(outs[s], axes) for s in selected)

    @jax.custom_vjp
    def fn(*arrays: jax.Array) -> tuple[jax.Array, ...]:
        return run_forward(*arrays)

    def fn_fwd(*arrays: jax.Array):
        if check_grad:
            check_differentiable(binding, call, arrays)
        if fwd_keep is None:
            return run_forward(*arrays), (arrays, None)
        axes = frozenset().union(*(_vma(a) for a in arrays)) if arrays else frozenset()
        *outs, token = fwd_keep(*arrays)
        return tuple(_vary(outs[s], axes) for s in selected), (arrays, _vary(token, axes))

    def fn_bwd(res: tuple[tuple[jax.Array, ...], jax.Array | None], cts: tuple[jax.Array, ...]):
        saved, token = res
        out: list[Any] = [None] * len(saved)
        if bwd is None:
            return tuple(out)  # no inexact input reaches an inexact result: zero cotangents
        axes = frozenset().union(*(_vma(a) for a in saved)) if saved else frozenset()
        grads = bwd(*saved, token, *(cts[j] for j in sel_inexact))
        for k, g in zip(diff, grads):
            out[k] = _vary(g, axes)
        return tuple(out)

    fn.defvjp(fn_fwd, fn_bwd)
    return fn, kept, token_reads
