"""Gradients of a torch op called from JAX: the `jax.custom_vjp` around a call.

The backward runs the op again under torch autograd on the saved inputs and
calls `torch.autograd.grad` with the cotangents, on the forward's path: the FFI
backward handler (`ffi_path.backward`) where the forward took the FFI path, else
a `buffer_callback` (`callback_path.backward_body`), one per shape of the saved
arrays. Only the inexact inputs are differentiated, against the cotangents of
the inexact selected results. Before the first backward, a trace-time check on
fake tensors says whether torch can differentiate the op at all
(`NotDifferentiableError`, naming the fix).

Inside `shard_map(check_vma=True)` the varying-axes typing that
`buffer_callback` drops is restored with `jax.lax.pcast` (`_vary`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
import torch
from jax.experimental.buffer_callback import buffer_callback

from . import callback_path
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
    dtypes: list[Any],
    bwd_ffi: Callable[..., Any] | None = None,
    *,
    check_grad: bool,
) -> Callable[..., Any]:
    """The call's `jax.custom_vjp` function of its arrays, returning the selected results.

    Args:
        binding: the op's binding.
        call: the call's plan (`fn` not set yet).
        fwd_cb: the forward on the call's path, returning every result.
        dtypes: the dtypes of the call's arrays.
        bwd_ffi: the FFI backward, where the forward takes the FFI path (else the
            callback backward is used).
        check_grad: run `check_differentiable` when the forward is traced for a VJP.
    """
    selected = call.selected
    sel_inexact = tuple(j for j, s in enumerate(selected) if _is_inexact(call.result_specs[s].dtype))
    diff = tuple(k for k, d in enumerate(dtypes) if _is_inexact(d))
    # the callback backward, one buffer_callback per shape of the saved arrays; the FFI
    # backward (when the forward took the FFI path) has its result shapes fixed with the call
    bwd_cb_body = None if bwd_ffi is not None else callback_path.backward_body(binding, call, dtypes, sel_inexact)
    bwd_cache: dict[Any, Any] = {}

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
        return run_forward(*arrays), arrays

    def fn_bwd(saved: tuple[jax.Array, ...], cts: tuple[jax.Array, ...]):
        axes = frozenset().union(*(_vma(a) for a in saved)) if saved else frozenset()
        shapes = tuple(jax.ShapeDtypeStruct(saved[k].shape, saved[k].dtype) for k in diff)
        backward = bwd_ffi
        if backward is None:
            key = tuple((s.shape, np.dtype(s.dtype).str) for s in shapes)
            backward = bwd_cache.get(key)
            if backward is None:
                backward = bwd_cache[key] = buffer_callback(bwd_cb_body, shapes)
        ct_in = [cts[j] for j in sel_inexact]
        grads = backward(*saved, *ct_in) if shapes else ()
        out: list[Any] = [None] * len(saved)
        for k, g in zip(diff, grads):
            out[k] = _vary(g, axes)
        return tuple(out)

    fn.defvjp(fn_fwd, fn_bwd)
    return fn
