"""How a torch function is recorded once and replayed: CUDA graphs on a GPU, and a CPU stand-in for tests.

A backend's `record(fn, inputs, grad)` returns a `Recording`: static input
tensors (the leaves of a differentiated recording require grad), static output
tensors, and `forward()` (and with `grad`, `backward()`) that replay the
recorded work on those buffers: `forward` reads `inputs` and writes `outputs`;
`backward` reads `grad_outputs` and the activations the last `forward` left, and
writes `grad_inputs`. Who calls a recording (`cuda_graphs.GraphedFunction`)
copies a call's tensors into `inputs` and copies of `outputs` out, the same for
every backend.

- `CudaGraphs`: warm-up runs, then `torch.cuda.CUDAGraph` captures of the
  forward (and of `torch.autograd.grad` of it: the backward), on a side stream
  of the device, in one private memory pool per recording; replays run on the
  current stream (XLA's, in a stage op).
- `FakeCapture` (tests, any device): records by running `fn` once and replays
  by running it again on the static inputs and copying its results into the
  static outputs (the backward from the activations of the last forward replay,
  as a graph's does). While recording it refuses what a CUDA capture refuses:
  reading a tensor's value on the host and shapes that depend on values.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Hashable, Sequence
from typing import Any, Protocol

import torch
from torch.overrides import TorchFunctionMode


class CaptureError(RuntimeError):
    """A stage cannot be recorded as a graph; the message says why (logged once, then the stage runs eagerly)."""


def as_outputs(out: Any) -> tuple[torch.Tensor, ...]:
    """A function's result as a tuple of tensors (one tensor: a 1-tuple)."""
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


@dataclasses.dataclass(frozen=True, eq=False)
class Recording:
    """A recorded function on static buffers (see the module docstring for what each replay reads and writes).

    `grad_outputs[j]` is None for an output that does not depend on a leaf; `grad_inputs[i]` is None for an
    input that is no leaf (an unused leaf's gradient is zeros).
    """

    inputs: tuple[torch.Tensor, ...]
    outputs: tuple[torch.Tensor, ...]
    forward: Callable[[], None]
    grad_outputs: tuple[torch.Tensor | None, ...] = ()
    grad_inputs: tuple[torch.Tensor | None, ...] = ()
    backward: Callable[[], None] | None = None


class CaptureBackend(Protocol):
    """What `cuda_graphs.StageGraphs` needs of a backend."""

    name: str

    def applies(self, t: torch.Tensor) -> bool:
        """Whether calls on tensors like `t` (its device) are recorded at all."""
        ...

    def lane(self, t: torch.Tensor) -> Hashable:
        """What keeps recordings apart besides the signature: the device (a GPU's one stream)."""
        ...

    def record(self, fn: Callable[..., Any], inputs: tuple[torch.Tensor, ...], grad: bool) -> Recording:
        """`fn` recorded on `inputs` (which hold a real call's values); raises on anything it cannot record."""
        ...


def _differentiate(outs: Sequence[torch.Tensor], leaves: Sequence[torch.Tensor],
                   cotangents: Sequence[torch.Tensor | None], *, retain: bool) -> tuple[torch.Tensor | None, ...]:
    """`torch.autograd.grad` of the outputs that have a cotangent, on this thread (None: an unused leaf)."""
    pairs = [(o, c) for o, c in zip(outs, cotangents) if c is not None]
    if not pairs or not leaves:
        return (None,) * len(leaves)
    with torch.autograd.set_multithreading_enabled(False):
        return torch.autograd.grad([o for o, _ in pairs], list(leaves), [c for _, c in pairs],
                                   retain_graph=retain, allow_unused=True)


def _grad_inputs(inputs: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None]
                 ) -> tuple[torch.Tensor | None, ...]:
    """Per input: its leaf's gradient buffer (zeros where autograd gave none), None for a non-leaf."""
    it = iter(grads)
    out = []
    for x in inputs:
        if not x.requires_grad:
            out.append(None)
            continue
        g = next(it)
        out.append(torch.zeros_like(x, requires_grad=False) if g is None else g.detach())
    return tuple(out)


# ----------------------------------------------------------------------------- CUDA graphs


class CudaGraphs:
    """Record with `torch.cuda.CUDAGraph` (forward, and backward under autograd); replay on the current stream.

    Args:
        warmup: eager runs before the capture, on the capture's stream (lazy initialisation, cuBLAS
            handles of that stream, TorchScript's profiling runs; torch's own default is 3).
    """

    name = "CUDA graphs"

    def __init__(self, warmup: int = 3) -> None:
        self.warmup = int(warmup)
        self._streams: dict[int, torch.cuda.Stream] = {}
        self._lock = threading.Lock()

    def applies(self, t: torch.Tensor) -> bool:
        return t.is_cuda

    def lane(self, t: torch.Tensor) -> Hashable:
        return t.device.index  # one stream per device: XLA's

    def _side_stream(self, device: torch.device) -> torch.cuda.Stream:
        with self._lock:
            if device.index not in self._streams:
                self._streams[device.index] = torch.cuda.Stream(device=device)
            return self._streams[device.index]

    def record(self, fn: Callable[..., Any], inputs: tuple[torch.Tensor, ...], grad: bool) -> Recording:
        device = inputs[0].device
        here = torch.cuda.current_stream(device)
        side = self._side_stream(device)
        side.wait_stream(here)  # the static inputs were filled on the current stream
        leaves = [x for x in inputs if x.requires_grad]
        try:
            with torch.cuda.device(device), torch.cuda.stream(side), torch.set_grad_enabled(grad):
                for _ in range(self.warmup):
                    outs = as_outputs(fn(*inputs))
                    if grad:
                        _differentiate(outs, leaves, [torch.ones_like(o) if o.requires_grad else None
                                                      for o in outs], retain=False)
                    del outs
                pool = torch.cuda.graph_pool_handle()
                fwd = torch.cuda.CUDAGraph()
                outs = _captured(fwd, pool, lambda: as_outputs(fn(*inputs)))
                if not grad:
                    return Recording(inputs, tuple(o.detach() for o in outs), fwd.replay)
                bwd = torch.cuda.CUDAGraph()
                cts: list[torch.Tensor | None] = []

                def backward() -> tuple[torch.Tensor | None, ...]:
                    cts.extend(torch.empty_like(o) if o.requires_grad else None for o in outs)
                    return _differentiate(outs, leaves, cts, retain=False)

                grads = _captured(bwd, pool, backward)
                return Recording(inputs, tuple(o.detach() for o in outs), fwd.replay, tuple(cts),
                                 _grad_inputs(inputs, grads), bwd.replay)
        finally:
            here.wait_stream(side)


def _captured(graph: Any, pool: Any, thunk: Callable[[], Any]) -> Any:
    """`thunk()` captured into `graph` on the current stream; a failed capture is ended before its error is raised.

    Mode "thread_local": a call CUDA forbids during capture fails on this thread only, so other devices'
    threads of the same process keep running.
    """
    graph.capture_begin(pool=pool, capture_error_mode="thread_local")
    try:
        out = thunk()
    except BaseException:
        try:
            graph.capture_end()
        except Exception:  # noqa: BLE001 - an invalidated capture also fails to end; the first error is the reason
            pass
        raise
    graph.capture_end()
    return out


# ----------------------------------------------------------------------------- the CPU stand-in

_HOST_READS = frozenset({"item", "tolist", "numpy", "cpu", "__bool__", "__int__", "__float__", "__index__",
                         "__complex__", "is_nonzero", "equal", "allclose", "nonzero", "argwhere", "unique",
                         "unique_consecutive", "masked_select", "bincount"})


class _RefuseHostReads(TorchFunctionMode):
    """Raise `CaptureError` where a CUDA capture would fail: a value read on the host, a value-dependent shape."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        masked = name in ("__getitem__", "__setitem__", "index_put_", "index_put") and any(
            isinstance(a, torch.Tensor) and a.dtype == torch.bool
            for a in _flat(args[1:2] if name.startswith("__") else args[1:]))
        if name == "repeat_interleave" and isinstance(args[1] if len(args) > 1 else kwargs.get("repeats"),
                                                      torch.Tensor) and kwargs.get("output_size") is None:
            masked, name = True, "repeat_interleave (tensor repeats, no output_size)"
        if name == "to" and args and isinstance(args[0], torch.Tensor) and args[0].device.type != "cpu" and any(
                torch.device(a).type == "cpu" for a in (*args[1:], kwargs.get("device"))
                if isinstance(a, (str, torch.device))):
            masked, name = True, "to('cpu') (a copy to the host)"
        if name in _HOST_READS or masked:
            what = name if " " in name else f"{name} with a boolean mask" if masked else name
            raise CaptureError(
                f"the stage calls {what}, which reads tensor values on the host or makes a shape that depends on "
                "them; a CUDA graph capture cannot record that")
        return func(*args, **kwargs)


def _flat(xs: Any) -> list[Any]:
    out: list[Any] = []
    for x in xs:
        out.extend(_flat(x) if isinstance(x, (tuple, list)) else [x])
    return out


class FakeCapture:
    """A CPU stand-in for `CudaGraphs` with the same buffers and the same replay rules (for tests).

    Recording runs `fn` once (refusing host reads, as a capture does); a forward replay runs `fn`
    on the static inputs and copies its results into the static outputs, keeping its autograd graph as
    the recording's activations; a backward replay differentiates those activations with the static
    cotangents into the static gradients. XLA's CPU devices, which torch sees as one, share the
    recordings (their calls take turns on each one's lock).
    """

    name = "fake capture"

    def applies(self, t: torch.Tensor) -> bool:
        return True

    def lane(self, t: torch.Tensor) -> Hashable:
        return t.device

    def record(self, fn: Callable[..., Any], inputs: tuple[torch.Tensor, ...], grad: bool) -> Recording:
        with _RefuseHostReads(), torch.set_grad_enabled(grad):
            first = as_outputs(fn(*inputs))
        outputs = tuple(o.detach().clone() for o in first)
        leaves = [x for x in inputs if x.requires_grad]
        live: list[tuple[torch.Tensor, ...]] = [first]

        def forward() -> None:
            with torch.set_grad_enabled(grad):
                res = as_outputs(fn(*inputs))
            with torch.no_grad():
                for s, r in zip(outputs, res):
                    s.copy_(r)
            live[0] = res  # the activations the backward reads

        if not grad:
            return Recording(inputs, outputs, forward)
        cts = tuple(torch.zeros_like(o) if o.requires_grad else None for o in first)
        grads = _grad_inputs(inputs, [None] * len(leaves))

        def backward() -> None:
            got = iter(_differentiate(live[0], leaves, cts, retain=True))
            with torch.no_grad():
                for g in grads:
                    if g is not None:
                        new = next(got)
                        g.copy_(new) if new is not None else g.zero_()

        return Recording(inputs, outputs, forward, cts, grads, backward)
