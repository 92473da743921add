"""The `buffer_callback` call path: the op called from Python on DLPack views of XLA's buffers.

`forward` is the op's forward as a `buffer_callback`: the op reads XLA's input
buffers and its results are written into XLA's output buffers (a mutated
argument's output buffer is aliased to its input, so the op writes straight into
JAX's result). Under differentiation `forward_keeping` runs the op instead under
torch autograd and keeps its graph in the call's `GraphTable`, returning a token
with the results; `backward_body` is the callback of the backward: that graph
(or, absent, the op again under autograd on the saved inputs), then
`torch.autograd.grad` with the cotangents. On a GPU the op's work is queued on
XLA's stream (`ctx.stream`) and the buffers' device; the backward reads the
token, two int32, from the device (one stream synchronisation). A failing
callback logs its error at once (`_report_failure`) before raising it.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import Any

import jax
import torch
from jax.experimental.buffer_callback import buffer_callback

from .dlpack import buffer_to_torch
from .graph_table import TOKEN_DTYPE, TOKEN_SHAPE, GraphTable
from .op_binding import OpBinding, _Call

_log = logging.getLogger(__name__)

_KDL_CUDA = 2
_KDL_ROCM = 10


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


# ----------------------------------------------------------------------------- the calls


def _op_caller(
    binding: OpBinding, statics: tuple[Any, ...], array_pos: tuple[int, ...]
) -> Callable[[Sequence[Any]], tuple[Any, ...]]:
    """`call(tensors)`: the op on `tensors` (one per array, in call order) and the statics, as a tuple of its returns.

    Everything that depends only on the schema and the static values (the
    positional and keyword templates, where each tensor goes) is worked out
    here once, so a call only fills the tensor slots.
    """
    pos0: list[Any] = []
    kw0: dict[str, Any] = {}
    slot: dict[int, int | str] = {}
    for i, p in enumerate(binding.params):
        if p.kwarg_only:
            kw0[p.name], slot[i] = statics[i], p.name
        else:
            slot[i] = len(pos0)
            pos0.append(statics[i])
    pos_fill = tuple((k, slot[i]) for k, i in enumerate(array_pos) if not binding.params[i].kwarg_only)
    kw_fill = tuple((k, slot[i]) for k, i in enumerate(array_pos) if binding.params[i].kwarg_only)
    op, n_ret = binding.op, binding.n_returns

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


def write_result(name: str, j: int, got: torch.Tensor, want: torch.Tensor) -> None:
    """The op's result `j` written into XLA's buffer `want` (unless the op wrote it there itself), after checking
    it is the shape and dtype JAX expects (as the FFI path's `write_result` in `ffi/buffers.cc`)."""
    if got.shape != want.shape or got.dtype != want.dtype:
        raise ValueError(
            f"op {name}: return {j} is {list(got.shape)} {got.dtype} but JAX expected {list(want.shape)} "
            f"{want.dtype} (from the op's fake implementation); its register_fake disagrees with its real "
            "implementation. Make the function registered with register_fake return the shapes and dtypes "
            "the op really returns"
        )
    if want.numel() != 0 and got.data_ptr() != want.data_ptr():
        want.copy_(got)  # the op allocated its result: one device copy


def forward(binding: OpBinding, statics, array_pos, mutated_pos, specs) -> Callable[..., tuple[jax.Array, ...]]:
    """The op's forward as a `buffer_callback` of the arrays, returning the results `specs`."""
    n_ret = binding.n_returns
    out_of = {i: n_ret + j for j, i in enumerate(mutated_pos)}
    aliases = {array_pos.index(i): out_of[i] for i in mutated_pos}
    # per array argument: the output buffer it is (a mutated argument, aliased to
    # its input by XLA, so the op writes straight into JAX's result), or None
    source = tuple(out_of.get(i) for i in array_pos)
    call = _op_caller(binding, statics, array_pos)

    def body(outs: Sequence[Any], ins: Sequence[Any]) -> None:
        t_out = [buffer_to_torch(b) for b in outs]
        res = call([buffer_to_torch(ins[k]) if j is None else t_out[j] for k, j in enumerate(source)])
        for j, (o, r) in enumerate(zip(t_out, res)):  # returns only; mutated arguments were written in place
            write_result(binding.name, j, r, o)

    callback = _on_xla_stream(binding.name, "call", False, body)
    return buffer_callback(callback, specs, input_output_aliases=aliases or None)


def _on_xla_stream(name: str, what: str, grad: bool, body: Callable[[Sequence[Any], Sequence[Any]], None]
                   ) -> Callable[..., None]:
    """The `buffer_callback` callback running `body(outs, ins)` on XLA's stream with torch's grad mode `grad`.

    The stream, device and grad mode are restored after; a failure is logged at once
    (`_report_failure`, naming the op and `what`) and raised.
    """
    set_grad, grad_enabled = torch._C._set_grad_enabled, torch.is_grad_enabled

    def callback(ctx: Any, outs: Sequence[Any], *ins: Any) -> None:
        saved = _enter_xla_stream(ctx, outs[0])
        was = grad_enabled()
        set_grad(grad)
        try:
            body(outs, ins)
        except BaseException as e:
            _report_failure(name, what, outs[0], e)
            raise
        finally:
            set_grad(was)
            if saved is not None:
                _leave_xla_stream(saved)

    return callback


@dataclasses.dataclass(frozen=True)
class _GradPlan:
    """What the differentiated forward and the backward of one call share."""

    kinds: tuple[tuple[bool, bool], ...]  # per array argument: (mutated by the op, differentiated)
    mutated_k: tuple[int, ...]  # array arguments the op mutates, in schema order
    results: tuple[int, ...]  # per cotangent: its index into (returns, then mutated arguments)
    run_op: Callable[[Sequence[Any]], tuple[Any, ...]]


def _grad_plan(binding: OpBinding, call: _Call, diff: tuple[int, ...], ct_idx: tuple[int, ...]) -> _GradPlan:
    kinds = tuple((binding.params[i].mutable, k in diff) for k, i in enumerate(call.array_pos))
    return _GradPlan(
        kinds, tuple(k for k, (mutable, _) in enumerate(kinds) if mutable),
        tuple(call.selected[j] for j in ct_idx), _op_caller(binding, call.statics, call.array_pos))


def _run_under_autograd(
    plan: _GradPlan, ins: Sequence[Any], *, keep: bool
) -> tuple[list[Any], tuple[Any, ...], tuple[Any, ...]]:
    """(leaves, every result, the results that get cotangents or None) of the op under autograd.

    With `keep` every input is cloned, so the graph outlives XLA's buffers; else
    only a mutated one (the op writes into it; never into JAX's buffer).
    """
    ts, leaves = [], []
    for buf, (mutable, differentiated) in zip(ins, plan.kinds):
        t = buffer_to_torch(buf)
        if keep or mutable:
            t = t.clone()
        if differentiated:
            leaves.append(t.requires_grad_(True))
            if mutable:
                t = t.clone()  # in-place writes into a leaf are not allowed
        ts.append(t)
    results = plan.run_op(ts) + tuple(ts[k] for k in plan.mutated_k)
    outputs = tuple(r if (r := results[j]).requires_grad else None for j in plan.results)
    return leaves, results, outputs


def forward_keeping(
    binding: OpBinding, call: _Call, diff: tuple[int, ...], ct_idx: tuple[int, ...], table: GraphTable
) -> Callable[..., tuple[jax.Array, ...]]:
    """The differentiated forward: every result, then the token of the graph kept in `table`.

    The op runs once under torch autograd (its inputs cloned, the arrays `diff`
    leaves); its results are written into XLA's buffers and `(leaves, outputs)`
    stay in `table` for the backward (`backward_body`).
    """
    plan = _grad_plan(binding, call, diff, ct_idx)
    n_ret = binding.n_returns
    aliases = {call.array_pos.index(i): n_ret + j for j, i in enumerate(call.mutated_pos)}
    specs = (*call.result_specs, jax.ShapeDtypeStruct(TOKEN_SHAPE, TOKEN_DTYPE))
    set_grad = torch._C._set_grad_enabled

    def body(outs: Sequence[Any], ins: Sequence[Any]) -> None:
        leaves, results, outputs = _run_under_autograd(plan, ins, keep=True)
        set_grad(False)
        for j, (b, r) in enumerate(zip(outs, results)):  # mutated arguments too: the op wrote into clones
            write_result(binding.name, j, r, buffer_to_torch(b))
        token = buffer_to_torch(outs[-1])
        for j, v in enumerate(table.keep((leaves, outputs))):
            token[j].fill_(v)  # a fill, not a copy from the host: no stream synchronisation

    callback = _on_xla_stream(binding.name, "call", True, body)
    return buffer_callback(callback, specs, input_output_aliases=aliases or None)


def backward_body(
    binding: OpBinding, call: _Call, diff: tuple[int, ...], ct_idx: tuple[int, ...], table: GraphTable
) -> Callable[..., Any]:
    """Callback computing the cotangents of the arrays `diff`: `(ctx, outs, *saved, token, *cotangents)`.

    The graph the forward kept under `token` in `table`, or (absent) the op re-run
    under autograd on the saved inputs, then `torch.autograd.grad` with the cotangents.
    """
    plan = _grad_plan(binding, call, diff, ct_idx)
    n_arrays = len(call.array_pos)

    def body(outs: Sequence[Any], ins: Sequence[Any]) -> None:
        kept = table.take(tuple(buffer_to_torch(ins[n_arrays]).tolist()))
        if kept is None:  # gone (a second pullback, evicted): the op again on the saved inputs
            leaves, _, outputs = _run_under_autograd(plan, ins[:n_arrays], keep=False)
        else:
            leaves, outputs = kept
        live = [(r, buffer_to_torch(ins[n_arrays + 1 + c])) for c, r in enumerate(outputs) if r is not None]
        grads: Sequence[Any] = [None] * len(leaves)
        if live:
            # on this thread (XLA's, on its stream), not torch's per-device autograd thread (see torch_call.cc)
            with torch.autograd.set_multithreading_enabled(False):
                grads = torch.autograd.grad([r for r, _ in live], leaves, [c for _, c in live], allow_unused=True)
        del kept, leaves, outputs, live  # the graph goes now, not with the frame
        for b, g in zip(outs, grads):
            o = buffer_to_torch(b)
            if g is None:
                o.zero_()
            else:
                o.copy_(g)

    return _on_xla_stream(binding.name, "backward call", True, body)


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
