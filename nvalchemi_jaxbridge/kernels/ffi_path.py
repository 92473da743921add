"""The compiled FFI call path, Python side: which path a call takes, and its plans.

The handler itself is C++ (`kernels/ffi/`): an XLA FFI custom call that wraps
XLA's buffers as tensors and calls the op through torch's dispatcher. Here a
call's static arguments and tensor slots are encoded as a plan (`ffi/plans.py`),
registered with the loaded extension (`ffi/target.py`), and the call becomes
`ext.call(plan, ...)`. `forward` and `grad_calls` return None with the reason
where a call falls back to the `buffer_callback` path under `call_path="auto"`,
and raise under `call_path="ffi"`.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import torch

from .graph_table import GRAPH_CAP, TOKEN_DTYPE, TOKEN_SHAPE, GradCalls
from .op_binding import KernelError, OpBinding, _Call
from .shape_probe import _is_inexact

_CALL_PATHS = ("auto", "ffi", "callback")
ENV_CALL_PATH = "JAXBRIDGE_KERNEL_PATH"  # the path "auto" means, when set

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


def requested_path(call_path: str, name: str) -> tuple[str, str]:
    """(the path asked for, who asked): the argument, else $JAXBRIDGE_KERNEL_PATH, else auto."""
    if call_path != "auto":
        return call_path, f"call_path={call_path!r}"
    env = os.environ.get(ENV_CALL_PATH, "").strip().lower()
    if not env:
        return "auto", 'call_path="auto"'
    if env not in _CALL_PATHS:
        raise KernelError(
            f"the environment variable {ENV_CALL_PATH} is {env!r} (read for op {name}); set it "
            f"to one of {list(_CALL_PATHS)} or unset it."
        )
    return env, f"{ENV_CALL_PATH}={env}"


def forward(
    binding: OpBinding, call_path: str, statics, array_pos, mutated_pos, specs
) -> tuple[Callable[..., Any] | None, str]:
    """The FFI forward and "ffi", or (None, "callback (<why>)") where the callback path is used.

    Under call_path="ffi" a call the FFI path cannot take raises instead.
    """
    want, who = requested_path(call_path, binding.name)
    if want == "callback":
        return None, f"callback ({who})"

    def no(reason: str) -> tuple[None, str]:
        if want == "ffi":
            raise KernelError(
                f"op {binding.name} cannot take the FFI call path ({who}): {reason}. Use "
                f'call_path="auto" (falls back to the buffer_callback path by itself) or '
                f'call_path="callback" for this call.'
            )
        return None, f"callback ({reason})"

    from .ffi import plans

    try:
        encoded = _encode_plan(binding, statics, array_pos, mutated_pos)
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
        plan = _register_plan(binding, ext, encoded, f"op {binding.name}")
    except KernelError as e:
        return no(str(e))
    n_ret = binding.n_returns
    aliases = {array_pos.index(i): n_ret + j for j, i in enumerate(mutated_pos)}
    return ext.call(plan, specs, aliases), "ffi"


def grad_calls(
    binding: OpBinding, call_path: str, call: _Call, arrays: Sequence[Any], diff: tuple[int, ...]
) -> tuple[GradCalls | None, str]:
    """The FFI forward-keeping-its-graph and backward of a call whose forward takes the FFI path, and "ffi".

    The forward runs the op under autograd and keeps its graph in its plan's
    table in C++ (at most `GRAPH_CAP`); the backward takes it by where its token
    was written (same run and device, same buffer) or by the token's value, or
    re-runs the op where it is gone. The differentiated inputs are the (inexact) arrays
    `diff`, the cotangents those of the inexact selected results
    (what `vjp.custom_vjp` passes). (None, "ffi") when no gradient flows (no call at
    all); (None, "callback (<why>)") where a plan is refused under call_path="auto".
    """
    from .ffi import plans, target

    outputs = tuple(s for s in call.selected if _is_inexact(call.result_specs[s].dtype))
    if not diff or not outputs:
        return None, "ffi"

    def encoded(**how: int) -> str:
        return _encode_plan(binding, call.statics, call.array_pos, call.mutated_pos,
                            backward=plans.Backward(diff, outputs, **how))

    ext = target.load()  # loaded by the forward already
    try:
        keep = _register_plan(binding, ext, encoded(keep=GRAPH_CAP), f"the differentiated forward of op {binding.name}")
        back = _register_plan(binding, ext, encoded(source=keep), f"the backward of op {binding.name}")
    except KernelError as e:
        if requested_path(call_path, binding.name)[0] == "ffi":
            raise
        return None, f"callback ({str(e).splitlines()[0]})"
    n_ret = binding.n_returns
    aliases = {call.array_pos.index(i): n_ret + j for j, i in enumerate(call.mutated_pos)}
    token = jax.ShapeDtypeStruct(TOKEN_SHAPE, TOKEN_DTYPE)
    grads = tuple(jax.ShapeDtypeStruct(tuple(arrays[k].shape), arrays[k].dtype) for k in diff)
    return GradCalls(
        ext.call(keep, (*call.result_specs, token), aliases), ext.call(back, grads, {}),
        lambda: ext.kept_graphs(keep), lambda: ext.token_reads(keep),
    ), "ffi"


def _register_plan(binding: OpBinding, ext: Any, encoded: str, where: str) -> int:
    """The id of this op's plan `encoded` in the loaded FFI extension (KernelError if refused)."""
    overload = "" if binding.op._overloadname == "default" else binding.op._overloadname
    return ext.register_plan(binding.op._schema.name, overload, encoded, where=where)


def _encode_plan(binding: OpBinding, statics, array_pos, mutated_pos, backward: Any = None) -> str:
    """The plan text of this call, or of its backward (raises plans.Ineligible with the reason).

    A differentiated call's plans take a mutated argument as an argument, cloned
    before the op writes into it; the backward's FFI arguments are the saved
    arrays, the token, then the cotangents.
    """
    from .ffi import plans

    out_of = {i: binding.n_returns + j for j, i in enumerate(mutated_pos)}
    if backward is None:
        slot = {
            i: plans.TensorSlot(out_of[i], from_result=True) if i in out_of else plans.TensorSlot(k)
            for k, i in enumerate(array_pos)
        }
        n_args = len(array_pos)
    else:
        slot = {i: plans.TensorSlot(k, cloned=i in out_of) for k, i in enumerate(array_pos)}
        n_args = len(array_pos) + (0 if backward.keep is not None else 1 + len(backward.outputs))
    entries = []
    for i, p in enumerate(binding.params):
        entries.append((p.name, p.type_str, slot.get(i, statics[i])))  # a Tensor list is refused by encode
    return plans.encode(n_args, entries, backward)
