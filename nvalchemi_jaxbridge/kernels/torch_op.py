"""A torch custom op (plain torch, Triton `triton_op`, Warp, ...) as a JAX callable.

Each call hands the device's buffers to the op through
`jax.experimental.buffer_callback` and DLPack, so the op reads XLA's memory and
writes its results straight into XLA's output buffers (no host copy). On a GPU
the op's work is queued on XLA's stream (`torch.cuda.ExternalStream(ctx.stream)`),
so it sees the finished results of the XLA kernels before it. Output shapes
come from the op's fake (meta) registration, evaluated under FakeTensorMode.

Results. The op's results as JAX sees them are, in order, the op's returned
tensors, then the arguments it mutates (`Tensor(a!)` in its schema) in schema
order. `outputs=` picks among them by index, or by the mutated argument's name.
A mutated argument is passed in as an array holding its initial value and comes
back as a new array (JAX arrays are immutable); XLA aliases the two buffers.

Gradients. The call is a `jax.custom_vjp`. Differentiated, the forward runs the
op once under torch autograd and keeps its graph for the backward, which calls
`torch.autograd.grad` with the cotangents on it (one forward, one backward, as
in torch; the backward re-runs the op on the saved inputs where the graph is
gone), on the same path as the forward (callback or FFI). Only ops torch can
differentiate (a `register_autograd` formula, or an autograd-capable composite)
qualify.

Inside `shard_map(check_vma=True)` the callback's varying-axes typing, which
`buffer_callback` drops, is restored with `jax.lax.pcast`.

Call paths. The forward has a second, compiled path (`call_path="ffi"`, see
`kernels/ffi/`): an XLA FFI custom call whose C++ handler wraps XLA's buffers as
tensors and calls the op through torch's dispatcher, with no Python on the
bridge's side. `call_path="auto"` (the default) takes it when the extension
builds and the call's static arguments can be encoded, else the callback path;
`call_path_of(...)` says which one a call takes and why, `backward_path_of(...)`
the same for its backward (which follows the forward's path).

Modules. `TorchOpKernel` composes the parts, each in its own module, and keeps
one compiled call per combination of argument shapes, dtypes and static values:
`op_binding` (the op's schema, a call's arguments bound to it), `shape_probe`
(output shapes and dtypes from the op's fake registration), `callback_path` and
`ffi_path` (the two call paths) and `vjp` (the custom_vjp and its backward).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from . import callback_path, ffi_path, vjp
from .callback_path import _KDL_CUDA as _KDL_CUDA  # tests fake a CUDA buffer with it
from .callback_path import _enter_xla_stream as _enter_xla_stream
from .callback_path import _leave_xla_stream as _leave_xla_stream
from .dlpack import check_x64_numpy
from .ffi_path import _CALL_PATHS
from .ffi_path import ENV_CALL_PATH as ENV_CALL_PATH
from .op_binding import KernelError as KernelError
from .op_binding import OpBinding, _Call
from .op_binding import _as_overload as _as_overload  # kernels/resolve.py
from .shape_probe import _is_inexact, result_specs
from .shape_probe import jax_dtype as jax_dtype
from .shape_probe import torch_dtype as torch_dtype
from .vjp import NotDifferentiableError as NotDifferentiableError
from .vjp import _vary, _vma


class TorchOpKernel:
    """A torch op, callable on JAX arrays inside jit, grad and shard_map.

    Args:
        op: a torch `OpOverload` (`torch.ops.ns.name.default`), its packet, or a
            `CustomOpDef` (what `@torch.library.custom_op` / `triton_op` return).
        outputs: which results to return: indices into (the op's returned tensors,
            then its mutated arguments in schema order), or names of mutated
            arguments. Default: all of them. One selected result is returned bare,
            several as a tuple.
        call_path: how a call reaches the op, forward and backward. "auto" (default):
            the compiled XLA FFI handler when it is available and the call's static
            arguments can be encoded, else `buffer_callback` (the environment variable
            `JAXBRIDGE_KERNEL_PATH` = auto / ffi / callback replaces "auto");
            "ffi": only the FFI handler (a `KernelError` says why a call cannot);
            "callback": only `buffer_callback`. `call_path_of(...)` and
            `backward_path_of(...)` tell which path a call takes.
        check_grad: check at trace time, on fake tensors, that torch can differentiate the
            op (default True; the check names the op and the fix). `torch_function` turns it
            off: a stage's body is differentiable where its torch code is, and a fake-tensor
            backward through TorchScript that has run for real (e3nn's tensor products) can
            launch real kernels on fake storage on a GPU.
        shape_probe: how output shapes are found at trace time: "fake" (default: the op on
            fake tensors, no computation) or "real" (the op once on zero-filled tensors on
            the device; for code that fake tensors cannot run, such as TorchScript fusion
            groups on a GPU). `torch_function` uses "real".

    Call it like the op: tensors as JAX arrays (shape and dtype as torch expects),
    everything else (numbers, bools, strings, None) as Python values, positional
    or by keyword. Mutated arguments take their initial values as arrays.

    Example:
        >>> k = TorchOpKernel(torch.ops.demo.pair_energy.default)
        >>> e = jax.jit(k)(positions, cutoff=2.5)
    """

    def __init__(
        self, op: Any, *, outputs: Sequence[int | str] | None = None, call_path: str = "auto",
        check_grad: bool = True, shape_probe: str = "fake",
    ) -> None:
        binding = OpBinding(op, outputs)
        self._binding = binding
        self.op = binding.op
        self.name = binding.name
        self.outputs = binding.outputs
        if call_path not in _CALL_PATHS:
            raise KernelError(
                f"call_path={call_path!r} for op {self.name} is not a call path; use one of "
                f"{list(_CALL_PATHS)} (\"auto\" takes the compiled FFI handler where it can)."
            )
        self.call_path = call_path
        self.check_grad = bool(check_grad)
        if shape_probe not in ("fake", "real"):
            raise KernelError(f"shape_probe={shape_probe!r} for op {self.name}: use 'fake' or 'real'.")
        self.shape_probe = shape_probe
        self._cache: dict[Any, _Call] = {}
        self._lock = threading.Lock()

    # -- identity -------------------------------------------------------------------

    def __repr__(self) -> str:
        out = "" if self.outputs is None else f", outputs={self.outputs!r}"
        path = "" if self.call_path == "auto" else f", call_path={self.call_path!r}"
        return f"TorchOpKernel({self.name}{out}{path})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TorchOpKernel) and (self.op, self.outputs, self.call_path) == (
            other.op, other.outputs, other.call_path)

    def __hash__(self) -> int:
        return hash((TorchOpKernel, self.name, self.outputs, self.call_path))

    @property
    def param_names(self) -> tuple[str, ...]:
        """The op's argument names in schema order (for keyword matching)."""
        return tuple(p.name for p in self._binding.params)

    @property
    def result_names(self) -> tuple[str, ...]:
        """What each selectable result is: "return i" or "mutated argument 'name'"."""
        return self._binding.result_names

    # -- call -----------------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> jax.Array | tuple[jax.Array, ...]:
        call, arrays = self._prepare(args, kwargs)
        axes = frozenset().union(*(_vma(a) for a in arrays)) if arrays else frozenset()
        arrays = [_vary(a, axes) for a in arrays]
        out = call.fn(*arrays)
        return out[0] if len(out) == 1 else tuple(out)

    def call_path_of(self, *args: Any, **kwargs: Any) -> str:
        """The forward path a call with these arguments takes: "ffi", or "callback (<why>)".

        Takes the same arguments as a call and prepares the call as a call would
        (the FFI extension is built on first use), without running the op.
        """
        return self._prepare(args, kwargs)[0].path

    def backward_path_of(self, *args: Any, **kwargs: Any) -> str:
        """The path `jax.grad` of a call with these arguments takes: "ffi", or "callback (<why>)".

        The backward takes the forward's path: the FFI backward handler where the
        forward is on the FFI path, else the buffer_callback backward.
        """
        return self._prepare(args, kwargs)[0].bwd_path

    def kept_graphs(self) -> int:
        """How many torch autograd graphs this kernel holds for backwards still to run (at most
        `graph_table.GRAPH_CAP` per compiled call; see `vjp`)."""
        return self._total(lambda c: c.kept())

    def token_reads(self) -> int:
        """How many backwards so far read their torch graph's token back from the device (a stream
        synchronisation each on a GPU): every backward on the callback path; on the FFI path only
        those that did not find the graph by where its token was written (see `graph_table`), counted
        per plan, which every kernel of the same op and static arguments shares."""
        return self._total(lambda c: c.token_reads())

    def _total(self, count: Any) -> int:
        """`count(call)` summed over the calls prepared so far."""
        with self._lock:
            calls = list(self._cache.values())
        return sum(count(c) for c in calls)

    def paths_taken(self) -> tuple[str, ...]:
        """The distinct forward paths of the calls prepared so far, e.g. `("ffi",)` (for run reports)."""
        with self._lock:
            return tuple(dict.fromkeys(c.path for c in self._cache.values()))

    def _prepare(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> tuple[_Call, list[Any]]:
        """The (cached) compiled call for these arguments, and the arrays it takes."""
        binding = self._binding
        values = binding.bind(args, kwargs)
        binding.check_kinds(values)
        array_pos = binding.array_positions(values)
        arrays = [jnp.asarray(values[i]) for i in array_pos]
        for i, a in zip(array_pos, arrays):
            check_x64_numpy(a.dtype, f"argument {binding.params[i].name!r} of op {self.name}")
        key = binding.cache_key(values, array_pos, arrays)
        call = self._cache.get(key)
        if call is None:
            with self._lock:
                call = self._cache.get(key)
                if call is None:
                    call = self._build(values, array_pos, arrays)
                    self._cache[key] = call
        return call, arrays

    # -- compile --------------------------------------------------------------------

    def _build(self, values: list[Any], array_pos: tuple[int, ...], arrays: list[jax.Array]) -> _Call:
        """One compiled call: output specs, the forward on its path, the backward, the custom_vjp."""
        binding = self._binding
        statics = tuple(None if i in array_pos else v for i, v in enumerate(values))
        mutated_pos = tuple(i for i in array_pos if binding.params[i].mutable)
        specs = result_specs(binding, statics, array_pos, arrays, mutated_pos, shape_probe=self.shape_probe)
        # the stack depth from __call__ to ffi_path.forward is what its warning's stacklevel counts
        fwd, path = ffi_path.forward(binding, self.call_path, statics, array_pos, mutated_pos, specs)
        if fwd is None:
            fwd = callback_path.forward(binding, statics, array_pos, mutated_pos, specs)
        call = _Call(array_pos, mutated_pos, statics, binding.n_returns, specs, binding.selected, fn=None, path=path)  # type: ignore[arg-type]
        ffi_grads, bwd_path = None, path
        if path == "ffi":  # the plans of every inexact array now (they decide the path); other sets when traced
            every = tuple(k for k, a in enumerate(arrays) if _is_inexact(a.dtype))
            full, bwd_path = ffi_path.grad_calls(binding, self.call_path, call, arrays, every)
            if bwd_path == "ffi":
                ffi_grads = lambda diff: (  # noqa: E731
                    full if diff == every else ffi_path.grad_calls(binding, self.call_path, call, arrays, diff)[0])
        avals = [jax.ShapeDtypeStruct(tuple(a.shape), a.dtype) for a in arrays]
        fn, kept, token_reads = vjp.custom_vjp(binding, call, fwd, avals, ffi_grads, check_grad=self.check_grad)
        return dataclasses.replace(call, fn=fn, bwd_path=bwd_path, kept=kept, token_reads=token_reads)
