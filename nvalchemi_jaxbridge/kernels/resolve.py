"""Which callable runs an adapter's op inside a compiled program."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from .torch_op import KernelError, TorchOpKernel

_cache: dict[Any, TorchOpKernel] = {}
_lock = threading.Lock()


def _is_torch_op(op: Any) -> bool:
    """True for an OpOverload, an OpOverloadPacket or a CustomOpDef."""
    return type(op).__name__ in ("OpOverload", "OpOverloadPacket", "CustomOpDef") or (
        hasattr(op, "_schema") and hasattr(op, "_overloadname")
    )


def resolve_kernel(op: Any) -> Callable[..., Any]:
    """The callable on local JAX arrays that runs `op` (the lower layer's `kernel_for`).

    Args:
        op: a lazy name "ns::name[.overload]" (resolved now, at compile time), a torch
            op (OpOverload, packet or CustomOpDef), a `TorchOpKernel`, or a JAX callable.

    Returns:
        JAX callables and `TorchOpKernel`s unchanged; for torch ops a `TorchOpKernel`,
        the same object for the same op so its compiled state is shared.

    Raises:
        OpResolutionError: a lazy name does not name a registered torch op.
        KernelError: `op` is neither a torch op nor callable.
    """
    if isinstance(op, TorchOpKernel):
        return op
    if isinstance(op, str):
        from ..spec.op_ref import resolve_op

        op = resolve_op(op)
    if _is_torch_op(op):
        from .torch_op import _as_overload

        overload = _as_overload(op)
        with _lock:
            kernel = _cache.get(overload)
            if kernel is None:
                kernel = _cache[overload] = TorchOpKernel(overload)
        return kernel
    if callable(op):
        return op
    raise KernelError(
        f"cannot run op {op!r:.80} ({type(op).__name__}): give a torch op, a lazy name "
        f"'ns::name', or a callable on JAX arrays."
    )
