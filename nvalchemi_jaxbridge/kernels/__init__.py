"""Calling kernels inside compiled JAX programs: torch custom ops and Triton `triton_op`s
through `buffer_callback` + DLPack (no copy), differentiable through `jax.custom_vjp`.

Importing this package imports torch; the package root never imports it eagerly.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
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


def compile(  # noqa: A001 (mirrors lower.compile)
    spec: Any,
    mesh: Any,
    plan: Any,
    *,
    kernel_for: Callable[[Any], Callable[..., Any]] | None = None,
    positions: Mapping[Any, Iterable[int | str]] | None = None,
    per_device_reductions: bool = False,
) -> Any:
    """`nvalchemi_jaxbridge.lower.compile` with torch ops and lazy "ns::name" ops runnable.

    Same arguments and result as `lower.compile`; only the kernel slot's default
    differs: `resolve_kernel`, so an `OpAdapter` whose op is a torch op (or a lazy
    name, resolved now) runs through `TorchOpKernel` and a Python callable as is.

    Args:
        spec: the `DistributionSpec`.
        mesh: a 1-D mesh (`make_mesh`, or `jax.make_mesh` with one axis).
        plan: a `HaloPlan` or `ShardPlan`.
        kernel_for: the kernel slot (optional, default `resolve_kernel`).
        positions: which gathered arguments are positions (see `lower.compile`).
        per_device_reductions: one `AllReduceSum` copy per device (see `lower.compile`).

    Returns:
        A `CompiledSpec`.
    """
    from ..lower import compile as lower_compile

    return lower_compile(spec, mesh, plan, kernel_for=kernel_for or resolve_kernel, positions=positions,
                         per_device_reductions=per_device_reductions)
