"""A plain torch function (a model stage, an `nn.Module` call) as a JAX callable.

`torch_function(fn, n_inputs, n_outputs)` defines a torch op whose only kernel is
`CompositeImplicitAutograd`: its body is `fn` itself. `TorchOpKernel` then runs it
like any custom op (DLPack views of XLA's buffers, the FFI handler or
`buffer_callback`; output shapes from one run of `fn` on zero-filled tensors at trace
time, since model code such as TorchScript fusion groups cannot run on fake tensors
on a GPU); under `jax.grad` it runs `fn` once under torch autograd and the backward
differentiates that graph, so `jax.grad` through a stage differentiates the torch
code itself at the cost of one forward, as in torch. Weights `fn` closes over stay torch tensors (no gradient
flows to them from JAX).

`fn` takes `n_inputs` tensors and returns `n_outputs` tensors (a tuple when
`n_outputs > 1`); it must not keep state between calls, since JAX may run it
more than once (shape probing; the backward re-runs it where the forward's graph is gone).
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable
from typing import Any

import torch

from .torch_op import KernelError, TorchOpKernel

_NAMESPACE = "jaxbridge_fn"
_COUNTER = itertools.count()


def _op_name(label: str) -> str:
    """A fresh op name from `label` (letters, digits and '_' only, unique in this process)."""
    base = re.sub(r"\W", "_", label).strip("_") or "fn"
    return f"{base[:40]}_{next(_COUNTER)}"


def torch_function(
    fn: Callable[..., Any], n_inputs: int, n_outputs: int, *, label: str = "fn", call_path: str = "auto"
) -> TorchOpKernel:
    """`fn` (tensors -> tensors) as a `TorchOpKernel`, differentiable through torch autograd.

    Args:
        fn: a torch function of `n_inputs` tensors returning `n_outputs` tensors.
        n_inputs, n_outputs: its arity (>= 1).
        label: a readable part of the op's name (errors and reports name the op).
        call_path: as for `TorchOpKernel` ("auto", "ffi" or "callback").

    Returns:
        A `TorchOpKernel`: call it on JAX arrays (inside jit, grad, shard_map); one
        output comes back bare, several as a tuple.

    Raises:
        KernelError: an arity below 1.
    """
    if n_inputs < 1 or n_outputs < 1:
        raise KernelError(
            f"torch_function({label!r}): n_inputs={n_inputs} and n_outputs={n_outputs} must both be >= 1; "
            "a stage takes and returns at least one tensor."
        )
    name = _op_name(label)
    args = ", ".join(f"Tensor a{i}" for i in range(n_inputs))
    rets = "Tensor" if n_outputs == 1 else "(" + ", ".join(["Tensor"] * n_outputs) + ")"
    lib = torch.library.Library(_NAMESPACE, "FRAGMENT")
    lib.define(f"{name}({args}) -> {rets}")

    def body(*tensors: torch.Tensor) -> Any:
        out = fn(*tensors)
        got = len(out) if isinstance(out, (tuple, list)) else 1
        if got != n_outputs:
            raise KernelError(
                f"torch function {label!r} returned {got} tensor(s) but was declared with n_outputs={n_outputs}."
            )
        return tuple(out) if n_outputs > 1 else (out[0] if isinstance(out, (tuple, list)) else out)

    lib.impl(name, body, "CompositeImplicitAutograd")
    kernel = TorchOpKernel(getattr(getattr(torch.ops, _NAMESPACE), name).default, call_path=call_path,
                           check_grad=False, shape_probe="real")
    kernel._library = lib  # the op lives as long as its kernel
    return kernel
