"""The PyTorch door's stages at static capacities, recorded and replayed as CUDA graphs (`cuda_graphs=`).

Eagerly the door runs each layout's exact rows and edges (`torch_model`), so every
layout is a new set of shapes. With graphs on it runs the JAX door's block instead:

- rows: the plan's `halo_rows` (owned, ghosts, then the padding rows at their
  parking points, attributes zero), receivers the owned capacity (per-layer
  exchange; every row with the deep halo);
- edges: the `EdgePlan`'s `edge_capacity`; an edge longer than the cutoff at these
  positions (or a padding one) becomes a padding edge, its slot's spare row to
  itself with a shift of `model_layout.padding_length` (`active_edges`, as the JAX
  door's `model_layout.active_edges`), so a model with a smooth cutoff sees exactly
  the pairs within its cutoff and the door's numbers do not change.

Each stage between exchanges is one torch function of tensors (`stages.stage_functions`:
edge features + embed + layer 0, each later layer, the last layer + node energies),
wrapped by `StageGraphs.wrap`: recorded once per set of capacities (and dtype, and
whether the strain is differentiated) and replayed from then on; a layout whose
capacities did not change replays. The refreshes between the stages run eagerly,
outside the graphs, and autograd flows through the replays' `_Replay` nodes and the
exchanges as before.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from .model_layout import padding_length
from .stages import Stages, run_stages


def uploaded(state: Any, key: tuple, device: torch.device, host: Callable[[], tuple[torch.Tensor, ...]]
             ) -> tuple[torch.Tensor, ...]:
    """`host()`'s tensors copied to `device` once per layout (kept in `state.uploaded` under `key`)."""
    hit = state.uploaded.get(key)
    if hit is None:
        hit = state.uploaded[key] = tuple(t.to(device) for t in host())
    return hit


def block_attrs(wrapper: Any, state: Any, rank: int, n_real: int, rows: int) -> np.ndarray:
    """`(rows, A)` node attributes of the rank's block: its `n_real` atoms' rows, then zero (padding) rows."""
    attrs = wrapper.node_attrs(state.numbers)[state.plan.halo_global[rank, :n_real]]
    return np.concatenate([attrs, np.zeros((rows - n_real, attrs.shape[1]), attrs.dtype)])


def capacity_inputs(state: Any, ctx: Any, wrapper: Any, device: torch.device, dtype: torch.dtype
                    ) -> tuple[torch.Tensor, ...]:
    """The layout's static block inputs at its capacities on `device`, uploaded once per layout (`state.uploaded`).

    Returns:
        `(parked, edges, shift, spare, attrs)`: the padding rows' parking points `(hr - n_real, 3)`,
        edges `(E, 2)` int32 (sender, receiver), shifts `(E, 3)`, each edge slot's spare row `(E,)`
        int32 and the node attributes `(hr, A)` (zero on padding rows), for `hr = halo_rows` and
        `E = edge_capacity`.
    """
    plan, e, rank = state.plan, state.edges, ctx.rank
    n_real, hr = ctx.n_owned + ctx.n_ghost, plan.halo_rows
    return uploaded(state, ("capacities", rank, device, dtype), device, lambda: (
        torch.tensor(plan.halo_offset[rank, n_real:hr], dtype=dtype),
        torch.as_tensor(np.ascontiguousarray(e.edges[rank]), dtype=torch.int32),
        torch.tensor(e.shift[rank], dtype=dtype),
        torch.as_tensor(np.ascontiguousarray(e.spare[rank]), dtype=torch.int32),
        torch.tensor(block_attrs(wrapper, state, rank, n_real, hr), dtype=dtype),
    ))


def within(block: torch.Tensor, senders: torch.Tensor, receivers: torch.Tensor, shift: torch.Tensor,
           cutoff: float) -> torch.Tensor:
    """`(E,)` True on the edges shorter than `cutoff` at `block`'s positions (not differentiated)."""
    with torch.no_grad():
        d = block[receivers] - block[senders] + shift
        return (d * d).sum(1) < cutoff * cutoff


def active_edges(block: torch.Tensor, edges: torch.Tensor, shift: torch.Tensor, spare: torch.Tensor,
                 cutoff: float, far: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Edges within `cutoff` at `block`'s positions kept, the others made padding edges (`(spare, spare)`, a
    shift of `far` along x); the torch twin of `model_layout.active_edges`, with no value read on the host."""
    keep = (edges[:, 0] != spare) & within(block, edges[:, 0], edges[:, 1], shift, cutoff)
    out = torch.where(keep[:, None], edges, spare[:, None])
    pad = torch.tensor([far, 0.0, 0.0], dtype=shift.dtype, device=shift.device)
    return out, torch.where(keep[:, None], shift, pad)


def graphed_node_energies(stages: Stages, block: torch.Tensor, attrs: torch.Tensor, edges: torch.Tensor,
                          shift: torch.Tensor, spare: torch.Tensor, *, skin: float, n_receivers: int | None,
                          between: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """`(hr,)` node energies of the capacity block through the recorded stages, `between` refreshing each feature
    between layers (eagerly).

    Args:
        block: `(hr, 3)` positions (strained); attrs: `(hr, A)`; edges, shift, spare: from `capacity_inputs`
            (shift strained); skin: the layout's skin (the padding edges' length); n_receivers: the owned
            capacity with per-layer exchange, None with the deep halo (the whole model as one stage).
    """
    w = stages.wrapper
    e_idx, shifts = active_edges(block, edges, shift, spare, w.cutoff, padding_length(w.cutoff, skin))
    return run_stages(stages.for_torch(n_receivers), (block, attrs, e_idx, shifts), between,
                      whole=n_receivers is None)
