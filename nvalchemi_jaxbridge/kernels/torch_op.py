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

Gradients. The call is a `jax.custom_vjp`; the backward runs the op again under
torch autograd on the saved inputs and calls `torch.autograd.grad` with the
cotangents, on the same path as the forward (callback or FFI). Only ops torch can differentiate
(a `register_autograd` formula, or an autograd-capable composite) qualify.

Inside `shard_map(check_vma=True)` the callback's varying-axes typing, which
`buffer_callback` drops, is restored with `jax.lax.pcast`.

Call paths. The forward has a second, compiled path (`call_path="ffi"`, see
`kernels/ffi/`): an XLA FFI custom call whose C++ handler wraps XLA's buffers as
tensors and calls the op through torch's dispatcher, with no Python on the
bridge's side. `call_path="auto"` (the default) takes it when the extension
builds and the call's static arguments can be encoded, else the callback path;
`call_path_of(...)` says which one a call takes and why, `backward_path_of(...)`
the same for its backward (which follows the forward's path).
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import logging
import os
import threading
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax.experimental.buffer_callback import buffer_callback

from . import _triton_interp
from .dlpack import DLPackError, buffer_to_torch, check_x64_numpy, check_x64_torch

_log = logging.getLogger(__name__)

_KDL_CUDA = 2
_KDL_ROCM = 10
_CALL_PATHS = ("auto", "ffi", "callback")
ENV_CALL_PATH = "JAXBRIDGE_KERNEL_PATH"  # the path "auto" means, when set
_TENSOR = "tensor"
_TENSOR_LIST = "tensor_list"
_STATIC = "static"


class KernelError(ValueError):
    """A torch op cannot be called from JAX as asked; the message says why and the fix."""


class NotDifferentiableError(KernelError):
    """`jax.grad` reached a torch op that torch cannot differentiate."""


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


# ----------------------------------------------------------------------------- schema


@dataclasses.dataclass(frozen=True)
class _Param:
    """One argument of the op's schema."""

    name: str
    kind: str  # _TENSOR, _TENSOR_LIST or _STATIC
    mutable: bool
    kwarg_only: bool
    has_default: bool
    default: Any
    type_str: str


def _params(op: Any) -> tuple[_Param, ...]:
    """The op's arguments, classified once."""
    opt_tensor = torch._C.OptionalType.ofTensor()
    out = []
    for a in op._schema.arguments:
        if a.type.isSubtypeOf(opt_tensor):
            kind = _TENSOR
        elif "Tensor" in str(a.type):
            kind = _TENSOR_LIST
        else:
            kind = _STATIC
        mutable = bool(a.alias_info is not None and a.alias_info.is_write)
        has_default = a.has_default_value()
        out.append(
            _Param(a.name, kind, mutable, a.kwarg_only, has_default, a.default_value if has_default else None, str(a.type))
        )
    return tuple(out)


def _hashable(v: Any, where: str) -> Any:
    """A hashable stand-in for a static argument (lists become tuples)."""
    if isinstance(v, (list, tuple)):
        return (type(v).__name__, tuple(_hashable(x, where) for x in v))
    if isinstance(v, dict):
        return ("dict", tuple(sorted((k, _hashable(x, where)) for k, x in v.items())))
    try:
        hash(v)
    except TypeError:
        raise KernelError(
            f"{where} is a {type(v).__name__}, which cannot key the kernel cache; pass a "
            f"number, bool, string, None, or a list/tuple of those."
        ) from None
    return (type(v).__name__, v)


def _is_array(v: Any) -> bool:
    return isinstance(v, (jax.Array, np.ndarray, np.generic)) or isinstance(v, jax.core.Tracer)


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


# ----------------------------------------------------------------------------- streams
#
# The callbacks run once per kernel call, so their host work is the bridge's per-call
# overhead (issue 7). On a GPU torch must queue the op on XLA's stream (`ctx.stream`)
# and on the buffers' device; the previous stream and device are restored after. The
# ExternalStream for each (stream pointer, device) is built once and its ids cached,
# and the stream is switched with torch's C setters instead of the nested
# `torch.cuda.device` / `torch.cuda.stream` context managers (which build Stream
# objects and query the current stream several times per call).

_XLA_STREAMS: dict[tuple[int, int], tuple[int, int, int]] = {}
_STREAM_OBJECTS: list[Any] = []  # keeps each cached ExternalStream alive with its ids


def _xla_stream_ids(ptr: int, index: int) -> tuple[int, int, int]:
    """torch's (stream_id, device_index, device_type) for XLA's stream `ptr` on GPU `index`."""
    ids = _XLA_STREAMS.get((ptr, index))
    if ids is None:
        torch.cuda.init()
        s = torch.cuda.ExternalStream(ptr, device=torch.device("cuda", index))
        _STREAM_OBJECTS.append(s)
        ids = _XLA_STREAMS[(ptr, index)] = (s.stream_id, s.device_index, s.device_type)
    return ids


def _enter_xla_stream(ctx: Any, buf: Any) -> tuple[int, tuple[int, int, int]] | None:
    """Make XLA's stream (and its device) torch's current one for a GPU buffer.

    Returns what `_leave_xla_stream` restores (previous device, previous stream of
    the buffer's device), or None for a CPU buffer (nothing to do).
    """
    kind, index = buf.__dlpack_device__()
    if kind != _KDL_CUDA and kind != _KDL_ROCM:
        return None
    sid, dev, dtype = _xla_stream_ids(ctx.stream, index)
    prev_device = torch._C._cuda_getDevice()
    prev_stream = torch._C._cuda_getCurrentStream(dev)
    torch._C._cuda_setStream(stream_id=sid, device_index=dev, device_type=dtype)  # also makes `dev` current
    return prev_device, prev_stream


def _leave_xla_stream(saved: tuple[int, tuple[int, int, int]]) -> None:
    """Restore the stream and device that `_enter_xla_stream` replaced."""
    prev_device, (sid, dev, dtype) = saved
    torch._C._cuda_setStream(stream_id=sid, device_index=dev, device_type=dtype)
    if prev_device != dev:
        torch._C._cuda_setDevice(prev_device)


# ----------------------------------------------------------------------------- per-call plan


@dataclasses.dataclass(frozen=True)
class _Call:
    """What one (op, argument shapes/dtypes, static values) combination compiles to."""

    array_pos: tuple[int, ...]  # schema positions fed by JAX arrays, in call order
    mutated_pos: tuple[int, ...]  # schema positions of mutated tensor args that are arrays
    statics: tuple[Any, ...]  # value per schema position (None where an array goes)
    n_returns: int
    result_specs: tuple[jax.ShapeDtypeStruct, ...]  # returns, then mutated args
    selected: tuple[int, ...]  # indices into result_specs that the caller gets
    fn: Callable[..., tuple[jax.Array, ...]]  # the custom_vjp function of the arrays
    path: str = "callback"  # the forward's path: "ffi" or "callback (<why>)"
    bwd_path: str = "callback"  # the backward's path, likewise


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
        op = _as_overload(op)
        self.op = op
        self.name = f"{op._schema.name}" + (
            f".{op._overloadname}" if op._overloadname not in ("default", "") else ""
        )
        self._params = _params(op)
        returns = op._schema.returns
        bad = [str(r.type) for r in returns if str(r.type) != "Tensor"]
        if bad:
            raise KernelError(
                f"op {self.name} returns {[str(r.type) for r in returns]}; only ops returning "
                f"Tensors (or nothing) can be called from JAX. Wrap it in a custom op that "
                f"returns plain Tensors."
            )
        self._n_returns = len(returns)
        self._mutable = tuple(i for i, p in enumerate(self._params) if p.mutable)
        names = [f"return {i}" for i in range(self._n_returns)] + [
            f"mutated argument {self._params[i].name!r}" for i in self._mutable
        ]
        self._result_names = tuple(names)
        self.outputs = None if outputs is None else tuple(outputs)
        self._selected = self._resolve_outputs(self.outputs)
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
        return tuple(p.name for p in self._params)

    @property
    def result_names(self) -> tuple[str, ...]:
        """What each selectable result is: "return i" or "mutated argument 'name'"."""
        return self._result_names

    # -- outputs --------------------------------------------------------------------

    def _resolve_outputs(self, outputs: tuple[int | str, ...] | None) -> tuple[int, ...]:
        n = len(self._result_names)
        listing = ", ".join(f"{i}: {s}" for i, s in enumerate(self._result_names)) or "none"
        if outputs is None:
            if n == 0:
                raise KernelError(
                    f"op {self.name} returns nothing and mutates no argument, so it has no "
                    f"result JAX could return; only ops with a Tensor result or a Tensor(a!) "
                    f"argument can be called."
                )
            return tuple(range(n))
        selected = []
        mutable_names = {self._params[i].name: self._n_returns + j for j, i in enumerate(self._mutable)}
        for k, o in enumerate(outputs):
            if isinstance(o, bool) or not isinstance(o, (int, str)):
                raise KernelError(
                    f"outputs[{k}] of op {self.name} is {o!r}; give a result index (int) or the "
                    f"name of a mutated argument (str). The op's results are {listing}."
                )
            if isinstance(o, str):
                if o not in mutable_names:
                    other = "" if not any(p.name == o for p in self._params) else (
                        f" ({o!r} is an argument the op does not mutate: it is not Tensor(a!) in the schema)"
                    )
                    raise KernelError(
                        f"outputs[{k}] of op {self.name} names {o!r}, which is not a mutated "
                        f"argument{other}; mutated arguments: {sorted(mutable_names) or 'none'}. "
                        f"The op's results are {listing}."
                    )
                selected.append(mutable_names[o])
            else:
                if not -n <= o < n:
                    raise KernelError(
                        f"outputs[{k}] of op {self.name} is {o}, but the op has {n} result(s): "
                        f"{listing}. Use one of these indices, or a mutated argument's name."
                    )
                selected.append(o % n)
        return tuple(selected)

    # -- binding --------------------------------------------------------------------

    def _bind(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> list[Any]:
        """Values per schema position, defaults filled in; raise on a bad call."""
        params = self._params
        n_pos = sum(not p.kwarg_only for p in params)
        if len(args) > n_pos:
            raise KernelError(
                f"op {self.name} takes {n_pos} positional argument(s) but {len(args)} were "
                f"given; its schema is {self.op._schema}."
            )
        values: list[Any] = list(args) + [_MISSING] * (len(params) - len(args))
        by_name = {p.name: i for i, p in enumerate(params)}
        for key, v in kwargs.items():
            if key not in by_name:
                close = difflib.get_close_matches(key, list(by_name), n=1)
                hint = f" Did you mean {close[0]!r}?" if close else ""
                raise KernelError(
                    f"op {self.name} has no argument {key!r}; its arguments are {list(by_name)}.{hint}"
                )
            i = by_name[key]
            if values[i] is not _MISSING:
                raise KernelError(f"op {self.name} got argument {key!r} both by position ({i}) and by keyword.")
            values[i] = v
        for i, p in enumerate(params):
            if values[i] is _MISSING:
                if not p.has_default:
                    raise KernelError(
                        f"op {self.name} is missing argument {p.name!r} (position {i}, type "
                        f"{p.type_str}); its schema is {self.op._schema}."
                    )
                values[i] = p.default
        return values

    def _check_kinds(self, values: list[Any]) -> None:
        for i, (p, v) in enumerate(zip(self._params, values)):
            where = f"argument {p.name!r} (position {i}) of op {self.name}"
            if p.kind == _TENSOR:
                if v is None and "Optional" in p.type_str:
                    continue
                if not _is_array(v):
                    raise KernelError(
                        f"{where} is a Tensor in the schema, so pass a JAX array; got "
                        f"{type(v).__name__} {v!r:.60}. Wrap scalars with jnp.asarray(...)."
                    )
            elif p.kind == _TENSOR_LIST:
                if _contains_array(v):
                    raise KernelError(
                        f"{where} is a {p.type_str}; lists of tensors cannot be passed to a torch "
                        f"op from JAX yet. Wrap the op in a custom op that takes separate Tensors."
                    )
            elif _contains_array(v):
                raise KernelError(
                    f"{where} is a {p.type_str} in the schema and must be a Python value, got a "
                    f"JAX array. Pass a Python {p.type_str} (it is baked into the compiled program); "
                    f"values that change from call to call must be Tensor arguments of the op."
                )
            if p.mutable and not _is_array(v):
                raise KernelError(f"{where} is mutated by the op (Tensor(a!)) and must be a JAX array holding its initial value.")

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

    def paths_taken(self) -> tuple[str, ...]:
        """The distinct forward paths of the calls prepared so far, e.g. `("ffi",)` (for run reports)."""
        with self._lock:
            return tuple(dict.fromkeys(c.path for c in self._cache.values()))

    def _prepare(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> tuple[_Call, list[Any]]:
        """The (cached) compiled call for these arguments, and the arrays it takes."""
        values = self._bind(args, kwargs)
        self._check_kinds(values)
        array_pos = tuple(i for i, v in enumerate(values) if self._params[i].kind == _TENSOR and v is not None)
        arrays = [jnp.asarray(values[i]) for i in array_pos]
        for i, a in zip(array_pos, arrays):
            check_x64_numpy(a.dtype, f"argument {self._params[i].name!r} of op {self.name}")
        key = (
            tuple((i, tuple(a.shape), np.dtype(a.dtype).str) for i, a in zip(array_pos, arrays)),
            tuple(
                (i, _hashable(v, f"argument {self._params[i].name!r} of op {self.name}"))
                for i, v in enumerate(values)
                if i not in array_pos
            ),
        )
        call = self._cache.get(key)
        if call is None:
            with self._lock:
                call = self._cache.get(key)
                if call is None:
                    call = self._build(values, array_pos, arrays)
                    self._cache[key] = call
        return call, arrays

    # -- compile --------------------------------------------------------------------

    def _fake_device(self) -> str:
        return "cuda" if jax.default_backend() == "gpu" and torch.cuda.is_available() else "cpu"

    def _call_op(self, values: Sequence[Any]) -> Any:
        """Run the op on per-position values (positional, then keyword-only by name)."""
        pos = [v for p, v in zip(self._params, values) if not p.kwarg_only]
        kw = {p.name: v for p, v in zip(self._params, values) if p.kwarg_only}
        return self.op(*pos, **kw)

    def _returns(self, res: Any) -> tuple[Any, ...]:
        if res is None:
            return ()
        return tuple(res) if isinstance(res, (tuple, list)) else (res,)

    def _build(self, values: list[Any], array_pos: tuple[int, ...], arrays: list[jax.Array]) -> _Call:
        statics = tuple(None if i in array_pos else v for i, v in enumerate(values))
        mutated_pos = tuple(i for i in array_pos if self._params[i].mutable)
        specs = self._result_specs(statics, array_pos, arrays, mutated_pos)
        fwd, path = self._forward_ffi(statics, array_pos, mutated_pos, specs)
        if fwd is None:
            fwd = self._forward_callback(statics, array_pos, mutated_pos, specs)
        call = _Call(array_pos, mutated_pos, statics, self._n_returns, specs, self._selected, fn=None, path=path)  # type: ignore[arg-type]
        bwd, bwd_path = None, path
        if path == "ffi":
            bwd, bwd_path = self._backward_ffi(call, arrays)
        call = dataclasses.replace(call, bwd_path=bwd_path)
        return dataclasses.replace(call, fn=self._custom_vjp(call, fwd, [a.dtype for a in arrays], bwd))

    # -- the FFI path -------------------------------------------------------------------

    def _requested_path(self) -> tuple[str, str]:
        """(the path asked for, who asked): the argument, else $JAXBRIDGE_KERNEL_PATH, else auto."""
        if self.call_path != "auto":
            return self.call_path, f"call_path={self.call_path!r}"
        env = os.environ.get(ENV_CALL_PATH, "").strip().lower()
        if not env:
            return "auto", 'call_path="auto"'
        if env not in _CALL_PATHS:
            raise KernelError(
                f"the environment variable {ENV_CALL_PATH} is {env!r} (read for op {self.name}); set it "
                f"to one of {list(_CALL_PATHS)} or unset it."
            )
        return env, f"{ENV_CALL_PATH}={env}"

    def _forward_ffi(self, statics, array_pos, mutated_pos, specs) -> tuple[Callable[..., Any] | None, str]:
        """The FFI forward and "ffi", or (None, "callback (<why>)") where the callback path is used.

        Under call_path="ffi" a call the FFI path cannot take raises instead.
        """
        want, who = self._requested_path()
        if want == "callback":
            return None, f"callback ({who})"

        def no(reason: str) -> tuple[None, str]:
            if want == "ffi":
                raise KernelError(
                    f"op {self.name} cannot take the FFI call path ({who}): {reason}. Use "
                    f'call_path="auto" (falls back to the buffer_callback path by itself) or '
                    f'call_path="callback" for this call.'
                )
            return None, f"callback ({reason})"

        from .ffi import plans

        try:
            encoded = self._encode_plan(statics, array_pos, mutated_pos)
        except plans.Ineligible as e:
            return no(e.reason)
        platform = _platform()
        if platform not in ("cpu", "cuda"):
            return no(f"JAX's default backend is {platform!r}; the FFI handler exists for cpu and CUDA only")
        try:
            from .ffi import target

            ext = target.load()
        except KernelError as e:
            if want == "ffi":
                raise
            _warn_ffi_unavailable(e)
            return None, "callback (the FFI extension is unavailable: " + str(e).splitlines()[0] + ")"
        if platform == "cuda":
            if not ext.cuda:
                return no(
                    f"the FFI extension {ext.path} was built without CUDA (no CUDA headers were found: set "
                    f"CUDA_HOME to a CUDA toolkit and delete {ext.path.parent} to rebuild it)"
                )
            torch.cuda.init()  # here, on the Python thread, not first inside the handler on XLA's
        try:
            plan = self._register_plan(ext, encoded, f"op {self.name}")
        except KernelError as e:
            return no(str(e))
        n_ret = self._n_returns
        aliases = {array_pos.index(i): n_ret + j for j, i in enumerate(mutated_pos)}
        return ext.call(plan, specs, aliases), "ffi"

    def _backward_ffi(self, call: _Call, arrays: Sequence[Any]) -> tuple[Callable[..., Any] | None, str]:
        """The FFI backward (`bwd(*saved, *cotangents)` -> input gradients) and "ffi", or (None, "callback (<why>)").

        Registered with the forward, for a call whose forward takes the FFI path;
        the differentiated inputs are the inexact arrays, the cotangents those of
        the inexact selected results (what `_custom_vjp` passes).
        """
        from .ffi import plans, target

        diff = tuple(k for k, a in enumerate(arrays) if _is_inexact(a.dtype))
        outputs = tuple(s for s in call.selected if _is_inexact(call.result_specs[s].dtype))
        if not diff:
            return None, "ffi"  # nothing to differentiate: no backward call at all
        encoded = self._encode_plan(
            call.statics, call.array_pos, call.mutated_pos, backward=plans.Backward(diff, outputs)
        )
        ext = target.load()  # loaded by the forward already
        try:
            plan = self._register_plan(ext, encoded, f"the backward of op {self.name}")
        except KernelError as e:
            if self._requested_path()[0] == "ffi":
                raise
            return None, f"callback ({str(e).splitlines()[0]})"
        specs = tuple(jax.ShapeDtypeStruct(tuple(arrays[k].shape), arrays[k].dtype) for k in diff)
        return ext.call(plan, specs, {}), "ffi"

    def _register_plan(self, ext: Any, encoded: str, where: str) -> int:
        """The id of this op's plan `encoded` in the loaded FFI extension (KernelError if refused)."""
        overload = "" if self.op._overloadname == "default" else self.op._overloadname
        return ext.register_plan(self.op._schema.name, overload, encoded, where=where)

    def _encode_plan(self, statics, array_pos, mutated_pos, backward: Any = None) -> str:
        """The plan text of this call, or of its backward (raises plans.Ineligible with the reason).

        The backward's FFI arguments are the saved arrays, then the cotangents; a
        mutated argument is an argument there, cloned before the op writes into it.
        """
        from .ffi import plans

        out_of = {i: self._n_returns + j for j, i in enumerate(mutated_pos)}
        if backward is None:
            slot = {
                i: plans.TensorSlot(out_of[i], from_result=True) if i in out_of else plans.TensorSlot(k)
                for k, i in enumerate(array_pos)
            }
            n_args = len(array_pos)
        else:
            slot = {i: plans.TensorSlot(k, cloned=i in out_of) for k, i in enumerate(array_pos)}
            n_args = len(array_pos) + len(backward.outputs)
        entries = []
        for i, p in enumerate(self._params):
            entries.append((p.name, p.type_str, slot.get(i, statics[i])))  # a Tensor list is refused by encode
        return plans.encode(n_args, entries, backward)

    def _fake_run(
        self,
        statics: tuple[Any, ...],
        array_pos: tuple[int, ...],
        arrays: Sequence[Any],
        *,
        grad: bool,
        then: Callable[[tuple[Any, ...], list[Any]], Any] | None = None,
    ) -> Any:
        """Run the op on fake tensors; `then(results, leaves)` runs inside the fake mode.

        Results are the returns, plus the mutated arguments when `grad` is set.
        """
        from torch._subclasses.fake_tensor import FakeTensorMode

        _triton_interp.patch_interpreter()
        device = self._fake_device()
        real = self.shape_probe == "real" and not grad
        # Real tensors an op closes over (a model stage's weights) are allowed: fake mode reads
        # only their metadata. TorchScript's profiling executor guards its specialised graphs
        # with value checks (aten::equal) that fake tensors cannot answer (e3nn's compiled
        # tensor products, once they have run for real); the unoptimised interpreter computes
        # the same shapes.
        fake = contextlib.nullcontext() if real else FakeTensorMode(allow_non_fake_inputs=True)
        with fake, torch.jit.optimized_execution(False):
            leaves, vals = [], list(statics)
            for i, a in zip(array_pos, arrays):
                where = f"argument {self._params[i].name!r} of op {self.name}"
                t = torch.zeros(tuple(a.shape), dtype=torch_dtype(a.dtype, where), device=device)
                if grad and _is_inexact(a.dtype):
                    leaves.append(t.requires_grad_(True))
                    t = t.clone() if self._params[i].mutable else t
                vals[i] = t
            with torch.enable_grad() if grad else torch.no_grad():
                res = self._returns(self._call_op(vals))
                if grad:
                    res = res + tuple(vals[i] for i in array_pos if self._params[i].mutable)
                return then(res, leaves) if then is not None else res

    def _result_specs(self, statics, array_pos, arrays, mutated_pos) -> tuple[jax.ShapeDtypeStruct, ...]:
        missing_mut = [self._params[i].name for i in self._mutable if i not in array_pos]
        if missing_mut:
            raise KernelError(
                f"op {self.name} mutates {missing_mut} but got None for them; pass arrays holding "
                f"their initial values (e.g. jnp.zeros of the right shape)."
            )
        try:
            res = self._fake_run(statics, array_pos, arrays, grad=False)
        except DLPackError:
            raise
        except KernelError:
            raise
        except Exception as e:
            raise _fake_error(self.name, e) from e
        if len(res) != self._n_returns or not all(isinstance(r, torch.Tensor) for r in res):
            raise KernelError(
                f"the fake implementation of op {self.name} returned {len(res)} value(s) of types "
                f"{[type(r).__name__ for r in res]}, but the schema declares {self._n_returns} "
                f"Tensor(s); fix the function registered with register_fake."
            )
        specs = [
            jax.ShapeDtypeStruct(tuple(r.shape), jax_dtype(r.dtype, f"return {k} of op {self.name}"))
            for k, r in enumerate(res)
        ]
        by_pos = dict(zip(array_pos, arrays))
        specs += [jax.ShapeDtypeStruct(tuple(by_pos[i].shape), by_pos[i].dtype) for i in mutated_pos]
        return tuple(specs)

    def _op_caller(self, statics: tuple[Any, ...], array_pos: tuple[int, ...]) -> Callable[[Sequence[Any]], tuple[Any, ...]]:
        """`call(tensors)`: the op on `tensors` (one per array, in call order) and the statics, as a tuple of its returns.

        Everything that depends only on the schema and the static values (the
        positional and keyword templates, where each tensor goes) is worked out
        here once, so a call only fills the tensor slots.
        """
        pos0: list[Any] = []
        kw0: dict[str, Any] = {}
        slot: dict[int, int | str] = {}
        for i, p in enumerate(self._params):
            if p.kwarg_only:
                kw0[p.name], slot[i] = statics[i], p.name
            else:
                slot[i] = len(pos0)
                pos0.append(statics[i])
        pos_fill = tuple((k, slot[i]) for k, i in enumerate(array_pos) if not self._params[i].kwarg_only)
        kw_fill = tuple((k, slot[i]) for k, i in enumerate(array_pos) if self._params[i].kwarg_only)
        op, n_ret = self.op, self._n_returns

        def call(ts: Sequence[Any]) -> tuple[Any, ...]:
            args = pos0.copy()
            for k, s in pos_fill:
                args[s] = ts[k]
            if kw0:
                kw = kw0.copy()
                for k, s in kw_fill:
                    kw[s] = ts[k]
                res = op(*args, **kw)
            else:
                res = op(*args)
            return (res,) if n_ret == 1 else () if n_ret == 0 else tuple(res)

        return call

    def _forward_callback(self, statics, array_pos, mutated_pos, specs) -> Callable[..., tuple[jax.Array, ...]]:
        n_ret = self._n_returns
        out_of = {i: n_ret + j for j, i in enumerate(mutated_pos)}
        aliases = {array_pos.index(i): out_of[i] for i in mutated_pos}
        # per array argument: the output buffer it is (a mutated argument, aliased to
        # its input by XLA, so the op writes straight into JAX's result), or None
        source = tuple(out_of.get(i) for i in array_pos)
        call = self._op_caller(statics, array_pos)
        set_grad, grad_enabled = torch._C._set_grad_enabled, torch.is_grad_enabled
        name = self.name

        def callback(ctx: Any, outs: Sequence[Any], *ins: Any) -> None:
            saved = _enter_xla_stream(ctx, outs[0])
            grad = grad_enabled()
            set_grad(False)
            try:
                t_out = [buffer_to_torch(b) for b in outs]
                res = call([buffer_to_torch(ins[k]) if j is None else t_out[j] for k, j in enumerate(source)])
                for o, r in zip(t_out, res):  # returns only; mutated arguments were written in place
                    if o.data_ptr() != r.data_ptr() or o.numel() == 0:
                        o.copy_(r)  # a functional op allocates its result: one device copy
            except BaseException as e:
                _report_failure(name, "call", outs[0], e)
                raise
            finally:
                set_grad(grad)
                if saved is not None:
                    _leave_xla_stream(saved)

        return buffer_callback(callback, specs, input_output_aliases=aliases or None)

    def _backward_callback(self, call: _Call, dtypes: Sequence[Any], ct_idx: tuple[int, ...]) -> Callable[..., Any]:
        """Callback computing the input cotangents of the inexact inputs."""
        array_pos = call.array_pos
        n_arrays = len(array_pos)
        # per array argument: (mutated by the op, differentiated)
        kinds = tuple((self._params[i].mutable, _is_inexact(d)) for i, d in zip(array_pos, dtypes))
        mutated_k = tuple(k for k, (mutable, _) in enumerate(kinds) if mutable)
        # per incoming cotangent: (index into returns + mutated arguments, position in `ins`)
        picks = tuple((call.selected[j], n_arrays + c) for c, j in enumerate(ct_idx))
        run_op = self._op_caller(call.statics, array_pos)
        set_grad, grad_enabled = torch._C._set_grad_enabled, torch.is_grad_enabled
        name = self.name

        def callback(ctx: Any, outs: Sequence[Any], *ins: Any) -> None:
            saved = _enter_xla_stream(ctx, outs[0])
            grad = grad_enabled()
            set_grad(True)
            try:
                ts, leaves = [], []
                for k, (mutable, differentiated) in enumerate(kinds):
                    t = buffer_to_torch(ins[k])
                    if mutable:
                        t = t.clone()  # the op writes into it; never into JAX's buffer
                    if differentiated:
                        leaves.append(t.requires_grad_(True))
                        if mutable:
                            t = t.clone()  # in-place writes into a leaf are not allowed
                    ts.append(t)
                results = run_op(ts) + tuple(ts[k] for k in mutated_k)
                outs_g, cts_g = [], []
                for r_idx, c in picks:
                    r = results[r_idx]
                    if r.requires_grad:
                        outs_g.append(r)
                        cts_g.append(buffer_to_torch(ins[c]))
                grads: Sequence[Any] = [None] * len(leaves)
                if outs_g:
                    grads = torch.autograd.grad(outs_g, leaves, cts_g, allow_unused=True)
                for b, g in zip(outs, grads):
                    o = buffer_to_torch(b)
                    if g is None:
                        o.zero_()
                    else:
                        o.copy_(g)
            except BaseException as e:
                _report_failure(name, "backward call", outs[0], e)
                raise
            finally:
                set_grad(grad)
                if saved is not None:
                    _leave_xla_stream(saved)

        return callback

    def _check_differentiable(self, call: _Call, arrays: Sequence[Any]) -> None:
        """Trace-time check, on fake tensors, that torch can differentiate the op (unless `check_grad` is off)."""
        if not self.check_grad:
            return
        fix = (
            f"Register a backward formula with torch.library.register_autograd({self.name.split('.')[0]!r}, "
            f"backward, setup_context=...), or do not differentiate through this op "
            f"(jax.lax.stop_gradient on its inputs)."
        )
        outputs = [self._result_names[j] for j in call.selected]

        def probe(results: tuple[Any, ...], leaves: list[Any]) -> str | None:
            live = [r for r in (results[j] for j in call.selected) if r.requires_grad]
            if not leaves:
                return None
            if not live:
                return f"torch autograd records no gradient for its results {outputs}."
            torch.autograd.grad(live, leaves, [torch.ones_like(r) for r in live], allow_unused=True)
            return None

        try:
            problem = self._fake_run(call.statics, call.array_pos, arrays, grad=True, then=probe)
        except Exception as e:
            if _is_data_dependent(e):
                # A backward formula exists but reads values (e.g. `.item()`), which fake
                # tensors cannot answer: differentiable; the real backward runs on real data.
                return
            problem = f"torch cannot differentiate it: {type(e).__name__}: {str(e).splitlines()[0][:300]}"
        if problem is not None:
            raise NotDifferentiableError(f"jax.grad reached op {self.name}, but {problem} {fix}")

    def _custom_vjp(
        self, call: _Call, fwd_cb: Callable[..., Any], dtypes: list[Any], bwd_ffi: Callable[..., Any] | None = None
    ) -> Callable[..., Any]:
        selected = call.selected
        sel_inexact = tuple(j for j, s in enumerate(selected) if _is_inexact(call.result_specs[s].dtype))
        diff = tuple(k for k, d in enumerate(dtypes) if _is_inexact(d))
        # the callback backward, one buffer_callback per shape of the saved arrays; the FFI
        # backward (when the forward took the FFI path) has its result shapes fixed with the call
        bwd_cb_body = None if bwd_ffi is not None else self._backward_callback(call, dtypes, sel_inexact)
        bwd_cache: dict[Any, Any] = {}

        def run_forward(*arrays: jax.Array) -> tuple[jax.Array, ...]:
            axes = frozenset().union(*(_vma(a) for a in arrays)) if arrays else frozenset()
            outs = fwd_cb(*arrays)
            return tuple(_vary(outs[s], axes) for s in selected)

        @jax.custom_vjp
        def fn(*arrays: jax.Array) -> tuple[jax.Array, ...]:
            return run_forward(*arrays)

        def fn_fwd(*arrays: jax.Array):
            self._check_differentiable(call, arrays)
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


_FFI_WARNED: list[str] = []


def _warn_ffi_unavailable(e: KernelError) -> None:
    """Warn once per process that "auto" fell back to the callback path because the FFI extension failed."""
    if _FFI_WARNED:
        return
    _FFI_WARNED.append(str(e))
    warnings.warn(
        f"TorchOpKernel: the compiled FFI call path is unavailable, so torch ops run through the "
        f"buffer_callback path (more host work per call). Reason: {e} To silence this, pass "
        f'call_path="callback" or set {ENV_CALL_PATH}=callback.',
        RuntimeWarning,
        stacklevel=6,  # the caller of TorchOpKernel.__call__ / call_path_of
    )


def _platform() -> str:
    """The platform programs are compiled for: "cpu", "cuda", "rocm", or another backend name."""
    backend = jax.default_backend()
    if backend != "gpu":
        return backend
    version = str(getattr(jax.devices()[0].client, "platform_version", "")).lower()
    return "rocm" if "rocm" in version else "cuda"


def _report_failure(op: str, what: str, buf: Any, e: BaseException) -> None:
    """Log a failed callback's error at once (level ERROR: shown without logging set up), naming the op and device.

    The exception is raised too, but when the program has collectives the other
    devices wait for this one in a rendezvous, and XLA may end the process at its
    timeout before the error reaches Python: this line is then all the user sees.
    """
    kind, index = buf.__dlpack_device__()
    device = f"cuda:{index}" if kind in (_KDL_CUDA, _KDL_ROCM) else "cpu"
    _log.error(
        "nvalchemi_jaxbridge: on device %s: torch op %s failed inside its %s (callback path): %s: %s\n(also raised as a JAX "
        "error; if other devices wait for this one in a collective, XLA may stop the process before that "
        "error reaches Python)", device, op, what, type(e).__name__, e)


def _is_data_dependent(e: BaseException) -> bool:
    """Whether a fake-tensor run failed only because the code asked for tensor values."""
    from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException

    return isinstance(e, (DataDependentOutputException, DynamicOutputShapeException))


class _Missing:
    def __repr__(self) -> str:
        return "<missing>"


_MISSING = _Missing()


def _contains_array(v: Any) -> bool:
    if isinstance(v, (list, tuple)):
        return any(_contains_array(x) for x in v)
    return _is_array(v)


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


def _as_overload(op: Any) -> Any:
    """An OpOverload from an OpOverload, packet or CustomOpDef; raise otherwise."""
    tname = type(op).__name__
    if tname == "CustomOpDef" and hasattr(op, "_opoverload"):
        return op._opoverload
    if tname == "OpOverloadPacket":
        try:
            return op.default
        except AttributeError:
            raise KernelError(
                f"op packet {op} has no default overload; pass one of {list(op.overloads())} "
                f"explicitly, e.g. torch.ops.<ns>.<name>.<overload>."
            ) from None
    if hasattr(op, "_schema") and hasattr(op, "_overloadname"):
        return op
    raise KernelError(
        f"TorchOpKernel needs a torch op (torch.ops.ns.name.default, its packet, or a "
        f"@torch.library.custom_op function); got {type(op).__name__} {op!r:.80}."
    )
