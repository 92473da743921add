"""A wrapper's stages as torch ops callable from JAX (`kernels.torch_fn`), one op per stage.

Every stage op takes the block graph as four arrays, `positions (rows, 3)`,
`node_attrs (rows, A)`, `edges (E, 2)` int32 (sender, receiver) and `shifts (E, 3)`,
then the stage's own node tensors:

| stage | inputs after the graph | outputs |
|---|---|---|
| `embed` | - | the node features `h` (one tensor or several) |
| `interaction[i]` | `h` | the new `h`, then the layer's `(rows,)` energy term |
| `readout` | the summed energy terms `(rows,)` | `(rows,)` node energies |
| `whole` (deep halo) | - | `(rows,)` node energies: every stage in one op, no exchange |
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch

from ..kernels.torch_fn import torch_function
from .protocol import BlockGraph, MessagePassingWrapper, as_tuple, node_energies_of


def block_graph(positions: torch.Tensor, node_attrs: torch.Tensor, edges: torch.Tensor,
                shifts: torch.Tensor) -> BlockGraph:
    """The `BlockGraph` of a stage's four graph arrays (edges `(E, 2)` -> `(2, E)` int64)."""
    return BlockGraph(positions, node_attrs, edges.to(torch.int64).t(), shifts)


def _n_features(wrapper: MessagePassingWrapper, device: torch.device) -> int:
    """How many tensors `wrapper.embed` returns (probed on a two-row fake block on `device`)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    n_attrs = wrapper.node_attrs(np.zeros(0, dtype=np.int64)).shape[1]
    with FakeTensorMode(allow_non_fake_inputs=True):
        f = {"dtype": wrapper.dtype, "device": device}
        g = BlockGraph(torch.zeros((2, 3), **f), torch.zeros((2, n_attrs), **f),
                       torch.zeros((2, 1), dtype=torch.int64, device=device), torch.ones((1, 3), **f))
        return len(as_tuple(wrapper.embed(g)))


@dataclasses.dataclass(frozen=True, eq=False)
class Stages:
    """The stage ops of one wrapper (JAX callables on local arrays)."""

    embed: Any
    interactions: tuple[Any, ...]
    readout: Any
    whole: Any
    n_features: int

    @classmethod
    def of(cls, wrapper: MessagePassingWrapper, *, call_path: str = "auto", device: str = "cpu") -> Stages:
        """Define the stage ops of `wrapper` (once per wrapper; they close over its weights).

        `device`: where the model's weights live ("cpu" or "cuda"), for the shape probes.
        """
        n = _n_features(wrapper, torch.device(device))
        name = wrapper.name

        def embed(pos, attrs, edges, shifts):
            return as_tuple(wrapper.embed(block_graph(pos, attrs, edges, shifts)))

        def interaction(i: int):
            def fn(pos, attrs, edges, shifts, *h):
                g = block_graph(pos, attrs, edges, shifts)
                h_new, e = wrapper.interaction(i, g, h if n > 1 else h[0])
                return (*as_tuple(h_new), e)
            return fn

        def readout(pos, attrs, edges, shifts, e_sum):
            return wrapper.node_energies(block_graph(pos, attrs, edges, shifts), e_sum)

        def whole(pos, attrs, edges, shifts):
            return node_energies_of(wrapper, block_graph(pos, attrs, edges, shifts))

        return cls(
            embed=torch_function(embed, 4, n, label=f"{name}_embed", call_path=call_path),
            interactions=tuple(
                torch_function(interaction(i), 4 + n, n + 1, label=f"{name}_interaction_{i}", call_path=call_path)
                for i in range(wrapper.n_layers)),
            readout=torch_function(readout, 5, 1, label=f"{name}_readout", call_path=call_path),
            whole=torch_function(whole, 4, 1, label=f"{name}_whole", call_path=call_path),
            n_features=n,
        )
