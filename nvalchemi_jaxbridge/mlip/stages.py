"""A wrapper's stages as torch ops callable from JAX (`kernels.torch_fn`), one op per layer.

Every stage op takes the block graph as four arrays, `positions (rows, 3)`,
`node_attrs (rows, A)`, `edges (E, 2)` int32 (sender, receiver) and `shifts (E, 3)`,
then its own tensors. With per-layer exchange the ops are cut where the exchange
is, between the layers, and nowhere else:

| op | inputs after the graph | outputs |
|---|---|---|
| `first` | - | the edge features (if the wrapper shares some), then layer 0's `h` and energy term |
| `middle[i]` (layer i + 1) | the edge features, then `h` | the new `h`, then the layer's `(rows,)` energy term |
| `last` (layer L - 1) | the edge features, `h`, the summed earlier terms | `(rows,)` node energies |
| `whole` (deep halo; or one layer) | - | `(rows,)` node energies: every stage in one op |

`first` runs the wrapper's `edge_features`, `embed` and layer 0; `last` its last
layer and `node_energies`. Each op costs a fixed amount per evaluation whatever it
holds (two calls into torch, its inputs kept for the backward, an autograd pass),
so MACE's two layers are two ops, not one per stage. The edge features cross from
`first` to the later layers as JAX arrays, so they are computed (and differentiated)
once per evaluation, as in the model's own forward.

The graph's receiver count (`BlockGraph.n_receivers`) is fixed per op set, as a
shape is: `Stages.for_receivers` defines one set per count.

On a GPU each op's body is recorded as CUDA graphs once per set of input shapes and
dtypes (its capacities) and replayed from then on (`kernels.cuda_graphs`; the
`cuda_graphs` option of `Stages.of`); a model that cannot be recorded runs eagerly.
The PyTorch door runs the same bodies as torch functions (`Stages.for_torch`), its
refresh between them (`run_stages` is the loop of both doors).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from ..kernels.cuda_graphs import AUTO_MAX_ROWS, StageGraphs, capture_backend
from ..kernels.torch_fn import torch_function
from . import contract
from .protocol import BlockGraph, MessagePassingWrapper, as_tuple, node_energies_of, with_edge_features
from .replicas import WrapperReplicas
from .torch_device import model_devices, weights


def block_graph(positions: torch.Tensor, node_attrs: torch.Tensor, edges: torch.Tensor,
                shifts: torch.Tensor, n_receivers: int | None = None,
                edge_features: tuple[torch.Tensor, ...] | None = None) -> BlockGraph:
    """The `BlockGraph` of a stage's four graph arrays (edges `(E, 2)` -> `(2, E)` int64, contiguous).

    Contiguous, as a model's own `edge_index` is: gathers and scatters on a strided index
    row leave torch's vectorised kernels (MACE at 10^4 atoms on an H200: +4 ms per E+F).
    """
    return BlockGraph(positions, node_attrs, edges.t().to(torch.int64, memory_format=torch.contiguous_format),
                      shifts, n_receivers, edge_features)


def _n_features(wrapper: MessagePassingWrapper, device: torch.device) -> int:
    """How many tensors `wrapper.embed` returns (probed on a two-row fake block on `device`, checked)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    n_attrs = wrapper.node_attrs(np.zeros(0, dtype=np.int64)).shape[1]
    with FakeTensorMode(allow_non_fake_inputs=True):
        f = {"dtype": wrapper.dtype, "device": device}
        g = BlockGraph(torch.zeros((2, 3), **f), torch.zeros((2, n_attrs), **f),
                       torch.zeros((2, 1), dtype=torch.int64, device=device), torch.ones((1, 3), **f))
        return len(as_tuple(contract.embed(wrapper, g, "shape probe on a two-row block")))


def _n_edge_features(wrapper: MessagePassingWrapper, device: torch.device) -> int:
    """How many per-edge tensors `wrapper.edge_features` returns (0: none), run on a one-edge block.

    A real run on `device` (not fake tensors: TorchScript'ed model code may not run on
    those on a GPU), which also checks that each result is a per-edge tensor.
    """
    n_attrs = wrapper.node_attrs(np.zeros(0, dtype=np.int64)).shape[1]
    f = {"dtype": wrapper.dtype, "device": device}
    g = BlockGraph(torch.tensor([[0.0, 0.0, 0.0], [1.0, 0.5, 0.25]], **f), torch.zeros((2, n_attrs), **f),
                   torch.tensor([[0], [1]], dtype=torch.int64, device=device), torch.zeros((1, 3), **f))
    with torch.no_grad():
        feats = contract.edge_features(wrapper, g, wrapper.edge_features(g), "shape probe on a one-edge block")
    return 0 if feats is None else len(as_tuple(feats))


FIRST_OPS = ("layer_0", "whole")  # the labels of the op an evaluation starts with (it checks the weights)


@dataclasses.dataclass(frozen=True, eq=False)
class StageOps:
    """The stage ops of one wrapper for blocks of one receiver count: JAX callables on local arrays (the JAX
    door), or torch functions of tensors (`stage_functions`, the PyTorch door).

    `first` and `last` are None with one layer (`whole` is the model then); `labels[i]` names layer i's op.
    """

    first: Any
    middle: tuple[Any, ...]
    last: Any
    whole: Any
    n_edge_features: int
    labels: tuple[str, ...] = ()

    def named(self) -> list[tuple[str, Any]]:
        """`(name, op)` of the per-layer ops in program order (`whole` alone with one layer)."""
        if self.first is None:
            return [("whole", self.whole)]
        return [("first", self.first), *((f"layer_{i + 1}", k) for i, k in enumerate(self.middle)),
                ("last", self.last)]


@dataclasses.dataclass(frozen=True, eq=False)
class Stages:
    """The stage ops of one wrapper, one set per receiver count (`BlockGraph.n_receivers`).

    The count is static: it is the owned capacity of a per-layer block (every row with
    the deep halo), so a program asks `for_receivers(t.owned_capacity)` while tracing
    and a layout with the same capacities reuses the same ops.
    """

    wrapper: MessagePassingWrapper
    call_path: str
    n_features: int
    n_edge_features: int
    graphs: StageGraphs | None = None  # recording as CUDA graphs (None: the ops run eagerly)
    _sets: dict[int | None, StageOps] = dataclasses.field(default_factory=dict)
    _torch_sets: dict[int | None, StageOps] = dataclasses.field(default_factory=dict)
    #: the wrapper on each device the stages run on (a copy where its weights live elsewhere: mlip.replicas)
    replicas: WrapperReplicas = dataclasses.field(init=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "replicas", WrapperReplicas(self.wrapper))

    @classmethod
    def of(cls, wrapper: MessagePassingWrapper, *, call_path: str = "auto", device: str = "cpu",
           cuda_graphs: Any = "auto") -> Stages:
        """The stage ops of `wrapper` (they close over its weights).

        `device`: where the ops run ("cpu" or "cuda"); the shape probes run where the model's
        weights are (on `device` if they are on several or none).
        `cuda_graphs`: "auto" (record the ops as CUDA graphs on a GPU), True, False, or a
        capture backend (`kernels.cuda_graphs.capture_backend`).
        """
        dev = torch.device(device)
        backend = capture_backend(cuda_graphs, dev, f"the stages of model {wrapper.name!r}")
        auto = isinstance(cuda_graphs, str) and cuda_graphs == "auto"
        graphs = None if backend is None else StageGraphs(backend, wrapper.name, lambda: weights(wrapper),
                                                          max_rows=AUTO_MAX_ROWS if auto else None)
        homes = model_devices(wrapper)
        probe = next(iter(homes)) if len(homes) == 1 else dev
        return cls(wrapper, call_path, _n_features(wrapper, probe), _n_edge_features(wrapper, probe), graphs)

    def for_receivers(self, n_receivers: int | None) -> StageOps:
        """The ops whose blocks have `n_receivers` receiver rows (None: every row), made once."""
        if n_receivers not in self._sets:
            self._sets[n_receivers] = self._define(n_receivers)
        return self._sets[n_receivers]

    def defined(self) -> list[StageOps]:
        """The op sets made so far (for reports)."""
        return list(self._sets.values())

    def for_torch(self, n_receivers: int | None) -> StageOps:
        """The stages as torch functions of tensors for the PyTorch door (recorded where `graphs` is on), made once."""
        if n_receivers not in self._torch_sets:
            self._torch_sets[n_receivers] = self._functions(n_receivers, "the PyTorch door")
        return self._torch_sets[n_receivers]

    def _functions(self, n_receivers: int | None, door: str) -> StageOps:
        """`stage_functions`, each wrapped by `graphs` (recorded and replayed) where it is on."""
        fns = stage_functions(self.wrapper, self.n_features, self.n_edge_features, n_receivers, door,
                              on=lambda t: self.replicas.on(t.device, check=False))
        if self.graphs is None:
            return fns
        name = self.wrapper.name

        def wrap(fn: Any, label: str) -> Any:  # the first op of an evaluation checks the weights' storage
            return None if fn is None else self.graphs.wrap(fn, f"{name}_{label}", checks_weights=label in FIRST_OPS)

        return dataclasses.replace(fns, first=wrap(fns.first, "layer_0"), last=wrap(fns.last, fns.labels[-1]),
                                   middle=tuple(wrap(f, f"layer_{i + 1}") for i, f in enumerate(fns.middle)),
                                   whole=wrap(fns.whole, "whole"))

    def _define(self, n_receivers: int | None) -> StageOps:
        wrapper, n, n_edge, call_path = self.wrapper, self.n_features, self.n_edge_features, self.call_path
        name, fns, replicas = wrapper.name, self._functions(n_receivers, "the JAX door"), self.replicas

        def op(run, n_in: int, n_out: int, label: str) -> Any:
            record = contract.ShapeRecord(wrapper, f"'{name}_{label}' of the JAX door")
            first_op = label in FIRST_OPS

            def checked(*arrays):
                replicas.on(arrays[0].device, check=first_op)  # outside any recording: copies follow the weights
                out = run(*arrays)
                record.check(arrays, out)
                return out

            return torch_function(checked, n_in, n_out, label=f"{name}_{label}", call_path=call_path)

        staged = fns.first is not None
        return StageOps(
            first=op(fns.first, 4, n_edge + n + 1, "layer_0") if staged else None,
            middle=tuple(op(f, 4 + n_edge + n, n + 1, f"layer_{i + 1}") for i, f in enumerate(fns.middle)),
            last=op(fns.last, 4 + n_edge + n + 1, 1, fns.labels[-1]) if staged else None,
            whole=op(fns.whole, 4, 1, "whole"),
            n_edge_features=n_edge,
            labels=fns.labels,
        )


def stage_functions(wrapper: MessagePassingWrapper, n_features: int, n_edge_features: int,
                    n_receivers: int | None, door: str,
                    on: Callable[[torch.Tensor], MessagePassingWrapper]) -> StageOps:
    """A wrapper's stages as torch functions of tensors (the bodies of the stage ops; see the module docstring).

    Each takes the four graph tensors, then its own (the table above), and returns a tensor or a
    tuple of them; `door` names the caller in the wrapper's errors. `on(t)`: the wrapper to run on
    `t`'s device (`WrapperReplicas.on`).
    """
    n, n_edge = n_features, n_edge_features
    name, n_layers = wrapper.name, wrapper.n_layers

    def graph(pos, attrs, edges, shifts, edge_features=None) -> BlockGraph:
        return block_graph(pos, attrs, edges, shifts, n_receivers, edge_features)

    def stage(label: str) -> str:
        return f"'{name}_{label}' of {door}"

    def layer(i: int, g: BlockGraph, h: tuple[Any, ...], where: str) -> tuple[tuple[Any, ...], Any]:
        h_new, e = contract.interaction(on(g.positions), i, g, h if n > 1 else h[0], where, n)
        return as_tuple(h_new), e

    def first(*arrays):
        where, w = stage("layer_0"), on(arrays[0])
        g = with_edge_features(w, graph(*arrays), where)
        h, e = layer(0, g, as_tuple(contract.embed(w, g, where)), where)
        return (*(g.edge_features or ()), *h, e)

    def middle(i: int):
        def fn(pos, attrs, edges, shifts, *rest):
            ef, h = rest[:n_edge], rest[n_edge:]
            h, e = layer(i, graph(pos, attrs, edges, shifts, ef if n_edge else None), h, stage(f"layer_{i}"))
            return (*h, e)
        return fn

    def last(pos, attrs, edges, shifts, *rest):
        ef, h, earlier = rest[:n_edge], rest[n_edge:-1], rest[-1]
        g = graph(pos, attrs, edges, shifts, ef if n_edge else None)
        where = stage(f"layer_{n_layers - 1}")
        _, e = layer(n_layers - 1, g, h, where)
        return contract.node_energies(on(pos), g, earlier + e, where)

    def whole(*arrays):
        return node_energies_of(on(arrays[0]), graph(*arrays), stage("whole"))

    staged = n_layers > 1
    return StageOps(first=first if staged else None, middle=tuple(middle(i) for i in range(1, n_layers - 1)),
                    last=last if staged else None, whole=whole, n_edge_features=n_edge,
                    labels=tuple(f"layer_{i}" for i in range(n_layers)))


def run_stages(ops: StageOps, graph: tuple[Any, ...], between: Callable[[Any], Any], *, whole: bool = False) -> Any:
    """Node energies of the block `graph` through `ops`: per layer, with `between` (the refresh of one node feature)
    applied to the features between layers; or `ops.whole` alone (`whole`, or one layer).

    The loop both doors run: the JAX door on stage ops, `between` an XLA exchange; the PyTorch door on
    torch functions, `between` the front door's refresh.
    """
    if whole or ops.first is None:
        return ops.whole(*graph)
    out = ops.first(*graph)  # edge features (once, for every layer), layer 0's h and energy term
    n_ef = ops.n_edge_features
    ef, h, acc = tuple(out[:n_ef]), tuple(out[n_ef:-1]), out[-1]
    for op in ops.middle:
        out = op(*graph, *ef, *(between(x) for x in h))
        h, acc = tuple(out[:-1]), acc + out[-1]
    return ops.last(*graph, *ef, *(between(x) for x in h), acc)
