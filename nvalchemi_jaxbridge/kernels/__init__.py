"""Calling kernels inside compiled JAX programs: torch custom ops and Triton `triton_op`s
through `buffer_callback` + DLPack (no copy), differentiable through `jax.custom_vjp`.

Importing this package imports torch; the package root never imports it eagerly.
"""

from __future__ import annotations

from typing import Any

from .dlpack import DLPackError as DLPackError
from .dlpack import jax_to_torch as jax_to_torch
from .dlpack import jax_to_torch_shards as jax_to_torch_shards
from .dlpack import torch_shards_to_jax as torch_shards_to_jax
from .dlpack import torch_to_jax as torch_to_jax
from .resolve import resolve_kernel as resolve_kernel
from .torch_op import KernelError as KernelError
from .torch_op import NotDifferentiableError as NotDifferentiableError
from .torch_op import TorchOpKernel as TorchOpKernel


def compile(spec: Any, mesh: Any, plan: Any, **kwargs: Any) -> Any:  # noqa: A001 (mirrors lower.compile)
    """`nvalchemi_jaxbridge.lower.compile` with torch ops and lazy "ns::name" ops runnable.

    Same arguments and result as `lower.compile(spec, mesh, plan, ...)`; the kernel
    slot defaults to `resolve_kernel`, so an `OpAdapter` whose op is a torch op (or
    a lazy name, resolved now) runs through `TorchOpKernel`.
    """
    from ..lower import compile as lower_compile

    kwargs.setdefault("kernel_for", resolve_kernel)
    return lower_compile(spec, mesh, plan, **kwargs)
