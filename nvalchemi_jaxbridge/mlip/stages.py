"""A wrapper's stages as torch ops callable from JAX (`kernels.torch_fn`), one op per stage.

Every stage op takes the block graph as four arrays, `positions (rows, 3)`,
`node_attrs (rows, A)`, `edges (E, 2)` int32 (sender, receiver) and `shifts (E, 3)`,
then the stage's own node tensors:

| stage | inputs after the graph | outputs |
|---|---|---|
| `edges` (if the wrapper shares edge features) | - | the wrapper's `edge_features`, per-edge tensors |
| `embed` | - | the node features `h` (one tensor or several) |
| `interaction[i]` | the edge features (if any), then `h` | the new `h`, then the layer's `(rows,)` energy term |
| `readout` | the summed energy terms `(rows,)` | `(rows,)` node energies |
| `whole` (deep halo) | - | `(rows,)` node energies: every stage in one op, no exchange |

The edge features cross from one op to the next as JAX arrays, so they are
computed (and differentiated) once per evaluation, as in the model's own forward,
instead of once per layer.

The graph's receiver count (`BlockGraph.n_receivers`) is fixed per op set, as a
shape is: `Stages.for_receivers` defines one set per count.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch

from ..kernels.torch_fn import torch_function
from .protocol import BlockGraph, MessagePassingWrapper, as_tuple, node_energies_of


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
    """How many tensors `wrapper.embed` returns (probed on a two-row fake block on `device`)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    n_attrs = wrapper.node_attrs(np.zeros(0, dtype=np.int64)).shape[1]
    with FakeTensorMode(allow_non_fake_inputs=True):
        f = {"dtype": wrapper.dtype, "device": device}
        g = BlockGraph(torch.zeros((2, 3), **f), torch.zeros((2, n_attrs), **f),
                       torch.zeros((2, 1), dtype=torch.int64, device=device), torch.ones((1, 3), **f))
        return len(as_tuple(wrapper.embed(g)))


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
        feats = wrapper.edge_features(g)
    if feats is None:
        return 0
    feats = tuple(feats) if isinstance(feats, (tuple, list)) else (feats,)
    bad = [k for k, t in enumerate(feats) if not isinstance(t, torch.Tensor) or t.ndim < 1 or t.shape[0] != 1]
    if not feats or bad:
        raise TypeError(
            f"{wrapper.name}: edge_features must return a non-empty tuple of per-edge tensors (E, ...) or None; "
            f"on a one-edge block its results {bad} are not (E, ...) tensors. Return only tensors with one row "
            "per edge (move node-wise work into the layers)."
        )
    return len(feats)


@dataclasses.dataclass(frozen=True, eq=False)
class StageOps:
    """The stage ops of one wrapper for blocks of one receiver count (JAX callables on local arrays)."""

    edges: Any  # None: the wrapper shares no edge features
    embed: Any
    interactions: tuple[Any, ...]
    readout: Any
    whole: Any

    def named(self) -> list[tuple[str, Any]]:
        """`(name, op)` of the staged ops in program order (`whole` left out)."""
        first = [] if self.edges is None else [("edges", self.edges)]
        return [*first, ("embed", self.embed), *((f"interaction_{i}", k) for i, k in enumerate(self.interactions)),
                ("readout", self.readout)]

    def edge_features(self, *graph: Any) -> tuple[Any, ...]:
        """The `edges` op's results on the four graph arrays, as a tuple (empty without the op)."""
        return () if self.edges is None else as_tuple(self.edges(*graph))


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
    _sets: dict[int | None, StageOps] = dataclasses.field(default_factory=dict)

    @classmethod
    def of(cls, wrapper: MessagePassingWrapper, *, call_path: str = "auto", device: str = "cpu") -> Stages:
        """The stage ops of `wrapper` (they close over its weights).

        `device`: where the model's weights live ("cpu" or "cuda"), for the shape probes.
        """
        dev = torch.device(device)
        return cls(wrapper, call_path, _n_features(wrapper, dev), _n_edge_features(wrapper, dev))

    def for_receivers(self, n_receivers: int | None) -> StageOps:
        """The ops whose blocks have `n_receivers` receiver rows (None: every row), made once."""
        if n_receivers not in self._sets:
            self._sets[n_receivers] = self._define(n_receivers)
        return self._sets[n_receivers]

    def defined(self) -> list[StageOps]:
        """The op sets made so far (for reports)."""
        return list(self._sets.values())

    def _define(self, n_receivers: int | None) -> StageOps:
        wrapper, n, n_edge, call_path = self.wrapper, self.n_features, self.n_edge_features, self.call_path
        name = wrapper.name

        def graph(pos, attrs, edges, shifts, edge_features=None) -> BlockGraph:
            return block_graph(pos, attrs, edges, shifts, n_receivers, edge_features)

        def edge_features(*g):
            return tuple(as_tuple(wrapper.edge_features(graph(*g))))

        def embed(*g):
            return as_tuple(wrapper.embed(graph(*g)))

        def interaction(i: int):
            def fn(pos, attrs, edges, shifts, *rest):
                ef, h = rest[:n_edge], rest[n_edge:]
                g = graph(pos, attrs, edges, shifts, ef if n_edge else None)
                h_new, e = wrapper.interaction(i, g, h if n > 1 else h[0])
                return (*as_tuple(h_new), e)
            return fn

        def readout(pos, attrs, edges, shifts, e_sum):
            return wrapper.node_energies(graph(pos, attrs, edges, shifts), e_sum)

        def whole(*g):
            return node_energies_of(wrapper, graph(*g))

        return StageOps(
            edges=torch_function(edge_features, 4, n_edge, label=f"{name}_edges", call_path=call_path)
            if n_edge else None,
            embed=torch_function(embed, 4, n, label=f"{name}_embed", call_path=call_path),
            interactions=tuple(
                torch_function(interaction(i), 4 + n_edge + n, n + 1, label=f"{name}_interaction_{i}",
                               call_path=call_path)
                for i in range(wrapper.n_layers)),
            readout=torch_function(readout, 5, 1, label=f"{name}_readout", call_path=call_path),
            whole=torch_function(whole, 4, 1, label=f"{name}_whole", call_path=call_path),
        )
