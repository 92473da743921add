"""The torch ops of the JAX front door's ML-IAP program: one model run, cut at its exchanges.

`SegmentOps.for_block(rows, pairs)` defines, for blocks of `rows` halo rows and `pairs` pair
slots, the ops of the model's exchange schedule (`MLIAPModel.schedule`, k exchanges):

| op | inputs | output |
|---|---|---|
| `first` | `meta (3,)` int32 `[device, nlocal, ntotal]`, `rij (pairs, 3)`, `edges (pairs, 2)` (sender, receiver), `keep (pairs,)` int32, `types (rows,)` int32 | `src` of exchange 1 `(rows, n_1)`, or the results |
| `rest[s]` | `meta`, `dst` of exchange s+1 `(rows, n_{s+1})` | `src` of exchange s+2, or the results |

The results are `eatoms (rows,)`, `fij (pairs, 3)` (zero on left-out pairs) and `energy (1,)`, float64.

`first` starts the model's `compute_forces(data)` in a worker thread of its device
(`_Run`); the worker's `data.forward_exchange` / `reverse_exchange` hand `src` to the
op that is waiting for it and wait for the next op to bring `dst`. The ops of one
device run one after another in the device's program, so at most one run per device
is in flight; a run left behind by a failed evaluation is cancelled by the next `first`.
On a GPU the worker runs on the stream of the op that resumed it.
"""

from __future__ import annotations

import copy
import itertools
import queue
import threading
from typing import Any

import torch

from ..kernels.torch_op import TorchOpKernel
from .mliap import MLIAPModel, check_schedule
from .mliap_data import BlockData, MLIAPError
from .mliap_kokkos import block_data

_NAMESPACE = "jaxbridge_mliap"
_COUNTER = itertools.count()


class _Cancelled(BaseException):
    """Raised inside a worker whose run was abandoned (not an error of the model)."""


class _Run:
    """One `compute_forces` in a worker thread, stopped at each exchange."""

    def __init__(self, model: MLIAPModel, obj: Any, data: BlockData, rows: int) -> None:
        self.model, self.obj, self.data, self.rows = model, obj, data, rows
        self.inbox: queue.Queue = queue.Queue(maxsize=1)
        self.outbox: queue.Queue = queue.Queue(maxsize=1)
        self.done = False
        data._exchange = self._exchange
        self.thread = threading.Thread(target=self._main, name=f"mliap-{model.name}", daemon=True)
        self.start_stream: Any = None

    def _main(self) -> None:
        if self.start_stream is not None:
            torch.cuda.set_stream(self.start_stream)
        try:
            self.model.compute(self.data, self.obj)
            self.outbox.put(("done", None))
        except _Cancelled:
            pass
        except BaseException as e:  # handed to the op, which raises it in the program
            self.outbox.put(("error", e))

    def _exchange(self, kind: str, src: torch.Tensor) -> torch.Tensor:
        self.outbox.put(("exchange", (kind, src)))
        what, value = self.inbox.get()
        if what == "cancel":
            raise _Cancelled("the evaluation this model run belonged to was abandoned")
        stream, dst = value
        if stream is not None:
            torch.cuda.set_stream(stream)
        return dst

    def cancel(self) -> None:
        if not self.done and self.thread.is_alive():
            self.inbox.put(("cancel", None))

    def advance(self, dst: torch.Tensor | None) -> tuple[str, Any]:
        """Start (no `dst`) or resume the run; wait until it exchanges again or ends."""
        if self.done:
            return "done", None
        stream = torch.cuda.current_stream() if self.data.fij.is_cuda else None
        if dst is None:
            self.start_stream = stream
            self.thread.start()
        else:
            self.inbox.put(("dst", (stream, dst[: self.data.ntotal])))
        what, value = self.outbox.get()
        if what == "error":
            self.done = True
            raise value
        if what == "done":
            self.done = True
        return what, value


class SegmentOps:
    """The segment ops of one model, one set per block shape (rows, pair slots)."""

    def __init__(self, model: MLIAPModel, *, call_path: str = "auto") -> None:
        self.model, self.call_path = model, call_path
        self._sets: dict[tuple, Any] = {}
        self._runs: dict[int, _Run] = {}
        self._objs: dict[int, Any] = {}
        self._libs: list[Any] = []

    def model_for(self, device: int) -> Any:
        """The model object device `device` runs: a copy of its own (made on first use).

        The devices' runs are concurrent threads of one process, where LAMMPS gives each rank its own
        object: a model may keep state between calls or settle its device on its first call (MACE moves
        itself to the device of the first data it sees), so one object must not serve several devices.
        """
        if device not in self._objs:
            self._objs[device] = copy.deepcopy(self.model.obj)
        return self._objs[device]

    def for_block(self, rows: int, pairs: int) -> Any:
        """The ops for blocks of `rows` rows and `pairs` pair slots (made once per shape and schedule)."""
        schedule = self.model.schedule
        key = (rows, pairs, schedule)
        if key not in self._sets:
            self._sets[key] = self._define(rows, pairs, schedule)
        return self._sets[key]

    # ------------------------------------------------------------------ op bodies

    def _start(self, meta: torch.Tensor, rij: torch.Tensor, edges: torch.Tensor, keep: torch.Tensor,
               types: torch.Tensor, rows: int) -> _Run:
        dev, n_own, n_real = (int(v) for v in meta.cpu())
        old = self._runs.pop(dev, None)
        if old is not None:
            old.cancel()
        k = keep.to(torch.bool)
        e = edges.to(torch.int64)
        data = block_data(rij[k], e[k, 1], e[k, 0], types[:n_real], n_own, model=self.model.name,
                          exchange=lambda kind, src: src)
        data._keep = k
        run = self._runs[dev] = _Run(self.model, self.model_for(dev), data, rows)
        return run

    def _output(self, run: _Run, index: int, what: str, value: Any) -> Any:
        """The op's result: the next exchange's `src` padded to the block's rows, zeros after an early end,
        or the results after the last exchange."""
        schedule = self.model.schedule
        data = run.data
        if index < len(schedule):
            step = schedule[index]
            if what == "exchange":
                kind, src = value
                self._check(run, data.exchanges + [(kind, int(src.shape[1]))])
                out = src.to(step.dtype).reshape(data.ntotal, step.width)
                return torch.cat([out, out.new_zeros((run.rows - data.ntotal, step.width))])
            return torch.zeros((run.rows, step.width), dtype=step.dtype, device=data.fij.device)
        if what == "exchange":
            self._check(run, data.exchanges + [(value[0], int(value[1].shape[1]))])
        data.check_energy_written()
        self._runs.pop(int(data._device_key), None)
        dev = data.fij.device
        eatoms = torch.zeros(run.rows, dtype=torch.float64, device=dev)
        eatoms[: data.nlocal] = data.eatoms_tensor
        fij = torch.zeros((data._keep.shape[0], 3), dtype=torch.float64, device=dev)
        fij[data._keep] = data.fij
        return eatoms, fij, torch.tensor([data.energy], dtype=torch.float64, device=dev)

    def _check(self, run: _Run, exchanges: list[tuple[str, int]]) -> None:
        """`check_schedule`, cancelling the run (left waiting in its exchange) when it fails."""
        try:
            check_schedule(self.model.name, exchanges, self.model.schedule)
        except MLIAPError:
            run.cancel()
            self._runs.pop(int(run.data._device_key), None)
            raise

    def _define(self, rows: int, pairs: int, schedule: Any) -> Any:
        import types as pytypes

        n = len(schedule)

        def first(meta, rij, edges, keep, types):
            run = self._start(meta, rij, edges, keep, types, rows)
            run.data._device_key = int(meta[0])
            return self._output(run, 0, *run.advance(None))

        def rest(index: int):
            def fn(meta, dst):
                run = self._runs.get(int(meta[0]))
                if run is None:
                    raise MLIAPError(f"{self.model.name}: no model run in flight on device {int(meta[0])}.")
                if run.done:
                    return self._output(run, index, "done", None)
                data = run.data
                return self._output(run, index, *run.advance(dst.to(data.fij.device)))
            return fn

        def spec(index: int) -> tuple[list[tuple[tuple[int, ...], torch.dtype]], bool]:
            if index < n:
                return [((rows, schedule[index].width), schedule[index].dtype)], False
            return [((rows,), torch.float64), ((pairs, 3), torch.float64), ((1,), torch.float64)], True

        ops = [self._op("first", first, "Tensor meta, Tensor rij, Tensor edges, Tensor keep, Tensor types",
                        *spec(0))]
        for s in range(n):
            ops.append(self._op(f"exchange_{s + 1}", rest(s + 1), "Tensor meta, Tensor dst", *spec(s + 1)))
        return pytypes.SimpleNamespace(first=ops[0], rest=tuple(ops[1:]))

    def _op(self, label: str, body: Any, args: str, outs: list, several: bool) -> TorchOpKernel:
        name = f"{self.model.name[:24]}_{label}_{next(_COUNTER)}".replace(".", "_")
        rets = "(" + ", ".join(["Tensor"] * len(outs)) + ")" if several else "Tensor"
        lib = torch.library.Library(_NAMESPACE, "FRAGMENT")
        lib.define(f"{name}({args}) -> {rets}")
        lib.impl(name, body, "CompositeExplicitAutograd")

        def fake(*tensors):
            like = tensors[0]
            made = [like.new_empty(shape, dtype=dtype) for shape, dtype in outs]
            return tuple(made) if several else made[0]

        torch.library.register_fake(f"{_NAMESPACE}::{name}", fake, lib=lib)
        self._libs.append(lib)
        return TorchOpKernel(getattr(getattr(torch.ops, _NAMESPACE), name).default, call_path=self.call_path,
                             check_grad=False)
