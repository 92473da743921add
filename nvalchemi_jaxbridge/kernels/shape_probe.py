"""The op's output shapes and dtypes at trace time, from its fake (meta) registration.

JAX needs every result's shape and dtype before the op runs. `result_specs`
runs the op once on fake tensors under FakeTensorMode (no computation), or with
`shape_probe="real"` once on zero-filled tensors on the device (for code that
fake tensors cannot run, such as TorchScript fusion groups on a GPU). The same
fake run, with autograd on, is what the trace-time differentiability check of
`vjp` uses. Also here: the dtype maps between torch and JAX.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch

from . import _triton_interp, cuda_graphs
from .dlpack import DLPackError, check_x64_torch
from .op_binding import KernelError, OpBinding

# ----------------------------------------------------------------------------- dtypes

_TORCH_TO_JAX: dict[torch.dtype, Any] = {
    torch.bool: jnp.bool_,
    torch.uint8: jnp.uint8,
    torch.int8: jnp.int8,
    torch.int16: jnp.int16,
    torch.int32: jnp.int32,
    torch.int64: jnp.int64,
    torch.float16: jnp.float16,
    torch.bfloat16: jnp.bfloat16,
    torch.float32: jnp.float32,
    torch.float64: jnp.float64,
    torch.complex64: jnp.complex64,
    torch.complex128: jnp.complex128,
}
for _name in ("uint16", "uint32", "uint64"):
    if hasattr(torch, _name):
        _TORCH_TO_JAX[getattr(torch, _name)] = getattr(jnp, _name)
_JAX_TO_TORCH = {np.dtype(v): k for k, v in _TORCH_TO_JAX.items()}


def torch_dtype(dtype: Any, where: str) -> torch.dtype:
    """The torch dtype of a JAX/numpy dtype."""
    try:
        return _JAX_TO_TORCH[np.dtype(dtype)]
    except (KeyError, TypeError):
        raise KernelError(
            f"{where} has dtype {dtype}, which torch has no equivalent for; supported: "
            f"{sorted(str(d) for d in _JAX_TO_TORCH)}. Convert it with .astype(...) first."
        ) from None


def jax_dtype(dtype: torch.dtype, where: str) -> Any:
    """The JAX dtype of a torch dtype, refusing 64-bit types while x64 is off."""
    if dtype not in _TORCH_TO_JAX:
        raise KernelError(
            f"{where} has torch dtype {dtype}, which JAX has no equivalent for; make the op "
            f"produce one of {sorted(str(d) for d in _TORCH_TO_JAX)}."
        )
    check_x64_torch(dtype, where)
    return _TORCH_TO_JAX[dtype]


def _is_inexact(dtype: Any) -> bool:
    return jnp.issubdtype(dtype, jnp.inexact)


# ----------------------------------------------------------------------------- the probe


def _fake_device() -> str:
    return "cuda" if jax.default_backend() == "gpu" and torch.cuda.is_available() else "cpu"


def _call_op(binding: OpBinding, values: Sequence[Any]) -> Any:
    """Run the op on per-position values (positional, then keyword-only by name)."""
    pos = [v for p, v in zip(binding.params, values) if not p.kwarg_only]
    kw = {p.name: v for p, v in zip(binding.params, values) if p.kwarg_only}
    return binding.op(*pos, **kw)


def _returns(res: Any) -> tuple[Any, ...]:
    if res is None:
        return ()
    return tuple(res) if isinstance(res, (tuple, list)) else (res,)


def fake_run(
    binding: OpBinding,
    statics: tuple[Any, ...],
    array_pos: tuple[int, ...],
    arrays: Sequence[Any],
    *,
    grad: bool,
    shape_probe: str = "fake",
    then: Callable[[tuple[Any, ...], list[Any]], Any] | None = None,
) -> Any:
    """Run the op on fake tensors; `then(results, leaves)` runs inside the fake mode.

    Results are the returns, plus the mutated arguments when `grad` is set.
    `shape_probe="real"` runs it on zero-filled real tensors instead (not with `grad`).
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    _triton_interp.patch_interpreter()
    device = _fake_device()
    real = shape_probe == "real" and not grad
    # Real tensors an op closes over (a model stage's weights) are allowed: fake mode reads
    # only their metadata. TorchScript's profiling executor guards its specialised graphs
    # with value checks (aten::equal) that fake tensors cannot answer (e3nn's compiled
    # tensor products, once they have run for real); the unoptimised interpreter computes
    # the same shapes.
    fake = contextlib.nullcontext() if real else FakeTensorMode(allow_non_fake_inputs=True)
    with fake, torch.jit.optimized_execution(False), cuda_graphs.eager():  # a probe is never recorded
        leaves, vals = [], list(statics)
        for i, a in zip(array_pos, arrays):
            where = f"argument {binding.params[i].name!r} of op {binding.name}"
            t = torch.zeros(tuple(a.shape), dtype=torch_dtype(a.dtype, where), device=device)
            if grad and _is_inexact(a.dtype):
                leaves.append(t.requires_grad_(True))
                t = t.clone() if binding.params[i].mutable else t
            vals[i] = t
        with torch.enable_grad() if grad else torch.no_grad():
            res = _returns(_call_op(binding, vals))
            if grad:
                res = res + tuple(vals[i] for i in array_pos if binding.params[i].mutable)
            return then(res, leaves) if then is not None else res


def result_specs(
    binding: OpBinding, statics, array_pos, arrays, mutated_pos, *, shape_probe: str
) -> tuple[jax.ShapeDtypeStruct, ...]:
    """The shape and dtype of each result JAX sees: the op's returns, then the mutated arguments."""
    missing_mut = [binding.params[i].name for i in binding.mutable if i not in array_pos]
    if missing_mut:
        raise KernelError(
            f"op {binding.name} mutates {missing_mut} but got None for them; pass arrays holding "
            f"their initial values (e.g. jnp.zeros of the right shape)."
        )
    try:
        res = fake_run(binding, statics, array_pos, arrays, grad=False, shape_probe=shape_probe)
    except DLPackError:
        raise
    except KernelError:
        raise
    except Exception as e:
        raise _fake_error(binding.name, e) from e
    if len(res) != binding.n_returns or not all(isinstance(r, torch.Tensor) for r in res):
        raise KernelError(
            f"the fake implementation of op {binding.name} returned {len(res)} value(s) of types "
            f"{[type(r).__name__ for r in res]}, but the schema declares {binding.n_returns} "
            f"Tensor(s); fix the function registered with register_fake."
        )
    specs = [
        jax.ShapeDtypeStruct(tuple(r.shape), jax_dtype(r.dtype, f"return {k} of op {binding.name}"))
        for k, r in enumerate(res)
    ]
    by_pos = dict(zip(array_pos, arrays))
    specs += [jax.ShapeDtypeStruct(tuple(by_pos[i].shape), by_pos[i].dtype) for i in mutated_pos]
    return tuple(specs)


def _fake_error(name: str, e: Exception) -> KernelError:
    """Explain why the op's output specs could not be derived."""
    from torch._subclasses.fake_tensor import UnsupportedOperatorException

    text = f"{type(e).__name__}: {e}"
    base = name.split(".")[0]
    no_fake = isinstance(e, UnsupportedOperatorException) or "no fake impl" in text
    if no_fake:
        return KernelError(
            f"cannot derive the output shapes of op {name}: it has no fake (meta) implementation "
            f"that runs on FakeTensors ({text.splitlines()[0][:300]}). JAX needs the shapes before "
            f"running it; register one with @torch.library.register_fake({base!r}) (a function "
            f"returning torch.empty(...) of the right shapes, or None for ops that only mutate)."
        )
    if "data-dependent" in text or "DynamicOutputShape" in text:
        return KernelError(
            f"op {name} has data-dependent output shapes ({text.splitlines()[0][:300]}); JAX needs "
            f"static shapes. Make the op take its output sizes as arguments (or pad to a capacity)."
        )
    return KernelError(
        f"cannot derive the output shapes of op {name}: its fake implementation failed on "
        f"FakeTensors with {text.splitlines()[0][:300]}. Check the function registered with "
        f"torch.library.register_fake({base!r}) against the arguments passed."
    )
