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
`backward_body`). Only the inputs JAX differentiates (inexact and perturbed) are
torch leaves, against the cotangents of the inexact selected results. When JAX
first traces a differentiated call, before any call reaches the op, two trace-time
checks say whether torch can differentiate it (`NotDifferentiableError`, naming the
fix): the op must have a kernel at its device's autograd key
(`check_autograd_kernel`, always: without one torch's fallback records no backward,
so the gradient would be silently zero), and a fake-tensor forward and backward must
run (`check_differentiable`, unless `check_grad=False`).

Inside `shard_map(check_vma=True)` the varying-axes typing that
`buffer_callback` drops is restored with `jax.lax.pcast` (`_vary`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import torch
from jax.custom_derivatives import SymbolicZero
from jax.experimental.buffer_callback import buffer_callback

from . import callback_path
from .graph_table import GradCalls, GraphTable
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


def _fix(binding: OpBinding) -> str:
    """What to do about an op torch cannot differentiate."""
    return (
        f"Register a backward formula with torch.library.register_autograd({binding.name.split('.')[0]!r}, "
        f"backward, setup_context=...), or use the op's forces output instead of jax.grad of its energy "
        f"(ScatterOutputs on the forces), or do not differentiate through this op "
        f"(jax.lax.stop_gradient on its inputs)."
    )


_AUTOGRAD_KEYS = {"cpu": "AutogradCPU", "gpu": "AutogradCUDA", "cuda": "AutogradCUDA", "rocm": "AutogradCUDA"}


def autograd_kernel(binding: OpBinding, platform: str) -> str | None:
    """What torch's dispatcher runs for the op at `platform`'s autograd key, from its dispatch table
    (e.g. "registered at ... [autograd kernel]"); None where the table does not say (an unknown platform)."""
    key = _AUTOGRAD_KEYS.get(platform)
    if key is None:
        return None
    try:
        table = torch._C._dispatch_dump_table(binding.name)
    except Exception:  # noqa: BLE001 - a private torch API: no table, no check (the fake-tensor check remains)
        return None
    for line in table.splitlines():
        if line.startswith(key + ":"):
            return line[len(key) + 1 :].strip()
    return None


def check_autograd_kernel(binding: OpBinding, platform: str) -> None:
    """Trace-time check that the op has a kernel at `platform`'s autograd key (its own, a
    `register_autograd` formula's, or a `CompositeImplicitAutograd` body's).

    Without one, torch reaches its autograd fallback, which records no backward: the
    gradient would be silently zero (torch only warns), so a differentiated call is
    refused before anything runs.
    """
    kernel = autograd_kernel(binding, platform)
    if kernel is not None and kernel.endswith("[backend fallback]"):
        raise NotDifferentiableError(
            f"jax.grad reached op {binding.name}, but the op has no autograd kernel: torch's dispatcher has only "
            f"its fallback at {_AUTOGRAD_KEYS[platform]}, which records no backward, so its gradient would be "
            f"zero or wrong. {_fix(binding)}"
        )


def check_differentiable(binding: OpBinding, call: _Call, arrays: Sequence[Any]) -> None:
    """Trace-time check, on fake tensors, that torch can differentiate the op."""
    fix = _fix(binding)
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


@jax.tree_util.register_pytree_node_class
class _Residuals:
    """What a differentiated forward leaves its backward: the saved arrays, the graph token, and
    (static) which arrays were differentiated."""

    def __init__(self, arrays: tuple[jax.Array, ...], token: jax.Array | None, diff: tuple[int, ...]) -> None:
        self.arrays, self.token, self.diff = arrays, token, diff

    def tree_flatten(self):
        return (self.arrays, self.token), self.diff

    @classmethod
    def tree_unflatten(cls, diff, children):
        return cls(children[0], children[1], diff)


def _zeros_for(ct: Any, axes: frozenset[str]) -> jax.Array:
    """A cotangent as an array: a symbolic zero made a zero array, varying like the call."""
    if isinstance(ct, SymbolicZero):
        return _vary(jnp.zeros(ct.shape, ct.dtype), axes)
    return ct


def custom_vjp(
    binding: OpBinding,
    call: _Call,
    fwd_cb: Callable[..., Any],
    avals: Sequence[jax.ShapeDtypeStruct],
    ffi_grads: Callable[[tuple[int, ...]], Any] | None = None,
    *,
    check_grad: bool,
) -> tuple[Callable[..., Any], Callable[[], int], Callable[[], int]]:
    """The call's `jax.custom_vjp` function of its arrays (returning the selected results), and two counts.

    Only the arrays JAX differentiates (inexact and perturbed: a gradient is asked of
    them) are torch autograd leaves, so torch computes no gradient nobody reads (for a
    model stage: not the node attributes' or the edge shifts'). Each such set gets its
    own differentiated forward and backward, made when first traced.

    Args:
        binding: the op's binding.
        call: the call's plan (`fn` not set yet).
        fwd_cb: the forward on the call's path, returning every result.
        avals: the shapes and dtypes of the call's arrays.
        ffi_grads: where the forward takes the FFI path, the FFI path's differentiated forward and
            backward of a set of differentiated arrays (a `GradCalls`, or None to use the
            callback path's for that set); else the callback path's are used.
        check_grad: run `check_differentiable` when the forward is traced for a VJP
            (`check_autograd_kernel` runs always).

    Returns:
        `(fn, kept, token_reads)`: `kept()` is how many torch graphs the call holds for backwards
        to come, `token_reads()` how many backwards read their graph's token back from the device.
    """
    selected = call.selected
    sel_inexact = tuple(j for j, s in enumerate(selected) if _is_inexact(call.result_specs[s].dtype))
    dtypes = [a.dtype for a in avals]
    inexact = tuple(k for k, d in enumerate(dtypes) if _is_inexact(d))
    pairs: dict[tuple[int, ...], GradCalls] = {}
    lock = threading.Lock()

    def make_pair(diff: tuple[int, ...]) -> GradCalls:
        g = ffi_grads(diff) if ffi_grads is not None else None
        if g is not None:
            return g
        table = GraphTable()
        shapes = tuple(jax.ShapeDtypeStruct(tuple(avals[k].shape), avals[k].dtype) for k in diff)
        return GradCalls(
            callback_path.forward_keeping(binding, call, diff, sel_inexact, table),
            buffer_callback(callback_path.backward_body(binding, call, diff, sel_inexact, table), shapes),
            table.__len__, lambda: table.token_reads)

    def pair_for(diff: tuple[int, ...]) -> GradCalls:
        with lock:
            if diff not in pairs:
                pairs[diff] = make_pair(diff)
            return pairs[diff]

    def counts(name: str) -> Callable[[], int]:
        def total() -> int:
            with lock:
                live = list(pairs.values())
            return sum(getattr(p, name)() for p in live)
        return total

    def varying_axes(arrays: Sequence[jax.Array]) -> frozenset[str]:
        return frozenset().union(*(_vma(a) for a in arrays)) if arrays else frozenset()

    def run_forward(*arrays: jax.Array) -> tuple[jax.Array, ...]:
        axes = varying_axes(arrays)
        outs = fwd_cb(*arrays)
        return tuple(_vary(outs[s], axes) for s in selected)

    @jax.custom_vjp
    def fn(*arrays: jax.Array) -> tuple[jax.Array, ...]:
        return run_forward(*arrays)

    def fn_fwd(*primals: Any):
        arrays = tuple(p.value for p in primals)
        diff = tuple(k for k in inexact if primals[k].perturbed) if sel_inexact else ()
        if not diff:  # no gradient flows through the op: no graph, no backward call
            return run_forward(*arrays), _Residuals(arrays, None, ())
        check_autograd_kernel(binding, jax.default_backend())
        if check_grad:
            check_differentiable(binding, call, arrays)
        axes = varying_axes(arrays)
        *outs, token = pair_for(diff).forward(*arrays)
        return tuple(_vary(outs[s], axes) for s in selected), _Residuals(arrays, _vary(token, axes), diff)

    def fn_bwd(res: _Residuals, cts: tuple[Any, ...]):
        saved, diff = res.arrays, res.diff
        out: list[Any] = [None] * len(saved)
        if not diff:
            return tuple(out)  # nothing was differentiated: no backward call
        # every cotangent zero still calls the backward, which releases the kept graph
        axes = varying_axes(saved)
        grads = pair_for(diff).backward(*saved, res.token, *(_zeros_for(cts[j], axes) for j in sel_inexact))
        for k, g in zip(diff, grads):
            out[k] = _vary(g, axes)
        return tuple(out)

    fn.defvjp(fn_fwd, fn_bwd, symbolic_zeros=True)
    return fn, counts("kept"), counts("token_reads")
