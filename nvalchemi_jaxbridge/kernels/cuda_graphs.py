"""Stage ops replayed as CUDA graphs: a torch function recorded once per signature, then replayed.

A model's stages (`mlip.stages`) take blocks of static capacities, so at given
capacities every call launches the same kernels, and on a GPU small systems are
bound by the host's launching them (issue 31). `StageGraphs.wrap(fn)` records
`fn` once per *signature* (the backend's lane, a device; whether autograd
records the call; each input's shape, dtype and requires_grad), with the
backends of `capture_backends`, and replays it from then on; a capacity growth
or a new dtype is a new signature, recorded in turn.

Buffers: a call's tensors are copied into the recording's static inputs, the
replay writes the static outputs, and the call returns copies of them, all under
the recording's lock (so callers on several threads, such as XLA's CPU devices
sharing torch's one CPU device, never read another call's results; on a GPU the
copies are queued on the same stream as the replay). Under autograd one node
(`_Replay`) replays the forward; its backward copies the cotangents into the
static ones, replays the recorded backward and returns copies of the static
gradients.
That backward reads the activations of the last forward replay: where another
forward of the same recording ran in between (two `jax.vjp` calls, then their
pullbacks), a generation count sees it, and that backward runs eagerly on its
saved inputs instead (same numbers; `StageGraphs.eager_backwards` counts them).
A recording reads the model's weights where they were at capture: changed in
place (`load_state_dict`, an optimiser step) they are seen; a parameter or
buffer whose storage moved (`param.data = ...`, `model.to(...)`) makes every
stage record again (the op wrapped with `checks_weights`, the first of each
evaluation, compares the storages: one pointer per tensor per evaluation).
Replacing a module's parameter by a new object is not seen: build a new
`DistributedMLIP` then.

Capture checks itself: after recording, one replay (forward, and backward with
a fixed cotangent) is compared with an eager run on the same inputs. Anything
that fails (a host synchronisation inside the model, a value-dependent shape, a
capture error, a replay that differs) turns recording off for that model with
one logged line (WARNING, logger `nvalchemi_jaxbridge.kernels.cuda_graphs`),
and its stages run eagerly from then on: the same numbers, more host time.
Shape probes run eagerly (`eager()`: zero-filled inputs and fake tensors are
never recorded).
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from .capture_backends import CaptureBackend, CaptureError, CudaGraphs, FakeCapture, Recording, as_outputs

__all__ = ["CaptureBackend", "CaptureError", "CudaGraphs", "FakeCapture", "GraphedFunction", "Recording",
           "StageGraphs", "capture_backend", "default_backend", "eager"]

_log = logging.getLogger(__name__)

OPTIONS = ("auto", True, False)
KEEP = 3  # recordings kept per function, lane and mode: the current capacities and two before
AUTO_MAX_ROWS = 4096
"""`cuda_graphs="auto"` records blocks of at most this many rows. Measured on one H200 (MACE E+F, float32):
1.6x faster with graphs at 1,372 atoms, the same speed at 10,976 (the GPU is busy the whole call), where a
recording's memory pool, as large as the call's intermediates (19 GiB), would double the model's memory."""
_CAPTURE = threading.Lock()  # one capture at a time in the process (torch's rule for CUDA graphs)
_EAGER: contextvars.ContextVar[bool] = contextvars.ContextVar("jaxbridge_graphs_eager", default=False)


@contextlib.contextmanager
def eager() -> Iterator[None]:
    """Inside: graphed functions run eagerly and record nothing (shape probes, fake tensors)."""
    token = _EAGER.set(True)
    try:
        yield
    finally:
        _EAGER.reset(token)


def default_backend(device: torch.device) -> CaptureBackend | None:
    """What `cuda_graphs="auto"` records with on `device`: CUDA graphs on a CUDA (or ROCm) GPU, nothing elsewhere."""
    return CudaGraphs() if torch.device(device).type == "cuda" else None


def capture_backend(option: Any, device: torch.device, where: str) -> CaptureBackend | None:
    """The backend of a `cuda_graphs=` option on `device` (None: stages run eagerly).

    Args:
        option: "auto" (CUDA graphs on a GPU, eager elsewhere), True (CUDA graphs; a GPU is required),
            False (eager), or a backend object (`FakeCapture()` in tests).
        device: the torch device of the model's stages.
        where: the caller, for the error.

    Raises:
        ValueError: an unknown option, or True on a device without CUDA graphs.
    """
    if hasattr(option, "record") and hasattr(option, "lane"):
        return option
    if option is False:
        return None
    if isinstance(option, str) and option == "auto":
        return default_backend(device)
    if option is True:
        backend = default_backend(device)
        if backend is None:
            raise ValueError(
                f"{where}: cuda_graphs=True but the model's stages run on {str(torch.device(device))!r}, where there "
                "are no CUDA graphs; pass cuda_graphs=\"auto\" (on where a GPU runs the model) or False."
            )
        return backend
    raise ValueError(f"{where}: cuda_graphs must be \"auto\", True or False, got {option!r}.")


class StageGraphs:
    """Recording for the stage ops of one model: one backend, one on/off switch, counts for reports and tests.

    Args:
        backend: how to record and replay (`CudaGraphs`, `FakeCapture`).
        model: the model's name, for the log line.
        weights: the model's parameters and buffers (read at the first call, and again where storage moved).

        max_rows: blocks of more rows (the first input's) run eagerly, unrecorded (None: no limit).

    Attributes:
        off: None while recording is on, else why it was turned off (logged once).
        captures: recordings made; replays: calls served by a replay; eager_backwards: backwards that ran
            eagerly because another forward replayed their recording first.
    """

    def __init__(self, backend: CaptureBackend, model: str,
                 weights: Callable[[], Sequence[torch.Tensor]] = tuple, max_rows: int | None = None) -> None:
        self.backend, self.model, self.weights = backend, model, weights
        self.max_rows = max_rows  # blocks of more rows run eagerly (cuda_graphs="auto": AUTO_MAX_ROWS)
        self.off: str | None = None
        self.captures = self.replays = self.eager_backwards = 0
        self.epoch = 0  # recordings of an older epoch were made with weights whose storage has moved since
        self._held: list[torch.Tensor] | None = None
        self._pointers: list[int] = []
        self._count = threading.Lock()

    def wrap(self, fn: Callable[..., Any], name: str, *, checks_weights: bool = False) -> GraphedFunction:
        """`fn` (tensors -> a tensor or a tuple of them) recorded and replayed by this model's switch.

        `checks_weights`: this function is the first of each evaluation, and compares the weights'
        storage with the recordings' before it runs.
        """
        return GraphedFunction(fn, name, self, checks_weights)

    def check_weights(self) -> None:
        """Start a new epoch (every function records again) where a weight's storage moved since the last look."""
        with self._count:
            if self._held is not None and [w.data_ptr() for w in self._held] == self._pointers:
                return
            moved = self._held is not None
            self._held = list(self.weights())  # held: their storage is not reused while recordings read it
            self._pointers = [w.data_ptr() for w in self._held]
            self.epoch += moved

    def turn_off(self, name: str, inputs: Sequence[torch.Tensor], e: BaseException) -> None:
        """Record nothing more for this model, with one log line saying why (the first failure only)."""
        with self._count:
            if self.off is not None:
                return
            reason = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"[:400]
            self.off = f"stage {name}: {reason}"
        shapes = ", ".join(f"{tuple(t.shape)} {str(t.dtype).replace('torch.', '')}" for t in inputs)
        _log.warning("%s off for model %r: stage %s on %s (inputs %s) could not be recorded: %s; its stages run "
                     "eagerly from now on (same numbers, more host time per call).", self.backend.name, self.model,
                     name, inputs[0].device if inputs else "?", shapes, reason)

    def _add(self, field: str) -> None:
        with self._count:
            setattr(self, field, getattr(self, field) + 1)


class _Entry:
    """One recording in use: its buffers, replay generation, and the weights' epoch it was recorded in."""

    def __init__(self, fn: Callable[..., Any], rec: Recording, epoch: int) -> None:
        self.fn, self.rec, self.epoch = fn, rec, epoch
        self.copy_in = tuple(x.detach() for x in rec.inputs)  # writes into a leaf without autograd's objection
        self.leaves = tuple(x.requires_grad for x in rec.inputs)
        self.generation = 0
        self.lock = threading.Lock()

    def forward(self, ts: Sequence[torch.Tensor]) -> tuple[int, tuple[torch.Tensor, ...]]:
        """Copy `ts` in, replay the forward, copy the outputs out; returns this replay's generation and them."""
        with self.lock, torch.no_grad():
            for s, t in zip(self.copy_in, ts):
                s.copy_(t)
            self.rec.forward()
            self.generation += 1
            return self.generation, tuple(o.clone() for o in self.rec.outputs)

    def backward(self, generation: int, cotangents: Sequence[torch.Tensor | None]
                 ) -> tuple[torch.Tensor | None, ...] | None:
        """The input gradients for `cotangents` (copies), or None when a later forward replayed over the activations."""
        with self.lock, torch.no_grad():
            if generation != self.generation:
                return None
            for s, c in zip(self.rec.grad_outputs, cotangents):
                if s is not None:
                    s.copy_(c) if c is not None else s.zero_()
            self.rec.backward()
            return tuple(None if g is None else g.clone() for g in self.rec.grad_inputs)

    def eager_backward(self, saved: Sequence[torch.Tensor], cotangents: Sequence[torch.Tensor | None]
                       ) -> tuple[torch.Tensor | None, ...]:
        """The same gradients by running `fn` eagerly under autograd on the saved inputs."""
        with torch.enable_grad():
            xs = [t.detach().requires_grad_(leaf) for t, leaf in zip(saved, self.leaves)]
            outs = as_outputs(self.fn(*xs))
            pairs = [(o, c) for o, c in zip(outs, cotangents) if c is not None and o.requires_grad]
            leaves = [x for x in xs if x.requires_grad]
            got = iter(torch.autograd.grad([o for o, _ in pairs], leaves, [c for _, c in pairs], allow_unused=True)
                       if pairs else [None] * len(leaves))
        return tuple(next(got) if leaf else None for leaf in self.leaves)


class _Replay(torch.autograd.Function):
    """One autograd node per differentiated call: the forward replayed, and the recorded backward."""

    @staticmethod
    def forward(ctx: Any, entry: _Entry, graphs: StageGraphs, *ts: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.entry, ctx.graphs = entry, graphs
        ctx.generation, outs = entry.forward(ts)
        ctx.save_for_backward(*ts)  # for an eager backward, where the activations were replayed over
        ctx.mark_non_differentiable(*(o for o, c in zip(outs, entry.rec.grad_outputs) if c is None))
        return outs

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, *cotangents: torch.Tensor | None) -> tuple[Any, ...]:
        entry = ctx.entry
        grads = entry.backward(ctx.generation, cotangents)
        if grads is None:
            ctx.graphs._add("eager_backwards")
            grads = entry.eager_backward(ctx.saved_tensors, cotangents)
        return (None, None, *grads)


class GraphedFunction:
    """`fn` recorded once per signature and replayed (see the module docstring); eager where nothing applies."""

    def __init__(self, fn: Callable[..., Any], name: str, graphs: StageGraphs, checks_weights: bool = False) -> None:
        self.fn, self.name, self.graphs, self.checks_weights = fn, name, graphs, checks_weights
        self._entries: collections.OrderedDict[tuple, _Entry] = collections.OrderedDict()
        self._single: bool | None = None  # whether fn returns one tensor, not a tuple

    def __call__(self, *ts: torch.Tensor) -> Any:
        g = self.graphs
        if g.off is not None or _EAGER.get() or not ts or not g.backend.applies(ts[0]) or _is_fake(ts[0]):
            return self.fn(*ts)
        if g.max_rows is not None and ts[0].ndim and ts[0].shape[0] > g.max_rows:  # device-bound: eager
            return self.fn(*ts)
        if self.checks_weights or g._held is None:
            g.check_weights()
        grad = torch.is_grad_enabled() and any(t.requires_grad for t in ts)
        key = (g.backend.lane(ts[0]), grad, tuple((t.shape, t.dtype, grad and t.requires_grad) for t in ts))
        entry = self._entries.get(key)
        if entry is None or entry.epoch != g.epoch:
            entry = self._record(key, ts, grad)
            if entry is None:
                return self.fn(*ts)
        g._add("replays")
        if grad:
            outs = _Replay.apply(entry, g, *ts)
        else:
            outs = entry.forward(ts)[1]
        return outs[0] if self._single else tuple(outs)

    def _record(self, key: tuple, ts: Sequence[torch.Tensor], grad: bool) -> _Entry | None:
        """A checked recording for `key` (kept), or None with recording turned off for the model."""
        g = self.graphs
        with _CAPTURE:
            entry = self._entries.get(key)
            if entry is not None and entry.epoch == g.epoch:
                return entry
            if g.off is not None:
                return None
            try:
                with torch.no_grad():
                    inputs = tuple(t.detach().clone(memory_format=torch.contiguous_format) for t in ts)
                for x, t in zip(inputs, ts):
                    x.requires_grad_(grad and t.requires_grad)
                epoch = g.epoch
                rec = g.backend.record(self.fn, inputs, grad)
                self._single = _check_replay(self.fn, rec, grad)
            except Exception as e:  # noqa: BLE001 - any failure means: eager, with the reason logged once
                g.turn_off(self.name, ts, e)
                return None
            old = self._entries.pop(key, None)
            self._entries[key] = _Entry(self.fn, rec, epoch)
            same = [k for k in self._entries if k[:2] == key[:2]]
            for k in same[:-KEEP]:
                del self._entries[k]
            del old  # a recording still referenced by a pending backward lives until that backward
            g._add("captures")
            return self._entries[key]


def _is_fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


def _tolerance(t: torch.Tensor) -> float:
    return 1024 * torch.finfo(t.dtype).eps if t.is_floating_point() or t.is_complex() else 0.0


def _same(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Raise `CaptureError` unless `got` is `want` (floats: within 1024 eps of the largest value)."""
    if got.shape != want.shape or got.dtype != want.dtype:
        raise CaptureError(f"the replayed {what} is {tuple(got.shape)} {got.dtype}, eagerly "
                           f"{tuple(want.shape)} {want.dtype}")
    if not (got.is_floating_point() or got.is_complex()):
        if not torch.equal(got, want):
            raise CaptureError(f"the replayed {what} differs from an eager run on the same inputs")
        return
    tol = _tolerance(want)
    scale = float(want.detach().abs().nan_to_num(0.0, 0.0, 0.0).max()) if want.numel() else 0.0
    if not torch.allclose(got, want, rtol=tol, atol=tol * max(scale, 1e-30), equal_nan=True):
        err = float((got - want).abs().nan_to_num(float("inf")).max())
        raise CaptureError(f"the replayed {what} differs from an eager run on the same inputs by up to {err:.3g} "
                           f"(largest value {scale:.3g})")


def _probe_cotangent(t: torch.Tensor) -> torch.Tensor:
    """A fixed, non-constant cotangent shaped like `t` (no random state touched)."""
    return torch.cos(0.7 * torch.arange(t.numel(), device=t.device, dtype=t.dtype)).reshape(t.shape)


def _check_replay(fn: Callable[..., Any], rec: Recording, grad: bool) -> bool:
    """Replay `rec` once against an eager run of `fn` on the same inputs (and gradients); whether fn returns one tensor.

    Raises:
        CaptureError: the replay differs, or the recording's differentiable outputs are not eager's.
    """
    with torch.set_grad_enabled(grad):
        xs = [x.detach().clone().requires_grad_(x.requires_grad) for x in rec.inputs]
        out = fn(*xs)
        want = as_outputs(out)
        leaves = [x for x in xs if x.requires_grad]
        if grad:
            if [o.requires_grad for o in want] != [c is not None for c in rec.grad_outputs]:
                raise CaptureError("the recording's differentiable outputs are not those of an eager run")
            cts = [_probe_cotangent(o) if o.requires_grad else None for o in want]
            pairs = [(o, c) for o, c in zip(want, cts) if c is not None]
            want_grads = torch.autograd.grad([o for o, _ in pairs], leaves, [c for _, c in pairs],
                                             allow_unused=True) if pairs else [None] * len(leaves)
    rec.forward()
    if len(rec.outputs) != len(want):
        raise CaptureError(f"the replay gives {len(rec.outputs)} outputs, an eager run {len(want)}")
    for j, (o, w) in enumerate(zip(rec.outputs, want)):
        _same(o, w.detach(), f"output {j}")
    if grad:
        with torch.no_grad():
            for s, c in zip(rec.grad_outputs, cts):
                if s is not None:
                    s.copy_(c)
        rec.backward()
        got = [g for g in rec.grad_inputs if g is not None]
        for k, (g, w) in enumerate(zip(got, want_grads)):
            _same(g, torch.zeros_like(g) if w is None else w, f"gradient of differentiated input {k}")
    return not isinstance(out, (tuple, list))
